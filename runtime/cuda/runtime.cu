// The CUDA runtime of the engine: device count, contexts and streams, the caching device
// allocator, pinned host memory, copies, and the error reporting behind the check macros.
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "runtime/cuda/runtime.cuh"
#include "runtime/cuda_api.h"

namespace unetcu {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the error so later calls start clean
    return 0;
  }
  return n;
}

namespace cuda {

bool built() { return true; }

int current_device() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) return -1;
  return d;
}

void throw_error(const char* library, const char* expr, const char* file, int line,
                 const std::string& message) {
  throw Error(str_cat(library, " error on cuda:", current_device(), " at ", file, ":", line, ": ",
                      expr, " -> ", message));
}

static bool sync_after_launch() {
  static const bool on = [] {
    const char* v = std::getenv("UNETCU_CUDA_SYNC");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  return on;
}

void check_launch(cudaStream_t stream, const char* what, const char* file, int line) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && sync_after_launch()) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess)
    throw_error("CUDA", what, file, line,
                std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err));
}

DeviceGuard::DeviceGuard(int device) {
  CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) CUDA_CHECK(cudaSetDevice(device));
}
DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
}

// ---- contexts and streams ------------------------------------------------------------

namespace {
constexpr int kMaxDevices = 64;

struct Contexts {
  std::mutex mu;
  std::unique_ptr<DeviceContext> ctx[kMaxDevices];
};
Contexts& contexts() {
  static Contexts* c = new Contexts();  // never destroyed: handles outlive static teardown
  return *c;
}

thread_local cudaStream_t t_stream_override[kMaxDevices] = {};

void check_device_index(int device) {
  const int n = cuda_device_count();
  UNETCU_CHECK(device >= 0 && device < n && device < kMaxDevices, "cuda:", device,
               " does not exist (", n, " GPU(s) visible)");
}
}  // namespace

DeviceContext& context(int device) {
  Contexts& c = contexts();
  std::lock_guard<std::mutex> lock(c.mu);
  if (device >= 0 && device < kMaxDevices && c.ctx[device]) return *c.ctx[device];
  check_device_index(device);
  auto ctx = std::make_unique<DeviceContext>();
  DeviceGuard g(device);
  ctx->device = device;
  ctx->stream = Stream(device);
  CUDNN_CHECK(cudnnCreate(&ctx->cudnn));
  CUBLAS_CHECK(cublasCreate(&ctx->cublas));
  c.ctx[device] = std::move(ctx);
  return *c.ctx[device];
}

cudaStream_t current_stream(int device) {
  if (device >= 0 && device < kMaxDevices && t_stream_override[device])
    return t_stream_override[device];
  return context(device).stream.get();
}

CudnnLock::CudnnLock(int device)
    : lock_(context(device).handle_mutex), handle_(context(device).cudnn) {
  CUDNN_CHECK(cudnnSetStream(handle_, current_stream(device)));
}

CublasLock::CublasLock(int device)
    : lock_(context(device).handle_mutex), handle_(context(device).cublas) {
  CUBLAS_CHECK(cublasSetStream(handle_, current_stream(device)));
}

// ---- caching device allocator --------------------------------------------------------

namespace {

struct Block {
  void* ptr;
  cudaStream_t stream;
};

struct DeviceHeap {
  std::mutex mu;
  std::multimap<size_t, Block> free_blocks;                  // capacity -> block
  std::unordered_map<void*, cudaStream_t> live;              // pointer -> stream it serves
  AllocatorStats stats;
};

DeviceHeap& heap(int device) {
  static DeviceHeap* heaps = new DeviceHeap[kMaxDevices];
  return heaps[device];
}

bool g_poison = false;

size_t round_device_size(size_t bytes) {
  if (bytes <= (size_t(1) << 20)) return (bytes + 511) / 512 * 512;
  size_t p = size_t(1) << 20;
  while (p * 2 <= bytes) p *= 2;
  const size_t step = p / 16;
  return (bytes + step - 1) / step * step;
}

void release_cache_locked(DeviceHeap& h, int device) {
  DeviceGuard g(device);
  for (auto& [size, b] : h.free_blocks) cudaFree(b.ptr);
  h.free_blocks.clear();
  h.stats.cached_bytes = 0;
}

}  // namespace

