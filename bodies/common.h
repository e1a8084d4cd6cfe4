// Shared by every math body: HD marks a function that both g++ (CPU launchers) and nvcc
// (CUDA launchers) compile, so each op's arithmetic is written once.
// bodies/ is the bottom layer: pointers, scalars and geometry structs only; its files
// include each other and the C++ standard library, nothing else (tests/layering_test.sh).
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define HD __host__ __device__ __forceinline__
#else
#define HD inline
#endif

namespace unetcu::kernels {

#if !defined(__CUDA_ARCH__)
// The bodies' unqualified sqrt, exp, log1p and fabs: on the host, <cmath>'s float overloads
// (otherwise sqrt(float) is C's double sqrt, and a float body computes in double on the CPU
// and in float on the GPU, whose device overloads take float).
using std::exp;
using std::fabs;
using std::fma;
using std::log;
using std::log1p;
using std::sqrt;
#endif

// a * b + c rounded once where the machine has a fused multiply-add, else rounded twice, the
// same way wherever a body calls it in one build: a compiler may or may not contract a plain
// a * b + c into an fma, differently in two loops, and a value recomputed in another kernel
// (the fused batch norm's ReLU mask, bodies/batchnorm.h) must have the forward's bits. The
// GPU and the CPU with FMA give the fma; a CPU without FMA has no fused instruction for the
// compiler to contract to either.
template <class T> HD T mul_add(T a, T b, T c) {
#if defined(__CUDA_ARCH__) || (defined(__FP_FAST_FMA) && defined(__FP_FAST_FMAF))
  return fma(a, b, c);
#else
  return a * b + c;
#endif
}

// Output size of a sliding window (conv, pooling) along one axis.
HD int64_t window_out_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dilation) {
  return (in + 2 * pad - dilation * (k - 1) - 1) / stride + 1;
}

}  // namespace unetcu::kernels
