// CPU losses over kernels/bodies/loss.h. Reductions accumulate in double.
#include "kernels/cpu/parallel.h"
#include "kernels/launchers.h"
#include "kernels/bodies/loss.h"

namespace unetcu::kernels::cpu {
namespace {

template <class T>
void dice_sums_impl(const T* x, const T* t, int64_t n, double* out) {
  double inter = 0, psum = 0, tsum = 0;
#pragma omp parallel for reduction(+ : inter, psum, tsum) schedule(static) if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const double p = kernels::sigmoid_forward(x[i]);
    inter += p * t[i];
    psum += p;
    tsum += t[i];
  }
  out[0] = inter, out[1] = psum, out[2] = tsum;
}

}  // namespace

void bce_with_logits_forward(const TensorRef& logits, const TensorRef& target,
                             const TensorRef& loss) {
  const int64_t n = logits.numel();
  UNETCU_DISPATCH_FLOAT(logits.dtype(), T, {
    const T* x = logits.data<T>();
    const T* t = target.data<T>();
    const double sum =
        parallel_sum(n, [&](int64_t i) { return double(kernels::bce_with_logits(x[i], t[i])); });
    loss.data<T>()[0] = T(sum / double(n));
  });
}

void bce_with_logits_backward(const TensorRef& logits, const TensorRef& target,
                              const TensorRef& grad_loss, const TensorRef& grad_x, double beta) {
  const int64_t n = logits.numel();
  UNETCU_DISPATCH_FLOAT(logits.dtype(), T, {
    const T* x = logits.data<T>();
    const T* t = target.data<T>();
    T* g = grad_x.data<T>();
    const T s = T(double(grad_loss.data<T>()[0]) / double(n)), b = T(beta);
    parallel_for(n, [&](int64_t i) { store(g + i, s * bce_with_logits_grad(x[i], t[i]), b); });
  });
}

void dice_sums(const TensorRef& logits, const TensorRef& target, const TensorRef& sums) {
  UNETCU_DISPATCH_FLOAT(logits.dtype(), T,
                        dice_sums_impl(logits.data<T>(), target.data<T>(), logits.numel(),
                                       sums.data<double>()));
}

void dice_loss_from_sums(const TensorRef& sums, double smooth, const TensorRef& loss) {
  const double* s = sums.data<double>();
  UNETCU_DISPATCH_FLOAT(loss.dtype(), T, loss.data<T>()[0] = T(dice_loss_value(s[0], s[1] + s[2], smooth)));
}

void dice_backward(const TensorRef& logits, const TensorRef& target, const TensorRef& sums,
                   double smooth, const TensorRef& grad_loss, const TensorRef& grad_x,
                   double beta) {
  const int64_t n = logits.numel();
  const double* s = sums.data<double>();
  UNETCU_DISPATCH_FLOAT(logits.dtype(), T, {
    const T* x = logits.data<T>();
    const T* t = target.data<T>();
    T* g = grad_x.data<T>();
    const T inter = T(s[0]), card = T(s[1] + s[2]), sm = T(smooth);
    const T sc = grad_loss.data<T>()[0], b = T(beta);
    parallel_for(n, [&](int64_t i) {
      const T p = kernels::sigmoid_forward(x[i]);
      store(g + i, sc * dice_grad_logit(p, t[i], inter, card, sm), b);
    });
  });
}

}  // namespace unetcu::kernels::cpu
