#include "runtime/cuda/nccl.cuh"
#include "runtime/cuda_api.h"
#include "parallel/nccl_communicator.h"

#include <atomic>
#include <cstdlib>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

namespace unetcu {
namespace {

using Clock = std::chrono::steady_clock;

// bfloat16: NCCL adds in float32 and rounds each partial sum to bfloat16, as the CPU ring.
ncclDataType_t nccl_type(const Tensor& t) {
  switch (t.dtype()) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
  }
  throw Error(str_cat("NCCL: no collective for ", dtype_name(t.dtype())));
}

class NcclWork : public Work {
 public:
  NcclWork(cuda::Event done, int device) : done_(std::move(done)), device_(device) {}
  void wait() override { done_.wait_on(cuda::current_stream(device_)); }

 private:
  cuda::Event done_;
  int device_;
};

// NCCL operations on one device run in the order they were issued, whatever group or stream
// they are on. Why: data parallelism holds two groups per GPU (gradient buckets on a
// communication stream, batch-norm collectives on the compute stream). Left to the streams, a
// --sync-bn all-reduce could run before an earlier bucket's on one GPU and after it on another;
// each kernel then waits for peers that are inside the other group's kernel: a hang with two
// or more GPUs. Every operation's stream first waits for the device's previous NCCL operation
// (an event), so all GPUs see the same total order, the order every rank issues them in.
//
// Inside a CUDA graph capture a stream may wait only for events recorded in that same capture:
// `last_capture` says where `last` was recorded (0: eagerly). The first operation of a capture
// does not wait for an eager one, nor an eager operation for a captured one (whose event is the
// graph's, not a point in time); the caller orders those through its streams: data parallelism
// joins every collective into its compute stream before a step ends, captures there, and after
// each launch watch_launch() makes the launch the device's last operation.
struct DeviceOrder {
  std::mutex mu;
  cuda::Event last;
  unsigned long long last_capture = 0;
};

// The id of the capture `stream` is in, or 0 when it is not capturing. A capture already
// invalidated (an earlier call in it failed) is an error here, before NCCL is called: NCCL
// would fail the call and keep the failure as the non-blocking communicator's error.
unsigned long long capture_id(cudaStream_t stream, const char* what, int rank) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  const cudaError_t e = cudaStreamGetCaptureInfo(stream, &status, &id);
  if (e != cudaSuccess || status == cudaStreamCaptureStatusInvalidated) {
    cudaGetLastError();
    throw Error(str_cat("NCCL ", what, " on rank ", rank, ": the stream's CUDA graph capture ",
                        e != cudaSuccess ? cudaGetErrorString(e) : "was invalidated by an earlier call"));
  }
  return status == cudaStreamCaptureStatusNone ? 0 : id;
}
DeviceOrder& device_order(int device) {
  static std::mutex map_mu;
  static auto* orders = new std::map<int, std::unique_ptr<DeviceOrder>>();
  std::lock_guard<std::mutex> lock(map_mu);
  auto& slot = (*orders)[device];
  if (!slot) slot = std::make_unique<DeviceOrder>();
  return *slot;
}

// The communicators of one set of ranks, owned together: NCCL's finalize is a collective
// over the ranks, so when one thread holds them all it must finalize them in one group (one at
// a time would wait for ranks that never come); abort likewise happens once, for all.
//
// The communicators are non-blocking (ncclConfig_t::blocking = 0): a call returns at once,
// possibly ncclInProgress, and is polled with ncclCommGetAsyncError. Why: abort must never run
// between a rank's "aborted?" check and its NCCL call (ncclCommAbort frees the communicator the
// call then uses), so calls hold `calls` shared and abort holds it exclusively; with blocking
// communicators a call could block inside NCCL waiting for a dead peer while holding it, and
// abort would wait forever.
//
// A watchdog thread polls every enqueued operation's completion event and the communicators'
// asynchronous errors: an operation unfinished after `timeout` seconds, or an NCCL error,
// aborts the group with a message naming the rank and the operation; every later call on any
// rank throws that message, and ncclCommAbort ends the kernels the ranks' streams wait on.
struct NcclGroup {
  std::vector<ncclComm_t> comms;  // this process's ranks
  std::vector<int> devices;
  int first_rank = 0;             // comms[i] is rank first_rank + i of world
  int world = 0;
  double timeout = kDefaultCollectiveTimeout;

