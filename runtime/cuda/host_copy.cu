// Asynchronous device-to-host copies into pinned memory (see cuda_api.h).
#include "runtime/cuda/runtime.cuh"
#include "runtime/cuda_api.h"

namespace unetcu::cuda {

Event copy_to_host_async(void* pinned_dst, const void* src, int device, size_t bytes) {
  DeviceGuard g(device);
  cudaStream_t s = current_stream(device);
  CUDA_CHECK(cudaMemcpyAsync(pinned_dst, src, bytes, cudaMemcpyDeviceToHost, s));
  Event done(device);
  done.record(s);
  return done;
}

void host_wait(const Event& e) {
  if (e.valid()) CUDA_CHECK(cudaEventSynchronize(e.get()));
}

}  // namespace unetcu::cuda
