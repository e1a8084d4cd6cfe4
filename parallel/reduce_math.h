// The arithmetic of the CPU all-reduces (the in-process ring, parallel/cpu_ring.cpp, and the
// one across processes, parallel/process_communicator.cpp), so both add the same elements the
// same way: each sum is computed in acc_t<T> and rounded once to T when stored (bfloat16
// buffers are added in float32 and rounded at every step of the ring, as NCCL does), and the
// mean's division likewise.
#pragma once
#include <cstdint>

#include "runtime/dtype.h"

namespace unetcu {

// dst += src.
template <class T>
void reduce_add_into(T* dst, const T* src, int64_t n) {
  using A = kernels::acc_t<T>;
  for (int64_t i = 0; i < n; ++i) dst[i] = kernels::to_storage<T>(A(dst[i]) + A(src[i]));
}

// x /= by.
template <class T>
void reduce_divide(T* x, int64_t n, int by) {
  using A = kernels::acc_t<T>;
  for (int64_t i = 0; i < n; ++i) x[i] = kernels::to_storage<T>(A(x[i]) / A(by));
}

}  // namespace unetcu
