#include "parallel/mpi_communicator.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "parallel/comm_thread.h"

#ifdef UNETCU_HAVE_MPI
#include <mpi.h>
#endif

namespace unetcu {

#ifndef UNETCU_HAVE_MPI

std::unique_ptr<Communicator> make_mpi_communicator(AllReduceAlgo, double) {
  throw Error("data parallelism across processes needs the MPI build (libopenmpi-dev)");
}

#else

namespace {

// The collective timeout for MPI ranks: a blocking MPI call cannot be interrupted, so a thread
// watches the collective in progress and, when it has waited longer than the timeout (a rank
// stopped, stuck or gone), prints which rank waited in which collective and ends the job
// (MPI_Abort) instead of letting every rank hang.
class Watchdog {
 public:
  Watchdog(int rank, double timeout) : rank_(rank), timeout_(timeout), thread_([this] { loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Marks one collective in progress for its lifetime.
  class Scope {
   public:
    Scope(Watchdog& w, const char* op) : w_(w) {
      std::lock_guard<std::mutex> lock(w_.mu_);
      w_.op_ = op;
      w_.since_ = Clock::now();
      w_.busy_ = true;
    }
    ~Scope() {
      std::lock_guard<std::mutex> lock(w_.mu_);
      w_.busy_ = false;
    }

   private:
    Watchdog& w_;
  };

 private:
  using Clock = std::chrono::steady_clock;
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (!busy_ || stop_) continue;
      const double waited = std::chrono::duration<double>(Clock::now() - since_).count();
      if (waited <= timeout_) continue;
      std::fprintf(stderr, "error: collective timed out: rank %d waited %g s in %s "
                   "for the other ranks (collective timeout); ending every rank\n", rank_, timeout_, op_);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  int rank_;
  double timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, busy_ = false;
  const char* op_ = "";
  Clock::time_point since_;
  std::thread thread_;
};

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(AllReduceAlgo algo, double timeout) : algo_(algo) {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    watchdog_ = std::make_unique<Watchdog>(rank_, timeout);
    comm_thread_ = std::make_unique<CommThread>("rank " + std::to_string(rank_) + " comm");
  }
  ~MpiCommunicator() override {
    comm_thread_.reset();  // its queued collectives first
    watchdog_.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce(Tensor& t, ReduceOp op) override {
    check(t, "all_reduce");
    Watchdog::Scope watched(*watchdog_, "all_reduce");
    UNETCU_DISPATCH_FLOAT(t.dtype(), T, {
      if (algo_ == AllReduceAlgo::Ring)
        ring<T>(t.data<T>(), t.numel(), op);
      else if (algo_ == AllReduceAlgo::ParameterServer)
        ps<T>(t.data<T>(), t.numel(), op);
      else
        native<T>(t.data<T>(), t.numel(), op);
    });
  }
  void broadcast(Tensor& t, int root) override {
    check(t, "broadcast");
    Watchdog::Scope watched(*watchdog_, "broadcast");
    MPI_Bcast(t.raw(), int(t.nbytes()), MPI_BYTE, root, comm_);
  }
  void reduce(Tensor& t, int root, ReduceOp op) override {
    check(t, "reduce");
    Watchdog::Scope watched(*watchdog_, "reduce");
    UNETCU_DISPATCH_FLOAT(t.dtype(), T, sum_at<T>(t.data<T>(), t.numel(), root, op));
  }
  void barrier() override {
    Watchdog::Scope watched(*watchdog_, "barrier");
    MPI_Barrier(comm_);
  }
  void abort() override { MPI_Abort(MPI_COMM_WORLD, 1); }

  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) override {
    return comm_thread_->submit(
        algo_ == AllReduceAlgo::Ring ? "all_reduce ring (mpi)"
        : algo_ == AllReduceAlgo::ParameterServer ? "all_reduce ps (mpi)" : "MPI_Allreduce",
        double(t.nbytes()), [this, t, op]() mutable { all_reduce(t, op); });
  }

 private:
  void check(const Tensor& t, const char* what) const {
    UNETCU_CHECK(t.device().is_cpu(), what, ": the MPI communicator needs CPU tensors, got ",
                 t.device().str());
  }

  // Reduce-scatter then all-gather, as parallel/cpu_ring.cpp: in reduce-scatter step s rank r
  // receives chunk (r - s - 1) from its left neighbour and adds it to its own (mine += left's),
  // sending chunk (r - s) to the right; then it owns the sum of chunk (r + 1), averages it,
  // and in all-gather step s receives chunk (r - s) from the left, sending chunk (r + 1 - s).
  template <class T>
  void ring(T* mine, int64_t L, ReduceOp op) {
    const int N = size_;
    if (N == 1) return;
    const int left = (rank_ + N - 1) % N, right = (rank_ + 1) % N;
    auto mod = [N](int c) { return ((c % N) + N) % N; };
    std::vector<T> recv(size_t(L / N + 1));
    for (int s = 0; s < N - 1; ++s) {
      const int cs = mod(rank_ - s), cr = mod(rank_ - s - 1);
      const int64_t sb = ring_chunk_begin(L, N, cs), se = ring_chunk_begin(L, N, cs + 1);
      const int64_t rb = ring_chunk_begin(L, N, cr), re = ring_chunk_begin(L, N, cr + 1);
      MPI_Sendrecv(mine + sb, int((se - sb) * sizeof(T)), MPI_BYTE, right, s, recv.data(),
                   int((re - rb) * sizeof(T)), MPI_BYTE, left, s, comm_, MPI_STATUS_IGNORE);
      for (int64_t i = 0; i < re - rb; ++i) mine[rb + i] += recv[size_t(i)];
    }
    if (op == ReduceOp::Average) {
      const int owned = mod(rank_ + 1);
      for (int64_t i = ring_chunk_begin(L, N, owned); i < ring_chunk_begin(L, N, owned + 1); ++i) mine[i] /= T(N);
    }
    for (int s = 0; s < N - 1; ++s) {
      const int cs = mod(rank_ + 1 - s), cr = mod(rank_ - s);
      const int64_t sb = ring_chunk_begin(L, N, cs), se = ring_chunk_begin(L, N, cs + 1);
      const int64_t rb = ring_chunk_begin(L, N, cr), re = ring_chunk_begin(L, N, cr + 1);
      MPI_Sendrecv(mine + sb, int((se - sb) * sizeof(T)), MPI_BYTE, right, N + s, mine + rb,
                   int((re - rb) * sizeof(T)), MPI_BYTE, left, N + s, comm_, MPI_STATUS_IGNORE);
    }
  }

  // Parameter-server pattern: root adds every other rank's buffer in rank order, then (ps
  // all-reduce) broadcasts the result.
  template <class T>
  void sum_at(T* mine, int64_t L, int root, ReduceOp op) {
    if (rank_ == root) {
      std::vector<T> recv(static_cast<size_t>(L));
      for (int r = 0; r < size_; ++r) {
        if (r == root) continue;
        MPI_Recv(recv.data(), int(L * sizeof(T)), MPI_BYTE, r, 7, comm_, MPI_STATUS_IGNORE);
        for (int64_t i = 0; i < L; ++i) mine[i] += recv[size_t(i)];
      }
      if (op == ReduceOp::Average)
        for (int64_t i = 0; i < L; ++i) mine[i] /= T(size_);
    } else {
      MPI_Send(mine, int(L * sizeof(T)), MPI_BYTE, root, 7, comm_);
    }
  }
  // The MPI library's own all-reduce (its algorithm, its order of additions), then the mean.
  template <class T>
  void native(T* mine, int64_t L, ReduceOp op) {
    MPI_Allreduce(MPI_IN_PLACE, mine, int(L), sizeof(T) == 4 ? MPI_FLOAT : MPI_DOUBLE, MPI_SUM, comm_);
    if (op == ReduceOp::Average)
      for (int64_t i = 0; i < L; ++i) mine[i] /= T(size_);
  }
  template <class T>
  void ps(T* mine, int64_t L, ReduceOp op) {
    sum_at<T>(mine, L, 0, op);
    MPI_Bcast(mine, int(L * sizeof(T)), MPI_BYTE, 0, comm_);
  }

  AllReduceAlgo algo_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<Watchdog> watchdog_;
  std::unique_ptr<CommThread> comm_thread_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(AllReduceAlgo algo, double timeout_s) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  UNETCU_CHECK(initialised, "the MPI communicator needs the process group (init_process_group)");
  UNETCU_CHECK(timeout_s > 0, "the collective timeout must be positive, got ", timeout_s, " s");
  return std::make_unique<MpiCommunicator>(algo, timeout_s);
}

#endif  // UNETCU_HAVE_MPI

}  // namespace unetcu
