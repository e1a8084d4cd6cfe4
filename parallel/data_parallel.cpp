#include "parallel/data_parallel.h"
#include "parallel/nccl_communicator.h"
#include "parallel/process_communicator.h"

#include <omp.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "engine/profiler.h"
#include "engine/tape.h"
#include "kernels/launchers.h"
#include "runtime/cuda_api.h"
#include "parallel/nccl_communicator.h"
#include "parallel/worker_pool.h"

namespace unetcu {

// ---- a replica and its gradient buckets ---------------------------------------------------

namespace {

class CommBatchNormSync : public BatchNormSync {
 public:
  explicit CommBatchNormSync(Communicator* c) : comm_(c) {}
  void all_reduce_sum(Tensor& t) override { comm_->all_reduce(t, ReduceOp::Sum); }
  int world_size() const override { return comm_->size(); }

 private:
  Communicator* comm_;
};

struct Bucket {
  std::vector<int> params;        // indices into the replica's parameter list
  std::vector<int64_t> offsets;   // element offset of each gradient in the flat buffer
  int64_t numel = 0;
};

}  // namespace

struct DataParallel::Replica {
  Device device;
  std::unique_ptr<UNet> model;
  std::unique_ptr<Optimizer> opt;
  // grad_comm carries the gradient buckets (asynchronous, on the communication thread/stream);
  // ctrl_comm the compute thread's own collectives (BN buffers, synchronized BN). Two groups,
  // so a rank still broadcasting buffers never pairs with a neighbour's bucket.
  std::unique_ptr<Communicator> grad_comm, ctrl_comm;
  std::unique_ptr<CommBatchNormSync> bn_sync;
  std::vector<Tensor> params;
  std::unordered_map<const TensorImpl*, int> param_index;
  std::vector<Bucket> buckets;
  std::vector<int> bucket_of;  // per parameter
  std::vector<Tensor> flat;    // per bucket, on the replica's device: the gradients live here
  std::vector<Tensor> low;     // per bucket with bf16_allreduce: the bfloat16 copy that travels
  Tensor buffers;              // the BN running statistics, packed (pack_buffers)
  // per step
  std::vector<int> ready_in_bucket;
  std::vector<std::unique_ptr<Work>> work;
  size_t next_launch = 0;
};

// Each gradient starts 256 bytes (64 elements) into its bucket after the previous one: the
// gradients are written in place by cuDNN and the GEMMs, which want aligned pointers (the head's
// bias alone, 1 element, would leave every later gradient of its bucket 4-byte aligned). The
// padding stays zero and is averaged harmlessly.
constexpr int64_t kGradAlignElements = 64;
static int64_t aligned_numel(int64_t n) {  // n rounded up to whole 256-byte steps
  return (n + kGradAlignElements - 1) / kGradAlignElements * kGradAlignElements;
}

static std::vector<Bucket> make_buckets(const std::vector<Tensor>& params, size_t first_bytes,
                                        size_t bytes) {
  std::vector<Bucket> out;
  size_t limit = first_bytes;
  for (int i = int(params.size()) - 1; i >= 0; --i) {  // reverse order: backward's order
    if (out.empty() || size_t(out.back().numel) * dtype_size(params[i].dtype()) >= limit) {
      if (!out.empty()) limit = bytes;
      out.emplace_back();
    }
    Bucket& b = out.back();
    b.params.push_back(i);
    b.offsets.push_back(b.numel);
    b.numel += aligned_numel(params[i].numel());
  }
  return out;
}

Tensor pack_buffers(const Module& model) {
  std::vector<Tensor> buffers;
  for (const StateEntry& e : model.state())
    if (!e.is_parameter && e.tensor.defined()) buffers.push_back(e.tensor);
  if (buffers.empty()) return Tensor();
  int64_t total = 0;
  std::vector<int64_t> offsets;
  for (const Tensor& b : buffers) {
    UNETCU_CHECK(b.dtype() == buffers[0].dtype() && b.device() == buffers[0].device(),
                 "pack_buffers: buffers of one model differ in dtype or device (",
                 dtype_name(b.dtype()), " on ", b.device().str(), ", ", dtype_name(buffers[0].dtype()),
                 " on ", buffers[0].device().str(), ")");
    offsets.push_back(total);
    total += aligned_numel(b.numel());
  }
  Tensor flat = Tensor::zeros({total}, buffers[0].dtype(), buffers[0].device());
  for (size_t i = 0; i < buffers.size(); ++i) {
    Tensor slot = flat.view_at(offsets[i], buffers[i].shape());
    slot.copy_(buffers[i]);
    // Re-pointed in the shared TensorImpl, so the module's own handle reads the slot.
    buffers[i].impl().storage = slot.impl().storage;
    buffers[i].impl().offset = slot.impl().offset;
  }
  return flat;
}

void DataParallelOptions::check() const {
  UNETCU_CHECK(collective_timeout > 0 && collective_timeout <= 7 * 24 * 3600.0, setting("collective_timeout"),
               " must be between 0 and 604800 seconds, got ", collective_timeout);
  UNETCU_CHECK(!bf16_allreduce || allreduce != AllReduceAlgo::Mpi, setting("allreduce_precision"), " bf16 needs ",
               setting("allreduce"), " ring or ps: the transport library's own all-reduce has no bfloat16 sum");
  UNETCU_CHECK(allreduce != AllReduceAlgo::Mpi || across_processes, setting("allreduce"),
               " mpi is the transport library's own all-reduce, for ranks in several processes: start them with "
               "mpirun, srun or torchrun (in one process use ring or ps)");
}

DataParallel::DataParallel(const UNetConfig& model_cfg, const DataParallelOptions& options,
                           const OptimizerFactory& make_optimizer)
    : options_(options), graph_(options.cuda_graphs, int(options.devices.size())) {
  const int N = int(options.devices.size());
  UNETCU_CHECK(N >= 1, "data parallelism needs at least one device");
  for (int r = 0; r < N; ++r)
    for (int q = 0; q < r; ++q)
      UNETCU_CHECK(options.devices[q] != options.devices[r], "data parallelism: device ",
                   options.devices[r].str(), " is given twice (one replica per device)");
  for (const Device& d : options.devices)
    UNETCU_CHECK(d.kind == options.devices[0].kind,
                 "data parallelism: the replicas must be all on CPU devices or all on GPUs");
  UNETCU_CHECK(!options.cuda_graphs || options.devices[0].is_cuda(),
               "CUDA graphs need GPU replicas; ", device_list_str(options.devices), " run eagerly");
  UNETCU_CHECK(options.accumulate_rows >= 0, "data parallelism: chunks of ", options.accumulate_rows,
               " rows for gradient accumulation");
  UNETCU_CHECK(!options.bf16_allreduce || options.allreduce != AllReduceAlgo::Mpi,
               "data parallelism: the MPI library's own all-reduce has no bfloat16 sum; bfloat16 "
               "gradients take the ring or ps all-reduce");
  if (options_.threads <= 0)
    options_.threads = std::max(1, omp_get_num_procs() / N);
  for (int r = 0; r < N; ++r) {
    auto rep = std::make_unique<Replica>();
    rep->device = options.devices[r];
    UNetConfig cfg = model_cfg;
    cfg.device = rep->device;
    rep->model = std::make_unique<UNet>(cfg);
    rep->params = rep->model->parameters();
    rep->buffers = pack_buffers(*rep->model);
    rep->opt = make_optimizer(rep->params);
    for (size_t i = 0; i < rep->params.size(); ++i) rep->param_index[rep->params[i].impl_ptr().get()] = int(i);
    rep->buckets = make_buckets(rep->params, options.first_bucket_bytes, options.bucket_bytes);
    rep->bucket_of.assign(rep->params.size(), -1);
    for (size_t k = 0; k < rep->buckets.size(); ++k) {
      const Bucket& b = rep->buckets[k];
      rep->flat.push_back(Tensor::zeros({b.numel}, model_cfg.dtype, rep->device));
      if (options.bf16_allreduce) rep->low.push_back(Tensor::zeros({b.numel}, DType::BF16, rep->device));
      // Each parameter's gradient is a view into its bucket: backward accumulates into it.
      for (size_t j = 0; j < b.params.size(); ++j) {
        rep->bucket_of[b.params[j]] = int(k);
        const Tensor& p = rep->params[b.params[j]];
        p.impl().grad = rep->flat[k].view_at(b.offsets[j], p.shape()).impl_ptr();
      }
    }
    replicas_.push_back(std::move(rep));
  }
  connect();
  pool_ = std::make_unique<WorkerPool>(options.devices, options_.threads, "compute replica");
  replicate_rank0();  // every replica starts from rank 0's parameters and buffers
}

// The replicas' gradient and control groups (again after a failed CUDA graph capture: the old
// ones are released first, their collectives all finished).
void DataParallel::connect() {
  const int N = int(replicas_.size());
  const DataParallelOptions& options = options_;
  for (auto& rep : replicas_) {
    rep->bn_sync.reset();
    rep->grad_comm.reset();
    rep->ctrl_comm.reset();
  }
  std::vector<std::unique_ptr<Communicator>> grad_comms, ctrl_comms;
  if (options.across_processes) {
    UNETCU_CHECK(N == 1, "data parallelism across processes: one device per process, got ",
                 device_list_str(options.devices));
    std::shared_ptr<ProcessGroup> base = options.process_group;
    if (options.devices[0].is_cuda()) {
      // NCCL between the processes' GPUs; the CPU group, if any, only carries the unique ids.
      if (!base && !nccl_rendezvous_from_environment()) base = world_process_group(options.collective_timeout);
      const int rank = base ? base->rank() : options.process_rank;
      const int world = base ? base->size() : options.process_count;
      const int dev = options.devices[0].index;
      auto comms = make_nccl_process_communicators(
          dev, rank, world, base.get(), {options.allreduce, AllReduceAlgo::Ring}, options.collective_timeout);
      grad_comms.push_back(std::move(comms[0]));
      ctrl_comms.push_back(std::move(comms[1]));
    } else {
      // Two groups of their own, so gradients and control never pair up.
      if (!base) base = world_process_group(options.collective_timeout);
      grad_comms.push_back(make_process_communicator(base->duplicate(), options.allreduce));
      ctrl_comms.push_back(make_process_communicator(base->duplicate(), AllReduceAlgo::Ring));
    }
  } else if (options.devices[0].is_cuda()) {
    std::vector<int> ids;
    for (const Device& d : options.devices) ids.push_back(d.index);
    grad_comms = make_nccl_communicators(ids, options.allreduce, options.collective_timeout);
    ctrl_comms = make_nccl_communicators(ids, AllReduceAlgo::Ring, options.collective_timeout);
  } else {
    grad_comms = make_cpu_communicators(N, options.allreduce, options.collective_timeout);
    ctrl_comms = make_cpu_communicators(N, AllReduceAlgo::Ring, options.collective_timeout);
  }
  for (int r = 0; r < N; ++r) {
    Replica& rep = *replicas_[r];
    rep.grad_comm = std::move(grad_comms[r]);
    rep.ctrl_comm = std::move(ctrl_comms[r]);
    if (options.sync_bn) rep.bn_sync = std::make_unique<CommBatchNormSync>(rep.ctrl_comm.get());
  }
}

void DataParallel::replicate_rank0() {
  run([&](int r) {
    Replica& rep = *replicas_[r];
    for (const StateEntry& e : rep.model->state()) {
      if (!e.is_parameter || !e.tensor.defined()) continue;
      Tensor t = e.tensor;
      rep.ctrl_comm->broadcast(t, 0);
    }
    if (rep.buffers.defined()) rep.ctrl_comm->broadcast(rep.buffers, 0);
    for (size_t i = 0; i < rep.params.size(); ++i) {
      const Optimizer::ParamState st = rep.opt->param_state(i);
      for (const auto& [name, tensor] : st.tensors) {
        Tensor t = tensor;
        rep.ctrl_comm->broadcast(t, 0);
      }
    }
  });
  // Host-side integers (BN batch counters, optimizer step counts): copied from rank 0.
  const auto state0 = replicas_[0]->model->state();
  for (int r = 1; r < size(); ++r) {
    const auto state = replicas_[r]->model->state();
    for (size_t i = 0; i < state.size(); ++i)
      if (state[i].counter) *state[i].counter = *state0[i].counter;
    for (size_t i = 0; i < replicas_[r]->params.size(); ++i) {
      const auto c0 = replicas_[0]->opt->param_state(i).counters;
      const auto c = replicas_[r]->opt->param_state(i).counters;
      for (size_t k = 0; k < c.size(); ++k) *c[k].second = *c0[k].second;
    }
  }
}

Optimizer& DataParallel::optimizer(int rank) { return *replicas_.at(rank)->opt; }

DataParallel::~DataParallel() = default;

int DataParallel::size() const { return int(replicas_.size()); }
int DataParallel::global_rank() const { return replicas_[0]->ctrl_comm->rank(); }
int DataParallel::global_size() const { return replicas_[0]->ctrl_comm->size(); }

double DataParallel::average_across_processes(double value) {
  if (!options_.across_processes) return value;
  // On the replica's device (NCCL reduces GPU memory); float32 there, float64 on the CPU.
  const Device dev = options_.devices[0];
  Tensor t = Tensor::full({1}, value, dev.is_cuda() ? DType::F32 : DType::F64, dev);
  replicas_[0]->ctrl_comm->all_reduce(t, ReduceOp::Average);
  return dev.is_cuda() ? t.to(Device::cpu()).item() : t.item();
}

Tensor DataParallel::average_across_processes(const Tensor& value) {
  const Device dev = options_.devices[0];
  UNETCU_CHECK(value.numel() == 1 && value.device() == dev, "average_across_processes takes one value on ",
               dev.str());
  Tensor t = value.to(dev.is_cuda() ? DType::F32 : DType::F64);
  if (t.raw() == value.raw()) t = t.clone();  // the caller's tensor stays as it was
  if (options_.across_processes) replicas_[0]->ctrl_comm->all_reduce(t, ReduceOp::Average);
  return t;
}
UNet& DataParallel::replica(int rank) { return *replicas_.at(rank)->model; }
void DataParallel::check_communicators() const {
  for (const auto& rep : replicas_) {
    rep->grad_comm->check_healthy();
    rep->ctrl_comm->check_healthy();
  }
}
size_t DataParallel::bucket_count() const { return replicas_[0]->buckets.size(); }
std::vector<Tensor> DataParallel::buckets(int rank) const { return replicas_.at(rank)->flat; }
void DataParallel::run(const std::function<void(int)>& f) {
  // A rank that fails aborts the communicators (once), so the others leave their collectives
  // with an error instead of waiting for it forever; the first failure is the one reported.
  std::mutex mu;
  std::exception_ptr root_cause;
  bool aborted = false;
  try {
    pool_->run([&](int r) {
      try {
        f(r);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!aborted) {
          aborted = true;
          root_cause = std::current_exception();
          for (auto& rep : replicas_) {
            rep->grad_comm->abort();
            rep->ctrl_comm->abort();
          }
        }
        throw;
      }
    });
  } catch (...) {
    if (root_cause) std::rethrow_exception(root_cause);
    throw;
  }
}

