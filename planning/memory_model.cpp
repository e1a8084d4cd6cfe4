#include "planning/memory_model.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <sstream>

#include "engine/tape.h"
#include "planning/block_walk.h"
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
  double before = 0, batch = 0, loss = 0, gradients = 0, optimizer = 0, images = 0, masks = 0;
  std::vector<double> cumulative;  // held above the start after each block's forward
  std::vector<double> output;      // each block's output
  std::vector<double> forward;     // the most held above the tape before it while its forward ran
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
  s.images = double(b.images.nbytes());
  s.masks = double(b.masks.nbytes());
  Tape tape;
  BlockWalk walk;
  Tensor loss;
  {
    TapeScope scope(tape);
    walk = walk_blocks(model, tape, images, [&](size_t k, const std::vector<Tensor>& in) {
      const double tape_before = m.held() - start;
      m.reset();
      Tensor out = model.run_block(k, in);
      s.forward.push_back(m.peak() - start - tape_before);
      s.cumulative.push_back(m.held() - start);
      s.output.push_back(double(out.nbytes()));
      return out;
    });
    loss = segmentation_loss(loss_kind, walk.outputs.back(), masks);
    s.loss = m.held() - start - s.cumulative.back();
  }
  const std::vector<size_t>& first_node = walk.first_node;
  // Each backward node's peak goes to its block (the loss's nodes to the last block).
  const size_t nodes = tape.size();
  std::vector<double> node_peak(nodes, 0);
  size_t done = 0;
  tape.set_node_done_hook([&](const char*) {
    node_peak[nodes - 1 - done++] = m.peak() - start;
    m.reset();
  });
  walk.outputs.clear();  // the tape holds what the backward needs; the last block's output too
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
  const std::vector<bool> kept_recompute = model.recompute();
  model.set_recompute({});  // the plain steps first
  measure_step(model, optimizer, loss, b1);  // the optimizer's state is made
  const StepMemory a = measure_step(model, optimizer, loss, b1);
  measure_step(model, optimizer, loss, b2);
  const StepMemory c = measure_step(model, optimizer, loss, b2);
  // Again with every block recomputed: a recomputed block's own backward.
  model.set_recompute(std::vector<bool>(model.blocks().size(), true));
  StepMemory ra, rc;
  try {
    ra = measure_step(model, optimizer, loss, b1);
    rc = measure_step(model, optimizer, loss, b2);
  } catch (...) {
    model.set_recompute(kept_recompute);
    throw;
  }
  model.set_recompute(kept_recompute);
  const auto slope = [&](double x1, double x2) { return std::max(0.0, (x2 - x1) / (n2 - n1)); };
  MemoryProfile p;
  p.before = std::max(a.before, c.before);
  p.batch = c.batch / n2;  // on a GPU its copy; a CPU device reads the loader's host batch
  p.images = c.images / n2;
  p.masks = c.masks / n2;
  p.loss = c.loss / n2;
  p.gradients = std::max(a.gradients, c.gradients);
  p.optimizer = std::max(a.optimizer, c.optimizer);
  const auto& blocks = model.blocks();
  const size_t n = blocks.size();
  double statics = 0;
  for (size_t k = 0; k < n; ++k) {
    BlockMemory b;
    b.name = blocks[k].name;
    b.inputs = blocks[k].inputs;
    const double kc = c.cumulative[k] - (k ? c.cumulative[k - 1] : 0);
    b.kept = kc / n2;  // what a block keeps grows with the batch from zero
    b.output = c.output[k] / n2;
    b.backward = slope(a.backward[k], c.backward[k]);
    b.backward_fixed = std::max(0.0, c.backward[k] - b.backward * n2);
    b.forward = slope(a.forward[k], c.forward[k]);
    b.forward_fixed = std::max(0.0, c.forward[k] - b.forward * n2);
    for (const Module* m : blocks[k].modules)
      for (const StateEntry& e : m->state()) {
        if (!e.tensor.defined()) continue;
        b.statics += double(e.tensor.nbytes());
        if (e.is_parameter) b.params += double(e.tensor.nbytes());
      }
    statics += b.statics;
    p.blocks.push_back(b);
  }
  p.state = std::max(0.0, p.before - statics);
  // Block k's residual: its backward less the earlier blocks' tape and the gradients of the
  // parameters of blocks k.. (the backward runs from the last block to the first).
  std::vector<double> grads_from(n + 1, 0);
  for (size_t k = n; k-- > 0;) grads_from[k] = grads_from[k + 1] + p.blocks[k].params;
  for (size_t k = 0; k < n; ++k) {
    const auto rest = [&](const StepMemory& s) {
      return s.backward[k] - (k ? s.cumulative[k - 1] : 0) - grads_from[k];
    };
    BlockMemory& b = p.blocks[k];
    b.residual = slope(rest(a), rest(c));
    b.residual_fixed = rest(c) - b.residual * n2;
    b.recomputed = slope(rest(ra), rest(rc));
    b.recomputed_fixed = rest(rc) - b.recomputed * n2;
  }
  return p;
}

