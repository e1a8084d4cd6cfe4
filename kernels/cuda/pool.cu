// CUDA max pooling over kernels/bodies/pool.h. Backward is a gather: each input element sums the
// gradients of the output windows whose argmax (recomputed from x) it is, so there are no
// atomics and the result is deterministic. One thread per element in memory order, in NCHW or
// NHWC (where neighbouring threads take neighbouring channels of a pixel, so reads coalesce);
// bfloat16 is compared as float and the gradient summed in float32, rounded once.
#include "kernels/cuda/common.cuh"
#include "kernels/bodies/elementwise.h"
#include "kernels/bodies/layout.h"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

// The first element of plane (n, c) of a [N, C, rows, cols] tensor and the distance between
// its pixels: 1 in NCHW, C in NHWC.
__device__ int64_t plane_base(const Dims4& d, int64_t n, int64_t c) {
  return d.nhwc ? n * d.H * d.W * d.C + c : (n * d.C + c) * d.H * d.W;
}
__device__ int64_t pixel_stride(const Dims4& d) { return d.nhwc ? d.C : 1; }

// y over its elements in memory order; the window read in x's plane of the same (n, c).
template <class S>
__global__ void maxpool_forward_kernel(const S* x, Dims4 dx, S* y, Dims4 dy, PoolGeometry g,
                                       int64_t n) {
  GRID_STRIDE(i, n) {
    int64_t nn, c, oh, ow;
    coords_of(dy, i, &nn, &c, &oh, &ow);
    const S* p = x + plane_base(dx, nn, c);
    const int64_t stride = pixel_stride(dx);
    const int64_t k = maxpool_argmax(p, g, oh, ow, stride);
    y[i] = k >= 0 ? p[k * stride] : to_storage<S>(acc_t<S>(-INFINITY));
  }
}

// grad_x over its elements in memory order: the sum of grad_y over the windows covering the
// element whose argmax it is, in output order, then written or accumulated by beta.
template <class S>
__global__ void maxpool_backward_kernel(const S* gy, Dims4 dy, const S* x, Dims4 dx, S* gx,
                                        acc_t<S> beta, PoolGeometry g, int64_t n) {
  using A = acc_t<S>;
  GRID_STRIDE(i, n) {
    int64_t nn, c, ih, iw;
    coords_of(dx, i, &nn, &c, &ih, &iw);
    const S* p = x + plane_base(dx, nn, c);
    const S* gp = gy + plane_base(dy, nn, c);
    const int64_t stride = pixel_stride(dx);  // the same in grad_y (one format)
    const int64_t self = ih * g.W + iw;
    // Output rows whose window covers ih: oh*sh - ph <= ih <= oh*sh - ph + kh - 1.
    const int64_t oh_lo = max(int64_t(0), (ih + g.ph - g.kh + g.sh) / g.sh);
    const int64_t oh_hi = min(g.OH - 1, (ih + g.ph) / g.sh);
    const int64_t ow_lo = max(int64_t(0), (iw + g.pw - g.kw + g.sw) / g.sw);
    const int64_t ow_hi = min(g.OW - 1, (iw + g.pw) / g.sw);
    A acc = 0;
    for (int64_t oh = oh_lo; oh <= oh_hi; ++oh)
      for (int64_t ow = ow_lo; ow <= ow_hi; ++ow)
        if (maxpool_argmax(p, g, oh, ow, stride) == self) acc += A(gp[(oh * g.OW + ow) * stride]);
    store(gx + i, acc, beta);
  }
}

}  // namespace

void maxpool_forward(const TensorRef& x, const TensorRef& y, const PoolGeometry& g) {
  const int64_t n = y.numel();
  if (n == 0) return;
  Launch l(x);
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    maxpool_forward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
        x.data<S>(), x.dims4(), y.data<S>(), y.dims4(), g, n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "maxpool_forward");
}

void maxpool_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& grad_x,
                      double beta, const PoolGeometry& g) {
  const int64_t n = x.numel();
  if (n == 0) return;
  Launch l(x);
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    maxpool_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
        grad_y.data<S>(), grad_y.dims4(), x.data<S>(), x.dims4(), grad_x.data<S>(),
        acc_t<S>(beta), g, n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "maxpool_backward");
}

}  // namespace unetcu::kernels::cuda
