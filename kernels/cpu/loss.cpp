// CPU losses over bodies/loss.h. Reductions accumulate in double.
//
// Logits are float32, float64 or bfloat16 in either memory format; the target is float32 or the
// logits' dtype, in either format. Each element is computed in the wider of the two compute
// types (float for bfloat16). The loss (and so its upstream gradient) is the logits' compute
// type: float32 for bfloat16 logits, as autocast runs these losses. grad_x has the logits'
// dtype and format, each element rounded once.
#include "kernels/cpu/parallel.h"
#include "kernels/launchers.h"
#include "bodies/loss.h"
#include "kernels/loss_target.h"

namespace unetcu::kernels::cpu {
namespace {


template <class X, class Tt>
void dice_sums_impl(const X* x, const Tt* t, const LossTargetIndex& ti, int64_t n, double* out) {
  using A = loss_acc_t<X, Tt>;
  double inter = 0, psum = 0, tsum = 0;
#pragma omp parallel for reduction(+ : inter, psum, tsum) schedule(static) if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const double p = kernels::sigmoid_forward(A(x[i]));
    const double tv = A(t[ti(i)]);
    inter += p * tv;
    psum += p;
    tsum += tv;
  }
  out[0] = inter, out[1] = psum, out[2] = tsum;
}

}  // namespace

void bce_with_logits_forward(const TensorRef& logits, const TensorRef& target,
                             const TensorRef& loss) {
  const int64_t n = logits.numel();
  const LossTargetIndex ti = target_index(logits, target);
  UNETCU_DISPATCH_LOSS(logits, target, {
    using A = loss_acc_t<X, Tt>;
    using L = acc_t<X>;  // the loss's type
    const X* x = logits.data<X>();
    const Tt* t = target.data<Tt>();
    const double sum = parallel_sum(
        n, [&](int64_t i) { return double(kernels::bce_with_logits(A(x[i]), A(t[ti(i)]))); });
    loss.data<L>()[0] = L(sum / double(n));
  });
}

void bce_with_logits_backward(const TensorRef& logits, const TensorRef& target,
                              const TensorRef& grad_loss, const TensorRef& grad_x, double beta) {
  const int64_t n = logits.numel();
  const LossTargetIndex ti = target_index(logits, target);
  UNETCU_DISPATCH_LOSS(logits, target, {
    using A = loss_acc_t<X, Tt>;
    using L = acc_t<X>;  // the loss's type
    const X* x = logits.data<X>();
    const Tt* t = target.data<Tt>();
    X* g = grad_x.data<X>();
    const A s = A(double(grad_loss.data<L>()[0]) / double(n)), b = A(beta);
    parallel_for(n, [&](int64_t i) {
      store(g + i, acc_t<X>(s * bce_with_logits_grad(A(x[i]), A(t[ti(i)]))), acc_t<X>(b));
    });
  });
}

void dice_sums(const TensorRef& logits, const TensorRef& target, const TensorRef& sums) {
  const LossTargetIndex ti = target_index(logits, target);
  UNETCU_DISPATCH_LOSS(logits, target,
                       dice_sums_impl(logits.data<X>(), target.data<Tt>(), ti, logits.numel(),
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
  const LossTargetIndex ti = target_index(logits, target);
  UNETCU_DISPATCH_LOSS(logits, target, {
    using A = loss_acc_t<X, Tt>;
    using L = acc_t<X>;  // the loss's type
    const X* x = logits.data<X>();
    const Tt* t = target.data<Tt>();
    X* g = grad_x.data<X>();
    const A inter = A(s[0]), card = A(s[1] + s[2]), sm = A(smooth);
    const A sc = A(grad_loss.data<L>()[0]), b = A(beta);
    parallel_for(n, [&](int64_t i) {
      const A p = kernels::sigmoid_forward(A(x[i]));
      store(g + i, acc_t<X>(sc * dice_grad_logit(p, A(t[ti(i)]), inter, card, sm)), acc_t<X>(b));
    });
  });
}

}  // namespace unetcu::kernels::cpu