bool copies_batch(const Device& d) { return d.is_cuda() || d.index != 0; }

namespace {

// One device's step: what it holds from start to end, and the most above that in the forward,
// in a block's backward and in the optimizer step.
struct Parts {
  Device device;
  std::string what;  // "one device", "replica 1", "stage 0 (stem..layer2)"
  double base = 0, forward = 0, backward = 0, optimizer = 0;
  int backward_block = -1;
  double peak() const { return base + std::max({forward, backward, optimizer}); }
};

// Blocks [lo, hi) on one device, on micro-batches of m samples: `held` of them on the tape at
// the end of the forward and at the first backward, `next_held` at the second (0: there is
// none). grads_resident: the gradients live through the step (DP's buckets). `inputs` bytes of
// the batch are copied onto the device.
Parts device_parts(const MemoryProfile& p, const std::vector<bool>& recompute, size_t lo, size_t hi,
                   double m, int held, int next_held, bool grads_resident, double inputs) {
  const auto on = [&](size_t k) { return !recompute.empty() && recompute[k]; };
  const auto keeps = [&](size_t k) { return on(k) ? p.blocks[k].output : p.blocks[k].kept; };
  const size_t n = p.blocks.size();
  double all_params = 0, params = 0, statics = 0;
  for (size_t k = 0; k < n; ++k) all_params += p.blocks[k].params;
  for (size_t k = lo; k < hi; ++k) params += p.blocks[k].params, statics += p.blocks[k].statics;
  const double share = all_params > 0 ? params / all_params : 1;
  Parts r;
  r.base = (lo == 0 && hi == n ? p.before : statics + p.state * share) + inputs + (grads_resident ? params : 0);
  // The outputs of other devices' blocks this one reads: its copies, one per micro-batch.
  std::set<int> received;
  for (size_t k = lo; k < hi; ++k)
    for (int i : p.blocks[k].inputs)
      if (i >= 0 && size_t(i) < lo) received.insert(i);
  double copies = 0;
  for (int i : received) copies += p.blocks[size_t(i)].output * m;
  double one = copies + (hi == n ? p.loss * m : 0);  // a micro-batch's, after its forward
  for (size_t k = lo; k < hi; ++k) one += keeps(k) * m;
  // The end of the forward, and each block's forward on the last micro-batch to come.
  r.forward = held * one;
  double ahead = copies;
  for (size_t k = lo; k < hi; ++k) {
    const BlockMemory& b = p.blocks[k];
    r.forward = std::max(r.forward, (held - 1) * one + ahead + b.forward * m + b.forward_fixed);
    ahead += keeps(k) * m;
  }
  // Block k's backward on the first micro-batch finds `held` micro-batches on the tape and
  // the gradients of the blocks after it; on the next one (if any), one micro-batch fewer
  // (GPipe; 1F1B as many as the schedule keeps) and every gradient of the device made, with
  // the first micro-batch's copies and their gradients still here until their producers'
  // backward takes them.
  double tape = copies;  // this micro-batch's: the copies, and what the blocks before k keep
  double grads = params;  // of blocks k.. on this device
  for (size_t k = lo; k < hi; ++k) {
    const BlockMemory& b = p.blocks[k];
    const double own = on(k) ? b.recomputed * m + b.recomputed_fixed : b.residual * m + b.residual_fixed;
    double v = (held - 1) * one + tape + own + (grads_resident ? 0 : grads);
    if (next_held > 0)
      v = std::max(v, (next_held - 1) * one + tape + own + (grads_resident ? 0 : params) + 2 * copies);
    if (v > r.backward) r.backward = v, r.backward_block = int(k);
    tape += keeps(k) * m;
    grads -= b.params;
  }
  r.optimizer = (grads_resident ? 0 : p.gradients * share) + p.optimizer * share;
  return r;
}

std::vector<Parts> plan_parts(const MemoryProfile& p, const MemoryPlan& plan) {
  const size_t n = p.blocks.size();
  UNETCU_CHECK(plan.recompute.empty() || plan.recompute.size() == n, "memory plan: ", plan.recompute.size(),
               " recompute flags for ", n, " blocks");
  UNETCU_CHECK(plan.batch >= 1, "memory plan: a batch of at least one sample");
  const auto device = [&](size_t i) { return i < plan.devices.size() ? plan.devices[i] : Device::cpu(); };
  // Whether device i holds a copy of its part of the batch: as profiled where none is named.
  const auto copied = [&](size_t i) { return plan.devices.empty() ? p.batch > 0 : copies_batch(plan.devices[i]); };
  const double B = plan.batch;
  std::vector<Parts> out;
  if (plan.kind == MemoryPlan::Single || plan.kind == MemoryPlan::DataParallel) {
    const bool dp = plan.kind == MemoryPlan::DataParallel;
    const size_t N = dp ? (plan.devices.empty() ? size_t(std::max(1, plan.replicas)) : plan.devices.size()) : 1;
    UNETCU_CHECK(dp || plan.devices.size() <= 1, "memory plan: one device, ", plan.devices.size(), " named");
    for (size_t i = 0; i < N; ++i) {
      Parts r = device_parts(p, plan.recompute, 0, n, B, 1, plan.chunks > 1 ? 1 : 0, dp,
                             copied(i) ? (p.images + p.masks) * B * plan.chunks : 0);
      r.device = device(i);
      r.what = dp ? str_cat("replica ", i) : std::string("one device");
      out.push_back(r);
    }
    return out;
  }
  const size_t S = plan.cuts.size() + 1;
  UNETCU_CHECK(plan.split_size >= 1, "memory plan: a split size of at least one sample");
  UNETCU_CHECK(plan.devices.empty() || plan.devices.size() == S, "memory plan: ", S, " stages on ",
               plan.devices.size(), " devices");
  const int m = std::min(plan.split_size, plan.batch);
  const int M = (plan.batch + m - 1) / m;
  for (size_t s = 0; s < S; ++s) {
    const size_t lo = s ? size_t(plan.cuts[s - 1]) : 0, hi = s + 1 < S ? size_t(plan.cuts[s]) : n;
    UNETCU_CHECK(lo < hi && hi <= n, "memory plan: the cuts must increase within the ", n, " blocks");
    const int held = plan.schedule == Schedule::GPipe ? M : std::min(M, int(S - s));
    const int next_held = M < 2 ? 0 : plan.schedule == Schedule::GPipe ? M - 1 : std::min(M - 1, int(S - s));
    double inputs = 0;
    if (s == 0 && copied(0)) inputs += p.images * B;
    if (s + 1 == S && copied(S - 1)) inputs += p.masks * B;
    Parts r = device_parts(p, plan.recompute, lo, hi, m, held, next_held, false, inputs);
    r.device = device(s);
    r.what = str_cat("stage ", s, " (", p.blocks[lo].name, "..", p.blocks[hi - 1].name, ")");
    out.push_back(r);
  }
  return out;
}

}  // namespace

