// CUDA nearest ×2 upsampling (bodies/resample.h), channel concatenation, and the two
// fused (upsample into the concat buffer), templated on the storage type: copies move elements
// as they are, 2×2 gradient sums are formed in the compute type (float for bfloat16) and
// rounded once. NCHW kernels walk planes and rows; NHWC kernels take one pack of channels (16
// bytes where the channel counts allow, else one value) per thread in memory order, so
// neighbouring threads move neighbouring channels of a pixel. Kernels that walk a flat index
// take their coordinates through dividers in index type I (32-bit where the tensors allow,
// bodies/divide.h): no division instruction per element.
#include "kernels/cuda/common.cuh"
#include "bodies/elementwise.h"
#include "kernels/launchers.h"
#include "bodies/resample.h"

namespace unetcu::kernels::cuda {
namespace {

// ---- NCHW ----

// y [planes, 2H, 2W] from x [planes, H, W].
// d_ow divides by 2W, d_oh by 2H.
template <class S, class I>
__global__ void upsample_forward_kernel(const S* x, S* y, I H, I W, Divider<I> d_ow, Divider<I> d_oh,
                                        I n) {
  GRID_STRIDE_I(I, i, n) {
    const I row = d_ow.div(i), ow = i - row * (2 * W);  // row = plane * 2H + oh
    const I plane = d_oh.div(row), oh = row - plane * (2 * H);
    y[i] = x[plane * H * W + upsample2x_source(oh, ow, W)];
  }
}

// d_w divides by W. Input row (plane, h) = row plane * H + h reads grad_y rows 2 * row and
// 2 * row + 1.
template <class S, class I>
__global__ void upsample_backward_kernel(const S* gy, S* gx, acc_t<S> beta, I W, Divider<I> d_w, I n) {
  GRID_STRIDE_I(I, i, n) {
    const I row = d_w.div(i), w = i - row * W, OW = 2 * W;
    const S* g_top = gy + 2 * row * OW;
    store(gx + i, upsample2x_grad_at(g_top, g_top + OW, w), beta);
  }
}

// x [N, Cx, HW] -> channels [off, off + Cx) of y [N, Cy, HW] (and back, with beta).
// d_image divides by Cx * HW (one image of x).
template <class S, class I>
__global__ void concat_forward_kernel(const S* x, S* y, Divider<I> d_image, I Cy, I off, I HW, I n) {
  GRID_STRIDE_I(I, i, n) {
    const I s = d_image.div(i), q = i - s * I(d_image.d);
    y[(s * Cy + off) * HW + q] = x[i];
  }
}
template <class S, class I>
__global__ void concat_backward_kernel(const S* gy, S* gx, acc_t<S> beta, Divider<I> d_image, I Cy,
                                       I off, I HW, I n) {
  GRID_STRIDE_I(I, i, n) {
    const I s = d_image.div(i), q = i - s * I(d_image.d);
    store(gx + i, acc_t<S>(gy[(s * Cy + off) * HW + q]), beta);
  }
}

// Fused upsample-into-concat. Grid: y over the planes n * C + c of y, x over rows, threads
// along a row (grid-stride on all three); the plane's source is worked out once per plane.
// Forward: y [N, Cx + Cs, 2H, 2W] from x [N, Cx, H, W] and skip [N, Cs, 2H, 2W].
template <class S>
__global__ void upsample_concat_forward_kernel(const S* x, const S* skip, S* y, int64_t Cx,
                                               int64_t Cs, int64_t H, int64_t W, int64_t planes) {
  const int64_t C = Cx + Cs, OH = 2 * H, OW = 2 * W;
  for (int64_t plane = blockIdx.y; plane < planes; plane += gridDim.y) {
    const int64_t n = plane / C, c = plane - n * C;
    int64_t src;
    const bool upsampled = upsample2x_concat_plane(n, c, Cx, Cs, &src);
    for (int64_t oh = blockIdx.x; oh < OH; oh += gridDim.x) {
      S* y_row = y + (plane * OH + oh) * OW;
      if (upsampled) {
        const S* x_row = x + (src * H + (oh >> 1)) * W;
        for (int64_t ow = threadIdx.x; ow < OW; ow += blockDim.x)
          y_row[ow] = upsample2x_row_at(x_row, ow);
      } else {
        const S* s_row = skip + (src * OH + oh) * OW;
        for (int64_t ow = threadIdx.x; ow < OW; ow += blockDim.x) y_row[ow] = s_row[ow];
      }
    }
  }
}

// Backward: an upsampled plane's block x row h writes grad_x row h from grad_y rows 2h, 2h + 1
// (H rows); a skip plane's block x row r copies grad_y row r (2H rows). A null gradient is
// absent: its planes do nothing.
template <class S>
__global__ void upsample_concat_backward_kernel(const S* gy, S* gx, acc_t<S> beta_x, S* gs,
                                                acc_t<S> beta_skip, int64_t Cx, int64_t Cs,
                                                int64_t H, int64_t W, int64_t planes) {
  const int64_t C = Cx + Cs, OH = 2 * H, OW = 2 * W;
  for (int64_t plane = blockIdx.y; plane < planes; plane += gridDim.y) {
    const int64_t n = plane / C, c = plane - n * C;
    int64_t dst;
    const S* g_plane = gy + plane * OH * OW;
    if (upsample2x_concat_plane(n, c, Cx, Cs, &dst)) {
      if (!gx) continue;
      for (int64_t h = blockIdx.x; h < H; h += gridDim.x) {
        const S* g_top = g_plane + 2 * h * OW;
        S* gx_row = gx + (dst * H + h) * W;
        for (int64_t w = threadIdx.x; w < W; w += blockDim.x)
          store(gx_row + w, upsample2x_grad_at(g_top, g_top + OW, w), beta_x);
      }
    } else {
      if (!gs) continue;
      for (int64_t r = blockIdx.x; r < OH; r += gridDim.x) {
        const S* g_row = g_plane + r * OW;
        S* gs_row = gs + (dst * OH + r) * OW;
        for (int64_t q = threadIdx.x; q < OW; q += blockDim.x)
          store(gs_row + q, acc_t<S>(g_row[q]), beta_skip);
      }
    }
  }
}

// ---- NHWC: [N, rows, cols, C], one pack of V channels per thread in memory order ----
//
// The kernels count in units of V consecutive channels of a pixel (a 16-byte pack where every
// channel count of the call is a multiple of V and the pointers are aligned, else V = 1: one
// value): every channel count and offset below is in units, every pointer offset the unit
// times V.

// Copies unit `from` of src to unit `to` of dst, V values as they are.
template <int V, class S, class I>
__device__ __forceinline__ void copy_unit(S* dst, I to, const S* src, I from) {
  pack_at<V>(dst + to * I(V)) = pack_at<V>(src + from * I(V));
}

// Stores the 2x2 block sums of the units at `left` and `left + step` of rows top and bottom
// (upsample2x_block_sum's order, per channel) into unit i of dst, with beta.
template <int V, class S, class I>
__device__ __forceinline__ void store_block_sums(S* dst, I i, const S* top, const S* bottom, I left,
                                                 I step, acc_t<S> beta) {
  using A = acc_t<S>;
  A a[V], b[V], c[V], d[V], out[V];
  load_pack<V>(top + left * I(V), a);
  load_pack<V>(top + (left + step) * I(V), b);
  load_pack<V>(bottom + left * I(V), c);
  load_pack<V>(bottom + (left + step) * I(V), d);
  for (int j = 0; j < V; ++j) out[j] = a[j] + b[j] + c[j] + d[j];
  store_pack<V>(dst + i * I(V), out, beta);
}

// Stores unit `from` of src into unit i of dst, with beta.
template <int V, class S, class I>
__device__ __forceinline__ void store_unit(S* dst, I i, const S* src, I from, acc_t<S> beta) {
  acc_t<S> v[V];
  load_pack<V>(src + from * I(V), v);
  store_pack<V>(dst + i * I(V), v, beta);
}

// y [N, 2H, 2W, C] from x [N, H, W, C].
// d_c divides by C, d_ow by 2W, d_oh by 2H.
template <int V, class S, class I>
__global__ void upsample_forward_nhwc_kernel(const S* x, S* y, I C, I H, I W, Divider<I> d_c,
                                             Divider<I> d_ow, Divider<I> d_oh, I n) {
  GRID_STRIDE_I(I, i, n) {
    const I pix = d_c.div(i), c = i - pix * C;
    const I row = d_ow.div(pix), ow = pix - row * (2 * W);  // row = n * 2H + oh
    const I img = d_oh.div(row), oh = row - img * (2 * H);
    copy_unit<V>(y, i, x, ((img * H + (oh >> 1)) * W + (ow >> 1)) * C + c);
  }
}

// d_c divides by C, d_w by W.
template <int V, class S, class I>
__global__ void upsample_backward_nhwc_kernel(const S* gy, S* gx, acc_t<S> beta, I C, I W,
                                              Divider<I> d_c, Divider<I> d_w, I n) {
  GRID_STRIDE_I(I, i, n) {
    const I pix = d_c.div(i), c = i - pix * C;
    const I row = d_w.div(pix), w = pix - row * W;  // row = n * H + h
    const I OWC = 2 * W * C;
    const S* g_top = gy + 2 * row * OWC * I(V);  // grad_y row 2h of image n
    store_block_sums<V>(gx, i, g_top, g_top + OWC * I(V), 2 * w * C + c, C, beta);
  }
}

// x [pixels, Cx] -> channels [off, off + Cx) of y [pixels, Cy] (and back, with beta).
// d_cx divides by Cx.
template <int V, class S, class I>
__global__ void concat_forward_nhwc_kernel(const S* x, S* y, Divider<I> d_cx, I Cy, I off, I n) {
  GRID_STRIDE_I(I, i, n) {
    const I pix = d_cx.div(i), c = i - pix * I(d_cx.d);
    copy_unit<V>(y, pix * Cy + off + c, x, i);
  }
}
template <int V, class S, class I>
__global__ void concat_backward_nhwc_kernel(const S* gy, S* gx, acc_t<S> beta, Divider<I> d_cx, I Cy,
                                            I off, I n) {
  GRID_STRIDE_I(I, i, n) {
    const I pix = d_cx.div(i), c = i - pix * I(d_cx.d);
    store_unit<V>(gx, i, gy, pix * Cy + off + c, beta);
  }
}

// y [N, 2H, 2W, Cx + Cs]: channel c < Cx of a pixel from x's source pixel, the rest from
// skip's same pixel.
// d_c divides by Cx + Cs, d_ow by 2W, d_oh by 2H.
template <int V, class S, class I>
__global__ void upsample_concat_forward_nhwc_kernel(const S* x, const S* skip, S* y, I Cx, I Cs, I H,
                                                    I W, Divider<I> d_c, Divider<I> d_ow,
                                                    Divider<I> d_oh, I n) {
  const I C = Cx + Cs;
  GRID_STRIDE_I(I, i, n) {
    const I pix = d_c.div(i), c = i - pix * C;
    if (c < Cx) {
      const I row = d_ow.div(pix), ow = pix - row * (2 * W);  // row = n * 2H + oh
      const I img = d_oh.div(row), oh = row - img * (2 * H);
      copy_unit<V>(y, i, x, ((img * H + (oh >> 1)) * W + (ow >> 1)) * Cx + c);
    } else {
      copy_unit<V>(y, i, skip, pix * Cs + (c - Cx));
    }
  }
}

// Units [0, nx) are grad_x's [N, H, W, Cx] (2×2 block sums), [nx, nx + ns) grad_skip's
// [N, 2H, 2W, Cs] (copies); an absent gradient has no units.
// d_cx divides by Cx, d_w by W, d_cs by Cs.
template <int V, class S, class I>
__global__ void upsample_concat_backward_nhwc_kernel(const S* gy, S* gx, acc_t<S> beta_x, I nx, S* gs,
                                                     acc_t<S> beta_skip, I ns, I Cx, I Cs, I W,
                                                     Divider<I> d_cx, Divider<I> d_w,
                                                     Divider<I> d_cs) {
  const I C = Cx + Cs, OWC = 2 * W * C;
  GRID_STRIDE_I(I, i, nx + ns) {
    if (i < nx) {
      const I pix = d_cx.div(i), c = i - pix * Cx;
      const I row = d_w.div(pix), w = pix - row * W;  // row = n * H + h
      const S* g_top = gy + 2 * row * OWC * I(V);
      store_block_sums<V>(gx, i, g_top, g_top + OWC * I(V), 2 * w * C + c, C, beta_x);
    } else {
      const I j = i - nx;
      const I pix = d_cs.div(j), c = j - pix * Cs;
      store_unit<V>(gs, j, gy, pix * C + Cx + c, beta_skip);
    }
  }
}

// Threads along one row: a multiple of the warp size, no more than the row needs (up to 256).
int row_threads(int64_t row) { return int(std::clamp<int64_t>((row + 31) / 32 * 32, 32, kThreads)); }
// Blocks along one axis of the grid, capped where the grid-stride loops take over.
unsigned grid_dim(int64_t n) { return unsigned(std::clamp<int64_t>(n, 1, 65535)); }

}  // namespace

void upsample2x_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t n = y.numel();
  if (n == 0) return;
  Launch l(x);
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    with_index_type(n, [&](auto index) {
      using I = decltype(index);
      const int64_t C = x.dim(1), H = x.dim(2), W = x.dim(3);
      const Divider<I> d_ow(2 * W), d_oh(2 * H);
      if (x.nhwc())
        with_pack<S>(packs_fit<S>({C}, x.data<S>(), y.data<S>()), [&](auto pack) {
          constexpr int V = decltype(pack)::value;
          upsample_forward_nhwc_kernel<V, S, I><<<blocks_for(n / V), kThreads, 0, l.stream>>>(
              x.data<S>(), y.data<S>(), I(C / V), I(H), I(W), Divider<I>(C / V), d_ow, d_oh,
              I(n / V));
        });
      else
        upsample_forward_kernel<S, I><<<blocks_for(n), kThreads, 0, l.stream>>>(
            x.data<S>(), y.data<S>(), I(H), I(W), d_ow, d_oh, I(n));
    });
  });
  CUDA_CHECK_LAUNCH(l.stream, "upsample2x_forward");
}

