// Activation recomputation (engine/recompute.h, UNet::run_block): the same step with every
// block recomputed in its backward equals the step without, bit for bit in float64 on the CPU
// (loss, every parameter after the optimizer, batch-norm running statistics and counts), on
// one device, with data parallelism and with the pipeline (both schedules); and the step's
// peak memory is lower.
#include <doctest/doctest.h>

#include <cstring>
#include <memory>

#include "data/synthetic.h"
#include "runtime/allocator.h"
#include "train/strategy.h"

using namespace unetcu;

namespace {

UNetConfig model_config(bool recompute, DType dtype) {
  UNetConfig c;
  c.width_divisor = 16;
  c.seed = 11;
  c.dtype = dtype;
  if (recompute) c.recompute.assign(UNet::kBlocks, true);
  return c;
}

enum class Run { Single, DataParallel, GPipe, OneFOneB };

std::unique_ptr<TrainingStrategy> make(Run mode, bool recompute, DType dtype) {
  const UNetConfig model = model_config(recompute, dtype);
  const OptimizerFactory adam = optimizer_factory({OptimizerKind::Adam, 1e-2, 0.9, 0});
  switch (mode) {
    case Run::Single: return std::make_unique<SingleDeviceStrategy>(model, Placement{}, adam, LossKind::BCEDice);
    case Run::DataParallel: {
      DataParallelOptions o;
      o.devices = {Device::cpu(0), Device::cpu(1)};
      return std::make_unique<DataParallelStrategy>(model, o, adam, LossKind::BCEDice);
    }
    default: {
      PipelineOptions o;
      o.devices = {Device::cpu(0), Device::cpu(1)};
      o.cuts = {6};  // after decoder.blocks.0: skips cross the cut
      o.split_size = 1;
      o.schedule = mode == Run::GPipe ? Schedule::GPipe : Schedule::OneFOneB;
      return std::make_unique<PipelineStrategy>(model, o, adam, LossKind::BCEDice);
    }
  }
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace

TEST_CASE("recomputed blocks give the same step bit for bit (float64): one device, DP, MP GPipe and 1F1B") {
  SyntheticSegmentation data(64, 5);  // a 2x2 bottleneck: micro-batches of one image train
  const Batch b1 = data.batch({0, 1, 2, 3}), b2 = data.batch({4, 5, 6, 7});
  for (Run mode : {Run::Single, Run::DataParallel, Run::GPipe, Run::OneFOneB}) {
    CAPTURE(int(mode));
    auto plain = make(mode, false, DType::F64);
    auto again = make(mode, true, DType::F64);
    CHECK(model_config(true, DType::F64).recompute.size() == size_t(UNet::kBlocks));
    for (const Batch* b : {&b1, &b2}) {
      const double lp = plain->step(plain->place(*b));
      const double la = again->step(again->place(*b));
      CHECK(std::memcmp(&lp, &la, sizeof lp) == 0);
    }
    plain->collect_state();
    again->collect_state();
    const auto sp = plain->model().state(), sa = again->model().state();
    REQUIRE(sp.size() == sa.size());
    int compared = 0;
    for (size_t i = 0; i < sp.size(); ++i) {
      CAPTURE(sp[i].name);
      if (sp[i].counter) CHECK(*sp[i].counter == *sa[i].counter);  // counted once per step
      if (sp[i].tensor.defined()) {
        CHECK(same_bits(sp[i].tensor.to(Device::cpu()), sa[i].tensor.to(Device::cpu())));
        ++compared;
      }
    }
    CHECK(compared > 100);
  }
}

TEST_CASE("recomputed blocks lower a step's peak memory (float32, one device)") {
  SyntheticSegmentation data(128, 5);
  const Batch b = data.batch({0, 1, 2, 3});
  size_t peak[2];
  for (int r = 0; r < 2; ++r) {
    auto s = make(Run::Single, r == 1, DType::F32);
    s->step(s->place(b));  // allocations settle
    HostAllocator::reset_peak();
    const size_t before = HostAllocator::stats().current_bytes;
    s->step(s->place(b));
    peak[r] = HostAllocator::stats().peak_bytes - before;
  }
  MESSAGE("step peak above what was held before it: ", peak[0] >> 10, " KiB without recompute, ",
          peak[1] >> 10, " KiB with every block recomputed");
  CHECK(peak[1] < peak[0] * 7 / 10);
}
