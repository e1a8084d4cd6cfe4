// The CUDA runtime of the engine: device count, contexts and streams, cuDNN handles, the
// caching device allocator, pinned host memory, copies, and the error reporting behind the
// check macros.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <utility>
#include <vector>
#if defined(UNETCU_CUDA_EMU) && defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include "runtime/allocator.h"
#include "runtime/block_pool.h"
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
  if (err == cudaSuccess && sync_after_launch()) {
    // Not while the stream is being captured into a graph: a wait would end the capture.
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    err = cudaStreamIsCapturing(stream, &capturing);
    if (err == cudaSuccess && capturing == cudaStreamCaptureStatusNone) err = cudaStreamSynchronize(stream);
  }
  if (err != cudaSuccess)
    throw_error("CUDA", what, file, line,
                std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err));
}

struct CudaDeviceCalls {
  static bool get(int* device) { return cudaGetDevice(device) == cudaSuccess; }
  static bool set(int device) { return cudaSetDevice(device) == cudaSuccess; }
};

DeviceGuard::DeviceGuard(int device) {
  if (!choice_.enter(device)) {
    const cudaError_t err = cudaGetLastError();
    throw_error("CUDA", "cudaSetDevice", __FILE__, __LINE__,
                str_cat("cannot use cuda:", device, ": ", cudaGetErrorName(err), ": ",
                        cudaGetErrorString(err)));
  }
}
DeviceGuard::~DeviceGuard() {
  if (!choice_.leave()) cudaGetLastError();  // a destructor's failure is not the next launch's
}

QuietDeviceGuard::QuietDeviceGuard(int device) { failed_ = !choice_.enter(device); }
QuietDeviceGuard::~QuietDeviceGuard() {
  if (!choice_.leave()) failed_ = true;
  // A failure of the guard's own calls is not left for the next launch's check
  // (cudaGetLastError) to report as its own. Only then: clearing always would also erase a
  // launch error made before the guard and not yet checked.
  if (failed_) cudaGetLastError();
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
// The first device this process made a context for (its training device), -1 before: pinned
// host memory is allocated there, so a loader thread that never chose a device does not open
// a context on GPU 0 (CUDA's default) by allocating.
std::atomic<int> g_first_device{-1};

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
  ctx->upload = Stream(device);
  c.ctx[device] = std::move(ctx);
  int none = -1;
  g_first_device.compare_exchange_strong(none, device);
  return *c.ctx[device];
}

cudaStream_t current_stream(int device) {
  if (device >= 0 && device < kMaxDevices && t_stream_override[device])
    return t_stream_override[device];
  return context(device).stream.get();
}

const Stream& upload_stream(int device) { return context(device).upload; }

void use_after(const Event& ready, const void* ptr, int device) {
  DeviceGuard g(device);
  const cudaStream_t s = current_stream(device);
  ready.wait_on(s);
  record_stream(ptr, Device::cuda(device), device, s);
}

const cudaDeviceProp& device_properties(int device) {
  check_device_index(device);
  static std::mutex mu;
  static std::unique_ptr<cudaDeviceProp> props[kMaxDevices];
  std::lock_guard<std::mutex> lock(mu);
  if (!props[device]) {
    auto p = std::make_unique<cudaDeviceProp>();
    CUDA_CHECK(cudaGetDeviceProperties(p.get(), device));
    props[device] = std::move(p);
  }
  return *props[device];
}

// ---- cuDNN handles, one per (device, stream) --------------------------------------------