void upsample2x_backward(const TensorRef& grad_y, const TensorRef& grad_x, double beta) {
  const int64_t n = grad_x.numel();
  if (n == 0) return;
  Launch l(grad_x);
  UNETCU_DISPATCH_STORAGE(grad_x.dtype(), S, {
    with_index_type(grad_y.numel(), [&](auto index) {  // the kernels index grad_y (4n)
      using I = decltype(index);
      const int64_t C = grad_x.dim(1), W = grad_x.dim(3);
      if (grad_x.nhwc())
        with_pack<S>(packs_fit<S>({C}, grad_y.data<S>(), grad_x.data<S>()), [&](auto pack) {
          constexpr int V = decltype(pack)::value;
          upsample_backward_nhwc_kernel<V, S, I><<<blocks_for(n / V), kThreads, 0, l.stream>>>(
              grad_y.data<S>(), grad_x.data<S>(), acc_t<S>(beta), I(C / V), I(W),
              Divider<I>(C / V), Divider<I>(W), I(n / V));
        });
      else
        upsample_backward_kernel<S, I><<<blocks_for(n), kThreads, 0, l.stream>>>(
            grad_y.data<S>(), grad_x.data<S>(), acc_t<S>(beta), I(W), Divider<I>(W), I(n));
    });
  });
  CUDA_CHECK_LAUNCH(l.stream, "upsample2x_backward");
}

