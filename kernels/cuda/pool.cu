// CUDA max pooling over bodies/pool.h, with 32-bit index math and dividers where the
// tensors allow (bodies/divide.h). Backward is a gather: each input element sums the
// gradients of the output windows whose argmax (recomputed from x) it is, so there are no
// atomics and the result is deterministic. One thread per element in memory order, in NCHW or
// NHWC (where neighbouring threads take neighbouring channels of a pixel, so reads coalesce);
// bfloat16 is compared as float and the gradient summed in float32, rounded once. NHWC tensors
// whose channels hold whole 16-byte packs move a pack per thread access.
#include "kernels/cuda/common.cuh"
#include "bodies/elementwise.h"
#include "bodies/layout.h"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

// The first element of plane (n, c) of a [N, C, rows, cols] tensor and the distance between
// its pixels: 1 in NCHW, C in NHWC. Index type I: see with_index_type.
template <class I>
__device__ I plane_base(const Dims4Div<I>& d, I n, I c) {
  const I C = I(d.C.d), H = I(d.H.d), W = I(d.W.d);
  return d.nhwc ? n * H * W * C + c : (n * C + c) * H * W;
}
template <class I>
__device__ I pixel_stride(const Dims4Div<I>& d) { return d.nhwc ? I(d.C.d) : I(1); }

// y over its elements in memory order; the window read in x's plane of the same (n, c).
template <class S, class I>
__global__ void maxpool_forward_kernel(const S* x, Dims4Div<I> dx, S* y, Dims4Div<I> dy, PoolGeometry g,
                                       I n) {
  GRID_STRIDE_I(I, i, n) {
    I nn, c, oh, ow;
    coords_of(dy, i, &nn, &c, &oh, &ow);
    const S* p = x + plane_base(dx, nn, c);
    const int64_t stride = pixel_stride(dx);
    const int64_t k = maxpool_argmax(p, g, oh, ow, stride);
    y[i] = k >= 0 ? p[k * stride] : to_storage<S>(acc_t<S>(-INFINITY));
  }
}

// The output positions whose windows cover input pixel (ih, iw): rows [oh_lo, oh_hi], columns
// [ow_lo, ow_hi] (empty where lo > hi). Along rows, oh*sh - ph <= ih <= oh*sh - ph + kh - 1, so
// oh >= ceil((ih + ph - kh + 1) / sh) = floor((ih + ph - kh + sh) / sh) (0 when negative) and
// oh <= floor((ih + ph) / sh); columns alike. The divisions by the strides go through
// dividers.
struct Covering {
  int64_t oh_lo, oh_hi, ow_lo, ow_hi;
};
template <class I>
__device__ Covering covering(I ih, I iw, const PoolGeometry& g, const Divider<I>& sh,
                             const Divider<I>& sw) {
  const int64_t lo_h = int64_t(ih) + g.ph - g.kh + g.sh, lo_w = int64_t(iw) + g.pw - g.kw + g.sw;
  Covering r;
  r.oh_lo = lo_h < 0 ? 0 : int64_t(sh.div(I(lo_h)));
  r.oh_hi = min(g.OH - 1, int64_t(sh.div(I(int64_t(ih) + g.ph))));
  r.ow_lo = lo_w < 0 ? 0 : int64_t(sw.div(I(lo_w)));
  r.ow_hi = min(g.OW - 1, int64_t(sw.div(I(int64_t(iw) + g.pw))));
  return r;
}

