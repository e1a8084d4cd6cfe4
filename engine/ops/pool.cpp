// max_pool2d: autograd glue. Saves the input; backward recomputes the argmax. Takes bfloat16
// and NHWC; the output (and the gradient) takes the input's dtype and format.
#include "engine/ops.h"
#include "engine/ops/op_util.h"
#include "kernels/launchers.h"

namespace unetcu {

Tensor max_pool2d(const Tensor& x, const Pool2dOptions& opt) {
  ops_detail::check_backend("max_pool2d", x, {true, true});
  check_ndim("max_pool2d", x, 4, "input");
  UNETCU_CHECK(opt.kernel_h >= 1 && opt.kernel_w >= 1 && opt.stride_h >= 1 && opt.stride_w >= 1,
               "max_pool2d: kernel and stride must be >= 1");
  UNETCU_CHECK(opt.pad_h >= 0 && 2 * opt.pad_h <= opt.kernel_h && opt.pad_w >= 0 &&
                   2 * opt.pad_w <= opt.kernel_w,
               "max_pool2d: padding must be between 0 and half the kernel");
  UNETCU_CHECK(x.numel() > 0, "max_pool2d: empty input ", shape_str(x.shape()));
  UNETCU_CHECK(x.dim(2) + 2 * opt.pad_h >= opt.kernel_h && x.dim(3) + 2 * opt.pad_w >= opt.kernel_w,
               "max_pool2d: input ", shape_str(x.shape()), " is smaller than the window");
  kernels::PoolGeometry g;
  g.H = x.dim(2), g.W = x.dim(3);
  g.kh = opt.kernel_h, g.kw = opt.kernel_w, g.sh = opt.stride_h, g.sw = opt.stride_w;
  g.ph = opt.pad_h, g.pw = opt.pad_w;
  g.OH = kernels::window_out_size(g.H, g.kh, g.sh, g.ph, 1);
  g.OW = kernels::window_out_size(g.W, g.kw, g.sw, g.pw, 1);
  Tensor y = Tensor::empty({x.dim(0), x.dim(1), g.OH, g.OW}, x.dtype(), x.device(), x.format());
  const double flops = double(y.numel()) * g.kh * g.kw, bytes = ops_detail::bytes_of({&x, &y});
  {
    ProfileRange range("max_pool2d", "op", flops, bytes);
    UNETCU_LAUNCH(x.device(), maxpool_forward, x, y, g);
  }
  if (Tape::should_record({&x})) {
    Tape::record("max_pool2d", {x}, {y}, [x, g](BackwardContext& ctx) {
      double beta;
      Tensor gx = ctx.grad_input(0, &beta);
      UNETCU_LAUNCH(x.device(), maxpool_backward, ctx.grad_output(0), x, gx, beta, g);
    }, OpCost{flops, 2 * bytes});
  }
  return y;
}

}  // namespace unetcu
