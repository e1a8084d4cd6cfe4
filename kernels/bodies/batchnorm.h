// Per-element bodies of 2-D batch normalisation (per channel over N*H*W).
//
// Types: activations (x, y, residual and their gradients) are stored as S (float, double or
// bf16); every body computes in T = acc_t<S> (float for bf16), which is also the type of the
// per-channel tensors (gamma, beta, mean, invstd, the running statistics and the parameter
// gradients). The launchers widen each stored value to T, call these bodies, and round once
// when they store (store(), bodies/elementwise.h). The sums of a channel are double whatever S is.
#pragma once
#include "kernels/bodies/bf16.h"
#include "kernels/bodies/common.h"
#include "kernels/bodies/elementwise.h"

namespace unetcu::kernels {

template <class T> HD T bn_normalize(T x, T mean, T invstd, T gamma, T beta) {
  return (x - mean) * invstd * gamma + beta;
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

// Backward. g = relu_backward(dy, y) is the gradient of bn(x) + r, so also the residual's
// gradient; the batch norm's sums are sum(g) and sum(g * xhat) (dbeta and dgamma), and
//   training: dx = bn_backward_train(g, xhat, ...),  eval: dx = g * gamma * invstd.
template <class T> HD T bn_relu_backward_dx(T dy, T y, T x, T mean, T invstd, T gamma_invstd,
                                            T inv_m, T sum_g, T sum_g_xhat, bool training) {
  const T g = relu_backward(dy, y);
  return training ? bn_backward_train(g, (x - mean) * invstd, gamma_invstd, inv_m, sum_g, sum_g_xhat)
                  : g * gamma_invstd;
}
// g and xhat of one element, the terms of the sums (added in double).
template <class T> HD void bn_relu_grad_terms(T dy, T y, T x, T mean, T invstd, T& g, T& xhat) {
  g = relu_backward(dy, y);
  xhat = (x - mean) * invstd;
}
template <class T>
HD void bn_relu_grad_accumulate(T dy, T y, T x, T mean, T invstd, double& sum_g,
                                double& sum_g_xhat) {
  T g, xhat;
  bn_relu_grad_terms(dy, y, x, mean, invstd, g, xhat);
  sum_g += g;
  sum_g_xhat += double(g) * double(xhat);
}

}  // namespace unetcu::kernels
