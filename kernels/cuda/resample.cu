// CUDA nearest ×2 upsampling (kernels/bodies/resample.h) and channel concatenation.
#include "kernels/cuda/common.cuh"
#include "kernels/bodies/elementwise.h"
#include "kernels/launchers.h"
#include "kernels/bodies/resample.h"

namespace unetcu::kernels::cuda {
namespace {

// y [planes, 2H, 2W] from x [planes, H, W].
__global__ void upsample_forward_kernel(const float* x, float* y, int64_t H, int64_t W, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t OW = 2 * W, ow = i % OW, oh = (i / OW) % (2 * H), plane = i / (OW * 2 * H);
    y[i] = x[plane * H * W + upsample2x_source(oh, ow, W)];
  }
}

__global__ void upsample_backward_kernel(const float* gy, float* gx, float beta, int64_t H,
                                         int64_t W, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t w = i % W, h = (i / W) % H, plane = i / (W * H), OW = 2 * W;
    const float* g = gy + (plane * 2 * H + 2 * h) * OW + 2 * w;
    store(gx + i, g[0] + g[1] + g[OW] + g[OW + 1], beta);
  }
}

// x [N, Cx, HW] -> channels [off, off + Cx) of y [N, Cy, HW] (and back, with beta).
__global__ void concat_forward_kernel(const float* x, float* y, int64_t Cx, int64_t Cy,
                                      int64_t off, int64_t HW, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t q = i % (Cx * HW), s = i / (Cx * HW);
    y[(s * Cy + off) * HW + q] = x[i];
  }
}
__global__ void concat_backward_kernel(const float* gy, float* gx, float beta, int64_t Cx,
                                       int64_t Cy, int64_t off, int64_t HW, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t q = i % (Cx * HW), s = i / (Cx * HW);
    store(gx + i, gy[(s * Cy + off) * HW + q], beta);
  }
}

}  // namespace

void upsample2x_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t n = y.numel();
  Launch l(x);
  upsample_forward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(x), fdata(y), x.dim(2),
                                                                    x.dim(3), n);
  CUDA_CHECK_LAUNCH(l.stream, "upsample2x_forward");
}

void upsample2x_backward(const TensorRef& grad_y, const TensorRef& grad_x, double beta) {
  const int64_t n = grad_x.numel();
  Launch l(grad_x);
  upsample_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
      fdata(grad_y), fdata(grad_x), float(beta), grad_x.dim(2), grad_x.dim(3), n);
  CUDA_CHECK_LAUNCH(l.stream, "upsample2x_backward");
}

void concat_forward_part(const TensorRef& x, const TensorRef& y, int64_t channel_offset) {
  const int64_t n = x.numel();
  Launch l(x);
  concat_forward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
      fdata(x), fdata(y), x.dim(1), y.dim(1), channel_offset, x.dim(2) * x.dim(3), n);
  CUDA_CHECK_LAUNCH(l.stream, "concat_forward_part");
}

void concat_backward_part(const TensorRef& grad_y, const TensorRef& grad_x, int64_t channel_offset,
                          double beta) {
  const int64_t n = grad_x.numel();
  Launch l(grad_x);
  concat_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
      fdata(grad_y), fdata(grad_x), float(beta), grad_x.dim(1), grad_y.dim(1), channel_offset,
      grad_x.dim(2) * grad_x.dim(3), n);
  CUDA_CHECK_LAUNCH(l.stream, "concat_backward_part");
}

}  // namespace unetcu::kernels::cuda
