// copy_to_host_async / host_wait for builds without CUDA: there is no device to copy from.
#include "runtime/common.h"
#include "runtime/cuda_api.h"

namespace unetcu::cuda {

Event copy_to_host_async(void*, const void*, int device, size_t) {
  throw Error(str_cat("cuda:", device, " requested, but this build has no CUDA"));
}

void host_wait(const Event&) {}

}  // namespace unetcu::cuda
