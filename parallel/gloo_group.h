// The Gloo transport of ProcessGroup (parallel/process_group.h), for processes started with
// torchrun's variables (or by SLURM without an MPI launch) and no MPI: TCP between every pair
// of ranks (Gloo's tcp transport). A group is a Gloo context whose ranks exchanged their
// addresses through the rendezvous at MASTER_ADDR:MASTER_PORT (parallel/rendezvous.h), under a
// key prefix of its own. A call that fails — it waited past the group's timeout, or a peer's
// connection closed because that rank ended — prints which rank, which call and why, tells the
// rendezvous, and ends this process; the other ranks then end the same way. Only in the Gloo
// build (UNETCU_HAVE_GLOO).
#pragma once
#include <memory>
#include <string>

#include "parallel/process_group.h"

namespace unetcu {

bool gloo_built();
// This process is rank `rank` of `world` (`local_size` of them on this host), meeting at
// addr:port; rank 0 starts serving the rendezvous there (Error when the port cannot be bound).
// Once per process. Gloo listens on the address this host reaches addr by; when that is a
// loopback address and the job spans hosts, the error says to set MASTER_ADDR to one the other
// hosts reach.
void init_gloo(int rank, int world, int local_size, const std::string& addr, int port);
// A new group of every rank; collective. The first call meets the other ranks at the
// rendezvous and waits at most timeout_s for them (Error: "only K of N ranks arrived").
std::shared_ptr<ProcessGroup> make_gloo_world_group(double timeout_s);
// Tells the other ranks (through the rendezvous) that this rank ends the job, then ends this
// process with `code`; returns when init_gloo was not called.
void abort_gloo(int code);

}  // namespace unetcu