std::vector<std::string> DataParallel::events() const {
  std::lock_guard<std::mutex> lock(events_mu_);
  return events_;
}

Tensor DataParallel::forward_backward(int r, const Tensor& images, const Tensor& masks, LossKind loss_kind) {
  Replica& rep = *replicas_[r];
  const bool log = options_.record_events && r == 0;
  auto event = [&](const std::string& e) {
    std::lock_guard<std::mutex> lock(events_mu_);
    events_.push_back(e);
  };
  // BN running statistics follow rank 0 (they are synchronized anyway with --sync-bn).
  for (const StateEntry& e : rep.model->state())  // a buffer moved out would miss the broadcast
    UNETCU_CHECK(e.is_parameter || !e.tensor.defined() || e.tensor.same_storage(rep.buffers),
                 "data parallelism: BN buffer ", e.name, " was moved out of its packed buffer");
  if (!options_.sync_bn && rep.buffers.defined()) rep.ctrl_comm->broadcast(rep.buffers, 0);
  rep.ready_in_bucket.assign(rep.buckets.size(), 0);
  rep.work.clear();
  rep.work.resize(rep.buckets.size());
  rep.next_launch = 0;

  // A finished bucket: its gradients are already in its buffer; reduce it in place.
  auto launch = [&](size_t k) {
    if (options_.bf16_allreduce) {
      // Rounded once on the compute stream, summed in bfloat16, divided in float32 below:
      // NCCL's average premultiplies by 1/N rounded to bfloat16 (biased for N = 3, 6, ...).
      rep.low[k].copy_(rep.flat[k]);
      rep.work[k] = rep.grad_comm->all_reduce_async(rep.low[k], ReduceOp::Sum);
    } else {
      rep.work[k] = rep.grad_comm->all_reduce_async(rep.flat[k], ReduceOp::Average);
    }
    if (log) event("allreduce bucket " + std::to_string(k));
  };
  auto launch_ready = [&] {
    while (rep.next_launch < rep.buckets.size() &&
           rep.ready_in_bucket[rep.next_launch] == int(rep.buckets[rep.next_launch].params.size()))
      launch(rep.next_launch++);
  };

  // Gradients start from zero in the buckets (a parameter unused this step contributes
  // zeros); the views stay in place, so the optimizer's zero_grad (which drops them) is not
  // used here.
  for (Tensor& flat : rep.flat) flat.fill_(0.0);
  for (size_t i = 0; i < rep.params.size(); ++i)
    UNETCU_CHECK(rep.params[i].grad().defined() && rep.params[i].grad().same_storage(rep.flat[rep.bucket_of[i]]),
                 "data parallelism: a parameter's gradient was moved out of its bucket");
  // Gradient accumulation: the chunks before the last add their gradients into the buckets;
  // the last chunk's backward launches each bucket as it completes.
  const int64_t rows = images.dim(0);
  const int64_t chunk =
      options_.accumulate_rows > 0 && options_.accumulate_rows < rows ? options_.accumulate_rows : rows;
  Tensor loss;
  for (int64_t lo = 0; lo < rows; lo += chunk) {
    const int64_t hi = std::min(lo + chunk, rows);
    Tape tape;
    if (hi == rows) {
      tape.set_leaf_ready_hook([&](const TensorImpl* leaf) {
        auto it = rep.param_index.find(leaf);
        if (it == rep.param_index.end()) return;
        ++rep.ready_in_bucket[rep.bucket_of[it->second]];
        launch_ready();
      });
    }
    if (log) tape.set_node_done_hook([&](const char* op) { event(std::string("backward ") + op); });
    Tensor part;
    {
      BatchNormSyncScope sync(rep.bn_sync.get());
      TapeScope scope(tape);
      const bool whole = chunk == rows;
      part = segmentation_loss(loss_kind, rep.model->forward(whole ? images : images.rows(lo, hi)),
                               whole ? masks : masks.rows(lo, hi));
      if (!whole) part = scale(part, double(hi - lo) / double(rows));
      tape.backward(part);
    }
    loss = loss.defined() ? add(loss, part) : part;
  }
  // Buckets with a parameter no node used are still reduced, in order, on every rank.
  while (rep.next_launch < rep.buckets.size()) launch(rep.next_launch++);
  for (size_t k = 0; k < rep.buckets.size(); ++k) {
    rep.work[k]->wait();
    if (options_.bf16_allreduce) {
      rep.flat[k].copy_(rep.low[k]);  // widened exactly, then the mean in float32
      UNETCU_LAUNCH(rep.device, axpby, rep.flat[k], 1.0 / rep.grad_comm->size(), rep.flat[k], 0.0);
    }
  }
  rep.work.clear();
  return loss;
}

