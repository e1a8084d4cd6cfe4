// CUDA losses over bodies/loss.h: block reductions in double, the loss finished on the
// device, and backward kernels that read the upstream gradient and the Dice sums from device
// memory, so no host synchronisation happens inside a step.
//
// Sums are deterministic: each block writes its partial sum, and one block adds the partials
// in a fixed order (an atomicAdd per block would add them in order of arrival, which varies
// the last bits of the loss and of the Dice gradient from run to run).
//
// As on the CPU: logits X (float32 or bfloat16, either memory format), target Tt (float32 or
// the logits' dtype, either format, read through LossTargetIndex), elements computed in A (the
// wider compute type), the loss and its upstream gradient in L (float32), grad_x in X.
#include "kernels/cuda/common.cuh"
#include "kernels/launchers.h"
#include "bodies/loss.h"
#include "kernels/loss_target.h"

namespace unetcu::kernels::cuda {
namespace {

// partials [blocks]: this block's sum.
template <class X, class Tt>
__global__ void bce_sum_kernel(const X* x, const Tt* t, LossTargetIndex ti, double* partials,
                               int64_t n) {
  using A = loss_acc_t<X, Tt>;
  double acc = 0;
  GRID_STRIDE(i, n) acc += double(bce_with_logits(A(x[i]), A(t[ti(i)])));
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

template <class L> __global__ void mean_kernel(const double* sum, L* loss, int64_t n) {
  loss[0] = L(sum[0] / double(n));
}

template <class X, class Tt>
__global__ void bce_backward_kernel(const X* x, const Tt* t, LossTargetIndex ti,
                                    const acc_t<X>* grad_loss, X* gx, acc_t<X> beta, int64_t n) {
  using A = loss_acc_t<X, Tt>;
  const A s = A(double(grad_loss[0]) / double(n));
  GRID_STRIDE(i, n) store(gx + i, acc_t<X>(s * bce_with_logits_grad(A(x[i]), A(t[ti(i)]))), beta);
}

// partials [3][blocks]: this block's sums of p*t, p and t.
template <class X, class Tt>
__global__ void dice_sums_kernel(const X* x, const Tt* t, LossTargetIndex ti, double* partials,
                                 int64_t n) {
  using A = loss_acc_t<X, Tt>;
  double inter = 0, ps = 0, ts = 0;
  GRID_STRIDE(i, n) {
    const double p = kernels::sigmoid_forward(A(x[i]));
    const double tv = A(t[ti(i)]);
    inter += p * tv;
    ps += p;
    ts += tv;
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

template <class L> __global__ void dice_loss_kernel(const double* sums, double smooth, L* loss) {
  loss[0] = L(dice_loss_value(sums[0], sums[1] + sums[2], smooth));
}

template <class X, class Tt>
__global__ void dice_backward_kernel(const X* x, const Tt* t, LossTargetIndex ti,
                                     const double* sums, double smooth,
                                     const acc_t<X>* grad_loss, X* gx, acc_t<X> beta, int64_t n) {
  using A = loss_acc_t<X, Tt>;
  const A inter = A(sums[0]), card = A(sums[1] + sums[2]), sm = A(smooth), sc = A(grad_loss[0]);
  GRID_STRIDE(i, n) {
    const A p = kernels::sigmoid_forward(A(x[i]));
    store(gx + i, acc_t<X>(sc * dice_grad_logit(p, A(t[ti(i)]), inter, card, sm)), beta);
  }
}


}  // namespace

void bce_with_logits_forward(const TensorRef& logits, const TensorRef& target,
                             const TensorRef& loss) {
  const int64_t n = logits.numel();
  Launch l(logits);
  const int blocks = blocks_for(n);
  const LossTargetIndex ti = target_index(logits, target);
  unetcu::cuda::DeviceBuffer partials(logits.device().index, size_t(blocks) * sizeof(double));
  unetcu::cuda::DeviceBuffer sum(logits.device().index, sizeof(double));
  UNETCU_DISPATCH_LOSS(logits, target, {
    bce_sum_kernel<<<blocks, kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), ti, static_cast<double*>(partials.get()), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_forward");
  sum_partials_kernel<1><<<1, kThreads, 0, l.stream>>>(static_cast<const double*>(partials.get()),
                                                       blocks, static_cast<double*>(sum.get()));
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_forward (sum)");
  UNETCU_DISPATCH_FLOAT(loss.dtype(), L, {
    mean_kernel<<<1, 1, 0, l.stream>>>(static_cast<double*>(sum.get()), loss.data<L>(), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_forward (mean)");
}

void bce_with_logits_backward(const TensorRef& logits, const TensorRef& target,
                              const TensorRef& grad_loss, const TensorRef& grad_x, double beta) {
  const int64_t n = logits.numel();
  Launch l(logits);
  const LossTargetIndex ti = target_index(logits, target);
  UNETCU_DISPATCH_LOSS(logits, target, {
    bce_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), ti, grad_loss.data<acc_t<X>>(), grad_x.data<X>(),
        acc_t<X>(beta), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_backward");
}

void dice_sums(const TensorRef& logits, const TensorRef& target, const TensorRef& sums) {
  const int64_t n = logits.numel();
  Launch l(logits);
  const int blocks = blocks_for(n);
  const LossTargetIndex ti = target_index(logits, target);
  unetcu::cuda::DeviceBuffer partials(logits.device().index, 3 * size_t(blocks) * sizeof(double));
  UNETCU_DISPATCH_LOSS(logits, target, {
    dice_sums_kernel<<<blocks, kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), ti, static_cast<double*>(partials.get()), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "dice_sums");
  sum_partials_kernel<3><<<1, kThreads, 0, l.stream>>>(static_cast<const double*>(partials.get()),
                                                       blocks, sums.data<double>());
  CUDA_CHECK_LAUNCH(l.stream, "dice_sums (sum)");
}

void dice_loss_from_sums(const TensorRef& sums, double smooth, const TensorRef& loss) {
  Launch l(sums);
  UNETCU_DISPATCH_FLOAT(loss.dtype(), L, {
    dice_loss_kernel<<<1, 1, 0, l.stream>>>(sums.data<double>(), smooth, loss.data<L>());
  });
  CUDA_CHECK_LAUNCH(l.stream, "dice_loss_from_sums");
}

void dice_backward(const TensorRef& logits, const TensorRef& target, const TensorRef& sums,
                   double smooth, const TensorRef& grad_loss, const TensorRef& grad_x,
                   double beta) {
  const int64_t n = logits.numel();
  Launch l(logits);
  const LossTargetIndex ti = target_index(logits, target);
  UNETCU_DISPATCH_LOSS(logits, target, {
    dice_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), ti, sums.data<double>(), smooth,
        grad_loss.data<acc_t<X>>(), grad_x.data<X>(), acc_t<X>(beta), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "dice_backward");
}

}  // namespace unetcu::kernels::cuda
