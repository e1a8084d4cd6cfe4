// Shared by every math body: HD marks a function that both g++ (CPU launchers) and nvcc
// (CUDA launchers) compile, so each op's arithmetic is written once.
// kernels/bodies/ is the bottom layer: pointers, scalars and geometry structs only; its files
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
using std::log1p;
using std::sqrt;
#endif

// Output size of a sliding window (conv, pooling) along one axis.
HD int64_t window_out_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dilation) {
  return (in + 2 * pad - dilation * (k - 1) - 1) / stride + 1;
}

}  // namespace unetcu::kernels
