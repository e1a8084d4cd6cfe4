#include "engine/tape.h"

#include "engine/profiler.h"

#include <atomic>

#include "kernels/launchers.h"

namespace unetcu {

static thread_local Tape* g_current_tape = nullptr;

static uint64_t next_tape_serial() {
  static std::atomic<uint64_t> counter{1};
  return counter.fetch_add(1, std::memory_order_relaxed);
}

Tape::Tape() : serial_(next_tape_serial()) {}

Tape* Tape::current() { return g_current_tape; }

TapeScope::TapeScope(Tape& tape) : previous_(g_current_tape) { g_current_tape = &tape; }
TapeScope::~TapeScope() { g_current_tape = previous_; }
NoGradScope::NoGradScope() : previous_(g_current_tape) { g_current_tape = nullptr; }
NoGradScope::~NoGradScope() { g_current_tape = previous_; }

bool Tape::should_record(std::initializer_list<const Tensor*> inputs) {
  if (!g_current_tape) return false;
  for (const Tensor* t : inputs)
    if (t && t->requires_grad()) return true;
  return false;
}

bool Tape::should_record(const std::vector<Tensor>& inputs) {
  if (!g_current_tape) return false;
  for (const Tensor& t : inputs)
    if (t.requires_grad()) return true;
  return false;
}

void Tape::record(const char* name, const std::vector<Tensor>& inputs,
                  const std::vector<Tensor>& outputs, BackwardFn backward, OpCost cost) {
  Tape* tape = g_current_tape;
  UNETCU_CHECK(tape != nullptr, "Tape::record(", name, ") without an active tape");
  Node node;
  node.name = name;
  for (const Tensor& t : inputs) {
    BackwardContext::Input in;
    in.requires_grad = t.defined() && t.requires_grad();
    in.id = t.defined() ? t.id() : 0;
    if (in.requires_grad) {
      in.shape = t.shape();
      in.dtype = t.dtype();
      in.device = t.device();
      in.format = t.format();
      // Only tensors this tape does not produce are held: intermediates are found by id, so
      // a node never keeps an activation alive that its backward does not need.
      if (t.impl().producer != tape->serial_) in.leaf = t.impl_ptr();
    }
    node.inputs.push_back(std::move(in));
  }
  for (const Tensor& t : outputs) {
    t.impl().requires_grad = true;
    t.impl().producer = tape->serial_;
    node.output_ids.push_back(t.id());
    node.output_shapes.push_back(t.shape());
    node.output_dtypes.push_back(t.dtype());
    node.output_formats.push_back(t.format());
  }
  node.device = outputs.at(0).device();
  node.backward = std::move(backward);
  node.cost = cost;
  if (Profiler::enabled()) node.block = BlockScope::current();
  tape->nodes_.push_back(std::move(node));
}

bool BackwardContext::needs_grad(int input) const { return (*inputs_)[input].requires_grad; }

Tensor BackwardContext::grad_input(int input, double* beta) {
  const Input& in = (*inputs_)[input];
  UNETCU_CHECK(in.requires_grad, "grad_input(", input, ") of an input that needs no gradient");
  if (in.leaf) {
    if (in.leaf->grad) {
      *beta = 1;
      return Tensor(in.leaf->grad);
    }
    Tensor g = Tensor::empty(in.shape, in.dtype, in.device, in.format);
    in.leaf->grad = g.impl_ptr();
    *beta = 0;
    return g;
  }
  auto it = tape_->grads_.find(in.id);
  if (it != tape_->grads_.end()) {
    *beta = 1;
    return it->second;
  }
  Tensor g = Tensor::empty(in.shape, in.dtype, in.device, in.format);
  tape_->grads_.emplace(in.id, g);
  *beta = 0;
  return g;
}

void Tape::accumulate(uint64_t id, const Tensor& g) {
  auto it = grads_.find(id);
  if (it == grads_.end()) {
    grads_.emplace(id, g.clone());
    return;
  }
  UNETCU_LAUNCH(g.device(), axpby, it->second, 1.0, g, 1.0);
}

void Tape::backward(const Tensor& loss) {
  UNETCU_CHECK(loss.numel() == 1, "backward(loss) needs a one-element loss, got shape ",
               shape_str(loss.shape()));
  backward({loss}, {Tensor::full(loss.shape(), 1.0, loss.dtype(), loss.device())});
}

void Tape::backward(std::vector<Tensor> outputs, std::vector<Tensor> grad_outputs) {
  UNETCU_CHECK(outputs.size() == grad_outputs.size(), "backward: ", outputs.size(),
               " outputs but ", grad_outputs.size(), " gradients");
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& o = outputs[i];
    const Tensor& g = grad_outputs[i];
    check_same_shape("backward", o, g);
    check_same_dtype_device("backward", o, g);
    UNETCU_CHECK(o.format() == g.format(), "backward: the gradient of an ", format_name(o.format()),
                 " output is ", format_name(g.format()));
    if (!o.requires_grad()) continue;
    if (o.impl().producer == serial_) {
      accumulate(o.id(), g);
    } else if (o.impl().grad) {  // a leaf given directly: its gradient is the seed itself
      Tensor existing(o.impl().grad);
      UNETCU_LAUNCH(g.device(), axpby, existing, 1.0, g, 1.0);
    } else {
      o.impl().grad = g.clone().impl_ptr();
    }
  }
  // Seeded: what the caller moved in goes as the walk frees its gradients.
  outputs.clear();
  grad_outputs.clear();
  // For the leaf-ready hook: the first node (in forward order) reading each leaf. Once the
  // walk back has passed it, that leaf's gradient is final.
  std::unordered_map<const TensorImpl*, size_t> first_use;
  if (leaf_ready_)
    for (size_t i = nodes_.size(); i-- > 0;)
      for (const auto& in : nodes_[i].inputs)
        if (in.leaf && in.requires_grad) first_use[in.leaf.get()] = i;
  for (auto node = nodes_.rbegin(); node != nodes_.rend(); ++node) {
    BackwardContext ctx;
    ctx.tape_ = this;
    ctx.inputs_ = &node->inputs;
    bool any = false;
    for (size_t i = 0; i < node->output_ids.size(); ++i) {
      auto it = grads_.find(node->output_ids[i]);
      if (it != grads_.end()) {
        ctx.grad_outputs_.push_back(it->second);
        any = true;
      } else {
        ctx.grad_outputs_.push_back(Tensor());
      }
    }
    bool needed = false;
    for (const auto& in : node->inputs) needed = needed || in.requires_grad;
    if (any && needed) {
      for (size_t i = 0; i < ctx.grad_outputs_.size(); ++i)
        if (!ctx.grad_outputs_[i].defined())
          ctx.grad_outputs_[i] = Tensor::zeros(node->output_shapes[i], node->output_dtypes[i],
                                                 node->device, node->output_formats[i]);
      if (Profiler::enabled()) {
        BlockScope block(node->block);
        ProfileRange range(std::string(node->name) + ".backward", "backward", node->cost.flops,
                           node->cost.bytes);
        node->backward(ctx);
      } else {
        node->backward(ctx);
      }
    }
    for (uint64_t id : node->output_ids) grads_.erase(id);
    node->backward = nullptr;  // frees the saved activations as soon as they are used
    if (node_done_) node_done_(node->name);
    if (leaf_ready_) {
      const size_t index = size_t(nodes_.rend() - node) - 1;
      for (const auto& in : node->inputs)
        if (in.leaf && in.requires_grad && first_use[in.leaf.get()] == index) {
          first_use[in.leaf.get()] = SIZE_MAX;  // once, even if the node reads it twice
          leaf_ready_(in.leaf.get());
        }
    }
  }
  clear();
}

void Tape::clear() {
  nodes_.clear();
  grads_.clear();
  serial_ = next_tape_serial();
}

}  // namespace unetcu
