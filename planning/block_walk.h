// The model's forward block by block on the tape in scope, as the profiles of the planners
// (the memory model, the block times) measure it: each block's inputs are the images and the
// earlier blocks' outputs, and the tape's size at each block's start tells which backward
// nodes are the block's.
#pragma once
#include <functional>
#include <vector>

#include "engine/tape.h"
#include "models/unet.h"

namespace unetcu {

struct BlockWalk {
  std::vector<Tensor> outputs;   // each block's output
  std::vector<size_t> first_node;  // the tape's size when block k began; [blocks]: after the last
};

// `run(k, inputs)` runs block k (and measures it) and returns its output.
inline BlockWalk walk_blocks(const UNet& model, const Tape& tape, const Tensor& images,
                             const std::function<Tensor(size_t, const std::vector<Tensor>&)>& run) {
  const auto& blocks = model.blocks();
  BlockWalk w;
  w.outputs.resize(blocks.size());
  w.first_node.resize(blocks.size() + 1);
  for (size_t k = 0; k < blocks.size(); ++k) {
    w.first_node[k] = tape.size();
    std::vector<Tensor> in;
    for (int i : blocks[k].inputs) in.push_back(i < 0 ? images : w.outputs[size_t(i)]);
    w.outputs[k] = run(k, in);
  }
  w.first_node[blocks.size()] = tape.size();
  return w;
}

}  // namespace unetcu
