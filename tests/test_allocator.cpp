// The caching allocator's reuse rule across streams (runtime/block_pool.h), on the CPU: a fake
// backend hands out host memory and events whose completion the test decides, so every case
// of the rule is shown without a GPU. The CUDA runtime's device and pinned pools are the same
// BlockPool over a backend of CUDA events.
#include <doctest/doctest.h>

#include <cstdlib>
#include <set>
#include <vector>

#include "runtime/block_pool.h"
#include "runtime/common.h"

using namespace unetcu;

namespace {

struct FakeEvent {
  StreamRef stream;
  bool done = false;
  bool released = false;
  bool captured = false;  // recorded while its stream was being captured into a graph
};

// Memory from malloc (up to `limit` bytes at once), events the test completes by hand.
struct FakeBackend : BlockBackend {
  size_t limit = size_t(1) << 40;
  size_t in_use = 0;
  int allocations = 0, deallocations = 0, waits = 0;
  bool fail_records = false;
  std::vector<FakeEvent*> events;
  std::set<const void*> capturing;  // streams being captured: an event recorded there is a node

  ~FakeBackend() override {
    for (FakeEvent* e : events) delete e;
  }
  void* allocate(size_t bytes) override {
    if (in_use + bytes > limit) return nullptr;
    in_use += bytes;
    ++allocations;
    return std::malloc(bytes);
  }
  void deallocate(void* p, size_t bytes) noexcept override {
    in_use -= bytes;
    ++deallocations;
    std::free(p);
  }
  void* record(StreamRef s) noexcept override {
    if (fail_records) return nullptr;
    events.push_back(new FakeEvent{s});
    events.back()->captured = capturing.count(s.handle) > 0;
    return events.back();
  }
  bool completed(void* e) override {
    REQUIRE_FALSE(static_cast<FakeEvent*>(e)->released);
    // CUDA refuses the query of an event recorded inside a capture (cudaErrorCapturedEvent).
    REQUIRE_FALSE(static_cast<FakeEvent*>(e)->captured);
    return static_cast<FakeEvent*>(e)->done;
  }
  void wait(void* e) override {
    ++waits;
    static_cast<FakeEvent*>(e)->done = true;  // the host waited until the stream got there
  }
  void release(void* e) noexcept override { static_cast<FakeEvent*>(e)->released = true; }

  // Completes every event recorded on `s` so far (the stream has reached them).
  void reach(StreamRef s) {
    for (FakeEvent* e : events)
      if (e->stream == s) e->done = true;
  }
  int pending_on(StreamRef s) const {
    int n = 0;
    for (FakeEvent* e : events) n += e->stream == s && !e->done && !e->released;
    return n;
  }
};

int g_stream_tags[4];
const StreamRef kA{0, &g_stream_tags[0]}, kB{0, &g_stream_tags[1]}, kPeer{1, &g_stream_tags[2]};
const StreamRef kC{0, &g_stream_tags[3]};
const StreamRef kHost{};

// A pool over a fresh fake backend, and the capacity each allocation reports.
struct Pool {
  FakeBackend be;
  BlockPool pool{be};
  size_t cap = 0;
};

}  // namespace

TEST_CASE_FIXTURE(Pool, "a block freed on its own stream is reused at once by that stream (stream order)") {
  void* p = pool.allocate(1000, kA, &cap);
  REQUIRE(p);
  CHECK(cap == BlockPool::round_size(1000));
  pool.free(p);
  CHECK(pool.pending_events() == 1);  // an event on A, not completed
  size_t cap2 = 0;
  CHECK(pool.allocate(1000, kA, &cap2) == p);
  CHECK(be.allocations == 1);
}

TEST_CASE_FIXTURE(Pool, "a block is not handed to another stream or the host while its event is pending") {
  void* p = pool.allocate(4096, kA, &cap);
  pool.free(p);
  size_t c2 = 0, c3 = 0;
  void* on_b = pool.allocate(4096, kB, &c2);
  CHECK(on_b != p);  // A may still be using p
  void* on_host = pool.allocate(4096, kHost, &c3);
  CHECK(on_host != p);
  CHECK(be.allocations == 3);
  CHECK(be.waits == 0);  // queried, never waited for
  // Once A has got past the free, the block serves anyone.
  be.reach(kA);
  size_t c4 = 0;
  CHECK(pool.allocate(4096, kB, &c4) == p);
  CHECK(pool.pending_events() == 0);
}

