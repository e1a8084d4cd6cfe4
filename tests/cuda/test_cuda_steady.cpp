// On a GPU: after warm-up a training step on one GPU takes no device memory from cudaMalloc
// (every block comes back from the device pool). Stages on several streams are not held to it:
// a block freed on one stream is handed to another only once its event has completed, which
// depends on timing. The CPU twin is tests/test_steady_alloc.cpp.
#include <doctest/doctest.h>

#include "runtime/cuda_api.h"
#include "../steady_alloc.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

UNetConfig gpu_model() {
  UNetConfig c;
  c.width_divisor = 16;
  c.seed = 4;
  c.device = Device::cuda(0);
  return c;
}

size_t device_system_allocations() { return cuda::device_memory_stats(0).system_allocations; }

}  // namespace

TEST_CASE("after warm-up a training step takes no GPU memory from the system") {
  SyntheticSegmentation data(64, 2);
  const Batch b = data.batch({0, 1, 2, 3});
  const OptimizerFactory adam = optimizer_factory({});
  SingleDevice s(gpu_model(), adam, LossKind::BCEDice);
  CHECK(system_allocations_after_warmup(s, b, 2, 3, device_system_allocations) == 0);
}
