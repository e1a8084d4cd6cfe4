// CPU launchers of fill, axpby, relu, sigmoid and add: OpenMP loops over
// bodies/elementwise.h. Every storage type (float32, float64, bfloat16): a bfloat16
// element is read as float, computed there and rounded once on store. The loops walk memory
// order, so they serve either memory format (the op layer makes operands agree).
#include "bodies/elementwise.h"

#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"

namespace unetcu::kernels::cpu {

// dst = alpha * src (+ dst): the gradient accumulation of the tape, so on bfloat16 the sum is
// formed in float32 from the destination's value and rounded once.
void axpby(const TensorRef& dst, double alpha, const TensorRef& src, double beta) {
  const int64_t n = dst.numel();
  UNETCU_DISPATCH_STORAGE(dst.dtype(), T, {
    using A = acc_t<T>;
    T* d = dst.data<T>();
    const T* s = src.data<T>();
    const A a = A(alpha), b = A(beta);
    parallel_for(n, [&](int64_t i) { store(d + i, a * A(s[i]), b); });
  });
}

void fill(const TensorRef& dst, double value) {
  const int64_t n = dst.numel();
  UNETCU_DISPATCH_STORAGE(dst.dtype(), T, {
    T* d = dst.data<T>();
    const T v = to_storage<T>(acc_t<T>(value));
    parallel_for(n, [&](int64_t i) { d[i] = v; });
  });
}

namespace {

// The unary ops (kernels::Relu, kernels::Sigmoid: bodies/elementwise.h), written once.
template <class Op>
void unary_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t n = x.numel();
  UNETCU_DISPATCH_STORAGE(x.dtype(), T, {
    using A = acc_t<T>;
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    parallel_for(n, [&](int64_t i) { yp[i] = to_storage<T>(Op().forward(A(xp[i]))); });
  });
}

template <class Op>
void unary_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x, double beta) {
  const int64_t n = y.numel();
  UNETCU_DISPATCH_STORAGE(y.dtype(), T, {
    using A = acc_t<T>;
    const T* gy = grad_y.data<T>();
    const T* yp = y.data<T>();
    T* gx = grad_x.data<T>();
    const A b = A(beta);
    parallel_for(n, [&](int64_t i) { store(gx + i, Op().backward(A(gy[i]), A(yp[i])), b); });
  });
}

}  // namespace

void relu_forward(const TensorRef& x, const TensorRef& y) { unary_forward<kernels::Relu>(x, y); }

void relu_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x, double beta) {
  unary_backward<kernels::Relu>(grad_y, y, grad_x, beta);
}

void sigmoid_forward(const TensorRef& x, const TensorRef& y) { unary_forward<kernels::Sigmoid>(x, y); }

void sigmoid_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x, double beta) {
  unary_backward<kernels::Sigmoid>(grad_y, y, grad_x, beta);
}

void add_forward(const TensorRef& a, const TensorRef& b, const TensorRef& y) {
  const int64_t n = a.numel();
  UNETCU_DISPATCH_STORAGE(a.dtype(), T, {
    using A = acc_t<T>;
    const T* ap = a.data<T>();
    const T* bp = b.data<T>();
    T* yp = y.data<T>();
    parallel_for(n, [&](int64_t i) { yp[i] = to_storage<T>(A(ap[i]) + A(bp[i])); });
  });
}

}  // namespace unetcu::kernels::cpu