bool DataParallel::graph_step_ready(const std::vector<Batch>& shards, LossKind loss_kind) {
  const Shape loss_key{int64_t(loss_kind)};
  if (!graph_.due(replicas_[0]->model->is_training(), {shards[0].images.shape(), shards[0].masks.shape(), loss_key}))
    return false;
  if (graph_.captured()) return true;
  // Every replica captures its step (nothing runs: its collectives are recorded, not issued
  // to the peers); then all agree: NCCL requires a collective to be captured on every rank of
  // its communicator or on none, and its graph launched by every rank. Every collective of the
  // last step was queued on every device before the step returned, so they all finish before
  // the caches go back: cudaFree then waits for no peer.
  run([&](int r) { GraphStep::release_cache(replicas_[r]->device); });
  std::vector<std::string> failures(replicas_.size());
  run([&](int r) {
    Replica& rep = *replicas_[r];
    try {
      const auto on_device = [&](const Tensor& t) { return t.device() == rep.device ? t : t.to(rep.device); };
      graph_.capture(r, *rep.model, {on_device(shards[r].images), on_device(shards[r].masks)}, {}, {},
                     [&](const std::vector<Tensor>& in) {
                       return std::vector<Tensor>{forward_backward(r, in[0], in[1], loss_kind)};
                     });
    } catch (const std::exception& e) {
      failures[r] = e.what();
      rep.work.clear();
    }
  });
  std::string why;
  for (size_t r = 0; r < failures.size(); ++r)
    if (!failures[r].empty()) {
      ++graph_capture_failures_;
      if (why.empty()) why = str_cat("rank ", global_rank() + int(r), ": ", failures[r]);
    }
  bool failed = graph_capture_failures_ > 0;
  // Across processes, every process must take the same decision.
  if (options_.across_processes) failed = average_across_processes(failed ? 1.0 : 0.0) > 0;
  if (!failed) {
    graph_.set_captured();
    return true;
  }
  // Whether a collective is captured must be the same on every rank (NCCL's rule for graphs),
  // and a failed capture holds only part of the step's: the communicators may not be used
  // again.
  if (why.empty()) why = "another process's capture failed";
  UNETCU_CHECK(!options_.across_processes, "capturing the data-parallel step as a CUDA graph failed (", why,
               "); NCCL cannot go on after a capture that differed between the ranks: train without "
               "CUDA graphs");
  options_.cuda_graphs = false;
  graph_.fall_back("the data-parallel step", why, " over new NCCL communicators");
  connect();
  return false;
}

