// Per-element optimizer updates, PyTorch semantics (torch.optim.Adam / SGD).
#pragma once
#include "bodies/common.h"

namespace unetcu::kernels {

struct AdamStep {
  double lr, beta1, beta2, eps, weight_decay;
  double bias_correction1, bias_correction2;  // 1 - beta^t for this parameter's step t
};

// The per-step scalars of Adam in the parameter's type, computed once per tensor.
template <class T> struct AdamCoeffs {
  T beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_sqrt_bc2, eps, weight_decay;
  AdamCoeffs() = default;  // arrays of them (the multi-tensor launch)
  explicit AdamCoeffs(const AdamStep& s)
      : beta1(T(s.beta1)), one_minus_beta1(T(1 - s.beta1)), beta2(T(s.beta2)),
        one_minus_beta2(T(1 - s.beta2)), step_size(T(s.lr / s.bias_correction1)),
        inv_sqrt_bc2(T(1 / std::sqrt(s.bias_correction2))), eps(T(s.eps)),
        weight_decay(T(s.weight_decay)) {}
};

// Adam (L2 weight decay added to the gradient, as torch.optim.Adam):
//   g += wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
//   p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
template <class T> HD void adam_update(T* p, T g, T* m, T* v, const AdamCoeffs<T>& c) {
  g += c.weight_decay * *p;
  *m = c.beta1 * *m + c.one_minus_beta1 * g;
  *v = c.beta2 * *v + c.one_minus_beta2 * g * g;
  *p -= c.step_size * *m / (sqrt(*v) * c.inv_sqrt_bc2 + c.eps);
}

struct SgdStep {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, first_step;  // first step: the momentum buffer starts as the gradient
};

// SGD with momentum: g += wd*p; buf = first ? g : mu*buf + (1-dampening)*g;
// g = nesterov ? g + mu*buf : buf; p -= lr*g.
template <class T> HD void sgd_update(T* p, T g, T* buf, const SgdStep& s) {
  if (s.weight_decay != 0) g += T(s.weight_decay) * *p;
  if (s.momentum != 0) {
    *buf = s.first_step ? g : T(s.momentum) * *buf + T(1 - s.dampening) * g;
    g = s.nesterov ? g + T(s.momentum) * *buf : *buf;
  }
  *p -= T(s.lr) * g;
}

// torch.nn.utils.clip_grad_norm_'s factor for gradients whose squares sum to square_sum:
// min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ = sqrt(square_sum). A non-finite norm gives NaN or 0, as
// torch.clamp passes NaN through: the step then writes non-finite parameters, and the loss of
// the next step says so, rather than the step going on with gradients it cannot measure.
HD double clip_coefficient(double square_sum, double max_norm) {
  const double c = max_norm / (sqrt(square_sum) + 1e-6);
  return c >= 1 ? 1.0 : c;  // NaN compares false: it stays NaN
}

// The record of the clipped steps, stats float64 [3]: the sum of the gradients' norms (before
// clipping), their largest (NaN once one was NaN), and the number of steps the clip scaled down.
HD void clip_stats_update(double square_sum, double max_norm, double* stats) {
  const double norm = sqrt(square_sum);
  stats[0] += norm;
  if (norm > stats[1] || norm != norm) stats[1] = norm;
  if (clip_coefficient(square_sum, max_norm) < 1) stats[2] += 1;
}

// The elements of each chunk a square sum adds serially before the chunks are added in order
// (square_sum_many): the result does not depend on the thread count on the CPU.
constexpr int64_t kSquareSumChunk = 4096;

}  // namespace unetcu::kernels