// grad_x over its elements in memory order: the sum of grad_y over the windows covering the
// element whose argmax it is, in output order, then written or accumulated by beta. The
// window bounds divide by the strides through dividers (sh, sw).
template <class S, class I>
__global__ void maxpool_backward_kernel(const S* gy, Dims4Div<I> dy, const S* x, Dims4Div<I> dx, S* gx,
                                        acc_t<S> beta, PoolGeometry g, Divider<I> sh, Divider<I> sw,
                                        I n) {
  using A = acc_t<S>;
  GRID_STRIDE_I(I, i, n) {
    I nn, c, ih, iw;
    coords_of(dx, i, &nn, &c, &ih, &iw);
    const S* p = x + plane_base(dx, nn, c);
    const S* gp = gy + plane_base(dy, nn, c);
    const int64_t stride = pixel_stride(dx);  // the same in grad_y (one format)
    const int64_t self = int64_t(ih) * g.W + int64_t(iw);
    const Covering r = covering(ih, iw, g, sh, sw);
    // Accumulating, the sum starts from grad_x's value, as the CPU's scatter adds each window
    // onto it: the same float additions in the same order, so both backends agree bit for bit.
    A acc = beta == A(0) ? A(0) : A(gx[i]);
    for (int64_t oh = r.oh_lo; oh <= r.oh_hi; ++oh)
      for (int64_t ow = r.ow_lo; ow <= r.ow_hi; ++ow)
        if (maxpool_argmax(p, g, oh, ow, stride) == self) acc += A(gp[(oh * g.OW + ow) * stride]);
    gx[i] = to_storage<S>(acc);
  }
}

// ---- NHWC in 16-byte packs ----------------------------------------------------------------
//
// A thread unit holds V consecutive channels of one pixel (C a multiple of V, every pointer
// aligned to a pack): each window pixel is one pack load instead of V scalar ones. Per channel
// the comparisons are maxpool_argmax's in its order, so the winners (and every bit of the
// results) are the scalar kernels'.

// The maxima of V channels over output (oh, ow)'s window: at[l] the flat pixel index of
// channel l's winner (-1 where the window holds no input pixel), value its stored value.
template <int V, class S> struct PackMax {
  int64_t at[V];
  Pack<S, V> value;
};

// p: the first of the V channels at the image's first pixel; pixels lie C elements apart.
template <int V, class S>
__device__ PackMax<V, S> pack_argmax(const S* p, const PoolGeometry& g, int64_t oh, int64_t ow,
                                     int64_t C) {
  using A = acc_t<S>;
  PackMax<V, S> m;
  A best[V];
  for (int l = 0; l < V; ++l) {
    m.at[l] = -1;
    best[l] = A(-INFINITY);
    m.value.v[l] = to_storage<S>(best[l]);
  }
  for (int i = 0; i < g.kh; ++i) {
    const int64_t ih = oh * g.sh - g.ph + i;
    if (ih < 0 || ih >= g.H) continue;
    for (int j = 0; j < g.kw; ++j) {
      const int64_t iw = ow * g.sw - g.pw + j;
      if (iw < 0 || iw >= g.W) continue;
      const int64_t k = ih * g.W + iw;
      const Pack<S, V> pk = pack_at<V>(p + k * C);
      for (int l = 0; l < V; ++l) {
        const A v = A(pk.v[l]);
        if (m.at[l] < 0 || pool_takes(v, best[l])) {
          m.at[l] = k;
          best[l] = v;
          m.value.v[l] = pk.v[l];
        }
      }
    }
  }
  return m;
}

// y in units of V channels; du: y's dims with C counted in units.
template <int V, class S, class I>
__global__ void maxpool_forward_nhwc_kernel(const S* x, S* y, Dims4Div<I> du, PoolGeometry g,
                                            int64_t C, I n) {
  GRID_STRIDE_I(I, i, n) {
    I nn, cu, oh, ow;
    coords_of(du, i, &nn, &cu, &oh, &ow);
    const S* p = x + int64_t(nn) * g.H * g.W * C + int64_t(cu) * V;
    pack_at<V>(y + int64_t(i) * V) = pack_argmax<V>(p, g, oh, ow, C).value;
  }
}