namespace {

struct CudnnSlot {
  cudnnHandle_t handle = nullptr;
  std::mutex mu;  // one call sequence at a time (threads may share a stream)
};

struct CudnnHandles {
  std::mutex mu;
  std::map<std::pair<int, cudaStream_t>, CudnnSlot*> by_stream;
  // Handles of destroyed streams, kept for the next stream of the device: cudnnDestroy
  // synchronises the device, which with NCCL kernels in flight can hang.
  std::vector<CudnnSlot*> spare[kMaxDevices];
};
CudnnHandles& cudnn_handles() {
  static CudnnHandles* h = new CudnnHandles();  // never destroyed, like the contexts
  return *h;
}

CudnnSlot& cudnn_slot(int device, cudaStream_t stream) {
  CudnnHandles& t = cudnn_handles();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.by_stream.find({device, stream});
  if (it != t.by_stream.end()) return *it->second;
  CudnnSlot* slot = nullptr;
  if (!t.spare[device].empty()) {
    slot = t.spare[device].back();
    t.spare[device].pop_back();
  } else {
    auto fresh = std::make_unique<CudnnSlot>();
    DeviceGuard g(device);
    CUDNN_CHECK(cudnnCreate(&fresh->handle));
    slot = fresh.release();
  }
  // Bound once: every call through this handle goes to this stream.
  const cudnnStatus_t st = cudnnSetStream(slot->handle, stream);
  if (st != CUDNN_STATUS_SUCCESS) {
    t.spare[device].push_back(slot);
    CUDNN_CHECK(st);
  }
  t.by_stream[{device, stream}] = slot;
  return *slot;
}

// A stream is going away: its handle becomes a spare of the device.
void release_cudnn_handle(int device, cudaStream_t stream) noexcept {
  if (device < 0 || device >= kMaxDevices) return;
  CudnnHandles& t = cudnn_handles();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.by_stream.find({device, stream});
  if (it == t.by_stream.end()) return;
  CudnnSlot* slot = it->second;
  { std::lock_guard<std::mutex> wait_for_user(slot->mu); }
  t.by_stream.erase(it);
  t.spare[device].push_back(slot);
}

}  // namespace

CudnnLock::CudnnLock(int device) {
  CudnnSlot& slot = cudnn_slot(device, current_stream(device));
  lock_ = std::unique_lock<std::mutex>(slot.mu);
  handle_ = slot.handle;
}

// ---- caching allocators: device memory and pinned host memory ------------------------
//
// Both are a BlockPool (runtime/block_pool.h: the bookkeeping and the reuse rule, tested on
// the CPU) over a backend of CUDA calls. Events come from a per-device free list, so a free
// costs one cudaEventRecord, not an event creation.

namespace {

struct EventSlot {
  int device;
  cudaEvent_t event;
};

struct EventFreeLists {
  std::mutex mu;
  std::vector<EventSlot*> free[kMaxDevices];
};
EventFreeLists& event_free_lists() {
  static EventFreeLists* e = new EventFreeLists();
  return *e;
}

EventSlot* take_event(int device) noexcept {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  EventFreeLists& l = event_free_lists();
  {
    std::lock_guard<std::mutex> lock(l.mu);
    if (!l.free[device].empty()) {
      EventSlot* e = l.free[device].back();
      l.free[device].pop_back();
      return e;
    }
  }
  QuietDeviceGuard g(device);
  cudaEvent_t e = nullptr;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return new (std::nothrow) EventSlot{device, e};
}

void return_event(EventSlot* e) noexcept {
  EventFreeLists& l = event_free_lists();
  std::lock_guard<std::mutex> lock(l.mu);
  l.free[e->device].push_back(e);
}

thread_local std::string t_alloc_error;  // CUDA's message for the last failed allocation

class CudaEvents : public BlockBackend {
 public:
  void* record(StreamRef stream) noexcept override {
    EventSlot* e = take_event(stream.device);
    if (!e) return nullptr;
    QuietDeviceGuard g(stream.device);
    if (cudaEventRecord(e->event, static_cast<cudaStream_t>(const_cast<void*>(stream.handle))) !=
        cudaSuccess) {
      cudaGetLastError();
      return_event(e);
      return nullptr;
    }
    return e;
  }
  bool completed(void* event) override {
    auto* e = static_cast<EventSlot*>(event);
    DeviceGuard g(e->device);
    const cudaError_t err = cudaEventQuery(e->event);
    if (err == cudaErrorNotReady) {
      cudaGetLastError();  // not an error: clear it so later checks start clean
      return false;
    }
    CUDA_CHECK(err);
    return true;
  }
  void wait(void* event) override {
    auto* e = static_cast<EventSlot*>(event);
    DeviceGuard g(e->device);
    CUDA_CHECK(cudaEventSynchronize(e->event));
  }
  void release(void* event) noexcept override { return_event(static_cast<EventSlot*>(event)); }
};

class DeviceMemory : public CudaEvents {
 public:
  explicit DeviceMemory(int device) : device_(device) {}
  void* allocate(size_t bytes) override {
    // --max-memory: a GPU of that size (blocks in tensors and in the cache alike).
    const size_t limit = memory_limit();
    if (limit && reserved_ + bytes > limit) {
      t_alloc_error = str_cat("the device's blocks would take ", reserved_ + bytes,
                              " bytes, over the limit of ", limit, " bytes",
                              memory_limit_note());
      return nullptr;
    }
    DeviceGuard g(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      t_alloc_error = cudaGetErrorString(err);
      return nullptr;
    }
    CUDA_CHECK(err);  // anything else is a fault to report, not a full device
    reserved_ += bytes;
    return p;
  }
  // cudaFree synchronises the whole device: the pool calls it only when memory is short
  // (BlockPool::allocate) or when asked to empty its cache.
  void deallocate(void* ptr, size_t bytes) noexcept override {
    QuietDeviceGuard g(device_);
    if (cudaFree(ptr) != cudaSuccess) cudaGetLastError();
    reserved_ -= bytes;
  }

