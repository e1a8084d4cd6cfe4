// The CUDA runtime as the rest of the engine sees it: plain C++, no CUDA headers, so engine
// code compiles the same with and without the CUDA parts. Implemented in runtime/cuda/runtime.cu
// (CUDA builds) or runtime/cuda/stubs.cpp (builds without CUDA, where every call but the
// queries throws: no CUDA tensor can exist there).
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "runtime/allocator.h"
#include "runtime/device.h"

namespace unetcu::cuda {

bool built();  // this build has the CUDA backend

// Device memory from the caching allocator of `device`. A freed block is reused only by work on
// the stream it was allocated on (stream order makes that safe). A tensor used on another
// stream must be kept alive by its user until that stream has passed the use (as the peer
// copy does with an event); there is no record_stream yet.
void* device_alloc(int device, size_t bytes, size_t* capacity);
void device_free(int device, void* ptr, size_t capacity);
AllocatorStats device_memory_stats(int device);
void reset_device_peak(int device);
void release_device_cache(int device);
// Tests: fill every new device block with 0xFF bytes (NaN in float) so an element a kernel
// fails to write shows up.
void set_poison_allocations(bool on);

// Page-locked host memory, for batches copied to the device asynchronously.
void* pinned_alloc(size_t bytes);
void pinned_free(void* ptr);

// Copies between any two of host / cuda:N, on the current stream of the CUDA device involved
// (the destination's for device-to-device). Returns when the bytes may be used by the host
// side: a copy into pageable host memory is waited for; a copy out of pinned memory is not.
void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
          bool src_pinned = false);
void memset_zero(void* ptr, int device, size_t bytes);
void synchronize(int device);

std::string device_name(int device);

// Streams and events for code outside the CUDA files (pipeline stages). A StageStream is a
// stream of its own on `device`; while a ThreadStream scope is alive the calling thread's
// work on that device goes to it. An EventHandle marks the work queued so far on the calling
// thread's current stream; wait() makes the calling thread's current stream on `device` wait
// for it (no host wait).
class StageStream {
 public:
  explicit StageStream(int device);
  ~StageStream();
  StageStream(const StageStream&) = delete;
  StageStream& operator=(const StageStream&) = delete;
  int device() const { return device_; }
  void* handle() const { return stream_; }

 private:
  int device_;
  void* stream_ = nullptr;
};

class ThreadStream {
 public:
  explicit ThreadStream(const StageStream& s);
  ~ThreadStream();
  ThreadStream(const ThreadStream&) = delete;
  ThreadStream& operator=(const ThreadStream&) = delete;

 private:
  int device_;
  void* previous_;
};

class EventHandle {
 public:
  static EventHandle record(int device);
  void wait(int device) const;
  bool valid() const { return event_ != nullptr; }

 private:
  std::shared_ptr<void> event_;
};

// cuDNN convolutions may use TF32 tensor cores (PyTorch's default). Tests comparing with the
// float64 reference at 1e-5 turn it off.
void set_allow_tf32(bool on);
bool allow_tf32();

}  // namespace unetcu::cuda
