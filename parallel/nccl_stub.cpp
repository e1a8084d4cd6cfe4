// make_nccl_communicators for builds without CUDA.
#include "parallel/nccl_communicator.h"

namespace unetcu {

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<int>&, AllReduceAlgo,
                                                                  double) {
  throw Error("data parallelism over GPUs needs the CUDA build (NCCL)");
}

std::vector<std::unique_ptr<Communicator>> make_nccl_process_communicators(int, int, int, ProcessGroup*,
                                                                         const std::vector<AllReduceAlgo>&,
                                                                         double) {
  throw Error("data parallelism over GPUs needs the CUDA build (NCCL)");
}

bool nccl_rendezvous_from_environment() { return false; }

}  // namespace unetcu