TEST_CASE_FIXTURE(Pool, "record_use: a block used on a second stream waits for that stream too") {
  char* p = static_cast<char*>(pool.allocate(size_t(3) << 20, kA, &cap));
  pool.record_use(p + 12345, kB);  // a view inside the block, read by a copy on B
  pool.record_use(p + 12345, kB);  // recorded once
  pool.record_use(p, kPeer);       // and by a stream of another device
  pool.free(p);
  CHECK(pool.pending_events() == 3);
  size_t c = 0;
  // A's own event does not hold A back, but B's and the peer's do.
  void* q = pool.allocate(size_t(3) << 20, kA, &c);
  CHECK(q != p);
  pool.free(q);
  be.reach(kB);
  void* r = pool.allocate(size_t(3) << 20, kA, &c);
  CHECK(r != p);
  pool.free(r);
  be.reach(kPeer);
  CHECK(pool.allocate(size_t(3) << 20, kA, &c) == p);
  // A pointer the pool does not hold is ignored.
  int elsewhere = 0;
  pool.record_use(&elsewhere, kB);
  pool.free(&elsewhere);
}

TEST_CASE_FIXTURE(Pool, "a destroyed stream is forgotten: no event is recorded on it later") {
  size_t c = 0;
  void* on_b = pool.allocate(2048, kB, &c);
  void* on_a = pool.allocate(2048, kA, &c);
  pool.record_use(on_a, kB);
  pool.forget_stream(kB);  // B synchronised and destroyed
  pool.free(on_a);
  pool.free(on_b);
  CHECK(pool.pending_events() == 1);  // only A's, for on_a
  for (FakeEvent* e : be.events) CHECK(e->stream != kB);
  void* host = pool.allocate(2048, kHost, &c);
  CHECK(host == on_b);  // nothing of B's is pending
}

TEST_CASE_FIXTURE(Pool, "a stream destroyed while a capture holds frees back is forgotten there too") {
  size_t c = 0;
  void* on_a = pool.allocate(2048, kA, &c);
  pool.record_use(on_a, kB);
  pool.open_private(kA);
  pool.free(on_a);  // main pool, held back until the capture closes
  CHECK(be.events.empty());
  pool.forget_stream(kB);  // B synchronised and destroyed meanwhile
  pool.close_private();
  CHECK(pool.pending_events() == 1);  // only A's
  for (FakeEvent* e : be.events) CHECK(e->stream != kB);
}

TEST_CASE_FIXTURE(Pool, "the peak counts the blocks a captured graph keeps for its replays") {
  size_t act = 0, out = 0;
  const int id = pool.open_private(kA);
  void* activation = pool.allocate(1 << 20, kA, &act);  // made and freed inside the capture
  void* result = pool.allocate(1 << 16, kA, &out);      // still alive after it
  pool.free(activation);
  pool.close_private();
  pool.reset_peak();  // a new epoch of replays: they write both blocks
  CHECK(pool.stats().current_bytes == out);
  CHECK(pool.stats().peak_bytes == act + out);
  size_t c = 0;
  void* eager = pool.allocate(1 << 10, kB, &c);
  CHECK(pool.stats().peak_bytes == act + out + c);
  pool.free(eager);
  pool.free(result);
  pool.release_private(id);  // the graph is gone
  pool.reset_peak();
  CHECK(pool.stats().peak_bytes == 0);
}

