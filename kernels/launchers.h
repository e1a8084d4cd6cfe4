// The launchers of both backends, declared once so their signatures cannot drift apart:
// kernels::cpu (OpenMP loops and OpenBLAS, kernels/cpu/) and kernels::cuda (CUDA kernels over
// the same bodies, cuDNN, kernels/cuda/). The op layer (engine/ops) validates inputs and picks
// the namespace from the inputs' device; launchers trust shapes and dtypes.
// A `beta` argument is 0 (overwrite the destination, which may hold garbage) or 1 (add to it).
#pragma once
#include <vector>

#include "engine/tensor.h"
#include "kernels/bodies/conv.h"
#include "kernels/bodies/optim.h"
#include "kernels/bodies/pool.h"

#define UNETCU_DECLARE_LAUNCHERS                                                             \
  /* dst = beta*dst + alpha*src (elementwise, same shape). */                                 \
  void axpby(Tensor& dst, double alpha, const Tensor& src, double beta);                      \
  void fill(Tensor& dst, double value);                                                       \
  void relu_forward(const Tensor& x, Tensor& y);                                              \
  void relu_backward(const Tensor& grad_y, const Tensor& y, Tensor& grad_x, double beta);     \
  void sigmoid_forward(const Tensor& x, Tensor& y);                                           \
  void sigmoid_backward(const Tensor& grad_y, const Tensor& y, Tensor& grad_x, double beta);  \
  void add_forward(const Tensor& a, const Tensor& b, Tensor& y);                              \
  /* y = conv(x, w) + b; b may be undefined. */                                               \
  void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,           \
                      const ConvGeometry& g);                                                 \
  /* Any of grad_x / grad_w / grad_b may be null (not needed). */                             \
  void conv2d_backward(const Tensor& grad_y, const Tensor& x, const Tensor& w, Tensor* grad_x, \
                       double beta_x, Tensor* grad_w, double beta_w, Tensor* grad_b,          \
                       double beta_b, const ConvGeometry& g);                                 \
  /* Training: batch statistics; writes save_mean/save_invstd [C] and updates the running     \
     statistics (momentum, unbiased variance). */                                             \
  void batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,      \
                               Tensor& y, Tensor& save_mean, Tensor& save_invstd,             \
                               Tensor& running_mean, Tensor& running_var, double momentum,    \
                               double eps);                                                   \
  void batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,       \
                              const Tensor& running_mean, const Tensor& running_var,          \
                              double eps, Tensor& y);                                         \
  /* mean = running_mean, invstd = 1/sqrt(running_var + eps): the constants of eval mode. */  \
  void batchnorm_eval_stats(const Tensor& running_mean, const Tensor& running_var, double eps, \
                            Tensor& mean, Tensor& invstd);                                    \
  /* training = false: mean/invstd are eval_stats and the statistics are constants;           \
     eps is the forward's. */                                                                 \
  void batchnorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& gamma,         \
                          const Tensor& mean, const Tensor& invstd, bool training, double eps, \
                          Tensor* grad_x, double beta_x, Tensor* grad_gamma,                  \
                          double beta_gamma, Tensor* grad_beta, double beta_beta);            \
  void maxpool_forward(const Tensor& x, Tensor& y, const PoolGeometry& g);                    \
  void maxpool_backward(const Tensor& grad_y, const Tensor& x, Tensor& grad_x, double beta,   \
                        const PoolGeometry& g);                                               \
  void upsample2x_forward(const Tensor& x, Tensor& y);                                        \
  void upsample2x_backward(const Tensor& grad_y, Tensor& grad_x, double beta);                \
  /* x into channels [offset, offset + C_x) of y, and back for the backward. */               \
  void concat_forward_part(const Tensor& x, Tensor& y, int64_t channel_offset);               \
  void concat_backward_part(const Tensor& grad_y, Tensor& grad_x, int64_t channel_offset,     \
                            double beta);                                                     \
  /* loss (0-dim, logits dtype) = mean BCE-with-logits over all elements. */                 \
  void bce_with_logits_forward(const Tensor& logits, const Tensor& target, Tensor& loss);     \
  /* grad_x = beta*grad_x + grad_loss/numel * (sigmoid(x) - t); grad_loss read on device. */  \
  void bce_with_logits_backward(const Tensor& logits, const Tensor& target,                   \
                                const Tensor& grad_loss, Tensor& grad_x, double beta);        \
  /* sums [3] float64 on the logits' device: sum p*t, sum p, sum t with p = sigmoid(x). */    \
  void dice_sums(const Tensor& logits, const Tensor& target, Tensor& sums);                   \
  /* loss = 1 - (2 I + smooth) / (P + T + smooth); 0 when the denominator is 0. */            \
  void dice_loss_from_sums(const Tensor& sums, double smooth, Tensor& loss);                  \
  void dice_backward(const Tensor& logits, const Tensor& target, const Tensor& sums,          \
                     double smooth, const Tensor& grad_loss, Tensor& grad_x, double beta);    \
  /* Synchronized batch norm; sums are [2, C] float64 on the tensors' device. */             \
  /* Per channel sum(x) and sum(x²) of this replica's batch. */                               \
  void batchnorm_channel_sums(const Tensor& x, Tensor& sums);                                 \
  /* From the sums over all replicas (count values per channel): mean, invstd, and the       \
     running statistics updated as by batchnorm_forward_train. */                             \
  void batchnorm_sync_stats(const Tensor& sums, double count, double momentum, double eps,    \
                            Tensor& mean, Tensor& invstd, Tensor& running_mean,               \
                            Tensor& running_var);                                             \
  /* y = (x - mean) * invstd * gamma + beta with the given statistics. */                     \
  void batchnorm_apply(const Tensor& x, const Tensor& gamma, const Tensor& beta,              \
                       const Tensor& mean, const Tensor& invstd, Tensor& y);                  \
  /* Per channel sum(dy) and sum(dy * xhat) of this replica's batch. */                       \
  void batchnorm_grad_sums(const Tensor& grad_y, const Tensor& x, const Tensor& mean,         \
                           const Tensor& invstd, Tensor& sums);                               \
  /* dgamma = sum(dy * xhat), dbeta = sum(dy) from this replica's sums. */                    \
  void batchnorm_param_grads(const Tensor& sums, Tensor* grad_gamma, double beta_gamma,       \
                             Tensor* grad_beta, double beta_beta);                            \
  /* dx from the sums over all replicas (count values per channel in all). */                \
  void batchnorm_grad_apply(const Tensor& grad_y, const Tensor& x, const Tensor& gamma,       \
                            const Tensor& mean, const Tensor& invstd, const Tensor& global_sums, \
                            double count, Tensor& grad_x, double beta_x);                     \
  void adam_update(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const AdamStep& s);      \
  void sgd_update(Tensor& p, const Tensor& g, Tensor& buf, const SgdStep& s);

namespace unetcu::kernels::cpu {
UNETCU_DECLARE_LAUNCHERS
inline void add_inplace(Tensor dst, const Tensor& src) { axpby(dst, 1.0, src, 1.0); }
// True when conv2d on this geometry takes the banded strategy (kernels/cpu/conv.cpp) with the
// calling thread's thread budget; for tests that must cover both strategies.
bool conv2d_uses_bands(const ConvGeometry& g, DType dtype);
}  // namespace unetcu::kernels::cpu

namespace unetcu::kernels::cuda {
UNETCU_DECLARE_LAUNCHERS
}  // namespace unetcu::kernels::cuda

// Calls kernels::cuda::fn or kernels::cpu::fn by the device: the one place ops branch on it.
#define UNETCU_LAUNCH(device, fn, ...)                                         \
  ((device).is_cuda() ? ::unetcu::kernels::cuda::fn(__VA_ARGS__)               \
                      : ::unetcu::kernels::cpu::fn(__VA_ARGS__))
