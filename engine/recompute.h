// Activation recomputation (PyTorch's torch.utils.checkpoint): a piece of the forward pass
// runs without keeping what it computes inside; its backward runs it again first, on a tape of
// its own, and back-propagates through that.
//
//  - What the outer tape keeps of the piece: its inputs (and outputs, as any op's) only.
//  - Gradients equal the run without recomputation bit for bit: the forward is run again on
//    the same inputs by the same kernels, and each input's gradient continues from the one the
//    outer tape already holds (the same additions in the same order).
//  - Batch-norm running statistics and counts are updated once per step: the second forward
//    updates throwaway copies (recomputing()).
//  - No randomness to replay: the model has none (dropout-free; augmentation is the loader's).
#pragma once
#include <functional>
#include <vector>

#include "engine/tape.h"

namespace unetcu {

using PieceFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// fn(inputs), recorded on the current tape as one node that recomputes it in its backward.
// `params` are the leaves fn reads besides its inputs (their gradients accumulate as usual).
// Without an active tape, or when nothing needs a gradient, just fn(inputs).
std::vector<Tensor> checkpoint(const char* name, const PieceFn& fn,
                               const std::vector<Tensor>& inputs,
                               const std::vector<Tensor>& params);

// True while the calling thread runs a piece's forward again (in its backward).
bool recomputing();

}  // namespace unetcu
