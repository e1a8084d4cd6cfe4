// The split search: which cut and which split_size make the pipeline fastest. The article
// found them by timing every combination by hand (its Table 1); here each block's forward and
// backward time is measured once, every cut × split_size is predicted by simulating the
// schedule (stage times per micro-batch, transfers over a link model), and the best few
// predictions are then run for real.
#pragma once
#include <string>
#include <vector>

#include "data/synthetic.h"
#include "models/unet.h"
#include "parallel/pipeline.h"

namespace unetcu {

struct BlockProfile {
  std::string name;
  std::vector<int> inputs;  // as UNet::Block::inputs
  double forward_s = 0, backward_s = 0;  // per sample
  double output_bytes = 0;               // per sample
};

struct LinkModel {
  double bandwidth = 10e9;  // bytes/s between stages
  double latency = 20e-6;   // s per transfer
};

// Predicted time of one pipeline step: the schedule simulated op by op (each stage runs its
// ops in schedule order; an op starts when its stage is free and its inputs, or its outputs'
// gradients, have arrived).
double predict_step(const std::vector<BlockProfile>& blocks, const std::vector<int>& cuts,
                    int batch, int split_size, Schedule schedule, const LinkModel& link);

struct PlanCandidate {
  std::vector<int> cuts;
  int split_size = 0;
  double predicted_s = 0;
  double measured_s = -1;  // when run for real
};

// Every single cut (two stages) × each split size, best prediction first.
std::vector<PlanCandidate> rank_plans(const std::vector<BlockProfile>& blocks, int batch,
                                      const std::vector<int>& split_sizes, Schedule schedule,
                                      const LinkModel& link);

// Times each block's forward and backward on the model's device over a few steps on `batch`
// (one device, training mode); the median per block, per sample.
std::vector<BlockProfile> profile_blocks(UNet& model, const Batch& batch, LossKind loss, int repeats);

// The article's Table 1 as Markdown: rows are cuts ("after <block>"), columns split sizes,
// cells the measured step time where a plan was run (else the prediction, in parentheses),
// the fastest in bold.
std::string plans_table(const std::vector<PlanCandidate>& plans, const std::vector<BlockProfile>& blocks);

}  // namespace unetcu
