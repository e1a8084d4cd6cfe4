// Shared by the benchmarks: one-device training steps timed after a warm-up.
#pragma once
#include <algorithm>
#include <chrono>
#include <vector>

#include "engine/data.h"
#include "engine/optim.h"
#include "engine/tape.h"
#include "models/unet.h"

namespace unetcu::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of each of `steps` training steps (forward, BCE+Dice, backward, Adam) of a fresh
// model on one device, after `warmup` untimed ones, with the calling thread's thread budget.
inline std::vector<double> time_single_device_steps(const UNetConfig& cfg, const Batch& b,
                                                    int warmup, int steps) {
  UNet model(cfg);
  Adam opt(model.parameters());
  std::vector<double> times;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    Tape tape;
    {
      TapeScope scope(tape);
      Tensor loss = segmentation_loss(LossKind::BCEDice, model.forward(b.images), b.masks);
      opt.zero_grad();
      tape.backward(loss);
    }
    opt.step();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= warmup) times.push_back(dt);
  }
  return times;
}

}  // namespace unetcu::bench
