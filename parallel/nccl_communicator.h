// NCCL communicators for data parallelism over GPUs: one process, one host thread per GPU.
// The communicators come from ncclGetUniqueId + ncclCommInitRankConfig (non-blocking, inside
// one NCCL group), the calls that serve several processes too once the unique id is shared
// between them. A watchdog aborts the group when an operation outlives the collective timeout.
// Collectives are ordered on the calling thread's current stream of the rank's GPU;
// all_reduce_async runs on a communication stream that first waits on an event of the compute
// stream, and its wait() makes the compute stream wait in turn (no host synchronisation).
// Builds without CUDA get a stub that throws.
#pragma once
#include <memory>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/process_group.h"

namespace unetcu {

// algo: Ring is NCCL's all-reduce; ParameterServer is ncclReduce to rank 0 then ncclBroadcast
// (the parameter-server traffic pattern, for the article's comparison).
// timeout_s: a collective unfinished after this long aborts the group (see communicator.h).
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(
    const std::vector<int>& devices, AllReduceAlgo algo = AllReduceAlgo::Ring,
    double timeout_s = kDefaultCollectiveTimeout);

// One process's rank of a job of several (one GPU per process): rank `rank` of `world` on
// GPU `device`, as `algos.size()` communicators (groups of their own: DP's gradients and
// control). The unique id: with NCCL_COMM_ID=host:port in the environment, NCCL's own
// rendezvous (every rank derives the same id; rank 0 listens there); otherwise rank 0 makes it
// and broadcasts it over `ids` (the CPU process group, MPI or Gloo), which may then not be
// null. One bootstrap: the further communicators are ncclCommSplit of the first. Collective:
// every process calls it in the same order.
std::vector<std::unique_ptr<Communicator>> make_nccl_process_communicators(
    int device, int rank, int world, ProcessGroup* ids, const std::vector<AllReduceAlgo>& algos,
    double timeout_s);
// NCCL_COMM_ID is set: NCCL bootstraps the processes itself.
bool nccl_rendezvous_from_environment();

}  // namespace unetcu