std::vector<double> predict_peaks(const MemoryProfile& p, const MemoryPlan& plan) {
  std::vector<double> out;
  for (const Parts& r : plan_parts(p, plan)) out.push_back(r.peak());
  return out;
}

double most_on_a_device(const MemoryProfile& p, const MemoryPlan& plan) {
  const std::vector<double> peaks = predict_peaks(p, plan);
  if (plan.devices.empty()) return *std::max_element(peaks.begin(), peaks.end());
  double most = 0;
  for (size_t i = 0; i < peaks.size(); ++i) {
    double on = 0;
    for (size_t j = 0; j < peaks.size(); ++j)
      if (plan.devices[j] == plan.devices[i]) on += peaks[j];
    most = std::max(most, on);
  }
  return most;
}

double predict_step_peak(const MemoryProfile& p, int batch, const std::vector<bool>& recompute) {
  MemoryPlan plan;
  plan.batch = batch;
  plan.recompute = recompute;
  return predict_peaks(p, plan).at(0);
}

std::string memory_report(const MemoryProfile& p, const MemoryPlan& plan) {
  const auto mib = [](double b) { return b / (1 << 20); };
  char line[400];
  std::ostringstream os;
  for (const Parts& r : plan_parts(p, plan)) {
    const std::string on = plan.devices.empty() ? std::string() : " on " + r.device.str();
    std::snprintf(line, sizeof line,
                  "%s%s: %.1f MiB held through the step; end of the forward +%.1f MiB; backward at most "
                  "+%.1f MiB (%s); optimizer step +%.1f MiB; predicted peak %.1f MiB\n",
                  r.what.c_str(), on.c_str(), mib(r.base), mib(r.forward), mib(r.backward),
                  r.backward_block >= 0 ? p.blocks[size_t(r.backward_block)].name.c_str() : "-",
                  mib(r.optimizer), mib(r.peak()));
    os << line;
  }
  return os.str();
}

std::string memory_report(const MemoryProfile& p, int batch, const std::vector<bool>& recompute) {
  MemoryPlan plan;
  plan.batch = batch;
  plan.recompute = recompute;
  return memory_report(p, plan);
}

}  // namespace unetcu