void concat_forward_part(const TensorRef& x, const TensorRef& y, int64_t channel_offset) {
  const int64_t n = x.numel();
  if (n == 0) return;
  Launch l(x);
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    with_index_type(y.numel(), [&](auto index) {
      using I = decltype(index);
      const int64_t Cx = x.dim(1), Cy = y.dim(1), HW = x.dim(2) * x.dim(3);
      if (x.nhwc())
        with_pack<S>(packs_fit<S>({Cx, Cy, channel_offset}, x.data<S>(), y.data<S>()),
                     [&](auto pack) {
          constexpr int V = decltype(pack)::value;
          concat_forward_nhwc_kernel<V, S, I><<<blocks_for(n / V), kThreads, 0, l.stream>>>(
              x.data<S>(), y.data<S>(), Divider<I>(Cx / V), I(Cy / V), I(channel_offset / V),
              I(n / V));
        });
      else
        concat_forward_kernel<S, I><<<blocks_for(n), kThreads, 0, l.stream>>>(
            x.data<S>(), y.data<S>(), Divider<I>(Cx * HW), I(Cy), I(channel_offset), I(HW), I(n));
    });
  });
  CUDA_CHECK_LAUNCH(l.stream, "concat_forward_part");
}

void concat_backward_part(const TensorRef& grad_y, const TensorRef& grad_x, int64_t channel_offset,
                          double beta) {
  const int64_t n = grad_x.numel();
  if (n == 0) return;
  Launch l(grad_x);
  UNETCU_DISPATCH_STORAGE(grad_x.dtype(), S, {
    with_index_type(grad_y.numel(), [&](auto index) {
      using I = decltype(index);
      const int64_t Cx = grad_x.dim(1), Cy = grad_y.dim(1), HW = grad_x.dim(2) * grad_x.dim(3);
      if (grad_x.nhwc())
        with_pack<S>(packs_fit<S>({Cx, Cy, channel_offset}, grad_y.data<S>(), grad_x.data<S>()),
                     [&](auto pack) {
          constexpr int V = decltype(pack)::value;
          concat_backward_nhwc_kernel<V, S, I><<<blocks_for(n / V), kThreads, 0, l.stream>>>(
              grad_y.data<S>(), grad_x.data<S>(), acc_t<S>(beta), Divider<I>(Cx / V), I(Cy / V),
              I(channel_offset / V), I(n / V));
        });
      else
        concat_backward_kernel<S, I><<<blocks_for(n), kThreads, 0, l.stream>>>(
            grad_y.data<S>(), grad_x.data<S>(), acc_t<S>(beta), Divider<I>(Cx * HW), I(Cy),
            I(channel_offset), I(HW), I(n));
    });
  });
  CUDA_CHECK_LAUNCH(l.stream, "concat_backward_part");
}

