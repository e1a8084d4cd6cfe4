// CUDA max pooling over kernels/bodies/pool.h. Backward is a gather: each input element sums the
// gradients of the output windows whose argmax (recomputed from x) it is, so there are no
// atomics and the result is deterministic.
#include "kernels/cuda/common.cuh"
#include "kernels/bodies/elementwise.h"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

__global__ void maxpool_forward_kernel(const float* x, float* y, PoolGeometry g, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t ow = i % g.OW, oh = (i / g.OW) % g.OH, plane = i / (g.OW * g.OH);
    const float* p = x + plane * g.H * g.W;
    const int64_t k = maxpool_argmax(p, g, oh, ow);
    y[i] = k >= 0 ? p[k] : -INFINITY;
  }
}

__global__ void maxpool_backward_kernel(const float* gy, const float* x, float* gx, float beta,
                                        PoolGeometry g, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t iw = i % g.W, ih = (i / g.W) % g.H, plane = i / (g.W * g.H);
    const float* p = x + plane * g.H * g.W;
    const float* gp = gy + plane * g.OH * g.OW;
    const int64_t self = ih * g.W + iw;
    // Output rows whose window covers ih: oh*sh - ph <= ih <= oh*sh - ph + kh - 1.
    const int64_t oh_lo = max(int64_t(0), (ih + g.ph - g.kh + g.sh) / g.sh);
    const int64_t oh_hi = min(g.OH - 1, (ih + g.ph) / g.sh);
    const int64_t ow_lo = max(int64_t(0), (iw + g.pw - g.kw + g.sw) / g.sw);
    const int64_t ow_hi = min(g.OW - 1, (iw + g.pw) / g.sw);
    float acc = 0;
    for (int64_t oh = oh_lo; oh <= oh_hi; ++oh)
      for (int64_t ow = ow_lo; ow <= ow_hi; ++ow)
        if (maxpool_argmax(p, g, oh, ow) == self) acc += gp[oh * g.OW + ow];
    store(gx + i, acc, beta);
  }
}

}  // namespace

void maxpool_forward(const TensorRef& x, const TensorRef& y, const PoolGeometry& g) {
  const int64_t n = y.numel();
  Launch l(x);
  maxpool_forward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(x), fdata(y), g, n);
  CUDA_CHECK_LAUNCH(l.stream, "maxpool_forward");
}

void maxpool_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& grad_x,
                      double beta, const PoolGeometry& g) {
  const int64_t n = x.numel();
  Launch l(x);
  maxpool_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
      fdata(grad_y), fdata(x), fdata(grad_x), float(beta), g, n);
  CUDA_CHECK_LAUNCH(l.stream, "maxpool_backward");
}

}  // namespace unetcu::kernels::cuda
