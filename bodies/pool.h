// Max pooling body: one output element from its window. Padding never wins (it is -inf,
// as in PyTorch); ties go to the first element in row-major window order, so forward and
// backward (which recomputes the argmax from the input) agree. Values are compared in the
// compute type (float for bfloat16 storage; widening is exact, so the winner is the same).
#pragma once
#include "bodies/bf16.h"
#include "bodies/common.h"

namespace unetcu::kernels {

struct PoolGeometry {
  int64_t H, W, OH, OW;  // input and output plane sizes
  int kh, kw, sh, sw, ph, pw;
};

// Whether v replaces the running maximum best_v: larger, or a NaN over a number (a NaN beats
// everything, as in PyTorch). Ties keep the earlier element.
template <class T> HD bool pool_takes(T v, T best_v) { return v > best_v || (v != v && best_v == best_v); }

// The input rows [*lo, *hi) of output row o's window along one axis (in: input size, k, s, p:
// kernel, stride, padding), clipped to the input; the same for columns.
HD void pool_window(int64_t o, int64_t in, int k, int s, int p, int64_t* lo, int64_t* hi) {
  const int64_t start = o * s - p;
  *lo = start < 0 ? 0 : start;
  *hi = start + k > in ? in : start + k;
}

// plane: one (n, c) input plane [H, W] whose pixels lie `stride` elements apart (1 in NCHW, C
// in NHWC, where plane points at channel c of the image's first pixel). Returns the flat pixel
// index ih * W + iw of the maximum (the element is plane[index * stride]).
template <class T> HD int64_t maxpool_argmax(const T* plane, const PoolGeometry& g, int64_t oh,
                                             int64_t ow, int64_t stride = 1) {
  using A = acc_t<T>;
  int64_t best = -1;
  A best_v = A(0);
  for (int i = 0; i < g.kh; ++i) {
    int64_t ih = oh * g.sh - g.ph + i;
    if (ih < 0 || ih >= g.H) continue;
    for (int j = 0; j < g.kw; ++j) {
      int64_t iw = ow * g.sw - g.pw + j;
      if (iw < 0 || iw >= g.W) continue;
      const A v = A(plane[(ih * g.W + iw) * stride]);
      if (best < 0 || pool_takes(v, best_v)) {
        best = ih * g.W + iw;
        best_v = v;
      }
    }
  }
  return best;
}

// The same for a window wholly inside the plane, top-left at (ih0, iw0): no bounds checks and
// selects instead of branches (the comparisons are data dependent), for the CPU's interior of
// an NCHW plane.
template <class T> HD int64_t maxpool_argmax_inside(const T* plane, const PoolGeometry& g,
                                                    int64_t ih0, int64_t iw0) {
  using A = acc_t<T>;
  int64_t best = ih0 * g.W + iw0;
  A best_v = A(plane[best]);
  for (int i = 0; i < g.kh; ++i) {
    const int64_t row = (ih0 + i) * g.W + iw0;
    for (int j = i == 0 ? 1 : 0; j < g.kw; ++j) {
      const A v = A(plane[row + j]);
      const bool take = pool_takes(v, best_v);
      best = take ? row + j : best;
      best_v = take ? v : best_v;
    }
  }
  return best;
}

}  // namespace unetcu::kernels
