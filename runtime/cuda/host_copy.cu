// Asynchronous copies ordered by events, and peer access between GPUs (see cuda_api.h).
#include "runtime/cuda/runtime.cuh"
#include "runtime/cuda_api.h"

#include <utility>

namespace unetcu::cuda {

Event copy_to_host_async(void* pinned_dst, const void* src, int device, size_t bytes) {
  DeviceGuard g(device);
  cudaStream_t s = current_stream(device);
  CUDA_CHECK(cudaMemcpyAsync(pinned_dst, src, bytes, cudaMemcpyDeviceToHost, s));
  // The pinned block is used by this stream: freed before the copy is done (a pending step loss
  // dropped on an error path), it is not handed out again until then.
  record_stream(pinned_dst, Device::cpu(), device, s);
  Event done(device);
  done.record(s);
  return done;
}

void host_wait(const Event& e) {
  if (e.valid()) CUDA_CHECK(cudaEventSynchronize(e.get()));
}

void copy_after(void* dst, int dst_device, const void* src, int src_device, size_t bytes,
                const Event& src_ready) {
  if (bytes == 0) return;
  DeviceGuard g(dst_device);
  cudaStream_t ds = current_stream(dst_device);
  src_ready.wait_on(ds);
  if (src_device == dst_device)
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ds));
  else
    CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, ds));
  record_stream(src, Device::cuda(src_device), dst_device, ds);
  record_stream(dst, Device::cuda(dst_device), dst_device, ds);
}

bool enable_peer_access(int a, int b) {
  if (a == b) return true;
  int ab = 0, ba = 0;
  CUDA_CHECK(cudaDeviceCanAccessPeer(&ab, a, b));
  CUDA_CHECK(cudaDeviceCanAccessPeer(&ba, b, a));
  if (!ab || !ba) return false;
  for (auto [from, to] : {std::pair{a, b}, std::pair{b, a}}) {
    DeviceGuard g(from);
    const cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // not an error here; clear it so later checks do not see it
    } else {
      CUDA_CHECK(e);
    }
  }
  return true;
}

}  // namespace unetcu::cuda
