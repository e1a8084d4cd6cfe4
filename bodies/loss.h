// Per-element bodies of the losses. Reductions (means, Dice sums) are done by the launchers.
// The launchers walk the logits in memory order and read the target element of the same
// (n, c, h, w) through LossTargetIndex, so the two may differ in memory format.
#pragma once
#include <type_traits>

#include "bodies/common.h"
#include "bodies/elementwise.h"
#include "bodies/layout.h"

namespace unetcu::kernels {

// The type a loss element is computed in, for logits stored as X and a target stored as Tt: the
// wider of their compute types (float for bfloat16).
template <class X, class Tt> using loss_acc_t = std::common_type_t<acc_t<X>, acc_t<Tt>>;

// Where the target element matching logits element i (memory order) lies. The same index when
// both share one memory order: the same format, or a layout where NCHW and NHWC coincide (one
// channel, as the UNet's logits, or one pixel); otherwise the coordinates are mapped.
struct LossTargetIndex {
  bool remap;
  Dims4 logits, target;
  HD int64_t operator()(int64_t i) const {
    if (!remap) return i;
    int64_t n, c, h, w;
    coords_of(logits, i, &n, &c, &h, &w);
    return offset_of(target, n, c, h, w);
  }
};

// Binary cross-entropy on logits: max(x,0) - x*t + log(1 + exp(-|x|)). Never overflows:
// at |x| = 100 the log term is log1p(e^-100), and max/x*t are exact.
template <class T> HD T bce_with_logits(T x, T t) {
  T relu_x = x > T(0) ? x : T(0);
  return relu_x - x * t + log1p(exp(-fabs(x)));
}
// d/dx of the per-element BCE: sigmoid(x) - t.
template <class T> HD T bce_with_logits_grad(T x, T t) { return sigmoid_forward(x) - t; }

// Soft Dice on probabilities p = sigmoid(x), over all elements of the batch:
//   loss = 1 - (2*I + s) / (S + s),  I = sum p*t,  S = sum p + sum t,  s = smooth.
// d loss / d p_i = -(2*t_i*(S + s) - (2*I + s)) / (S + s)^2, then times p(1-p) for d/dx.
// With nothing predicted, nothing to find and smooth = 0 the ratio is 0/0: the loss is taken
// as 0 (a perfect match) and so is its gradient.
template <class T> HD T dice_grad_logit(T p, T t, T inter, T card, T smooth) {
  T denom = card + smooth;
  if (denom == T(0)) return T(0);
  T dp = -(T(2) * t * denom - (T(2) * inter + smooth)) / (denom * denom);
  return dp * p * (T(1) - p);
}
HD double dice_loss_value(double inter, double card, double smooth) {
  const double denom = card + smooth;
  return denom == 0 ? 0.0 : 1.0 - (2.0 * inter + smooth) / denom;
}

}  // namespace unetcu::kernels
