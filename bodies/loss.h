// Per-element bodies of the losses. Reductions (means, Dice sums) are done by the launchers.
//
// Targets: for one output channel (binary) a value in [0, 1] per pixel; for C >= 2 channels
// the class index 0..C-1 per pixel, stored as a float. A negative target marks an ignored
// pixel (the data's --ignore-index, or a crop's padding): it adds nothing to any loss, sum or
// count, and its gradient is 0. With no ignored pixel every loss is the mean over all pixels.
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

// A target value that takes part in the loss (not ignored).
template <class T> HD bool counted(T t) { return t >= T(0); }

// Where logit (pixel, c) of [N, C, H, W] lies, pixel = n * H*W + h * W + w, in either format.
struct ClassLayout {
  int64_t C, HW;
  bool nhwc;
  HD int64_t operator()(int64_t pixel, int64_t c) const {
    return nhwc ? pixel * C + c : (pixel / HW) * C * HW + c * HW + pixel % HW;
  }
};

// The largest logit of a pixel and log(sum exp(x_c - max)): softmax p_c = exp(x_c - max - lse).
template <class A, class X> HD void softmax_stats(const X* x, const ClassLayout& L, int64_t pixel,
                                                  A* max_out, A* lse_out) {
  A mx = A(x[L(pixel, 0)]);
  for (int64_t c = 1; c < L.C; ++c) mx = A(x[L(pixel, c)]) > mx ? A(x[L(pixel, c)]) : mx;
  A s = A(0);
  for (int64_t c = 0; c < L.C; ++c) s += exp(A(x[L(pixel, c)]) - mx);
  *max_out = mx, *lse_out = log(s);
}

// Softmax cross-entropy of one pixel with class t: log-sum-exp(x) - x_t.
template <class A, class X> HD A softmax_ce(const X* x, const ClassLayout& L, int64_t pixel, int64_t t) {
  A mx, lse;
  softmax_stats(x, L, pixel, &mx, &lse);
  return mx + lse - A(x[L(pixel, t)]);
}

// The class a pixel is predicted as: one channel, 1 where the logit is > 0 (probability > 0.5);
// C >= 2, the first largest logit.
template <class X> HD int64_t predicted_class(const X* x, const ClassLayout& L, int64_t pixel) {
  using A = acc_t<X>;
  if (L.C == 1) return A(x[L(pixel, 0)]) > A(0) ? 1 : 0;
  int64_t best = 0;
  for (int64_t c = 1; c < L.C; ++c)
    if (A(x[L(pixel, c)]) > A(x[L(pixel, best)])) best = c;
  return best;
}
// The class a target is: one channel, 1 where > 0.5; else the index; -1 when ignored.
template <class T> HD int64_t target_class(T t, int64_t C) {
  if (!counted(t)) return -1;
  return C == 1 ? (t > T(0.5) ? 1 : 0) : int64_t(t);
}

// Multiclass soft Dice, segmentation_models_pytorch's DiceLoss(mode='multiclass') with smooth 0
// and eps 1e-7: per class c over the batch's counted pixels, I_c = sum p_c [t = c],
// D_c = max(sum p_c + sum [t = c] + smooth, eps); loss = mean over all C classes of
// (1 - (2 I_c + smooth) / D_c) for a class present in the target, 0 for a class absent from it
// (its term is zeroed, as SMP does, but it still counts in the mean).
// d loss / d p_c at a pixel of class t: g_c = -(2 [t = c] D_c - (2 I_c + smooth)) / (C D_c^2)
// for a present class (D_c >= 1 there, so eps never binds), 0 for an absent one; through the
// softmax d loss / d x_k = p_k (g_k - sum_c g_c p_c).
constexpr double kMulticlassDiceEps = 1e-7;
HD double multiclass_dice_denominator(double psum, double tsum, double smooth) {
  const double d = psum + tsum + smooth;
  return d > kMulticlassDiceEps ? d : kMulticlassDiceEps;
}
template <class A> HD A multiclass_dice_grad_p(A t_is_c, A inter, A denom, A tsum, A smooth, A classes) {
  if (tsum <= A(0)) return A(0);
  return -(A(2) * t_is_c * denom - (A(2) * inter + smooth)) / (classes * denom * denom);
}

// The multiclass Dice loss from its sums [3, C] (inter, psum, tsum per class).
HD double multiclass_dice_value(const double* s, int64_t C, double smooth) {
  double total = 0;
  for (int64_t c = 0; c < C; ++c)
    if (s[2 * C + c] > 0)
      total += 1.0 - (2.0 * s[c] + smooth) / multiclass_dice_denominator(s[C + c], s[2 * C + c], smooth);
  return total / double(C);
}

// The softmax cross-entropy's gradient at one pixel of target t, scale s (the upstream
// gradient over the count): s (softmax(x)_c - [c = t]) for each class c, 0 where the pixel is
// ignored, each given to put(c, value).
template <class A, class X, class Put>
HD void softmax_ce_grad_pixel(const X* x, const ClassLayout& L, int64_t p, A t, A s, Put&& put) {
  const bool on = counted(t);
  A mx = A(0), lse = A(0);
  if (on) softmax_stats(x, L, p, &mx, &lse);
  for (int64_t c = 0; c < L.C; ++c)
    put(c, on ? s * (exp(A(x[L(p, c)]) - mx - lse) - A(int64_t(t) == c)) : A(0));
}

// The multiclass Dice's gradient at one pixel of target t from the sums [3, C], scale sc (the
// upstream gradient): sc p_c (g_c - sum_k g_k p_k) for each class c (multiclass_dice_grad_p),
// 0 where the pixel is ignored, each given to put(c, value).
template <class A, class X, class Put>
HD void multiclass_dice_grad_pixel(const X* x, const ClassLayout& L, int64_t p, A t, const double* s,
                                   double smooth, A sc, Put&& put) {
  const int64_t C = L.C;
  const bool on = counted(t);
  const int64_t k = on ? int64_t(t) : 0;
  auto grad_p = [&](int64_t c) {  // d loss / d p_c at a pixel of class k
    return multiclass_dice_grad_p(A(k == c), A(s[c]), A(multiclass_dice_denominator(s[C + c], s[2 * C + c], smooth)),
                                  A(s[2 * C + c]), A(smooth), A(C));
  };
  A mx = A(0), lse = A(0), dot = A(0);
  if (on) {
    softmax_stats(x, L, p, &mx, &lse);
    for (int64_t c = 0; c < C; ++c) dot += grad_p(c) * exp(A(x[L(p, c)]) - mx - lse);
  }
  for (int64_t c = 0; c < C; ++c) put(c, on ? sc * exp(A(x[L(p, c)]) - mx - lse) * (grad_p(c) - dot) : A(0));
}

}  // namespace unetcu::kernels
