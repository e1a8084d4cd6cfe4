// CPU losses over kernels/loss.h. Reductions accumulate in double.
#include "kernels/cpu/launchers.h"
#include "kernels/cpu/parallel.h"
#include "kernels/loss.h"

namespace unetcu::kernels::cpu {
namespace {

template <class T>
DiceSums dice_sums_impl(const T* x, const T* t, int64_t n) {
  double inter = 0, psum = 0, tsum = 0;
#pragma omp parallel for reduction(+ : inter, psum, tsum) schedule(static) if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const double p = kernels::sigmoid_forward(x[i]);
    inter += p * t[i];
    psum += p;
    tsum += t[i];
  }
  return {inter, psum, tsum};
}

}  // namespace

double bce_with_logits_forward(const Tensor& logits, const Tensor& target) {
  const int64_t n = logits.numel();
  double sum = 0;
  UNETCU_DISPATCH_FLOAT(logits.dtype(), T, {
    const T* x = logits.data<T>();
    const T* t = target.data<T>();
    sum = parallel_sum(n, [&](int64_t i) { return double(kernels::bce_with_logits(x[i], t[i])); });
  });
  return sum / double(n);
}

void bce_with_logits_backward(const Tensor& logits, const Tensor& target, double scale,
                              Tensor& grad_x, double beta) {
  const int64_t n = logits.numel();
  UNETCU_DISPATCH_FLOAT(logits.dtype(), T, {
    const T* x = logits.data<T>();
    const T* t = target.data<T>();
    T* g = grad_x.data<T>();
    const T s = T(scale), b = T(beta);
    parallel_for(n, [&](int64_t i) { store(g + i, s * bce_with_logits_grad(x[i], t[i]), b); });
  });
}

DiceSums dice_sums(const Tensor& logits, const Tensor& target) {
  DiceSums s{};
  UNETCU_DISPATCH_FLOAT(logits.dtype(), T,
                        s = dice_sums_impl(logits.data<T>(), target.data<T>(), logits.numel()));
  return s;
}

void dice_backward(const Tensor& logits, const Tensor& target, const DiceSums& s, double smooth,
                   double scale, Tensor& grad_x, double beta) {
  const int64_t n = logits.numel();
  UNETCU_DISPATCH_FLOAT(logits.dtype(), T, {
    const T* x = logits.data<T>();
    const T* t = target.data<T>();
    T* g = grad_x.data<T>();
    const T inter = T(s.intersection), card = T(s.prob_sum + s.target_sum), sm = T(smooth);
    const T sc = T(scale), b = T(beta);
    parallel_for(n, [&](int64_t i) {
      const T p = kernels::sigmoid_forward(x[i]);
      store(g + i, sc * dice_grad_logit(p, t[i], inter, card, sm), b);
    });
  });
}

}  // namespace unetcu::kernels::cpu
