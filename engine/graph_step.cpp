#include "engine/graph_step.h"

#include <cstdio>

#include "engine/profiler.h"

namespace unetcu {

bool GraphStep::due(bool training, const std::vector<Shape>& key) {
  if (!on_ || Profiler::enabled() || !training) return false;
  if (key_.empty()) key_ = key;
  if (key != key_) return false;  // another shape: eager
  return captured_ || eager_steps_++ >= kEagerStepsBeforeCapture;
}

void GraphStep::release_cache(const Device& device) {
  cuda::synchronize(device.index);
  cuda::release_device_cache(device.index);
}

void GraphStep::capture(int i, Module& model, const std::vector<Tensor>& like,
                        const std::vector<const cuda::Stream*>& streams, const std::vector<Optimizer*>& optimizers,
                        const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& record) {
  auto s = std::make_unique<Slot>();
  for (const Tensor& t : like) s->inputs.push_back(Tensor::empty(t.shape(), t.dtype(), t.device(), t.format()));
  CapturedCounts counts(model);
  try {
    const auto work = [&] { s->outputs = record(s->inputs); };
    s->graph = streams.empty() ? cuda::Graph::capture(like.at(0).device().index, work)
                               : cuda::Graph::capture(streams, work);
    if (!optimizers.empty())
      for (const Tensor& p : model.parameters()) {
        UNETCU_CHECK(p.grad().defined(), "the captured step left a parameter without a gradient");
        s->grads.push_back(p.grad());
      }
  } catch (...) {
    s.reset();  // the graph, if one was made, and its tensors
    counts.undo();
    for (Optimizer* o : optimizers) o->zero_grad();  // whatever the failed capture left
    cuda::clear_last_error();
    throw;
  }
  counts.undo();  // nothing ran yet: the first launch counts
  s->counts = std::move(counts);
  slots_.at(size_t(i)) = std::move(s);
}

void GraphStep::Slot::launch() {
  graph.launch();
  counts.replay();
}

void GraphStep::Slot::use_gradients(Module& model) const {
  const auto params = model.parameters();
  for (size_t i = 0; i < params.size() && i < grads.size(); ++i) params[i].impl().grad = grads[i].impl_ptr();
}

void GraphStep::fall_back(const std::string& step, const std::string& why, const std::string& then) {
  for (auto& s : slots_) s.reset();  // the graphs go first (NCCL's persistent resources are theirs)
  on_ = false;
  captured_ = false;
  std::fprintf(stderr, "warning: capturing %s as a CUDA graph failed, training goes on without graphs%s: %s\n",
               step.c_str(), then.c_str(), why.c_str());
}

}  // namespace unetcu
