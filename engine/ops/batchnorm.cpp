// batch_norm2d, and batch norm fused with ReLU (batch_norm_relu) and with the residual add and
// ReLU (batch_norm_add_relu): autograd glue. The running statistics are buffers updated in
// place during a training forward; they take no gradient.
//
// Types and formats: x (and y, the residual and their gradients) is float32, float64 (CPU) or
// bfloat16, NCHW or NHWC, y in x's format. The per-channel tensors (gamma, beta, the running
// statistics, the saved mean and invstd, and the gradients of gamma and beta) are in the compute
// dtype: float32 when x is bfloat16 (mixed precision: parameters and statistics stay float32),
// x's dtype otherwise.
#include "engine/ops.h"
#include "engine/ops/op_util.h"
#include "kernels/launchers.h"

#include <algorithm>
#include <cmath>

namespace unetcu {

namespace {

DType compute_dtype(const Tensor& x) { return x.dtype() == DType::BF16 ? DType::F32 : x.dtype(); }

// The checks every batch-norm op makes at its entry: x a 4-dimensional activation of a dtype
// and format the kernels take; the per-channel tensors [C] in the compute dtype on x's device;
// a residual of x's shape, dtype, device and format.
void check_bn_args(const char* op, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                   const Tensor& running_mean, const Tensor& running_var, const Tensor* residual) {
  using namespace ops_detail;
  check_backend(op, x, Accepts{true, true});
  check_ndim(op, x, 4, "input");
  const int64_t C = x.dim(1);
  const DType cd = compute_dtype(x);
  for (const Tensor* t : {&gamma, &beta, &running_mean, &running_var}) {
    UNETCU_CHECK(t->defined(), op, ": undefined per-channel tensor");
    UNETCU_CHECK(t->dtype() == cd, op, ": per-channel tensor is ", dtype_name(t->dtype()),
                 ", expected ", dtype_name(cd), " for a ", dtype_name(x.dtype()), " input");
    UNETCU_CHECK(t->device() == x.device(), op, ": device mismatch (", x.device().str(), " vs ",
                 t->device().str(), ")");
    UNETCU_CHECK(t->ndim() == 1 && t->dim(0) == C, op, ": per-channel tensor ",
                 shape_str(t->shape()), " does not match ", C, " channels");
  }
  if (residual) {
    check_same_dtype_device(op, x, *residual);
    check_same_shape(op, x, *residual);
    check_same_format(op, x, *residual);
  }
}

}  // namespace

static thread_local BatchNormSync* g_bn_sync = nullptr;
BatchNormSyncScope::BatchNormSyncScope(BatchNormSync* sync) : previous_(g_bn_sync) { g_bn_sync = sync; }
BatchNormSyncScope::~BatchNormSyncScope() { g_bn_sync = previous_; }
BatchNormSync* BatchNormSyncScope::current() { return g_bn_sync; }

// Training-mode batch norm over all replicas: the per-channel sums are all-reduced, so every
// replica normalises with the statistics of the whole global batch (replicas hold equal
// shards: count = local count x replicas); the backward all-reduces sum(dy) and
// sum(dy * xhat) likewise (as PyTorch's SyncBatchNorm). dgamma/dbeta stay local: data
// parallelism averages them with the other gradients. No host synchronisation on a GPU.
static Tensor batch_norm2d_synced(BatchNormSync* sync, const Tensor& x, const Tensor& gamma,
                                  const Tensor& beta, Tensor& running_mean, Tensor& running_var,
                                  double momentum, double eps) {
  const Device dev = x.device();
  const int64_t C = x.dim(1);
  const double count = double(x.dim(0) * x.dim(2) * x.dim(3)) * sync->world_size();
  UNETCU_CHECK(count > 1, "batch_norm2d: training needs more than one value per channel");
  const double n = double(x.numel()), bytes = ops_detail::bytes_of({&x});
  ProfileRange range("batch_norm2d_sync", "op", 7 * n, 3 * bytes);
  Tensor sums = Tensor::empty({2 * C}, DType::F64, dev);
  UNETCU_LAUNCH(dev, batchnorm_channel_sums, x, sums);
  sync->all_reduce_sum(sums);
  Tensor mean = Tensor::empty({C}, compute_dtype(x), dev);
  Tensor invstd = Tensor::empty({C}, compute_dtype(x), dev);
  UNETCU_LAUNCH(dev, batchnorm_sync_stats, sums, count, momentum, eps, mean, invstd, running_mean,
                running_var);
  Tensor y = ops_detail::empty_like(x);
  UNETCU_LAUNCH(dev, batchnorm_apply, x, gamma, beta, mean, invstd, y);
  if (Tape::should_record({&x, &gamma, &beta})) {
    Tape::record("batch_norm2d_sync", {x, gamma, beta}, {y},
                 [x, gamma, mean, invstd, sync, count](BackwardContext& ctx) {
                   const Device dev = x.device();
                   Tensor local = Tensor::empty({2 * x.dim(1)}, DType::F64, dev);
                   UNETCU_LAUNCH(dev, batchnorm_grad_sums, ctx.grad_output(0), x, mean, invstd,
                                 local);
                   Tensor gg, gb;
                   double bg = 0, bb = 0;
                   if (ctx.needs_grad(1)) gg = ctx.grad_input(1, &bg);
                   if (ctx.needs_grad(2)) gb = ctx.grad_input(2, &bb);
                   UNETCU_LAUNCH(dev, batchnorm_param_grads, local, gg, bg, gb, bb);
                   Tensor global = local.clone();
                   sync->all_reduce_sum(global);  // every replica, also when x needs no grad
                   if (ctx.needs_grad(0)) {
                     double bx;
                     Tensor gx = ctx.grad_input(0, &bx);
                     UNETCU_LAUNCH(dev, batchnorm_grad_apply, ctx.grad_output(0), x, gamma, mean,
                                   invstd, global, count, gx, bx);
                   }
                 }, OpCost{9 * n, 4 * bytes});
  }
  return y;
}

Tensor batch_norm2d(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                    Tensor& running_mean, Tensor& running_var, bool training, double momentum,
                    double eps) {
  using namespace ops_detail;
  check_bn_args("batch_norm2d", x, gamma, beta, running_mean, running_var, nullptr);
  const int64_t C = x.dim(1);
  const DType cd = compute_dtype(x);
  if (training && BatchNormSyncScope::current())
    return batch_norm2d_synced(BatchNormSyncScope::current(), x, gamma, beta, running_mean,
                               running_var, momentum, eps);
  Tensor y = empty_like(x);
  Tensor mean, invstd;
  const double n = double(x.numel()), bytes = bytes_of({&x, &y});
  ProfileRange range("batch_norm2d", "op", 7 * n, 1.5 * bytes);
  if (training) {
    UNETCU_CHECK(x.dim(0) * x.dim(2) * x.dim(3) > 1,
                 "batch_norm2d: training needs more than one value per channel, got input ",
                 shape_str(x.shape()));
    mean = Tensor::empty({C}, cd, x.device());
    invstd = Tensor::empty({C}, cd, x.device());
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
      mean = Tensor::empty({C}, cd, x.device());
      invstd = Tensor::empty({C}, cd, x.device());
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
                       gx, bx, gg, bg, gb, bb);
                 }, OpCost{9 * n, 2 * bytes});
  }
  return y;
}

