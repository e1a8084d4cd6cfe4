#include "parallel/process_pipeline.h"

#include <algorithm>
#include <exception>
#include <map>
#include <set>

#include "engine/profiler.h"
#include "engine/tape.h"
#include "kernels/launchers.h"
#include "parallel/process_communicator.h"

namespace unetcu {

namespace {

// Tags stay below 32768, the smallest MPI_TAG_UB the MPI standard allows.
constexpr int64_t kMaxTag = 32767;

// Broadcasts a tensor on any device: GPU memory goes through a host copy (the process group
// carries host memory).
void broadcast_tensor(ProcessGroup& g, const Tensor& t, int root) {
  if (t.device().is_cpu()) {
    g.broadcast(t.raw(), t.nbytes(), root);
    return;
  }
  Tensor host = t.to(Device::cpu());
  g.broadcast(host.raw(), host.nbytes(), root);
  Tensor(t).copy_(host);
}

}  // namespace

ProcessPipeline::ProcessPipeline(const UNetConfig& model_cfg, const PipelineOptions& options,
                                 const DataParallelOptions& replicas, const OptimizerFactory& make_optimizer)
    : options_(options), replicas_options_(replicas),
      world_(replicas.process_group ? replicas.process_group : world_process_group(replicas.collective_timeout)) {
  UNETCU_CHECK(options.devices.size() == 1, "a pipeline across processes takes one device per process");
  const int W = world_->size(), S = options.pipeline_stages > 0 ? options.pipeline_stages : W;
  stages_ = S;
  UNETCU_CHECK(S >= 2, "pipeline across processes: at least two stages, got ", S);
  UNETCU_CHECK(W % S == 0, "pipeline across processes: ", W, " processes do not make replicas of ", S,
               " stages (the process count must be a multiple of the stage count)");
  UNETCU_CHECK(int(options.cuts.size()) == S - 1, "pipeline across processes: ", S, " stages need ",
               S - 1, " cuts, got ", options.cuts.size());
  UNETCU_CHECK(options.split_size >= 1, "pipeline across processes: the split size must be at least 1, got ",
               options.split_size);
  replicas_ = W / S;
  stage_ = world_->rank() % S;
  replica_ = world_->rank() / S;
  if (options_.threads > 0) set_cpu_threads(options_.threads);

  UNetConfig cfg = model_cfg;
  cfg.device = options.devices[0];
  model_ = std::make_unique<UNet>(cfg);
  const auto& blocks = model_->blocks();
  stage_of_block_ = stages_of_blocks(*model_, options.cuts, "pipeline across processes");
  consumers_.assign(blocks.size(), {});
  for (size_t j = 0; j < blocks.size(); ++j)
    for (int i : blocks[j].inputs)
      if (i >= 0 && stage_of_block_[i] != stage_of_block_[j]) consumers_[i].push_back(stage_of_block_[j]);
  for (auto& c : consumers_) {
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
  }
  // Every stage's optimizer, as in one process, so the checkpoint has the same layout.
  std::vector<std::vector<Tensor>> stage_params(S);
  for (size_t b = 0; b < blocks.size(); ++b)
    for (Module* m : blocks[b].modules)
      for (const Tensor& p : m->parameters()) stage_params[stage_of_block_[b]].push_back(p);
  for (int s = 0; s < S; ++s) {
    UNETCU_CHECK(!stage_params[s].empty(), "pipeline across processes: stage ", s, " has no blocks");
    optimizers_.push_back(make_optimizer(stage_params[s]));
  }
  stage_params_ = stage_params[stage_];

  // Groups of their own, created in the same order on every process.
  ctrl_ = world_->duplicate();
  pipe_ = world_->split(replica_);  // ordered by world rank: rank s is stage s
  std::shared_ptr<ProcessGroup> same_stage = world_->split(stage_);  // rank r is replica r
  UNETCU_CHECK(!replicas.bf16_allreduce || replicas.allreduce != AllReduceAlgo::Mpi,
               "pipeline across processes: the MPI library's own all-reduce has no bfloat16 sum; "
               "bfloat16 gradients take the ring or ps all-reduce");
  if (replicas_ > 1) grads_ = make_process_communicator(same_stage, replicas.allreduce);
}

ProcessPipeline::~ProcessPipeline() = default;

std::vector<Batch> ProcessPipeline::place(const Batch& batch) const {
  std::vector<Arrival> arrivals;
  std::vector<Batch> out = place_ahead(batch, &arrivals);
  for (const Arrival& a : arrivals) a.wait();
  return out;
}

std::vector<Batch> ProcessPipeline::place_ahead(const Batch& batch, std::vector<Arrival>* arrivals) const {
  const int64_t B = batch.size();
  UNETCU_CHECK(B >= 1, "pipeline across processes: an empty batch");
  const int64_t split = std::min<int64_t>(options_.split_size, B);
  // The first stage reads the images, the last the masks: each on this process's device.
  const Device dev = options_.devices[0];
  auto on_device = [&](const Tensor& t, bool needed) {
    if (!needed || t.device() == dev) return t;
    arrivals->push_back(t.upload_ahead(dev));
    return arrivals->back().tensor;
  };
  std::vector<Batch> out;
  for (int64_t lo = 0; lo < B; lo += split) {
    const int64_t hi = std::min<int64_t>(lo + split, B);
    out.push_back({on_device(batch.images.rows(lo, hi), stage_ == 0),
                   on_device(batch.masks.rows(lo, hi), stage_ == stages() - 1)});
  }
  return out;
}

// One step's execution on this process's stage (StageRun); a tensor crosses a cut as a message
// from the producer's process, sent when its forward is done, and its gradient comes back the
// same way.
class ProcessPipeline::Run : public CutTransport {
 public:
  Run(ProcessPipeline& p, const std::vector<Batch>& micro_batches, LossKind loss)
      : p_(p), M_(int(micro_batches.size())), forward_sends_(size_t(M_)),
        stage_(*p.model_, p.stage_of_block_, p.stage_, p.stages(), p.options_.schedule, micro_batches, loss, *this) {
    const int64_t blocks = int64_t(p.model_->blocks().size());
    UNETCU_CHECK(2 * int64_t(M_) * blocks <= kMaxTag, "pipeline across processes: ", M_,
                 " micro-batches are more than the message tags can tell apart (at most ",
                 kMaxTag / (2 * blocks), "); use larger micro-batches");
  }