  std::shared_mutex calls;
  std::atomic<bool> aborted{false};
  std::string reason;  // written under `calls` held exclusively

  struct Pending {
    cuda::Event done;
    Clock::time_point start;
    int rank;
    std::string op;
  };
  std::mutex pending_mu;
  std::condition_variable pending_cv;
  std::vector<Pending> pending;
  bool stop = false;
  std::thread watchdog;

  // The watchdog queries events on the group's first device, so that it opens no context on
  // CUDA's default device 0 (the process may not use GPU 0 at all).
  void start_watchdog() {
    watchdog = std::thread([this] {
      cuda::QuietDeviceGuard on(devices.empty() ? 0 : devices[0]);
      watch_loop();
    });
  }

  void abort(const std::string& why) {
    std::unique_lock<std::shared_mutex> lock(calls);
    if (aborted) return;
    reason = why;
    aborted = true;
    for (ncclComm_t c : comms)
      if (c) ncclCommAbort(c);
  }

  void track(cuda::Event done, int rank, const char* op) {
    std::lock_guard<std::mutex> lock(pending_mu);
    pending.push_back({std::move(done), Clock::now(), rank, op});
  }

  void watch_loop() {
    std::unique_lock<std::mutex> lock(pending_mu);
    while (!stop) {
      pending_cv.wait_for(lock, std::chrono::milliseconds(100));
      if (stop || aborted) continue;
      std::string why;
      for (size_t i = 0; i < pending.size();) {
        const cudaError_t q = cudaEventQuery(pending[i].done.get());
        if (q == cudaSuccess) {
          pending.erase(pending.begin() + i);
          continue;
        }
        if (q != cudaErrorNotReady) {
          why = str_cat("NCCL ", pending[i].op, " on rank ", pending[i].rank,
                        " failed: ", cudaGetErrorString(q));
          break;
        }
        const double waited = std::chrono::duration<double>(Clock::now() - pending[i].start).count();
        if (waited > timeout) {
          why = str_cat("collective timed out: rank ", pending[i].rank, "'s ", pending[i].op,
                        " did not finish within ", timeout, " s (collective timeout)");
          break;
        }
        ++i;
      }
      // The communicators' asynchronous errors, polled only while no call is under way (the
      // round is skipped otherwise): ncclCommGetAsyncError must not run beside another
      // thread's on the same communicator. settle() polls it after every call, and the first
      // poll to see a non-blocking group finished joins and frees NCCL's group job, unlocked;
      // two at once free it twice. Nor may it run while abort() frees the communicator.
      // try_to_lock: a caller holding `calls` shared may be waiting for pending_mu in track().
      if (why.empty()) {
        std::unique_lock<std::shared_mutex> idle(calls, std::try_to_lock);
        for (size_t r = 0; idle.owns_lock() && !aborted && why.empty() && r < comms.size(); ++r) {
          ncclResult_t st = ncclSuccess;
          if (ncclCommGetAsyncError(comms[r], &st) == ncclSuccess && st != ncclSuccess &&
              st != ncclInProgress)
            why = str_cat("NCCL error on rank ", first_rank + int(r), ": ", ncclGetErrorString(st));
        }
      }
      if (!why.empty()) {
        lock.unlock();  // abort takes `calls`; a caller holding it may be waiting to track()
        abort(why);
        lock.lock();
      }
    }
  }

