// Per-element bodies of relu, sigmoid, add and scale, forward and backward. They compute in the
// type they are given; a launcher over bfloat16 storage widens to float (acc_t) first and
// rounds once when it stores (store below).
#pragma once
#include "bodies/bf16.h"
#include "bodies/common.h"

namespace unetcu::kernels {

template <class T> HD T relu_forward(T x) { return x > T(0) ? x : T(0); }
// The gradient passes where the output is positive (at x == 0 it is 0, as in PyTorch).
template <class T> HD T relu_backward(T grad_y, T y) { return y > T(0) ? grad_y : T(0); }

// Stable for any |x|: exp is only taken of a non-positive number.
template <class T> HD T sigmoid_forward(T x) {
  if (x >= T(0)) return T(1) / (T(1) + exp(-x));
  T e = exp(x);
  return e / (T(1) + e);
}
template <class T> HD T sigmoid_backward(T grad_y, T y) { return grad_y * y * (T(1) - y); }

// The unary ops as types, for the launchers written once over them.
struct Relu {
  template <class T> HD T forward(T x) const { return relu_forward(x); }
  template <class T> HD T backward(T grad_y, T y) const { return relu_backward(grad_y, y); }
};
struct Sigmoid {
  template <class T> HD T forward(T x) const { return sigmoid_forward(x); }
  template <class T> HD T backward(T grad_y, T y) const { return sigmoid_backward(grad_y, y); }
};

// Stores a computed value into storage S. beta is 0 (overwrite; the destination may hold
// garbage) or 1 (accumulate: the destination is read in the compute type, the sum formed
// there and rounded once). For float and double it is *dst = value or *dst + value.
template <class S> HD void store(S* dst, acc_t<S> value, acc_t<S> beta) {
  *dst = to_storage<S>(beta == acc_t<S>(0) ? value : acc_t<S>(*dst) + value);
}

}  // namespace unetcu::kernels