// relu(batch_norm2d(x) + residual) (no add without a residual) in one elementwise pass each way.
// Forward: the statistics (training: one pass of shifted sums; eval: the running statistics),
// then y in one pass over x (and the residual). Backward: one reduction pass over (dy, x), and
// y with a residual, for sum(g) and sum(g * xhat), g = dy where y > 0 (dgamma, dbeta and the
// sums dx needs), then one pass writing dx and the residual's gradient g. Without a residual
// the mask y > 0 is recomputed from x, gamma and beta with the forward's bits, so y is not
// read (one value fewer per element in each pass). Saved: x, and y with a residual (not the
// unfused ops' normalised and summed intermediates). Under synchronized batch norm in training
// the statistics cross replicas: the unfused ops run.
static Tensor batch_norm_add_relu_impl(const char* op, const Tensor& x, const Tensor& gamma,
                                       const Tensor& beta, const Tensor* residual,
                                       Tensor& running_mean, Tensor& running_var, bool training,
                                       double momentum, double eps) {
  using namespace ops_detail;
  check_bn_args(op, x, gamma, beta, running_mean, running_var, residual);
  const int64_t C = x.dim(1);
  if (training && BatchNormSyncScope::current()) {
    Tensor h = batch_norm2d(x, gamma, beta, running_mean, running_var, true, momentum, eps);
    return relu(residual ? add(h, *residual) : h);
  }
  const Device dev = x.device();
  Tensor mean = Tensor::empty({C}, compute_dtype(x), dev);
  Tensor invstd = Tensor::empty({C}, compute_dtype(x), dev);
  Tensor y = empty_like(x);
  const double n = double(x.numel()), bytes = bytes_of({&x, &y, residual});
  {
    ProfileRange range(op, "op", (residual ? 9 : 8) * n, bytes + (training ? bytes_of({&x}) : 0.0));
    if (training) {
      UNETCU_CHECK(x.dim(0) * x.dim(2) * x.dim(3) > 1, op,
                   ": training needs more than one value per channel, got input ",
                   shape_str(x.shape()));
      UNETCU_LAUNCH(dev, batchnorm_stats, x, mean, invstd, running_mean, running_var, momentum,
                    eps);
    } else {  // the running statistics, also the backward's constants
      UNETCU_LAUNCH(dev, batchnorm_eval_stats, running_mean, running_var, eps, mean, invstd);
    }
    UNETCU_LAUNCH(dev, batchnorm_add_relu_forward, x, gamma, beta, mean, invstd,
                  residual ? *residual : Tensor(), y);
  }
  std::vector<Tensor> inputs = {x, gamma, beta};
  if (residual) inputs.push_back(*residual);
  if (Tape::should_record(inputs)) {
    // One kernel call fills the gradients of x, gamma, beta (and the residual): distinct buffers.
    UNETCU_CHECK(!gamma.same_storage(beta) && !x.same_storage(gamma) && !x.same_storage(beta),
                 op, ": input, weight and bias must be distinct tensors");
    // A residual that is x itself (or shares a parameter's storage) gets its gradient in a pass
    // of its own after the others are complete, as the tape asks of a tensor given twice.
    const bool residual_apart = residual && (residual->same_storage(x) ||
                                             residual->same_storage(gamma) ||
                                             residual->same_storage(beta));
    Tape::record(op, inputs, {y},
                 [x, gamma, beta, mean, invstd, y = residual ? y.detach() : Tensor(), training,
                  has_residual = bool(residual), residual_apart](BackwardContext& ctx) {
                   Tensor gx, gg, gb, gr;
                   double bx = 0, bg = 0, bb = 0, br = 0;
                   if (ctx.needs_grad(0)) gx = ctx.grad_input(0, &bx);
                   if (ctx.needs_grad(1)) gg = ctx.grad_input(1, &bg);
                   if (ctx.needs_grad(2)) gb = ctx.grad_input(2, &bb);
                   const bool want_r = has_residual && ctx.needs_grad(3);
                   if (want_r && !residual_apart) gr = ctx.grad_input(3, &br);
                   UNETCU_LAUNCH(x.device(), batchnorm_add_relu_backward, ctx.grad_output(0), y, x,
                                 gamma, beta, mean, invstd, training, gx, bx, gg, bg, gb, bb, gr,
                                 br);
                   if (want_r && residual_apart) {
                     gr = ctx.grad_input(3, &br);
                     UNETCU_LAUNCH(x.device(), relu_backward, ctx.grad_output(0), y, gr, br);
                   }
                 }, OpCost{(residual ? 12 : 15) * n, (residual ? 8 : 5) * bytes_of({&x})});
  }
  return y;
}

Tensor batch_norm_relu(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                       Tensor& running_mean, Tensor& running_var, bool training, double momentum,
                       double eps) {
  return batch_norm_add_relu_impl("batch_norm_relu", x, gamma, beta, nullptr, running_mean,
                                  running_var, training, momentum, eps);
}

Tensor batch_norm_add_relu(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                           const Tensor& residual, Tensor& running_mean, Tensor& running_var,
                           bool training, double momentum, double eps) {
  return batch_norm_add_relu_impl("batch_norm_add_relu", x, gamma, beta, &residual, running_mean,
                                  running_var, training, momentum, eps);
}

}  // namespace unetcu
