// batch_norm2d: autograd glue. The running statistics are buffers updated in place during a
// training forward; they take no gradient.
#include "engine/ops.h"
#include "engine/ops/op_util.h"
#include "kernels/launchers.h"

#include <algorithm>
#include <cmath>

namespace unetcu {

static thread_local BatchNormSync* g_bn_sync = nullptr;
BatchNormSyncScope::BatchNormSyncScope(BatchNormSync* sync) : previous_(g_bn_sync) { g_bn_sync = sync; }
BatchNormSyncScope::~BatchNormSyncScope() { g_bn_sync = previous_; }
BatchNormSync* BatchNormSyncScope::current() { return g_bn_sync; }

// Training-mode batch norm over all replicas: the per-channel sums (and the element count) are
// all-reduced, so every replica normalises with the statistics of the whole global batch; the
// backward all-reduces sum(dy) and sum(dy * xhat) likewise (as PyTorch's SyncBatchNorm).
// dgamma/dbeta stay local: data parallelism averages them with the other gradients.
static Tensor batch_norm2d_synced(BatchNormSync* sync, const Tensor& x, const Tensor& gamma,
                                  const Tensor& beta, Tensor& running_mean, Tensor& running_var,
                                  double momentum, double eps) {
  UNETCU_CHECK(x.device().is_cpu(), "synchronized batch norm runs on CPU devices; ",
               x.device().str(), " is not supported yet");
  const int64_t C = x.dim(1);
  // [sum x (C), sum x² (C), count]
  Tensor stats = Tensor::empty({2 * C + 1}, DType::F64, x.device());
  kernels::cpu::batchnorm_channel_sums(x, stats);  // fills the first 2C
  stats.data<double>()[2 * C] = double(x.dim(0) * x.dim(2) * x.dim(3));
  sync->all_reduce_sum(stats);
  const double* s = stats.data<double>();
  const double M = s[2 * C];
  UNETCU_CHECK(M > 1, "batch_norm2d: training needs more than one value per channel");
  Tensor mean = Tensor::empty({C}, x.dtype(), x.device());
  Tensor invstd = Tensor::empty({C}, x.dtype(), x.device());
  for (int64_t c = 0; c < C; ++c) {
    const double m = s[c] / M;
    const double var = std::max(0.0, s[C + c] / M - m * m);
    mean.set(c, m);
    invstd.set(c, 1.0 / std::sqrt(var + eps));
    running_mean.set(c, (1 - momentum) * running_mean.at(c) + momentum * m);
    running_var.set(c, (1 - momentum) * running_var.at(c) + momentum * var * M / (M - 1));
  }
  Tensor y = ops_detail::empty_like(x);
  kernels::cpu::batchnorm_apply(x, gamma, beta, mean, invstd, y);
  if (Tape::should_record({&x, &gamma, &beta})) {
    Tape::record("batch_norm2d_sync", {x, gamma, beta}, {y},
                 [x, gamma, mean, invstd, sync, M](BackwardContext& ctx) {
                   const int64_t C = x.dim(1);
                   Tensor local = Tensor::empty({2 * C}, DType::F64, x.device());
                   kernels::cpu::batchnorm_grad_sums(ctx.grad_output(0), x, mean, invstd, local);
                   const double* l = local.data<double>();
                   double beta;
                   if (ctx.needs_grad(1)) {  // dgamma = sum(dy * xhat), this replica's
                     Tensor gg = ctx.grad_input(1, &beta);
                     for (int64_t c = 0; c < C; ++c) gg.set(c, (beta ? gg.at(c) : 0.0) + l[C + c]);
                   }
                   if (ctx.needs_grad(2)) {  // dbeta = sum(dy)
                     Tensor gb = ctx.grad_input(2, &beta);
                     for (int64_t c = 0; c < C; ++c) gb.set(c, (beta ? gb.at(c) : 0.0) + l[c]);
                   }
                   Tensor global = local.clone();
                   sync->all_reduce_sum(global);  // every replica, also when x needs no grad
                   if (ctx.needs_grad(0)) {
                     Tensor gx = ctx.grad_input(0, &beta);
                     kernels::cpu::batchnorm_grad_apply(ctx.grad_output(0), x, gamma, mean, invstd,
                                                        global, M, gx, beta);
                   }
                 });
  }
  return y;
}

Tensor batch_norm2d(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                    Tensor& running_mean, Tensor& running_var, bool training, double momentum,
                    double eps) {
  using namespace ops_detail;
  check_backend("batch_norm2d", x);
  check_ndim("batch_norm2d", x, 4, "input");
  const int64_t C = x.dim(1);
  for (const Tensor* t : {&gamma, &beta, const_cast<const Tensor*>(&running_mean),
                          const_cast<const Tensor*>(&running_var)}) {
    check_same_dtype_device("batch_norm2d", x, *t);
    UNETCU_CHECK(t->ndim() == 1 && t->dim(0) == C, "batch_norm2d: per-channel tensor ",
                 shape_str(t->shape()), " does not match ", C, " channels");
  }
  if (training && BatchNormSyncScope::current())
    return batch_norm2d_synced(BatchNormSyncScope::current(), x, gamma, beta, running_mean,
                               running_var, momentum, eps);
  Tensor y = empty_like(x);
  Tensor mean, invstd;
  if (training) {
    UNETCU_CHECK(x.dim(0) * x.dim(2) * x.dim(3) > 1,
                 "batch_norm2d: training needs more than one value per channel, got input ",
                 shape_str(x.shape()));
    mean = Tensor::empty({C}, x.dtype(), x.device());
    invstd = Tensor::empty({C}, x.dtype(), x.device());
    UNETCU_LAUNCH(x.device(), batchnorm_forward_train, x, gamma, beta, y, mean, invstd, running_mean,
                                          running_var, momentum, eps);
  } else {
    UNETCU_LAUNCH(x.device(), batchnorm_forward_eval, x, gamma, beta, running_mean, running_var, eps, y);
  }

  if (Tape::should_record({&x, &gamma, &beta})) {
    // The backward fills all three gradient buffers in one kernel call: they must differ.
    UNETCU_CHECK(!gamma.same_storage(beta) && !x.same_storage(gamma) && !x.same_storage(beta),
                 "batch_norm2d: input, weight and bias must be distinct tensors");
    if (!training) {  // the backward of eval mode uses the running statistics as constants
      mean = Tensor::empty({C}, x.dtype(), x.device());
      invstd = Tensor::empty({C}, x.dtype(), x.device());
      UNETCU_LAUNCH(x.device(), batchnorm_eval_stats, running_mean, running_var, eps, mean, invstd);
    }
    Tape::record("batch_norm2d", {x, gamma, beta}, {y},
                 [x, gamma, mean, invstd, training, eps](BackwardContext& ctx) {
                   Tensor gx, gg, gb;
                   double bx = 0, bg = 0, bb = 0;
                   if (ctx.needs_grad(0)) gx = ctx.grad_input(0, &bx);
                   if (ctx.needs_grad(1)) gg = ctx.grad_input(1, &bg);
                   if (ctx.needs_grad(2)) gb = ctx.grad_input(2, &bb);
                   UNETCU_LAUNCH(x.device(), batchnorm_backward, 
                       ctx.grad_output(0), x, gamma, mean, invstd, training, eps,
                       gx.defined() ? &gx : nullptr, bx, gg.defined() ? &gg : nullptr, bg,
                       gb.defined() ? &gb : nullptr, bb);
                 });
  }
  return y;
}

}  // namespace unetcu
