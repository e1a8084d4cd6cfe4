// CUDA-side runtime for the .cu files of the runtime, the CUDA launchers and the NCCL
// communicator: check macros (one per library), the per-device context (stream, cuDNN and
// cuBLAS handles), and the launch check with its debug switch. Streams and events are the
// plain C++ ones of runtime/cuda_api.h (get() gives the cudaStream_t / cudaEvent_t).
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <mutex>
#include <string>

#include "runtime/common.h"
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
#define CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                     \
    cublasStatus_t st_ = (expr);                                                           \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                      \
      ::unetcu::cuda::throw_error("cuBLAS", #expr, __FILE__, __LINE__,                     \
                                  cublasGetStatusString(st_));                             \
  } while (0)
// NCCL_CHECK is in runtime/cuda/nccl.cuh (only the communicator needs nccl.h).

namespace unetcu::cuda {

// After a kernel launch: reports a launch error; with UNETCU_CUDA_SYNC=1 in the environment
// also synchronises the stream, so an asynchronous fault is reported at the launch that
// caused it rather than at some later call.
void check_launch(cudaStream_t stream, const char* what, const char* file, int line);
#define CUDA_CHECK_LAUNCH(stream, what) ::unetcu::cuda::check_launch(stream, what, __FILE__, __LINE__)

// Sets the current device for the scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
};

// One per device: its default compute stream and the library handles. The handles are
// re-pointed at the stream in use on every call (cudnnSetStream / cublasSetStream) under the
// context's mutex, so threads sharing a device may use different streams.
struct DeviceContext {
  int device = 0;
  Stream stream;
  cudnnHandle_t cudnn = nullptr;
  cublasHandle_t cublas = nullptr;
  std::mutex handle_mutex;
};
DeviceContext& context(int device);

// The stream the calling thread issues work to on `device`: the one set by a StreamScope, or
// the device's default stream.
cudaStream_t current_stream(int device);

// A cuDNN handle bound to the calling thread's current stream on `device`, held under the
// context's mutex for the lock's lifetime.
class CudnnLock {
 public:
  explicit CudnnLock(int device);
  cudnnHandle_t handle() const { return handle_; }

 private:
  std::lock_guard<std::mutex> lock_;
  cudnnHandle_t handle_;
};

// The cuBLAS handle, likewise bound to the calling thread's current stream.
class CublasLock {
 public:
  explicit CublasLock(int device);
  cublasHandle_t handle() const { return handle_; }

 private:
  std::lock_guard<std::mutex> lock_;
  cublasHandle_t handle_;
};

// Temporary device memory (cuDNN workspaces, launcher scratch) from the caching allocator, on
// the calling thread's current stream.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes);
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