 private:
  int device_;
  std::atomic<size_t> reserved_{0};  // taken from cudaMalloc and not given back
};

class PinnedMemory : public CudaEvents {
 public:
  void* allocate(size_t bytes) override {
    std::optional<QuietDeviceGuard> g;
    if (const int device = home(); device >= 0) g.emplace(device);
    void* p = nullptr;
    const cudaError_t err = cudaMallocHost(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      t_alloc_error = cudaGetErrorString(err);
      return nullptr;
    }
    return p;
  }
  void deallocate(void* ptr, size_t) noexcept override {
    std::optional<QuietDeviceGuard> g;
    if (const int device = home(); device >= 0) g.emplace(device);
    if (cudaFreeHost(ptr) != cudaSuccess) cudaGetLastError();
  }

 private:
  // The process's training device; before any context, the thread's own device (-1: none,
  // and then CUDA's current device serves).
  static int home() {
    const int first = g_first_device.load();
    return first >= 0 ? first : thread_device();
  }
};

struct DeviceHeap {
  DeviceMemory memory;
  BlockPool pool;
  explicit DeviceHeap(int device) : memory(device), pool(memory) {}
};

DeviceHeap& heap(int device) {
  static std::vector<std::unique_ptr<DeviceHeap>>* heaps = [] {
    auto* v = new std::vector<std::unique_ptr<DeviceHeap>>();  // never destroyed
    for (int d = 0; d < kMaxDevices; ++d) v->push_back(std::make_unique<DeviceHeap>(d));
    return v;
  }();
  return *(*heaps)[size_t(device)];
}

struct PinnedHeap {
  PinnedMemory memory;
  BlockPool pool{memory};
};
PinnedHeap& pinned_heap() {
  static PinnedHeap* h = new PinnedHeap();  // never destroyed: batches may be freed during exit
  return *h;
}

std::atomic<bool> g_poison{false};

}  // namespace

namespace {
#if defined(UNETCU_CUDA_EMU) && defined(__SANITIZE_ADDRESS__)
// The CUDA emulator under AddressSanitizer (tools/test_cuda_emu.sh --asan): a block's bytes past
// the tensor it holds are marked unaddressable, so a kernel that reads or writes past its
// tensor's end (inside the caching allocator's rounding) is reported. The marking happens in
// stream order, before the new owner's work and after the last owner's, as a host function on
// the block's stream. Inside a capture nothing is marked: a capture's blocks are its own, fresh
// or reused within it, and never marked by an earlier owner.
struct Marking {
  char* block;
  size_t bytes, capacity;
};
void mark_block(void* m) {
  auto* k = static_cast<Marking*>(m);
  ASAN_UNPOISON_MEMORY_REGION(k->block, k->bytes);
  ASAN_POISON_MEMORY_REGION(k->block + k->bytes, k->capacity - k->bytes);
  delete k;
}
void mark_past_end(int device, void* p, size_t bytes, size_t capacity, cudaStream_t stream) {
  DeviceGuard g(device);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone) return;
  auto* k = new Marking{static_cast<char*>(p), bytes, capacity};
  if (cudaLaunchHostFunc(stream, mark_block, k) != cudaSuccess) {
    cudaGetLastError();
    delete k;
  }
}
#else
void mark_past_end(int, void*, size_t, size_t, cudaStream_t) {}  // only the emulator under ASan marks
#endif
}  // namespace

