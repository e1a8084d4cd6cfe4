#include "runtime/cuda/nccl.cuh"
#include "runtime/cuda_api.h"
#include "parallel/nccl_communicator.h"

#include <atomic>
#include <mutex>

namespace unetcu {
namespace {

ncclDataType_t nccl_type(const Tensor& t) {
  return t.dtype() == DType::F32 ? ncclFloat32 : ncclFloat64;
}

class NcclWork : public Work {
 public:
  NcclWork(cuda::Event done, int device) : done_(std::move(done)), device_(device) {}
  void wait() override { done_.wait_on(cuda::current_stream(device_)); }

 private:
  cuda::Event done_;
  int device_;
};

// The communicators of one set of ranks, owned together: NCCL's finalize is a collective
// over the ranks, so when one thread holds them all it must finalize them in one group (one at
// a time would wait for ranks that never come); abort likewise happens once, for all.
struct NcclGroup {
  std::vector<ncclComm_t> comms;
  std::vector<int> devices;
  std::atomic<bool> aborted{false};
  std::once_flag abort_once;
  ~NcclGroup() {
    if (aborted) return;  // ncclCommAbort released them
    ncclGroupStart();
    for (size_t r = 0; r < comms.size(); ++r) {
      cudaSetDevice(devices[r]);
      ncclCommFinalize(comms[r]);
    }
    ncclGroupEnd();
    for (size_t r = 0; r < comms.size(); ++r) ncclCommDestroy(comms[r]);
  }
  void abort() {
    std::call_once(abort_once, [&] {
      aborted = true;
      for (ncclComm_t c : comms) ncclCommAbort(c);
    });
  }
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclGroup> group, int rank, AllReduceAlgo algo)
      : group_(std::move(group)), comm_(group_->comms[rank]), algo_(algo), rank_(rank),
        size_(int(group_->comms.size())), device_(group_->devices[rank]),
        comm_stream_(device_) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce(Tensor& t, ReduceOp op) override {
    check(t);
    cuda::DeviceGuard g(device_);
    enqueue_all_reduce(t, op, cuda::current_stream(device_));
  }
  void broadcast(Tensor& t, int root) override {
    check(t);
    cuda::DeviceGuard g(device_);
    NCCL_CHECK(ncclBroadcast(t.raw(), t.raw(), size_t(t.numel()), nccl_type(t), root, comm_,
                             cuda::current_stream(device_)));
  }
  void reduce(Tensor& t, int root, ReduceOp op) override {
    check(t);
    cuda::DeviceGuard g(device_);
    NCCL_CHECK(ncclReduce(t.raw(), t.raw(), size_t(t.numel()), nccl_type(t), nccl_op(op), root,
                          comm_, cuda::current_stream(device_)));
  }
  void barrier() override {
    Tensor one = Tensor::zeros({1}, DType::F32, Device::cuda(device_));
    all_reduce(one, ReduceOp::Sum);
    cuda::synchronize(device_);
  }
  // Error path only: after a rank failed, every rank's collectives end with an error.
  void abort() override { group_->abort(); }
  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) override {
    check(t);
    cuda::DeviceGuard g(device_);
    cuda::Event ready(device_);
    ready.record(cuda::current_stream(device_));  // the gradients in t are final there
    ready.wait_on(comm_stream_.get());
    enqueue_all_reduce(t, op, comm_stream_.get());
    cuda::Event done(device_);
    done.record(comm_stream_.get());
    return std::make_unique<NcclWork>(std::move(done), device_);
  }

 private:
  void enqueue_all_reduce(Tensor& t, ReduceOp op, cudaStream_t s) {
    UNETCU_CHECK(!group_->aborted, "NCCL collective after an abort: another rank failed");
    const size_t n = size_t(t.numel());
    if (algo_ == AllReduceAlgo::Ring) {
      NCCL_CHECK(ncclAllReduce(t.raw(), t.raw(), n, nccl_type(t), nccl_op(op), comm_, s));
      return;
    }
    // Stream order runs the broadcast after the reduce has finished at rank 0.
    NCCL_CHECK(ncclReduce(t.raw(), t.raw(), n, nccl_type(t), nccl_op(op), 0, comm_, s));
    NCCL_CHECK(ncclBroadcast(t.raw(), t.raw(), n, nccl_type(t), 0, comm_, s));
  }
  static ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclAvg; }
  void check(const Tensor& t) const {
    UNETCU_CHECK(t.device() == Device::cuda(device_), "NCCL rank ", rank_, " works on cuda:",
                 device_, ", got a tensor on ", t.device().str());
  }
  std::shared_ptr<NcclGroup> group_;
  ncclComm_t comm_;
  AllReduceAlgo algo_;
  int rank_, size_, device_;
  cuda::Stream comm_stream_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<int>& devices,
                                                                  AllReduceAlgo algo) {
  const int n = int(devices.size());
  auto group = std::make_shared<NcclGroup>();
  group->devices = devices;
  group->comms.assign(n, nullptr);
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  {
    cuda::DeviceGuard restore(devices[0]);  // puts the caller's device back afterwards
    ncclResult_t res = ncclGroupStart();
    for (int r = 0; r < n && res == ncclSuccess; ++r) {
      if (cudaSetDevice(devices[r]) != cudaSuccess) {
        res = ncclInvalidArgument;
        break;
      }
      res = ncclCommInitRank(&group->comms[r], n, id, r);
    }
    const ncclResult_t end = ncclGroupEnd();  // always closes the group
    if (res == ncclSuccess) res = end;
    if (res != ncclSuccess) {
      group->aborted = true;  // nothing usable to finalize
      for (ncclComm_t c : group->comms)
        if (c) ncclCommAbort(c);
      NCCL_CHECK(res);
    }
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) out.push_back(std::make_unique<NcclCommunicator>(group, r, algo));
  return out;
}

}  // namespace unetcu
