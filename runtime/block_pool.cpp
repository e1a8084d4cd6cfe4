#include "runtime/block_pool.h"

#include <algorithm>

#include "runtime/common.h"

namespace unetcu {

BlockPool::~BlockPool() {
  std::lock_guard<std::mutex> lock(mu_);
  release_all_locked();
  for (auto& [id, pool] : private_)
    for (auto& [size, block] : pool.cached) backend_.deallocate(block.ptr, size);
  for (auto& [ptr, live] : held_frees_) backend_.deallocate(ptr, live.capacity);
  for (Held& h : capture_held_) backend_.deallocate(h.ptr, h.live.capacity);
  for (auto& [ptr, live] : live_) backend_.deallocate(ptr, live.capacity);
  live_.clear();
}

size_t BlockPool::round_size(size_t bytes) {
  // No machine has this much memory; refusing here keeps the rounding below from wrapping.
  UNETCU_CHECK(bytes <= (size_t(1) << 48), "out of memory: ", bytes, " bytes requested");
  if (bytes == 0) bytes = 1;
  if (bytes <= (size_t(1) << 20)) return (bytes + 511) / 512 * 512;
  size_t p = size_t(1) << 20;
  while (p * 2 <= bytes) p *= 2;
  const size_t step = p / 16;
  return (bytes + step - 1) / step * step;
}

bool BlockPool::ready_for(Cached& block, StreamRef stream) {
  bool ready = true;
  auto& pending = block.pending;
  for (size_t i = 0; i < pending.size();) {
    // An event on the asking stream itself needs no wait: the stream runs its work in order.
    if (!stream.is_host() && pending[i].stream == stream) {
      ++i;
      continue;
    }
    if (!backend_.completed(pending[i].event)) {
      ready = false;  // still in use there; keep looking at the rest only to prune them
      ++i;
      continue;
    }
    backend_.release(pending[i].event);
    pending[i] = pending.back();
    pending.pop_back();
  }
  return ready;
}

void BlockPool::take(CachedMap::iterator it, size_t* capacity) {
  for (const Pending& p : it->second.pending) backend_.release(p.event);
  *capacity = it->first;
  stats_.cached_bytes -= it->first;
  cached_.erase(it);
}

void BlockPool::give_back(CachedMap::iterator it) {
  for (const Pending& p : it->second.pending) backend_.release(p.event);
  backend_.deallocate(it->second.ptr, it->first);
  stats_.cached_bytes -= it->first;
  cached_.erase(it);
}

// Gives back the cached blocks no stream uses any more; true when there was one.
bool BlockPool::release_ready_locked() {
  bool any = false;
  for (auto it = cached_.begin(); it != cached_.end();) {
    auto next = std::next(it);
    if (ready_for(it->second, StreamRef{})) {
      give_back(it);
      any = true;
    }
    it = next;
  }
  return any;
}

void BlockPool::release_all_locked() {
  for (auto& [size, block] : cached_)
    for (const Pending& p : block.pending) backend_.wait(p.event);
  while (!cached_.empty()) give_back(cached_.begin());
}

void* BlockPool::allocate(size_t bytes, StreamRef stream, size_t* capacity, bool release_on_oom,
                          bool counted) {
  const size_t want = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  char* p = nullptr;
  const int pool = open_ && std::find(open_streams_.begin(), open_streams_.end(), stream) != open_streams_.end()
                       ? open_ : 0;
  if (pool) {  // a capture: the private pool's cache, else new memory; no event is touched
    CachedMap& cache = private_.at(pool).cached;
    auto it = cache.lower_bound(want);
    // Only a block no other stream of the capture used.
    const auto only_here = [&](const Cached& c) {
      for (StreamRef u : c.uses)
        if (u != stream) return false;
      return true;
    };
    while (it != cache.end() && it->first <= want + want / 8 && !only_here(it->second)) ++it;
    if (it != cache.end() && it->first <= want + want / 8) {
      p = it->second.ptr;
      *capacity = it->first;
      stats_.cached_bytes -= it->first;
      graph_bytes_ -= it->first;
      cache.erase(it);
    } else {
      p = static_cast<char*>(backend_.allocate(want));
      if (!p) return nullptr;
      ++stats_.system_allocations;
      *capacity = want;
    }
  }
  for (auto it = cached_.lower_bound(want); !pool && it != cached_.end() && it->first <= want + want / 8;
       ++it) {
    if (!ready_for(it->second, stream)) continue;
    p = it->second.ptr;
    take(it, capacity);
    break;
  }
  if (!p) {
    p = static_cast<char*>(backend_.allocate(want));
    // Memory is short: give back what no stream uses any more, and only if that is not enough,
    // wait for the rest. Giving memory back may synchronise the device (cudaFree does), so it
    // happens here only, never in the steady state.
    if (!p && release_on_oom && release_ready_locked()) p = static_cast<char*>(backend_.allocate(want));
    if (!p && release_on_oom && !cached_.empty()) {
      release_all_locked();
      p = static_cast<char*>(backend_.allocate(want));
    }
    if (!p) return nullptr;
    ++stats_.system_allocations;
    *capacity = want;
  }
  Live& live = live_[p];
  live.capacity = *capacity;
  live.counted = counted;
  live.pool = pool;
  live.uses.clear();
  if (!stream.is_host()) live.uses.push_back(stream);
  if (counted) {
    stats_.current_bytes += *capacity;
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.current_bytes + graph_bytes_);
  }
  return p;
}