void* device_alloc(int device, size_t bytes, size_t* capacity) {
  check_device_index(device);
  const cudaStream_t stream = current_stream(device);
  DeviceHeap& h = heap(device);
  void* p = h.pool.allocate(bytes, StreamRef{device, stream}, capacity);
  if (!p)
    throw Error(str_cat("out of device memory on cuda:", device, ": allocating ",
                        BlockPool::round_size(bytes), " bytes with ",
                        h.pool.stats().current_bytes, " bytes in tensors (", t_alloc_error, ")"));
  if (g_poison) {
    mark_past_end(device, p, *capacity, *capacity, stream);  // the fill below covers the whole block
    DeviceGuard g(device);
    CUDA_CHECK(cudaMemsetAsync(p, 0xFF, *capacity, stream));
  }
  mark_past_end(device, p, bytes, *capacity, stream);
  return p;
}

void device_free(int device, void* ptr, size_t) {
  if (!ptr || device < 0 || device >= kMaxDevices) return;
  heap(device).pool.free(ptr);
}

void record_stream(const void* ptr, Device memory, int stream_device, cudaStream_t stream) {
  const StreamRef use{stream_device, stream};
  if (memory.is_cuda()) {
    if (memory.index >= 0 && memory.index < kMaxDevices) heap(memory.index).pool.record_use(ptr, use);
  } else {
    pinned_heap().pool.record_use(ptr, use);
  }
}

AllocatorStats device_memory_stats(int device) {
  check_device_index(device);
  return heap(device).pool.stats();
}

void reset_device_peak(int device) {
  check_device_index(device);
  heap(device).pool.reset_peak();
}

size_t device_free_memory(int device) {
  check_device_index(device);
  DeviceGuard guard(device);
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return free_b + heap(device).pool.stats().cached_bytes;
}

// Waits for the events of the cached blocks, then cudaFree's them (which synchronises the
// device: not to be called while NCCL kernels of this process may wait for another rank).
void release_device_cache(int device) {
  check_device_index(device);
  heap(device).pool.release_cache();
}

void set_poison_allocations(bool on) { g_poison = on; }

DeviceBuffer::DeviceBuffer(int device, size_t bytes, bool optional) : device_(device) {
  if (!bytes) return;
  if (!optional) {
    ptr_ = device_alloc(device, bytes, &capacity_);
    return;
  }
  check_device_index(device);
  ptr_ = heap(device).pool.allocate(bytes, StreamRef{device, current_stream(device)}, &capacity_,
                                    /*release_on_oom=*/false, /*counted=*/false);
  if (ptr_) mark_past_end(device, ptr_, bytes, capacity_, current_stream(device));
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_) device_free(device_, ptr_, capacity_);
}

// ---- host side -----------------------------------------------------------------------

void* pinned_alloc(size_t bytes) {
  size_t capacity = 0;
  void* p = pinned_heap().pool.allocate(bytes, StreamRef{}, &capacity);
  if (!p)
    throw Error(str_cat("cannot allocate ", bytes, " bytes of pinned host memory: ", t_alloc_error));
  return p;
}

