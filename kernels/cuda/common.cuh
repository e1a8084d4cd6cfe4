// Shared pieces of the CUDA launchers: grid-stride loops, a block sum reduction, and the
// stream/device set-up every launcher starts with.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <type_traits>

#include "runtime/cuda/runtime.cuh"
#include "runtime/tensor_ref.h"
#include "bodies/bf16.h"
#include "bodies/common.h"
#include "bodies/divide.h"

namespace unetcu::kernels::cuda {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements: enough to fill the GPU, no more.
inline int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return int(std::clamp<int64_t>(b, 1, 4096));
}

#define GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// A grid-stride loop with index type I (uint32_t or int64_t, see with_index_type).
#define GRID_STRIDE_I(I, i, n) \
  for (I i = I(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += I(gridDim.x) * blockDim.x)

// Calls f(I()) with I = uint32_t when no index of the launch reaches `largest` >= 2^31
// (32-bit index math and Divider<uint32_t>, bodies/divide.h), else with int64_t.
template <class F>
void with_index_type(int64_t largest, F&& f) {
  if (index_fits_32(largest))
    f(uint32_t());
  else
    f(int64_t());
}

// Sets the tensor's device for the scope and gives its current stream.
struct Launch {
  explicit Launch(const TensorRef& t)
      : guard(t.device().index), stream(unetcu::cuda::current_stream(t.device().index)) {}
  unetcu::cuda::DeviceGuard guard;
  cudaStream_t stream;
};

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024); valid in thread 0.
template <class T>
__device__ T block_sum(T v) {
  __shared__ T warp_sums[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x >> 5) ? warp_sums[lane] : T(0);
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  __syncthreads();  // warp_sums may be reused by a following call
  return v;
}

// ---- packed accesses: V consecutive values of S in one load or store ---------------------
//
// Memory-bound kernels move 16 bytes per thread per access (kPack<S> values: 8 bf16, 4 floats)
// where the tensor's rows allow it: one 128-bit instruction instead of kPack scalar ones, so
// enough bytes are in flight to reach the memory's bandwidth. V = 1 is the scalar access.
template <class S> constexpr int kPack = int(16 / sizeof(S));
template <class S, int V> struct alignas(sizeof(S) * V) Pack {
  S v[V];
};

// A kernel parameter too large to copy per thread (a launch's batch of tensor pointers, about
// 21 KB): __grid_constant__ on a GPU, read in place from the parameter space; in the CUDA
// emulator, where a kernel is a C++ function called once per emulated thread, a reference to
// the launch's one copy (a by-value parameter was copied on every call: most of an emulated
// training step's time).
#ifdef UNETCU_CUDA_EMU
#define UNETCU_GRID_PARAM(T) const T&
#else
#define UNETCU_GRID_PARAM(T) const __grid_constant__ T
#endif

// The pack at p (aligned to V values). A misaligned vector access faults on a GPU (misaligned
// address); on x86 it would just work, so the CUDA emulator stops the run there instead.
template <int V, class S> __device__ __forceinline__ Pack<S, V>& pack_at(S* p) {
#ifdef UNETCU_CUDA_EMU
  if (reinterpret_cast<uintptr_t>(p) % sizeof(Pack<S, V>) != 0) {
    std::fprintf(stderr, "CUDA emulator: a %d-byte access at %p is not aligned to its size\n",
                 int(sizeof(Pack<S, V>)), static_cast<const void*>(p));
    std::abort();
  }
#endif
  return *reinterpret_cast<Pack<S, V>*>(p);
}
template <int V, class S> __device__ __forceinline__ const Pack<S, V>& pack_at(const S* p) {
  return pack_at<V>(const_cast<S*>(p));
}

// out[j] = p[j] widened to the compute type; p aligned to V values.
template <int V, class S> __device__ __forceinline__ void load_pack(const S* p, acc_t<S> (&out)[V]) {
  const Pack<S, V> pk = pack_at<V>(p);
  for (int j = 0; j < V; ++j) out[j] = acc_t<S>(pk.v[j]);
}

// p[j] = in[j] rounded once to S, or with beta 1 the sum p[j] + in[j] formed in the compute type
// and rounded once (store(), bodies/elementwise.h); p aligned to V values.
template <int V, class S>
__device__ __forceinline__ void store_pack(S* p, const acc_t<S> (&in)[V], acc_t<S> beta = 0) {
  Pack<S, V> pk;
  if (beta == acc_t<S>(0)) {
    for (int j = 0; j < V; ++j) pk.v[j] = to_storage<S>(in[j]);
  } else {
    pk = pack_at<V>(p);
    for (int j = 0; j < V; ++j) pk.v[j] = to_storage<S>(acc_t<S>(pk.v[j]) + in[j]);
  }
  pack_at<V>(p) = pk;
}

// Whether every pointer given (null ones pass) is aligned to `bytes`.
inline bool aligned_to(size_t) { return true; }
template <class P, class... Ps> bool aligned_to(size_t bytes, P* p, Ps*... ps) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0 && aligned_to(bytes, ps...);
}

// Whether packs of S fit a launch: every count given a multiple of kPack<S> and every pointer
// (null ones pass) aligned to a pack.
template <class S, class... Ps> bool packs_fit(std::initializer_list<int64_t> counts, Ps*... ptrs) {
  for (int64_t c : counts)
    if (c % kPack<S> != 0) return false;
  return aligned_to(sizeof(S) * kPack<S>, ptrs...);
}

// Calls f(std::integral_constant<int, V>()) with V = kPack<S> where `fits` (packs_fit), else
// with V = 1: the one choice between packed and scalar accesses every launcher makes.
template <class S, class F> void with_pack(bool fits, F&& f) {
  if (fits)
    f(std::integral_constant<int, kPack<S>>());
  else
    f(std::integral_constant<int, 1>());
}

// The CUDA backend computes in float32 (the op layer checks); launchers read float data.
inline float* fdata(const TensorRef& t) { return t.data<float>(); }

}  // namespace unetcu::kernels::cuda
