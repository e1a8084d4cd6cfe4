// The memory model: a training step's peak on each device, predicted from a memory profile of
// the model's blocks, for one device, a data-parallel replica or a pipeline stage, at any
// batch, micro-batch size, schedule, cut and set of recomputed blocks (engine/recompute.h).
//
// The profile is measured, not derived: one step at each of two batch sizes, with the
// device's allocator read after every block's forward and every node of the backward
// (runtime/allocator.h on a CPU device, the caching allocator's tensors on a GPU), so the
// precision, the memory format and the convolutions' workspace are those of the device and
// settings it was measured with. From them, per block: what its forward keeps on the tape per
// sample (its saved tensors and output), its output per sample, its parameters and buffers,
// and the most held while its backward runs; and for the step: what is held before it
// (parameters, optimizer state, buffers), the batch, the loss, the gradients, and the optimizer
// step's own scratch. Activations are taken as linear in the batch.
//
// Block k's backward is split into what the step around it holds (what the blocks before it
// keep, the gradients of its own and every later block's parameters) and its own residual
// (what it saved, the gradients in flight, the workspace; per sample and fixed), so that one
// residual serves every plan:
//  - one device: before + max(end of the forward, each block's backward, the optimizer step),
//    where a recomputed block keeps only its output through the forward and the backward of
//    every later block, and its own backward takes the residual measured with it recomputed;
//  - a data-parallel replica: the same at its shard, with the gradient buckets held through
//    the step (its gradients are views into them) and the shard copied onto its device;
//  - a pipeline stage: its blocks' parameters, buffers, optimizer state and gradients; per
//    micro-batch in flight what its blocks keep and its copies of other stages' outputs (GPipe
//    holds every micro-batch at the end of the forward, 1F1B at most S - s); the images on the
//    first stage, the masks on the last.
#pragma once
#include <string>
#include <vector>

#include "data/batch.h"
#include "engine/optim.h"
#include "engine/ops.h"
#include "models/unet.h"
#include "parallel/pipeline.h"

namespace unetcu {

struct BlockMemory {
  std::string name;
  std::vector<int> inputs;  // as UNet::Block::inputs (-1: the images)
  double kept = 0;      // bytes per sample the tape holds after its forward (saved + output)
  double output = 0;    // bytes per sample of its output
  // The most held above the tape before it while its forward runs (what it keeps, and its
  // scratch: the convolutions' workspace), per sample and fixed; measured without recompute.
  double forward = 0, forward_fixed = 0;
  double backward = 0;  // per sample: the most held above the step's start while its backward runs
  double backward_fixed = 0;  // the same, the part that does not grow with the batch
  // `backward` less what the blocks before it keep and the gradients of its own and every
  // later block's parameters: per sample, and fixed (negative where a gradient is not made yet).
  double residual = 0, residual_fixed = 0;
  // The same when the block is recomputed (measured with every block recomputed): its forward
  // run again, its own tape's backward, its inputs' gradients copied into the step's.
  double recomputed = 0, recomputed_fixed = 0;
  double params = 0;   // bytes of its parameters (and of their gradients)
  double statics = 0;  // bytes of its parameters and buffers (batch-norm statistics)
};

struct MemoryProfile {
  std::vector<BlockMemory> blocks;
  double before = 0;           // held when a step starts, less the batch
  double batch = 0;            // bytes per sample of the batch's copy on the device (none on a CPU)
  double images = 0, masks = 0;  // bytes per sample of the loader's images and masks
  double state = 0;            // `before` less the blocks' parameters and buffers: the optimizer's
                               // state, spread over the devices by their parameters' bytes
  double loss = 0;             // bytes per sample the loss adds at the end of the forward
  double gradients = 0;        // the parameter gradients after the backward
  double optimizer = 0;        // the optimizer step's scratch above them
};

// Steps `model` (on its device, with `optimizer` over its parameters) at b1 and then b2 > b1
// samples (host batches, as make_batch makes them), each twice (the first sets up the
// optimizer's state), then once each with every block recomputed, measuring as above. The
// model's parameters change (it trains).
MemoryProfile profile_memory(UNet& model, Optimizer& optimizer, LossKind loss, const Batch& b1,
                             const Batch& b2);

// A plan whose peak per device the model predicts.
struct MemoryPlan {
  enum Kind { Single, DataParallel, Pipeline } kind = Single;
  int batch = 1;                // Single, DataParallel: per replica; Pipeline: the whole batch
  std::vector<bool> recompute;  // one flag per block; empty: none
  // One per replica or stage (which of them copy the batch: copies_batch). Empty: one device
  // (every stage or replica), with the batch copied as on the device profiled.
  std::vector<Device> devices;
  int replicas = 1;             // DataParallel without devices
  // Single, DataParallel: gradient accumulation, `batch` being one chunk of the step (a later
  // chunk's backward finds every gradient made).
  int chunks = 1;
  // Pipeline
  std::vector<int> cuts;        // first block of stages 1..S-1
  int split_size = 1;
  Schedule schedule = Schedule::GPipe;
};

// The predictions are within 10 % of the measured peaks (tests/test_memory_model.cpp); a plan
// chosen by them counts as fitting a limit when its prediction leaves this much of it free.
constexpr double kMemoryHeadroom = 0.10;

// Whether the strategies copy a host batch onto `d`: a GPU's copy, and every CPU device's but
// cpu:0's (the loader's tensors are cpu:0's, counted under no device).
bool copies_batch(const Device& d);

// The predicted peak of each replica or stage of the plan (one for Single), in bytes.
std::vector<double> predict_peaks(const MemoryProfile& p, const MemoryPlan& plan);
// The most on any one device: stages that share a device (`--devices cuda:0,cuda:0`) add up.
double most_on_a_device(const MemoryProfile& p, const MemoryPlan& plan);

// One device's step at `batch` samples with `recompute` (one flag per block; empty: none), as
// on the device profiled.
double predict_step_peak(const MemoryProfile& p, int batch, const std::vector<bool>& recompute);

// A line per device: what the step holds throughout, the most above it in the forward, in the
// backward (and in which block) and in the optimizer step, and the predicted peak.
std::string memory_report(const MemoryProfile& p, const MemoryPlan& plan);
std::string memory_report(const MemoryProfile& p, int batch, const std::vector<bool>& recompute);

}  // namespace unetcu
