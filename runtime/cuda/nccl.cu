#include "runtime/cuda/nccl.cuh"

namespace unetcu::cuda {

int nccl_version() {
  int v = 0;
  NCCL_CHECK(ncclGetVersion(&v));
  return v;
}

}  // namespace unetcu::cuda