void* device_alloc(int device, size_t bytes, size_t* capacity) {
  check_device_index(device);
  const size_t want = round_device_size(bytes ? bytes : 1);
  // A freed block is reused only by work on the stream it served: work queued on that
  // stream before the free finishes before anything queued after the reuse.
  const cudaStream_t stream = current_stream(device);
  DeviceHeap& h = heap(device);
  std::lock_guard<std::mutex> lock(h.mu);
  void* p = nullptr;
  for (auto it = h.free_blocks.lower_bound(want);
       it != h.free_blocks.end() && it->first <= want + want / 8; ++it) {
    if (it->second.stream != stream) continue;
    p = it->second.ptr;
    *capacity = it->first;
    h.stats.cached_bytes -= it->first;
    h.free_blocks.erase(it);
    break;
  }
  if (!p) {
    DeviceGuard g(device);
    cudaError_t err = cudaMalloc(&p, want);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      release_cache_locked(h, device);
      err = cudaMalloc(&p, want);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw Error(str_cat("out of device memory on cuda:", device, ": allocating ", want,
                          " bytes with ", h.stats.current_bytes, " bytes in tensors (",
                          cudaGetErrorString(err), ")"));
    }
    *capacity = want;
  }
  h.live[p] = stream;
  h.stats.current_bytes += *capacity;
  if (h.stats.current_bytes > h.stats.peak_bytes) h.stats.peak_bytes = h.stats.current_bytes;
  if (g_poison) {
    DeviceGuard g(device);
    CUDA_CHECK(cudaMemsetAsync(p, 0xFF, *capacity, stream));
  }
  return p;
}

void device_free(int device, void* ptr, size_t capacity) {
  if (!ptr) return;
  DeviceHeap& h = heap(device);
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.live.find(ptr);
  const cudaStream_t stream = it != h.live.end() ? it->second : nullptr;
  if (it != h.live.end()) h.live.erase(it);
  h.free_blocks.emplace(capacity, Block{ptr, stream});
  h.stats.current_bytes -= capacity;
  h.stats.cached_bytes += capacity;
}

AllocatorStats device_memory_stats(int device) {
  check_device_index(device);
  DeviceHeap& h = heap(device);
  std::lock_guard<std::mutex> lock(h.mu);
  return h.stats;
}

void reset_device_peak(int device) {
  check_device_index(device);
  DeviceHeap& h = heap(device);
  std::lock_guard<std::mutex> lock(h.mu);
  h.stats.peak_bytes = h.stats.current_bytes;
}

void release_device_cache(int device) {
  check_device_index(device);
  DeviceHeap& h = heap(device);
  std::lock_guard<std::mutex> lock(h.mu);
  CUDA_CHECK(cudaDeviceSynchronize());
  release_cache_locked(h, device);
}

void set_poison_allocations(bool on) { g_poison = on; }

DeviceBuffer::DeviceBuffer(int device, size_t bytes) : device_(device) {
  if (bytes) ptr_ = device_alloc(device, bytes, &capacity_);
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_) device_free(device_, ptr_, capacity_);
}

// ---- host side -----------------------------------------------------------------------

// Pinned blocks are cached by size: cudaFreeHost synchronises the device, and a training
// loop asks for the same batch sizes every step.
namespace {
struct PinnedPool {
  std::mutex mu;
  std::multimap<size_t, void*> free_blocks;
  std::unordered_map<void*, size_t> sizes;
};
PinnedPool& pinned_pool() {
  static PinnedPool* p = new PinnedPool();
  return *p;
}
}  // namespace

void* pinned_alloc(size_t bytes) {
  const size_t want = round_device_size(bytes ? bytes : 1);
  PinnedPool& pool = pinned_pool();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    auto it = pool.free_blocks.find(want);
    if (it != pool.free_blocks.end()) {
      void* p = it->second;
      pool.free_blocks.erase(it);
      return p;
    }
  }
  void* p = nullptr;
  cudaError_t err = cudaMallocHost(&p, want);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Error(str_cat("cannot allocate ", bytes, " bytes of pinned host memory: ",
                        cudaGetErrorString(err)));
  }
  std::lock_guard<std::mutex> lock(pool.mu);
  pool.sizes[p] = want;
  return p;
}

