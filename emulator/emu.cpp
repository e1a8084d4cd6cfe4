// The CUDA emulator's runtime (include/cuda_runtime.h, include/emu_device.h): devices, memory,
// streams, events, graphs and the kernel launch, on the CPU. See README.md for what it checks
// and what it cannot.
#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <thread>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
// AddressSanitizer follows the fibers' stacks (tools/test_cuda_emu.sh --asan).
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define UNETCU_EMU_ASAN 1
#endif

// ---- devices, errors ----------------------------------------------------------------------

namespace unetcu_emu {
namespace {

constexpr int kMaxDevices = 16;
// Each device's memory: 16 GiB, or UNETCU_EMU_DEVICE_MEMORY bytes (read at each call, so a
// test may shrink it for a while). cudaMalloc past it fails as on a GPU of that size.
size_t device_bytes() {
  const char* s = std::getenv("UNETCU_EMU_DEVICE_MEMORY");
  const long long v = s ? std::atoll(s) : 0;
  return v > 0 ? size_t(v) : size_t(16) << 30;
}

int device_count() {
  static const int n = [] {
    const char* s = std::getenv("UNETCU_EMU_DEVICES");
    const int v = s ? std::atoi(s) : 2;
    return v < 0 ? 0 : (v > kMaxDevices ? kMaxDevices : v);
  }();
  return n;
}

thread_local int t_device = 0;
thread_local cudaError_t t_last_error = cudaSuccess;

cudaError_t fail(cudaError_t e) {
  t_last_error = e;
  return e;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "CUDA emulator: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// ---- memory: every allocation known, so copies and kernel arguments can be checked ----------

struct Allocation {
  size_t bytes;
  int device;  // -1: pinned host memory
};
std::mutex g_mem_mutex;
std::map<uintptr_t, Allocation> g_allocations;
size_t g_device_bytes[kMaxDevices] = {};

// The allocation holding p (one past its end counts), or nullptr.
const Allocation* find_allocation(const void* p, uintptr_t* base = nullptr) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_allocations.upper_bound(a);
  if (it == g_allocations.begin()) return nullptr;
  --it;
  if (a > it->first + it->second.bytes) return nullptr;
  if (base) *base = it->first;
  return &it->second;
}

size_t allocated_size(size_t bytes) { return (bytes + 255) / 256 * 256 + 256; }

void* allocate(size_t bytes, int device) {
  void* p = std::aligned_alloc(256, allocated_size(bytes));
  if (!p) return nullptr;
#if defined(UNETCU_EMU_ASAN)
  // Past the bytes asked for: unaddressable, so an access there is reported.
  ASAN_POISON_MEMORY_REGION(static_cast<char*>(p) + bytes, allocated_size(bytes) - bytes);
#endif
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  g_allocations[reinterpret_cast<uintptr_t>(p)] = {bytes, device};
  if (device >= 0) g_device_bytes[device] += bytes;
  return p;
}

cudaError_t release(void* p, bool pinned) {
  if (!p) return cudaSuccess;
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  auto it = g_allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_allocations.end() || (it->second.device < 0) != pinned) return fail(cudaErrorInvalidValue);
  if (it->second.device >= 0) g_device_bytes[it->second.device] -= it->second.bytes;
#if defined(UNETCU_EMU_ASAN)
  ASAN_UNPOISON_MEMORY_REGION(p, allocated_size(it->second.bytes));
#endif
  g_allocations.erase(it);
  std::free(p);
  return cudaSuccess;
}

// Where p points: a device (>= 0), pinned host memory (-1), or other host memory (-2).
int where(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  uintptr_t base = 0;
  const Allocation* a = find_allocation(p, &base);
  if (!a) return -2;
  if (reinterpret_cast<uintptr_t>(p) + bytes > base + a->bytes)
    die("a copy of " + std::to_string(bytes) + " bytes runs past the end of its allocation");
  return a->device;
}

// ---- streams, events, graphs ----------------------------------------------------------------
//
// A stream is a queue and a host thread that runs its work in order, so work is asynchronous
// to the issuing thread as on a GPU: a host read that does not wait for its copy, or a block
// reused before the work using it is done, can be seen. An event is a position in a stream's
// queue.

// A capture's work as a graph: each node depends on the node issued before it on its stream
// and on the nodes an event it waited for stood behind, as CUDA's stream capture records it.
struct Stream;
struct Graph {
  struct Node {
    std::function<void()> work;
    std::vector<size_t> deps;
  };
  std::mutex m;  // several host threads may issue into the streams of one capture
  std::vector<Node> nodes;
  std::vector<Stream*> streams;  // every stream in the capture, the origin first
  bool invalidated = false;      // every later call into the capture fails
  uint64_t id = 0;               // while capturing: its key in g_captures
  // UNETCU_EMU_FAIL_CAPTURE_AT=N (tests): the capture's N-th node is refused, as a driver
  // refuses an operation a graph cannot hold, and the capture is invalidated.
  uint64_t fail_at = 0, issued = 0;
};

// The captures in progress, by id: an event recorded in a capture that has ended names none.
std::mutex g_captures_mutex;
std::map<uint64_t, Graph*> g_captures;
uint64_t g_next_capture = 1;

struct Queue {
  int device = 0;
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> pending;
  uint64_t issued = 0, done = 0;
  bool stop = false;
  std::thread worker;