std::vector<double> DataParallel::step(const std::vector<Batch>& shards, LossKind loss_kind) {
  std::vector<double> losses;
  for (const Tensor& loss : step_async(shards, loss_kind)) losses.push_back(loss.item());
  return losses;
}

std::vector<Tensor> DataParallel::step_async(const std::vector<Batch>& shards, LossKind loss_kind) {
  UNETCU_CHECK(int(shards.size()) == size(), "data parallelism got ", shards.size(),
               " shards for ", size(), " replicas");
  for (const Batch& b : shards)
    UNETCU_CHECK(b.images.shape() == shards[0].images.shape(), "every replica needs a shard of the same shape");
  std::vector<Tensor> losses(size());
  {
    std::lock_guard<std::mutex> lock(events_mu_);
    events_.clear();
  }
  const bool replay = graph_step_ready(shards, loss_kind);
  run([&](int r) {
    Replica& rep = *replicas_[r];
    auto on_device = [&](const Tensor& t) { return t.device() == rep.device ? t : t.to(rep.device); };
    Tensor loss;
    if (replay) {
      GraphStep::Slot& c = graph_.slot(r);
      c.inputs[0].copy_(on_device(shards[r].images));
      c.inputs[1].copy_(on_device(shards[r].masks));
      c.launch();
      rep.grad_comm->watch_launch("CUDA graph of the step (gradient all-reduces)");
      rep.ctrl_comm->watch_launch("CUDA graph of the step (batch-norm collectives)");
      loss = c.outputs[0];
    } else {
      loss = forward_backward(r, on_device(shards[r].images), on_device(shards[r].masks), loss_kind);
    }
    rep.opt->step();
    losses[r] = loss;  // a GPU's is read behind the step's work on this stream (no host wait here)
  });
  if (replay) graph_.count_replay();
  return losses;
}

}  // namespace unetcu
