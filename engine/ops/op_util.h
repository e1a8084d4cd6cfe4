// Helpers shared by the op glue in engine/ops/*.cpp.
#pragma once
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

}  // namespace unetcu::ops_detail
