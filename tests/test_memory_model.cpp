// The memory model (planning/memory_model.h) against the measured peak of training steps on a
// CPU device: a grid of batch sizes and recompute sets, each within 10 %.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "cli/parse.h"
#include "data/synthetic.h"
#include "planning/memory_model.h"
#include "runtime/allocator.h"
#include "train/strategy.h"

using namespace unetcu;

namespace {

Batch batch_of(const SyntheticSegmentation& data, int n) {
  std::vector<int64_t> idx;
  for (int i = 0; i < n; ++i) idx.push_back(i);
  return data.batch(idx);
}

// The most cpu:0's tensors held during the third step of a fresh SingleDevice.
double measured_peak(UNetConfig cfg, const std::vector<bool>& recompute, const Batch& b) {
  cfg.recompute = recompute;
  SingleDevice s(cfg, optimizer_factory({OptimizerKind::Adam, 1e-3, 0.9, 0}), LossKind::BCEDice);
  s.step(s.place(b));
  s.step(s.place(b));
  const PlacedBatch placed = s.place(b);
  HostAllocator::reset_peak();
  s.step(placed);
  return double(HostAllocator::device_stats(0).peak_bytes);
}

}  // namespace

TEST_CASE("the memory model predicts a step's peak within 10 % over batches and recompute sets (CPU)") {
  UNetConfig cfg;
  cfg.width_divisor = 8;
  cfg.seed = 2;
  SyntheticSegmentation data(96, 7);
  double worst = 0;
  MemoryProfile profile;
  {
    UNet model(cfg);
    auto adam = optimizer_factory({OptimizerKind::Adam, 1e-3, 0.9, 0})(model.parameters());
    profile = profile_memory(model, *adam, LossKind::BCEDice, batch_of(data, 2), batch_of(data, 4));
  }
  const std::vector<std::pair<const char*, std::vector<bool>>> sets = {
      {"none", {}},
      {"blocks", cli::parse_recompute("blocks")},
      {"encoder", cli::parse_recompute("stem,layer1,layer2,layer3,layer4")},
      {"decoder", cli::parse_recompute("decoder.blocks.2,decoder.blocks.3,decoder.blocks.4")}};
  for (int n : {2, 4, 1, 3, 6}) {
    const Batch b = batch_of(data, n);
    for (const auto& [name, set] : sets) {
      const double want = measured_peak(cfg, set, b), got = predict_step_peak(profile, n, set);
      const double err = std::fabs(got - want) / want;
      CAPTURE(name);
      CAPTURE(n);
      CAPTURE(want);
      CAPTURE(got);
      CAPTURE(memory_report(profile, n, set));
      MESSAGE("batch ", n, ", recompute ", name, ": measured ", want / (1 << 20), " MiB, predicted ",
              got / (1 << 20), " MiB (", err * 100, " %)");
      CHECK(err < 0.10);
      worst = std::max(worst, err);
    }
  }
  MESSAGE("worst error over the grid: ", worst * 100, " %");
}
