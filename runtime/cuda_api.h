// The CUDA runtime as the rest of the engine sees it: plain C++, no CUDA headers, so engine
// code compiles the same with and without the CUDA parts. Implemented in runtime/cuda/runtime.cu
// (CUDA builds) or runtime/cuda/stubs.cpp (builds without CUDA, where every call but the
// queries throws: no CUDA tensor can exist there).
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/allocator.h"
#include "runtime/device.h"

// The CUDA runtime's opaque handle types, declared as <cuda_runtime.h> declares them.
struct CUstream_st;
struct CUevent_st;

namespace unetcu::cuda {

bool built();  // this build has the CUDA backend

// Device memory from the caching allocator of `device` (runtime/block_pool.h has the rule).
// A block is allocated for the calling thread's current stream on `device`; when freed, an
// event is recorded on every stream that used it (that one, and those given to record_stream),
// and it is handed out again only once those events have completed; an event on the stream
// asking for it needs no wait (stream order). Out of memory, cached blocks are given back to
// CUDA (cudaFree synchronises the device) and the allocation is tried again.
void* device_alloc(int device, size_t bytes, size_t* capacity);
void device_free(int device, void* ptr, size_t capacity);
AllocatorStats device_memory_stats(int device);
void reset_device_peak(int device);
// What a new allocation could take on `device`: the driver's free memory and this process's
// cached blocks.
size_t device_free_memory(int device);
// Gives every cached block back to CUDA after waiting for its streams (cudaFree synchronises
// the device: not while NCCL kernels of this process may wait for another rank).
void release_device_cache(int device);
// Tests: fill every new device block with 0xFF bytes (NaN in float) so an element a kernel
// fails to write shows up.
void set_poison_allocations(bool on);

// Page-locked host memory, for batches copied to the device asynchronously. Cached like device
// memory: a block an asynchronous copy reads (copy() records it) is handed out again only once
// the copy has completed.
void* pinned_alloc(size_t bytes);
void pinned_free(void* ptr);

// The block holding `ptr` (device memory of `memory`, or pinned host memory when `memory` is
// a CPU device) is used by work queued on `stream` (a stream of cuda:`stream_device`): when the
// block is freed it is not reused until that work is done. copy() records its own uses; a
// caller that runs a kernel or a collective on a tensor from another stream records it here.
// Pointers the allocators do not hold are ignored.
void record_stream(const void* ptr, Device memory, int stream_device, CUstream_st* stream);

// Copies between any two of host / cuda:N, on the current stream of the CUDA device involved
// (the destination's for device-to-device). Returns when the bytes may be used by the host
// side: a copy into pageable host memory is waited for; a copy out of pinned memory is not.
void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
          bool src_pinned = false);
void memset_zero(void* ptr, int device, size_t bytes);
void synchronize(int device);
// Clears the calling thread's last CUDA error: after a failed capture, on each thread that
// queued work into it, so that the next checked launch there is not blamed for it.
void clear_last_error();

std::string device_name(int device);

// Streams and events, the one vocabulary for plain C++ (pipeline stages) and the .cu files
// alike. The handles are the CUDA runtime's own opaque types (cudaStream_t is CUstream_st*,
// cudaEvent_t is CUevent_st*), so get() gives a .cu file what it passes to CUDA, with no cast
// and no CUDA header here.
//
// Stream: a stream of its own on `device`, non-blocking with respect to the legacy default
// stream. Move-only. Destroying it first waits for the work queued on it (a new stream may get
// the handle of a destroyed one, and the allocator's stream-order reuse compares handles).
class Stream {
 public:
  Stream() = default;  // none
  explicit Stream(int device);
  ~Stream();
  Stream(Stream&& o) noexcept : stream_(o.stream_), device_(o.device_) { o.stream_ = nullptr; }
  Stream& operator=(Stream&& o) noexcept {
    std::swap(stream_, o.stream_);
    std::swap(device_, o.device_);
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  int device() const { return device_; }
  CUstream_st* get() const { return stream_; }

 private:
  CUstream_st* stream_ = nullptr;
  int device_ = -1;
};

// While a StreamScope is alive, the calling thread's work on the stream's device goes to that
// stream (it is what current_stream() returns); the previous one is restored after.
class StreamScope {
 public:
  explicit StreamScope(const Stream& stream);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  int device_;
  CUstream_st* previous_;
};

// Event: a point in a stream's work. Copies share one CUDA event (it is destroyed with the
// last copy), so tables of events, one per (stage, micro-batch), can be made and copied whole.
class Event {
 public:
  Event() = default;  // none: valid() is false and wait() does nothing
  explicit Event(int device);
  // A new event marking the work queued so far on the calling thread's current stream of
  // `device`.
  static Event record(int device);
  // Makes the calling thread's current stream on `device` wait for the event (no host wait).
  void wait(int device) const;
  // The same on explicit streams: marks the work queued on `stream` so far, and makes
  // `stream` wait until the event has completed.
  void record(CUstream_st* stream);
  void wait_on(CUstream_st* stream) const;
  bool valid() const { return event_ != nullptr; }
  CUevent_st* get() const { return event_.get(); }