  ~NcclGroup() {
    {
      std::lock_guard<std::mutex> lock(pending_mu);
      stop = true;
    }
    pending_cv.notify_all();
    if (watchdog.joinable()) watchdog.join();
    if (aborted) return;  // ncclCommAbort released them
    {
      cuda::QuietDeviceGuard restore(devices[0]);  // puts the caller's device back afterwards
      bool ok = true;
      ncclGroupStart();
      for (size_t r = 0; r < comms.size(); ++r) {
        ok = cudaSetDevice(devices[r]) == cudaSuccess && ok;
        ncclCommFinalize(comms[r]);
      }
      ncclGroupEnd();
      if (!ok) cudaGetLastError();  // a failure here is not the next launch's error
    }
    for (ncclComm_t c : comms) {  // non-blocking: finalize completes asynchronously
      ncclResult_t st = ncclInProgress;
      const auto t0 = Clock::now();
      while (st == ncclInProgress && ncclCommGetAsyncError(c, &st) == ncclSuccess &&
             std::chrono::duration<double>(Clock::now() - t0).count() < timeout)
        std::this_thread::yield();
    }
    for (ncclComm_t c : comms) ncclCommDestroy(c);
  }
};

// Polls a non-blocking communicator until its last call has been enqueued (or failed).
ncclResult_t settle(ncclComm_t comm, ncclResult_t res, double timeout) {
  const auto t0 = Clock::now();
  while (res == ncclInProgress) {
    if (ncclCommGetAsyncError(comm, &res) != ncclSuccess) return ncclSystemError;
    if (std::chrono::duration<double>(Clock::now() - t0).count() > timeout) return ncclInProgress;
    if (res == ncclInProgress) std::this_thread::yield();
  }
  return res;
}

