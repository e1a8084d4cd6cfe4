// CUDA batch normalisation. Training forward/backward and eval forward through cuDNN's
// spatial batch-norm calls; the running statistics follow PyTorch (exponential average with
// factor = momentum, unbiased variance), as cuDNN does. The eval-mode backward (statistics as
// constants) and the eval statistics are small hand-written kernels. Batch norm fused with the
// residual add and ReLU is hand-written over kernels/bodies/batchnorm.h (end of this file).
//
// Gradient rule: dx is written (beta 0) or accumulated (beta 1) through cuDNN's
// betaDataDiff; dgamma/dbeta through betaParamDiff, which cuDNN applies to both, so when
// their betas differ (or one is not wanted) the parameter gradients go through scratch.
#include "kernels/cuda/common.cuh"
#include "kernels/bodies/batchnorm.h"
#include "kernels/cuda/cudnn_util.cuh"
#include "kernels/bodies/elementwise.h"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

struct BnDescs {
  TensorDesc x, param;
  explicit BnDescs(const TensorRef& t) {
    x.set(t.dim(0), t.dim(1), t.dim(2), t.dim(3));
    CUDNN_CHECK(cudnnDeriveBNTensorDescriptor(param.d, x.d, CUDNN_BATCHNORM_SPATIAL));
  }
};

__global__ void eval_stats_kernel(const float* rm, const float* rv, double eps, float* mean,
                                  float* invstd, int64_t C) {
  GRID_STRIDE(c, C) {
    mean[c] = rm[c];
    invstd[c] = float(1.0 / sqrt(double(rv[c]) + eps));
  }
}

// One block per channel: sums over N*HW, then dx = dy * gamma * invstd.
__global__ void eval_backward_kernel(const float* dy, const float* x, const float* gamma,
                                     const float* mean, const float* invstd, int64_t N, int64_t C,
                                     int64_t HW, float* dx, float beta_x, float* dgamma,
                                     float beta_g, float* dbeta, float beta_b) {
  const int64_t c = blockIdx.x;
  const float m = mean[c], is = invstd[c], gi = gamma[c] * is;
  double s_dy = 0, s_dy_xhat = 0;
  for (int64_t k = threadIdx.x; k < N * HW; k += blockDim.x) {
    const int64_t i = ((k / HW) * C + c) * HW + k % HW;
    s_dy += dy[i];
    s_dy_xhat += double(dy[i]) * double((x[i] - m) * is);
    if (dx) store(dx + i, dy[i] * gi, beta_x);
  }
  s_dy = block_sum(s_dy);
  s_dy_xhat = block_sum(s_dy_xhat);
  if (threadIdx.x == 0) {
    if (dgamma) store(dgamma + c, float(s_dy_xhat), beta_g);
    if (dbeta) store(dbeta + c, float(s_dy), beta_b);
  }
}

}  // namespace

void batchnorm_forward_train(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                             const TensorRef& y, const TensorRef& save_mean,
                             const TensorRef& save_invstd, const TensorRef& running_mean,
                             const TensorRef& running_var, double momentum, double eps) {
  Launch l(x);
  BnDescs d(x);
  const float one = 1, zero = 0;
  unetcu::cuda::CudnnLock h(x.device().index);
  CUDNN_CHECK(cudnnBatchNormalizationForwardTraining(
      h.handle(), CUDNN_BATCHNORM_SPATIAL, &one, &zero, d.x.d, x.raw(), d.x.d, y.raw(), d.param.d,
      gamma.raw(), beta.raw(), momentum, running_mean.raw(), running_var.raw(), eps,
      save_mean.raw(), save_invstd.raw()));
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_forward_train");
}

void batchnorm_forward_eval(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                            const TensorRef& running_mean, const TensorRef& running_var, double eps,
                            const TensorRef& y) {
  Launch l(x);
  BnDescs d(x);
  const float one = 1, zero = 0;
  unetcu::cuda::CudnnLock h(x.device().index);
  CUDNN_CHECK(cudnnBatchNormalizationForwardInference(
      h.handle(), CUDNN_BATCHNORM_SPATIAL, &one, &zero, d.x.d, x.raw(), d.x.d, y.raw(), d.param.d,
      gamma.raw(), beta.raw(), running_mean.raw(), running_var.raw(), eps));
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_forward_eval");
}

