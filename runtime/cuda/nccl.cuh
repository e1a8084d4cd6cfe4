// NCCL's check macro, for the data-parallel communicator (parallel/). Throws unetcu::Error
// with the expression, file:line, the current device and NCCL's message.
#pragma once
#include <nccl.h>

#include "runtime/cuda/runtime.cuh"

#define NCCL_CHECK(expr)                                                                   \
  do {                                                                                     \
    ncclResult_t res_ = (expr);                                                            \
    if (res_ != ncclSuccess)                                                               \
      ::unetcu::cuda::throw_error("NCCL", #expr, __FILE__, __LINE__, ncclGetErrorString(res_)); \
  } while (0)

namespace unetcu::cuda {
int nccl_version();  // e.g. 22805 for 2.28.5
}  // namespace unetcu::cuda
