// The MPI transport of ProcessGroup (parallel/process_group.h): a group is a duplicate or a
// split of MPI_COMM_WORLD; a watchdog thread per group ends the job (MPI_Abort) when a call
// waits longer than the timeout. Only in the MPI build (UNETCU_HAVE_MPI).
#pragma once
#include <memory>

#include "parallel/process_group.h"

namespace unetcu {

// A duplicate of MPI_COMM_WORLD; MPI must be initialised (init_process_group).
std::shared_ptr<ProcessGroup> make_mpi_world_group(double timeout_s);

}  // namespace unetcu
