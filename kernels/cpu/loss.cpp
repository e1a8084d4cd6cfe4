// CPU losses over bodies/loss.h. Reductions accumulate in double.
//
// Logits are float32, float64 or bfloat16 in either memory format; the target is float32 or the
// logits' dtype, in either format. Each element is computed in the wider of the two compute
// types (float for bfloat16). The loss (and so its upstream gradient) is the logits' compute
// type: float32 for bfloat16 logits, as autocast runs these losses. grad_x has the logits'
// dtype and format, each element rounded once.
#include <algorithm>
#include <vector>

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
    const double tv = A(t[ti(i)]);
    if (!counted(tv)) continue;
    const double p = kernels::sigmoid_forward(A(x[i]));
    inter += p * tv;
    psum += p;
    tsum += tv;
  }
  out[0] = inter, out[1] = psum, out[2] = tsum;
}

// K sums over [0, n) added in an order that does not depend on the thread count: fixed
// chunks, each summed serially by body(i, acc[K]), then the chunks' sums in chunk order.
template <class F> void chunked_sums(int64_t n, int K, F&& body, double* out) {
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(size_t(chunks) * size_t(K), 0.0);
  parallel_for(chunks, [&](int64_t k) {
    double* acc = part.data() + k * K;
    for (int64_t i = k * kChunk, end = std::min(n, i + kChunk); i < end; ++i) body(i, acc);
  }, 2);
  for (int j = 0; j < K; ++j) out[j] = 0;
  for (int64_t k = 0; k < chunks; ++k)
    for (int j = 0; j < K; ++j) out[j] += part[size_t(k * K + j)];
}

ClassLayout class_layout(const TensorRef& logits) {
  const Dims4 d = logits.dims4();
  return {d.C, d.H * d.W, d.nhwc};
}

// The mean's value, 0 over no counted element.
template <class L> void write_mean(const double* sums, const TensorRef& loss) {
  loss.data<L>()[0] = L(sums[1] > 0 ? sums[0] / sums[1] : 0.0);
}

}  // namespace

void bce_with_logits_forward(const TensorRef& logits, const TensorRef& target,
                             const TensorRef& sums, const TensorRef& loss) {
  const int64_t n = logits.numel();
  const LossTargetIndex ti = target_index(logits, target);
  double* s = sums.data<double>();
  UNETCU_DISPATCH_LOSS(logits, target, {
    using A = loss_acc_t<X, Tt>;
    using L = acc_t<X>;  // the loss's type
    const X* x = logits.data<X>();
    const Tt* t = target.data<Tt>();
    s[0] = parallel_sum(n, [&](int64_t i) {
      const A tv = A(t[ti(i)]);
      return counted(tv) ? double(kernels::bce_with_logits(A(x[i]), tv)) : 0.0;
    });
    s[1] = parallel_sum(n, [&](int64_t i) { return counted(A(t[ti(i)])) ? 1.0 : 0.0; });
    write_mean<L>(s, loss);
  });
}

void bce_with_logits_backward(const TensorRef& logits, const TensorRef& target,
                              const TensorRef& sums, const TensorRef& grad_loss,
                              const TensorRef& grad_x, double beta) {
  const int64_t n = logits.numel();
  const LossTargetIndex ti = target_index(logits, target);
  const double count = sums.data<double>()[1];
  UNETCU_DISPATCH_LOSS(logits, target, {
    using A = loss_acc_t<X, Tt>;
    using L = acc_t<X>;  // the loss's type
    const X* x = logits.data<X>();
    const Tt* t = target.data<Tt>();
    X* g = grad_x.data<X>();
    const A s = A(count > 0 ? double(grad_loss.data<L>()[0]) / count : 0.0), b = A(beta);
    parallel_for(n, [&](int64_t i) {
      const A tv = A(t[ti(i)]);
      store(g + i, acc_t<X>(counted(tv) ? s * bce_with_logits_grad(A(x[i]), tv) : A(0)), acc_t<X>(b));
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
      const A tv = A(t[ti(i)]);
      const A p = kernels::sigmoid_forward(A(x[i]));
      store(g + i, acc_t<X>(counted(tv) ? sc * dice_grad_logit(p, tv, inter, card, sm) : A(0)),
            acc_t<X>(b));
    });
  });
}