void batchnorm_eval_stats(const TensorRef& running_mean, const TensorRef& running_var, double eps,
                          const TensorRef& mean, const TensorRef& invstd) {
  const int64_t C = mean.numel();
  Launch l(mean);
  eval_stats_kernel<<<blocks_for(C), kThreads, 0, l.stream>>>(
      fdata(running_mean), fdata(running_var), eps, fdata(mean), fdata(invstd), C);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_eval_stats");
}

void batchnorm_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& gamma,
                        const TensorRef& mean, const TensorRef& invstd, bool training, double eps,
                        const TensorRef& grad_x, double beta_x, const TensorRef& grad_gamma,
                        double beta_gamma, const TensorRef& grad_beta, double beta_beta) {
  Launch l(x);
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  if (!training) {
    eval_backward_kernel<<<int(C), kThreads, 0, l.stream>>>(
        fdata(grad_y), fdata(x), fdata(gamma), fdata(mean), fdata(invstd), N, C, HW,
        grad_x.defined() ? fdata(grad_x) : nullptr, float(beta_x),
        grad_gamma.defined() ? fdata(grad_gamma) : nullptr, float(beta_gamma),
        grad_beta.defined() ? fdata(grad_beta) : nullptr, float(beta_beta));
    CUDA_CHECK_LAUNCH(l.stream, "batchnorm_backward (eval)");
    return;
  }
  // cuDNN writes dx, dgamma and dbeta every time: point the unwanted ones at scratch.
  const int dev = x.device().index;
  const bool direct_params =
      grad_gamma.defined() && grad_beta.defined() && beta_gamma == beta_beta;
  const size_t param_bytes = size_t(C) * sizeof(float);
  unetcu::cuda::DeviceBuffer dx_scratch(dev, grad_x.defined() ? 0 : x.nbytes());
  unetcu::cuda::DeviceBuffer dg_scratch(dev, direct_params ? 0 : param_bytes);
  unetcu::cuda::DeviceBuffer db_scratch(dev, direct_params ? 0 : param_bytes);
  const TensorRef dx =
      grad_x.defined() ? grad_x : TensorRef(dx_scratch.get(), DType::F32, x.device(), x.shape());
  const TensorRef dg =
      direct_params ? grad_gamma : TensorRef(dg_scratch.get(), DType::F32, x.device(), {C});
  const TensorRef db =
      direct_params ? grad_beta : TensorRef(db_scratch.get(), DType::F32, x.device(), {C});
  const float one = 1, bx = grad_x.defined() ? float(beta_x) : 0.f;
  const float bp = direct_params ? float(beta_gamma) : 0.f;
  BnDescs d(x);
  {
    unetcu::cuda::CudnnLock h(dev);
    CUDNN_CHECK(cudnnBatchNormalizationBackward(
        h.handle(), CUDNN_BATCHNORM_SPATIAL, &one, &bx, &one, &bp, d.x.d, x.raw(), d.x.d,
        grad_y.raw(), d.x.d, dx.raw(), d.param.d, gamma.raw(), dg.raw(), db.raw(), eps, mean.raw(),
        invstd.raw()));
  }
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_backward");
  if (!direct_params) {
    if (grad_gamma.defined()) axpby(grad_gamma, 1.0, dg, beta_gamma);
    if (grad_beta.defined()) axpby(grad_beta, 1.0, db, beta_beta);
  }
}

}  // namespace unetcu::kernels::cuda

// ---- synchronized batch norm: the per-replica pieces; the caller all-reduces the sums ----

