// Helpers shared by the op glue in engine/ops/*.cpp.
#pragma once
#include "engine/tape.h"
#include "engine/tensor.h"

namespace unetcu::ops_detail {

// The backend an op runs on is chosen by its inputs' device. Until the CUDA op backend is
// linked in, CUDA tensors are refused here with a clear message.
inline void check_backend(const char* op, const Tensor& t) {
  UNETCU_CHECK(t.defined(), op, ": undefined input tensor");
  UNETCU_CHECK(t.device().is_cpu(), op, ": no ", t.device().str(),
               " implementation in this build");
}

inline Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

}  // namespace unetcu::ops_detail