class NcclCommunicator : public Communicator {
 public:
  // The process's `local`-th rank of the group.
  NcclCommunicator(std::shared_ptr<NcclGroup> group, int local, AllReduceAlgo algo)
      : group_(std::move(group)), comm_(group_->comms[local]), algo_(algo),
        rank_(group_->first_rank + local), size_(group_->world), device_(group_->devices[local]),
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
    enqueue("broadcast", cuda::current_stream(device_), [&](cudaStream_t s) {
      return ncclBroadcast(t.raw(), t.raw(), size_t(t.numel()), nccl_type(t), root, comm_, s);
    });
  }
  void reduce(Tensor& t, int root, ReduceOp op) override {
    check(t);
    cuda::DeviceGuard g(device_);
    enqueue("reduce", cuda::current_stream(device_), [&](cudaStream_t s) {
      return ncclReduce(t.raw(), t.raw(), size_t(t.numel()), nccl_type(t), nccl_op(op), root,
                        comm_, s);
    });
  }
  void barrier() override {
    Tensor one = Tensor::zeros({1}, DType::F32, Device::cuda(device_));
    all_reduce(one, ReduceOp::Sum);
    cuda::synchronize(device_);
  }
  // Error path only: after a rank failed, every rank's collectives end with an error.
  void abort() override { group_->abort("collective aborted: another rank failed"); }
  void check_healthy() const override {
    std::shared_lock<std::shared_mutex> calls(group_->calls);
    if (group_->aborted) throw Error(str_cat("NCCL on rank ", rank_, ": ", group_->reason));
  }
  void watch_launch(const char* what) override {
    cuda::DeviceGuard g(device_);
    std::shared_lock<std::shared_mutex> calls(group_->calls);
    if (group_->aborted) throw Error(str_cat("NCCL ", what, " on rank ", rank_, ": ", group_->reason));
    DeviceOrder& order = device_order(device_);
    std::lock_guard<std::mutex> ordered(order.mu);
    cuda::Event done(device_);
    done.record(cuda::current_stream(device_));
    order.last = done;
    order.last_capture = 0;
    group_->track(done, rank_, what);
  }
  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) override {
    check(t);
    cuda::DeviceGuard g(device_);
    cuda::Event ready(device_);
    ready.record(cuda::current_stream(device_));  // the gradients in t are final there
    ready.wait_on(comm_stream_.get());
    // The tensor is used on the communication stream: the allocator must not hand its block
    // out again (after a free on the compute stream) before the all-reduce has finished.
    cuda::record_stream(t.raw(), t.device(), device_, comm_stream_.get());
    cuda::Event done = enqueue_all_reduce(t, op, comm_stream_.get());
    return std::make_unique<NcclWork>(std::move(done), device_);
  }

 private:
  cuda::Event enqueue_all_reduce(Tensor& t, ReduceOp op, cudaStream_t stream) {
    const size_t n = size_t(t.numel());
    if (algo_ == AllReduceAlgo::Ring)
      return enqueue("all_reduce", stream, [&](cudaStream_t s) {
        return ncclAllReduce(t.raw(), t.raw(), n, nccl_type(t), nccl_op(op), comm_, s);
      });
    // Stream order runs the broadcast after the reduce has finished at rank 0.
    enqueue("all_reduce (ps: reduce)", stream, [&](cudaStream_t s) {
      return ncclReduce(t.raw(), t.raw(), n, nccl_type(t), nccl_op(op), 0, comm_, s);
    });
    return enqueue("all_reduce (ps: broadcast)", stream, [&](cudaStream_t s) {
      return ncclBroadcast(t.raw(), t.raw(), n, nccl_type(t), 0, comm_, s);
    });
  }

  // One NCCL call on `stream`: under the group's call lock (no abort in between), after the
  // device's previous NCCL operation, tracked by the watchdog. Returns its completion event.
  template <class Call>
  cuda::Event enqueue(const char* what, cudaStream_t stream, Call&& call) {
    std::shared_lock<std::shared_mutex> calls(group_->calls);
    if (group_->aborted) throw Error(str_cat("NCCL ", what, " on rank ", rank_, ": ", group_->reason));
    DeviceOrder& order = device_order(device_);
    std::lock_guard<std::mutex> ordered(order.mu);
    const unsigned long long capture = capture_id(stream, what, rank_);
    if (order.last.valid() && order.last_capture == capture) order.last.wait_on(stream);
    const ncclResult_t res = settle(comm_, call(stream), group_->timeout);
    if (res == ncclInProgress)
      throw Error(str_cat("NCCL ", what, " on rank ", rank_, " was not enqueued within ",
                          group_->timeout, " s (collective timeout)"));
    if (res != ncclSuccess)
      throw Error(str_cat("NCCL ", what, " on rank ", rank_, " failed: ", ncclGetErrorString(res)));
    cuda::Event done(device_);
    done.record(stream);
    order.last = done;
    order.last_capture = capture;
    // A captured event cannot be queried: the launch is tracked instead (watch_launch).
    if (!capture) group_->track(done, rank_, what);
    return done;
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
                                                                  AllReduceAlgo algo,
                                                                  double timeout_s) {
  UNETCU_CHECK(timeout_s > 0, "the collective timeout must be positive, got ", timeout_s, " s");
  UNETCU_CHECK(algo != AllReduceAlgo::Mpi, "the MPI library's all-reduce is for CPU ranks in several "
                                           "processes; GPUs use NCCL's (ring) or ps");
  const int n = int(devices.size());
  auto group = std::make_shared<NcclGroup>();
  group->devices = devices;
  group->world = n;
  group->timeout = timeout_s;
  group->comms.assign(n, nullptr);
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  {
    cuda::DeviceGuard restore(devices[0]);  // puts the caller's device back afterwards
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // see NcclGroup
    ncclResult_t res = ncclGroupStart();
    for (int r = 0; r < n && res == ncclSuccess; ++r) {
      if (cudaSetDevice(devices[r]) != cudaSuccess) {
        res = ncclInvalidArgument;
        break;
      }
      res = ncclCommInitRankConfig(&group->comms[r], n, id, r, &config);
      if (res == ncclInProgress) res = ncclSuccess;  // completes at ncclGroupEnd, polled below
    }
    ncclResult_t end = ncclGroupEnd();  // always closes the group
    if (end == ncclInProgress) end = ncclSuccess;
    if (res == ncclSuccess) res = end;
    for (int r = 0; r < n && res == ncclSuccess; ++r)
      res = group->comms[r] ? settle(group->comms[r], ncclInProgress, timeout_s) : ncclInternalError;
    if (res != ncclSuccess) {
      group->aborted = true;  // nothing usable to finalize
      for (ncclComm_t c : group->comms)
        if (c) ncclCommAbort(c);
      if (res == ncclInProgress)
        throw Error(str_cat("NCCL communicators not ready within ", timeout_s, " s (collective timeout)"));
      NCCL_CHECK(res);
    }
  }
  group->start_watchdog();
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) out.push_back(std::make_unique<NcclCommunicator>(group, r, algo));
  return out;
}

