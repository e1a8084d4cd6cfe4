// The plans `--mode auto` chooses among, with their predicted time and memory.
//
// Every plan trains the same `images` per optimizer step on some of the given devices:
//  - one device (the first);
//  - data parallelism over all of them (each replica images/N);
//  - a pipeline over all of them: for two stages every single cut, for more the cut balanced
//    by compute; split sizes 1, 2, 4, ... and the whole batch; GPipe and 1F1B;
// each with the recompute set that adds the least forward time among those the memory model
// (memory_model.h) puts under the limit on every device, and, for one device and DP, where even
// every block recomputed does not fit, gradient accumulation over the fewest chunks that fit
// (each count that divides the batch, or the shard), with the next two counts beside it
// (accumulation changes the batch that batch norm sees, so only where nothing else fits). A
// plan is timed by the performance model (perf_model.h) from
// per-block times measured on the first device: a recomputed block's backward runs its forward
// again; on CPU devices, which share the machine's cores, a plan over n devices gives each
// block 1/n of them (its time n times longer).
#pragma once
#include <string>
#include <vector>

#include "planning/memory_model.h"
#include "planning/perf_model.h"
#include "planning/split_search.h"

namespace unetcu {

struct AutoPlan {
  MemoryPlan plan;  // kind, per-replica chunk (a pipeline: the whole batch), chunks, devices, cuts, split, schedule, recompute
  double predicted_s = 0;     // one optimizer step
  double predicted_peak = 0;  // the most on any device
  double measured_s = -1;     // when timed
  double measured_peak = -1;
  std::string failed;         // why its timing run failed (empty: it did not)
  // "single", "dp x2", "mp x2 after layer3, split 4, 1f1b"; and the recompute and chunks.
  std::string name(const std::vector<std::string>& block_names) const;
};

struct AutoSearch {
  std::vector<Device> devices;  // the first is the one-device plan's
  int images = 1;               // per optimizer step
  double limit = 0;             // bytes per device
  int min_samples = 1;          // the fewest samples a chunk or micro-batch may have (batch norm)
  LinkModel link;               // between the devices
  AllReduceAlgo allreduce = AllReduceAlgo::Ring;
};

// Every plan that fits, fastest prediction first. `times`: per-block times on the first device
// (profile_blocks_by_batch, at the micro-batch sizes the plans use); `memory`: its memory
// profile; `param_bytes`: the model's parameters (DP's all-reduce).
std::vector<AutoPlan> auto_plans(const MemoryProfile& memory, const std::vector<BlockProfile>& times,
                                 double param_bytes, const AutoSearch& search);

// The micro-batch and chunk sizes auto_plans may time a block at (for the block profile).
std::vector<int> auto_batch_sizes(const AutoSearch& search);

// A Markdown table of the plans: predicted and measured step time and peak memory.
std::string auto_table(const std::vector<AutoPlan>& plans, const std::vector<std::string>& block_names);

}  // namespace unetcu
