// runtime/cuda_api.h for builds without the CUDA backend.
#include "runtime/common.h"
#include "runtime/cuda_api.h"

namespace unetcu::cuda {

[[noreturn]] static void no_cuda() { throw Error("this build has no CUDA backend"); }

bool built() { return false; }
void* device_alloc(int, size_t, size_t*) { no_cuda(); }
void device_free(int, void*, size_t) { no_cuda(); }
AllocatorStats device_memory_stats(int) { no_cuda(); }
void reset_device_peak(int) { no_cuda(); }
size_t device_free_memory(int) { no_cuda(); }
void release_device_cache(int) { no_cuda(); }
void set_poison_allocations(bool) {}
void* pinned_alloc(size_t) { no_cuda(); }
void pinned_free(void*) { no_cuda(); }
void record_stream(const void*, Device, int, CUstream_st*) {}  // no stream can exist here
void copy(void*, Device, const void*, Device, size_t, bool) { no_cuda(); }
void memset_zero(void*, int, size_t) { no_cuda(); }
void synchronize(int) { no_cuda(); }
void clear_last_error() {}
std::string device_name(int) { no_cuda(); }
Stream::Stream(int) { no_cuda(); }
Stream::~Stream() {}
StreamScope::StreamScope(const Stream&) : device_(0), previous_(nullptr) { no_cuda(); }
StreamScope::~StreamScope() {}
const Stream& upload_stream(int) { no_cuda(); }
void use_after(const Event&, const void*, int) { no_cuda(); }
Event::Event(int) { no_cuda(); }
Event Event::record(int) { no_cuda(); }
void Event::wait(int) const {}  // no event can exist here: waiting on none does nothing
void Event::record(CUstream_st*) { no_cuda(); }
void Event::wait_on(CUstream_st*) const { no_cuda(); }
struct Graph::Impl {};
Graph Graph::capture(int, const std::function<void()>&) { no_cuda(); }
Graph Graph::capture(const std::vector<const Stream*>&, const std::function<void()>&) { no_cuda(); }
void Graph::launch() const { no_cuda(); }
Graph::Graph() = default;
Graph::~Graph() = default;
Graph::Graph(Graph&&) noexcept = default;
Graph& Graph::operator=(Graph&&) noexcept = default;
void set_allow_tf32(bool) {}
bool allow_tf32() { return false; }
void set_deterministic(bool) {}
bool deterministic() { return false; }

}  // namespace unetcu::cuda
