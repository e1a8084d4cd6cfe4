// conv2d: autograd glue. Gradients: weight/bias/input grads follow the tape's rule (written
// into a fresh buffer, accumulated into an existing one); the kernels take that beta.
//
// dtypes: x, w, b and y share one: float32, float64 (CPU) or bfloat16 (float32 accumulation,
// rounded once on store). Formats: x NCHW or NHWC, and y takes x's; w [O, I, KH, KW] OIHW
// (NCHW) or OHWI (NHWC, what cuDNN's channels-last tensor-core kernels read), in either case;
// b 1-D. Each gradient has its tensor's dtype and format (the tape makes them so).
#include "engine/ops.h"
#include "engine/ops/op_util.h"
#include "kernels/launchers.h"

namespace unetcu {

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dOptions& opt) {
  using namespace ops_detail;
  check_backend("conv2d", x, Accepts{true, true});
  check_ndim("conv2d", x, 4, "input");
  check_ndim("conv2d", w, 4, "weight");
  check_same_dtype_device("conv2d", x, w);
  UNETCU_CHECK(x.dim(1) == w.dim(1), "conv2d: input has ", x.dim(1), " channels but weight ",
               shape_str(w.shape()), " expects ", w.dim(1));
  UNETCU_CHECK(opt.stride_h >= 1 && opt.stride_w >= 1 && opt.pad_h >= 0 && opt.pad_w >= 0,
               "conv2d: stride must be >= 1 and padding >= 0");
  if (b.defined()) {
    check_same_dtype_device("conv2d", x, b);
    UNETCU_CHECK(b.ndim() == 1 && b.dim(0) == w.dim(0), "conv2d: bias ", shape_str(b.shape()),
                 " does not match ", w.dim(0), " output channels");
  }
  UNETCU_CHECK(x.numel() > 0, "conv2d: empty input ", shape_str(x.shape()));
  UNETCU_CHECK(x.dim(2) + 2 * opt.pad_h >= w.dim(2) && x.dim(3) + 2 * opt.pad_w >= w.dim(3),
               "conv2d: input ", shape_str(x.shape()), " with padding ", opt.pad_h, "x", opt.pad_w,
               " is smaller than the kernel ", shape_str(w.shape()));
  kernels::ConvGeometry g;
  g.N = x.dim(0), g.C = x.dim(1), g.H = x.dim(2), g.W = x.dim(3), g.O = w.dim(0);
  g.kh = int(w.dim(2)), g.kw = int(w.dim(3));
  g.sh = opt.stride_h, g.sw = opt.stride_w, g.ph = opt.pad_h, g.pw = opt.pad_w;
  g.OH = kernels::window_out_size(g.H, g.kh, g.sh, g.ph, 1);
  g.OW = kernels::window_out_size(g.W, g.kw, g.sw, g.pw, 1);
  Tensor y = Tensor::empty({g.N, g.O, g.OH, g.OW}, x.dtype(), x.device(), x.format());
  const double flops = kernels::conv2d_flops(g, b.defined());
  const double bytes = ops_detail::bytes_of({&x, &w, &b, &y});
  {
    ProfileRange range("conv2d", "op", flops, bytes);
    UNETCU_LAUNCH(x.device(), conv2d_forward, x, w, b, y, g);
  }

  if (Tape::should_record({&x, &w, &b})) {
    // The backward fills all three gradient buffers in one kernel call: they must differ.
    UNETCU_CHECK(!x.same_storage(w) && (!b.defined() || (!b.same_storage(x) && !b.same_storage(w))),
                 "conv2d: input, weight and bias must be distinct tensors");
    Tape::record("conv2d", {x, w, b}, {y}, [x, w, g](BackwardContext& ctx) {
      Tensor gx, gw, gb;
      double bx = 0, bw = 0, bb = 0;
      if (ctx.needs_grad(0)) gx = ctx.grad_input(0, &bx);
      if (ctx.needs_grad(1)) gw = ctx.grad_input(1, &bw);
      if (ctx.needs_grad(2)) gb = ctx.grad_input(2, &bb);
      UNETCU_LAUNCH(x.device(), conv2d_backward, ctx.grad_output(0), x, w, gx, bx, gw, bw, gb,
                    bb, g);
    }, OpCost{2 * flops, 2 * bytes});  // the data and the weight gradient
  }
  return y;
}

}  // namespace unetcu
