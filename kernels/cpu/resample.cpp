// CPU nearest ×2 upsampling, channel concatenation, and the two fused (upsample into the
// concat buffer).
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

// y [N, Cx + Cs, 2H, 2W]: one pass over y's planes; an upsampled plane row by row from its
// input row, a skip plane copied whole (it is contiguous in both).
void upsample2x_concat_forward(const TensorRef& x, const TensorRef& skip, const TensorRef& y) {
  const int64_t N = x.dim(0), Cx = x.dim(1), Cs = skip.dim(1), H = x.dim(2), W = x.dim(3);
  const int64_t C = Cx + Cs, OH = 2 * H, OW = 2 * W;
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, {
    const T* xp = x.data<T>();
    const T* sp = skip.data<T>();
    T* yp = y.data<T>();
    parallel_for(N * C, [&](int64_t plane) {
      const int64_t n = plane / C, c = plane - n * C;  // once per plane
      int64_t src;
      T* y_plane = yp + plane * OH * OW;
      if (upsample2x_concat_plane(n, c, Cx, Cs, &src)) {
        const T* x_plane = xp + src * H * W;
        for (int64_t oh = 0; oh < OH; ++oh) {
          const T* x_row = x_plane + (oh >> 1) * W;
          T* y_row = y_plane + oh * OW;
          for (int64_t ow = 0; ow < OW; ++ow) y_row[ow] = upsample2x_row_at(x_row, ow);
        }
      } else {
        std::copy(sp + src * OH * OW, sp + (src + 1) * OH * OW, y_plane);
      }
    }, 1);
  });
}

// One pass over grad_y's planes: an upsampled plane gives grad_x's plane (2×2 sums), a skip
// plane grad_skip's (a copy); each written or accumulated by its beta, an absent one skipped.
void upsample2x_concat_backward(const TensorRef& grad_y, const TensorRef& grad_x, double beta_x,
                                const TensorRef& grad_skip, double beta_skip,
                                int64_t x_channels) {
  const int64_t N = grad_y.dim(0), C = grad_y.dim(1), OH = grad_y.dim(2), OW = grad_y.dim(3);
  const int64_t Cx = x_channels, Cs = C - Cx, H = OH / 2, W = OW / 2;
  UNETCU_DISPATCH_FLOAT(grad_y.dtype(), T, {
    const T* gy = grad_y.data<T>();
    T* gx = grad_x.defined() ? grad_x.data<T>() : nullptr;
    T* gs = grad_skip.defined() ? grad_skip.data<T>() : nullptr;
    const T bx = T(beta_x), bs = T(beta_skip);
    parallel_for(N * C, [&](int64_t plane) {
      const int64_t n = plane / C, c = plane - n * C;  // once per plane
      int64_t dst;
      const T* g_plane = gy + plane * OH * OW;
      if (upsample2x_concat_plane(n, c, Cx, Cs, &dst)) {
        if (!gx) return;
        T* gx_plane = gx + dst * H * W;
        for (int64_t h = 0; h < H; ++h) {
          const T* g_top = g_plane + 2 * h * OW;
          T* gx_row = gx_plane + h * W;
          for (int64_t w = 0; w < W; ++w)
            store(gx_row + w, upsample2x_grad_at(g_top, g_top + OW, w), bx);
        }
      } else {
        if (!gs) return;
        T* gs_plane = gs + dst * OH * OW;
        for (int64_t q = 0; q < OH * OW; ++q) store(gs_plane + q, g_plane[q], bs);
      }
    }, 1);
  });
}

}  // namespace unetcu::kernels::cpu
