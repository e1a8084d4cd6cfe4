// One process per device, started by a launcher: who this process is, from the launcher's
// environment, in this order:
//   Open MPI  OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
//   torchrun  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (before
//             SLURM's: under `srun torchrun` they name the workers, SLURM's the agents)
//   SLURM     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, this node's entry of
//             SLURM_TASKS_PER_NODE (SLURM_NODEID) (and, started without PMI, MASTER_ADDR and
//             MASTER_PORT)
// DistMode::Auto takes the first that is present; Mpi and Env insist on MPI's or on the
// torchrun/SLURM variables; None ignores them all (one process).
#pragma once
#include <string>

#include "engine/named.h"

namespace unetcu {

enum class DistMode { Auto, Mpi, Env, None };
inline constexpr NamedValue<DistMode> kDistNames[] = {
    {"auto", DistMode::Auto}, {"mpi", DistMode::Mpi}, {"env", DistMode::Env}, {"none", DistMode::None}};

struct DistEnv {
  std::string launcher = "none";  // "mpi", "slurm", "torchrun" or "none"
  int rank = 0, world = 1, local_rank = 0, local_size = 1;
  std::string master_addr;
  int master_port = 0;
  bool multi() const { return world > 1; }
};

// From the environment; Error when the variables are inconsistent (rank outside the world,
// non-numbers) or when `mode` asks for a launcher whose variables are absent.
DistEnv detect_dist(DistMode mode);

// The process group's transport, chosen by the launcher:
//   mpirun (Open MPI)                       MPI
//   srun with PMI (--mpi=pmix, PMI_RANK)    MPI, in the MPI build
//   SLURM otherwise, torchrun               Gloo: TCP, meeting at MASTER_ADDR:MASTER_PORT
// (parallel/process_group.h). MPI: the build needs Open MPI (libopenmpi-dev); initialised once
// (thread level MULTIPLE: a rank's gradient all-reduces run on a communication thread beside
// its compute thread), finalised at exit. Gloo: the build needs libgloo-dev; rank 0 serves the
// rendezvous from here on (an error when MASTER_ADDR or MASTER_PORT is missing, or the port
// is taken); the ranks meet at the first world_process_group.
bool mpi_built();
bool gloo_built();
void init_process_group(const DistEnv& env);
// "MPI", "Gloo", or "" before init_process_group (or in one process).
std::string process_group_transport();
// Ends this process of the job after a rank's error was printed, and with it every rank
// (MPI_Abort; Gloo: the rendezvous is told, and the other ranks' connections close); returns
// when there is no process group.
void abort_process_group(int code);
std::string hostname();

}  // namespace unetcu
