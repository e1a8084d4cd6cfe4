// CUDA batch normalisation. Training forward/backward and eval forward through cuDNN's
// spatial batch-norm calls; the running statistics follow PyTorch (exponential average with
// factor = momentum, unbiased variance), as cuDNN does. The eval-mode backward (statistics as
// constants) and the eval statistics are small hand-written kernels.
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