TEST_CASE_FIXTURE(Pool, "pinned-style host blocks: reused only after the asynchronous copy's event") {
  void* batch = pool.allocate(1 << 16, kHost, &cap);
  pool.free(batch);  // no stream used it: reusable at once
  CHECK(pool.pending_events() == 0);
  size_t c = 0;
  batch = pool.allocate(1 << 16, kHost, &c);
  CHECK(be.allocations == 1);
  pool.record_use(batch, kA);  // an upload from it on A
  pool.free(batch);
  void* next = pool.allocate(1 << 16, kHost, &c);
  CHECK(next != batch);  // the host would overwrite bytes the copy still reads
  be.reach(kA);
  pool.free(next);
  CHECK(pool.allocate(1 << 16, kHost, &c) == batch);
}

TEST_CASE_FIXTURE(Pool, "pinned-style host blocks freed during a capture: held until its graph is gone") {
  size_t c = 0;
  void* batch = pool.allocate(1 << 16, kHost, &c);
  void* other = pool.allocate(1 << 16, kHost, &c);
  pool.record_use(batch, kA);  // an upload from it on A
  pool.record_use(other, kB);  // and from the other on B, which no capture spans
  be.capturing.insert(kA.handle);
  const int capture = pool.begin_capture({kA});
  pool.free(batch);  // an event now would be recorded inside A's capture
  pool.free(other);  // B is not captured: cached with its event as usual
  CHECK(pool.capture_held_blocks() == 1);
  CHECK(be.events.size() == 1);  // B's only
  be.reach(kB);
  CHECK(pool.allocate(1 << 16, kHost, &c) == other);  // queries B's event, never one on A
  void* fresh = pool.allocate(1 << 16, kHost, &c);
  CHECK(fresh != batch);  // held, not handed out
  be.capturing.erase(kA.handle);
  pool.end_capture(capture);
  // The capture has ended, its graph lives: replays read the block's address.
  CHECK(pool.capture_held_blocks() == 1);
  CHECK(be.pending_on(kA) == 0);
  pool.free(fresh);
  CHECK(pool.allocate(1 << 16, kHost, &c) == fresh);  // a block the capture did not use: as usual
  pool.release_capture(capture);  // the graph is gone
  CHECK(pool.capture_held_blocks() == 0);
  CHECK(be.pending_on(kA) == 1);  // its event, recorded now
  be.reach(kA);
  CHECK(pool.allocate(1 << 16, kHost, &c) == batch);
}

TEST_CASE_FIXTURE(Pool, "captures on two devices at once: a block both used waits for both graphs") {
  size_t c = 0;
  void* batch = pool.allocate(1 << 16, kHost, &c);
  pool.record_use(batch, kA);
  pool.record_use(batch, kPeer);
  be.capturing = {kA.handle, kPeer.handle};
  const int first = pool.begin_capture({kA});
  const int second = pool.begin_capture({kPeer});
  pool.free(batch);
  be.capturing.clear();
  pool.end_capture(first);
  pool.end_capture(second);
  pool.release_capture(first);
  CHECK(pool.capture_held_blocks() == 1);  // still in the second graph
  CHECK(be.events.empty());
  pool.release_capture(second);
  CHECK(pool.capture_held_blocks() == 0);
  CHECK(be.events.size() == 2);
  // A capture that has ended holds nothing freed after it.
  void* later = pool.allocate(1 << 16, kHost, &c);
  pool.record_use(later, kA);
  const int third = pool.begin_capture({kA});
  pool.end_capture(third);
  pool.free(later);
  CHECK(pool.capture_held_blocks() == 0);
  pool.release_capture(third);
}

TEST_CASE("out of memory: completed blocks are given back first, pending ones only when needed") {
  FakeBackend be;
  be.limit = size_t(3) << 20;
  BlockPool pool(be);
  size_t c = 0;
  void* a = pool.allocate(size_t(1) << 20, kA, &c);
  void* b = pool.allocate(size_t(1) << 20, kB, &c);
  pool.free(a);
  pool.free(b);
  be.reach(kA);  // a is idle, b is still in use on B
  // 2 MiB do not fit beside the two cached MiB: a is given back, b stays, no wait.
  void* big = pool.allocate(size_t(2) << 20, kA, &c);
  CHECK(big);
  CHECK(be.deallocations == 1);
  CHECK(be.waits == 0);
  CHECK(pool.cached_blocks() == 1);
  // Nothing idle is left: the pool waits for B and gives b back.
  void* more = pool.allocate(size_t(1) << 20, kA, &c, /*release_on_oom=*/false);
  CHECK(more == nullptr);  // the caller asked for no release
  CHECK(be.waits == 0);
  more = pool.allocate(size_t(1) << 20, kA, &c);
  CHECK(more);
  CHECK(be.waits == 1);
  CHECK(be.pending_on(kB) == 0);
  // Nothing cached and the backend full: nullptr, for the caller to report.
  CHECK(pool.allocate(size_t(1) << 20, kA, &c) == nullptr);
  pool.free(big);
  pool.free(more);
}