void pinned_free(void* ptr) { pinned_heap().pool.free(ptr); }

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
    record_stream(dst, dst_device, dst_device.index, s);
    // A pageable source may be reused by the host allocator as soon as we return: wait. A
    // pinned source is read later, by the copy on s: its block is not handed out again (and
    // overwritten by the host) until that copy has completed.
    if (src_pinned)
      record_stream(src, src_device, dst_device.index, s);
    else
      CUDA_CHECK(cudaStreamSynchronize(s));
    return;
  }
  if (dst_device.is_cpu() && src_device.is_cuda()) {
    DeviceGuard g(src_device.index);
    cudaStream_t s = current_stream(src_device.index);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));  // done before we return: nothing left to record
    return;
  }
  // Device to device: the copy runs on the destination's stream. Both blocks are recorded as
  // used there, so neither is handed out again (to any stream) before the copy has completed.
  const int sd = src_device.index, dd = dst_device.index;
  cudaStream_t ds = current_stream(dd);
  if (sd == dd) {
    DeviceGuard g(dd);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ds));
    record_stream(src, src_device, dd, ds);
    record_stream(dst, dst_device, dd, ds);
    return;
  }
  // Across devices the copy also starts only after the source's stream has finished what it had
  // queued (an event, not a host wait).
  Event ready(sd);
  ready.record(current_stream(sd));
  DeviceGuard g(dd);
  ready.wait_on(ds);
  CUDA_CHECK(cudaMemcpyPeerAsync(dst, dd, src, sd, bytes, ds));
  record_stream(src, src_device, dd, ds);
  record_stream(dst, dst_device, dd, ds);
  // ...and the source's stream waits for the copy. (The recorded use above already keeps the
  // source block from being reused too early; this wait also orders later writes to it.)
  Event copied(dd);
  copied.record(ds);
  copied.wait_on(current_stream(sd));
}

void memset_zero(void* ptr, int device, size_t bytes) {
  DeviceGuard g(device);
  cudaStream_t s = current_stream(device);
  CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, s));
  record_stream(ptr, Device::cuda(device), device, s);
}

void synchronize(int device) {
  DeviceGuard g(device);
  CUDA_CHECK(cudaStreamSynchronize(current_stream(device)));
}

void clear_last_error() { cudaGetLastError(); }

std::string device_name(int device) { return device_properties(device).name; }

// ---- graphs (runtime/cuda_api.h) ---------------------------------------------------------

namespace {
// Every live Stream, by device: what other_streams_busy looks at.
struct StreamRegistry {
  std::mutex mu;
  std::vector<cudaStream_t> streams[kMaxDevices];
  int capturing[kMaxDevices] = {};  // captures begun and not yet ended, by device
};
StreamRegistry& stream_registry() {
  static auto* r = new StreamRegistry();  // never destroyed: streams may outlive main
  return *r;
}
}  // namespace

struct Graph::Impl {
  int device = -1;
  cudaStream_t stream = nullptr;  // the origin: launches go there
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<std::pair<int, int>> pools;  // (device, private pool id)
  int pinned_capture = 0;  // the pinned pool's hold on the blocks the capture used
  ~Impl() {
    {
      QuietDeviceGuard g(device);
      // A replay's work on every stream it spans ends before the launch on the origin does.
      if (stream) cudaStreamSynchronize(stream);
      if (exec) cudaGraphExecDestroy(exec);
      if (graph) cudaGraphDestroy(graph);
    }
    for (auto [d, id] : pools) heap(d).pool.release_private(id);
    if (pinned_capture) pinned_heap().pool.release_capture(pinned_capture);
  }
};