  void run() {
    stage_.run();
    for (auto& x : sends_) x->wait();  // the buffers are ours until the receivers have them
    sends_.clear();
    for (auto& v : forward_sends_) {  // the last stage's (it sends none) and any left
      for (auto& x : v) x->wait();
      v.clear();
    }
  }

  ~Run() {
    // A stage that failed ends the job (its error is printed, then the process group is
    // aborted): its sends in flight are not waited for, which could outlast the timeout.
    if (std::uncaught_exceptions() > 0) {
      for (auto& x : sends_) x->abandon();
      for (auto& v : forward_sends_)
        for (auto& x : v) x->abandon();
    }
  }

  double loss() {
    double l = 0;
    for (int m = 0; m < M_; ++m) l += stage_.micro_batch(m).loss.item();
    return l;
  }
  int peak_live() const { return stage_.peak_live(); }

  // The schedules' data dependencies order the stages: a receive waits for its message.
  void before_forward(int, int) override {}
  void before_backward(int, int) override {}

  // This stage's copy of `block`'s output for micro-batch m, received once from its producer.
  Tensor receive(int, int m, int block) override {
    MicroBatch& me = stage_.micro_batch(m);
    auto it = me.received.find(block);
    if (it != me.received.end()) return it->second;
    Tensor copy = receive_from(p_.stage_of_block_[block], tag(0, m, block));
    UNETCU_CHECK(copy.defined(), "pipeline across processes: block ", block, " came without data");
    copy.set_requires_grad(true);
    me.received.emplace(block, copy);
    return copy;
  }

  // Each output a later stage reads goes to that stage now.
  void after_forward(int, int m) override {
    for (const auto& [b, out] : stage_.micro_batch(m).outputs)
      for (int c : p_.consumers_[size_t(b)]) send(out.detach(), c, tag(0, m, b), forward_sends_[size_t(m)]);
  }

  // The gradients each consumer sent back, added in stage order.
  Tensor gradient(int, int m, int block) override {
    Tensor sum;
    for (int c : p_.consumers_[size_t(block)]) {
      const Tensor g = receive_from(c, tag(1, m, block));
      if (!g.defined()) continue;
      sum = sum.defined() ? add(sum, g) : g;
    }
    return sum;
  }