TEST_CASE_FIXTURE(Pool, "a block whose event cannot be recorded is given back, not cached") {
  size_t c = 0;
  void* p = pool.allocate(1000, kA, &c);
  be.fail_records = true;
  pool.free(p);
  CHECK(pool.cached_blocks() == 0);
  CHECK(be.deallocations == 1);
  CHECK(pool.stats().current_bytes == 0);
  CHECK(pool.stats().cached_bytes == 0);
}

TEST_CASE_FIXTURE(Pool, "allocator statistics (bytes in use, peak, cached), sizes rounded and matched within 1/8") {
  CHECK(BlockPool::round_size(0) == 512);
  CHECK(BlockPool::round_size(513) == 1024);
  CHECK(BlockPool::round_size((size_t(1) << 20) + 1) == (size_t(1) << 20) + (size_t(1) << 16));
  CHECK_THROWS_AS(BlockPool::round_size(size_t(1) << 50), Error);
  size_t c1 = 0, c2 = 0;
  void* p = pool.allocate(size_t(8) << 20, kA, &c1);
  void* q = pool.allocate(100, kA, &c2);
  CHECK(pool.stats().current_bytes == c1 + c2);
  pool.free(p);
  CHECK(pool.stats().current_bytes == c2);
  CHECK(pool.stats().cached_bytes == c1);
  CHECK(pool.stats().peak_bytes == c1 + c2);
  size_t c3 = 0;
  // A request up to 1/8 below a cached block takes it (7.5 MiB + 1/8 > 8 MiB); half does not.
  void* r = pool.allocate((size_t(15) << 20) / 2, kA, &c3);
  CHECK(r == p);
  CHECK(c3 == c1);
  void* s = pool.allocate(size_t(4) << 20, kA, &c3);
  CHECK(s != p);
  pool.free(r);
  pool.free(s);
  pool.free(q);
  pool.reset_peak();
  CHECK(pool.stats().peak_bytes == 0);
  // An uncounted block (the algorithm search's workspace) stays out of current and peak bytes,
  // but is cached like any other once freed.
  size_t c5 = 0;
  void* scratch = pool.allocate(size_t(64) << 20, kA, &c5, true, /*counted=*/false);
  CHECK(pool.stats().current_bytes == 0);
  CHECK(pool.stats().peak_bytes == 0);
  pool.free(scratch);
  CHECK(pool.stats().current_bytes == 0);
  CHECK(pool.stats().cached_bytes == c1 + c2 + c3 + c5);
  pool.release_cache();
  CHECK(pool.stats().cached_bytes == 0);
  CHECK(be.in_use == 0);
}

