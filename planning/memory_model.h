// The memory model: a training step's peak on one device, predicted from a memory profile of
// the model's blocks, for any batch and any set of recomputed blocks (engine/recompute.h).
//
// The profile is measured, not derived: one step at each of two batch sizes, with the
// device's allocator read after every block's forward and every node of the backward
// (runtime/allocator.h on a CPU device, the caching allocator's tensors on a GPU). From them,
// per block: what its forward keeps on the tape per sample (its saved tensors and output), its
// output per sample, and the most held while its backward runs (a part per sample, a part
// fixed: the parameter gradients made by then); and for the step: what is held before it
// (parameters, optimizer state, buffers, the batch), the loss, the gradients, and the optimizer
// step's own scratch. Activations are taken as linear in the batch.
//
// Predicted peak = before + max(end of the forward, each block's backward, the optimizer step)
// where a recomputed block keeps only its output through the forward and the backward of every
// later block, and holds all it kept again while its own backward runs, with its output a
// second time and its inputs' gradients twice (its own tape's, copied into the step's).
#pragma once
#include <string>
#include <vector>

#include "data/batch.h"
#include "engine/optim.h"
#include "engine/ops.h"
#include "models/unet.h"

namespace unetcu {

struct BlockMemory {
  std::string name;
  std::vector<int> inputs;  // as UNet::Block::inputs (-1: the images)
  double kept = 0;      // bytes per sample the tape holds after its forward (saved + output)
  double output = 0;    // bytes per sample of its output
  double backward = 0;  // per sample: the most held above the step's start while its backward runs
  double backward_fixed = 0;  // the same, the part that does not grow with the batch
};

struct MemoryProfile {
  std::vector<BlockMemory> blocks;
  double before = 0;           // held when a step starts, less the batch
  double batch = 0;            // bytes per sample of the batch's copy on the device (none on a CPU)
  double loss = 0;             // bytes per sample the loss adds at the end of the forward
  double gradients = 0;        // the parameter gradients after the backward
  double optimizer = 0;        // the optimizer step's scratch above them
};

// Steps `model` (on its device, with `optimizer` over its parameters) at b1 and then b2 > b1
// samples (host batches, as make_batch makes them), each twice (the first sets up the
// optimizer's state), measuring as above. The model's parameters change (it trains).
MemoryProfile profile_memory(UNet& model, Optimizer& optimizer, LossKind loss, const Batch& b1,
                             const Batch& b2);

// The predicted peak of one step at `batch` samples with `recompute` (one flag per block;
// empty: none), in bytes.
double predict_step_peak(const MemoryProfile& p, int batch, const std::vector<bool>& recompute);

// The peak of the step that `predict_step_peak` gives, broken into its parts, one per line.
std::string memory_report(const MemoryProfile& p, int batch, const std::vector<bool>& recompute);

}  // namespace unetcu
