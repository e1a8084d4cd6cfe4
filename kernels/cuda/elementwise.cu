// CUDA launchers of fill, axpby, relu, sigmoid and add: grid-stride loops over the bodies of
// kernels/bodies/elementwise.h (the same ones the CPU backend runs), templated on the storage
// type: a bfloat16 element is read as float, computed there and rounded once on store. The
// loops walk memory order, so they serve either memory format (the op layer makes operands
// agree).
#include "kernels/cuda/common.cuh"
#include "kernels/bodies/elementwise.h"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

template <class S> __global__ void fill_kernel(S* d, S v, int64_t n) {
  GRID_STRIDE(i, n) d[i] = v;
}
template <class S>
__global__ void axpby_kernel(S* d, acc_t<S> a, const S* s, acc_t<S> b, int64_t n) {
  GRID_STRIDE(i, n) store(d + i, a * acc_t<S>(s[i]), b);
}
template <class S> __global__ void relu_forward_kernel(const S* x, S* y, int64_t n) {
  GRID_STRIDE(i, n) y[i] = to_storage<S>(kernels::relu_forward(acc_t<S>(x[i])));
}
template <class S>
__global__ void relu_backward_kernel(const S* gy, const S* y, S* gx, acc_t<S> b, int64_t n) {
  GRID_STRIDE(i, n) store(gx + i, kernels::relu_backward(acc_t<S>(gy[i]), acc_t<S>(y[i])), b);
}
template <class S> __global__ void sigmoid_forward_kernel(const S* x, S* y, int64_t n) {
  GRID_STRIDE(i, n) y[i] = to_storage<S>(kernels::sigmoid_forward(acc_t<S>(x[i])));
}
template <class S>
__global__ void sigmoid_backward_kernel(const S* gy, const S* y, S* gx, acc_t<S> b, int64_t n) {
  GRID_STRIDE(i, n) store(gx + i, kernels::sigmoid_backward(acc_t<S>(gy[i]), acc_t<S>(y[i])), b);
}
template <class S> __global__ void add_kernel(const S* a, const S* b, S* y, int64_t n) {
  GRID_STRIDE(i, n) y[i] = to_storage<S>(acc_t<S>(a[i]) + acc_t<S>(b[i]));
}

}  // namespace

// Any storage type: float64 device scalars (the Dice sums) are filled too.
void fill(const TensorRef& dst, double value) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  Launch l(dst);
  UNETCU_DISPATCH_STORAGE(dst.dtype(), S, {
    fill_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(dst.data<S>(),
                                                          to_storage<S>(acc_t<S>(value)), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "fill");
}

// The tape accumulates gradients with this: on bfloat16 the destination is read, the sum
// formed in float32 and rounded once.
void axpby(const TensorRef& dst, double alpha, const TensorRef& src, double beta) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  Launch l(dst);
  UNETCU_DISPATCH_STORAGE(dst.dtype(), S, {
    axpby_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
        dst.data<S>(), acc_t<S>(alpha), src.data<S>(), acc_t<S>(beta), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "axpby");
}

void relu_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  Launch l(x);
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    relu_forward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(x.data<S>(), y.data<S>(), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "relu_forward");
}

void relu_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x,
                   double beta) {
  const int64_t n = y.numel();
  if (n == 0) return;
  Launch l(y);
  UNETCU_DISPATCH_STORAGE(y.dtype(), S, {
    relu_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
        grad_y.data<S>(), y.data<S>(), grad_x.data<S>(), acc_t<S>(beta), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "relu_backward");
}

void sigmoid_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  Launch l(x);
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    sigmoid_forward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(x.data<S>(), y.data<S>(), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "sigmoid_forward");
}

void sigmoid_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x,
                      double beta) {
  const int64_t n = y.numel();
  if (n == 0) return;
  Launch l(y);
  UNETCU_DISPATCH_STORAGE(y.dtype(), S, {
    sigmoid_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
        grad_y.data<S>(), y.data<S>(), grad_x.data<S>(), acc_t<S>(beta), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "sigmoid_backward");
}

void add_forward(const TensorRef& a, const TensorRef& b, const TensorRef& y) {
  const int64_t n = a.numel();
  if (n == 0) return;
  Launch l(a);
  UNETCU_DISPATCH_STORAGE(a.dtype(), S, {
    add_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(a.data<S>(), b.data<S>(), y.data<S>(), n);
  });
  CUDA_CHECK_LAUNCH(l.stream, "add_forward");
}

}  // namespace unetcu::kernels::cuda
