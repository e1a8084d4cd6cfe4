// CPU launchers of relu, sigmoid, add, axpby: OpenMP loops over kernels/bodies/elementwise.h.
#include "kernels/bodies/elementwise.h"

#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"

namespace unetcu::kernels::cpu {

void axpby(const TensorRef& dst, double alpha, const TensorRef& src, double beta) {
  const int64_t n = dst.numel();
  UNETCU_DISPATCH_FLOAT(dst.dtype(), T, {
    T* d = dst.data<T>();
    const T* s = src.data<T>();
    const T a = T(alpha), b = T(beta);
    parallel_for(n, [&](int64_t i) { store(d + i, a * s[i], b); });
  });
}

void fill(const TensorRef& dst, double value) {
  const int64_t n = dst.numel();
  UNETCU_DISPATCH_FLOAT(dst.dtype(), T, {
    T* d = dst.data<T>();
    const T v = T(value);
    parallel_for(n, [&](int64_t i) { d[i] = v; });
  });
}

void relu_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t n = x.numel();
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, {
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    parallel_for(n, [&](int64_t i) { yp[i] = kernels::relu_forward(xp[i]); });
  });
}

void relu_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x,
                   double beta) {
  const int64_t n = y.numel();
  UNETCU_DISPATCH_FLOAT(y.dtype(), T, {
    const T* gy = grad_y.data<T>();
    const T* yp = y.data<T>();
    T* gx = grad_x.data<T>();
    const T b = T(beta);
    parallel_for(n, [&](int64_t i) { store(gx + i, kernels::relu_backward(gy[i], yp[i]), b); });
  });
}

void sigmoid_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t n = x.numel();
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, {
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    parallel_for(n, [&](int64_t i) { yp[i] = kernels::sigmoid_forward(xp[i]); });
  });
}

void sigmoid_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x,
                      double beta) {
  const int64_t n = y.numel();
  UNETCU_DISPATCH_FLOAT(y.dtype(), T, {
    const T* gy = grad_y.data<T>();
    const T* yp = y.data<T>();
    T* gx = grad_x.data<T>();
    const T b = T(beta);
    parallel_for(n, [&](int64_t i) { store(gx + i, kernels::sigmoid_backward(gy[i], yp[i]), b); });
  });
}

void add_forward(const TensorRef& a, const TensorRef& b, const TensorRef& y) {
  const int64_t n = a.numel();
  UNETCU_DISPATCH_FLOAT(a.dtype(), T, {
    const T* ap = a.data<T>();
    const T* bp = b.data<T>();
    T* yp = y.data<T>();
    parallel_for(n, [&](int64_t i) { yp[i] = ap[i] + bp[i]; });
  });
}

}  // namespace unetcu::kernels::cpu
