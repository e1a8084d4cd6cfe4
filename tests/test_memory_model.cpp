// The memory model (planning/memory_model.h) against the measured peaks of training steps on
// CPU devices: one device over batch sizes and recompute sets, data-parallel replicas and
// pipeline stages over cuts, split sizes, schedules and recompute sets, each within 10 %.
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

// The most cpu:0's tensors held during the third step of a fresh SingleDeviceStrategy.
double measured_peak(UNetConfig cfg, const std::vector<bool>& recompute, const Batch& b) {
  cfg.recompute = recompute;
  SingleDeviceStrategy s(cfg, {}, optimizer_factory({OptimizerKind::Adam, 1e-3, 0.9, 0}), LossKind::BCEDice);
  s.step(s.place(b));
  s.step(s.place(b));
  const PlacedBatch placed = s.place(b);
  HostAllocator::reset_peak();
  s.step(placed);
  return double(HostAllocator::device_stats(0).peak_bytes);
}

// The most each device's tensors held during the third step of a fresh strategy.
std::vector<double> measured_peaks(TrainingStrategy& s, const Batch& b) {
  s.step(s.place(b));
  s.step(s.place(b));
  const PlacedBatch placed = s.place(b);
  HostAllocator::reset_peak();
  s.step(placed);
  std::vector<double> out;
  for (const Device& d : s.devices()) out.push_back(double(HostAllocator::device_stats(d.index).peak_bytes));
  return out;
}

MemoryProfile profile_of(const UNetConfig& cfg, const SyntheticSegmentation& data) {
  UNet model(cfg);
  auto adam = optimizer_factory({OptimizerKind::Adam, 1e-3, 0.9, 0})(model.parameters());
  return profile_memory(model, *adam, LossKind::BCEDice, batch_of(data, 2), batch_of(data, 4));
}

// Checks every device's prediction against its measurement; returns the worst error.
double check_peaks(const MemoryProfile& profile, const MemoryPlan& plan, const std::vector<double>& want,
                   const std::string& what) {
  const std::vector<double> got = predict_peaks(profile, plan);
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]) / want[i];
    CAPTURE(what);
    CAPTURE(i);
    CAPTURE(memory_report(profile, plan));
    MESSAGE(what, ", device ", i, ": measured ", want[i] / (1 << 20), " MiB, predicted ", got[i] / (1 << 20),
            " MiB (", err * 100, " %)");
    CHECK(err < 0.10);
    worst = std::max(worst, err);
  }
  return worst;
}

const auto kAdam = optimizer_factory({OptimizerKind::Adam, 1e-3, 0.9, 0});

// The grid's model (width/8), its data (96x96) and the model's memory profile on cpu:0.
struct Grid {
  UNetConfig cfg = [] {
    UNetConfig c;
    c.width_divisor = 8;
    c.seed = 2;
    return c;
  }();
  SyntheticSegmentation data{96, 7};
  MemoryProfile profile = profile_of(cfg, data);

  // The grid's model recomputing `set` (the --recompute syntax).
  UNetConfig recomputing(const char* set) const {
    UNetConfig c = cfg;
    c.recompute = cli::parse_recompute(set);
    return c;
  }
};

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

TEST_CASE_FIXTURE(Grid, "the memory model predicts each data-parallel replica's peak within 10 % (CPU devices)") {
  double worst = 0;
  for (int b : {2, 3}) {
    for (const char* set : {"none", "blocks", "layer1,decoder.blocks.3"}) {
      const UNetConfig c = recomputing(set);
      DataParallelOptions o;
      o.devices = {Device::cpu(0), Device::cpu(1)};
      DataParallelStrategy dp(c, o, kAdam, LossKind::BCEDice);
      const std::vector<double> want = measured_peaks(dp, batch_of(data, 2 * b));
      MemoryPlan plan;
      plan.kind = MemoryPlan::DataParallel;
      plan.batch = b;
      plan.recompute = c.recompute;
      plan.devices = o.devices;
      worst = std::max(worst, check_peaks(profile, plan, want, str_cat("dp, ", b, " per replica, recompute ", set)));
    }
  }
  MESSAGE("worst error over the data-parallel grid: ", worst * 100, " %");
}

