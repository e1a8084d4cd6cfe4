#include "parallel/dist.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "parallel/gloo_group.h"
#include "parallel/mpi_group.h"
#include "parallel/process_group.h"
#include "runtime/common.h"

#ifdef UNETCU_HAVE_MPI
#include <mpi.h>
#endif

namespace unetcu {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  UNETCU_CHECK(errno == 0 && end && *end == '\0' && x >= 0 && x <= 1000000, "environment variable ",
               name, "='", v, "' is not a count");
  return int(x);
}

bool from_mpi(DistEnv* d) {
  if (!env("OMPI_COMM_WORLD_RANK") || !env("OMPI_COMM_WORLD_SIZE")) return false;
  d->launcher = "mpi";
  d->rank = env_int("OMPI_COMM_WORLD_RANK", 0);
  d->world = env_int("OMPI_COMM_WORLD_SIZE", 1);
  d->local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", d->rank);
  d->local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", d->world);
  return true;
}

// The tasks on this node: SLURM_TASKS_PER_NODE lists them node by node, compressed
// ("2(x3),1": three nodes of 2, then one of 1), always set in a step; SLURM_NODEID picks this
// node's entry. Without it (an unusual step): SLURM_NTASKS_PER_NODE, else SLURM_LOCALID + 1.
int slurm_tasks_on_this_node() {
  const char* list = env("SLURM_TASKS_PER_NODE");
  const char* node = env("SLURM_NODEID");
  if (list && node) {
    const int want = env_int("SLURM_NODEID", 0);
    int at = 0;
    for (const char* p = list; *p;) {
      char* end = nullptr;
      const long count = std::strtol(p, &end, 10);
      if (end == p || count < 1) break;
      long repeat = 1;
      p = end;
      if (std::strncmp(p, "(x", 2) == 0) {
        repeat = std::strtol(p + 2, &end, 10);
        if (end == p + 2 || *end != ')' || repeat < 1) break;
        p = end + 1;
      }
      if (want < at + repeat) return int(count);
      at += int(repeat);
      if (*p == ',') ++p;
    }
  }
  if (const char* per = env("SLURM_NTASKS_PER_NODE")) return std::max(1, std::atoi(per));
  return env_int("SLURM_LOCALID", 0) + 1;
}

bool from_slurm(DistEnv* d) {
  if (!env("SLURM_PROCID") || !env("SLURM_NTASKS")) return false;
  d->launcher = "slurm";
  d->rank = env_int("SLURM_PROCID", 0);
  d->world = env_int("SLURM_NTASKS", 1);
  d->local_rank = env_int("SLURM_LOCALID", 0);
  d->local_size = slurm_tasks_on_this_node();
  if (const char* a = env("MASTER_ADDR")) d->master_addr = a;  // for Gloo, without PMI
  d->master_port = env_int("MASTER_PORT", 0);
  return true;
}

bool from_torchrun(DistEnv* d) {
  if (!env("RANK") || !env("WORLD_SIZE")) return false;
  d->launcher = "torchrun";
  d->rank = env_int("RANK", 0);
  d->world = env_int("WORLD_SIZE", 1);
  d->local_rank = env_int("LOCAL_RANK", d->rank);
  d->local_size = env_int("LOCAL_WORLD_SIZE", d->world);
  if (const char* a = env("MASTER_ADDR")) d->master_addr = a;
  d->master_port = env_int("MASTER_PORT", 0);
  return true;
}

#ifdef UNETCU_HAVE_MPI
bool g_mpi_initialised = false;
#endif
std::string g_transport;  // "MPI" or "Gloo" once init_process_group chose

// MPI for processes an MPI launcher started (mpirun; srun with PMI, in the MPI build), else Gloo.
std::string choose_transport(const DistEnv& d) {
  if (d.launcher == "mpi") return "MPI";
  if (d.launcher == "slurm" && mpi_built() && (env("PMI_RANK") || env("PMIX_RANK"))) return "MPI";
  return "Gloo";
}

