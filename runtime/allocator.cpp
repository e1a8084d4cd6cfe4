#include "runtime/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>

#include "runtime/common.h"

namespace unetcu {
namespace {

constexpr int kMaxCpuDevices = 64;

struct State {
  std::mutex mu;
  std::multimap<size_t, void*> free_blocks;  // capacity -> block
  AllocatorStats stats;
  AllocatorStats devices[kMaxCpuDevices];  // current and peak bytes in each device's tensors
};

std::atomic<size_t> g_limit{0};

int slot(int device) { return device >= 0 && device < kMaxCpuDevices ? device : 0; }

thread_local int t_host_data = 0;

// Counts a block taken for `device`'s tensors (-1: host data, no device's; the lock held).
void count_in(State& s, int device, size_t capacity) {
  s.stats.current_bytes += capacity;
  if (s.stats.current_bytes > s.stats.peak_bytes) s.stats.peak_bytes = s.stats.current_bytes;
  if (device < 0) return;
  AllocatorStats& d = s.devices[slot(device)];
  d.current_bytes += capacity;
  if (d.current_bytes > d.peak_bytes) d.peak_bytes = d.current_bytes;
}

State& state() {
  static State* s = new State();  // never destroyed: tensors may be freed during exit
  return *s;
}

// Small blocks round to 64 bytes, large ones to 1/16 of their power of two, so that nearly
// equal sizes share blocks without wasting more than ~6%.
size_t round_size(size_t bytes) {
  // No machine has this much memory; refusing here keeps the rounding below from wrapping.
  UNETCU_CHECK(bytes <= (size_t(1) << 48), "out of host memory: ", bytes, " bytes requested");
  if (bytes <= 4096) return (bytes + 63) / 64 * 64;
  size_t p = 4096;
  while (p * 2 <= bytes) p *= 2;
  const size_t step = p / 16;
  return (bytes + step - 1) / step * step;
}

}  // namespace

void* HostAllocator::allocate(size_t bytes, size_t* capacity, int device) {
  const size_t want = round_size(bytes ? bytes : 1);
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const size_t limit = device < 0 ? 0 : g_limit.load();
    const size_t held = device < 0 ? 0 : s.devices[slot(device)].current_bytes;
    if (limit && held + want > limit)
      throw Error(str_cat("out of memory on cpu:", device, ": allocating ", bytes, " bytes with ",
                          held, " bytes in its tensors needs ", held + want,
                          " bytes, over the limit of ", limit, " bytes",
                          memory_limit_note()));
    auto it = s.free_blocks.lower_bound(want);
    if (it != s.free_blocks.end() && it->first <= want + want / 8) {
      void* p = it->second;
      *capacity = it->first;
      s.stats.cached_bytes -= it->first;
      s.free_blocks.erase(it);
      count_in(s, device, *capacity);
      return p;
    }
  }
  void* p = std::aligned_alloc(64, want);
  if (!p) {
    release_cache();
    p = std::aligned_alloc(64, want);
  }
  if (!p) throw Error(str_cat("out of host memory allocating ", bytes, " bytes"));
  *capacity = want;
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.stats.system_allocations;
  count_in(s, device, want);
  return p;
}

void HostAllocator::free(void* ptr, size_t capacity, int device) {
  if (!ptr) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.current_bytes -= capacity;
  if (device >= 0) s.devices[slot(device)].current_bytes -= capacity;
  // Blocks in tensors and in the cache together stay within twice what the busiest moment
  // ever needed in tensors (at least a floor), so sizes that stop recurring cannot pile up
  // without bound. Twice: an evaluation pass at 512², batch 4, held 457 MB at most but needed
  // 628 MB of cached blocks to take nothing from the system in the next pass (with the cache
  // alone bounded by the peak, the blocks freed last went back to the system every pass and
  // came back as fresh pages). Since tensors never hold more than the peak, the cache may
  // always hold at least that much.
  const size_t limit = std::max<size_t>(2 * s.stats.peak_bytes, size_t(256) << 20);
  if (s.stats.current_bytes + s.stats.cached_bytes + capacity > limit) {
    std::free(ptr);
    return;
  }
  s.free_blocks.emplace(capacity, ptr);
  s.stats.cached_bytes += capacity;
}

AllocatorStats HostAllocator::stats() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.stats;
}

AllocatorStats HostAllocator::device_stats(int device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.devices[slot(device)];
}

void HostAllocator::reset_peak() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.peak_bytes = s.stats.current_bytes;
  for (AllocatorStats& d : s.devices) d.peak_bytes = d.current_bytes;
}

std::mutex g_source_mu;
std::string g_source;

void set_memory_limit(size_t bytes, const std::string& source) {
  {
    std::lock_guard<std::mutex> lock(g_source_mu);
    g_source = source;
  }
  g_limit = bytes;
}

std::string memory_limit_source() {
  std::lock_guard<std::mutex> lock(g_source_mu);
  return g_source;
}

std::string memory_limit_note() {
  const std::string s = memory_limit_source();
  return s.empty() ? s : " (" + s + ")";
}

HostDataScope::HostDataScope() { ++t_host_data; }
HostDataScope::~HostDataScope() { --t_host_data; }
bool HostDataScope::active() { return t_host_data > 0; }
size_t memory_limit() { return g_limit.load(); }

void HostAllocator::release_cache() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& [size, p] : s.free_blocks) std::free(p);
  s.free_blocks.clear();
  s.stats.cached_bytes = 0;
}

}  // namespace unetcu
