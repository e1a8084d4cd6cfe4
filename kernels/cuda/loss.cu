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

// partials [2][blocks]: this block's sum and count over counted elements.
template <class X, class Tt>
__global__ void bce_sum_kernel(const X* x, const Tt* t, LossTargetIndex ti, double* partials,
                               int64_t n) {
  using A = loss_acc_t<X, Tt>;
  double acc = 0, cnt = 0;
  GRID_STRIDE(i, n) {
    const A tv = A(t[ti(i)]);
    if (!counted(tv)) continue;
    acc += double(bce_with_logits(A(x[i]), tv));
    cnt += 1;
  }
  acc = block_sum(acc);
  cnt = block_sum(cnt);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc, partials[gridDim.x + blockIdx.x] = cnt;
}

// partials [2][blocks]: this block's sum of softmax cross-entropy and count of counted pixels.
template <class X, class Tt>
__global__ void softmax_ce_sum_kernel(const X* x, const Tt* t, ClassLayout L, double* partials,
                                      int64_t pixels) {
  using A = loss_acc_t<X, Tt>;
  double acc = 0, cnt = 0;
  GRID_STRIDE(p, pixels) {
    const A tv = A(t[p]);
    if (!counted(tv)) continue;
    acc += double(softmax_ce<A>(x, L, p, int64_t(tv)));
    cnt += 1;
  }
  acc = block_sum(acc);
  cnt = block_sum(cnt);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc, partials[gridDim.x + blockIdx.x] = cnt;
}

template <class X, class Tt>
__global__ void softmax_ce_backward_kernel(const X* x, const Tt* t, ClassLayout L,
                                           const double* sums, const acc_t<X>* grad_loss, X* gx,
                                           acc_t<X> beta, int64_t pixels) {
  using A = loss_acc_t<X, Tt>;
  const A s = A(sums[1] > 0 ? double(grad_loss[0]) / sums[1] : 0.0);
  GRID_STRIDE(p, pixels) {
    softmax_ce_grad_pixel(x, L, p, A(t[p]), s, [&](int64_t c, A v) { store(gx + L(p, c), acc_t<X>(v), beta); });
  }
}

// Block (b, c) sums class c = blockIdx.y: partials [3][C][blocks] = sum p_c [t = c], sum p_c,
// sum [t = c] over its pixels.
template <class X, class Tt>
__global__ void multiclass_dice_sums_kernel(const X* x, const Tt* t, ClassLayout L,
                                            double* partials, int64_t pixels) {
  using A = loss_acc_t<X, Tt>;
  const int64_t c = blockIdx.y;
  double inter = 0, ps = 0, ts = 0;
  GRID_STRIDE(p, pixels) {
    const A tv = A(t[p]);
    if (!counted(tv)) continue;
    A mx, lse;
    softmax_stats(x, L, p, &mx, &lse);
    const double pc = double(exp(A(x[L(p, c)]) - mx - lse));
    const bool is_c = int64_t(tv) == c;
    ps += pc;
    inter += is_c ? pc : 0.0;
    ts += is_c ? 1.0 : 0.0;
  }
  inter = block_sum(inter);
  ps = block_sum(ps);
  ts = block_sum(ts);
  if (threadIdx.x == 0) {
    const int64_t C = gridDim.y, B = gridDim.x;
    partials[(0 * C + c) * B + blockIdx.x] = inter;
    partials[(1 * C + c) * B + blockIdx.x] = ps;
    partials[(2 * C + c) * B + blockIdx.x] = ts;
  }
}

// Block k: out[k] = sum over b of partials[k * blocks + b], in a fixed order.
__global__ void sum_rows_kernel(const double* partials, int blocks, double* out) {
  double acc = 0;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) acc += partials[int64_t(blockIdx.x) * blocks + b];
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

template <class L>
__global__ void multiclass_dice_loss_kernel(const double* s, int64_t C, double smooth, L* loss) {
  loss[0] = L(multiclass_dice_value(s, C, smooth));
}