void BlockPool::record_use(const void* ptr, StreamRef stream) {
  if (!ptr || stream.is_host()) return;  // the host's own use is over when its call returns
  const char* c = static_cast<const char*>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.upper_bound(const_cast<char*>(c));
  if (it == live_.begin()) return;
  --it;
  if (c >= it->first + it->second.capacity) return;
  auto& uses = it->second.uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

void BlockPool::free(void* ptr) noexcept {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(static_cast<char*>(ptr));
  if (it == live_.end()) return;
  Live live = std::move(it->second);
  live_.erase(it);
  if (live.counted) stats_.current_bytes -= live.capacity;
  if (live.pool) {
    auto pit = private_.find(live.pool);
    if (pit != private_.end() && !pit->second.released) {
      pit->second.cached.emplace(live.capacity, Cached{static_cast<char*>(ptr), {}, std::move(live.uses)});
      stats_.cached_bytes += live.capacity;
      graph_bytes_ += live.capacity;
      return;
    }
    live.pool = 0;  // its graph is gone: an ordinary block now
  }
  if (open_) {  // no events while a capture may be running: recorded at close_private()
    held_frees_.emplace_back(static_cast<char*>(ptr), std::move(live));
    return;
  }
  if (std::vector<int> ids = captures_using(live); !ids.empty()) {  // until their graphs are gone
    capture_held_.push_back(Held{static_cast<char*>(ptr), std::move(live), std::move(ids)});
    return;
  }
  free_locked(static_cast<char*>(ptr), std::move(live));
}

std::vector<int> BlockPool::captures_using(const Live& live) const {
  std::vector<int> ids;
  for (const auto& [id, c] : captures_) {
    if (c.ended) continue;
    for (StreamRef s : live.uses)
      if (std::find(c.streams.begin(), c.streams.end(), s) != c.streams.end()) {
        ids.push_back(id);
        break;
      }
  }
  return ids;
}

int BlockPool::begin_capture(const std::vector<StreamRef>& streams) {
  std::lock_guard<std::mutex> lock(mu_);
  const int id = next_capture_++;
  captures_[id] = Capture{streams, false};
  return id;
}

void BlockPool::end_capture(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = captures_.find(id);
  if (it != captures_.end()) it->second.ended = true;
}

void BlockPool::release_capture(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  captures_.erase(id);
  std::vector<Held> held = std::move(capture_held_);
  capture_held_.clear();
  for (Held& h : held) {
    h.captures.erase(std::remove(h.captures.begin(), h.captures.end(), id), h.captures.end());
    if (h.captures.empty())
      free_locked(h.ptr, std::move(h.live));
    else
      capture_held_.push_back(std::move(h));
  }
}

size_t BlockPool::capture_held_blocks() {
  std::lock_guard<std::mutex> lock(mu_);
  return capture_held_.size();
}

void BlockPool::free_locked(char* ptr, Live live) noexcept {
  Cached block{ptr, {}, {}};
  for (StreamRef s : live.uses) {
    void* e = backend_.record(s);
    if (!e) {
      // No event, so no way to know when the stream is done with the block: it is not cached.
      // (Giving it back is safe: cudaFree waits for the device.)
      for (const Pending& p : block.pending) backend_.release(p.event);
      backend_.deallocate(ptr, live.capacity);
      return;
    }
    block.pending.push_back({s, e});
  }
  cached_.emplace(live.capacity, std::move(block));
  stats_.cached_bytes += live.capacity;
}

int BlockPool::open_private(const std::vector<StreamRef>& streams) {
  std::lock_guard<std::mutex> lock(mu_);
  UNETCU_CHECK(!open_, "a private pool is already open (one capture at a time per device)");
  UNETCU_CHECK(!streams.empty(), "a private pool belongs to streams");
  for (StreamRef s : streams) UNETCU_CHECK(!s.is_host(), "a private pool belongs to streams, not the host");
  open_ = next_private_++;
  open_streams_ = streams;
  private_[open_];
  return open_;
}

void BlockPool::close_private() {
  std::lock_guard<std::mutex> lock(mu_);
  open_ = 0;
  open_streams_.clear();
  std::vector<std::pair<char*, Live>> held = std::move(held_frees_);
  held_frees_.clear();
  for (auto& [ptr, live] : held) free_locked(ptr, std::move(live));
}

void BlockPool::release_private(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = private_.find(id);
  if (it == private_.end()) return;
  UNETCU_CHECK(id != open_, "release_private of the open pool");
  for (auto& [size, block] : it->second.cached) {
    backend_.deallocate(block.ptr, size);
    stats_.cached_bytes -= size;
    graph_bytes_ -= size;
  }
  it->second.cached.clear();
  bool live = false;
  for (const auto& [ptr, l] : live_) live = live || l.pool == id;
  if (live)
    it->second.released = true;  // its live blocks become ordinary ones when freed
  else
    private_.erase(it);
}

void BlockPool::forget_stream(StreamRef stream) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto forget = [&](Live& live) {
    live.uses.erase(std::remove(live.uses.begin(), live.uses.end(), stream), live.uses.end());
  };
  for (auto& [ptr, live] : live_) forget(live);
  for (auto& [ptr, live] : held_frees_) forget(live);  // their events come at close_private()
  for (Held& h : capture_held_) forget(h.live);  // and at release_capture()
}

AllocatorStats BlockPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void BlockPool::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes = stats_.current_bytes + graph_bytes_;
}

void BlockPool::release_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_all_locked();
}

size_t BlockPool::cached_blocks() {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_.size();
}

size_t BlockPool::pending_events() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (auto& [size, block] : cached_) n += block.pending.size();
  return n;
}

}  // namespace unetcu
