// Collective communication between the replicas of data parallelism. One Communicator object
// per rank, used by that rank's thread(s); all ranks of a group call the same collectives in
// the same order with tensors of the same size and dtype.
//
// Implementations:
//  - CpuRingGroup: ranks are CPU devices (cpu:N) in one process. All-reduce is the ring
//    algorithm: reduce-scatter, then all-gather, each N-1 steps over N chunks; every rank sends
//    and receives 2(N-1)/N of the buffer (S bytes): 2(N-1)/N·S per rank, independent of N for
//    large N. The "ps" flavour reduces to rank 0 and broadcasts back: rank 0 receives and sends
//    (N-1)·S, the parameter-server bottleneck.
//  - NCCL (parallel/nccl_communicator.*, CUDA builds): one host thread per GPU.
//
// Ordering rule: every rank issues the same collectives in the same order, on each of its
// communicators, and — where one process holds several groups on a device (data parallelism's
// gradient and control groups) — NCCL operations on one device run in the order they were
// issued, whatever group or stream they belong to (nccl_communicator.cu chains them with
// events), so two groups never wait on each other in opposite orders on two GPUs.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/named.h"
#include "engine/tensor.h"

namespace unetcu {

enum class ReduceOp { Sum, Average };
// Ring and ParameterServer are ours (on every transport); Mpi is the MPI library's own
// MPI_Allreduce, for ranks in several processes only.
enum class AllReduceAlgo { Ring, ParameterServer, Mpi };
inline constexpr NamedValue<AllReduceAlgo> kAllReduceNames[] = {
    {"ring", AllReduceAlgo::Ring}, {"ps", AllReduceAlgo::ParameterServer}, {"mpi", AllReduceAlgo::Mpi}};
// The dtype data parallelism's gradients travel in: their own (full) or bfloat16 (true).
inline constexpr NamedValue<bool> kAllReducePrecisionNames[] = {{"full", false}, {"bf16", true}};

// An all-reduce in flight. wait(): on CPU ranks, blocks until it is done; on a GPU, makes the
// calling thread's current stream wait for it (no host wait).
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place on `t` (contiguous, float32, float64 or bfloat16). Blocks until this rank's part
  // is done. bfloat16 is added in float32 and each partial sum rounded to bfloat16 (NCCL's
  // arithmetic). Average divides the sum here (the CPU rings); NCCL's premultiplies each rank's
  // values by 1/N rounded to the dtype, biased in bfloat16 unless N is a power of two: to
  // average bfloat16 alike everywhere, sum and divide in float32 afterwards.
  virtual void all_reduce(Tensor& t, ReduceOp op) = 0;
  virtual void broadcast(Tensor& t, int root) = 0;
  // The result lands in root's tensor; other ranks' tensors are left as they were.
  virtual void reduce(Tensor& t, int root, ReduceOp op) = 0;
  virtual void barrier() = 0;
  // Starts an all-reduce that runs while the caller goes on (the CPU ring on a communication
  // thread per rank; NCCL on a communication stream). Every rank must issue the same async
  // collectives in the same order, and not touch `t` until wait() returns.
  virtual std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) = 0;
  // After a rank failed: every rank's pending and later collectives end with an error. The
  // group cannot be used again.
  virtual void abort() = 0;
  // Throws the reason when the group was aborted: results of collectives queued before that
  // and read without a later call (a GPU's, read after a host wait) are undefined. CPU ranks
  // report their failures from the calls themselves: nothing to do.
  virtual void check_healthy() const {}
  // GPUs: a CUDA graph holding collectives of this group was just launched on the calling
  // thread's current stream. Collectives issued while a stream is capturing are recorded, not
  // run, and not timed one by one; the watchdog times the launch instead (an unfinished
  // replay past the collective timeout aborts the group), and later collectives on the device
  // follow it. CPU ranks have no graphs: nothing to do.
  virtual void watch_launch(const char* /*what*/) {}
};

// Chunk c of a length-L buffer split in N for the ring: [c*L/N, (c+1)*L/N), possibly empty
// when L < N. The in-process ring and the MPI ring both cut here, so they add the same
// elements in the same order (byte-identical results across the two).
inline int64_t ring_chunk_begin(int64_t L, int N, int c) { return L * c / N; }

// A collective that has not completed after this long aborts its group (every rank then ends
// with a message naming the rank and the collective that waited), instead of hanging.
inline constexpr double kDefaultCollectiveTimeout = 600;

// An in-process group of CPU ranks. make_communicators returns one Communicator per rank;
// they share the group's state and must each be driven by a different thread.
std::vector<std::unique_ptr<Communicator>> make_cpu_communicators(
    int size, AllReduceAlgo algo, double timeout_s = kDefaultCollectiveTimeout);

}  // namespace unetcu
