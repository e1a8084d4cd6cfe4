// copy_to_host_async, host_wait, copy_after, enable_peer_access for builds without CUDA: there is no device to copy from.
#include "runtime/common.h"
#include "runtime/cuda_api.h"

namespace unetcu::cuda {

Event copy_to_host_async(void*, const void*, int device, size_t) {
  throw Error(str_cat("cuda:", device, " requested, but this build has no CUDA"));
}

void host_wait(const Event&) {}

void copy_after(void*, int dst_device, const void*, int, size_t, const Event&) {
  throw Error(str_cat("cuda:", dst_device, " requested, but this build has no CUDA"));
}

bool enable_peer_access(int, int) { return false; }

}  // namespace unetcu::cuda
