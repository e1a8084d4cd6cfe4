// to_device: the explicit move between devices; convert: a change of dtype or memory format
// (mixed precision, channels-last). The gradient travels back the same way.
#include "engine/ops.h"
#include "engine/ops/op_util.h"
#include "kernels/launchers.h"

namespace unetcu {

Tensor to_device(const Tensor& x, Device device) {
  UNETCU_CHECK(x.defined(), "to_device: undefined tensor");
  Tensor y;
  {
    ProfileRange range("to_device", "op", 0, double(x.nbytes()));
    y = x.to(device);
  }
  if (Tape::should_record({&x})) {
    const Device from = x.device();
    Tape::record("to_device", {x}, {y}, [from](BackwardContext& ctx) {
      double beta;
      Tensor gx = ctx.grad_input(0, &beta);
      if (beta == 0) {
        gx.copy_(ctx.grad_output(0));
      } else {
        Tensor moved = ctx.grad_output(0).to(from);
        UNETCU_LAUNCH(from, axpby, gx, 1.0, moved, 1.0);
      }
    }, OpCost{0, double(x.nbytes())});
  }
  return y;
}

Tensor convert(const Tensor& x, DType dtype, MemoryFormat format) {
  UNETCU_CHECK(x.defined(), "convert: undefined tensor");
  if (x.dtype() == dtype && x.format() == format) return x;
  UNETCU_CHECK(dtype != DType::F64 || x.device().is_cpu(), "convert: float64 on ", x.device().str());
  Tensor y = Tensor::empty(x.shape(), dtype, x.device(), format);
  {
    ProfileRange range("convert", "op", 0, double(x.nbytes() + y.nbytes()));
    UNETCU_LAUNCH(x.device(), convert, x, y, 0.0);
  }
  if (Tape::should_record({&x})) {
    Tape::record("convert", {x}, {y}, [](BackwardContext& ctx) {
      double beta;
      Tensor gx = ctx.grad_input(0, &beta);
      const Tensor& gy = ctx.grad_output(0);
      UNETCU_LAUNCH(gy.device(), convert, gy, gx, beta);
    }, OpCost{0, double(x.nbytes() + y.nbytes())});
  }
  return y;
}

}  // namespace unetcu
