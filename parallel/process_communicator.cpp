#include "parallel/process_communicator.h"

#include <vector>

#include "parallel/comm_thread.h"
#include "parallel/reduce_math.h"

namespace unetcu {

namespace {


class ProcessCommunicator : public Communicator {
 public:
  ProcessCommunicator(std::shared_ptr<ProcessGroup> group, AllReduceAlgo algo)
      : algo_(algo), group_(std::move(group)), rank_(group_->rank()), size_(group_->size()) {
    comm_thread_ = std::make_unique<CommThread>("rank " + std::to_string(rank_) + " comm");
  }
  ~ProcessCommunicator() override { comm_thread_.reset(); }  // its queued collectives first
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce(Tensor& t, ReduceOp op) override {
    check(t, "all_reduce");
    UNETCU_CHECK(algo_ != AllReduceAlgo::Mpi || t.dtype() != DType::BF16, "the ", group_->transport(),
                 " library's own all-reduce has no bfloat16 sum: bfloat16 gradients take the ring or ps all-reduce");
    UNETCU_DISPATCH_STORAGE(t.dtype(), T, {
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
    group_->broadcast(t.raw(), t.nbytes(), root);
  }
  void reduce(Tensor& t, int root, ReduceOp op) override {
    check(t, "reduce");
    UNETCU_DISPATCH_STORAGE(t.dtype(), T, sum_at<T>(t.data<T>(), t.numel(), root, op));
  }
  void barrier() override { group_->barrier(); }
  void abort() override { group_->abort(1); }

  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) override {
    const std::string via = " (" + group_->transport() + ")";
    return comm_thread_->submit(
        algo_ == AllReduceAlgo::Ring ? "all_reduce ring" + via
        : algo_ == AllReduceAlgo::ParameterServer ? "all_reduce ps" + via : group_->transport() + " all-reduce",
        double(t.nbytes()), [this, t, op]() mutable { all_reduce(t, op); });
  }

 private:
  void check(const Tensor& t, const char* what) const {
    UNETCU_CHECK(t.device().is_cpu(), what, ": a communicator across processes needs CPU tensors, got ",
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
      group_->send_recv(mine + sb, size_t(se - sb) * sizeof(T), right, recv.data(),
                        size_t(re - rb) * sizeof(T), left, s);
      reduce_add_into(mine + rb, recv.data(), re - rb);
    }
    if (op == ReduceOp::Average) {
      const int owned = mod(rank_ + 1);
      const int64_t b = ring_chunk_begin(L, N, owned);
      reduce_divide(mine + b, ring_chunk_begin(L, N, owned + 1) - b, N);
    }
    for (int s = 0; s < N - 1; ++s) {
      const int cs = mod(rank_ + 1 - s), cr = mod(rank_ - s);
      const int64_t sb = ring_chunk_begin(L, N, cs), se = ring_chunk_begin(L, N, cs + 1);
      const int64_t rb = ring_chunk_begin(L, N, cr), re = ring_chunk_begin(L, N, cr + 1);
      group_->send_recv(mine + sb, size_t(se - sb) * sizeof(T), right, mine + rb,
                        size_t(re - rb) * sizeof(T), left, N + s);
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
        group_->recv(recv.data(), size_t(L) * sizeof(T), r, 7);
        reduce_add_into(mine, recv.data(), L);
      }
      if (op == ReduceOp::Average) reduce_divide(mine, L, size_);
    } else {
      group_->send(mine, size_t(L) * sizeof(T), root, 7);
    }
  }
  // The transport library's own all-reduce (its algorithm, its order of additions), then the mean.
  template <class T>
  void native(T* mine, int64_t L, ReduceOp op) {
    group_->all_reduce_sum(mine, L, dtype_of<T>());
    if (op == ReduceOp::Average) reduce_divide(mine, L, size_);
  }
  template <class T>
  void ps(T* mine, int64_t L, ReduceOp op) {
    sum_at<T>(mine, L, 0, op);
    group_->broadcast(mine, size_t(L) * sizeof(T), 0);
  }

  AllReduceAlgo algo_;
  std::shared_ptr<ProcessGroup> group_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<CommThread> comm_thread_;
};

}  // namespace

std::unique_ptr<Communicator> make_process_communicator(std::shared_ptr<ProcessGroup> group,
                                                        AllReduceAlgo algo) {
  UNETCU_CHECK(group, "a communicator across processes needs a process group");
  return std::make_unique<ProcessCommunicator>(std::move(group), algo);
}

}  // namespace unetcu
