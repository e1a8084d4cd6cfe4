// CUDA launchers of fill, axpby, relu, sigmoid and add: grid-stride loops over the bodies of
// kernels/bodies/elementwise.h (the same ones the CPU backend runs).
#include "kernels/cuda/common.cuh"
#include "kernels/bodies/elementwise.h"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

__global__ void fill_kernel(float* d, float v, int64_t n) {
  GRID_STRIDE(i, n) d[i] = v;
}
__global__ void fill_kernel_f64(double* d, double v, int64_t n) {
  GRID_STRIDE(i, n) d[i] = v;
}
__global__ void axpby_kernel(float* d, float a, const float* s, float b, int64_t n) {
  GRID_STRIDE(i, n) store(d + i, a * s[i], b);
}
__global__ void relu_forward_kernel(const float* x, float* y, int64_t n) {
  GRID_STRIDE(i, n) y[i] = kernels::relu_forward(x[i]);
}
__global__ void relu_backward_kernel(const float* gy, const float* y, float* gx, float b, int64_t n) {
  GRID_STRIDE(i, n) store(gx + i, kernels::relu_backward(gy[i], y[i]), b);
}
__global__ void sigmoid_forward_kernel(const float* x, float* y, int64_t n) {
  GRID_STRIDE(i, n) y[i] = kernels::sigmoid_forward(x[i]);
}
__global__ void sigmoid_backward_kernel(const float* gy, const float* y, float* gx, float b, int64_t n) {
  GRID_STRIDE(i, n) store(gx + i, kernels::sigmoid_backward(gy[i], y[i]), b);
}
__global__ void add_kernel(const float* a, const float* b, float* y, int64_t n) {
  GRID_STRIDE(i, n) y[i] = a[i] + b[i];
}

}  // namespace

void fill(const TensorRef& dst, double value) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  Launch l(dst);
  if (dst.dtype() == DType::F64)  // float64 device scalars (Dice sums) are filled too
    fill_kernel_f64<<<blocks_for(n), kThreads, 0, l.stream>>>(dst.data<double>(), value, n);
  else
    fill_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(dst), float(value), n);
  CUDA_CHECK_LAUNCH(l.stream, "fill");
}

void axpby(const TensorRef& dst, double alpha, const TensorRef& src, double beta) {
  const int64_t n = dst.numel();
  Launch l(dst);
  axpby_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(dst), float(alpha), fdata(src),
                                                         float(beta), n);
  CUDA_CHECK_LAUNCH(l.stream, "axpby");
}

void relu_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t n = x.numel();
  Launch l(x);
  relu_forward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(x), fdata(y), n);
  CUDA_CHECK_LAUNCH(l.stream, "relu_forward");
}

void relu_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x,
                   double beta) {
  const int64_t n = y.numel();
  Launch l(y);
  relu_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(grad_y), fdata(y),
                                                                 fdata(grad_x), float(beta), n);
  CUDA_CHECK_LAUNCH(l.stream, "relu_backward");
}

void sigmoid_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t n = x.numel();
  Launch l(x);
  sigmoid_forward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(x), fdata(y), n);
  CUDA_CHECK_LAUNCH(l.stream, "sigmoid_forward");
}

void sigmoid_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x,
                      double beta) {
  const int64_t n = y.numel();
  Launch l(y);
  sigmoid_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(grad_y), fdata(y),
                                                                    fdata(grad_x), float(beta), n);
  CUDA_CHECK_LAUNCH(l.stream, "sigmoid_backward");
}

void add_forward(const TensorRef& a, const TensorRef& b, const TensorRef& y) {
  const int64_t n = a.numel();
  Launch l(a);
  add_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(a), fdata(b), fdata(y), n);
  CUDA_CHECK_LAUNCH(l.stream, "add_forward");
}

}  // namespace unetcu::kernels::cuda
