// The launchers of both backends, listed once: kernels/launchers.h declares them for
// kernels::cpu and kernels::cuda from this list, and kernels/cuda/stubs.cpp makes the no-CUDA
// stubs from it, so adding an op is one row here plus its two bodies.
//
// Each row is X(name, (parameters)); every launcher returns void. Launchers trust shapes and
// dtypes (the op layer checked them). A `beta` argument is 0 (overwrite the destination, which
// may hold garbage) or 1 (add to it): that is what "written or accumulated" means below.
#pragma once

#define UNETCU_LAUNCHERS(X)                                                                   \
  /* dst = beta*dst + alpha*src (elementwise, same shape): written or accumulated by beta. */ \
  X(axpby, (Tensor& dst, double alpha, const Tensor& src, double beta))                       \
  /* dst written. */                                                                          \
  X(fill, (Tensor& dst, double value))                                                        \
  /* y written; grad_x written or accumulated by beta. */                                     \
  X(relu_forward, (const Tensor& x, Tensor& y))                                               \
  X(relu_backward, (const Tensor& grad_y, const Tensor& y, Tensor& grad_x, double beta))      \
  X(sigmoid_forward, (const Tensor& x, Tensor& y))                                            \
  X(sigmoid_backward, (const Tensor& grad_y, const Tensor& y, Tensor& grad_x, double beta))   \
  X(add_forward, (const Tensor& a, const Tensor& b, Tensor& y))                               \
  /* y = conv(x, w) + b, written; b may be undefined. */                                      \
  X(conv2d_forward, (const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,            \
                     const ConvGeometry& g))                                                  \
  /* Any of grad_x / grad_w / grad_b may be null (not needed); each written or accumulated   \
     by its beta. */                                                                          \
  X(conv2d_backward, (const Tensor& grad_y, const Tensor& x, const Tensor& w, Tensor* grad_x, \
                      double beta_x, Tensor* grad_w, double beta_w, Tensor* grad_b,           \
                      double beta_b, const ConvGeometry& g))                                  \
  /* Training: batch statistics; writes y and save_mean/save_invstd [C] and updates the      \
     running statistics in place (momentum, unbiased variance). */                            \
  X(batchnorm_forward_train, (const Tensor& x, const Tensor& gamma, const Tensor& beta,       \
                              Tensor& y, Tensor& save_mean, Tensor& save_invstd,              \
                              Tensor& running_mean, Tensor& running_var, double momentum,     \
                              double eps))                                                    \
  /* y written. */                                                                            \
  X(batchnorm_forward_eval, (const Tensor& x, const Tensor& gamma, const Tensor& beta,        \
                             const Tensor& running_mean, const Tensor& running_var,           \
                             double eps, Tensor& y))                                          \
  /* mean = running_mean, invstd = 1/sqrt(running_var + eps) (written): the constants of     \
     eval mode. */                                                                            \
  X(batchnorm_eval_stats, (const Tensor& running_mean, const Tensor& running_var, double eps, \
                           Tensor& mean, Tensor& invstd))                                     \
  /* training = false: mean/invstd are eval_stats and the statistics are constants;           \
     eps is the forward's. Gradients may be null; each written or accumulated by its beta. */ \
  X(batchnorm_backward, (const Tensor& grad_y, const Tensor& x, const Tensor& gamma,          \
                         const Tensor& mean, const Tensor& invstd, bool training, double eps, \
                         Tensor* grad_x, double beta_x, Tensor* grad_gamma,                   \
                         double beta_gamma, Tensor* grad_beta, double beta_beta))             \
  /* y written; grad_x written or accumulated by beta. */                                     \
  X(maxpool_forward, (const Tensor& x, Tensor& y, const PoolGeometry& g))                     \
  X(maxpool_backward, (const Tensor& grad_y, const Tensor& x, Tensor& grad_x, double beta,    \
                       const PoolGeometry& g))                                                \
  X(upsample2x_forward, (const Tensor& x, Tensor& y))                                         \
  X(upsample2x_backward, (const Tensor& grad_y, Tensor& grad_x, double beta))                 \
  /* x into channels [offset, offset + C_x) of y (written), and back for the backward        \
     (grad_x written or accumulated by beta). */                                              \
  X(concat_forward_part, (const Tensor& x, Tensor& y, int64_t channel_offset))                \
  X(concat_backward_part, (const Tensor& grad_y, Tensor& grad_x, int64_t channel_offset,      \
                           double beta))                                                      \
  /* loss (0-dim, logits dtype) = mean BCE-with-logits over all elements, written. */        \
  X(bce_with_logits_forward, (const Tensor& logits, const Tensor& target, Tensor& loss))      \
  /* grad_x = beta*grad_x + grad_loss/numel * (sigmoid(x) - t); grad_loss read on device. */  \
  X(bce_with_logits_backward, (const Tensor& logits, const Tensor& target,                    \
                               const Tensor& grad_loss, Tensor& grad_x, double beta))         \
  /* sums [3] float64 on the logits' device (written): sum p*t, sum p, sum t with             \
     p = sigmoid(x). */                                                                       \
  X(dice_sums, (const Tensor& logits, const Tensor& target, Tensor& sums))                    \
  /* loss = 1 - (2 I + smooth) / (P + T + smooth), written; 0 when the denominator is 0. */   \
  X(dice_loss_from_sums, (const Tensor& sums, double smooth, Tensor& loss))                   \
  /* grad_x written or accumulated by beta. */                                                \
  X(dice_backward, (const Tensor& logits, const Tensor& target, const Tensor& sums,           \
                    double smooth, const Tensor& grad_loss, Tensor& grad_x, double beta))     \
  /* Synchronized batch norm; sums are [2, C] float64 on the tensors' device. */             \
  /* Per channel sum(x) and sum(x²) of this replica's batch, written. */                      \
  X(batchnorm_channel_sums, (const Tensor& x, Tensor& sums))                                  \
  /* From the sums over all replicas (count values per channel): mean, invstd (written), and \
     the running statistics updated in place as by batchnorm_forward_train. */                \
  X(batchnorm_sync_stats, (const Tensor& sums, double count, double momentum, double eps,     \
                           Tensor& mean, Tensor& invstd, Tensor& running_mean,                \
                           Tensor& running_var))                                              \
  /* y = (x - mean) * invstd * gamma + beta with the given statistics, written. */            \
  X(batchnorm_apply, (const Tensor& x, const Tensor& gamma, const Tensor& beta,               \
                      const Tensor& mean, const Tensor& invstd, Tensor& y))                   \
  /* Per channel sum(dy) and sum(dy * xhat) of this replica's batch, written. */              \
  X(batchnorm_grad_sums, (const Tensor& grad_y, const Tensor& x, const Tensor& mean,          \
                          const Tensor& invstd, Tensor& sums))                                \
  /* dgamma = sum(dy * xhat), dbeta = sum(dy) from this replica's sums; either may be null;   \
     each written or accumulated by its beta. */                                              \
  X(batchnorm_param_grads, (const Tensor& sums, Tensor* grad_gamma, double beta_gamma,        \
                            Tensor* grad_beta, double beta_beta))                             \
  /* dx from the sums over all replicas (count values per channel in all); written or         \
     accumulated by beta_x. */                                                                \
  X(batchnorm_grad_apply, (const Tensor& grad_y, const Tensor& x, const Tensor& gamma,        \
                           const Tensor& mean, const Tensor& invstd, const Tensor& global_sums, \
                           double count, Tensor& grad_x, double beta_x))                      \
  /* Parameter, moments and momentum buffer updated in place. */                              \
  X(adam_update, (Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const AdamStep& s))       \
  X(sgd_update, (Tensor& p, const Tensor& g, Tensor& buf, const SgdStep& s))
