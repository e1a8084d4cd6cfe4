// CPU optimizer updates over kernels/bodies/optim.h.
#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"
#include "kernels/bodies/optim.h"

namespace unetcu::kernels::cpu {

void adam_update(const TensorRef& p, const TensorRef& g, const TensorRef& m, const TensorRef& v,
                 const AdamStep& s) {
  const int64_t n = p.numel();
  UNETCU_DISPATCH_FLOAT(p.dtype(), T, {
    T* pp = p.data<T>();
    const T* gp = g.data<T>();
    T* mp = m.data<T>();
    T* vp = v.data<T>();
    const AdamCoeffs<T> c(s);
    parallel_for(n, [=](int64_t i) { kernels::adam_update(pp + i, gp[i], mp + i, vp + i, c); });
  });
}

void sgd_update(const TensorRef& p, const TensorRef& g, const TensorRef& buf, const SgdStep& s) {
  const int64_t n = p.numel();
  UNETCU_DISPATCH_FLOAT(p.dtype(), T, {
    T* pp = p.data<T>();
    const T* gp = g.data<T>();
    T* bp = buf.data<T>();
    parallel_for(n, [&](int64_t i) { kernels::sgd_update(pp + i, gp[i], bp + i, s); });
  });
}

}  // namespace unetcu::kernels::cpu
