// Helpers shared by the op glue in engine/ops/*.cpp.
#pragma once
#include "engine/profiler.h"
#include "engine/tape.h"
#include "engine/tensor.h"

namespace unetcu::ops_detail {

// The backend an op runs on is chosen by its inputs' device (UNETCU_LAUNCH in
// kernels/launchers.h). The CPU backend takes float32 and float64; the CUDA backend float32.
inline void check_backend(const char* op, const Tensor& t) {
  UNETCU_CHECK(t.defined(), op, ": undefined input tensor");
  UNETCU_CHECK(t.device().is_cpu() || t.dtype() == DType::F32, op, ": ", t.device().str(),
               " computes in float32, got ", dtype_name(t.dtype()));
}

inline Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

// Bytes of tensors, for the profiler's bytes-moved figures.
inline double bytes_of(std::initializer_list<const Tensor*> ts) {
  double b = 0;
  for (const Tensor* t : ts)
    if (t && t->defined()) b += double(t->nbytes());
  return b;
}

}  // namespace unetcu::ops_detail