  void after_backward(int, int m) override {
    // Every consumer sent its gradients of m, so it has this stage's outputs of m: their
    // sends are done and their buffers go.
    for (auto& x : forward_sends_[size_t(m)]) x->wait();
    forward_sends_[size_t(m)].clear();
    // The gradients of what this stage received go home.
    MicroBatch& me = stage_.micro_batch(m);
    for (const auto& [b, copy] : me.received)
      send(copy.grad(), p_.stage_of_block_[size_t(b)], tag(1, m, b), sends_);
    me.received.clear();
  }

 private:
  // A tensor on its way: the header (defined | (dtype + 1) << 8 | format << 16, ndim, dims) and
  // the data, kept alive until sent. Activations may be bfloat16 and NHWC (mixed precision,
  // channels-last), gradients have their tensor's dtype and format.
  struct Sending {
    int64_t header[6] = {0, 0, 0, 0, 0, 0};
    Tensor data;
    std::unique_ptr<ProcessGroup::Request> header_sent, data_sent;
    void wait() {
      header_sent->wait();
      data_sent->wait();
    }
    // The job is ending: the requests and the buffer are left as they are (never freed while
    // the transport may still read them).
    void abandon() {
      (void)header_sent.release();
      (void)data_sent.release();
      new Tensor(std::move(data));
    }
  };

  int tag(int direction, int m, int block) const {
    return int(block + int64_t(p_.model_->blocks().size()) * (2 * int64_t(m) + direction));
  }

  // Sends `t` (possibly undefined: no gradient) to stage `to` of this replica; kept in `into`
  // until waited for.
  void send(const Tensor& t, int to, int tag, std::vector<std::unique_ptr<Sending>>& into) {
    auto x = std::make_unique<Sending>();
    if (t.defined()) {
      x->header[0] = 1 | (int64_t(t.dtype()) + 1) << 8 | int64_t(t.format()) << 16;
      x->header[1] = int64_t(t.shape().size());
      for (size_t i = 0; i < t.shape().size(); ++i) x->header[2 + i] = t.shape()[i];
      // A GPU tensor goes through host memory (what the process group carries).
      x->data = t.device().is_cpu() ? t : t.to(Device::cpu());
    }
    x->header_sent = p_.pipe_->isend(x->header, sizeof x->header, to, tag);
    x->data_sent = p_.pipe_->isend(t.defined() ? x->data.raw() : nullptr, t.defined() ? x->data.nbytes() : 0, to, tag);
    into.push_back(std::move(x));
  }
  Tensor receive_from(int from, int tag) {
    int64_t header[6] = {0, 0, 0, 0, 0, 0};
    p_.pipe_->recv(header, sizeof header, from, tag);
    if (!header[0]) return Tensor();
    UNETCU_CHECK(header[1] >= 1 && header[1] <= 4, "pipeline across processes: a message from stage ", from,
                 " has ", header[1], " dimensions");
    const int64_t dtype_code = ((header[0] >> 8) & 0xff) - 1, format_code = (header[0] >> 16) & 0xff;
    UNETCU_CHECK((header[0] & 1) && dtype_code >= 0 && dtype_code <= int64_t(DType::BF16) &&
                     format_code <= int64_t(MemoryFormat::NHWC) && (header[1] == 4 || format_code == 0),
                 "pipeline across processes: a message from stage ", from, " has a bad header");
    Shape shape(header + 2, header + 2 + header[1]);
    Tensor t = Tensor::empty(shape, DType(dtype_code), Device::cpu(), MemoryFormat(format_code));
    p_.pipe_->recv(t.raw(), t.nbytes(), from, tag);
    return p_.options_.devices[0].is_cpu() ? t : t.to(p_.options_.devices[0]);
  }

