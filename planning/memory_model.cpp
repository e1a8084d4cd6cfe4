#include "planning/memory_model.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "engine/tape.h"
#include "runtime/allocator.h"
#include "runtime/cuda_api.h"

namespace unetcu {

namespace {

// The device's tensors now, and the most since the last reset.
struct Meter {
  Device dev;
  AllocatorStats stats() const {
    if (dev.is_cuda()) {
      cuda::synchronize(dev.index);
      return cuda::device_memory_stats(dev.index);
    }
    return HostAllocator::device_stats(dev.index);
  }
  double held() const { return double(stats().current_bytes); }
  double peak() const { return double(stats().peak_bytes); }
  void reset() const {
    if (dev.is_cuda())
      cuda::reset_device_peak(dev.index);
    else
      HostAllocator::reset_peak();
  }
};

// One step's measurements at one batch size (absolute bytes, above the step's start).
struct StepMemory {
  double before = 0, batch = 0, loss = 0, gradients = 0, optimizer = 0;
  std::vector<double> cumulative;  // held above the start after each block's forward
  std::vector<double> output;      // each block's output
  std::vector<double> backward;    // the most held above the start while its backward ran
};

StepMemory measure_step(UNet& model, Optimizer& optimizer, LossKind loss_kind, const Batch& b) {
  const Device dev = model.parameters()[0].device();
  const Meter m{dev};
  const auto& blocks = model.blocks();
  StepMemory s;
  optimizer.zero_grad();
  const double empty = m.held();
  // Placed as a strategy places it: a copy on a GPU, the loader's own tensors on a CPU device.
  const Tensor images = b.images.device() == dev ? b.images : b.images.to(dev);
  const Tensor masks = b.masks.device() == dev ? b.masks : b.masks.to(dev);
  const double start = m.held();
  s.before = empty;
  s.batch = start - empty;
  Tape tape;
  std::vector<Tensor> outs(blocks.size());
  std::vector<size_t> first_node(blocks.size() + 1);
  Tensor loss;
  {
    TapeScope scope(tape);
    for (size_t k = 0; k < blocks.size(); ++k) {
      first_node[k] = tape.size();
      std::vector<Tensor> in;
      for (int i : blocks[k].inputs) in.push_back(i < 0 ? images : outs[i]);
      outs[k] = blocks[k].forward(in);
      s.cumulative.push_back(m.held() - start);
      s.output.push_back(double(outs[k].nbytes()));
    }
    first_node[blocks.size()] = tape.size();
    loss = segmentation_loss(loss_kind, outs.back(), masks);
    s.loss = m.held() - start - s.cumulative.back();
  }
  // Each backward node's peak goes to its block (the loss's nodes to the last block).
  const size_t nodes = tape.size();
  std::vector<double> node_peak(nodes, 0);
  size_t done = 0;
  tape.set_node_done_hook([&](const char*) {
    node_peak[nodes - 1 - done++] = m.peak() - start;
    m.reset();
  });
  outs.clear();  // the tape holds what the backward needs; the last block's output too
  m.reset();
  tape.backward(loss);
  loss = Tensor();
  s.backward.assign(blocks.size(), 0);
  for (size_t k = 0; k < blocks.size(); ++k) {
    const size_t end = k + 1 == blocks.size() ? nodes : first_node[k + 1];
    for (size_t i = first_node[k]; i < end; ++i) s.backward[k] = std::max(s.backward[k], node_peak[i]);
  }
  s.gradients = m.held() - start;
  m.reset();
  optimizer.step();
  s.optimizer = m.peak() - m.held();
  return s;
}

}  // namespace

MemoryProfile profile_memory(UNet& model, Optimizer& optimizer, LossKind loss, const Batch& b1,
                             const Batch& b2) {
  const double n1 = double(b1.size()), n2 = double(b2.size());
  UNETCU_CHECK(n2 > n1 && n1 >= 1, "profile_memory: two batch sizes, the second larger");
  measure_step(model, optimizer, loss, b1);  // the optimizer's state is made
  const StepMemory a = measure_step(model, optimizer, loss, b1);
  measure_step(model, optimizer, loss, b2);
  const StepMemory c = measure_step(model, optimizer, loss, b2);
  const auto slope = [&](double x1, double x2) { return std::max(0.0, (x2 - x1) / (n2 - n1)); };
  MemoryProfile p;
  p.before = std::max(a.before, c.before);
  p.batch = c.batch / n2;  // on a GPU its copy; a CPU device reads the loader's host batch
  p.loss = c.loss / n2;
  p.gradients = std::max(a.gradients, c.gradients);
  p.optimizer = std::max(a.optimizer, c.optimizer);
  const auto& blocks = model.blocks();
  for (size_t k = 0; k < blocks.size(); ++k) {
    BlockMemory b;
    b.name = blocks[k].name;
    b.inputs = blocks[k].inputs;
    const double kc = c.cumulative[k] - (k ? c.cumulative[k - 1] : 0);
    b.kept = kc / n2;  // what a block keeps grows with the batch from zero
    b.output = c.output[k] / n2;
    b.backward = slope(a.backward[k], c.backward[k]);
    b.backward_fixed = std::max(0.0, c.backward[k] - b.backward * n2);
    p.blocks.push_back(b);
  }
  return p;
}

namespace {

struct Parts {
  double before, batch, forward, backward, optimizer;
  int backward_block;
};

Parts parts_of(const MemoryProfile& p, int batch, const std::vector<bool>& recompute) {
  const double B = batch;
  const size_t n = p.blocks.size();
  const auto on = [&](size_t k) { return !recompute.empty() && recompute[k]; };
  // What each block keeps through the forward: all it saved, or only its output.
  std::vector<double> kept(n);
  for (size_t k = 0; k < n; ++k) kept[k] = (on(k) ? p.blocks[k].output : p.blocks[k].kept) * B;
  Parts r{p.before, p.batch * B, 0, 0, p.gradients + p.optimizer, -1};
  for (size_t k = 0; k < n; ++k) r.forward += kept[k];
  r.forward += p.loss * B;
  // Block k's backward, measured without recomputation: less what the earlier recomputed blocks
  // no longer keep; its own internals are back (recomputed), with its output a second time.
  double saved_before = 0;  // what recomputed blocks before k do not keep
  for (size_t k = 0; k < n; ++k) {
    const BlockMemory& b = p.blocks[k];
    double v = b.backward * B + b.backward_fixed - saved_before;
    if (on(k)) {
      v += b.output * B;
      for (int i : b.inputs) v += (i < 0 ? p.batch : p.blocks[size_t(i)].output) * B;
    }
    if (v > r.backward) {
      r.backward = v;
      r.backward_block = int(k);
    }
    if (on(k)) saved_before += (b.kept - b.output) * B;
  }
  return r;
}

}  // namespace

double predict_step_peak(const MemoryProfile& p, int batch, const std::vector<bool>& recompute) {
  const Parts r = parts_of(p, batch, recompute);
  return r.before + r.batch + std::max({r.forward, r.backward, r.optimizer});
}

std::string memory_report(const MemoryProfile& p, int batch, const std::vector<bool>& recompute) {
  const Parts r = parts_of(p, batch, recompute);
  const auto mib = [](double b) { return b / (1 << 20); };
  char line[256];
  std::ostringstream os;
  std::snprintf(line, sizeof line,
                "before the step %.1f MiB (parameters, optimizer state, buffers), batch %.1f MiB\n",
                mib(r.before), mib(r.batch));
  os << line;
  std::snprintf(line, sizeof line, "end of the forward +%.1f MiB; backward at most +%.1f MiB (%s); "
                "optimizer step +%.1f MiB\n", mib(r.forward), mib(r.backward),
                r.backward_block >= 0 ? p.blocks[size_t(r.backward_block)].name.c_str() : "-",
                mib(r.optimizer));
  os << line;
  std::snprintf(line, sizeof line, "predicted peak %.1f MiB\n", mib(predict_step_peak(p, batch, recompute)));
  os << line;
  return os.str();
}

}  // namespace unetcu
