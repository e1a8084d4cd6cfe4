// Helpers shared by the op glue in engine/ops/*.cpp.
#pragma once
#include "engine/profiler.h"
#include "engine/tape.h"
#include "engine/tensor.h"

namespace unetcu::ops_detail {

// What an op takes beyond float32 (and float64 on the CPU) in NCHW.
struct Accepts {
  bool bf16 = false;  // bfloat16 storage (computed in float32)
  bool nhwc = false;  // channels-last memory format
};

// The backend an op runs on is chosen by its inputs' device (UNETCU_LAUNCH in
// kernels/launchers.h). The CPU backend takes float32 and float64; the CUDA backend float32;
// both take bfloat16 and NHWC for the ops that say so.
inline void check_backend(const char* op, const Tensor& t, Accepts a = {}) {
  UNETCU_CHECK(t.defined(), op, ": undefined input tensor");
  if (t.dtype() == DType::BF16)
    UNETCU_CHECK(a.bf16, op, ": no bfloat16 kernel");
  else
    UNETCU_CHECK(t.device().is_cpu() || t.dtype() == DType::F32, op, ": ", t.device().str(),
                 " computes in float32 or bfloat16, got ", dtype_name(t.dtype()));
  UNETCU_CHECK(a.nhwc || t.format() == MemoryFormat::NCHW, op, ": no channels-last (NHWC) kernel");
}

inline Tensor empty_like(const Tensor& t) {
  return Tensor::empty(t.shape(), t.dtype(), t.device(), t.format());
}

// Bytes of tensors, for the profiler's bytes-moved figures.
inline double bytes_of(std::initializer_list<const Tensor*> ts) {
  double b = 0;
  for (const Tensor* t : ts)
    if (t && t->defined()) b += double(t->nbytes());
  return b;
}

}  // namespace unetcu::ops_detail
