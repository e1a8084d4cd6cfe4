// CPU nearest ×2 upsampling and channel concatenation.
#include <algorithm>

#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"
#include "kernels/bodies/elementwise.h"
#include "kernels/bodies/resample.h"

namespace unetcu::kernels::cpu {

void upsample2x_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t planes = x.dim(0) * x.dim(1), H = x.dim(2), W = x.dim(3);
  const int64_t OH = 2 * H, OW = 2 * W;
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, {
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    parallel_for(planes, [&](int64_t pl) {
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow)
          yp[(pl * OH + oh) * OW + ow] = xp[pl * H * W + upsample2x_source(oh, ow, W)];
    }, 1);
  });
}

void upsample2x_backward(const TensorRef& grad_y, const TensorRef& grad_x, double beta) {
  const int64_t planes = grad_x.dim(0) * grad_x.dim(1), H = grad_x.dim(2), W = grad_x.dim(3);
  const int64_t OW = 2 * W;
  UNETCU_DISPATCH_FLOAT(grad_x.dtype(), T, {
    const T* gy = grad_y.data<T>();
    T* gx = grad_x.data<T>();
    const T b = T(beta);
    parallel_for(planes, [&](int64_t pl) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t w = 0; w < W; ++w) {
          const T* g = gy + (pl * 2 * H + 2 * h) * OW + 2 * w;
          store(gx + (pl * H + h) * W + w, g[0] + g[1] + g[OW] + g[OW + 1], b);
        }
    }, 1);
  });
}

void concat_forward_part(const TensorRef& x, const TensorRef& y, int64_t channel_offset) {
  const int64_t N = x.dim(0), Cx = x.dim(1), Cy = y.dim(1), HW = x.dim(2) * x.dim(3);
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, {
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    parallel_for(N, [&](int64_t n) {
      std::copy(xp + n * Cx * HW, xp + (n + 1) * Cx * HW, yp + (n * Cy + channel_offset) * HW);
    }, 1);
  });
}

void concat_backward_part(const TensorRef& grad_y, const TensorRef& grad_x, int64_t channel_offset,
                          double beta) {
  const int64_t N = grad_x.dim(0), Cx = grad_x.dim(1), Cy = grad_y.dim(1);
  const int64_t HW = grad_x.dim(2) * grad_x.dim(3);
  UNETCU_DISPATCH_FLOAT(grad_x.dtype(), T, {
    const T* gy = grad_y.data<T>();
    T* gx = grad_x.data<T>();
    const T b = T(beta);
    parallel_for(N, [&](int64_t n) {
      const T* src = gy + (n * Cy + channel_offset) * HW;
      T* dst = gx + n * Cx * HW;
      for (int64_t q = 0; q < Cx * HW; ++q) store(dst + q, src[q], b);
    }, 1);
  });
}

}  // namespace unetcu::kernels::cpu
