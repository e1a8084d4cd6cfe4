#include "engine/cuda/nccl.cuh"
#include "engine/cuda_api.h"
#include "parallel/nccl_communicator.h"

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

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, int device, AllReduceAlgo algo)
      : comm_(comm), algo_(algo), rank_(rank), size_(size), device_(device),
        comm_stream_(cuda::Stream::create(device)) {}
  ~NcclCommunicator() override {
    if (aborted_) return;  // ncclCommAbort released it
    cuda::DeviceGuard g(device_);
    ncclCommDestroy(comm_);
  }
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
  void abort() override { ncclCommAbort(comm_); aborted_ = true; }
  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) override {
    check(t);
    cuda::DeviceGuard g(device_);
    cuda::Event ready = cuda::Event::create(device_);
    ready.record(cuda::current_stream(device_));  // the gradients in t are final there
    ready.wait_on(comm_stream_.get());
    enqueue_all_reduce(t, op, comm_stream_.get());
    cuda::Event done = cuda::Event::create(device_);
    done.record(comm_stream_.get());
    return std::make_unique<NcclWork>(std::move(done), device_);
  }

 private:
  void enqueue_all_reduce(Tensor& t, ReduceOp op, cudaStream_t s) {
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
  ncclComm_t comm_;
  AllReduceAlgo algo_;
  bool aborted_ = false;
  int rank_, size_, device_;
  cuda::Stream comm_stream_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<int>& devices,
                                                                  AllReduceAlgo algo) {
  const int n = int(devices.size());
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<ncclComm_t> comms(n);
  NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < n; ++r) {
    CUDA_CHECK(cudaSetDevice(devices[r]));
    NCCL_CHECK(ncclCommInitRank(&comms[r], n, id, r));
  }
  NCCL_CHECK(ncclGroupEnd());
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r)
    out.push_back(std::make_unique<NcclCommunicator>(comms[r], r, n, devices[r], algo));
  return out;
}

}  // namespace unetcu