namespace unetcu::kernels::cuda {
namespace {

// One block per channel: s[c] = sum x, s[C + c] = sum x² over N*HW.
__global__ void channel_sums_kernel(const float* x, int64_t N, int64_t C, int64_t HW, double* s) {
  const int64_t c = blockIdx.x;
  double a = 0, b = 0;
  for (int64_t k = threadIdx.x; k < N * HW; k += blockDim.x) {
    const float v = x[((k / HW) * C + c) * HW + k % HW];
    a += v;
    b += double(v) * v;
  }
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) {
    s[c] = a;
    s[C + c] = b;
  }
}

__global__ void sync_stats_kernel(const double* s, double count, double momentum, double eps,
                                  float* mean, float* invstd, float* rm, float* rv, int64_t C) {
  GRID_STRIDE(c, C) {
    const double mu = s[c] / count;
    const double var = fmax(0.0, s[C + c] / count - mu * mu);
    mean[c] = float(mu);
    invstd[c] = float(1.0 / sqrt(var + eps));
    rm[c] = bn_running_update(rm[c], float(mu), float(momentum));
    rv[c] = bn_running_update(rv[c], float(var * count / (count - 1)), float(momentum));
  }
}

__global__ void apply_kernel(const float* x, const float* gamma, const float* beta,
                             const float* mean, const float* invstd, float* y, int64_t C,
                             int64_t HW, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t c = (i / HW) % C;
    y[i] = bn_normalize(x[i], mean[c], invstd[c], gamma[c], beta[c]);
  }
}

__global__ void grad_sums_kernel(const float* dy, const float* x, const float* mean,
                                 const float* invstd, int64_t N, int64_t C, int64_t HW, double* s) {
  const int64_t c = blockIdx.x;
  const float m = mean[c], is = invstd[c];
  double a = 0, b = 0;
  for (int64_t k = threadIdx.x; k < N * HW; k += blockDim.x) {
    const int64_t i = ((k / HW) * C + c) * HW + k % HW;
    a += dy[i];
    b += double(dy[i]) * double((x[i] - m) * is);
  }
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) {
    s[c] = a;
    s[C + c] = b;
  }
}

__global__ void param_grads_kernel(const double* s, float* dg, float beta_g, float* db,
                                   float beta_b, int64_t C) {
  GRID_STRIDE(c, C) {
    if (dg) store(dg + c, float(s[C + c]), beta_g);
    if (db) store(db + c, float(s[c]), beta_b);
  }
}

__global__ void grad_apply_kernel(const float* dy, const float* x, const float* gamma,
                                  const float* mean, const float* invstd, const double* s,
                                  float inv_count, float* dx, float beta_x, int64_t C, int64_t HW,
                                  int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t c = (i / HW) % C;
    const float is = invstd[c];
    store(dx + i,
          bn_backward_train(dy[i], (x[i] - mean[c]) * is, gamma[c] * is, inv_count, float(s[c]),
                            float(s[C + c])),
          beta_x);
  }
}

}  // namespace

void batchnorm_channel_sums(const TensorRef& x, const TensorRef& sums) {
  Launch l(x);
  channel_sums_kernel<<<int(x.dim(1)), kThreads, 0, l.stream>>>(
      fdata(x), x.dim(0), x.dim(1), x.dim(2) * x.dim(3), sums.data<double>());
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_channel_sums");
}

void batchnorm_sync_stats(const TensorRef& sums, double count, double momentum, double eps,
                          const TensorRef& mean, const TensorRef& invstd,
                          const TensorRef& running_mean, const TensorRef& running_var) {
  const int64_t C = mean.numel();
  Launch l(mean);
  sync_stats_kernel<<<blocks_for(C), kThreads, 0, l.stream>>>(
      sums.data<double>(), count, momentum, eps, fdata(mean), fdata(invstd), fdata(running_mean),
      fdata(running_var), C);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_sync_stats");
}

void batchnorm_apply(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                     const TensorRef& mean, const TensorRef& invstd, const TensorRef& y) {
  const int64_t n = x.numel();
  Launch l(x);
  apply_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(x), fdata(gamma), fdata(beta),
                                                         fdata(mean), fdata(invstd), fdata(y),
                                                         x.dim(1), x.dim(2) * x.dim(3), n);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_apply");
}

void batchnorm_grad_sums(const TensorRef& grad_y, const TensorRef& x, const TensorRef& mean,
                         const TensorRef& invstd, const TensorRef& sums) {
  Launch l(x);
  grad_sums_kernel<<<int(x.dim(1)), kThreads, 0, l.stream>>>(
      fdata(grad_y), fdata(x), fdata(mean), fdata(invstd), x.dim(0), x.dim(1), x.dim(2) * x.dim(3),
      sums.data<double>());
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_grad_sums");
}

