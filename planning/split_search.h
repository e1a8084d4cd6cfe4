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

// A block's forward and backward time per sample measured with micro-batches of `samples`.
struct BatchPoint {
  int samples = 0;
  double forward_s = 0, backward_s = 0;  // per sample
};

struct BlockProfile {
  std::string name;
  std::vector<int> inputs;  // as UNet::Block::inputs
  double forward_s = 0, backward_s = 0;  // per sample (at by_batch's largest size, if any)
  double output_bytes = 0;               // per sample
  // Per-sample times at several micro-batch sizes, ascending (profile_blocks_by_batch; the
  // FLOP-derived profile's under-fill curve). Empty: forward_s/backward_s at every size.
  std::vector<BatchPoint> by_batch = {};
  // Time with every device of the run computing at once over the time with this device alone
  // (measure_shared_slowdown): CPU devices share cores' caches and the memory bandwidth;
  // devices that share nothing (GPUs) keep 1.
  double shared_slowdown = 1;
  double param_bytes = 0;  // the block's parameters (an MP stage's optimizer steps its own)
};

// Per-sample time of a block at micro-batch `samples`: linear between the measured sizes,
// flat below the smallest and beyond the largest.
double forward_per_sample(const BlockProfile& b, double samples);
double backward_per_sample(const BlockProfile& b, double samples);

struct LinkModel {
  double bandwidth = 10e9;  // bytes/s between stages
  double latency = 20e-6;   // s per transfer
};

// Predicted time of one pipeline step: the schedule simulated op by op (each stage runs its
// ops in schedule order; an op starts when its stage is free and its inputs, or its outputs'
// gradients, have arrived). An op on a micro-batch of m samples costs m times its stage's
// per-sample time at m (forward_per_sample). While k of the S stages compute at once, each
// runs 1 + (d - 1)(k - 1)/(S - 1) times slower, d its stage's time-weighted shared_slowdown
// (measured with all S busy; 1 alone): the simulation advances event by event at those rates.
// Without slowdowns (all 1) it is the plain list schedule.
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

// profile_blocks at each batch's size (e.g. 1, 2, 4, 8 samples), twice, each block's faster
// round: by_batch holds every size; forward_s/backward_s are the largest's.
std::vector<BlockProfile> profile_blocks_by_batch(UNet& model, const std::vector<Batch>& batches,
                                                  LossKind loss, int repeats);

// Sets each block's shared_slowdown: one model per device, each on its own thread (CPU
// devices with `threads` each); the blocks are profiled on `batch` with only the first device
// working and with every device working at the same time, twice each, alternated; the
// slowdown is the devices' mean time over the first's time alone, per block (the faster of
// the two rounds of each kind).
void measure_shared_slowdown(std::vector<BlockProfile>& blocks, const UNetConfig& model,
                             const std::vector<Device>& devices, int threads, const Batch& batch,
                             LossKind loss, int repeats);

// The article's Table 1 as Markdown: rows are cuts ("after <block>"), columns split sizes,
// cells the measured step time where a plan was run (else the prediction, in parentheses),
// the fastest in bold.
std::string plans_table(const std::vector<PlanCandidate>& plans, const std::vector<BlockProfile>& blocks);

}  // namespace unetcu
