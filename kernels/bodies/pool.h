// Max pooling body: one output element from its window. Padding never wins (it is -inf,
// as in PyTorch); ties go to the first element in row-major window order, so forward and
// backward (which recomputes the argmax from the input) agree.
#pragma once
#include "kernels/bodies/common.h"

namespace unetcu::kernels {

struct PoolGeometry {
  int64_t H, W, OH, OW;  // input and output plane sizes
  int kh, kw, sh, sw, ph, pw;
};

// plane: one (n, c) input plane [H, W]. Returns the flat index in the plane of the maximum.
template <class T> HD int64_t maxpool_argmax(const T* plane, const PoolGeometry& g, int64_t oh,
                                             int64_t ow) {
  int64_t best = -1;
  T best_v = T(0);
  for (int i = 0; i < g.kh; ++i) {
    int64_t ih = oh * g.sh - g.ph + i;
    if (ih < 0 || ih >= g.H) continue;
    for (int j = 0; j < g.kw; ++j) {
      int64_t iw = ow * g.sw - g.pw + j;
      if (iw < 0 || iw >= g.W) continue;
      T v = plane[ih * g.W + iw];
      // NaN propagates: a NaN beats everything, as in PyTorch.
      if (best < 0 || v > best_v || (v != v && best_v == best_v)) {
        best = ih * g.W + iw;
        best_v = v;
      }
    }
  }
  return best;
}

}  // namespace unetcu::kernels