  ProcessPipeline& p_;
  const int M_;
  std::vector<std::unique_ptr<Sending>> sends_;                       // gradients, to the step's end
  std::vector<std::vector<std::unique_ptr<Sending>>> forward_sends_;  // per micro-batch, to its backward
  StageRun stage_;
};

double ProcessPipeline::step(const std::vector<Batch>& micro_batches, LossKind loss_kind) {
  UNETCU_CHECK(!micro_batches.empty(), "pipeline across processes: a step needs at least one micro-batch");
  if (options_.threads > 0) set_cpu_threads(options_.threads);
  Optimizer& opt = *optimizers_[size_t(stage_)];
  opt.zero_grad();
  Run run(*this, micro_batches, loss_kind);
  run.run();
  peak_live_ = run.peak_live();
  if (grads_) {  // the same gradients on every replica of this stage: their mean
    int64_t n = 0;
    for (const Tensor& p : stage_params_) n += p.numel();
    const DType dt = model_->config().dtype;
    // One flat host buffer (the process group carries host memory).
    Tensor flat = Tensor::zeros({n}, dt, Device::cpu());
    const Device dev = options_.devices[0];
    const size_t esize = dtype_size(dt);
    int64_t at = 0;
    for (const Tensor& p : stage_params_) {
      if (p.grad().defined())
        copy_bytes(static_cast<char*>(flat.raw()) + at * int64_t(esize), Device::cpu(), p.grad().raw(), dev,
                   p.grad().nbytes());
      at += p.numel();
    }
    if (replicas_options_.bf16_allreduce) {
      Tensor low = Tensor::empty({n}, DType::BF16, Device::cpu());
      low.copy_(flat);
      grads_->all_reduce(low, ReduceOp::Sum);  // summed in bfloat16, divided in float32
      flat.copy_(low);
      UNETCU_LAUNCH(Device::cpu(), axpby, flat, 1.0 / grads_->size(), flat, 0.0);
    } else {
      grads_->all_reduce(flat, ReduceOp::Average);
    }
    at = 0;
    for (const Tensor& p : stage_params_) {
      if (!p.grad().defined()) p.impl().grad = Tensor::zeros(p.shape(), dt, dev).impl_ptr();
      copy_bytes(p.grad().raw(), dev, static_cast<const char*>(flat.raw()) + at * int64_t(esize), Device::cpu(),
                 p.grad().nbytes());
      at += p.numel();
    }
  }
  if (opt.max_grad_norm() > 0 && stages() > 1) {
    // Clipped by the norm of the whole model's gradients: every stage's square sum in its own
    // slot (the others 0, so the sum is exact in any order), added in stage order here: the
    // total of an in-process pipeline, the same bits on every stage and replica.
    std::vector<double> part(size_t(stages()), 0.0);
    part[size_t(stage_)] = opt.grad_square_sum().item();
    pipe_->all_reduce_sum(part.data(), int64_t(part.size()), DType::F64);
    double total = 0;
    for (double v : part) total += v;
    opt.step_clipped_by(Tensor::full({1}, total, DType::F64, options_.devices[0]));
  } else {
    opt.step();
  }
  // The loss is the last stage's; every process of this replica gets it, then the replicas' mean.
  double loss = stage_ == stages() - 1 ? run.loss() : 0.0;
  pipe_->broadcast(&loss, sizeof loss, stages() - 1);
  if (replicas_ > 1) {
    ctrl_->all_reduce_sum(&loss, 1, DType::F64);
    loss /= double(ctrl_->size());
  }
  return loss;
}

void ProcessPipeline::collect() {
  const auto& blocks = model_->blocks();
  const int S = stages();
  for (int s = 0; s < S; ++s) {
    const int root = s;  // replica 0's process of stage s
    std::set<Module*> seen;
    for (size_t b = 0; b < blocks.size(); ++b) {
      if (stage_of_block_[b] != s) continue;
      for (Module* m : blocks[b].modules) {
        if (!seen.insert(m).second) continue;
        for (const StateEntry& e : m->state()) {
          if (e.tensor.defined())
            broadcast_tensor(*ctrl_, e.tensor, root);
          else if (e.counter)
            ctrl_->broadcast(e.counter, sizeof *e.counter, root);
        }
      }
    }
    Optimizer& opt = *optimizers_[size_t(s)];
    for (size_t i = 0; i < opt.params().size(); ++i) {
      const Optimizer::ParamState st = opt.param_state(i);
      for (const auto& [name, t] : st.tensors) broadcast_tensor(*ctrl_, t, root);
      for (const auto& [name, c] : st.counters) ctrl_->broadcast(c, sizeof *c, root);
    }
  }
}

bool ProcessPipeline::any(bool mine) {
  double v = mine ? 1 : 0;
  ctrl_->all_reduce_sum(&v, 1, DType::F64);
  return v > 0;
}

}  // namespace unetcu
