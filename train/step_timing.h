// Training steps of any strategy (train/strategy.h), timed after a warm-up, on a batch placed
// once: for the benchmarks of bench/ and unet_bench (apps/), which may not include each other.
#pragma once
#include <algorithm>
#include <chrono>
#include <vector>

#include "data/synthetic.h"
#include "train/strategy.h"

namespace unetcu::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of each of `steps` training steps of `strategy` on `host` (placed on its devices
// once), after `warmup` untimed ones.
inline std::vector<double> time_steps(TrainingStrategy& strategy, const Batch& host, int warmup,
                                      int steps) {
  const PlacedBatch batch = strategy.place(host);
  std::vector<double> times;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    strategy.step(batch);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= warmup) times.push_back(dt);
  }
  return times;
}

// A fresh model on one device (Adam, BCE+Dice), with the calling thread's thread budget.
inline std::vector<double> time_single_device_steps(const UNetConfig& cfg, const Batch& b,
                                                    int warmup, int steps) {
  SingleDeviceStrategy strategy(cfg, {}, optimizer_factory({}), LossKind::BCEDice);
  return time_steps(strategy, b, warmup, steps);
}

}  // namespace unetcu::bench
