// kernels::cuda for builds without the CUDA backend. No CUDA tensor can be made in such a
// build (its allocation throws first), so these are never reached; they keep the op layer's
// single dispatch point (UNETCU_LAUNCH) linkable.
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {

[[noreturn]] static void no_cuda() { throw Error("this build has no CUDA backend"); }

void axpby(Tensor&, double, const Tensor&, double) { no_cuda(); }
void fill(Tensor&, double) { no_cuda(); }
void relu_forward(const Tensor&, Tensor&) { no_cuda(); }
void relu_backward(const Tensor&, const Tensor&, Tensor&, double) { no_cuda(); }
void sigmoid_forward(const Tensor&, Tensor&) { no_cuda(); }
void sigmoid_backward(const Tensor&, const Tensor&, Tensor&, double) { no_cuda(); }
void add_forward(const Tensor&, const Tensor&, Tensor&) { no_cuda(); }
void conv2d_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&, const ConvGeometry&) {
  no_cuda();
}
void conv2d_backward(const Tensor&, const Tensor&, const Tensor&, Tensor*, double, Tensor*, double,
                     Tensor*, double, const ConvGeometry&) {
  no_cuda();
}
void batchnorm_forward_train(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&,
                             Tensor&, Tensor&, double, double) {
  no_cuda();
}
void batchnorm_forward_eval(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, double, Tensor&) {
  no_cuda();
}
void batchnorm_eval_stats(const Tensor&, const Tensor&, double, Tensor&, Tensor&) { no_cuda(); }
void batchnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        bool, double, Tensor*, double, Tensor*, double, Tensor*, double) {
  no_cuda();
}
void maxpool_forward(const Tensor&, Tensor&, const PoolGeometry&) { no_cuda(); }
void maxpool_backward(const Tensor&, const Tensor&, Tensor&, double, const PoolGeometry&) {
  no_cuda();
}
void upsample2x_forward(const Tensor&, Tensor&) { no_cuda(); }
void upsample2x_backward(const Tensor&, Tensor&, double) { no_cuda(); }
void concat_forward_part(const Tensor&, Tensor&, int64_t) { no_cuda(); }
void concat_backward_part(const Tensor&, Tensor&, int64_t, double) { no_cuda(); }
void bce_with_logits_forward(const Tensor&, const Tensor&, Tensor&) { no_cuda(); }
void bce_with_logits_backward(const Tensor&, const Tensor&, const Tensor&, Tensor&, double) {
  no_cuda();
}
void dice_sums(const Tensor&, const Tensor&, Tensor&) { no_cuda(); }
void dice_loss_from_sums(const Tensor&, double, Tensor&) { no_cuda(); }
void dice_backward(const Tensor&, const Tensor&, const Tensor&, double, const Tensor&, Tensor&,
                   double) {
  no_cuda();
}
void adam_update(Tensor&, const Tensor&, Tensor&, Tensor&, const AdamStep&) { no_cuda(); }
void sgd_update(Tensor&, const Tensor&, Tensor&, const SgdStep&) { no_cuda(); }

}  // namespace unetcu::kernels::cuda

namespace unetcu::kernels::cuda {
void batchnorm_channel_sums(const Tensor&, Tensor&) { no_cuda(); }
void batchnorm_sync_stats(const Tensor&, double, double, double, Tensor&, Tensor&, Tensor&, Tensor&) {
  no_cuda();
}
void batchnorm_apply(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                     Tensor&) {
  no_cuda();
}
void batchnorm_grad_sums(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&) {
  no_cuda();
}
void batchnorm_param_grads(const Tensor&, Tensor*, double, Tensor*, double) { no_cuda(); }
void batchnorm_grad_apply(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, double, Tensor&, double) {
  no_cuda();
}
}  // namespace unetcu::kernels::cuda
