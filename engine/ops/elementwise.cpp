// relu, sigmoid, add, scale: autograd glue. Every op takes float32, float64 (CPU) and bfloat16
// in either memory format; the output takes the input's dtype and format, and the operands of
// add must agree in both.
#include "engine/ops.h"
#include "engine/ops/op_util.h"
#include "kernels/launchers.h"

namespace unetcu {

Tensor relu(const Tensor& x) {
  ops_detail::check_backend("relu", x, {true, true});
  Tensor y = ops_detail::empty_like(x);
  const double n = double(x.numel()), bytes = ops_detail::bytes_of({&x, &y});
  {
    ProfileRange range("relu", "op", n, bytes);
    UNETCU_LAUNCH(x.device(), relu_forward, x, y);
  }
  if (Tape::should_record({&x})) {
    // Saves the output, not the input: y > 0 exactly where x > 0.
    Tape::record("relu", {x}, {y}, [y = y.detach()](BackwardContext& ctx) {
      double beta;
      Tensor gx = ctx.grad_input(0, &beta);
      UNETCU_LAUNCH(y.device(), relu_backward, ctx.grad_output(0), y, gx, beta);
    }, OpCost{n, 1.5 * bytes});
  }
  return y;
}

Tensor sigmoid(const Tensor& x) {
  ops_detail::check_backend("sigmoid", x, {true, true});
  Tensor y = ops_detail::empty_like(x);
  const double n = double(x.numel()), bytes = ops_detail::bytes_of({&x, &y});
  {
    ProfileRange range("sigmoid", "op", 4 * n, bytes);
    UNETCU_LAUNCH(x.device(), sigmoid_forward, x, y);
  }
  if (Tape::should_record({&x})) {
    Tape::record("sigmoid", {x}, {y}, [y = y.detach()](BackwardContext& ctx) {
      double beta;
      Tensor gx = ctx.grad_input(0, &beta);
      UNETCU_LAUNCH(y.device(), sigmoid_backward, ctx.grad_output(0), y, gx, beta);
    }, OpCost{3 * n, 1.5 * bytes});
  }
  return y;
}

Tensor add(const Tensor& a, const Tensor& b) {
  ops_detail::check_backend("add", a, {true, true});
  check_same_dtype_device("add", a, b);
  check_same_shape("add", a, b);
  check_same_format("add", a, b);
  Tensor y = ops_detail::empty_like(a);
  const double n = double(a.numel()), bytes = ops_detail::bytes_of({&a, &b, &y});
  {
    ProfileRange range("add", "op", n, bytes);
    UNETCU_LAUNCH(a.device(), add_forward, a, b, y);
  }
  if (Tape::should_record({&a, &b})) {
    Tape::record("add", {a, b}, {y}, [](BackwardContext& ctx) {
      for (int i = 0; i < 2; ++i) {
        if (!ctx.needs_grad(i)) continue;
        double beta;
        Tensor g = ctx.grad_input(i, &beta);
        UNETCU_LAUNCH(g.device(), axpby, g, 1.0, ctx.grad_output(0), beta);
      }
    }, OpCost{2 * n, 2 * bytes});
  }
  return y;
}

Tensor scale(const Tensor& x, double alpha) {
  ops_detail::check_backend("scale", x, {true, true});
  Tensor y = ops_detail::empty_like(x);
  const double n = double(x.numel()), bytes = ops_detail::bytes_of({&x, &y});
  {
    ProfileRange range("scale", "op", n, bytes);
    UNETCU_LAUNCH(x.device(), axpby, y, alpha, x, 0.0);
  }
  if (Tape::should_record({&x})) {
    Tape::record("scale", {x}, {y}, [alpha](BackwardContext& ctx) {
      double beta;
      Tensor g = ctx.grad_input(0, &beta);
      UNETCU_LAUNCH(g.device(), axpby, g, alpha, ctx.grad_output(0), beta);
    }, OpCost{n, bytes});
  }
  return y;
}

}  // namespace unetcu
