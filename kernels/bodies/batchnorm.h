// Per-element bodies of 2-D batch normalisation (per channel over N*H*W).
#pragma once
#include "kernels/bodies/common.h"

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

}  // namespace unetcu::kernels
