// The CPU communicator across processes: this process's rank of a process group
// (parallel/process_group.h: MPI or Gloo). The ring and ps algorithms are the in-process CPU
// communicator's (parallel/cpu_ring.cpp), step for step over point-to-point messages: the same
// additions in the same order, so a run across processes gives the same bits as one in one
// process. AllReduceAlgo::Mpi is the transport library's own all-reduce. all_reduce_async runs
// on a communication thread per communicator. abort() ends the job: a rank's failure ends
// every rank; so does a call that waits longer than the group's timeout.
#pragma once
#include <memory>

#include "parallel/communicator.h"
#include "parallel/process_group.h"

namespace unetcu {

// Takes a group of its own (no other user may send on it).
std::unique_ptr<Communicator> make_process_communicator(std::shared_ptr<ProcessGroup> group,
                                                        AllReduceAlgo algo);

}  // namespace unetcu
