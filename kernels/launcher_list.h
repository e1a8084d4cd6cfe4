// The launchers of both backends, listed once: kernels/launchers.h declares them for
// kernels::cpu and kernels::cuda from this list, and kernels/cuda/stubs.cpp makes the no-CUDA
// stubs from it, so adding an op is one row here plus its two bodies.
//
// Each row is X(name, (parameters)); every launcher returns void. Launchers trust shapes and
// dtypes (the op layer checked them). Activations may be bfloat16 (read as float32, rounded
// once on store) and NCHW or NHWC (TensorRef::format); per-channel parameters and statistics
// are then float32; outputs and gradients take their tensor's format. A `beta` argument is 0 (overwrite the destination, which
// may hold garbage) or 1 (add to it): that is what "written or accumulated" means below.
#pragma once

#define UNETCU_LAUNCHERS(X)                                                                        \
  /* dst = beta*dst + alpha*src (elementwise, same shape): written or accumulated by beta. */      \
  X(axpby, (const TensorRef& dst, double alpha, const TensorRef& src, double beta))                \
  /* dst written. */                                                                               \
  X(fill, (const TensorRef& dst, double value))                                                    \
  /* dst = convert(src): same dims and device, any dtypes (float32, float64, bfloat16; rounding    \
     to nearest even) and memory formats; written or accumulated by beta (the sum computed in      \
     float32, or float64 when either side is float64). */                                          \
  X(convert, (const TensorRef& src, const TensorRef& dst, double beta))                            \
  /* y written; grad_x written or accumulated by beta. */                                          \
  X(relu_forward, (const TensorRef& x, const TensorRef& y))                                        \
  X(relu_backward, (const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x,          \
                    double beta))                                                                  \
  X(sigmoid_forward, (const TensorRef& x, const TensorRef& y))                                     \
  X(sigmoid_backward, (const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x,       \
                       double beta))                                                               \
  X(add_forward, (const TensorRef& a, const TensorRef& b, const TensorRef& y))                     \
  /* y = conv(x, w) + b, written; b may be absent. x, w, b, y one dtype; y in x's format, w OIHW   \
     or OHWI (its format). A bf16 y with a bias is rounded twice on a GPU (cuDNN's result, then    \
     + b, as PyTorch's CUDA path), once on the CPU. */                                             \
  X(conv2d_forward, (const TensorRef& x, const TensorRef& w, const TensorRef& b,                   \
                     const TensorRef& y, const ConvGeometry& g))                                   \
  /* Any of grad_x / grad_w / grad_b may be absent (not needed); each written or accumulated by    \
     its beta. */                                                                                  \
  X(conv2d_backward, (const TensorRef& grad_y, const TensorRef& x, const TensorRef& w,             \
                      const TensorRef& grad_x, double beta_x, const TensorRef& grad_w,             \
                      double beta_w, const TensorRef& grad_b, double beta_b,                       \
                      const ConvGeometry& g))                                                      \
  /* Training: batch statistics; writes y and save_mean/save_invstd [C] and updates the running    \
     statistics in place (momentum, unbiased variance). */                                         \
  X(batchnorm_forward_train, (const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,   \
                              const TensorRef& y, const TensorRef& save_mean,                      \
                              const TensorRef& save_invstd, const TensorRef& running_mean,         \
                              const TensorRef& running_var, double momentum, double eps))          \
  /* y written. */                                                                                 \
  X(batchnorm_forward_eval, (const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,    \
                             const TensorRef& running_mean, const TensorRef& running_var,          \
                             double eps, const TensorRef& y))                                      \
  /* mean = running_mean, invstd = 1/sqrt(running_var + eps) (written): the constants of eval      \
     mode. */                                                                                      \
  X(batchnorm_eval_stats, (const TensorRef& running_mean, const TensorRef& running_var,            \
                           double eps, const TensorRef& mean, const TensorRef& invstd))            \
  /* training = false: mean/invstd are eval_stats and the statistics are constants; eps is the     \
     forward's. Gradients may be absent; each written or accumulated by its beta. */               \
  X(batchnorm_backward, (const TensorRef& grad_y, const TensorRef& x, const TensorRef& gamma,      \
                         const TensorRef& mean, const TensorRef& invstd, bool training,            \
                         double eps, const TensorRef& grad_x, double beta_x,                       \
                         const TensorRef& grad_gamma, double beta_gamma,                           \
                         const TensorRef& grad_beta, double beta_beta))                            \
  /* Fused batch norm + residual add + ReLU (engine/ops/batchnorm.cpp). Training statistics in     \
     one pass (shifted sums): mean, invstd written, running statistics updated in place as by      \
     batchnorm_forward_train. */                                                                   \
  X(batchnorm_stats, (const TensorRef& x, const TensorRef& mean, const TensorRef& invstd,          \
                      const TensorRef& running_mean, const TensorRef& running_var,                 \
                      double momentum, double eps))                                                \
  /* y = relu((x - mean) * invstd * gamma + beta + residual), written; residual may be absent. */  \
  X(batchnorm_add_relu_forward, (const TensorRef& x, const TensorRef& gamma,                       \
                                 const TensorRef& beta, const TensorRef& mean,                     \
                                 const TensorRef& invstd, const TensorRef& residual,               \
                                 const TensorRef& y))                                              \
  /* g = grad_y where the forward's output y > 0; grad_residual = g; dgamma, dbeta and dx of       \
     the batch norm for g (training: batch statistics, else constants). With a residual y is       \
     given and read; without one y may be absent, and the mask is then recomputed from x, gamma    \
     and beta with the forward's bits (bn_relu_passes), grad_residual absent. Any gradient may     \
     be absent; each written or accumulated by its beta. */                                        \
  X(batchnorm_add_relu_backward, (const TensorRef& grad_y, const TensorRef& y,                     \
                                  const TensorRef& x, const TensorRef& gamma,                      \
                                  const TensorRef& beta, const TensorRef& mean,                    \
                                  const TensorRef& invstd, bool training,                          \
                                  const TensorRef& grad_x, double beta_x,                          \
                                  const TensorRef& grad_gamma, double beta_gamma,                  \
                                  const TensorRef& grad_beta, double beta_beta,                    \
                                  const TensorRef& grad_residual, double beta_residual))           \
  /* y written; grad_x written or accumulated by beta. */                                          \
  X(maxpool_forward, (const TensorRef& x, const TensorRef& y, const PoolGeometry& g))              \
  X(maxpool_backward, (const TensorRef& grad_y, const TensorRef& x, const TensorRef& grad_x,       \
                       double beta, const PoolGeometry& g))                                        \
  X(upsample2x_forward, (const TensorRef& x, const TensorRef& y))                                  \
  X(upsample2x_backward, (const TensorRef& grad_y, const TensorRef& grad_x, double beta))          \
  /* x into channels [offset, offset + C_x) of y (written), and back for the backward (grad_x      \
     written or accumulated by beta). */                                                           \
  X(concat_forward_part, (const TensorRef& x, const TensorRef& y, int64_t channel_offset))         \
  X(concat_backward_part, (const TensorRef& grad_y, const TensorRef& grad_x,                       \
                           int64_t channel_offset, double beta))                                   \
  /* Nearest ×2 upsample of x [N, Cx, H, W] written into channels [0, Cx) of y                     \
     [N, Cx + Cs, 2H, 2W] and skip [N, Cs, 2H, 2W] copied into [Cx, Cx + Cs), one pass (y          \
     written). Backward: grad_x (2×2 block sums) and grad_skip (a copy) in one pass; either may    \
     be absent; each written or accumulated by its beta. x_channels is Cx. */                      \
  X(upsample2x_concat_forward, (const TensorRef& x, const TensorRef& skip, const TensorRef& y))    \
  X(upsample2x_concat_backward, (const TensorRef& grad_y, const TensorRef& grad_x, double beta_x,  \
                                 const TensorRef& grad_skip, double beta_skip,                     \
                                 int64_t x_channels))                                              \
  /* Losses. The target has the logits' shape for one channel (values in [0, 1]) and shape       \
     [N, 1, H, W] for C >= 2 channels (class indices); a negative target is an ignored pixel      \
     (bodies/loss.h). The loss is 0-dim, the logits' dtype (float32 for bf16 logits), written.    \
     sums are float64 on the logits' device, written by the forward and read by the backward.    \
     Backwards write grad_x or accumulate into it by beta; grad_loss is read on the device. */   \
  /* sums [2] = (sum of BCE-with-logits over counted elements, their count); loss = the mean. */ \
  X(bce_with_logits_forward, (const TensorRef& logits, const TensorRef& target,                    \
                              const TensorRef& sums, const TensorRef& loss))                       \
  /* grad_x = grad_loss/count * (sigmoid(x) - t), 0 where ignored. */                             \
  X(bce_with_logits_backward, (const TensorRef& logits, const TensorRef& target,                   \
                               const TensorRef& sums, const TensorRef& grad_loss,                  \
                               const TensorRef& grad_x, double beta))                              \
  /* sums [3]: sum p*t, sum p, sum t over counted elements, p = sigmoid(x). */                     \
  X(dice_sums, (const TensorRef& logits, const TensorRef& target, const TensorRef& sums))          \
  /* loss = 1 - (2 I + smooth) / (P + T + smooth); 0 when the denominator is 0. */                 \
  X(dice_loss_from_sums, (const TensorRef& sums, double smooth, const TensorRef& loss))            \
  X(dice_backward, (const TensorRef& logits, const TensorRef& target, const TensorRef& sums,       \
                    double smooth, const TensorRef& grad_loss, const TensorRef& grad_x,            \
                    double beta))                                                                  \
  /* Softmax cross-entropy over C >= 2 channels: sums [2] = (sum over counted pixels of            \
     logsumexp(x) - x_t, their count); loss = the mean (0 with no counted pixel). */               \
  X(softmax_ce_forward, (const TensorRef& logits, const TensorRef& target, const TensorRef& sums,  \
                         const TensorRef& loss))                                                   \
  /* grad_x = grad_loss/count * (softmax(x) - onehot(t)), 0 at ignored pixels. */                  \
  X(softmax_ce_backward, (const TensorRef& logits, const TensorRef& target, const TensorRef& sums, \
                          const TensorRef& grad_loss, const TensorRef& grad_x, double beta))       \
  /* Multiclass soft Dice (bodies/loss.h): sums [3, C] = per class sum p_c [t = c], sum p_c,       \
     sum [t = c] over counted pixels, p = softmax(x). */                                           \
  X(multiclass_dice_sums, (const TensorRef& logits, const TensorRef& target,                       \
                           const TensorRef& sums))                                                 \
  X(multiclass_dice_loss_from_sums, (const TensorRef& sums, double smooth, const TensorRef& loss)) \
  X(multiclass_dice_backward, (const TensorRef& logits, const TensorRef& target,                   \
                               const TensorRef& sums, double smooth, const TensorRef& grad_loss,   \
                               const TensorRef& grad_x, double beta))                              \
  /* Confusion matrix: counts [K, K] float64 (K = 2 for one channel, else C), accumulated:       \
     counts[truth * K + predicted] += 1 per counted pixel (bodies/loss.h predicted_class,        \
     target_class). */                                                                           \
  X(confusion_update, (const TensorRef& logits, const TensorRef& target, const TensorRef& counts)) \
  /* Synchronized batch norm; sums are [2, C] float64 on the tensors' device. */                   \
  /* Per channel sum(x) and sum(x²) of this replica's batch, written. */                           \
  X(batchnorm_channel_sums, (const TensorRef& x, const TensorRef& sums))                           \
  /* From the sums over all replicas (count values per channel): mean, invstd (written), and       \
     the running statistics updated in place as by batchnorm_forward_train. */                     \
  X(batchnorm_sync_stats, (const TensorRef& sums, double count, double momentum, double eps,       \
                           const TensorRef& mean, const TensorRef& invstd,                         \
                           const TensorRef& running_mean, const TensorRef& running_var))           \
  /* y = (x - mean) * invstd * gamma + beta with the given statistics, written. */                 \
  X(batchnorm_apply, (const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,           \
                      const TensorRef& mean, const TensorRef& invstd, const TensorRef& y))         \
  /* Per channel sum(dy) and sum(dy * xhat) of this replica's batch, written. */                   \
  X(batchnorm_grad_sums, (const TensorRef& grad_y, const TensorRef& x, const TensorRef& mean,      \
                          const TensorRef& invstd, const TensorRef& sums))                         \
  /* dgamma = sum(dy * xhat), dbeta = sum(dy) from this replica's sums; either may be absent;      \
     each written or accumulated by its beta. */                                                   \
  X(batchnorm_param_grads, (const TensorRef& sums, const TensorRef& grad_gamma,                    \
                            double beta_gamma, const TensorRef& grad_beta, double beta_beta))      \
  /* dx from the sums over all replicas (count values per channel in all); written or              \
     accumulated by beta_x. */                                                                     \
  X(batchnorm_grad_apply, (const TensorRef& grad_y, const TensorRef& x, const TensorRef& gamma,    \
                           const TensorRef& mean, const TensorRef& invstd,                         \
                           const TensorRef& global_sums, double count, const TensorRef& grad_x,    \
                           double beta_x))                                                         \
  /* Parameter, moments and momentum buffer updated in place. */                                   \
  X(adam_update, (const TensorRef& p, const TensorRef& g, const TensorRef& m, const TensorRef& v,  \
                  const AdamStep& s))                                                              \
  /* adam_update over many parameters at once, each with its own scalars, in one pass: on a        \
     GPU one launch per 256 tensors (every parameter of the UNet in one). The same per-element     \
     arithmetic as adam_update, so the results are the same bits. */                               \
  X(adam_update_many, (const std::vector<AdamTensor>& tensors))                                    \
  X(sgd_update, (const TensorRef& p, const TensorRef& g, const TensorRef& buf, const SgdStep& s))  \
  /* Gradient clipping by the total norm (torch.nn.utils.clip_grad_norm_). out (float64 [1] on     \
     the tensors' device) = the sum of x² over every element of every tensor (float32, or float64  \
     on the CPU; any format), written; accumulated in float64 in a fixed order: the same bits      \
     every run. */                                                                                 \
  X(square_sum_many, (const std::vector<TensorRef>& xs, const TensorRef& out))                     \
  /* Every x multiplied in place by clip_coefficient(square_sum[0], max_norm)                      \
     (bodies/optim.h), square_sum float64 [1] read on the tensors' device. */              \
  X(clip_scale_many, (const std::vector<TensorRef>& xs, const TensorRef& square_sum,               \
                      double max_norm))                                                            \
  /* stats (float64 [3], the square sum's device) updated in place by clip_stats_update            \
     (bodies/optim.h) for one clipped step. */                                             \
  X(clip_stats_update, (const TensorRef& square_sum, double max_norm, const TensorRef& stats))