void softmax_ce_forward(const TensorRef& logits, const TensorRef& target, const TensorRef& sums,
                        const TensorRef& loss) {
  const ClassLayout L = class_layout(logits);
  const int64_t pixels = logits.numel() / L.C;
  double* s = sums.data<double>();
  UNETCU_DISPATCH_LOSS(logits, target, {
    using A = loss_acc_t<X, Tt>;
    const X* x = logits.data<X>();
    const Tt* t = target.data<Tt>();
    chunked_sums(pixels, 2, [&](int64_t p, double* acc) {
      const A tv = A(t[p]);
      if (!counted(tv)) return;
      acc[0] += double(softmax_ce<A>(x, L, p, int64_t(tv)));
      acc[1] += 1;
    }, s);
    write_mean<acc_t<X>>(s, loss);
  });
}

void softmax_ce_backward(const TensorRef& logits, const TensorRef& target, const TensorRef& sums,
                         const TensorRef& grad_loss, const TensorRef& grad_x, double beta) {
  const ClassLayout L = class_layout(logits);
  const int64_t pixels = logits.numel() / L.C;
  const double count = sums.data<double>()[1];
  UNETCU_DISPATCH_LOSS(logits, target, {
    using A = loss_acc_t<X, Tt>;
    const X* x = logits.data<X>();
    const Tt* t = target.data<Tt>();
    X* g = grad_x.data<X>();
    const A s = A(count > 0 ? double(grad_loss.data<acc_t<X>>()[0]) / count : 0.0), b = A(beta);
    parallel_for(pixels, [&](int64_t p) {
      softmax_ce_grad_pixel(x, L, p, A(t[p]), s, [&](int64_t c, A v) { store(g + L(p, c), acc_t<X>(v), acc_t<X>(b)); });
    }, kParallelGrain / 8);
  });
}

void multiclass_dice_sums(const TensorRef& logits, const TensorRef& target, const TensorRef& sums) {
  const ClassLayout L = class_layout(logits);
  const int64_t pixels = logits.numel() / L.C, C = L.C;
  UNETCU_DISPATCH_LOSS(logits, target, {
    using A = loss_acc_t<X, Tt>;
    const X* x = logits.data<X>();
    const Tt* t = target.data<Tt>();
    // acc: [inter_0..C-1, psum_0..C-1, tsum_0..C-1], the layout of sums [3, C].
    chunked_sums(pixels, int(3 * C), [&](int64_t p, double* acc) {
      const A tv = A(t[p]);
      if (!counted(tv)) return;
      A mx, lse;
      softmax_stats(x, L, p, &mx, &lse);
      const int64_t k = int64_t(tv);
      for (int64_t c = 0; c < C; ++c) acc[C + c] += double(exp(A(x[L(p, c)]) - mx - lse));
      acc[k] += double(exp(A(x[L(p, k)]) - mx - lse));
      acc[2 * C + k] += 1;
    }, sums.data<double>());
  });
}

void multiclass_dice_loss_from_sums(const TensorRef& sums, double smooth, const TensorRef& loss) {
  const double value = multiclass_dice_value(sums.data<double>(), sums.dim(1), smooth);
  UNETCU_DISPATCH_FLOAT(loss.dtype(), T, loss.data<T>()[0] = T(value));
}

void multiclass_dice_backward(const TensorRef& logits, const TensorRef& target,
                              const TensorRef& sums, double smooth, const TensorRef& grad_loss,
                              const TensorRef& grad_x, double beta) {
  const ClassLayout L = class_layout(logits);
  const int64_t pixels = logits.numel() / L.C;
  const double* s = sums.data<double>();
  UNETCU_DISPATCH_LOSS(logits, target, {
    using A = loss_acc_t<X, Tt>;
    const X* x = logits.data<X>();
    const Tt* t = target.data<Tt>();
    X* g = grad_x.data<X>();
    const A sc = A(grad_loss.data<acc_t<X>>()[0]), b = A(beta);
    parallel_for(pixels, [&](int64_t p) {
      multiclass_dice_grad_pixel(x, L, p, A(t[p]), s, smooth, sc,
                                 [&](int64_t c, A v) { store(g + L(p, c), acc_t<X>(v), acc_t<X>(b)); });
    }, kParallelGrain / 8);
  });
}

void confusion_update(const TensorRef& logits, const TensorRef& target, const TensorRef& counts) {
  const ClassLayout L = class_layout(logits);
  const int64_t pixels = logits.numel() / L.C, K = counts.dim(0);
  double* m = counts.data<double>();
  UNETCU_DISPATCH_LOSS(logits, target, {
    const X* x = logits.data<X>();
    const Tt* t = target.data<Tt>();
    for (int64_t p = 0; p < pixels; ++p) {
      const int64_t truth = target_class(loss_acc_t<X, Tt>(t[p]), L.C);
      if (truth >= 0) m[truth * K + predicted_class(x, L, p)] += 1;
    }
  });
}

}  // namespace unetcu::kernels::cpu
