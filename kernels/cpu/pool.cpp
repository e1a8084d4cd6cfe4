// CPU max pooling over kernels/bodies/pool.h. Backward recomputes each window's argmax from the
// saved input (no index tensor is kept) and scatters within one (n, c) plane per thread.
#include <algorithm>

#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"
#include "kernels/bodies/elementwise.h"

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

// f(oh, ow, k) for every output of a plane, k the argmax's flat index in the plane (-1: none).
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
    for (int64_t ow = cols.lo; ow < cols.hi; ++ow)
      f(oh, ow, maxpool_argmax_inside(plane, g, ih0, ow * g.sw - g.pw));
    for (int64_t ow = cols.hi; ow < g.OW; ++ow) f(oh, ow, maxpool_argmax(plane, g, oh, ow));
  }
}

}  // namespace

void maxpool_forward(const TensorRef& x, const TensorRef& y, const PoolGeometry& g) {
  const int64_t planes = x.dim(0) * x.dim(1);
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, {
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    parallel_for(planes, [&](int64_t pl) {
      const T* plane = xp + pl * g.H * g.W;
      T* out = yp + pl * g.OH * g.OW;
      for_each_argmax(plane, g, [&](int64_t oh, int64_t ow, int64_t k) {
        out[oh * g.OW + ow] = k >= 0 ? plane[k] : T(-INFINITY);
      });
    }, 1);
  });
}

void maxpool_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& grad_x,
                      double beta, const PoolGeometry& g) {
  const int64_t planes = x.dim(0) * x.dim(1);
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, {
    const T* xp = x.data<T>();
    const T* gy = grad_y.data<T>();
    T* gx = grad_x.data<T>();
    parallel_for(planes, [&](int64_t pl) {
      const T* plane = xp + pl * g.H * g.W;
      T* gplane = gx + pl * g.H * g.W;
      if (beta == 0)
        for (int64_t q = 0; q < g.H * g.W; ++q) gplane[q] = T(0);
      const T* gout = gy + pl * g.OH * g.OW;
      for_each_argmax(plane, g, [&](int64_t oh, int64_t ow, int64_t k) {
        if (k >= 0) gplane[k] += gout[oh * g.OW + ow];
      });
    }, 1);
  });
}

}  // namespace unetcu::kernels::cpu