namespace {

struct CaptureStream {
  int device;
  cudaStream_t stream;
};

// The capture behind both Graph::capture overloads: `streams` (the origin first, no repeats)
// joined by events into one capture for as long as `work` runs.
Graph::Impl* capture_streams(const std::vector<CaptureStream>& streams, const std::function<void()>& work) {
  const CaptureStream origin = streams.at(0);
  auto impl = std::make_unique<Graph::Impl>();
  impl->device = origin.device;
  impl->stream = origin.stream;
  // A private pool on each device the capture spans, for all of its streams there.
  std::map<int, std::vector<StreamRef>> by_device;
  for (const CaptureStream& c : streams) by_device[c.device].push_back(StreamRef{c.device, c.stream});
  std::vector<int> open;
  // The pinned pool holds the blocks these streams used and that are freed meanwhile until the
  // graph is gone (runtime/block_pool.h, begin_capture; ~Impl releases them); other streams'
  // searches query nothing on these devices until the capture ends (other_streams_busy).
  std::vector<StreamRef> all_refs;
  for (const CaptureStream& c : streams) all_refs.push_back(StreamRef{c.device, c.stream});
  std::vector<int> counted;  // devices whose capture count this capture raised
  const auto close_pools = [&] {
    for (int d : open) heap(d).pool.close_private();
    open.clear();
    if (impl->pinned_capture) pinned_heap().pool.end_capture(impl->pinned_capture);
    StreamRegistry& r = stream_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (int d : counted) --r.capturing[d];
    counted.clear();
  };
  try {
    for (const auto& [d, refs] : by_device) {
      impl->pools.emplace_back(d, heap(d).pool.open_private(refs));
      open.push_back(d);
    }
    impl->pinned_capture = pinned_heap().pool.begin_capture(all_refs);
    StreamRegistry& r = stream_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const auto& [d, refs] : by_device) {
      ++r.capturing[d];
      counted.push_back(d);
    }
  } catch (...) {
    close_pools();
    throw;
  }
  DeviceGuard g(origin.device);
  cudaError_t st = cudaStreamBeginCapture(origin.stream, cudaStreamCaptureModeRelaxed);
  if (st != cudaSuccess) {
    close_pools();
    throw Error(str_cat("cudaStreamBeginCapture on cuda:", origin.device, " failed: ", cudaGetErrorString(st)));
  }
  // Fork: every other stream joins the capture behind the origin's start; join: the origin
  // waits for each of them at the end (CUDA refuses to end a capture with a stream not joined
  // back). Unchecked: a failure here shows as the capture's own failure below.
  std::vector<cudaEvent_t> events;
  const auto link = [&](const CaptureStream& from, const CaptureStream& to) {
    QuietDeviceGuard on(from.device);
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) return;
    events.push_back(e);
    cudaEventRecord(e, from.stream);
    QuietDeviceGuard there(to.device);
    cudaStreamWaitEvent(to.stream, e, 0);
  };
  for (size_t i = 1; i < streams.size(); ++i) link(origin, streams[i]);
  const auto end = [&](cudaGraph_t* out) {
    for (size_t i = 1; i < streams.size(); ++i) link(streams[i], origin);
    const cudaError_t e = cudaStreamEndCapture(origin.stream, out);
    for (cudaEvent_t ev : events) cudaEventDestroy(ev);
    close_pools();
    return e;
  };
  const auto abandon = [&] {
    cudaGraph_t broken = nullptr;
    end(&broken);
    if (broken) cudaGraphDestroy(broken);
    cudaGetLastError();  // the capture's error must not surface at an unrelated later launch
  };
  // Every stream must be in the capture before any work is queued: a stream the fork missed
  // would run its part of the work for real now (a stage's batch-norm statistics updated once
  // outside the graph).
  for (const CaptureStream& c : streams) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    QuietDeviceGuard on(c.device);
    if (cudaStreamIsCapturing(c.stream, &status) != cudaSuccess || status != cudaStreamCaptureStatusActive) {
      abandon();
      throw Error(str_cat("capturing a CUDA graph: a stream of cuda:", c.device, " could not join the capture "
                          "begun on cuda:", origin.device));
    }
  }
  try {
    work();
  } catch (...) {
    abandon();
    throw;
  }
  st = end(&impl->graph);
  if (st != cudaSuccess) cudaGetLastError();
  UNETCU_CHECK(st == cudaSuccess && impl->graph, "capturing a CUDA graph on cuda:", origin.device, " failed: ",
               cudaGetErrorString(st), " (the captured work waited for the host, used another "
               "stream without joining it, or called something a graph cannot hold)");
  st = cudaGraphInstantiate(&impl->exec, impl->graph, 0);
  if (st != cudaSuccess) {
    cudaGetLastError();
    throw Error(str_cat("instantiating a CUDA graph on cuda:", origin.device, " failed: ", cudaGetErrorString(st)));
  }
  return impl.release();
}

}  // namespace

Graph Graph::capture(int device, const std::function<void()>& work) {
  check_device_index(device);
  DeviceGuard g(device);
  Graph graph;
  graph.impl_.reset(capture_streams({{device, current_stream(device)}}, work));
  return graph;
}