  explicit Queue(int d) : device(d) {
    worker = std::thread([this] { run(); });
  }
  ~Queue() {
    {
      std::lock_guard<std::mutex> l(m);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }
  void run() {
    t_device = device;
    for (;;) {
      std::function<void()> w;
      {
        std::unique_lock<std::mutex> l(m);
        cv.wait(l, [&] { return stop || !pending.empty(); });
        if (pending.empty()) return;
        w = std::move(pending.front());
        pending.pop_front();
      }
      w();
      {
        std::lock_guard<std::mutex> l(m);
        ++done;
      }
      cv.notify_all();
    }
  }
  uint64_t push(std::function<void()> w) {
    uint64_t seq;
    {
      std::lock_guard<std::mutex> l(m);
      pending.push_back(std::move(w));
      seq = ++issued;
    }
    cv.notify_all();
    return seq;
  }
  uint64_t position() {
    std::lock_guard<std::mutex> l(m);
    return issued;
  }
  bool reached(uint64_t seq) {
    std::lock_guard<std::mutex> l(m);
    return done >= seq;
  }
  void wait_for(uint64_t seq) {
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return done >= seq; });
  }
  void drain() { wait_for(position()); }
};

// Every live queue, for the device-wide synchronisation of cudaFree and cudaFreeHost.
std::mutex g_queues_mutex;
std::vector<std::weak_ptr<Queue>> g_queues;

std::shared_ptr<Queue> new_queue(int device) {
  auto q = std::make_shared<Queue>(device);
  std::lock_guard<std::mutex> lock(g_queues_mutex);
  g_queues.erase(std::remove_if(g_queues.begin(), g_queues.end(), [](auto& w) { return w.expired(); }),
                 g_queues.end());
  g_queues.push_back(q);
  return q;
}

// Waits for the work of every stream of `device` (every device: -1).
void synchronize_device(int device) {
  std::vector<std::shared_ptr<Queue>> live;
  {
    std::lock_guard<std::mutex> lock(g_queues_mutex);
    for (auto& w : g_queues)
      if (auto q = w.lock(); q && (device < 0 || q->device == device)) live.push_back(q);
  }
  for (auto& q : live) q->drain();
}

struct Stream {
  std::shared_ptr<Queue> queue;
  Graph* capture = nullptr;  // the graph being captured into, or nullptr
  std::vector<size_t> tail;  // in a capture: the nodes the stream's next node depends on
  int device() const { return queue->device; }
};

}  // namespace
}  // namespace unetcu_emu

