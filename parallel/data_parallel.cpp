#include "parallel/data_parallel.h"

#include <omp.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "engine/tape.h"
#include "parallel/nccl_communicator.h"
#include "parallel/worker_pool.h"

namespace unetcu {

std::vector<Device> parse_device_list(const std::string& s) {
  std::vector<Device> out;
  std::stringstream ss(s);
  std::string item;
  std::set<std::string> seen;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    Device d = Device::parse(item);
    UNETCU_CHECK(seen.insert(d.str()).second, "--devices lists ", d.str(), " twice");
    UNETCU_CHECK(out.empty() || out[0].kind == d.kind,
                 "--devices must be all CPU devices or all GPUs, got ", s);
    out.push_back(d);
  }
  UNETCU_CHECK(!out.empty(), "--devices is empty");
  return out;
}

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
  std::vector<int64_t> offsets;   // element offset of each in the flat buffer
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
  std::vector<Tensor> flat;    // per bucket, on the replica's device
  // per step
  std::vector<int> ready_in_bucket;
  std::vector<std::unique_ptr<Work>> work;
  size_t next_launch = 0;
};

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
    b.numel += params[i].numel();
  }
  return out;
}

DataParallel::DataParallel(const UNetConfig& model_cfg, const DataParallelOptions& options,
                           const OptimizerFactory& make_optimizer)
    : options_(options) {
  const int N = int(options.devices.size());
  UNETCU_CHECK(N >= 1, "data parallelism needs at least one device");
  if (options_.threads_per_replica <= 0)
    options_.threads_per_replica = std::max(1, omp_get_num_procs() / N);
  std::vector<std::unique_ptr<Communicator>> grad_comms, ctrl_comms;
  if (options.devices[0].is_cuda()) {
    std::vector<int> ids;
    for (const Device& d : options.devices) ids.push_back(d.index);
    grad_comms = make_nccl_communicators(ids, options.algo);
    ctrl_comms = make_nccl_communicators(ids);
  } else {
    grad_comms = make_cpu_communicators(N, options.algo);
    ctrl_comms = make_cpu_communicators(N, AllReduceAlgo::Ring);
  }
  for (int r = 0; r < N; ++r) {
    auto rep = std::make_unique<Replica>();
    rep->device = options.devices[r];
    UNetConfig cfg = model_cfg;
    cfg.device = rep->device;
    rep->model = std::make_unique<UNet>(cfg);
    rep->params = rep->model->parameters();
    rep->opt = make_optimizer(rep->params);
    rep->grad_comm = std::move(grad_comms[r]);
    rep->ctrl_comm = std::move(ctrl_comms[r]);
    if (options.sync_bn) rep->bn_sync = std::make_unique<CommBatchNormSync>(rep->ctrl_comm.get());
    for (size_t i = 0; i < rep->params.size(); ++i) rep->param_index[rep->params[i].impl_ptr().get()] = int(i);
    rep->buckets = make_buckets(rep->params, options.first_bucket_bytes, options.bucket_bytes);
    rep->bucket_of.assign(rep->params.size(), -1);
    for (size_t k = 0; k < rep->buckets.size(); ++k) {
      for (int i : rep->buckets[k].params) rep->bucket_of[i] = int(k);
      rep->flat.push_back(Tensor::empty({rep->buckets[k].numel}, model_cfg.dtype, rep->device));
    }
    replicas_.push_back(std::move(rep));
  }
  pool_ = std::make_unique<WorkerPool>(options.devices, options_.threads_per_replica, "compute replica");
  // Every replica starts from rank 0's parameters and buffers.
  run([&](int r) {
    for (const StateEntry& e : replicas_[r]->model->state()) {
      if (!e.tensor.defined()) continue;
      Tensor t = e.tensor;
      replicas_[r]->grad_comm->broadcast(t, 0);
    }
  });
}

DataParallel::~DataParallel() = default;

int DataParallel::size() const { return int(replicas_.size()); }
UNet& DataParallel::replica(int rank) { return *replicas_.at(rank)->model; }
size_t DataParallel::bucket_count() const { return replicas_[0]->buckets.size(); }
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

