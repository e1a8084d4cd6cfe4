// The CPU communicator: ranks are threads of one process, buffers are host memory. Data moves
// as in a message-passing ring: in each step a rank reads only its left neighbour's buffer (the
// chunk that neighbour "sends") and writes only its own; a barrier separates the steps.
#include <chrono>
#include <condition_variable>
#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <thread>
#include <mutex>
#include <string>

#include "runtime/device.h"
#include "engine/profiler.h"
#include "parallel/comm_thread.h"
#include "parallel/communicator.h"
#include "parallel/reduce_math.h"

namespace unetcu {

namespace {

// Reusable barrier for `n` threads (C++17 has no std::barrier) that can be aborted, with a
// watchdog: a rank that waits longer than `timeout` seconds for the others aborts the group,
// naming itself and the collective, so every rank ends with that message instead of hanging
// (a rank stuck or gone elsewhere never arrives).
class Barrier {
 public:
  Barrier(int n, double timeout) : n_(n), timeout_(timeout) {}
  void wait(int rank, const char* what) {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_) throw Error(reason_);
    const uint64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    const auto limit = std::chrono::duration<double>(timeout_);
    if (!cv_.wait_for(lock, limit, [&] { return generation_ != gen || aborted_; })) {
      abort_locked(str_cat("collective timed out: rank ", rank, " waited ", timeout_, " s in ",
                           what, " for the other ranks (collective timeout)"));
    }
    if (generation_ == gen) throw Error(reason_);
  }
  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    abort_locked(reason);
  }

 private:
  void abort_locked(const std::string& reason) {
    if (!aborted_) reason_ = reason;  // the first reason is the cause
    aborted_ = true;
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  double timeout_;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string reason_;
};

struct Group {
  Group(int n, AllReduceAlgo a, double timeout)
      : size(n), algo(a), barrier(n, timeout), buffers(n), counts(n), dtypes(n) {}
  int size;
  AllReduceAlgo algo;
  Barrier barrier;
  std::vector<void*> buffers;  // each rank's tensor for the collective in progress
  std::vector<int64_t> counts;
  std::vector<DType> dtypes;
};


class CpuRingCommunicator : public Communicator {
 public:
  CpuRingCommunicator(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }

  void all_reduce(Tensor& t, ReduceOp op) override {
    publish(t, "all_reduce");
    if (g_->algo == AllReduceAlgo::Ring)
      UNETCU_DISPATCH_STORAGE(t.dtype(), T, ring_all_reduce<T>(op));
    else
      UNETCU_DISPATCH_STORAGE(t.dtype(), T, ps_all_reduce<T>(op));
    sync();  // nobody leaves while a neighbour may still read its buffer
  }

  void broadcast(Tensor& t, int root) override {
    publish(t, "broadcast");
    check_root(root);
    if (rank_ != root) std::memcpy(t.raw(), g_->buffers[root], t.nbytes());
    sync();
  }

  void reduce(Tensor& t, int root, ReduceOp op) override {
    publish(t, "reduce");
    check_root(root);
    if (rank_ == root) UNETCU_DISPATCH_STORAGE(t.dtype(), T, sum_at_root<T>(op));
    sync();
  }

  void barrier() override {
    op_ = "barrier";
    sync();
  }
  void abort() override { g_->barrier.abort("collective aborted: another rank failed"); }

  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) override {
    return comm_.submit(g_->algo == AllReduceAlgo::Ring ? "all_reduce ring" : "all_reduce ps",
                        double(t.nbytes()), [this, t, op]() mutable { all_reduce(t, op); });
  }

