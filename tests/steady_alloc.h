// Shared by the CPU and CUDA suites: how many blocks a training strategy takes from the system
// (not from its allocator's cache) over `steps` steps after `warmup` steps at a fixed shape.
#pragma once
#include <functional>

#include "data/synthetic.h"
#include "train/strategy.h"

namespace unetcu::testing {

// `system_allocations` reads the counter of the allocator the strategy's tensors come from.
inline size_t system_allocations_after_warmup(TrainingStrategy& strategy, const Batch& host, int warmup,
                                              int steps, const std::function<size_t()>& system_allocations) {
  const PlacedBatch batch = strategy.place(host);
  for (int i = 0; i < warmup; ++i) strategy.step(batch);
  const size_t before = system_allocations();
  for (int i = 0; i < steps; ++i) strategy.step(batch);
  return system_allocations() - before;
}

}  // namespace unetcu::testing
