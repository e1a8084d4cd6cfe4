// A training step at a fixed shape takes no memory from the system after its first runs: every
// tensor of the step comes back from the allocator's cache (what a captured CUDA graph needs,
// and what keeps the system's allocator out of the steady state). tests/cuda/test_cuda_steady.cpp
// holds the same on a GPU.
#include <doctest/doctest.h>

#include "engine/tape.h"
#include "runtime/allocator.h"
#include "steady_alloc.h"
#include "testing.h"
#include "train/inference.h"
#include "small_models.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

UNetConfig small_model() { return small_unet(4); }

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
    SingleDeviceStrategy s(cfg, {}, optimizer_factory({}), LossKind::BCEDice);
    CHECK(host_system_allocations() > start);  // the counter counts
    CHECK(system_allocations_after_warmup(s, b, 2, 3, host_system_allocations) == 0);
  }
}

TEST_CASE("after the first batch prediction at a fixed shape takes no host memory from the system") {
  // Prediction frees each activation as soon as the next layer has read it, so the most ever
  // held in tensors is a fraction of what one forward pass allocates in all: the cache must
  // keep more than that peak, or the blocks freed last in a pass go back to the system and the
  // next pass takes them again (and on the CPU the system hands them out as fresh pages,
  // faulted in on first touch: at 512², batch 4, a fifth of the time). The real model at
  // 512², batch 2: a peak of about 280 MB, above the cache's 256 MB floor (so the floor alone
  // cannot make it pass). With the old bound (the cache alone within the peak) two blocks a
  // pass came from the system.
  UNetConfig cfg;
  cfg.seed = 4;
  UNet model(cfg);
  model.eval();
  Rng rng(5);
  const Tensor x = testing::random_tensor({2, 3, 512, 512}, rng, -1, 1, DType::F32);
  HostAllocator::release_cache();
  HostAllocator::reset_peak();  // the bound this case holds is its own, not an earlier case's
  predict_logits(model, x);
  REQUIRE(HostAllocator::stats().peak_bytes > (size_t(256) << 20));  // above the cache's floor
  const size_t before = host_system_allocations();
  for (int i = 0; i < 2; ++i) predict_logits(model, x);
  CHECK(host_system_allocations() - before == 0);
}