 private:
  std::shared_ptr<CUevent_st> event_;
};

// Starts copying `bytes` from cuda:`device` memory into pinned host memory on the calling
// thread's current stream of that device and returns the event of its completion: no host
// wait (a training step's loss is read this way one step later). host_wait blocks the calling
// thread until the event has completed.
Event copy_to_host_async(void* pinned_dst, const void* src, int device, size_t bytes);

// A device-to-device copy ordered after `src_ready`, an event the producer recorded on its own
// stream (copy() can only record one on the calling thread's stream of the source device, which
// is not the producer's when another thread made the data). Runs on the calling thread's stream
// of the destination; peer-to-peer when enable_peer_access() allowed it, else staged by the
// driver. Both blocks are recorded as used there (record_stream), so neither is reused early.
void copy_after(void* dst, int dst_device, const void* src, int src_device, size_t bytes,
                const Event& src_ready);
// Lets each of two GPUs read the other's memory directly (cudaDeviceEnablePeerAccess both ways)
// where the hardware allows; returns whether it does. Idempotent.
bool enable_peer_access(int a, int b);
void host_wait(const Event& e);

// Host-to-device copies of input batches run on a stream of their own per device, the upload
// stream, so that the next batch's copy runs while the current step's kernels do (the copy
// engine beside the SMs) instead of between two steps on the compute stream. Allocate the
// destination and copy under a StreamScope of it (the allocator then lets the copy write a
// block only after its earlier users are done), record an Event there, and hand the bytes to
// their consumer with use_after: the calling thread's current stream on `device` waits for
// `ready` (no host wait) and is recorded as a user of the block holding `ptr`, so the block is
// not reused before the consumer's work is done. Queue the upload after the work it should
// overlap with: what the current stream queues after use_after waits for the copy.
const Stream& upload_stream(int device);
void use_after(const Event& ready, const void* ptr, int device);

// A CUDA graph: the work `work` queues on the calling thread's current stream of `device`,
// captured once (stream capture, relaxed mode) and replayed by launch() on that stream with one
// call. Nothing runs while capturing. Every allocation the work makes on that stream comes from
// a private pool of the device's allocator (runtime/block_pool.h): the graph's tensors keep
// their addresses for every replay, so what the work leaves alive (its outputs) is rewritten
// by each launch, and what it freed stays reserved for it. What the work reads from outside
// (inputs, parameters) must outlive the graph and keep its address; what it needs from the
// host it must not read at run time (a host wait, or a value baked into a kernel argument,
// is captured once). Destroying the graph waits for its stream, then gives the pool back.
//
// The overload over several streams captures what any thread queues on them while `work` runs
// (a pipeline's stage threads, each on its stage's stream, on one GPU or several) into one
// graph. The first stream is the origin: the capture begins there, the others join it at once
// through an event and are joined back through events at the end, so the graph's work on
// every stream follows what was queued on the origin before a launch, and what is queued on
// the origin after it waits for all of it. The work itself orders the streams with events
// (cuda::Event's record/wait, which inside the capture become the graph's edges). Each device
// the streams are on gives the capture a private pool; a block one stream freed is reused
// inside the capture only by that stream (block_pool.h). launch() replays on the origin, under
// a StreamScope of it; the other streams must wait for an event recorded on the origin after
// the launch before they read what the graph wrote.
class Graph {
 public:
  Graph();  // none: valid() is false
  static Graph capture(int device, const std::function<void()>& work);
  static Graph capture(const std::vector<const Stream*>& streams, const std::function<void()>& work);
  void launch() const;
  bool valid() const { return impl_ != nullptr; }
  ~Graph();
  Graph(Graph&&) noexcept;
  Graph& operator=(Graph&&) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  struct Impl;  // the backend's (runtime/cuda/runtime.cu)

 private:
  std::unique_ptr<Impl> impl_;
};

// cuDNN convolutions may use TF32 tensor cores (PyTorch's default). Tests comparing with the
// float64 reference at 1e-5 turn it off.
void set_allow_tf32(bool on);
bool allow_tf32();

// Deterministic convolutions: only cuDNN algorithms that report CUDNN_DETERMINISTIC (no
// atomics) and are neither FFT nor Winograd (their rounding differs most from a direct sum),
// so two runs, or two streams, give the same bits. Off by default (the fastest algorithm
// wins); the CUDA tests and unet_train --deterministic turn it on.
void set_deterministic(bool on);
bool deterministic();

}  // namespace unetcu::cuda