bool nccl_rendezvous_from_environment() {
  const char* v = std::getenv("NCCL_COMM_ID");
  return v && *v;
}

std::vector<std::unique_ptr<Communicator>> make_nccl_process_communicators(
    int device, int rank, int world, ProcessGroup* ids, const std::vector<AllReduceAlgo>& algos,
    double timeout_s) {
  UNETCU_CHECK(timeout_s > 0, "the collective timeout must be positive, got ", timeout_s, " s");
  for (AllReduceAlgo a : algos)
    UNETCU_CHECK(a != AllReduceAlgo::Mpi, "the transport's own all-reduce is for CPU ranks; GPUs use "
                                          "NCCL's (ring) or ps");
  UNETCU_CHECK(world >= 1 && rank >= 0 && rank < world, "NCCL rank ", rank, " of ", world);
  ncclUniqueId id;
  if (nccl_rendezvous_from_environment()) {
    NCCL_CHECK(ncclGetUniqueId(&id));  // the same id on every rank, from NCCL_COMM_ID
  } else {
    UNETCU_CHECK(ids, "GPU ranks in several processes need NCCL_COMM_ID=host:port, or a process group "
                      "(mpirun, srun --mpi, or torchrun's variables with the Gloo build) to share "
                      "NCCL's unique id");
    UNETCU_CHECK(ids->rank() == rank && ids->size() == world, "NCCL rank ", rank, " of ", world,
                 " but process group rank ", ids->rank(), " of ", ids->size());
    if (rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    ids->broadcast(&id, sizeof id, 0);
  }
  auto new_group = [&] {
    auto g = std::make_shared<NcclGroup>();
    g->devices = {device};
    g->first_rank = rank;
    g->world = world;
    g->timeout = timeout_s;
    g->comms.assign(1, nullptr);
    return g;
  };
  std::vector<std::shared_ptr<NcclGroup>> groups;
  // Settles a non-blocking init or split; on failure aborts every communicator made so far (a
  // finalize would wait for peers that are gone).
  auto ready = [&](NcclGroup& g, ncclResult_t res, const char* what) {
    if ((res == ncclSuccess || res == ncclInProgress) && g.comms[0])
      res = settle(g.comms[0], ncclInProgress, timeout_s);
    else if (res == ncclSuccess)
      res = ncclInternalError;  // no handle
    if (res == ncclSuccess) return;
    for (auto& made : groups) {
      made->aborted = true;
      if (made->comms[0]) ncclCommAbort(made->comms[0]);
    }
    if (res == ncclInProgress)
      throw Error(str_cat("NCCL rank ", rank, " of ", world, ": ", what, " not done within ", timeout_s,
                          " s (collective timeout; did every rank start?)"));
    NCCL_CHECK(res);
  };
  {
    cuda::DeviceGuard restore(device);
    UNETCU_CHECK(cudaSetDevice(device) == cudaSuccess, "NCCL rank ", rank, ": cannot use cuda:", device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // see NcclGroup
    groups.push_back(new_group());
    ready(*groups[0], ncclCommInitRankConfig(&groups[0]->comms[0], world, id, rank, &config),
          "ncclCommInitRank");
    for (size_t k = 1; k < algos.size(); ++k) {
      groups.push_back(new_group());
      ncclConfig_t split_config = NCCL_CONFIG_INITIALIZER;
      split_config.blocking = 0;
      ncclResult_t res = ncclCommSplit(groups[0]->comms[0], 0, rank, &groups[k]->comms[0], &split_config);
      // A split on a non-blocking communicator is an operation of the parent: the child's
      // handle is filled in only once the parent's state has left ncclInProgress.
      if (res == ncclSuccess || res == ncclInProgress) res = settle(groups[0]->comms[0], ncclInProgress, timeout_s);
      if (res == ncclSuccess && !groups[k]->comms[0]) res = ncclInternalError;
      ready(*groups[k], res, "ncclCommSplit");
    }
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (size_t k = 0; k < algos.size(); ++k) {
    groups[k]->start_watchdog();
    out.push_back(std::make_unique<NcclCommunicator>(groups[k], 0, algos[k]));
  }
  return out;
}

}  // namespace unetcu
