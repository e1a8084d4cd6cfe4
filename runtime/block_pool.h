// The bookkeeping of a caching allocator whose blocks are read and written by asynchronous
// streams: the device allocator and the pinned host allocator of the CUDA runtime are each a
// BlockPool over a BlockBackend that talks to CUDA (runtime/cuda/runtime.cu). Plain C++ with
// no CUDA types, so the reuse rule is tested on the CPU with a fake backend
// (tests/test_allocator.cpp).
//
// The reuse rule. A live block remembers the streams that use it: the one it was allocated
// for and those added by record_use() (a copy or a collective on another stream). free()
// records an event on each of them. A cached block is handed out for work on stream S only
// when every one of its events has completed (queried, never waited for), except an event
// recorded on S itself: work queued on S after the reuse runs after it anyway. The host is no
// stream: a block for the host (pinned memory the CPU writes at once) waits for every event.
// Only when the backend is out of memory does the pool give cached blocks back (first those
// whose events have completed, then, waiting for the others, the rest) and try again.
#pragma once
#include <cstddef>
#include <map>
#include <mutex>
#include <vector>

#include "runtime/allocator.h"

namespace unetcu {

// A stream as the pool sees it: the device it belongs to and an opaque handle (a cudaStream_t).
// StreamRef{} is the host.
struct StreamRef {
  int device = -1;
  const void* handle = nullptr;
  bool is_host() const { return handle == nullptr; }
  bool operator==(const StreamRef& o) const { return device == o.device && handle == o.handle; }
  bool operator!=(const StreamRef& o) const { return !(*this == o); }
};

// What a BlockPool needs from the memory it manages and from the streams that use it.
class BlockBackend {
 public:
  virtual ~BlockBackend() = default;
  virtual void* allocate(size_t bytes) = 0;                     // nullptr when out of memory
  virtual void deallocate(void* ptr, size_t bytes) noexcept = 0;
  // A new event marking the work queued on `stream` so far; nullptr when none can be recorded
  // (the pool then gives the block back instead of caching it).
  virtual void* record(StreamRef stream) noexcept = 0;
  virtual bool completed(void* event) = 0;                      // never blocks
  virtual void wait(void* event) = 0;                           // blocks the host until done
  virtual void release(void* event) noexcept = 0;               // the event is no longer needed
};

class BlockPool {
 public:
  explicit BlockPool(BlockBackend& backend) : backend_(backend) {}
  ~BlockPool();  // gives every block back (tests; the runtime's pools are never destroyed)
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // Sizes blocks are made in: 512-byte steps up to 1 MiB, then 1/16 of the power of two, so
  // that nearly equal sizes share blocks with at most ~6% waste.
  static size_t round_size(size_t bytes);

  // A block of at least `bytes` for work on `stream` (StreamRef{}: the host). *capacity
  // receives its size. A cached block up to 1/8 larger may be handed out. Out of memory: with
  // `release_on_oom` cached blocks are given back and the allocation is tried again; returns
  // nullptr when it still fails (the caller reports it, naming the device). A block that is not
  // `counted` stays out of current_bytes and peak_bytes while in use (a one-off scratch buffer
  // that would otherwise make the peak say more about the first step than about training).
  void* allocate(size_t bytes, StreamRef stream, size_t* capacity, bool release_on_oom = true,
                 bool counted = true);
  // The live block containing `ptr` (anywhere inside it: tensor views have offsets) is also used
  // by work queued on `stream`. Pointers the pool does not hold are ignored.
  void record_use(const void* ptr, StreamRef stream);
  // Caches a live block, with an event on every stream that used it. Pointers the pool does not
  // hold are ignored.
  void free(void* ptr) noexcept;
  // `stream` is about to be destroyed, its work all done: live blocks stop listing it, so no
  // event is ever recorded on a destroyed stream's handle.
  void forget_stream(StreamRef stream);

  AllocatorStats stats();
  void reset_peak();
  // Gives every cached block back to the backend, waiting for its events first.
  void release_cache();