void batchnorm_param_grads(const TensorRef& sums, const TensorRef& grad_gamma, double beta_gamma,
                           const TensorRef& grad_beta, double beta_beta) {
  const int64_t C = sums.numel() / 2;
  Launch l(sums);
  param_grads_kernel<<<blocks_for(C), kThreads, 0, l.stream>>>(
      sums.data<double>(), grad_gamma.defined() ? fdata(grad_gamma) : nullptr, float(beta_gamma),
      grad_beta.defined() ? fdata(grad_beta) : nullptr, float(beta_beta), C);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_param_grads");
}

void batchnorm_grad_apply(const TensorRef& grad_y, const TensorRef& x, const TensorRef& gamma,
                          const TensorRef& mean, const TensorRef& invstd,
                          const TensorRef& global_sums, double count, const TensorRef& grad_x,
                          double beta_x) {
  const int64_t n = x.numel();
  Launch l(x);
  grad_apply_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
      fdata(grad_y), fdata(x), fdata(gamma), fdata(mean), fdata(invstd), global_sums.data<double>(),
      float(1.0 / count), fdata(grad_x), float(beta_x), x.dim(1), x.dim(2) * x.dim(3), n);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_grad_apply");
}

}  // namespace unetcu::kernels::cuda

// ---- fused batch norm + residual add + ReLU ----------------------------------------------
//
// Per-channel reductions run over many blocks per channel: a grid of (chunk, channel) blocks,
// chunk = (n, part of the plane (n, c)), each writing its partial sums; one block per channel
// then adds the partials in a fixed order. Deterministic, no atomics, and a channel of any
// size (the statistics of 32 M values per channel take 16 K blocks) fills the GPU.
// Elementwise passes run over a grid of (plane, part) blocks. No index division per element.

