// A training step at a fixed shape takes no memory from the system after its first runs: every
// tensor of the step comes back from the allocator's cache (what a captured CUDA graph needs,
// and what keeps the system's allocator out of the steady state). tests/cuda/test_cuda_steady.cpp
// holds the same on a GPU.
#include <doctest/doctest.h>

#include "runtime/allocator.h"
#include "steady_alloc.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

UNetConfig small_model() {
  UNetConfig c;
  c.width_divisor = 16;
  c.seed = 4;
  return c;
}

size_t host_system_allocations() { return HostAllocator::stats().system_allocations; }

}  // namespace

TEST_CASE("after warm-up a training step on one CPU device takes no host memory from the system") {
  // One thread allocates and frees the same sizes in the same order every step, so from the
  // second step on the cache serves every request. (Replicas or stages on several CPU devices
  // share the one host cache from several threads whose interleaving changes from step to
  // step, and which thread's free feeds which allocation with it: they are not held to this.
  // GPU devices each have a pool of their own.)
  // Float32 NCHW, and mixed precision in channels-last (the weights' bf16 copies, the
  // conversions at the stem and the head are tensors of the step too).
  SyntheticSegmentation data(64, 2);
  const Batch b = data.batch({0, 1, 2, 3});
  for (bool mixed : {false, true}) {
    CAPTURE(mixed);
    UNetConfig cfg = small_model();
    cfg.bf16_activations = mixed;
    cfg.format = mixed ? MemoryFormat::NHWC : MemoryFormat::NCHW;
    HostAllocator::release_cache();  // so building the strategy below must take system memory
    const size_t start = host_system_allocations();
    SingleDevice s(cfg, optimizer_factory({}), LossKind::BCEDice);
    CHECK(host_system_allocations() > start);  // the counter counts
    CHECK(system_allocations_after_warmup(s, b, 2, 3, host_system_allocations) == 0);
  }
}