  // Private pools, for capturing work into a CUDA graph. A graph replays its kernels on the
  // addresses they had when captured, so the blocks the captured work used must stay the
  // graph's for as long as it exists, and the capture must not query or record events.
  //  - open_private(streams): from now on allocations for those streams (every stream a
  //    capture spans on this device) come from a new private pool (its own cache, else the
  //    backend; no event is queried, no memory is given back when short). Blocks of the main
  //    cache are not handed out to it, and frees of other blocks are held back, their events
  //    recorded only at close_private(). Returns the pool's id (> 0). One pool is open at a
  //    time.
  //  - A private block, when freed, goes back to its pool's cache without events, never to the
  //    main cache: replays keep writing there. Inside the capture it is handed out again only
  //    for the one stream that used it: the captured work runs in that stream's order, while
  //    two streams' work is ordered only where an event joins them, so a block another stream
  //    used stays unused until the graph is gone.
  //  - close_private(): allocations take the main path again; the held-back frees happen.
  //  - release_private(id): the graph is gone and its work done: the pool's cached blocks go back
  //    to the backend; its live blocks, when freed later, go to the main cache as any block.
  // A private pool's cached blocks count in cached_bytes (memory held for a graph) but are not
  // given back by release_cache(); they also count in peak_bytes beside current_bytes, since
  // every replay of the graph writes them (after reset_peak, an epoch of replays would
  // otherwise report only the memory outside its graph). Only the device pools take private
  // pools; the pinned pool is told of captures with begin_capture/end_capture below.
  int open_private(const std::vector<StreamRef>& streams);
  int open_private(StreamRef stream) { return open_private(std::vector<StreamRef>{stream}); }
  void close_private();
  void release_private(int id);

  // Captures seen by a pool that keeps no private pool for them (the pinned pool: its blocks
  // are the host's). While `streams` are being captured, a freed block that one of them used
  // is held back: an event recorded on a capturing stream would be a node of the graph (a
  // later query of it fails: cudaErrorCapturedEvent), and the graph's replays read or write
  // the block's address (an upload from it, a copy into it). It stays held until every capture
  // it was used under is released: release_capture(id), once that capture's graph is gone (or
  // at once, for a capture abandoned), frees it with its events. Captures on several devices at
  // once nest: a stream counts once per begin_capture. end_capture(id): the capture has ended
  // (its streams take work again); its held blocks wait for release_capture(id).
  int begin_capture(const std::vector<StreamRef>& streams);
  void end_capture(int id);
  void release_capture(int id);
  size_t capture_held_blocks();  // for tests

  // For tests: cached blocks and the events they still wait for.
  size_t cached_blocks();
  size_t pending_events();

 private:
  struct Pending {
    StreamRef stream;
    void* event;
  };
  struct Live {
    size_t capacity;
    bool counted;
    std::vector<StreamRef> uses;  // the allocating stream first (none for the host), no repeats
    int pool = 0;                 // the private pool it belongs to; 0: the main one
  };
  struct Cached {
    char* ptr;
    std::vector<Pending> pending;
    std::vector<StreamRef> uses;  // a private pool's block: the streams that used it
  };
  using CachedMap = std::multimap<size_t, Cached>;  // capacity -> block

  struct Private {
    CachedMap cached;  // no events: its blocks are reused only in one stream's order
    bool released = false;
  };

  bool ready_for(Cached& block, StreamRef stream);  // drops the events that have completed
  void free_locked(char* ptr, Live live) noexcept;
  void take(CachedMap::iterator it, size_t* capacity);
  void give_back(CachedMap::iterator it);
  bool release_ready_locked();
  void release_all_locked();

  BlockBackend& backend_;
  std::mutex mu_;
  std::map<char*, Live> live_;  // by address, so an interior pointer finds its block
  CachedMap cached_;
  AllocatorStats stats_;
  std::map<int, Private> private_;
  int open_ = 0, next_private_ = 1;
  std::vector<StreamRef> open_streams_;
  size_t graph_bytes_ = 0;  // in the caches of private pools not yet released
  std::vector<std::pair<char*, Live>> held_frees_;  // main blocks freed while a pool is open
  struct Capture {
    std::vector<StreamRef> streams;
    bool ended = false;
  };
  std::map<int, Capture> captures_;  // begin_capture's, until release_capture
  int next_capture_ = 1;
  struct Held {
    char* ptr;
    Live live;
    std::vector<int> captures;  // the captures it was used under, not yet released
  };
  std::vector<Held> capture_held_;  // freed while a stream they used was captured
  std::vector<int> captures_using(const Live& live) const;  // running captures of its streams
};

}  // namespace unetcu