struct CUstream_st : unetcu_emu::Stream {};
struct CUevent_st {
  int device;
  std::shared_ptr<unetcu_emu::Queue> queue;  // where it was last recorded, at position seq
  uint64_t seq = 0;
  bool captured = false;       // last recorded inside a capture
  uint64_t capture_id = 0;     // that capture's key in g_captures (absent once it ended)
  std::vector<size_t> captured_tail;  // there: the nodes it stands behind
};
struct CUgraph_st : unetcu_emu::Graph {};
// An instantiated graph: its nodes in the order a replay runs them.
struct CUgraphExec_st {
  std::vector<std::function<void()>> order;
};
namespace unetcu_emu {
namespace {

// Each device's default stream (cudaStream_t nullptr; as a stream of its own, without the
// legacy stream's synchronisation with the others: the engine issues no work to it).
Stream* default_stream(int device) {
  static std::mutex m;
  static CUstream_st streams[kMaxDevices];
  std::lock_guard<std::mutex> lock(m);
  Stream* s = &streams[device];
  if (!s->queue) s->queue = new_queue(device);
  return s;
}
Stream* resolve(cudaStream_t s) { return s ? static_cast<Stream*>(s) : default_stream(t_device); }

// Queues `work` on the stream, or appends it to the graph the stream is capturing.
cudaError_t issue(cudaStream_t stream, std::function<void()> work) {
  Stream* s = resolve(stream);
  if (s->device() != t_device) return fail(cudaErrorInvalidResourceHandle);
  if (s->capture) {
    Graph* g = s->capture;
    std::lock_guard<std::mutex> lock(g->m);
    if (g->invalidated) return fail(cudaErrorStreamCaptureInvalidated);
    if (g->fail_at && ++g->issued == g->fail_at) {
      g->invalidated = true;
      return fail(cudaErrorStreamCaptureUnsupported);
    }
    // A replay runs every node on the launching stream's thread: each as its own device's.
    g->nodes.push_back({[d = s->device(), w = std::move(work)] {
                          const int saved = t_device;
                          t_device = d;
                          w();
                          t_device = saved;
                        },
                        s->tail});
    s->tail = {g->nodes.size() - 1};
  } else {
    s->queue->push([w = std::move(work)] {
      try {
        w();
      } catch (const std::exception& e) {
        die(std::string("stream work threw: ") + e.what());
      }
    });
  }
  return cudaSuccess;
}

// A synchronising call on a capturing stream invalidates the capture, as CUDA does.
void invalidate(Graph* g) {
  std::lock_guard<std::mutex> lock(g->m);
  g->invalidated = true;
}

cudaError_t no_sync_in_capture(Stream* s) {
  if (!s->capture) return cudaSuccess;
  invalidate(s->capture);
  return fail(cudaErrorStreamCaptureUnsupported);
}

// Every node `tail` depends on, itself included.
std::vector<char> ancestors(const Graph& g, const std::vector<size_t>& tail) {
  std::vector<char> seen(g.nodes.size(), 0);
  std::vector<size_t> todo = tail;
  while (!todo.empty()) {
    const size_t n = todo.back();
    todo.pop_back();
    if (seen[n]) continue;
    seen[n] = 1;
    for (size_t d : g.nodes[n].deps) todo.push_back(d);
  }
  return seen;
}

// The order a replay runs the nodes in: one that keeps every dependency but not the issue
// order, so that work captured on two streams without an event between them runs in another
// order than it was issued in (of the nodes ready, the one issued last runs first). On one
// stream that is the issue order.
std::vector<std::function<void()>> replay_order(const Graph& g) {
  const size_t n = g.nodes.size();
  std::vector<size_t> waiting(n, 0);
  std::vector<std::vector<size_t>> after(n);
  for (size_t i = 0; i < n; ++i) {
    std::vector<size_t> deps = g.nodes[i].deps;
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    waiting[i] = deps.size();
    for (size_t d : deps) after[d].push_back(i);
  }
  std::vector<size_t> ready;  // a max-heap of node ids
  for (size_t i = 0; i < n; ++i)
    if (!waiting[i]) ready.push_back(i);
  std::make_heap(ready.begin(), ready.end());
  std::vector<std::function<void()>> order;
  while (!ready.empty()) {
    std::pop_heap(ready.begin(), ready.end());
    const size_t i = ready.back();
    ready.pop_back();
    order.push_back(g.nodes[i].work);
    for (size_t j : after[i])
      if (--waiting[j] == 0) {
        ready.push_back(j);
        std::push_heap(ready.begin(), ready.end());
      }
  }
  return order;  // deps point only to earlier nodes: every node is in it
}

}  // namespace

cudaError_t enqueue(cudaStream_t stream, std::function<void()> work) { return issue(stream, std::move(work)); }

int memory_device(const void* p, size_t bytes, const char* what) {
  {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    uintptr_t base = 0;
    const Allocation* a = find_allocation(p, &base);
    if (!a) return -2;
    if (reinterpret_cast<uintptr_t>(p) + bytes <= base + a->bytes) return a->device;
  }
  die(std::string(what) + ": " + std::to_string(bytes) + " bytes run past the end of their allocation");
}
int stream_device(cudaStream_t stream) { return resolve(stream)->device(); }
void stop(const std::string& what) { die(what); }

}  // namespace unetcu_emu

using namespace unetcu_emu;

