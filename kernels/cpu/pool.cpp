// CPU max pooling over bodies/pool.h. Backward recomputes each window's argmax from the
// saved input (no index tensor is kept) and scatters: within one (n, c) plane per thread in
// NCHW, within one (image, block of channels) per thread in NHWC. Scatters add in output order
// (row by row), the same order in both formats, so NCHW and NHWC give the same bits.
//
// bfloat16: values are compared as float (exact); the backward scatters into a float32 copy of
// the thread's part of grad_x and rounds each element once at the end, so an input that wins
// several windows has its gradients summed in float32, in the same order as the float32 op.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"
#include "bodies/elementwise.h"

namespace unetcu::kernels::cpu {
namespace {

// The output rows / columns whose windows lie wholly inside the input: [lo, hi).
struct Inside {
  int64_t lo, hi;
};
Inside inside(int64_t in, int64_t out, int k, int s, int p) {
  const int64_t lo = std::min<int64_t>(out, (p + s - 1) / s);
  int64_t hi = in + p - k >= 0 ? (in + p - k) / s + 1 : 0;
  hi = std::max(lo, std::min<int64_t>(hi, out));
  return {lo, hi};
}

// The argmax of the windows of outputs [ow0, ow1) of row oh, every one wholly inside the
// plane, with column stride kSw: the window's taps are the outer loops, in the order
// maxpool_argmax_inside takes them, and the outputs the inner one, which the compiler
// vectorises (the comparisons selects). Each output compares the same taps in the same order,
// so the argmax is maxpool_argmax_inside's. Then f(oh, ow, k) in ow order.
template <int kSw, class T, class F>
void argmax_row_inside(const T* plane, const PoolGeometry& g, int64_t oh, int64_t ih0, int64_t ow0,
                       int64_t ow1, F&& f) {
  using A = acc_t<T>;
  constexpr int64_t kBlock = 64;
  A best_v[kBlock];
  int64_t best_k[kBlock];
  for (int64_t b0 = ow0; b0 < ow1; b0 += kBlock) {
    const int64_t n = std::min(kBlock, ow1 - b0);
    const int64_t k0 = ih0 * g.W + b0 * kSw - g.pw;  // tap (0, 0) of output b0
    for (int64_t j = 0; j < n; ++j) {
      best_k[j] = k0 + j * kSw;
      best_v[j] = A(plane[k0 + j * kSw]);
    }
    for (int i = 0; i < g.kh; ++i)
      for (int t = i == 0 ? 1 : 0; t < g.kw; ++t) {
        const int64_t kt = k0 + i * g.W + t;
        const T* r = plane + kt;
        for (int64_t j = 0; j < n; ++j) {
          const A v = A(r[j * kSw]);
          const bool take = pool_takes(v, best_v[j]);
          best_v[j] = take ? v : best_v[j];
          best_k[j] = take ? kt + j * kSw : best_k[j];
        }
      }
    for (int64_t j = 0; j < n; ++j) f(oh, b0 + j, best_k[j]);
  }
}

// f(oh, ow, k) for every output of an NCHW plane, in row order, k the argmax's flat index in
// the plane (-1: none).
template <class T, class F>
void for_each_argmax(const T* plane, const PoolGeometry& g, F&& f) {
  const Inside rows = inside(g.H, g.OH, g.kh, g.sh, g.ph);
  const Inside cols = inside(g.W, g.OW, g.kw, g.sw, g.pw);
  for (int64_t oh = 0; oh < g.OH; ++oh) {
    if (oh < rows.lo || oh >= rows.hi) {
      for (int64_t ow = 0; ow < g.OW; ++ow) f(oh, ow, maxpool_argmax(plane, g, oh, ow));
      continue;
    }
    for (int64_t ow = 0; ow < cols.lo; ++ow) f(oh, ow, maxpool_argmax(plane, g, oh, ow));
    const int64_t ih0 = oh * g.sh - g.ph;
    if (g.sw == 2) {
      argmax_row_inside<2>(plane, g, oh, ih0, cols.lo, cols.hi, f);
    } else if (g.sw == 1) {
      argmax_row_inside<1>(plane, g, oh, ih0, cols.lo, cols.hi, f);
    } else {
      for (int64_t ow = cols.lo; ow < cols.hi; ++ow)
        f(oh, ow, maxpool_argmax_inside(plane, g, ih0, ow * g.sw - g.pw));
    }
    for (int64_t ow = cols.hi; ow < g.OW; ++ow) f(oh, ow, maxpool_argmax(plane, g, oh, ow));
  }
}

// NHWC works on blocks of up to kChannelBlock channels of one image: per output pixel the
// window's bounds are found once and the comparisons run along the block's contiguous channels
// (a vector loop), which serves border and interior windows alike.
constexpr int64_t kChannelBlock = 64;

struct NhwcTask {
  int64_t n, c0, cb;  // image, first channel, channels in the block
};
NhwcTask nhwc_task(int64_t t, int64_t C) {
  const int64_t blocks = (C + kChannelBlock - 1) / kChannelBlock;
  const int64_t n = t / blocks, c0 = (t - n * blocks) * kChannelBlock;
  return {n, c0, std::min(kChannelBlock, C - c0)};
}

// f(oh, ow, best_v, best_k) for every output pixel of image n, channels [c0, c0 + cb) of an NHWC
// x [N, H, W, C]: best_v[j] the maximum of channel c0 + j (window order, a NaN wins), best_k[j]
// the flat pixel index ih * W + iw of its first occurrence (-1: empty window).
template <class T, bool kWantIndex, class F>
void for_each_max_nhwc(const T* x, int64_t C, const PoolGeometry& g, const NhwcTask& t, F&& f) {
  using A = acc_t<T>;
  A best_v[kChannelBlock];
  int64_t best_k[kChannelBlock];
  const T* image = x + t.n * g.H * g.W * C + t.c0;
  for (int64_t oh = 0; oh < g.OH; ++oh) {
    int64_t ih_lo, ih_hi;
    pool_window(oh, g.H, g.kh, g.sh, g.ph, &ih_lo, &ih_hi);
    for (int64_t ow = 0; ow < g.OW; ++ow) {
      int64_t iw_lo, iw_hi;
      pool_window(ow, g.W, g.kw, g.sw, g.pw, &iw_lo, &iw_hi);
      if (ih_lo >= ih_hi || iw_lo >= iw_hi) {
        for (int64_t j = 0; j < t.cb; ++j) best_v[j] = A(-INFINITY), best_k[j] = -1;
        f(oh, ow, best_v, best_k);
        continue;
      }
      const int64_t k0 = ih_lo * g.W + iw_lo;
      const T* first = image + k0 * C;
      for (int64_t j = 0; j < t.cb; ++j) {
        best_v[j] = A(first[j]);
        if (kWantIndex) best_k[j] = k0;
      }
      for (int64_t ih = ih_lo; ih < ih_hi; ++ih)
        for (int64_t iw = ih == ih_lo ? iw_lo + 1 : iw_lo; iw < iw_hi; ++iw) {
          const int64_t k = ih * g.W + iw;
          const T* px = image + k * C;
          for (int64_t j = 0; j < t.cb; ++j) {
            const A v = A(px[j]);
            const bool take = pool_takes(v, best_v[j]);
            best_v[j] = take ? v : best_v[j];
            if (kWantIndex) best_k[j] = take ? k : best_k[j];
          }
        }
      f(oh, ow, best_v, best_k);
    }
  }
}

// A float32 scratch the calling thread reuses across tasks (bfloat16 backward).
template <class A> A* thread_scratch(int64_t n) {
  thread_local std::vector<A> buffer;
  if (int64_t(buffer.size()) < n) buffer.resize(size_t(n));
  return buffer.data();
}

template <class T>
void maxpool_forward_nhwc(const T* xp, T* yp, int64_t N, int64_t C, const PoolGeometry& g) {
  const int64_t blocks = (C + kChannelBlock - 1) / kChannelBlock;
  parallel_for(N * blocks, [&](int64_t task) {
    const NhwcTask t = nhwc_task(task, C);
    T* out = yp + t.n * g.OH * g.OW * C + t.c0;
    for_each_max_nhwc<T, false>(xp, C, g, t, [&](int64_t oh, int64_t ow, const acc_t<T>* best_v,
                                                 const int64_t*) {
      T* o = out + (oh * g.OW + ow) * C;
      for (int64_t j = 0; j < t.cb; ++j) o[j] = to_storage<T>(best_v[j]);
    });
  }, 1);
}

// Scatters into acc (float64/float32: grad_x itself; bfloat16: a float32 scratch) with pixel
// stride `stride`, then rounds the scratch into grad_x.
template <class T>
void maxpool_backward_nhwc(const T* gy, const T* xp, T* gx, bool accumulate, int64_t N, int64_t C,
                           const PoolGeometry& g) {
  using A = acc_t<T>;
  constexpr bool kDirect = std::is_same<T, A>::value;
  const int64_t blocks = (C + kChannelBlock - 1) / kChannelBlock, HW = g.H * g.W;
  parallel_for(N * blocks, [&](int64_t task) {
    const NhwcTask t = nhwc_task(task, C);
    T* gx_image = gx + t.n * HW * C + t.c0;
    // acc[k * stride + j]: channel c0 + j of pixel k.
    A* acc;
    int64_t stride;
    if constexpr (kDirect) {
      acc = gx_image, stride = C;
      if (!accumulate)
        for (int64_t k = 0; k < HW; ++k) std::fill(acc + k * C, acc + k * C + t.cb, A(0));
    } else {
      acc = thread_scratch<A>(HW * t.cb), stride = t.cb;
      for (int64_t k = 0; k < HW; ++k)
        for (int64_t j = 0; j < t.cb; ++j)
          acc[k * t.cb + j] = accumulate ? A(gx_image[k * C + j]) : A(0);
    }
    const T* gy_image = gy + t.n * g.OH * g.OW * C + t.c0;
    for_each_max_nhwc<T, true>(xp, C, g, t, [&](int64_t oh, int64_t ow, const A*,
                                                const int64_t* best_k) {
      const T* go = gy_image + (oh * g.OW + ow) * C;
      for (int64_t j = 0; j < t.cb; ++j)
        if (best_k[j] >= 0) acc[best_k[j] * stride + j] += A(go[j]);
    });
    if constexpr (!kDirect)
      for (int64_t k = 0; k < HW; ++k)
        for (int64_t j = 0; j < t.cb; ++j) gx_image[k * C + j] = to_storage<T>(acc[k * t.cb + j]);
  }, 1);
}

// One (n, c) plane per task; float32 and float64 scatter into grad_x itself, bfloat16 into a
// float32 copy of the plane.
template <class T>
void maxpool_backward_nchw(const T* gy, const T* xp, T* gx, bool accumulate, int64_t planes,
                           const PoolGeometry& g) {
  using A = acc_t<T>;
  const int64_t HW = g.H * g.W;
  parallel_for(planes, [&](int64_t pl) {
    const T* plane = xp + pl * HW;
    T* gplane = gx + pl * HW;
    const T* gout = gy + pl * g.OH * g.OW;
    if constexpr (std::is_same<T, A>::value) {
      if (!accumulate)
        for (int64_t q = 0; q < HW; ++q) gplane[q] = T(0);
      for_each_argmax(plane, g, [&](int64_t oh, int64_t ow, int64_t k) {
        if (k >= 0) gplane[k] += gout[oh * g.OW + ow];
      });
    } else {
      A* acc = thread_scratch<A>(HW);
      for (int64_t q = 0; q < HW; ++q) acc[q] = accumulate ? A(gplane[q]) : A(0);
      for_each_argmax(plane, g, [&](int64_t oh, int64_t ow, int64_t k) {
        if (k >= 0) acc[k] += A(gout[oh * g.OW + ow]);
      });
      for (int64_t q = 0; q < HW; ++q) gplane[q] = to_storage<T>(acc[q]);
    }
  }, 1);
}

}  // namespace

void maxpool_forward(const TensorRef& x, const TensorRef& y, const PoolGeometry& g) {
  const Dims4 d = x.dims4();
  UNETCU_DISPATCH_STORAGE(x.dtype(), T, {
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    if (d.nhwc) {
      maxpool_forward_nhwc(xp, yp, d.N, d.C, g);
    } else {
      parallel_for(d.N * d.C, [&](int64_t pl) {
        const T* plane = xp + pl * g.H * g.W;
        T* out = yp + pl * g.OH * g.OW;
        for_each_argmax(plane, g, [&](int64_t oh, int64_t ow, int64_t k) {
          out[oh * g.OW + ow] = k >= 0 ? plane[k] : to_storage<T>(acc_t<T>(-INFINITY));
        });
      }, 1);
    }
  });
}

void maxpool_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& grad_x,
                      double beta, const PoolGeometry& g) {
  const Dims4 d = x.dims4();
  UNETCU_DISPATCH_STORAGE(x.dtype(), T, {
    const T* xp = x.data<T>();
    const T* gy = grad_y.data<T>();
    T* gx = grad_x.data<T>();
    if (d.nhwc) {
      maxpool_backward_nhwc(gy, xp, gx, beta != 0, d.N, d.C, g);
    } else {
      maxpool_backward_nchw(gy, xp, gx, beta != 0, d.N * d.C, g);
    }
  });
}

}  // namespace unetcu::kernels::cpu
