// CUDA-side runtime for the .cu files of the runtime, the CUDA launchers and the NCCL
// communicator: check macros (one per library in use), the per-device context (default stream),
// a cuDNN handle per stream, and the launch check with its debug switch. Streams and events are
// the plain C++ ones of runtime/cuda_api.h (get() gives the cudaStream_t / cudaEvent_t).
#pragma once
#include <cuda_runtime.h>
#include <cudnn.h>

#include <mutex>
#include <string>

#include "runtime/common.h"
#include "runtime/cuda/device_choice.h"
#include "runtime/cuda_api.h"

namespace unetcu::cuda {

int current_device();
[[noreturn]] void throw_error(const char* library, const char* expr, const char* file, int line,
                              const std::string& message);

}  // namespace unetcu::cuda

// Each throws unetcu::Error with the failing expression, file:line, the current device and
// the library's own message.
#define CUDA_CHECK(expr)                                                                   \
  do {                                                                                     \
    cudaError_t err_ = (expr);                                                             \
    if (err_ != cudaSuccess)                                                               \
      ::unetcu::cuda::throw_error("CUDA", #expr, __FILE__, __LINE__,                       \
                                  std::string(cudaGetErrorName(err_)) + ": " +             \
                                      cudaGetErrorString(err_));                           \
  } while (0)
#define CUDNN_CHECK(expr)                                                                  \
  do {                                                                                     \
    cudnnStatus_t st_ = (expr);                                                            \
    if (st_ != CUDNN_STATUS_SUCCESS)                                                       \
      ::unetcu::cuda::throw_error("cuDNN", #expr, __FILE__, __LINE__, cudnnGetErrorString(st_)); \
  } while (0)
// NCCL_CHECK is in runtime/cuda/nccl.cuh (only the communicator needs nccl.h). cuBLAS has no
// check macro and no handle: nothing calls it (convolutions are cuDNN's, the rest are
// our kernels), and an unused handle costs device memory and start-up time.

namespace unetcu::cuda {

// After a kernel launch: reports a launch error; with UNETCU_CUDA_SYNC=1 in the environment
// also synchronises the stream, so an asynchronous fault is reported at the launch that
// caused it rather than at some later call.
void check_launch(cudaStream_t stream, const char* what, const char* file, int line);
#define CUDA_CHECK_LAUNCH(stream, what) ::unetcu::cuda::check_launch(stream, what, __FILE__, __LINE__)

// Sets the current device for the scope; afterwards the thread is back on the device it had,
// or, on a thread that had none, stays on this one (runtime/cuda/device_choice.h: putting back
// CUDA's default device 0 would open a context on GPU 0 in a run on another GPU). Throws where
// the device cannot be set.
struct CudaDeviceCalls;  // cudaGetDevice and cudaSetDevice, for DeviceChoice
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  DeviceChoice<CudaDeviceCalls> choice_;
};

// The same without throwing, for noexcept paths (destructors, deleters, the allocator's free,
// watchdog threads): a failure shows up in the CUDA call that follows, and the guard clears
// CUDA's error only where its own calls failed.
class QuietDeviceGuard {
 public:
  explicit QuietDeviceGuard(int device);
  ~QuietDeviceGuard();
  QuietDeviceGuard(const QuietDeviceGuard&) = delete;
  QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;

 private:
  DeviceChoice<CudaDeviceCalls> choice_;
  bool failed_ = false;
};

// One per device: its default compute stream.
struct DeviceContext {
  int device = 0;
  Stream stream;
  Stream upload;  // host-to-device copies of input batches (upload_stream)
};
DeviceContext& context(int device);

// The stream the calling thread issues work to on `device`: the one set by a StreamScope, or
// the device's default stream.
cudaStream_t current_stream(int device);

// The device's properties, read once (cudaGetDeviceProperties is slow).
const cudaDeviceProp& device_properties(int device);

// Whether a stream of `device` that this process made, other than `except`, has work queued or
// running, or is being captured. Work of other processes on the GPU is not seen. A convolution
// search measured while this is true timed its candidates beside other work.
bool other_streams_busy(int device, cudaStream_t except);

// The cuDNN handle of the calling thread's current stream on `device`, held (under its own
// mutex) for the lock's lifetime. Each (device, stream) has its own handle, created on first
// use and bound to the stream once: two pipeline stages on one GPU, each on its own stream, do
// not wait for each other's cuDNN calls. When a Stream is destroyed its handle is kept for the
// next new stream of the device instead of cudnnDestroy, which synchronises the whole device.
class CudnnLock {
 public:
  explicit CudnnLock(int device);
  cudnnHandle_t handle() const { return handle_; }

 private:
  std::unique_lock<std::mutex> lock_;
  cudnnHandle_t handle_;
};

// Temporary device memory (cuDNN workspaces, launcher scratch) from the caching allocator, on
// the calling thread's current stream. `optional` (the algorithm search's large workspace):
// when memory is short get() is nullptr instead of an error, no cached block is given back for
// it (that synchronises the device), and it is left out of the allocator's current and peak
// bytes (it is used once per shape, by the search only).
class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes, bool optional = false);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  int device_;
  void* ptr_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace unetcu::cuda