std::vector<double> DataParallel::step(const std::vector<Batch>& shards, LossKind loss_kind) {
  UNETCU_CHECK(int(shards.size()) == size(), "data parallelism got ", shards.size(),
               " shards for ", size(), " replicas");
  for (const Batch& b : shards)
    UNETCU_CHECK(b.images.shape() == shards[0].images.shape(),
                 "every replica needs a shard of the same shape");
  std::vector<double> losses(size());
  {
    std::lock_guard<std::mutex> lock(events_mu_);
    events_.clear();
  }
  run([&](int r) {
    Replica& rep = *replicas_[r];
    const bool log = options_.record_events && r == 0;
    auto event = [&](const std::string& e) {
      std::lock_guard<std::mutex> lock(events_mu_);
      events_.push_back(e);
    };
    // BN running statistics follow rank 0 (they are synchronized anyway with --sync-bn).
    if (!options_.sync_bn)
      for (const StateEntry& e : rep.model->state())
        if (!e.is_parameter && e.tensor.defined()) {
          Tensor t = e.tensor;
          rep.ctrl_comm->broadcast(t, 0);
        }
    const Tensor images = shards[r].images.to(rep.device);
    const Tensor masks = shards[r].masks.to(rep.device);
    rep.ready_in_bucket.assign(rep.buckets.size(), 0);
    rep.work.clear();
    rep.work.resize(rep.buckets.size());
    rep.next_launch = 0;

    // Copies a finished bucket's gradients into its flat buffer and starts its all-reduce.
    auto launch = [&](size_t k) {
      const Bucket& b = rep.buckets[k];
      Tensor& flat = rep.flat[k];
      const size_t es = dtype_size(flat.dtype());
      for (size_t j = 0; j < b.params.size(); ++j) {
        const Tensor& p = rep.params[b.params[j]];
        char* dst = static_cast<char*>(flat.raw()) + b.offsets[j] * es;
        Tensor g = p.grad();
        if (!g.defined()) {  // unused in this step: contributes zeros
          g = Tensor::zeros(p.shape(), p.dtype(), p.device());
          p.impl().grad = g.impl_ptr();
        }
        copy_bytes(dst, flat.device(), g.raw(), g.device(), g.nbytes());
      }
      rep.work[k] = rep.grad_comm->all_reduce_async(flat, ReduceOp::Average);
      if (log) event("allreduce bucket " + std::to_string(k));
    };
    auto launch_ready = [&] {
      while (rep.next_launch < rep.buckets.size() &&
             rep.ready_in_bucket[rep.next_launch] == int(rep.buckets[rep.next_launch].params.size()))
        launch(rep.next_launch++);
    };

    rep.opt->zero_grad();
    Tape tape;
    tape.set_leaf_ready_hook([&](const TensorImpl* leaf) {
      auto it = rep.param_index.find(leaf);
      if (it == rep.param_index.end()) return;
      ++rep.ready_in_bucket[rep.bucket_of[it->second]];
      launch_ready();
    });
    if (log) tape.set_node_done_hook([&](const char* op) { event(std::string("backward ") + op); });
    Tensor loss;
    {
      BatchNormSyncScope sync(rep.bn_sync.get());
      TapeScope scope(tape);
      loss = segmentation_loss(loss_kind, rep.model->forward(images), masks);
      tape.backward(loss);
    }
    // Buckets with a parameter no node used are still reduced, in order, on every rank.
    while (rep.next_launch < rep.buckets.size()) launch(rep.next_launch++);
    for (size_t k = 0; k < rep.buckets.size(); ++k) {
      rep.work[k]->wait();
      const Bucket& b = rep.buckets[k];
      const size_t es = dtype_size(rep.flat[k].dtype());
      for (size_t j = 0; j < b.params.size(); ++j) {
        Tensor g = rep.params[b.params[j]].grad();
        const char* src = static_cast<const char*>(rep.flat[k].raw()) + b.offsets[j] * es;
        copy_bytes(g.raw(), g.device(), src, rep.flat[k].device(), g.nbytes());
      }
    }
    rep.opt->step();
    losses[r] = loss.item();
  });
  return losses;
}

}  // namespace unetcu
