// CUDA losses over kernels/bodies/loss.h: block reductions in double, the loss finished on the
// device, and backward kernels that read the upstream gradient and the Dice sums from device
// memory, so no host synchronisation happens inside a step.
//
// Sums are deterministic: each block writes its partial sum, and one block adds the partials
// in a fixed order (an atomicAdd per block would add them in order of arrival, which varies
// the last bits of the loss and of the Dice gradient from run to run).
#include "kernels/cuda/common.cuh"
#include "kernels/launchers.h"
#include "kernels/bodies/loss.h"

namespace unetcu::kernels::cuda {
namespace {

// partials [blocks]: this block's sum.
__global__ void bce_sum_kernel(const float* x, const float* t, double* partials, int64_t n) {
  double acc = 0;
  GRID_STRIDE(i, n) acc += double(bce_with_logits(x[i], t[i]));
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// One block: out[k] = sum over b of partials[k * blocks + b], k < K, in a fixed order.
template <int K>
__global__ void sum_partials_kernel(const double* partials, int blocks, double* out) {
  for (int k = 0; k < K; ++k) {
    double acc = 0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) acc += partials[k * blocks + b];
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[k] = acc;
  }
}

__global__ void mean_kernel(const double* sum, float* loss, int64_t n) {
  loss[0] = float(sum[0] / double(n));
}

__global__ void bce_backward_kernel(const float* x, const float* t, const float* grad_loss,
                                    float* gx, float beta, int64_t n) {
  const float s = float(double(grad_loss[0]) / double(n));
  GRID_STRIDE(i, n) store(gx + i, s * bce_with_logits_grad(x[i], t[i]), beta);
}

// partials [3][blocks]: this block's sums of p*t, p and t.
__global__ void dice_sums_kernel(const float* x, const float* t, double* partials, int64_t n) {
  double inter = 0, ps = 0, ts = 0;
  GRID_STRIDE(i, n) {
    const double p = kernels::sigmoid_forward(x[i]);
    inter += p * t[i];
    ps += p;
    ts += t[i];
  }
  inter = block_sum(inter);
  ps = block_sum(ps);
  ts = block_sum(ts);
  if (threadIdx.x == 0) {
    partials[0 * gridDim.x + blockIdx.x] = inter;
    partials[1 * gridDim.x + blockIdx.x] = ps;
    partials[2 * gridDim.x + blockIdx.x] = ts;
  }
}

__global__ void dice_loss_kernel(const double* sums, double smooth, float* loss) {
  loss[0] = float(dice_loss_value(sums[0], sums[1] + sums[2], smooth));
}

__global__ void dice_backward_kernel(const float* x, const float* t, const double* sums,
                                     float smooth, const float* grad_loss, float* gx, float beta,
                                     int64_t n) {
  const float inter = float(sums[0]), card = float(sums[1] + sums[2]), sc = grad_loss[0];
  GRID_STRIDE(i, n) {
    const float p = kernels::sigmoid_forward(x[i]);
    store(gx + i, sc * dice_grad_logit(p, t[i], inter, card, smooth), beta);
  }
}

}  // namespace

void bce_with_logits_forward(const TensorRef& logits, const TensorRef& target,
                             const TensorRef& loss) {
  const int64_t n = logits.numel();
  Launch l(logits);
  const int blocks = blocks_for(n);
  unetcu::cuda::DeviceBuffer partials(logits.device().index, size_t(blocks) * sizeof(double));
  unetcu::cuda::DeviceBuffer sum(logits.device().index, sizeof(double));
  bce_sum_kernel<<<blocks, kThreads, 0, l.stream>>>(fdata(logits), fdata(target),
                                                    static_cast<double*>(partials.get()), n);
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_forward");
  sum_partials_kernel<1><<<1, kThreads, 0, l.stream>>>(static_cast<const double*>(partials.get()),
                                                       blocks, static_cast<double*>(sum.get()));
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_forward (sum)");
  mean_kernel<<<1, 1, 0, l.stream>>>(static_cast<double*>(sum.get()), fdata(loss), n);
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_forward (mean)");
}

void bce_with_logits_backward(const TensorRef& logits, const TensorRef& target,
                              const TensorRef& grad_loss, const TensorRef& grad_x, double beta) {
  const int64_t n = logits.numel();
  Launch l(logits);
  bce_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
      fdata(logits), fdata(target), fdata(grad_loss), fdata(grad_x), float(beta), n);
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_backward");
}

void dice_sums(const TensorRef& logits, const TensorRef& target, const TensorRef& sums) {
  const int64_t n = logits.numel();
  Launch l(logits);
  const int blocks = blocks_for(n);
  unetcu::cuda::DeviceBuffer partials(logits.device().index, 3 * size_t(blocks) * sizeof(double));
  dice_sums_kernel<<<blocks, kThreads, 0, l.stream>>>(fdata(logits), fdata(target),
                                                      static_cast<double*>(partials.get()), n);
  CUDA_CHECK_LAUNCH(l.stream, "dice_sums");
  sum_partials_kernel<3><<<1, kThreads, 0, l.stream>>>(static_cast<const double*>(partials.get()),
                                                       blocks, sums.data<double>());
  CUDA_CHECK_LAUNCH(l.stream, "dice_sums (sum)");
}

void dice_loss_from_sums(const TensorRef& sums, double smooth, const TensorRef& loss) {
  Launch l(sums);
  dice_loss_kernel<<<1, 1, 0, l.stream>>>(sums.data<double>(), smooth, fdata(loss));
  CUDA_CHECK_LAUNCH(l.stream, "dice_loss_from_sums");
}

void dice_backward(const TensorRef& logits, const TensorRef& target, const TensorRef& sums,
                   double smooth, const TensorRef& grad_loss, const TensorRef& grad_x,
                   double beta) {
  const int64_t n = logits.numel();
  Launch l(logits);
  dice_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
      fdata(logits), fdata(target), sums.data<double>(), float(smooth), fdata(grad_loss),
      fdata(grad_x), float(beta), n);
  CUDA_CHECK_LAUNCH(l.stream, "dice_backward");
}

}  // namespace unetcu::kernels::cuda
