// CPU launchers: OpenMP loops over the bodies in kernels/*.h, GEMM through OpenBLAS.
// Inputs are validated by the op layer (engine/ops); launchers trust shapes and dtypes.
// A `beta` argument is 0 (overwrite the destination, which may hold garbage) or 1 (add to it).
#pragma once
#include <vector>

#include "engine/tensor.h"
#include "kernels/conv.h"
#include "kernels/optim.h"
#include "kernels/pool.h"

namespace unetcu::kernels::cpu {

// dst = beta*dst + alpha*src (elementwise, same shape).
void axpby(Tensor& dst, double alpha, const Tensor& src, double beta);
inline void add_inplace(Tensor dst, const Tensor& src) { axpby(dst, 1.0, src, 1.0); }

void relu_forward(const Tensor& x, Tensor& y);
void relu_backward(const Tensor& grad_y, const Tensor& y, Tensor& grad_x, double beta);
void sigmoid_forward(const Tensor& x, Tensor& y);
void sigmoid_backward(const Tensor& grad_y, const Tensor& y, Tensor& grad_x, double beta);
void add_forward(const Tensor& a, const Tensor& b, Tensor& y);

// y = conv(x, w) + b. b may be undefined.
void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                    const ConvGeometry& g);
// True when conv2d on this geometry takes the banded strategy (see kernels/cpu/conv.cpp)
// with the calling thread's thread budget; for tests that must cover both strategies.
bool conv2d_uses_bands(const ConvGeometry& g, DType dtype);
// Any of grad_x / grad_w / grad_b may be null (not needed).
void conv2d_backward(const Tensor& grad_y, const Tensor& x, const Tensor& w, Tensor* grad_x,
                     double beta_x, Tensor* grad_w, double beta_w, Tensor* grad_b, double beta_b,
                     const ConvGeometry& g);

// Training: batch statistics; writes save_mean/save_invstd [C] and updates the running
// statistics. Eval: running statistics.
void batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                             Tensor& save_mean, Tensor& save_invstd, Tensor& running_mean,
                             Tensor& running_var, double momentum, double eps);
void batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                            const Tensor& running_mean, const Tensor& running_var, double eps,
                            Tensor& y);
// training = false: mean/invstd are the running ones and the statistics are constants.
void batchnorm_backward(const Tensor& grad_y, const Tensor& x, const Tensor& gamma,
                        const Tensor& mean, const Tensor& invstd, bool training, Tensor* grad_x,
                        double beta_x, Tensor* grad_gamma, double beta_gamma, Tensor* grad_beta,
                        double beta_beta);

void maxpool_forward(const Tensor& x, Tensor& y, const PoolGeometry& g);
void maxpool_backward(const Tensor& grad_y, const Tensor& x, Tensor& grad_x, double beta,
                      const PoolGeometry& g);

void upsample2x_forward(const Tensor& x, Tensor& y);
void upsample2x_backward(const Tensor& grad_y, Tensor& grad_x, double beta);

// Copies x into channels [channel_offset, channel_offset + C_x) of y, and back for backward.
void concat_forward_part(const Tensor& x, Tensor& y, int64_t channel_offset);
void concat_backward_part(const Tensor& grad_y, Tensor& grad_x, int64_t channel_offset,
                          double beta);

// Mean BCE-with-logits over all elements.
double bce_with_logits_forward(const Tensor& logits, const Tensor& target);
// grad_x = beta*grad_x + scale * (sigmoid(x) - t); scale = upstream grad / numel.
void bce_with_logits_backward(const Tensor& logits, const Tensor& target, double scale,
                              Tensor& grad_x, double beta);
struct DiceSums {
  double intersection, prob_sum, target_sum;
};
DiceSums dice_sums(const Tensor& logits, const Tensor& target);
void dice_backward(const Tensor& logits, const Tensor& target, const DiceSums& s, double smooth,
                   double scale, Tensor& grad_x, double beta);

void adam_update(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const AdamStep& s);
void sgd_update(Tensor& p, const Tensor& g, Tensor& buf, const SgdStep& s);

}  // namespace unetcu::kernels::cpu