template <class X, class Tt>
__global__ void multiclass_dice_backward_kernel(const X* x, const Tt* t, ClassLayout L,
                                                const double* s, double smooth,
                                                const acc_t<X>* grad_loss, X* gx, acc_t<X> beta,
                                                int64_t pixels) {
  using A = loss_acc_t<X, Tt>;
  const A sc = A(grad_loss[0]);
  GRID_STRIDE(p, pixels) {
    multiclass_dice_grad_pixel(x, L, p, A(t[p]), s, smooth, sc,
                               [&](int64_t c, A v) { store(gx + L(p, c), acc_t<X>(v), beta); });
  }
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

// loss = sums[0] / sums[1], 0 over no counted element.
template <class L> __global__ void mean_kernel(const double* sums, L* loss) {
  loss[0] = L(sums[1] > 0 ? sums[0] / sums[1] : 0.0);
}

template <class X, class Tt>
__global__ void bce_backward_kernel(const X* x, const Tt* t, LossTargetIndex ti,
                                    const double* sums, const acc_t<X>* grad_loss, X* gx,
                                    acc_t<X> beta, int64_t n) {
  using A = loss_acc_t<X, Tt>;
  const A s = A(sums[1] > 0 ? double(grad_loss[0]) / sums[1] : 0.0);
  GRID_STRIDE(i, n) {
    const A tv = A(t[ti(i)]);
    store(gx + i, acc_t<X>(counted(tv) ? s * bce_with_logits_grad(A(x[i]), tv) : A(0)), beta);
  }
}

// partials [3][blocks]: this block's sums of p*t, p and t.
template <class X, class Tt>
__global__ void dice_sums_kernel(const X* x, const Tt* t, LossTargetIndex ti, double* partials,
                                 int64_t n) {
  using A = loss_acc_t<X, Tt>;
  double inter = 0, ps = 0, ts = 0;
  GRID_STRIDE(i, n) {
    const double tv = A(t[ti(i)]);
    if (!counted(tv)) continue;
    const double p = kernels::sigmoid_forward(A(x[i]));
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
    const A tv = A(t[ti(i)]);
    const A p = kernels::sigmoid_forward(A(x[i]));
    store(gx + i, acc_t<X>(counted(tv) ? sc * dice_grad_logit(p, tv, inter, card, sm) : A(0)), beta);
  }
}


template <class X, class Tt>
__global__ void confusion_kernel(const X* x, const Tt* t, ClassLayout L, double* m, int64_t K,
                                 int64_t pixels) {
  GRID_STRIDE(p, pixels) {
    const int64_t truth = target_class(loss_acc_t<X, Tt>(t[p]), L.C);
    if (truth >= 0) atomicAdd(m + truth * K + predicted_class(x, L, p), 1.0);  // exact: whole numbers
  }
}

}  // namespace

void bce_with_logits_forward(const TensorRef& logits, const TensorRef& target,
                             const TensorRef& sums, const TensorRef& loss) {
  const int64_t n = logits.numel();
  Launch l(logits);
  const int blocks = blocks_for(n);
  const LossTargetIndex ti = target_index(logits, target);
  unetcu::cuda::DeviceBuffer partials(logits.device().index, 2 * size_t(blocks) * sizeof(double));
  UNETCU_DISPATCH_LOSS(logits, target, {
    bce_sum_kernel<<<blocks, kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), ti, static_cast<double*>(partials.get()), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_forward");
  sum_partials_kernel<2><<<1, kThreads, 0, l.stream>>>(static_cast<const double*>(partials.get()),
                                                       blocks, sums.data<double>());
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_forward (sum)");
  UNETCU_DISPATCH_FLOAT(loss.dtype(), L, {
    mean_kernel<<<1, 1, 0, l.stream>>>(sums.data<double>(), loss.data<L>());
  });
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_forward (mean)");
}

void bce_with_logits_backward(const TensorRef& logits, const TensorRef& target,
                              const TensorRef& sums, const TensorRef& grad_loss,
                              const TensorRef& grad_x, double beta) {
  const int64_t n = logits.numel();
  Launch l(logits);
  const LossTargetIndex ti = target_index(logits, target);
  UNETCU_DISPATCH_LOSS(logits, target, {
    bce_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), ti, sums.data<double>(), grad_loss.data<acc_t<X>>(),
        grad_x.data<X>(), acc_t<X>(beta), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "bce_with_logits_backward");
}

namespace {
ClassLayout class_layout(const TensorRef& logits) {
  const Dims4 d = logits.dims4();
  return {d.C, d.H * d.W, d.nhwc};
}
}  // namespace

void softmax_ce_forward(const TensorRef& logits, const TensorRef& target, const TensorRef& sums,
                        const TensorRef& loss) {
  const ClassLayout L = class_layout(logits);
  const int64_t pixels = logits.numel() / L.C;
  Launch l(logits);
  const int blocks = blocks_for(pixels);
  unetcu::cuda::DeviceBuffer partials(logits.device().index, 2 * size_t(blocks) * sizeof(double));
  UNETCU_DISPATCH_LOSS(logits, target, {
    softmax_ce_sum_kernel<<<blocks, kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), L, static_cast<double*>(partials.get()), pixels);
  });
  CUDA_CHECK_LAUNCH(l.stream, "softmax_ce_forward");
  sum_partials_kernel<2><<<1, kThreads, 0, l.stream>>>(static_cast<const double*>(partials.get()),
                                                       blocks, sums.data<double>());
  CUDA_CHECK_LAUNCH(l.stream, "softmax_ce_forward (sum)");
  UNETCU_DISPATCH_FLOAT(loss.dtype(), Lt, {
    mean_kernel<<<1, 1, 0, l.stream>>>(sums.data<double>(), loss.data<Lt>());
  });
  CUDA_CHECK_LAUNCH(l.stream, "softmax_ce_forward (mean)");
}

