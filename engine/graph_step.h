// A training step as a CUDA graph (--cuda-graphs), written once for every strategy: one
// device, each replica of data parallelism (a slot per replica), the pipeline's stages (one
// graph over their streams). It owns
//  - when: graphs on, not while profiling (the profiler times ops on the host), in training
//    mode only (a graph holds train-mode batch norm), only at the first step's key (its input
//    shapes and loss; another, as a short last batch, runs eagerly), and only after two eager
//    steps there (cuDNN's algorithm search, the optimizers' state, NCCL's setup of each
//    communicator and the allocator's cache are settled before the capture, which can hold
//    none of them);
//  - the capture: the device's cache given back first (the capture takes memory of its own:
//    the device holds one step's worth, not two), the static inputs (the tensors each replay
//    copies its batch into), batch norm's host-side counts (what one capture adds, each
//    replay adds), the gradients the replays rewrite;
//  - the replay: launch, counts, and the model's gradients pointed back at the graph's after
//    an eager step in between;
//  - the fallback: a failed capture is undone, said once, and the run goes on eagerly.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/module.h"
#include "engine/optim.h"
#include "runtime/cuda_api.h"

namespace unetcu {

class GraphStep {
 public:
  static constexpr int kEagerStepsBeforeCapture = 2;

  // One captured step on one device (or one set of streams).
  struct Slot {
    std::vector<Tensor> inputs;   // fixed addresses: copy the step's batch here, then launch()
    std::vector<Tensor> outputs;  // what the recorded step returned (its losses), rewritten each replay
    std::vector<Tensor> grads;    // with optimizers: each parameter's gradient, rewritten each replay
    CapturedCounts counts;
    cuda::Graph graph;
    void launch();                           // the graph, then the counts it adds
    void use_gradients(Module& model) const;  // the parameters' gradients are the graph's again
  };

  explicit GraphStep(bool on = false, int slots = 1) : on_(on), slots_(size_t(slots)) {}
  bool on() const { return on_; }
  bool captured() const { return captured_; }
  int64_t replays() const { return replays_; }

  // Whether the step at `key` runs as the graph: true when it is captured and replays, or
  // when it is to be captured now (captured() false). Counts the eager steps before it.
  bool due(bool training, const std::vector<Shape>& key);

  // Captures slot `i`: inputs like `like` (shapes, dtypes, devices, formats), then
  // `record(inputs)` (returning the step's outputs) into one graph on `streams` (empty: the
  // current stream of like[0]'s device). With `optimizers` the step owns the gradients: the
  // caller has zeroed them before giving the cache back (the captured backward writes each
  // with beta 0, and the freed ones go back with the cache), and each parameter of `model`
  // must have one after. A failure undoes the counts, zeroes those gradients, clears
  // the device's error and rethrows; the slot stays empty. Slots may be captured side by side.
  void capture(int i, Module& model, const std::vector<Tensor>& like, const std::vector<const cuda::Stream*>& streams,
               const std::vector<Optimizer*>& optimizers,
               const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& record);
  void set_captured() { captured_ = true; }  // every slot holds its graph
  Slot& slot(int i) { return *slots_.at(size_t(i)); }
  void count_replay() { ++replays_; }

  // Before capturing on `device`: its work finished and its cached memory back to the system.
  static void release_cache(const Device& device);
  // A capture failed: every slot's graph goes, graphs are off from now on, and one warning
  // says so ("capturing <step> as a CUDA graph failed, training goes on without graphs<then>: <why>").
  void fall_back(const std::string& step, const std::string& why, const std::string& then = "");

 private:
  bool on_;
  bool captured_ = false;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<Shape> key_;  // the first step's: the key captured
  int eager_steps_ = 0;     // steps run at that key before the capture
  int64_t replays_ = 0;
};

}  // namespace unetcu