// grad_x in units of V channels (du: x's dims with C in units), as maxpool_backward_kernel per
// channel: a window's gradient pack is read only when one of its V winners is this pixel.
template <int V, class S, class I>
__global__ void maxpool_backward_nhwc_kernel(const S* gy, const S* x, S* gx, acc_t<S> beta,
                                             Dims4Div<I> du, PoolGeometry g, int64_t C,
                                             Divider<I> sh, Divider<I> sw, I n) {
  using A = acc_t<S>;
  GRID_STRIDE_I(I, i, n) {
    I nn, cu, ih, iw;
    coords_of(du, i, &nn, &cu, &ih, &iw);
    const S* p = x + int64_t(nn) * g.H * g.W * C + int64_t(cu) * V;
    const S* gp = gy + int64_t(nn) * g.OH * g.OW * C + int64_t(cu) * V;
    const int64_t self = int64_t(ih) * g.W + int64_t(iw);
    const Covering r = covering(ih, iw, g, sh, sw);
    A acc[V];
    if (beta == A(0))
      for (int l = 0; l < V; ++l) acc[l] = A(0);
    else
      load_pack<V>(gx + int64_t(i) * V, acc);
    for (int64_t oh = r.oh_lo; oh <= r.oh_hi; ++oh)
      for (int64_t ow = r.ow_lo; ow <= r.ow_hi; ++ow) {
        const PackMax<V, S> m = pack_argmax<V>(p, g, oh, ow, C);
        bool hit = false;
        for (int l = 0; l < V; ++l) hit = hit || m.at[l] == self;
        if (!hit) continue;
        A d[V];
        load_pack<V>(gp + (oh * g.OW + ow) * C, d);
        for (int l = 0; l < V; ++l)
          if (m.at[l] == self) acc[l] += d[l];
      }
    store_pack<V>(gx + int64_t(i) * V, acc);
  }
}

// dims with the channels counted in units of V.
Dims4 in_units(Dims4 d, int V) {
  d.C /= V;
  return d;
}

}  // namespace

void maxpool_forward(const TensorRef& x, const TensorRef& y, const PoolGeometry& g) {
  const int64_t n = y.numel();
  if (n == 0) return;
  Launch l(x);
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    with_index_type(std::max(x.numel(), n), [&](auto index) {
      using I = decltype(index);
      const int64_t C = x.dim(1);
      constexpr int V = kPack<S>;
      if (x.nhwc() && y.nhwc() && packs_fit<S>({C}, x.data<S>(), y.data<S>()))
        maxpool_forward_nhwc_kernel<V, S, I><<<blocks_for(n / V), kThreads, 0, l.stream>>>(
            x.data<S>(), y.data<S>(), Dims4Div<I>(in_units(y.dims4(), V)), g, C, I(n / V));
      else
        maxpool_forward_kernel<S, I><<<blocks_for(n), kThreads, 0, l.stream>>>(
            x.data<S>(), Dims4Div<I>(x.dims4()), y.data<S>(), Dims4Div<I>(y.dims4()), g, I(n));
    });
  });
  CUDA_CHECK_LAUNCH(l.stream, "maxpool_forward");
}

void maxpool_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& grad_x,
                      double beta, const PoolGeometry& g) {
  const int64_t n = x.numel();
  if (n == 0) return;
  Launch l(x);
  // Window bounds reach (H + ph) / sh: within the index range too.
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    with_index_type(std::max({n, grad_y.numel(), g.H + g.ph + g.sh, g.W + g.pw + g.sw}), [&](auto index) {
      using I = decltype(index);
      const int64_t C = x.dim(1);
      constexpr int V = kPack<S>;
      if (x.nhwc() && grad_y.nhwc() && grad_x.nhwc() &&
          packs_fit<S>({C}, grad_y.data<S>(), x.data<S>(), grad_x.data<S>()))
        maxpool_backward_nhwc_kernel<V, S, I><<<blocks_for(n / V), kThreads, 0, l.stream>>>(
            grad_y.data<S>(), x.data<S>(), grad_x.data<S>(), acc_t<S>(beta),
            Dims4Div<I>(in_units(x.dims4(), V)), g, C, Divider<I>(g.sh), Divider<I>(g.sw),
            I(n / V));
      else
        maxpool_backward_kernel<S, I><<<blocks_for(n), kThreads, 0, l.stream>>>(
            grad_y.data<S>(), Dims4Div<I>(grad_y.dims4()), x.data<S>(), Dims4Div<I>(x.dims4()),
            grad_x.data<S>(), acc_t<S>(beta), g, Divider<I>(g.sh), Divider<I>(g.sw), I(n));
    });
  });
  CUDA_CHECK_LAUNCH(l.stream, "maxpool_backward");
}

}  // namespace unetcu::kernels::cuda