cudaError_t cudaGetDeviceCount(int* count) {
  *count = device_count();
  if (*count == 0) return fail(cudaErrorNoDevice);
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "CUDA emulator on the CPU (device %d)", device);
  prop->totalGlobalMem = device_bytes();
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (device < 0 || device >= device_count() || peer < 0 || peer >= device_count())
    return fail(cudaErrorInvalidDevice);
  *can = device != peer;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned) {
  static std::mutex m;
  static bool enabled[kMaxDevices][kMaxDevices] = {};
  if (peer < 0 || peer >= device_count() || peer == t_device) return fail(cudaErrorInvalidDevice);
  std::lock_guard<std::mutex> lock(m);
  if (enabled[t_device][peer]) return fail(cudaErrorPeerAccessAlreadyEnabled);
  enabled[t_device][peer] = true;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return t_last_error; }
const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected (emulator: UNETCU_EMU_DEVICES=0)";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureUnjoined: return "capture sequence contains a fork that was not joined to the primary stream";
    default: return cudaGetErrorName(err);
  }
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  const size_t total = device_bytes();
  *total_bytes = total;
  const size_t used = g_device_bytes[t_device];
  *free_bytes = used < total ? total - used : 0;
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    if (g_device_bytes[t_device] + bytes > device_bytes()) return fail(cudaErrorMemoryAllocation);
  }
  *ptr = allocate(bytes, t_device);
  return *ptr ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}
// Both synchronise the device (all devices for pinned memory), as CUDA's do.
cudaError_t cudaFree(void* ptr) {
  if (!ptr) return cudaSuccess;
  synchronize_device(where(ptr, 0));
  return release(ptr, false);
}
cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
  *ptr = allocate(bytes, -1);
  return *ptr ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}
cudaError_t cudaFreeHost(void* ptr) {
  synchronize_device(-1);
  return release(ptr, true);
}