void upsample2x_concat_forward(const TensorRef& x, const TensorRef& skip, const TensorRef& y) {
  const int64_t planes = y.dim(0) * y.dim(1), OH = y.dim(2), OW = y.dim(3);
  if (y.numel() == 0) return;
  Launch l(y);
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    if (y.nhwc()) {
      with_index_type(y.numel(), [&](auto index) {
        using I = decltype(index);
        const int64_t Cx = x.dim(1), Cs = skip.dim(1), H = x.dim(2), W = x.dim(3);
        with_pack<S>(packs_fit<S>({Cx, Cs}, x.data<S>(), skip.data<S>(), y.data<S>()),
                     [&](auto pack) {
          constexpr int V = decltype(pack)::value;
          const int64_t n = y.numel() / V;
          upsample_concat_forward_nhwc_kernel<V, S, I><<<blocks_for(n), kThreads, 0, l.stream>>>(
              x.data<S>(), skip.data<S>(), y.data<S>(), I(Cx / V), I(Cs / V), I(H), I(W),
              Divider<I>((Cx + Cs) / V), Divider<I>(2 * W), Divider<I>(2 * H), I(n));
        });
      });
    } else {
      const dim3 grid(grid_dim(OH), grid_dim(planes));
      upsample_concat_forward_kernel<<<grid, row_threads(OW), 0, l.stream>>>(
          x.data<S>(), skip.data<S>(), y.data<S>(), x.dim(1), skip.dim(1), x.dim(2), x.dim(3),
          planes);
    }
  });
  CUDA_CHECK_LAUNCH(l.stream, "upsample2x_concat_forward");
}