namespace unetcu::kernels::cuda {
namespace {

constexpr int64_t kReducePerBlock = 8 * kThreads;  // values a reduction block sums (8 a thread)

// Reduction geometry: plane parts of `chunk` values; grid (N * parts, C).
struct ReduceGrid {
  int parts;
  int64_t chunk;
  int blocks_per_channel;  // N * parts: partials per channel
};
ReduceGrid reduce_grid(int64_t N, int64_t HW) {
  const int64_t parts = std::max<int64_t>(1, (HW + kReducePerBlock - 1) / kReducePerBlock);
  const int64_t chunk = (HW + parts - 1) / parts;
  UNETCU_CHECK(N * parts < (int64_t(1) << 31), "batch norm: input too large for one launch");
  return {int(parts), chunk, int(N * parts)};
}

// Elementwise geometry: grid (N * C, parts), each block striding over its plane.
dim3 plane_grid(int64_t NC, int64_t HW) {
  const int64_t parts = std::clamp<int64_t>((HW + 4 * kThreads - 1) / (4 * kThreads), 1, 65535);
  return dim3(unsigned(NC), unsigned(parts));
}

// partials [C][2][N * parts]: shifted sums (s1, s2) of block (n, part) of channel blockIdx.y.
__global__ void stats_partials_kernel(const float* x, int64_t C, int64_t HW, int parts,
                                      int64_t chunk, double* partials) {
  const int64_t c = blockIdx.y;
  const int n = blockIdx.x / parts, part = blockIdx.x % parts;
  const float* p = x + (int64_t(n) * C + c) * HW;
  const double shift = x[c * HW];  // the channel's first element
  const int64_t lo = part * chunk, hi = min(HW, lo + chunk);
  double s1 = 0, s2 = 0;
  for (int64_t q = lo + threadIdx.x; q < hi; q += blockDim.x) bn_stats_accumulate(p[q], shift, s1, s2);
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  if (threadIdx.x == 0) {
    const int64_t k = gridDim.x;
    partials[(2 * c) * k + blockIdx.x] = s1;
    partials[(2 * c + 1) * k + blockIdx.x] = s2;
  }
}

// One block per channel: the partials added in a fixed order, then mean, invstd and the
// running statistics.
__global__ void stats_finish_kernel(const double* partials, int k, const float* x, int64_t HW,
                                    double count, double momentum, double eps, float* mean,
                                    float* invstd, float* rm, float* rv) {
  const int64_t c = blockIdx.x;
  double s1 = 0, s2 = 0;
  for (int b = threadIdx.x; b < k; b += blockDim.x) {
    s1 += partials[(2 * c) * k + b];
    s2 += partials[(2 * c + 1) * k + b];
  }
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  if (threadIdx.x == 0) {
    double mu, var;
    bn_stats_finish(s1, s2, count, double(x[c * HW]), mu, var);
    mean[c] = float(mu);
    invstd[c] = float(1.0 / sqrt(var + eps));
    rm[c] = bn_running_update(rm[c], float(mu), float(momentum));
    rv[c] = bn_running_update(rv[c], float(var * count / (count - 1)), float(momentum));
  }
}

__global__ void add_relu_forward_kernel(const float* x, const float* gamma, const float* beta,
                                        const float* mean, const float* invstd,
                                        const float* residual, float* y, int64_t C, int64_t HW) {
  const int64_t nc = blockIdx.x, c = nc % C, base = nc * HW;
  const float m = mean[c], is = invstd[c], gm = gamma[c], bt = beta[c];
  for (int64_t q = int64_t(blockIdx.y) * blockDim.x + threadIdx.x; q < HW;
       q += int64_t(gridDim.y) * blockDim.x) {
    const int64_t i = base + q;
    y[i] = residual ? bn_add_relu_forward(x[i], m, is, gm, bt, residual[i])
                    : bn_relu_forward(x[i], m, is, gm, bt);
  }
}

// partials [C][2][N * parts]: sum g and sum g * xhat of block (n, part) of channel blockIdx.y.
__global__ void grad_partials_kernel(const float* dy, const float* y, const float* x,
                                     const float* mean, const float* invstd, int64_t C,
                                     int64_t HW, int parts, int64_t chunk, double* partials) {
  const int64_t c = blockIdx.y;
  const int n = blockIdx.x / parts, part = blockIdx.x % parts;
  const int64_t base = (int64_t(n) * C + c) * HW;
  const float m = mean[c], is = invstd[c];
  const int64_t lo = part * chunk, hi = min(HW, lo + chunk);
  double a = 0, b = 0;
  for (int64_t q = lo + threadIdx.x; q < hi; q += blockDim.x)
    bn_relu_grad_accumulate(dy[base + q], y[base + q], x[base + q], m, is, a, b);
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) {
    const int64_t k = gridDim.x;
    partials[(2 * c) * k + blockIdx.x] = a;
    partials[(2 * c + 1) * k + blockIdx.x] = b;
  }
}

// One block per channel: sums [C][sum g, sum g * xhat] in a fixed order; dgamma, dbeta.
__global__ void grad_finish_kernel(const double* partials, int k, double* sums, float* dg,
                                   float beta_g, float* db, float beta_b) {
  const int64_t c = blockIdx.x;
  double a = 0, b = 0;
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    a += partials[(2 * c) * k + j];
    b += partials[(2 * c + 1) * k + j];
  }
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) {
    sums[2 * c] = a;
    sums[2 * c + 1] = b;
    if (dg) store(dg + c, float(b), beta_g);
    if (db) store(db + c, float(a), beta_b);
  }
}

__global__ void add_relu_grad_apply_kernel(const float* dy, const float* y, const float* x,
                                           const float* gamma, const float* mean,
                                           const float* invstd, const double* sums, bool training,
                                           float inv_m, float* dx, float beta_x, float* dr,
                                           float beta_r, int64_t C, int64_t HW) {
  const int64_t nc = blockIdx.x, c = nc % C, base = nc * HW;
  const float m = mean[c], is = invstd[c], gi = gamma[c] * is;
  const float sg = sums ? float(sums[2 * c]) : 0.f, sgx = sums ? float(sums[2 * c + 1]) : 0.f;
  for (int64_t q = int64_t(blockIdx.y) * blockDim.x + threadIdx.x; q < HW;
       q += int64_t(gridDim.y) * blockDim.x) {
    const int64_t i = base + q;
    if (dx) store(dx + i, bn_relu_backward_dx(dy[i], y[i], x[i], m, is, gi, inv_m, sg, sgx, training), beta_x);
    if (dr) store(dr + i, kernels::relu_backward(dy[i], y[i]), beta_r);
  }
}

float* fdata_or_null(const TensorRef& t) { return t.defined() ? fdata(t) : nullptr; }

}  // namespace