// A copy's ends must be where its kind says: a device's memory for a device end, host memory
// (pinned or not) for a host end. A device end on another device than the stream's is an error
// except in a peer copy.
// Returns where p is (see where()).
static int check_copy_end(const void* p, size_t bytes, bool device_end, const char* what) {
  const int w = where(p, bytes);
  if (device_end ? w < 0 : w >= 0)
    die(std::string("cudaMemcpyAsync: the ") + what + " is " +
        (w >= 0 ? "device memory" : "host memory") + " but the copy's kind says otherwise");
  return w;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDefault) die("cudaMemcpyAsync: cudaMemcpyDefault is not emulated");
  const int wd = check_copy_end(dst, bytes, dst_dev, "destination");
  const int ws = check_copy_end(src, bytes, src_dev, "source");
  // With pageable host memory at either end the copy is synchronous, as CUDA's is: it waits
  // for the stream's earlier work and is done when the call returns.
  if (wd == -2 || ws == -2) {
    Stream* s = resolve(stream);
    if (s->capture) return no_sync_in_capture(s);
    if (const cudaError_t e = issue(stream, [=] { std::memmove(dst, src, bytes); })) return e;
    s->queue->drain();
    return cudaSuccess;
  }
  return issue(stream, [=] { std::memmove(dst, src, bytes); });
}
cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device,
                                size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (where(dst, bytes) != dst_device || where(src, bytes) != src_device)
    die("cudaMemcpyPeerAsync: a pointer is not on the device named for it");
  return issue(stream, [=] { std::memmove(dst, src, bytes); });
}
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (where(ptr, bytes) != t_device) die("cudaMemsetAsync: the pointer is not the current device's memory");
  return issue(stream, [=] { std::memset(ptr, value, bytes); });
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  auto* s = new CUstream_st();
  s->queue = new_queue(t_device);
  *stream = s;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (!stream) return fail(cudaErrorInvalidResourceHandle);
  delete stream;  // its queue runs what is pending, held by the events recorded on it
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Stream* s = resolve(stream);
  if (const cudaError_t e = no_sync_in_capture(s)) return e;
  s->queue->drain();
  return cudaSuccess;
}
// Whether the stream's work so far has all run; inside a capture the capture is invalidated, as
// CUDA's relaxed mode does for this call.
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  Stream* s = resolve(stream);
  if (const cudaError_t e = no_sync_in_capture(s)) return e;
  return s->queue->reached(s->queue->position()) ? cudaSuccess : fail(cudaErrorNotReady);
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) {
  Stream* s = resolve(stream);
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  if (s->capture || event->captured) {
    // Inside a capture only events captured in it can be waited on; waiting on one joins the
    // capture. An event of a capture that has ended is waited on by no one (CUDA's behaviour
    // there is not relied on).
    // The capture stays alive while its mutex is taken: it ends under g_captures_mutex.
    std::unique_lock<std::mutex> captures(g_captures_mutex);
    auto it = event->captured ? g_captures.find(event->capture_id) : g_captures.end();
    Graph* g = it == g_captures.end() ? nullptr : it->second;
    if (!g || (s->capture && s->capture != g)) {
      captures.unlock();
      if (s->capture) invalidate(s->capture);
      return fail(cudaErrorStreamCaptureIsolation);
    }
    std::lock_guard<std::mutex> lock(g->m);
    captures.unlock();
    if (g->invalidated) return fail(cudaErrorStreamCaptureInvalidated);
    if (!s->capture) {  // joins: its next node comes after what the event stands behind
      s->capture = g;
      s->tail.clear();
      g->streams.push_back(s);
    }
    s->tail.insert(s->tail.end(), event->captured_tail.begin(), event->captured_tail.end());
    return cudaSuccess;
  }
  if (!event->queue || event->queue == s->queue) return cudaSuccess;
  auto q = event->queue;
  const uint64_t seq = event->seq;
  s->queue->push([q, seq] { q->wait_for(seq); });
  return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode) {
  if (!stream) return fail(cudaErrorStreamCaptureUnsupported);  // not on the legacy stream
  Stream* s = resolve(stream);
  if (s->capture) return fail(cudaErrorInvalidValue);
  auto* g = new CUgraph_st();
  g->streams.push_back(s);
  // UNETCU_EMU_FAIL_CAPTURE_DEVICE=d: only the captures that begin on device d.
  const char* on = std::getenv("UNETCU_EMU_FAIL_CAPTURE_DEVICE");
  if (const char* at = std::getenv("UNETCU_EMU_FAIL_CAPTURE_AT"); at && (!on || std::atoi(on) == s->device()))
    g->fail_at = std::strtoull(at, nullptr, 10);
  {
    std::lock_guard<std::mutex> lock(g_captures_mutex);
    g->id = g_next_capture++;
    g_captures[g->id] = g;
  }
  s->capture = g;
  s->tail.clear();
  return cudaSuccess;
}
// Ends the capture on its origin stream. Every stream that joined it must have been joined
// back: its last node an ancestor of the origin's (an event recorded on it, waited for by the
// origin), else cudaErrorStreamCaptureUnjoined, as CUDA. Every stream leaves the capture.
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  Stream* s = resolve(stream);
  *graph = nullptr;
  if (!s->capture) return fail(cudaErrorStreamCaptureUnmatched);
  auto* g = static_cast<CUgraph_st*>(s->capture);
  cudaError_t result = cudaSuccess;
  {
    std::lock_guard<std::mutex> captures(g_captures_mutex);  // before g->m, as in the waits
    std::lock_guard<std::mutex> lock(g->m);
    if (g->streams.front() != s) return fail(cudaErrorStreamCaptureUnmatched);  // not its origin
    g_captures.erase(g->id);
    const std::vector<char> joined = ancestors(*g, s->tail);
    for (Stream* other : g->streams)
      for (size_t n : other->tail)
        if (!joined[n]) result = cudaErrorStreamCaptureUnjoined;
    if (g->invalidated) result = cudaErrorStreamCaptureInvalidated;
    for (Stream* other : g->streams) {
      other->capture = nullptr;
      other->tail.clear();
    }
  }
  if (result != cudaSuccess) {
    delete g;
    return fail(result);
  }
  *graph = g;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  Stream* s = resolve(stream);
  Graph* g = s->capture;  // read once (a capture ending on another thread meanwhile is the caller's race)
  if (!g) {
    *status = cudaStreamCaptureStatusNone;
    return cudaSuccess;
  }
  std::lock_guard<std::mutex> lock(g->m);
  *status = g->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, cudaStreamCaptureStatus* status,
                                     unsigned long long* id) {
  Stream* s = resolve(stream);
  Graph* g = s->capture;  // read once, as in cudaStreamIsCapturing
  if (id) *id = 0;
  if (!g) {
    *status = cudaStreamCaptureStatusNone;
    return cudaSuccess;
  }
  std::lock_guard<std::mutex> lock(g->m);
  *status = g->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  if (id) *id = g->id;
  return cudaSuccess;
}
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) {
  return issue(stream, [=] { fn(user_data); });
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
  *event = new CUevent_st{t_device, nullptr, 0, false, 0, {}};
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  delete event;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  Stream* s = resolve(stream);
  if (!event || event->device != s->device()) return fail(cudaErrorInvalidResourceHandle);
  event->captured = s->capture != nullptr;
  event->capture_id = s->capture ? s->capture->id : 0;
  event->queue = s->capture ? nullptr : s->queue;
  event->seq = s->capture ? 0 : s->queue->position();
  event->captured_tail.clear();
  if (s->capture) {
    std::lock_guard<std::mutex> lock(s->capture->m);
    if (s->capture->invalidated) return fail(cudaErrorStreamCaptureInvalidated);
    event->captured_tail = s->tail;
  }
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  if (event->captured) return fail(cudaErrorCapturedEvent);
  if (event->queue && !event->queue->reached(event->seq)) return fail(cudaErrorNotReady);
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!event) return fail(cudaErrorInvalidResourceHandle);
  if (event->captured) return fail(cudaErrorCapturedEvent);
  if (event->queue) event->queue->wait_for(event->seq);
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (!graph) return fail(cudaErrorInvalidValue);
  auto* e = new CUgraphExec_st();
  std::lock_guard<std::mutex> lock(graph->m);
  e->order = replay_order(*graph);
  *exec = e;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (!exec) return fail(cudaErrorInvalidValue);
  return issue(stream, [exec] {
    for (auto& w : exec->order) w();
  });
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}

