// Per-element bodies of 2-D batch normalisation (per channel over N*H*W).
//
// Types: activations (x, y, residual and their gradients) are stored as S (float, double or
// bf16); every body computes in T = acc_t<S> (float for bf16), which is also the type of the
// per-channel tensors (gamma, beta, mean, invstd, the running statistics and the parameter
// gradients). The launchers widen each stored value to T, call these bodies, and round once
// when they store (store(), bodies/elementwise.h). The sums of a channel are double whatever S is.
#pragma once
#include "bodies/bf16.h"
#include "bodies/common.h"
#include "bodies/elementwise.h"

namespace unetcu::kernels {

// A batch-norm operand's geometry: [N, C, H*W] in either memory order (NCHW or NHWC), P =
// N*H*W pixels, the values of a channel. Both backends' launchers index through it.
struct BnGeometry {
  int64_t N, C, HW;
  bool nhwc;
  HD int64_t pixels() const { return N * HW; }
  HD int64_t numel() const { return N * C * HW; }
  // Memory index of (n = 0, c, q = 0): the channel's first element.
  HD int64_t first_of(int64_t c) const { return nhwc ? c : c * HW; }
};

// The scale and shift as one mul_add (bodies/common.h): the same bits in every kernel of a
// build, which the fused op's backward needs when it recomputes the ReLU mask (below).
template <class T> HD T bn_normalize(T x, T mean, T invstd, T gamma, T beta) {
  return mul_add((x - mean) * invstd, gamma, beta);
}

// Training-mode input gradient, with M = N*H*W elements in the channel, xhat the normalised
// input, sum_dy = sum(dy), sum_dy_xhat = sum(dy * xhat):
//   dx = gamma * invstd / M * (M*dy - sum_dy - xhat*sum_dy_xhat)
template <class T> HD T bn_backward_train(T dy, T xhat, T gamma_invstd, T inv_m, T sum_dy,
                                          T sum_dy_xhat) {
  return gamma_invstd * (dy - inv_m * sum_dy - xhat * inv_m * sum_dy_xhat);
}

// Running statistics as PyTorch: r = (1 - momentum) * r + momentum * batch_stat, with the
// unbiased variance (M / (M - 1)) for running_var.
template <class T> HD T bn_running_update(T running, T batch_stat, T momentum) {
  return (T(1) - momentum) * running + momentum * batch_stat;
}

// ---- training statistics in one pass: shifted sums --------------------------------------
//
// Per channel, with a shift K (the channel's first element, x[n = 0, c, 0, 0]) and d = x - K:
//   s1 = sum d, s2 = sum d²  (double, whatever the tensor dtype)
//   mean = K + s1 / M,  var = s2 / M - (s1 / M)²  (biased).
// The subtraction loses about log10((mean - K)² / var) digits; K is a sample of the channel,
// so (mean - K)² is a few variances and the variance keeps nearly all of double's digits
// however large the mean. The unshifted E[x²] - E[x]² loses log10(mean² / var) digits instead:
// all of float32's at mean/std = 1e4, half of double's at 1e8 (tests/test_fused.cpp).
// Partial sums of chunks of a channel add up exactly as the sums of the whole channel, so
// chunks (NCHW planes or NHWC runs of pixels on the CPU, blocks on the GPU) are summed
// separately and then combined in a fixed order: deterministic, and no atomics. The shift is
// the same element, x(n = 0, c, 0, 0), in either memory format.
template <class T> HD void bn_stats_accumulate(T x, double shift, double& s1, double& s2) {
  const double d = double(x) - shift;
  s1 += d;
  s2 += d * d;
}

// mean and biased variance from the shifted sums of count values.
HD void bn_stats_finish(double s1, double s2, double count, double shift, double& mean,
                        double& var) {
  const double m1 = s1 / count;
  mean = shift + m1;
  const double v = s2 / count - m1 * m1;
  var = v > 0 ? v : 0.0;
}

// ---- fused batch norm + (residual add) + ReLU --------------------------------------------
//
// Forward: y = relu(bn(x) + r), r = 0 without a residual; the same operations in the same
// order as the unfused ops (bn_normalize, then the add, then relu_forward).
template <class T> HD T bn_add_relu_forward(T x, T mean, T invstd, T gamma, T beta, T residual) {
  return relu_forward(bn_normalize(x, mean, invstd, gamma, beta) + residual);
}
template <class T> HD T bn_relu_forward(T x, T mean, T invstd, T gamma, T beta) {
  return relu_forward(bn_normalize(x, mean, invstd, gamma, beta));
}

// Whether the fused op without a residual stored a positive y for this x, from x instead of
// y: the forward's bn_normalize (its mul_add gives the same bits in every kernel) against the
// bound below which rounding to the storage type S gives zero (stored_zero_bound), so the
// answer is y > 0 bit for bit, where y = to_storage<S>(relu_forward(v)): relu_forward(v) is
// v where v > 0 and 0 otherwise (a NaN too), and a positive v is stored as a positive S
// exactly when v exceeds the bound. The backward then reads dy and x only, not y: one value
// fewer per element in each of its two passes.
template <class S, class T> HD bool bn_relu_passes(T x, T mean, T invstd, T gamma, T beta) {
  return bn_normalize(x, mean, invstd, gamma, beta) > stored_zero_bound<S, T>();
}

// Where the backward's ReLU mask comes from: none (the plain batch norm, g = dy), the stored
// output y (relu_backward(dy, y), the fused op with a residual), or x (bn_relu_passes, the
// fused op without one).
enum class ReluMask { none, stored_y, from_x };

// g, the gradient of bn(x) + r, from the output's gradient dy: also the residual's gradient.
// The batch norm's sums are sum(g) and sum(g * xhat) (dbeta and dgamma), and
//   training: dx = bn_backward_train(g, xhat, ...),  eval: dx = g * gamma * invstd.
// y is read only with stored_y; gamma and beta only with from_x.
template <ReluMask M, class S, class T>
HD T bn_relu_grad(T dy, T y, T x, T mean, T invstd, T gamma, T beta) {
  if constexpr (M == ReluMask::none) return dy;
  else if constexpr (M == ReluMask::stored_y) return relu_backward(dy, y);
  else return bn_relu_passes<S>(x, mean, invstd, gamma, beta) ? dy : T(0);
}

}  // namespace unetcu::kernels