void init_mpi(const DistEnv& d) {
#ifdef UNETCU_HAVE_MPI
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  g_mpi_initialised = true;
  std::atexit([] {
    int done = 0;
    MPI_Finalized(&done);
    if (!done) MPI_Finalize();
  });
  UNETCU_CHECK(provided >= MPI_THREAD_MULTIPLE,
               "this MPI library does not support MPI_THREAD_MULTIPLE (a rank's gradient "
               "all-reduces run on their own thread)");
  int rank = -1, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  UNETCU_CHECK(rank == d.rank && size == d.world, "MPI says rank ", rank, " of ", size,
               ", the launcher's environment rank ", d.rank, " of ", d.world);
#else
  throw Error(str_cat("a process group of ", d.world, " (", d.launcher,
                      ") needs the MPI build: install libopenmpi-dev (tools/setup.sh) and rebuild"));
#endif
}

void init_gloo_from(const DistEnv& d) {
  const char* how = d.launcher == "slurm" ? "SLURM without an MPI launch (srun --mpi=pmix would use MPI)"
                                          : d.launcher.c_str();
  UNETCU_CHECK(gloo_built(), "a process group of ", d.world, " started by ", how,
               " needs the Gloo build: install libgloo-dev (tools/setup.sh) and rebuild, or start the "
               "ranks with mpirun");
  UNETCU_CHECK(!d.master_addr.empty() && d.master_port > 0,
               "a process group of ", d.world, " started by ", how, " meets at MASTER_ADDR:MASTER_PORT: set "
               "both (e.g. MASTER_ADDR=<rank 0's host> MASTER_PORT=29500), the same on every rank");
  UNETCU_CHECK(d.master_port <= 65535, "MASTER_PORT=", d.master_port, " is not a TCP port");
  // torchrun's agent may serve its own store (PyTorch's) at MASTER_PORT, and then says so to
  // its workers (TORCHELASTIC_USE_AGENT_STORE=True): the rendezvous takes the next port. Every
  // rank sees the same variables, so every rank picks the same port.
  const char* agent_store = env("TORCHELASTIC_USE_AGENT_STORE");
  const bool next_port = agent_store && std::strcmp(agent_store, "True") == 0;
  init_gloo(d.rank, d.world, d.local_size, d.master_addr, d.master_port + (next_port ? 1 : 0));
}

}  // namespace

DistEnv detect_dist(DistMode mode) {
  DistEnv d;
  bool found = false;
  switch (mode) {
    case DistMode::None: return d;
    case DistMode::Mpi:
      found = from_mpi(&d);
      UNETCU_CHECK(found, "an MPI process group was asked for, but this process was not started by "
                          "mpirun (no OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE)");
      break;
    case DistMode::Env:
      // torchrun's variables first: under `srun torchrun` they name the workers, SLURM's the
      // nodes' agents.
      found = from_torchrun(&d) || from_slurm(&d);
      UNETCU_CHECK(found, "a process group from the environment was asked for, but neither SLURM's "
                          "(SLURM_PROCID, SLURM_NTASKS) nor torchrun's (RANK, WORLD_SIZE) variables are set");
      break;
    case DistMode::Auto:
      found = from_mpi(&d) || from_torchrun(&d) || from_slurm(&d);
      break;
  }
  if (!found) return DistEnv{};
  UNETCU_CHECK(d.world >= 1 && d.rank < d.world, "launcher ", d.launcher, ": rank ", d.rank,
               " is outside a world of ", d.world);
  UNETCU_CHECK(d.local_size >= 1 && d.local_rank < d.local_size, "launcher ", d.launcher,
               ": local rank ", d.local_rank, " is outside a node of ", d.local_size);
  return d;
}

bool mpi_built() {
#ifdef UNETCU_HAVE_MPI
  return true;
#else
  return false;
#endif
}

void init_process_group(const DistEnv& d) {
  // A launcher's group, of several processes or of one (--dist naming the launcher).
  if (d.launcher == "none" || !g_transport.empty()) return;
  const std::string transport = choose_transport(d);
  if (transport == "MPI")
    init_mpi(d);
  else
    init_gloo_from(d);
  g_transport = transport;
}

std::string process_group_transport() { return g_transport; }

void abort_process_group(int code) {
#ifdef UNETCU_HAVE_MPI
  if (g_mpi_initialised) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  if (g_transport == "Gloo") abort_gloo(code);
}

std::shared_ptr<ProcessGroup> world_process_group(double timeout_s) {
  UNETCU_CHECK(!g_transport.empty(), "no process group: this process was not started as one rank of several "
                                     "(mpirun, srun, torchrun) or init_process_group was not called");
  return g_transport == "MPI" ? make_mpi_world_group(timeout_s) : make_gloo_world_group(timeout_s);
}

std::string hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

}  // namespace unetcu