 private:
  // Every rank registers its buffer; after the barrier all ranks see all buffers.
  void publish(Tensor& t, const char* what) {
    op_ = what;
    UNETCU_CHECK(t.device().is_cpu(), what, ": the CPU communicator needs CPU tensors, got ",
                 t.device().str());
    g_->buffers[rank_] = t.raw();
    g_->counts[rank_] = t.numel();
    g_->dtypes[rank_] = t.dtype();
    sync();
    // All ranks check the same thing, so they all throw together (no rank left waiting); the
    // second barrier keeps a rank that throws from overwriting its entry for its next
    // collective while a slower rank is still checking this one.
    bool agree = true;
    for (int r = 0; r < g_->size; ++r)
      agree = agree && g_->counts[r] == g_->counts[0] && g_->dtypes[r] == g_->dtypes[0];
    const int64_t mine = g_->counts[rank_], first = g_->counts[0];
    sync();
    UNETCU_CHECK(agree, what, ": ranks disagree on the tensor (rank ", rank_, ": ", mine,
                 " elements, rank 0: ", first, ")");
  }
  void check_root(int root) {
    UNETCU_CHECK(root >= 0 && root < g_->size, "root rank ", root, " out of range");
  }

  template <class T>
  T* buf(int r) const { return static_cast<T*>(g_->buffers[r]); }

  template <class T>
  void ring_all_reduce(ReduceOp op) {
    const int N = g_->size;
    const int64_t L = g_->counts[rank_];
    const int left = (rank_ + N - 1) % N;
    T* mine = buf<T>(rank_);
    const T* from_left = buf<T>(left);
    // Reduce-scatter: in step s, receive chunk (r - s - 1) from the left and add it to ours.
    // The left neighbour is itself adding into chunk (r - s - 2) in this step, so the chunk we
    // read is not being written. After N - 1 steps we own the full sum of chunk (r + 1).
    for (int s = 0; s < N - 1; ++s) {
      const int c = ((rank_ - s - 1) % N + N) % N;
      const int64_t b = ring_chunk_begin(L, N, c), e = ring_chunk_begin(L, N, c + 1);
      reduce_add_into(mine + b, from_left + b, e - b);
      sync();
    }
    const int owned = (rank_ + 1) % N;
    if (op == ReduceOp::Average) {
      const int64_t b = ring_chunk_begin(L, N, owned), e = ring_chunk_begin(L, N, owned + 1);
      reduce_divide(mine + b, e - b, N);
      sync();
    }
    // All-gather: in step s, copy the finished chunk (r - s) from the left.
    for (int s = 0; s < N - 1; ++s) {
      const int c = ((rank_ - s) % N + N) % N;
      const int64_t b = ring_chunk_begin(L, N, c), e = ring_chunk_begin(L, N, c + 1);
      std::copy(from_left + b, from_left + e, mine + b);
      sync();
    }
  }

  // Parameter-server pattern: every rank's buffer goes to rank 0, which sums in rank order and
  // the result goes back to every rank.
  template <class T>
  void ps_all_reduce(ReduceOp op) {
    if (rank_ == 0) sum_at_root<T>(op);
    sync();
    if (rank_ != 0) std::copy(buf<T>(0), buf<T>(0) + g_->counts[0], buf<T>(rank_));
  }

  template <class T>
  void sum_at_root(ReduceOp op) {
    const int64_t L = g_->counts[rank_];
    T* mine = buf<T>(rank_);
    for (int r = 0; r < g_->size; ++r)
      if (r != rank_) reduce_add_into(mine, buf<T>(r), L);
    if (op == ReduceOp::Average)
      reduce_divide(mine, L, g_->size);
  }

  // One step of a collective: wait for every rank (or the watchdog's timeout).
  void sync() { g_->barrier.wait(rank_, op_); }

  std::shared_ptr<Group> g_;
  int rank_;
  const char* op_ = "collective";  // the collective in progress, for the watchdog's message
  // Last: made after and destroyed before what its queued collectives use.
  CommThread comm_{"rank " + std::to_string(rank_) + " comm"};
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_cpu_communicators(int size, AllReduceAlgo algo,
                                                                 double timeout_s) {
  UNETCU_CHECK(size >= 1, "a communicator group needs at least one rank");
  UNETCU_CHECK(timeout_s > 0, "the collective timeout must be positive, got ", timeout_s, " s");
  UNETCU_CHECK(algo != AllReduceAlgo::Mpi, "the MPI library's all-reduce is for ranks in several "
                                           "processes (mpirun); replicas in one process use ring or ps");
  auto g = std::make_shared<Group>(size, algo, timeout_s);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<CpuRingCommunicator>(g, r));
  return out;
}

}  // namespace unetcu