void pinned_free(void* ptr) {
  if (!ptr) return;
  PinnedPool& pool = pinned_pool();
  std::lock_guard<std::mutex> lock(pool.mu);
  pool.free_blocks.emplace(pool.sizes.at(ptr), ptr);
}

void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
          bool src_pinned) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  if (dst_device.is_cuda() && src_device.is_cpu()) {
    DeviceGuard g(dst_device.index);
    cudaStream_t s = current_stream(dst_device.index);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
    // A pageable source may be reused by the host allocator as soon as we return: wait. A
    // pinned source stays untouched until the caller has synchronised (the trainer keeps its
    // batch alive until the step's loss has been read).
    if (!src_pinned) CUDA_CHECK(cudaStreamSynchronize(s));
    return;
  }
  if (dst_device.is_cpu() && src_device.is_cuda()) {
    DeviceGuard g(src_device.index);
    cudaStream_t s = current_stream(src_device.index);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    return;
  }
  // Device to device: the copy runs on the destination's stream after the source's stream
  // has finished what it had queued (an event, not a host wait).
  const int sd = src_device.index, dd = dst_device.index;
  cudaStream_t ds = current_stream(dd);
  if (sd == dd) {
    DeviceGuard g(dd);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ds));
    return;
  }
  Event ready(sd);
  ready.record(current_stream(sd));
  DeviceGuard g(dd);
  ready.wait_on(ds);
  CUDA_CHECK(cudaMemcpyPeerAsync(dst, dd, src, sd, bytes, ds));
  // ...and the source's stream waits for the copy, so the source block cannot be handed out
  // again (to work on that stream) while the copy still reads it.
  Event copied(dd);
  copied.record(ds);
  copied.wait_on(current_stream(sd));
}

void memset_zero(void* ptr, int device, size_t bytes) {
  DeviceGuard g(device);
  CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, current_stream(device)));
}

void synchronize(int device) {
  DeviceGuard g(device);
  CUDA_CHECK(cudaStreamSynchronize(current_stream(device)));
}

std::string device_name(int device) {
  check_device_index(device);
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

// ---- streams and events (runtime/cuda_api.h) -------------------------------------------

// Destructors must not throw: they switch devices with unchecked calls.
Stream::Stream(int device) : device_(device) {
  check_device_index(device);
  DeviceGuard g(device);
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}
Stream::~Stream() {
  if (!stream_) return;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
  cudaSetDevice(prev);
}

StreamScope::StreamScope(const Stream& stream) : device_(stream.device()) {
  check_device_index(device_);
  previous_ = t_stream_override[device_];
  t_stream_override[device_] = stream.get();
}
StreamScope::~StreamScope() { t_stream_override[device_] = previous_; }

Event::Event(int device) {
  DeviceGuard g(device);
  cudaEvent_t e;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  event_ = std::shared_ptr<CUevent_st>(e, [device](cudaEvent_t p) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    cudaEventDestroy(p);
    cudaSetDevice(prev);
  });
}

Event Event::record(int device) {
  Event e(device);
  DeviceGuard g(device);
  e.record(current_stream(device));
  return e;
}

void Event::wait(int device) const {
  if (!event_) return;
  DeviceGuard g(device);
  wait_on(current_stream(device));
}

void Event::record(cudaStream_t stream) { CUDA_CHECK(cudaEventRecord(event_.get(), stream)); }
void Event::wait_on(cudaStream_t stream) const {
  CUDA_CHECK(cudaStreamWaitEvent(stream, event_.get(), 0));
}

static bool g_allow_tf32 = true;
void set_allow_tf32(bool on) { g_allow_tf32 = on; }
bool allow_tf32() { return g_allow_tf32; }

}  // namespace cuda
}  // namespace unetcu