TEST_CASE_FIXTURE(Grid, "the memory model predicts each pipeline stage's peak within 10 % (CPU devices)") {
  struct Case {
    const char* cuts;
    int batch, split;
    Schedule schedule;
    const char* recompute;
  };
  const std::vector<Case> cases = {
      {"layer3", 4, 2, Schedule::GPipe, "none"},
      {"layer3", 4, 1, Schedule::GPipe, "none"},
      {"layer3", 4, 1, Schedule::OneFOneB, "none"},
      {"decoder.blocks.1", 6, 2, Schedule::GPipe, "none"},
      {"layer2", 4, 4, Schedule::GPipe, "blocks"},
      {"layer3", 6, 2, Schedule::OneFOneB, "blocks"},
      {"layer2,decoder.blocks.1", 6, 2, Schedule::OneFOneB, "none"},
      {"layer2,decoder.blocks.1", 6, 2, Schedule::GPipe, "layer3,decoder.blocks.4"},
  };
  double worst = 0;
  for (const Case& k : cases) {
    const UNetConfig c = recomputing(k.recompute);
    PipelineOptions o;
    o.cuts = cli::parse_cuts(k.cuts);
    for (size_t s = 0; s <= o.cuts.size(); ++s) o.devices.push_back(Device::cpu(int(s)));
    o.split_size = k.split;
    o.schedule = k.schedule;
    PipelineStrategy mp(c, o, kAdam, LossKind::BCEDice);
    const std::vector<double> want = measured_peaks(mp, batch_of(data, k.batch));
    MemoryPlan plan;
    plan.kind = MemoryPlan::Pipeline;
    plan.batch = k.batch;
    plan.recompute = c.recompute;
    plan.devices = o.devices;
    plan.cuts = o.cuts;
    plan.split_size = k.split;
    plan.schedule = k.schedule;
    worst = std::max(worst, check_peaks(profile, plan, want,
                                        str_cat("mp, cut ", k.cuts, ", batch ", k.batch, ", split ", k.split, ", ",
                                                name_of(kScheduleNames, k.schedule), ", recompute ", k.recompute)));
  }
  MESSAGE("worst error over the pipeline grid: ", worst * 100, " %");
}

TEST_CASE_FIXTURE(
    Grid, "the memory model predicts a step accumulated in chunks within 10 % (one device and DP, CPU devices)") {
  double worst = 0;
  for (const char* set : {"none", "blocks"}) {
    const UNetConfig c = recomputing(set);
    for (const auto& [chunk, chunks] : {std::pair{2, 3}, std::pair{1, 4}, std::pair{3, 2}}) {
      MemoryPlan plan;
      plan.batch = chunk;
      plan.chunks = chunks;
      plan.recompute = c.recompute;
      plan.devices = {Device::cpu(0)};
      {
        SingleDeviceStrategy one(c, Placement{{}, 0, false, chunk}, kAdam, LossKind::BCEDice);
        worst =
            std::max(worst, check_peaks(profile, plan, measured_peaks(one, batch_of(data, chunk * chunks)),
                                        str_cat("one device, ", chunks, " chunks of ", chunk, ", recompute ", set)));
      }
      DataParallelOptions o;
      o.devices = {Device::cpu(0), Device::cpu(1)};
      o.accumulate_rows = chunk;
      DataParallelStrategy dp(c, o, kAdam, LossKind::BCEDice);
      plan.kind = MemoryPlan::DataParallel;
      plan.devices = o.devices;
      worst =
          std::max(worst, check_peaks(profile, plan, measured_peaks(dp, batch_of(data, 2 * chunk * chunks)),
                                      str_cat("dp, ", chunks, " chunks of ", chunk, " per replica, recompute ", set)));
    }
  }
  MESSAGE("worst error over the accumulation grid: ", worst * 100, " %");
}