void batchnorm_stats(const TensorRef& x, const TensorRef& mean, const TensorRef& invstd,
                     const TensorRef& running_mean, const TensorRef& running_var, double momentum,
                     double eps) {
  if (x.numel() == 0) return;  // an empty batch (eval; training refuses it): no launch of 0 blocks
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  UNETCU_CHECK(C <= 65535, "batch norm: more than 65535 channels");
  Launch l(x);
  const ReduceGrid g = reduce_grid(N, HW);
  unetcu::cuda::DeviceBuffer partials(x.device().index,
                                      size_t(2 * C) * size_t(g.blocks_per_channel) * sizeof(double));
  double* pp = static_cast<double*>(partials.get());
  stats_partials_kernel<<<dim3(unsigned(g.blocks_per_channel), unsigned(C)), kThreads, 0, l.stream>>>(
      fdata(x), C, HW, g.parts, g.chunk, pp);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_stats (partials)");
  stats_finish_kernel<<<unsigned(C), kThreads, 0, l.stream>>>(
      pp, g.blocks_per_channel, fdata(x), HW, double(N * HW), momentum, eps, fdata(mean),
      fdata(invstd), fdata(running_mean), fdata(running_var));
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_stats (finish)");
}

void batchnorm_add_relu_forward(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                                const TensorRef& mean, const TensorRef& invstd,
                                const TensorRef& residual, const TensorRef& y) {
  if (x.numel() == 0) return;  // an empty batch (eval; training refuses it): no launch of 0 blocks
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  Launch l(x);
  add_relu_forward_kernel<<<plane_grid(N * C, HW), kThreads, 0, l.stream>>>(
      fdata(x), fdata(gamma), fdata(beta), fdata(mean), fdata(invstd), fdata_or_null(residual),
      fdata(y), C, HW);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_add_relu_forward");
}

void batchnorm_add_relu_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& x,
                                 const TensorRef& gamma, const TensorRef& mean,
                                 const TensorRef& invstd, bool training, const TensorRef& grad_x,
                                 double beta_x, const TensorRef& grad_gamma, double beta_gamma,
                                 const TensorRef& grad_beta, double beta_beta,
                                 const TensorRef& grad_residual, double beta_residual) {
  if (x.numel() == 0) return;  // an empty batch (eval; training refuses it): no launch of 0 blocks
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  UNETCU_CHECK(C <= 65535, "batch norm: more than 65535 channels");
  Launch l(x);
  const int dev = x.device().index;
  const bool need_sums = grad_gamma.defined() || grad_beta.defined() || (grad_x.defined() && training);
  unetcu::cuda::DeviceBuffer sums(dev, need_sums ? size_t(2 * C) * sizeof(double) : 0);
  if (need_sums) {
    const ReduceGrid g = reduce_grid(N, HW);
    unetcu::cuda::DeviceBuffer partials(
        dev, size_t(2 * C) * size_t(g.blocks_per_channel) * sizeof(double));
    double* pp = static_cast<double*>(partials.get());
    grad_partials_kernel<<<dim3(unsigned(g.blocks_per_channel), unsigned(C)), kThreads, 0, l.stream>>>(
        fdata(grad_y), fdata(y), fdata(x), fdata(mean), fdata(invstd), C, HW, g.parts, g.chunk, pp);
    CUDA_CHECK_LAUNCH(l.stream, "batchnorm_add_relu_backward (partials)");
    grad_finish_kernel<<<unsigned(C), kThreads, 0, l.stream>>>(
        pp, g.blocks_per_channel, static_cast<double*>(sums.get()), fdata_or_null(grad_gamma),
        float(beta_gamma), fdata_or_null(grad_beta), float(beta_beta));
    CUDA_CHECK_LAUNCH(l.stream, "batchnorm_add_relu_backward (sums)");
  }
  if (!grad_x.defined() && !grad_residual.defined()) return;
  add_relu_grad_apply_kernel<<<plane_grid(N * C, HW), kThreads, 0, l.stream>>>(
      fdata(grad_y), fdata(y), fdata(x), fdata(gamma), fdata(mean), fdata(invstd),
      need_sums ? static_cast<const double*>(sums.get()) : nullptr, training,
      float(1.0 / double(N * HW)), fdata_or_null(grad_x), float(beta_x),
      fdata_or_null(grad_residual), float(beta_residual), C, HW);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_add_relu_backward (apply)");
}

}  // namespace unetcu::kernels::cuda
