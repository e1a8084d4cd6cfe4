// CPU nearest ×2 upsampling, channel concatenation, and the two fused (upsample into the
// concat buffer), in NCHW (walks over (n, c) planes) and NHWC (walks over rows of pixels, each
// pixel's channels contiguous). Copies move elements as they are (exact in any dtype); the 2×2
// gradient sums are formed in the compute type and rounded once.
#include <algorithm>

#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"
#include "bodies/elementwise.h"
#include "bodies/resample.h"

namespace unetcu::kernels::cpu {

void upsample2x_forward(const TensorRef& x, const TensorRef& y) {
  const Dims4 d = x.dims4();
  const int64_t H = d.H, W = d.W, C = d.C, OH = 2 * H, OW = 2 * W;
  UNETCU_DISPATCH_STORAGE(x.dtype(), T, {
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    if (d.nhwc) {
      // One output row [2W, C] per iteration: each pixel copies its source pixel's C values.
      parallel_for(d.N * OH, [&](int64_t row) {
        const int64_t n = row / OH, oh = row - n * OH;
        const T* x_row = xp + (n * H + (oh >> 1)) * W * C;
        T* y_row = yp + row * OW * C;
        for (int64_t ow = 0; ow < OW; ++ow)
          std::copy(x_row + (ow >> 1) * C, x_row + ((ow >> 1) + 1) * C, y_row + ow * C);
      }, 1);
    } else {
      parallel_for(d.N * C, [&](int64_t pl) {
        for (int64_t oh = 0; oh < OH; ++oh)
          for (int64_t ow = 0; ow < OW; ++ow)
            yp[(pl * OH + oh) * OW + ow] = xp[pl * H * W + upsample2x_source(oh, ow, W)];
      }, 1);
    }
  });
}

void upsample2x_backward(const TensorRef& grad_y, const TensorRef& grad_x, double beta) {
  const Dims4 d = grad_x.dims4();
  const int64_t H = d.H, W = d.W, C = d.C, OW = 2 * W;
  UNETCU_DISPATCH_STORAGE(grad_x.dtype(), T, {
    const T* gy = grad_y.data<T>();
    T* gx = grad_x.data<T>();
    const acc_t<T> b = acc_t<T>(beta);
    if (d.nhwc) {
      // One input row [W, C] per iteration, from output rows 2h and 2h + 1.
      parallel_for(d.N * H, [&](int64_t row) {
        const T* g_top = gy + 2 * row * OW * C;
        const T* g_bottom = g_top + OW * C;
        T* gx_row = gx + row * W * C;
        for (int64_t w = 0; w < W; ++w) {
          const T* top = g_top + 2 * w * C;  // the right neighbour is C elements on
          const T* bottom = g_bottom + 2 * w * C;
          T* dst = gx_row + w * C;
          if (b == acc_t<T>(0))  // the beta test outside the channel loop, which vectorises
            for (int64_t c = 0; c < C; ++c)
              dst[c] = to_storage<T>(upsample2x_block_sum(top, bottom, c, C));
          else
            for (int64_t c = 0; c < C; ++c)
              dst[c] = to_storage<T>(acc_t<T>(dst[c]) + upsample2x_block_sum(top, bottom, c, C));
        }
      }, 1);
    } else {
      parallel_for(d.N * C, [&](int64_t pl) {
        for (int64_t h = 0; h < H; ++h) {
          const T* g_top = gy + (pl * 2 * H + 2 * h) * OW;
          for (int64_t w = 0; w < W; ++w)
            store(gx + (pl * H + h) * W + w, upsample2x_grad_at(g_top, g_top + OW, w), b);
        }
      }, 1);
    }
  });
}

void concat_forward_part(const TensorRef& x, const TensorRef& y, int64_t channel_offset) {
  const Dims4 d = x.dims4();
  const int64_t N = d.N, Cx = d.C, Cy = y.dim(1), HW = d.H * d.W;
  UNETCU_DISPATCH_STORAGE(x.dtype(), T, {
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    if (d.nhwc) {
      // Pixel p's Cx values land at channels [offset, offset + Cx) of y's pixel p.
      parallel_for(N * HW, [&](int64_t p) {
        std::copy(xp + p * Cx, xp + (p + 1) * Cx, yp + p * Cy + channel_offset);
      }, kParallelGrain / std::max<int64_t>(Cx, 1));
    } else {
      parallel_for(N, [&](int64_t n) {
        std::copy(xp + n * Cx * HW, xp + (n + 1) * Cx * HW, yp + (n * Cy + channel_offset) * HW);
      }, 1);
    }
  });
}

void concat_backward_part(const TensorRef& grad_y, const TensorRef& grad_x, int64_t channel_offset,
                          double beta) {
  const Dims4 d = grad_x.dims4();
  const int64_t N = d.N, Cx = d.C, Cy = grad_y.dim(1), HW = d.H * d.W;
  UNETCU_DISPATCH_STORAGE(grad_x.dtype(), T, {
    using A = acc_t<T>;
    const T* gy = grad_y.data<T>();
    T* gx = grad_x.data<T>();
    const A b = A(beta);
    if (d.nhwc) {
      parallel_for(N * HW, [&](int64_t p) {
        const T* src = gy + p * Cy + channel_offset;
        T* dst = gx + p * Cx;
        for (int64_t c = 0; c < Cx; ++c) store(dst + c, A(src[c]), b);
      }, kParallelGrain / std::max<int64_t>(Cx, 1));
    } else {
      parallel_for(N, [&](int64_t n) {
        const T* src = gy + (n * Cy + channel_offset) * HW;
        T* dst = gx + n * Cx * HW;
        for (int64_t q = 0; q < Cx * HW; ++q) store(dst + q, A(src[q]), b);
      }, 1);
    }
  });
}

// y [N, Cx + Cs, 2H, 2W]. NCHW: one pass over y's planes; an upsampled plane row by row from
// its input row, a skip plane copied whole (it is contiguous in both). NHWC: one pass over y's
// rows; each pixel takes its source pixel's Cx values of x, then its own Cs values of skip.
void upsample2x_concat_forward(const TensorRef& x, const TensorRef& skip, const TensorRef& y) {
  const Dims4 d = x.dims4();
  const int64_t N = d.N, Cx = d.C, Cs = skip.dim(1), H = d.H, W = d.W;
  const int64_t C = Cx + Cs, OH = 2 * H, OW = 2 * W;
  UNETCU_DISPATCH_STORAGE(x.dtype(), T, {
    const T* xp = x.data<T>();
    const T* sp = skip.data<T>();
    T* yp = y.data<T>();
    if (d.nhwc) {
      parallel_for(N * OH, [&](int64_t row) {
        const int64_t n = row / OH, oh = row - n * OH;
        const T* x_row = xp + (n * H + (oh >> 1)) * W * Cx;
        const T* s_row = sp + row * OW * Cs;
        T* y_row = yp + row * OW * C;
        for (int64_t ow = 0; ow < OW; ++ow) {
          const T* x_px = x_row + (ow >> 1) * Cx;
          T* y_px = y_row + ow * C;
          std::copy(x_px, x_px + Cx, y_px);
          std::copy(s_row + ow * Cs, s_row + (ow + 1) * Cs, y_px + Cx);
        }
      }, 1);
      return;
    }
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

// One pass over grad_y: an upsampled part gives grad_x (2×2 sums), a skip part grad_skip (a
// copy); each written or accumulated by its beta, an absent one skipped. NCHW by planes of
// grad_y; NHWC by pairs of grad_y rows (2h, 2h + 1), which make grad_x's row h and grad_skip's
// rows 2h and 2h + 1.
void upsample2x_concat_backward(const TensorRef& grad_y, const TensorRef& grad_x, double beta_x,
                                const TensorRef& grad_skip, double beta_skip,
                                int64_t x_channels) {
  const Dims4 d = grad_y.dims4();
  const int64_t N = d.N, C = d.C, OH = d.H, OW = d.W;
  const int64_t Cx = x_channels, Cs = C - Cx, H = OH / 2, W = OW / 2;
  UNETCU_DISPATCH_STORAGE(grad_y.dtype(), T, {
    using A = acc_t<T>;
    const T* gy = grad_y.data<T>();
    T* gx = grad_x.defined() ? grad_x.data<T>() : nullptr;
    T* gs = grad_skip.defined() ? grad_skip.data<T>() : nullptr;
    const A bx = A(beta_x), bs = A(beta_skip);
    if (d.nhwc) {
      parallel_for(N * H, [&](int64_t pair) {
        const T* g_top = gy + 2 * pair * OW * C;  // row 2h of image n: (n * OH + 2h) = 2 * pair
        const T* g_bottom = g_top + OW * C;
        T* gx_row = gx ? gx + pair * W * Cx : nullptr;
        T* gs_top = gs ? gs + 2 * pair * OW * Cs : nullptr;  // grad_skip rows 2h, 2h + 1
        T* gs_bottom = gs ? gs_top + OW * Cs : nullptr;
        // Skip channels of one grad_y pixel into grad_skip's pixel: a plain copy when written
        // (exact in any dtype), else summed in the compute type.
        auto skip_pixel = [&](const T* src, T* dst) {
          if (bs == A(0))
            std::copy(src + Cx, src + C, dst);
          else
            for (int64_t c = 0; c < Cs; ++c) dst[c] = to_storage<T>(A(dst[c]) + A(src[Cx + c]));
        };
        // Input column w: the 2×2 block of grad_y pixels (2w, 2w + 1 of rows 2h, 2h + 1), each
        // read once, whole: its first Cx channels summed into grad_x, the rest copied.
        for (int64_t w = 0; w < W; ++w) {
          const T* top = g_top + 2 * w * C;  // the right neighbour is C elements on
          const T* bottom = g_bottom + 2 * w * C;
          if (gx_row) {
            T* dst = gx_row + w * Cx;
            if (bx == A(0))  // the beta test outside the channel loop, which then vectorises
              for (int64_t c = 0; c < Cx; ++c)
                dst[c] = to_storage<T>(upsample2x_block_sum(top, bottom, c, C));
            else
              for (int64_t c = 0; c < Cx; ++c)
                dst[c] = to_storage<T>(A(dst[c]) + upsample2x_block_sum(top, bottom, c, C));
          }
          if (gs_top) {
            skip_pixel(top, gs_top + 2 * w * Cs);
            skip_pixel(top + C, gs_top + (2 * w + 1) * Cs);
            skip_pixel(bottom, gs_bottom + 2 * w * Cs);
            skip_pixel(bottom + C, gs_bottom + (2 * w + 1) * Cs);
          }
        }
      }, 1);
      return;
    }
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
        for (int64_t q = 0; q < OH * OW; ++q) store(gs_plane + q, A(g_plane[q]), bs);
      }
    }, 1);
  });
}

}  // namespace unetcu::kernels::cpu
