// The CPU communicator across processes: this process's rank of MPI_COMM_WORLD, over a
// duplicate of it (one per group, so the gradient and control groups never pair up). The ring
// and ps algorithms are the in-process CPU communicator's (parallel/cpu_ring.cpp), step for
// step over point-to-point messages: the same additions in the same order, so a run across
// processes gives the same bits as one in one process. all_reduce_async runs on a
// communication thread per communicator (MPI_THREAD_MULTIPLE). abort() ends the job
// (MPI_Abort): a rank's failure ends every rank; so does a collective that waits longer than
// timeout_s (a watchdog thread; the message names the rank and the collective).
#pragma once
#include <memory>

#include "parallel/communicator.h"

namespace unetcu {

std::unique_ptr<Communicator> make_mpi_communicator(AllReduceAlgo algo,
                                                   double timeout_s = kDefaultCollectiveTimeout);

}  // namespace unetcu