TEST_CASE_FIXTURE(Pool, "a private pool (graph capture) keeps its blocks and touches no event while open") {
  // A main-cache block, freed on A before the capture: not for the capture.
  void* before = pool.allocate(4096, kA, &cap);
  pool.free(before);
  const size_t events_before = be.events.size();
  void* kept = pool.allocate(8192, kA, &cap);  // a tensor that lives through the capture
  const int id = pool.open_private(kA);
  CHECK(id > 0);
  CHECK_THROWS_AS(pool.open_private(kA), Error);  // one at a time
  const int allocs = be.allocations;
  void* t1 = pool.allocate(4096, kA, &cap);
  CHECK(t1 != before);                 // the main cache is not handed to the capture
  CHECK(be.allocations == allocs + 1);  // new memory
  pool.free(t1);                       // back to the private cache, no event
  void* t2 = pool.allocate(4096, kA, &cap);
  CHECK(t2 == t1);                     // reused within the capture (stream order)
  void* out = pool.allocate(1024, kA, &cap);  // an output the graph leaves alive (a gradient)
  pool.free(kept);                     // a main block freed during the capture: held back
  pool.free(t2);
  CHECK(be.events.size() == events_before);  // nothing recorded while open
  // Another stream (a copy stream, the host) still uses the main cache while the pool is open.
  void* other = pool.allocate(4096, kB, &cap);
  CHECK(other != t1);
  pool.free(other);
  pool.close_private();
  CHECK(be.events.size() > events_before);  // the held-back frees now record their events
  // After the capture the graph's temporaries stay its own: the main path never gets them.
  be.reach(kA);
  be.reach(kB);
  std::set<void*> handed;
  for (int i = 0; i < 4; ++i) handed.insert(pool.allocate(4096, kA, &cap));
  CHECK(handed.count(t1) == 0);
  CHECK(handed.count(kept) == 0);  // 8192 bytes: not a 4096 match, but freed to the main cache
  for (void* p : handed) pool.free(p);
  // Released (the graph destroyed): its cached blocks go back to the backend; its live output
  // becomes an ordinary block when freed.
  const int deallocs = be.deallocations;
  pool.release_private(id);
  CHECK(be.deallocations == deallocs + 1);  // t1's block
  pool.free(out);
  be.reach(kA);
  void* again = pool.allocate(1024, kA, &cap);
  CHECK(again == out);  // through the main cache now
  pool.free(again);
}

TEST_CASE("a private pool short of memory fails without giving anything back") {
  FakeBackend be;
  be.limit = 8192;
  BlockPool pool(be);
  size_t cap = 0;
  void* a = pool.allocate(4096, kA, &cap);
  pool.free(a);  // cached on the main path, its event not completed
  pool.open_private(kA);
  void* b = pool.allocate(4096, kA, &cap);
  REQUIRE(b != nullptr);
  CHECK(pool.allocate(4096, kA, &cap) == nullptr);  // no release (it would query and free)
  CHECK(be.waits == 0);
  pool.free(b);
  pool.close_private();
}

TEST_CASE_FIXTURE(
    Pool, "a private pool over two streams (a pipeline's capture) reuses a block only on the stream that used it") {
  pool.open_private({kA, kB});
  const size_t events_before = be.events.size();
  void* a = pool.allocate(4096, kA, &cap);  // used on A only
  void* ab = pool.allocate(4096, kA, &cap);  // made on A, read by B (a stage's output, copied)
  pool.record_use(ab, kB);
  void* b = pool.allocate(4096, kB, &cap);  // made on B
  pool.free(a);
  pool.free(ab);
  pool.free(b);
  CHECK(be.events.size() == events_before);  // no event inside the capture
  // B's work is ordered after A's only where an event joins them: A's block is not for B.
  void* for_b = pool.allocate(4096, kB, &cap);
  CHECK(for_b == b);
  void* for_a = pool.allocate(4096, kA, &cap);
  CHECK(for_a == a);
  // The block both streams used: for neither, new memory instead.
  const int allocs = be.allocations;
  void* more_a = pool.allocate(4096, kA, &cap);
  void* more_b = pool.allocate(4096, kB, &cap);
  CHECK(more_a != ab);
  CHECK(more_b != ab);
  CHECK(be.allocations == allocs + 2);
  // A stream outside the capture takes the main path: the private cache is not for it.
  pool.free(for_a);  // in the private cache again, used by A alone
  void* other = pool.allocate(4096, kC, &cap);
  CHECK(other != a);
  CHECK(other != ab);
  for (void* p : {for_b, more_a, more_b, other}) pool.free(p);
  pool.close_private();
  CHECK_THROWS_AS(pool.open_private(std::vector<StreamRef>{}), Error);
  CHECK_THROWS_AS(pool.open_private({kA, StreamRef{}}), Error);  // the host is no stream
}
