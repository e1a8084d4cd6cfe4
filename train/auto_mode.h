// --mode auto: the fastest plan that fits. The memory model (planning/memory_model.h) and the
// block times are measured on the first device; planning/auto_plan.h lists every plan that
// fits the limit with its predicted time; the fastest prediction of each kind (one device,
// DP, a pipeline) is then run for real under the limit, three steps each (the first warms
// up), and the fastest of those measured wins.
#pragma once
#include <functional>
#include <iosfwd>
#include <vector>

#include "planning/auto_plan.h"
#include "train/strategy.h"

namespace unetcu {

struct AutoResult {
  StrategyConfig strategy;  // mode, devices, cuts, split size, schedule, recompute, accumulate_rows
  int batch_size = 0;       // per replica per forward (a pipeline: the whole batch)
  int accumulate = 1;       // chunks per optimizer step
  AutoPlan chosen;
  std::vector<AutoPlan> plans;  // every plan that fits, with the timed ones' measurements
};

// `base`: the run's configuration (devices: the candidates; the model, optimizer and loss);
// `batch_of(n)`: a host batch of the first n training images; `images`: per optimizer step;
// `limit`: bytes per device; `min_samples`: the fewest images a chunk or micro-batch may hold.
// The table of plans and the choice go to `out`.
AutoResult choose_auto_plan(const StrategyConfig& base, const std::function<Batch(int)>& batch_of, int images,
                            double limit, int min_samples, std::ostream& out);

}  // namespace unetcu
