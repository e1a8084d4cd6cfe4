// The autograd tape. An op appends a Node (its saved tensors, captured by the backward
// closure) only when a tape is active on the calling thread and one of its inputs requires a
// gradient. backward() walks the nodes in reverse.
//
// Gradients:
//  - a leaf (a parameter, or an input marked requires_grad, or a tensor made by another tape)
//    accumulates into its TensorImpl::grad across backward calls until zero_grad(): gradient
//    accumulation over micro-batches is a feature.
//  - an intermediate tensor's gradient lives in the tape, keyed by tensor id, and is freed as
//    soon as the node that produced it has run its backward.
// A backward may start from a scalar loss or from given gradients of any outputs (one
// pipeline stage back-propagated on its own). backward() consumes the tape: nodes and their
// saved activations are freed.
//
// Each thread has its own current tape (TapeScope), so each pipeline (stage, micro-batch) or
// data-parallel replica records on a tape of its own. Accumulation into a leaf's gradient is
// not synchronised: two threads must not back-propagate into the same leaf at the same time
// (replicas own their parameters; pipeline stages own theirs).
#pragma once
#include <functional>
#include <unordered_map>
#include <vector>

#include "engine/tensor.h"

namespace unetcu {

class Tape;

// What a node's backward closure sees.
class BackwardContext {
 public:
  // Gradient of output i (zeros if nothing downstream produced one).
  const Tensor& grad_output(int i) const { return grad_outputs_[i]; }
  bool needs_grad(int input) const;
  // Buffer for the gradient of input i. *beta is 0 when the buffer is fresh (uninitialised:
  // write it) and 1 when a gradient already exists (accumulate into it). Request one input's
  // buffer, fill it completely, then request the next: the same tensor may be two inputs.
  Tensor grad_input(int input, double* beta);

 private:
  friend class Tape;
  Tape* tape_ = nullptr;
  struct Input {
    uint64_t id;
    std::shared_ptr<TensorImpl> leaf;  // set when the input is not produced by this tape
    bool requires_grad;
    Shape shape;
    DType dtype;
    Device device;
    MemoryFormat format;  // a gradient has its tensor's dtype and memory format
  };
  const std::vector<Input>* inputs_ = nullptr;
  std::vector<Tensor> grad_outputs_;
};

using BackwardFn = std::function<void(BackwardContext&)>;

// What an op's backward costs, for the profiler (0 when unknown).
struct OpCost {
  double flops = 0, bytes = 0;
};

class Tape {
 public:
  Tape();
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;

  // The calling thread's active tape, or null (then nothing is recorded).
  static Tape* current();

  // True when a tape is active and any input requires a gradient.
  static bool should_record(std::initializer_list<const Tensor*> inputs);
  static bool should_record(const std::vector<Tensor>& inputs);

  // Appends a node to the current tape, marks outputs as produced here and requiring grad.
  static void record(const char* name, const std::vector<Tensor>& inputs,
                     const std::vector<Tensor>& outputs, BackwardFn backward,
                     OpCost backward_cost = {});

  // Back-propagates d(loss)/d(everything) from a one-element loss.
  void backward(const Tensor& loss);
  // Back-propagates from the given gradients of the given outputs.
  void backward(std::vector<Tensor> outputs, std::vector<Tensor> grad_outputs);

  // Called during backward() as soon as a leaf's gradient is final (no node left to run uses
  // it): data parallelism starts reducing gradient buckets while the rest of backward runs.
  void set_leaf_ready_hook(std::function<void(const TensorImpl*)> hook) { leaf_ready_ = std::move(hook); }
  // Called after each node's backward with the node's op name (event traces, tests).
  void set_node_done_hook(std::function<void(const char*)> hook) { node_done_ = std::move(hook); }

  // Drops all nodes (and the activations they saved) without back-propagating.
  void clear();
  size_t size() const { return nodes_.size(); }
  // Unique among all tapes ever made, renewed by clear(): a tensor recorded by an earlier use
  // of this tape (or by a tape that happened to live at the same address) is a leaf here.
  uint64_t serial() const { return serial_; }

 private:
  friend class BackwardContext;
  struct Node {
    const char* name;
    std::vector<BackwardContext::Input> inputs;
    std::vector<uint64_t> output_ids;
    std::vector<Shape> output_shapes;
    std::vector<DType> output_dtypes;
    std::vector<MemoryFormat> output_formats;
    Device device;
    BackwardFn backward;
    OpCost cost;
    std::string block;  // the model block that made it (profiling)
  };
  void accumulate(uint64_t id, const Tensor& g);
  std::vector<Node> nodes_;
  std::unordered_map<uint64_t, Tensor> grads_;  // gradients of intermediate tensors
  uint64_t serial_;
  std::function<void(const TensorImpl*)> leaf_ready_;
  std::function<void(const char*)> node_done_;
};

// Makes `tape` the current tape of this thread for the scope's lifetime (restores the previous).
class TapeScope {
 public:
  explicit TapeScope(Tape& tape);
  ~TapeScope();
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  Tape* previous_;
};

// Turns recording off for the scope (evaluation).
class NoGradScope {
 public:
  NoGradScope();
  ~NoGradScope();

 private:
  Tape* previous_;
};

}  // namespace unetcu
