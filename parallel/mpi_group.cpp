#include "parallel/mpi_group.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "runtime/common.h"

#ifdef UNETCU_HAVE_MPI
#include <mpi.h>
#endif

namespace unetcu {

#ifndef UNETCU_HAVE_MPI

std::shared_ptr<ProcessGroup> make_mpi_world_group(double) {
  throw Error("a process group over MPI needs the MPI build (libopenmpi-dev; tools/setup.sh)");
}

#else

namespace {

// A blocking MPI call cannot be interrupted, so a thread watches the call in progress and,
// when it has waited longer than the timeout (a rank stopped, stuck or gone), prints which rank
// waited in which call and ends the job (MPI_Abort) instead of letting every rank hang.
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
  // Marks one call in progress for its lifetime.
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

int to_int(size_t bytes) {
  UNETCU_CHECK(bytes <= size_t(INT32_MAX), "an MPI message of ", bytes, " bytes is over MPI's 2 GiB count");
  return int(bytes);
}

class MpiGroup : public ProcessGroup {
 public:
  // Takes ownership of `comm`.
  MpiGroup(MPI_Comm comm, double timeout) : comm_(comm), timeout_(timeout) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    watchdog_ = std::make_unique<Watchdog>(rank_, timeout);
  }
  ~MpiGroup() override {
    watchdog_.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string transport() const override { return "MPI"; }
  double timeout() const override { return timeout_; }

  void send(const void* data, size_t bytes, int peer, int tag) override {
    if (!bytes) return;
    Watchdog::Scope w(*watchdog_, "send");
    MPI_Send(data, to_int(bytes), MPI_BYTE, peer, tag, comm_);
  }
  std::unique_ptr<Request> isend(const void* data, size_t bytes, int peer, int tag) override {
    auto r = std::make_unique<MpiRequest>(this);
    if (bytes) MPI_Isend(data, to_int(bytes), MPI_BYTE, peer, tag, comm_, &r->req);
    return r;
  }
  void recv(void* data, size_t bytes, int peer, int tag) override {
    if (!bytes) return;
    Watchdog::Scope w(*watchdog_, "receive");
    MPI_Recv(data, to_int(bytes), MPI_BYTE, peer, tag, comm_, MPI_STATUS_IGNORE);
  }
  void send_recv(const void* send_data, size_t send_bytes, int to, void* recv_data, size_t recv_bytes,
                 int from, int tag) override {
    Watchdog::Scope w(*watchdog_, "send/receive");
    // A zero-byte side is not sent: MPI_PROC_NULL makes it a no-op.
    MPI_Sendrecv(send_data, to_int(send_bytes), MPI_BYTE, send_bytes ? to : MPI_PROC_NULL, tag, recv_data,
                 to_int(recv_bytes), MPI_BYTE, recv_bytes ? from : MPI_PROC_NULL, tag, comm_,
                 MPI_STATUS_IGNORE);
  }
  void broadcast(void* data, size_t bytes, int root) override {
    if (!bytes) return;
    Watchdog::Scope w(*watchdog_, "broadcast");
    MPI_Bcast(data, to_int(bytes), MPI_BYTE, root, comm_);
  }
  void barrier() override {
    Watchdog::Scope w(*watchdog_, "barrier");
    MPI_Barrier(comm_);
  }
  void all_reduce_sum(void* data, int64_t count, DType dtype) override {
    UNETCU_CHECK(dtype == DType::F32 || dtype == DType::F64, "MPI all-reduce of ", dtype_name(dtype));
    UNETCU_CHECK(count <= INT32_MAX, "an MPI all-reduce of ", count, " elements is over MPI's count");
    if (!count) return;
    Watchdog::Scope w(*watchdog_, "MPI_Allreduce");
    MPI_Allreduce(MPI_IN_PLACE, data, int(count), dtype == DType::F32 ? MPI_FLOAT : MPI_DOUBLE, MPI_SUM, comm_);
  }
  std::shared_ptr<ProcessGroup> split(int colour) override {
    MPI_Comm c = MPI_COMM_NULL;
    {
      Watchdog::Scope w(*watchdog_, "split");
      MPI_Comm_split(comm_, colour, rank_, &c);
    }
    return std::make_shared<MpiGroup>(c, timeout_);
  }
  std::shared_ptr<ProcessGroup> duplicate() override {
    MPI_Comm c = MPI_COMM_NULL;
    {
      Watchdog::Scope w(*watchdog_, "duplicate");
      MPI_Comm_dup(comm_, &c);
    }
    return std::make_shared<MpiGroup>(c, timeout_);
  }
  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  struct MpiRequest : Request {
    explicit MpiRequest(MpiGroup* g) : group(g) {}
    ~MpiRequest() override {
      if (req == MPI_REQUEST_NULL) return;
      Watchdog::Scope w(*group->watchdog_, "send (wait)");
      MPI_Wait(&req, MPI_STATUS_IGNORE);
    }
    void wait() override {
      if (req == MPI_REQUEST_NULL) return;
      Watchdog::Scope w(*group->watchdog_, "send (wait)");
      MPI_Wait(&req, MPI_STATUS_IGNORE);
    }
    MpiGroup* group;
    MPI_Request req = MPI_REQUEST_NULL;
  };

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  double timeout_;
  std::unique_ptr<Watchdog> watchdog_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_mpi_world_group(double timeout_s) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  UNETCU_CHECK(initialised, "a process group over MPI needs MPI initialised (init_process_group)");
  UNETCU_CHECK(timeout_s > 0, "the collective timeout must be positive, got ", timeout_s, " s");
  MPI_Comm c = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &c);
  return std::make_shared<MpiGroup>(c, timeout_s);
}

#endif  // UNETCU_HAVE_MPI

}  // namespace unetcu
