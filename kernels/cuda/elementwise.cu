// CUDA launchers of fill, axpby, relu, sigmoid and add: grid-stride loops over the bodies of
// bodies/elementwise.h (the same ones the CPU backend runs), templated on the storage
// type: a bfloat16 element is read as float, computed there and rounded once on store. The
// loops walk memory order, so they serve either memory format (the op layer makes operands
// agree), in 16-byte packs where the element count and the pointers allow (by_packs).
#include "kernels/cuda/common.cuh"
#include "bodies/elementwise.h"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

// Each kernel walks n / V units of V consecutive elements: a 16-byte pack (V = kPack<S>)
// where n is a multiple of it and every pointer aligned, else one element (V = 1).
template <int V, class S> __global__ void fill_kernel(S* d, S v, int64_t n) {
  Pack<S, V> pk;
  for (int j = 0; j < V; ++j) pk.v[j] = v;
  GRID_STRIDE(i, n) pack_at<V>(d + i * V) = pk;
}
template <int V, class S>
__global__ void axpby_kernel(S* d, acc_t<S> a, const S* s, acc_t<S> b, int64_t n) {
  GRID_STRIDE(i, n) {
    acc_t<S> v[V];
    load_pack<V>(s + i * V, v);
    for (int j = 0; j < V; ++j) v[j] = a * v[j];
    store_pack<V>(d + i * V, v, b);
  }
}
// y = f(x) and gx = df(gy, y) (written or accumulated by b) for relu and sigmoid: F gives
// forward(x) and backward(gy, y) over the bodies.
template <int V, class F, class S>
__global__ void unary_forward_kernel(F f, const S* x, S* y, int64_t n) {
  GRID_STRIDE(i, n) {
    acc_t<S> v[V];
    load_pack<V>(x + i * V, v);
    for (int j = 0; j < V; ++j) v[j] = f.forward(v[j]);
    store_pack<V>(y + i * V, v);
  }
}
template <int V, class F, class S>
__global__ void unary_backward_kernel(F f, const S* gy, const S* y, S* gx, acc_t<S> b, int64_t n) {
  GRID_STRIDE(i, n) {
    acc_t<S> g[V], yv[V];
    load_pack<V>(gy + i * V, g);
    load_pack<V>(y + i * V, yv);
    for (int j = 0; j < V; ++j) g[j] = f.backward(g[j], yv[j]);
    store_pack<V>(gx + i * V, g, b);
  }
}
template <int V, class S> __global__ void add_kernel(const S* a, const S* b, S* y, int64_t n) {
  GRID_STRIDE(i, n) {
    acc_t<S> u[V], v[V];
    load_pack<V>(a + i * V, u);
    load_pack<V>(b + i * V, v);
    for (int j = 0; j < V; ++j) u[j] += v[j];
    store_pack<V>(y + i * V, u);
  }
}

// Launches k<V> over n elements as n / V units: V = kPack<S> where n is a multiple of it and
// every pointer aligned to a pack, else 1 (with_pack). launch(pack, blocks, units) is called
// with V as pack's value.
template <class S, class Launcher, class... Ptrs>
void by_packs(int64_t n, Launcher&& launch, Ptrs*... ptrs) {
  with_pack<S>(packs_fit<S>({n}, ptrs...), [&](auto pack) {
    constexpr int V = decltype(pack)::value;
    launch(pack, blocks_for(n / V), n / V);
  });
}

}  // namespace

// Any storage type: float64 device scalars (the Dice sums) are filled too.
void fill(const TensorRef& dst, double value) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  Launch l(dst);
  UNETCU_DISPATCH_STORAGE(dst.dtype(), S, {
    by_packs<S>(n, [&](auto pack, int blocks, int64_t units) {
      fill_kernel<decltype(pack)::value><<<blocks, kThreads, 0, l.stream>>>(
          dst.data<S>(), to_storage<S>(acc_t<S>(value)), units);
    }, dst.data<S>());
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
    by_packs<S>(n, [&](auto pack, int blocks, int64_t units) {
      axpby_kernel<decltype(pack)::value><<<blocks, kThreads, 0, l.stream>>>(
          dst.data<S>(), acc_t<S>(alpha), src.data<S>(), acc_t<S>(beta), units);
    }, dst.data<S>(), src.data<S>());
  });
  CUDA_CHECK_LAUNCH(l.stream, "axpby");
}

namespace {

// The launchers of the unary ops (Relu, Sigmoid: bodies/elementwise.h), written once.
template <class Op>
void unary_forward(const char* name, const TensorRef& x, const TensorRef& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  Launch l(x);
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    by_packs<S>(n, [&](auto pack, int blocks, int64_t units) {
      unary_forward_kernel<decltype(pack)::value><<<blocks, kThreads, 0, l.stream>>>(
          Op(), x.data<S>(), y.data<S>(), units);
    }, x.data<S>(), y.data<S>());
  });
  CUDA_CHECK_LAUNCH(l.stream, name);
}

template <class Op>
void unary_backward(const char* name, const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x,
                    double beta) {
  const int64_t n = y.numel();
  if (n == 0) return;
  Launch l(y);
  UNETCU_DISPATCH_STORAGE(y.dtype(), S, {
    by_packs<S>(n, [&](auto pack, int blocks, int64_t units) {
      unary_backward_kernel<decltype(pack)::value><<<blocks, kThreads, 0, l.stream>>>(
          Op(), grad_y.data<S>(), y.data<S>(), grad_x.data<S>(), acc_t<S>(beta), units);
    }, grad_y.data<S>(), y.data<S>(), grad_x.data<S>());
  });
  CUDA_CHECK_LAUNCH(l.stream, name);
}

}  // namespace

void relu_forward(const TensorRef& x, const TensorRef& y) { unary_forward<Relu>("relu_forward", x, y); }

void relu_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x, double beta) {
  unary_backward<Relu>("relu_backward", grad_y, y, grad_x, beta);
}

void sigmoid_forward(const TensorRef& x, const TensorRef& y) { unary_forward<Sigmoid>("sigmoid_forward", x, y); }

void sigmoid_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& grad_x, double beta) {
  unary_backward<Sigmoid>("sigmoid_backward", grad_y, y, grad_x, beta);
}

void add_forward(const TensorRef& a, const TensorRef& b, const TensorRef& y) {
  const int64_t n = a.numel();
  if (n == 0) return;
  Launch l(a);
  UNETCU_DISPATCH_STORAGE(a.dtype(), S, {
    by_packs<S>(n, [&](auto pack, int blocks, int64_t units) {
      add_kernel<decltype(pack)::value><<<blocks, kThreads, 0, l.stream>>>(
          a.data<S>(), b.data<S>(), y.data<S>(), units);
    }, a.data<S>(), b.data<S>(), y.data<S>());
  });
  CUDA_CHECK_LAUNCH(l.stream, "add_forward");
}

}  // namespace unetcu::kernels::cuda
