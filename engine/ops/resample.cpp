// upsample_nearest2x, concat_channels and upsample_nearest2x_concat: autograd glue. They take
// bfloat16 and NHWC; the output takes the (first) input's dtype and format, and all inputs
// must agree in both.
#include "engine/ops.h"
#include "engine/ops/op_util.h"
#include "kernels/launchers.h"

namespace unetcu {

Tensor upsample_nearest2x(const Tensor& x) {
  ops_detail::check_backend("upsample_nearest2x", x, {true, true});
  check_ndim("upsample_nearest2x", x, 4, "input");
  Tensor y = Tensor::empty({x.dim(0), x.dim(1), 2 * x.dim(2), 2 * x.dim(3)}, x.dtype(), x.device(),
                           x.format());
  const double bytes = ops_detail::bytes_of({&x, &y});
  {
    ProfileRange range("upsample_nearest2x", "op", 0, bytes);
    UNETCU_LAUNCH(x.device(), upsample2x_forward, x, y);
  }
  if (Tape::should_record({&x})) {
    Tape::record("upsample_nearest2x", {x}, {y}, [](BackwardContext& ctx) {
      double beta;
      Tensor gx = ctx.grad_input(0, &beta);
      UNETCU_LAUNCH(gx.device(), upsample2x_backward, ctx.grad_output(0), gx, beta);
    }, OpCost{3.0 * double(x.numel()), bytes});
  }
  return y;
}

Tensor concat_channels(const std::vector<Tensor>& xs) {
  UNETCU_CHECK(!xs.empty(), "concat_channels: no inputs");
  const Tensor& x0 = xs[0];
  ops_detail::check_backend("concat_channels", x0, {true, true});
  int64_t C = 0;
  for (const Tensor& x : xs) {
    check_ndim("concat_channels", x, 4, "input");
    check_same_dtype_device("concat_channels", x0, x);
    check_same_format("concat_channels", x0, x);
    UNETCU_CHECK(x.dim(0) == x0.dim(0) && x.dim(2) == x0.dim(2) && x.dim(3) == x0.dim(3),
                 "concat_channels: shapes ", shape_str(x0.shape()), " and ", shape_str(x.shape()),
                 " differ outside the channel dimension");
    C += x.dim(1);
  }
  Tensor y = Tensor::empty({x0.dim(0), C, x0.dim(2), x0.dim(3)}, x0.dtype(), x0.device(),
                           x0.format());
  std::vector<int64_t> offsets;
  int64_t off = 0;
  const double bytes = 2 * ops_detail::bytes_of({&y});
  ProfileRange range("concat_channels", "op", 0, bytes);
  for (const Tensor& x : xs) {
    offsets.push_back(off);
    UNETCU_LAUNCH(x.device(), concat_forward_part, x, y, off);
    off += x.dim(1);
  }
  if (Tape::should_record(xs)) {
    Tape::record("concat_channels", xs, {y}, [offsets](BackwardContext& ctx) {
      for (size_t i = 0; i < offsets.size(); ++i) {
        if (!ctx.needs_grad(int(i))) continue;
        double beta;
        Tensor g = ctx.grad_input(int(i), &beta);
        UNETCU_LAUNCH(g.device(), concat_backward_part, ctx.grad_output(0), g, offsets[i], beta);
      }
    }, OpCost{0, bytes});
  }
  return y;
}

// SMP's decoder input in one op: the ×2 upsample of x lands in channels [0, Cx) of the concat
// buffer, skip in [Cx, Cx + Cs); no intermediate upsampled tensor, one pass each way. x and
// skip differ in height (H vs 2H), so they are never the same tensor and both gradient buffers
// may be held at once.
Tensor upsample_nearest2x_concat(const Tensor& x, const Tensor& skip) {
  ops_detail::check_backend("upsample_nearest2x_concat", x, {true, true});
  check_ndim("upsample_nearest2x_concat", x, 4, "input");
  check_ndim("upsample_nearest2x_concat", skip, 4, "skip");
  check_same_dtype_device("upsample_nearest2x_concat", x, skip);
  check_same_format("upsample_nearest2x_concat", x, skip);
  UNETCU_CHECK(skip.dim(0) == x.dim(0) && skip.dim(2) == 2 * x.dim(2) &&
                   skip.dim(3) == 2 * x.dim(3),
               "upsample_nearest2x_concat: skip ", shape_str(skip.shape()),
               " is not the ×2 upsample of input ", shape_str(x.shape()),
               " outside the channel dimension");
  UNETCU_CHECK(x.dim(2) > 0 && x.dim(3) > 0, "upsample_nearest2x_concat: empty input ",
               shape_str(x.shape()));
  const int64_t Cx = x.dim(1);
  Tensor y = Tensor::empty({x.dim(0), Cx + skip.dim(1), skip.dim(2), skip.dim(3)}, x.dtype(),
                           x.device(), x.format());
  const double bytes = ops_detail::bytes_of({&x, &skip, &y});
  {
    ProfileRange range("upsample_nearest2x_concat", "op", 0, bytes);
    UNETCU_LAUNCH(x.device(), upsample2x_concat_forward, x, skip, y);
  }
  if (Tape::should_record({&x, &skip})) {
    Tape::record("upsample_nearest2x_concat", {x, skip}, {y}, [Cx](BackwardContext& ctx) {
      double beta_x = 0, beta_skip = 0;
      Tensor gx, gs;
      if (ctx.needs_grad(0)) gx = ctx.grad_input(0, &beta_x);
      if (ctx.needs_grad(1)) gs = ctx.grad_input(1, &beta_skip);
      const Tensor& gy = ctx.grad_output(0);
      UNETCU_LAUNCH(gy.device(), upsample2x_concat_backward, gy, gx, beta_x, gs, beta_skip, Cx);
    }, OpCost{3.0 * double(x.numel()), bytes});
  }
  return y;
}

}  // namespace unetcu