void upsample2x_concat_backward(const TensorRef& grad_y, const TensorRef& grad_x, double beta_x,
                                const TensorRef& grad_skip, double beta_skip,
                                int64_t x_channels) {
  const int64_t planes = grad_y.dim(0) * grad_y.dim(1), OH = grad_y.dim(2), OW = grad_y.dim(3);
  const int64_t Cx = x_channels, Cs = grad_y.dim(1) - x_channels;
  if (grad_y.numel() == 0) return;
  Launch l(grad_y);
  UNETCU_DISPATCH_STORAGE(grad_y.dtype(), S, {
    S* gx = grad_x.defined() ? grad_x.data<S>() : nullptr;
    S* gs = grad_skip.defined() ? grad_skip.data<S>() : nullptr;
    if (grad_y.nhwc()) {
      const int64_t nx = gx ? grad_x.numel() : 0, ns = gs ? grad_skip.numel() : 0;
      if (nx + ns > 0)
        with_index_type(grad_y.numel(), [&](auto index) {  // nx + ns <= grad_y's elements
          using I = decltype(index);
          with_pack<S>(packs_fit<S>({Cx, Cs}, grad_y.data<S>(), gx, gs), [&](auto pack) {
            constexpr int V = decltype(pack)::value;
            upsample_concat_backward_nhwc_kernel<V, S, I>
                <<<blocks_for((nx + ns) / V), kThreads, 0, l.stream>>>(
                    grad_y.data<S>(), gx, acc_t<S>(beta_x), I(nx / V), gs, acc_t<S>(beta_skip),
                    I(ns / V), I(Cx / V), I(Cs / V), I(OW / 2), Divider<I>(Cx / V),
                    Divider<I>(OW / 2), Divider<I>(Cs / V));
          });
        });
    } else {
      const dim3 grid(grid_dim(OH), grid_dim(planes));
      upsample_concat_backward_kernel<<<grid, row_threads(OW), 0, l.stream>>>(
          grad_y.data<S>(), gx, acc_t<S>(beta_x), gs, acc_t<S>(beta_skip), Cx, Cs, OH / 2, OW / 2,
          planes);
    }
  });
  CUDA_CHECK_LAUNCH(l.stream, "upsample2x_concat_backward");
}

}  // namespace unetcu::kernels::cuda