void softmax_ce_backward(const TensorRef& logits, const TensorRef& target, const TensorRef& sums,
                         const TensorRef& grad_loss, const TensorRef& grad_x, double beta) {
  const ClassLayout L = class_layout(logits);
  const int64_t pixels = logits.numel() / L.C;
  Launch l(logits);
  UNETCU_DISPATCH_LOSS(logits, target, {
    softmax_ce_backward_kernel<<<blocks_for(pixels), kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), L, sums.data<double>(), grad_loss.data<acc_t<X>>(),
        grad_x.data<X>(), acc_t<X>(beta), pixels);
  });
  CUDA_CHECK_LAUNCH(l.stream, "softmax_ce_backward");
}

void multiclass_dice_sums(const TensorRef& logits, const TensorRef& target, const TensorRef& sums) {
  const ClassLayout L = class_layout(logits);
  const int64_t pixels = logits.numel() / L.C;
  Launch l(logits);
  const int blocks = blocks_for(pixels);
  unetcu::cuda::DeviceBuffer partials(logits.device().index,
                                      3 * size_t(L.C) * size_t(blocks) * sizeof(double));
  UNETCU_DISPATCH_LOSS(logits, target, {
    multiclass_dice_sums_kernel<<<dim3(unsigned(blocks), unsigned(L.C)), kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), L, static_cast<double*>(partials.get()), pixels);
  });
  CUDA_CHECK_LAUNCH(l.stream, "multiclass_dice_sums");
  sum_rows_kernel<<<unsigned(3 * L.C), kThreads, 0, l.stream>>>(
      static_cast<const double*>(partials.get()), blocks, sums.data<double>());
  CUDA_CHECK_LAUNCH(l.stream, "multiclass_dice_sums (sum)");
}

void multiclass_dice_loss_from_sums(const TensorRef& sums, double smooth, const TensorRef& loss) {
  Launch l(sums);
  UNETCU_DISPATCH_FLOAT(loss.dtype(), Lt, {
    multiclass_dice_loss_kernel<<<1, 1, 0, l.stream>>>(sums.data<double>(), sums.dim(1), smooth,
                                                        loss.data<Lt>());
  });
  CUDA_CHECK_LAUNCH(l.stream, "multiclass_dice_loss_from_sums");
}

void multiclass_dice_backward(const TensorRef& logits, const TensorRef& target,
                              const TensorRef& sums, double smooth, const TensorRef& grad_loss,
                              const TensorRef& grad_x, double beta) {
  const ClassLayout L = class_layout(logits);
  const int64_t pixels = logits.numel() / L.C;
  Launch l(logits);
  UNETCU_DISPATCH_LOSS(logits, target, {
    multiclass_dice_backward_kernel<<<blocks_for(pixels), kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), L, sums.data<double>(), smooth,
        grad_loss.data<acc_t<X>>(), grad_x.data<X>(), acc_t<X>(beta), pixels);
  });
  CUDA_CHECK_LAUNCH(l.stream, "multiclass_dice_backward");
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

void confusion_update(const TensorRef& logits, const TensorRef& target, const TensorRef& counts) {
  const ClassLayout L = class_layout(logits);
  const int64_t pixels = logits.numel() / L.C;
  Launch l(logits);
  UNETCU_DISPATCH_LOSS(logits, target, {
    confusion_kernel<<<blocks_for(pixels), kThreads, 0, l.stream>>>(
        logits.data<X>(), target.data<Tt>(), L, counts.data<double>(), counts.dim(0), pixels);
  });
  CUDA_CHECK_LAUNCH(l.stream, "confusion_update");
}

}  // namespace unetcu::kernels::cuda