Graph Graph::capture(const std::vector<const Stream*>& streams, const std::function<void()>& work) {
  std::vector<CaptureStream> cs;
  for (const Stream* s : streams) {
    UNETCU_CHECK(s && s->get(), "a CUDA graph capture over a stream that does not exist");
    check_device_index(s->device());
    bool seen = false;
    for (const CaptureStream& c : cs) seen = seen || c.stream == s->get();
    if (!seen) cs.push_back({s->device(), s->get()});
  }
  UNETCU_CHECK(!cs.empty(), "a CUDA graph capture needs a stream");
  Graph graph;
  graph.impl_.reset(capture_streams(cs, work));
  return graph;
}

void Graph::launch() const {
  UNETCU_CHECK(impl_, "launch of an empty CUDA graph");
  DeviceGuard g(impl_->device);
  // The caller's copies before and reads after are on its current stream: the graph must be
  // replayed on that same stream to be ordered with them.
  UNETCU_CHECK(current_stream(impl_->device) == impl_->stream,
               "a CUDA graph is launched on the stream it was captured on, not the current one");
  CUDA_CHECK(cudaGraphLaunch(impl_->exec, impl_->stream));
}

Graph::Graph() = default;
Graph::~Graph() = default;
Graph::Graph(Graph&&) noexcept = default;
Graph& Graph::operator=(Graph&&) noexcept = default;

// ---- streams and events (runtime/cuda_api.h) -------------------------------------------

bool other_streams_busy(int device, cudaStream_t except) {
  check_device_index(device);
  StreamRegistry& r = stream_registry();
  std::lock_guard<std::mutex> lock(r.mu);  // no stream is destroyed while it is queried
  // While a capture runs on the device nothing there is queried: a stream could join it
  // between the check below and the query, and a query would end that capture.
  if (r.capturing[device] > 0) return true;
  QuietDeviceGuard g(device);
  for (cudaStream_t s : r.streams[device]) {
    if (s == except) continue;
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    // A capturing stream is busy, and must not be queried (that would end its capture).
    if (cudaStreamIsCapturing(s, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone) {
      cudaGetLastError();
      return true;
    }
    const cudaError_t st = cudaStreamQuery(s);
    if (st != cudaSuccess) {
      cudaGetLastError();  // cudaErrorNotReady is an answer, not an error
      return true;
    }
  }
  return false;
}

// Destructors must not throw: they switch devices with unchecked calls.
Stream::Stream(int device) : device_(device) {
  check_device_index(device);
  DeviceGuard g(device);
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  StreamRegistry& r = stream_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.streams[device].push_back(stream_);
}
Stream::~Stream() {
  if (!stream_) return;
  QuietDeviceGuard g(device_);
  {
    StreamRegistry& r = stream_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto& v = r.streams[device_];
    v.erase(std::remove(v.begin(), v.end(), stream_), v.end());
  }
  cudaStreamSynchronize(stream_);
  release_cudnn_handle(device_, stream_);
  // Blocks still alive that this stream used (on any device: a peer copy reads one device's
  // block on another's stream) must not get an event recorded on the destroyed handle when they
  // are freed; the stream's work on them is done.
  const StreamRef self{device_, stream_};
  try {
    for (int d = 0; d < kMaxDevices; ++d) heap(d).pool.forget_stream(self);
    pinned_heap().pool.forget_stream(self);
  } catch (...) {  // a mutex failing to lock: nothing sensible left to do in a destructor
  }
  cudaStreamDestroy(stream_);
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
    QuietDeviceGuard g(device);
    // A deleter's failure is not the next launch's error.
    if (cudaEventDestroy(p) != cudaSuccess) cudaGetLastError();
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

// Process-wide switches read by the convolution launcher on every call (and part of its plan
// key), set by unet_train's flags or the tests.
static std::atomic<bool> g_allow_tf32{true};
void set_allow_tf32(bool on) { g_allow_tf32 = on; }
bool allow_tf32() { return g_allow_tf32; }

static std::atomic<bool> g_deterministic{false};
void set_deterministic(bool on) { g_deterministic = on; }
bool deterministic() { return g_deterministic; }

}  // namespace cuda
}  // namespace unetcu
