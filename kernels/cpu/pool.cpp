// CPU max pooling over kernels/bodies/pool.h. Backward recomputes each window's argmax from the
// saved input (no index tensor is kept) and scatters within one (n, c) plane per thread.
#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"
#include "kernels/bodies/elementwise.h"

namespace unetcu::kernels::cpu {

void maxpool_forward(const TensorRef& x, const TensorRef& y, const PoolGeometry& g) {
  const int64_t planes = x.dim(0) * x.dim(1);
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, {
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    parallel_for(planes, [&](int64_t pl) {
      const T* plane = xp + pl * g.H * g.W;
      T* out = yp + pl * g.OH * g.OW;
      for (int64_t oh = 0; oh < g.OH; ++oh)
        for (int64_t ow = 0; ow < g.OW; ++ow) {
          const int64_t k = maxpool_argmax(plane, g, oh, ow);
          out[oh * g.OW + ow] = k >= 0 ? plane[k] : T(-INFINITY);
        }
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
      for (int64_t oh = 0; oh < g.OH; ++oh)
        for (int64_t ow = 0; ow < g.OW; ++ow) {
          const int64_t k = maxpool_argmax(plane, g, oh, ow);
          if (k >= 0) gplane[k] += gout[oh * g.OW + ow];
        }
    }, 1);
  });
}

}  // namespace unetcu::kernels::cpu