// ---- kernels: blocks one after another; a block's threads in a loop or as fibers ------------

namespace unetcu_emu {

thread_local Coords t_coords;

namespace {

// Context switch: saves the callee-saved registers on the current stack, stores its pointer in
// *from, and continues on the stack `to`. The floating-point control words (MXCSR, the x87
// control word) are not switched: every fiber of a block runs on the scheduler's host thread
// and no kernel changes them, so they are the same in every context; loading them at each
// switch (ldmxcsr and fldcw serialise the pipeline) took most of a block's barrier time.
#if defined(__x86_64__)
extern "C" void unetcu_emu_switch(void** from, void* to);
asm(R"(
  .text
  .globl unetcu_emu_switch
  .type unetcu_emu_switch,@function
unetcu_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size unetcu_emu_switch,.-unetcu_emu_switch
)");
#endif

constexpr size_t kFiberStack = 64 * 1024;
enum class State { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
  State state = State::Runnable;
  void* sp = nullptr;
  char* stack = nullptr;     // its kFiberStack bytes
  void* asan_fake = nullptr;  // AddressSanitizer's record of the stack while switched away
  uint3 thread{};
  unsigned shuffles = 0;  // shuffles done: the parity picks the exchange slot
#if !defined(__x86_64__)
  ucontext_t ctx;
#endif
};

struct BlockRun {
  const char* name = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  std::vector<char> stacks;
  void* scheduler_sp = nullptr;
  // AddressSanitizer: the scheduler's stack, as the fibers switch back to it.
  void* asan_fake = nullptr;
  const void* scheduler_bottom = nullptr;
  size_t scheduler_size = 0;
#if !defined(__x86_64__)
  ucontext_t scheduler_ctx;
#endif
  int current = -1;
  bool from_scheduler = false;  // the running fiber was switched to by the scheduler
  int live = 0;
  std::vector<uint64_t> exchange;  // [warp][parity][lane]
};
thread_local BlockRun* t_run = nullptr;  // the block running as fibers on this thread
thread_local const char* t_sequential = nullptr;  // the kernel running barrier-free

// On a fiber's stack, just after a switch to it: tells AddressSanitizer where it now runs (and,
// coming from the scheduler, where the scheduler's stack is).
void arrived_on_fiber(BlockRun* r) {
#if defined(UNETCU_EMU_ASAN)
  const void* bottom = nullptr;
  size_t size = 0;
  __sanitizer_finish_switch_fiber(r->fibers[r->current].asan_fake, &bottom, &size);
  if (r->from_scheduler) {
    r->scheduler_bottom = bottom;
    r->scheduler_size = size;
  }
#else
  (void)r;
#endif
}

// The first fiber after i that can run, or -1.
int next_runnable(const BlockRun* r, int i) {
  for (int j = i + 1; j < int(r->fibers.size()); ++j)
    if (r->fibers[size_t(j)].state == State::Runnable) return j;
  return -1;
}

// The current fiber waits at a barrier (or, `finished`, has ended): control passes straight to
// the next fiber after it that can run, else back to the scheduler, which releases a barrier.
// The order is the scheduler's own (a pass over the block in thread order), at half the
// switches of a return to the scheduler between two fibers.
void yield_fiber(BlockRun* r, bool finished = false) {
  Fiber& f = r->fibers[size_t(r->current)];
  const int j = next_runnable(r, r->current);
#if !defined(UNETCU_EMU_ASAN)
  (void)finished;
#endif
  if (j < 0) {
#if defined(UNETCU_EMU_ASAN)
    __sanitizer_start_switch_fiber(finished ? nullptr : &f.asan_fake, r->scheduler_bottom, r->scheduler_size);
#endif
#if defined(__x86_64__)
    unetcu_emu_switch(&f.sp, r->scheduler_sp);
#else
    swapcontext(&f.ctx, &r->scheduler_ctx);
#endif
  } else {
    Fiber& to = r->fibers[size_t(j)];
    r->current = j;
    r->from_scheduler = false;
    t_coords.thread = to.thread;
#if defined(UNETCU_EMU_ASAN)
    __sanitizer_start_switch_fiber(finished ? nullptr : &f.asan_fake, to.stack, kFiberStack);
#endif
#if defined(__x86_64__)
    unetcu_emu_switch(&f.sp, to.sp);
#else
    swapcontext(&f.ctx, &to.ctx);
#endif
  }
  arrived_on_fiber(r);
}

void fiber_main() {
  BlockRun* r = t_run;
  arrived_on_fiber(r);
  try {
    (*r->body)();
  } catch (...) {
    die(std::string("kernel ") + r->name + " threw");
  }
  r->fibers[r->current].state = State::Done;
  --r->live;
  yield_fiber(r, /*finished=*/true);
  die("a finished fiber was resumed");
}

void resume(BlockRun* r, int i) {
  r->current = i;
  r->from_scheduler = true;
  t_coords.thread = r->fibers[i].thread;
#if defined(UNETCU_EMU_ASAN)
  __sanitizer_start_switch_fiber(&r->asan_fake, r->fibers[i].stack, kFiberStack);
#endif
#if defined(__x86_64__)
  unetcu_emu_switch(&r->scheduler_sp, r->fibers[i].sp);
#else
  swapcontext(&r->scheduler_ctx, &r->fibers[i].ctx);
#endif
#if defined(UNETCU_EMU_ASAN)
  __sanitizer_finish_switch_fiber(r->asan_fake, nullptr, nullptr);
#endif
}

std::string block_name(const char* kernel) {
  const uint3 b = t_coords.block;
  return std::string("kernel ") + kernel + ", block (" + std::to_string(b.x) + ", " +
         std::to_string(b.y) + ", " + std::to_string(b.z) + ")";
}

void run_block_fibers(BlockRun& r, int threads) {
  const dim3 bd = t_coords.block_dim;
  r.fibers.assign(size_t(threads), Fiber());
#if defined(UNETCU_EMU_ASAN)
  // The last block's fibers never returned from fiber_main: their frames' redzones are still
  // marked on the stacks this block reuses (or that a larger block's resize copies).
  ASAN_UNPOISON_MEMORY_REGION(r.stacks.data(), r.stacks.size());
#endif
  if (r.stacks.size() < size_t(threads) * kFiberStack) r.stacks.resize(size_t(threads) * kFiberStack);
  r.exchange.assign(size_t((threads + 31) / 32) * 64, 0);
  for (int i = 0; i < threads; ++i) {
    Fiber& f = r.fibers[size_t(i)];
    f.thread = {unsigned(i) % bd.x, (unsigned(i) / bd.x) % bd.y, unsigned(i) / (bd.x * bd.y)};
    char* base = r.stacks.data() + size_t(i) * kFiberStack;
    f.stack = base;
#if defined(__x86_64__)
    uintptr_t top = (reinterpret_cast<uintptr_t>(base) + kFiberStack) & ~uintptr_t(15);
    void** slot = reinterpret_cast<void**>(top - 16);  // 16-aligned: fiber_main starts as if called
    *slot = reinterpret_cast<void*>(&fiber_main);
    uint64_t* frame = reinterpret_cast<uint64_t*>(slot) - 6;  // the 6 registers switch pops
    std::memset(frame, 0, 6 * sizeof(uint64_t));
    f.sp = frame;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = base;
    f.ctx.uc_stack.ss_size = kFiberStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
  }
  r.live = threads;
  t_run = &r;
  while (r.live > 0) {
    for (int i = 0; i < threads; ++i)
      if (r.fibers[size_t(i)].state == State::Runnable) resume(&r, i);
    if (r.live == 0) break;
    // Every live thread waits at a barrier: release a warp whose live lanes all wait at a
    // shuffle, else the block if every live thread waits at __syncthreads.
    bool released = false;
    for (int w = 0; w * 32 < threads; ++w) {
      bool all = true, any = false;
      for (int i = w * 32; i < std::min(threads, w * 32 + 32); ++i) {
        const State s = r.fibers[size_t(i)].state;
        if (s == State::Done) continue;
        any = true;
        all = all && s == State::AtWarpBarrier;
      }
      if (any && all) {
        for (int i = w * 32; i < std::min(threads, w * 32 + 32); ++i)
          if (r.fibers[size_t(i)].state == State::AtWarpBarrier) r.fibers[size_t(i)].state = State::Runnable;
        released = true;
      }
    }
    if (released) continue;
    bool all_block = true;
    for (auto& f : r.fibers) all_block = all_block && (f.state == State::Done || f.state == State::AtBlockBarrier);
    if (!all_block)
      die(block_name(r.name) + ": its threads wait at different barriers (a __syncthreads or a "
          "shuffle not reached by every thread): this deadlocks on a GPU");
    for (auto& f : r.fibers)
      if (f.state == State::AtBlockBarrier) f.state = State::Runnable;
  }
  t_run = nullptr;
}

}  // namespace

void syncthreads() {
  BlockRun* r = t_run;
  if (!r)
    die(std::string("kernel ") + (t_sequential ? t_sequential : "?") +
        " calls __syncthreads but was translated as barrier-free (emulator/translate.py)");
  r->fibers[size_t(r->current)].state = State::AtBlockBarrier;
  yield_fiber(r);
}

uint64_t shuffle_down(uint64_t bits, unsigned mask, unsigned delta, int width) {
  BlockRun* r = t_run;
  if (!r)
    die(std::string("kernel ") + (t_sequential ? t_sequential : "?") +
        " shuffles but was translated as barrier-free (emulator/translate.py)");
  if (mask != 0xffffffffu || width != 32) die(block_name(r->name) + ": only full-warp shuffles are emulated");
  const int i = r->current, warp = i / 32, lane = i % 32;
  Fiber& f = r->fibers[size_t(i)];
  uint64_t* slots = r->exchange.data() + size_t(warp) * 64 + (f.shuffles & 1) * 32;
  ++f.shuffles;
  slots[lane] = bits;
  f.state = State::AtWarpBarrier;
  yield_fiber(r);
  const int src = lane + int(delta);
  const int lanes = std::min(32, int(r->fibers.size()) - warp * 32);
  return src < lanes ? slots[src] : bits;
}

void submit(const char* name, const Config& c, bool barriers, const void* const* pointers,
            int npointers, std::function<void()> body) {
  const uint64_t threads = uint64_t(c.block.x) * c.block.y * c.block.z;
  if (threads == 0 || threads > 1024 || c.block.z > 64 || c.grid.x == 0 || c.grid.y == 0 ||
      c.grid.z == 0 || c.grid.y > 65535 || c.grid.z > 65535 || c.shared > 48 * 1024) {
    fail(cudaErrorInvalidConfiguration);
    return;
  }
  for (int k = 0; k < npointers; ++k) {
    if (!pointers[k]) continue;
    const int w = where(pointers[k], 0);
    if (w != t_device)
      die(std::string("kernel ") + name + ": pointer argument " + std::to_string(k + 1) + " is " +
          (w == -2 ? "host memory" : w == -1 ? "pinned host memory" : "cuda:" + std::to_string(w) + "'s memory") +
          ", launched on cuda:" + std::to_string(t_device));
  }
  auto run = [name, c, barriers, body = std::move(body)] {
    const Coords saved = t_coords;
    t_coords.block_dim = c.block;
    t_coords.grid_dim = c.grid;
    static thread_local BlockRun fiber_block;
    for (unsigned bz = 0; bz < c.grid.z; ++bz)
      for (unsigned by = 0; by < c.grid.y; ++by)
        for (unsigned bx = 0; bx < c.grid.x; ++bx) {
          t_coords.block = {bx, by, bz};
          if (barriers) {
            fiber_block.name = name;
            fiber_block.body = &body;
            run_block_fibers(fiber_block, int(c.block.x * c.block.y * c.block.z));
            continue;
          }
          t_sequential = name;
          for (unsigned tz = 0; tz < c.block.z; ++tz)
            for (unsigned ty = 0; ty < c.block.y; ++ty)
              for (unsigned tx = 0; tx < c.block.x; ++tx) {
                t_coords.thread = {tx, ty, tz};
                body();
              }
          t_sequential = nullptr;
        }
    t_coords = saved;
  };
  issue(c.stream, std::move(run));
}

}  // namespace unetcu_emu
