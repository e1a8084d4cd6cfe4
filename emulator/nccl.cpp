// The CUDA emulator's NCCL (include/nccl.h): communicators between ranks of this process, their
// collectives queued on streams as NCCL's kernels are. See README.md.
//
// A clique is the ranks of one unique id (or of one split). A collective is work on the
// calling rank's stream; when the stream reaches it, the rank arrives at its next round (the
// rounds count the collectives each rank has run, in stream order, so a captured collective
// replayed from a CUDA graph is a new round each time) and waits there for every other rank;
// the last to arrive checks that all called the same collective, computes it for all and lets
// them go. What a GPU would hang on or corrupt silently stops the run here with a message: the
// ranks disagreeing on the collective, one communicator running two collectives at once (no
// stream order between them), a buffer that is not the rank's device memory.
#include <nccl.h>
#include <emu_device.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace unetcu_emu {
namespace {

enum class Kind { AllReduce, Reduce, Broadcast };

struct Call {
  Kind kind = Kind::AllReduce;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  ncclRedOp_t op = ncclSum;
  int root = 0;
};

struct Round {
  std::vector<Call> calls;
  int arrived = 0, left = 0;
  bool done = false;
};

struct SplitCall {
  int color = 0, key = 0;
  ncclComm_t* out = nullptr;
  bool blocking = true;
};
struct SplitRound {
  std::vector<SplitCall> calls;
  int arrived = 0;
  bool done = false;
};

struct Clique {
  explicit Clique(int n)
      : nranks(n), taken(n, 0), devices(n, -1), state(n, ncclInProgress), aborted(n, 0), executed(n, 0),
        running(n, 0), splits(n, 0) {}
  const int nranks;
  std::mutex m;
  std::condition_variable cv;
  int joined = 0;
  std::vector<char> taken;
  std::vector<int> devices;
  std::vector<ncclResult_t> state;  // each rank's asynchronous state (ncclCommGetAsyncError)
  // Each rank's communicator aborted: its waiting and later collectives return at once. Its
  // peers' go on waiting, as on GPUs, until their own abort (their watchdog's timeout).
  std::vector<char> aborted;
  std::vector<uint64_t> executed;   // collectives each rank has started, in stream order
  std::vector<char> running;        // a rank's collective is under way
  std::map<uint64_t, Round> rounds;
  std::vector<uint64_t> splits;     // splits each rank has called
  std::map<uint64_t, SplitRound> split_rounds;
};

}  // namespace
}  // namespace unetcu_emu

struct ncclComm {
  std::shared_ptr<unetcu_emu::Clique> clique;
  int rank;
  int device;
  bool blocking;
};

namespace unetcu_emu {
namespace {

// The cliques still waiting for ranks, by unique id.
std::mutex g_ids_mutex;
std::map<std::string, std::shared_ptr<Clique>> g_forming;
std::atomic<uint64_t> g_next_id{1};

thread_local int t_group_depth = 0;
thread_local std::vector<ncclComm_t> t_group_blocking;  // blocking inits a group defers

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32: return 4;
    case ncclFloat64: return 8;
    case ncclBfloat16: return 2;
    default: return 0;  // not emulated
  }
}
const char* type_name(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32: return "float32";
    case ncclFloat64: return "float64";
    case ncclBfloat16: return "bfloat16";
    default: return "an unemulated type";
  }
}
const char* op_name(ncclRedOp_t op) {
  switch (op) {
    case ncclSum: return "sum";
    case ncclProd: return "prod";
    case ncclMax: return "max";
    case ncclMin: return "min";
    case ncclAvg: return "avg";
  }
  return "?";
}
const char* kind_name(Kind k) {
  return k == Kind::AllReduce ? "all-reduce" : k == Kind::Reduce ? "reduce" : "broadcast";
}
std::string describe(const Call& c) {
  std::string s = std::string(kind_name(c.kind)) + " of " + std::to_string(c.count) + " " + type_name(c.type);
  if (c.kind != Kind::Broadcast) s += std::string(" (") + op_name(c.op) + ")";
  if (c.kind != Kind::AllReduce) s += " to root " + std::to_string(c.root);
  return s;
}
bool same(const Call& a, const Call& b) {
  return a.kind == b.kind && a.count == b.count && a.type == b.type &&
         (a.kind == Kind::Broadcast || a.op == b.op) && (a.kind == Kind::AllReduce || a.root == b.root);
}

// The element types: loaded into their accumulation type, stored back rounded (bfloat16:
// added in float32, every partial sum rounded to nearest even, as NCCL does).
struct F32 {
  using A = float;
  static A load(const void* p, size_t i) { return static_cast<const float*>(p)[i]; }
  static void store(void* p, size_t i, A v) { static_cast<float*>(p)[i] = v; }
  static A round(A v) { return v; }
};
struct F64 {
  using A = double;
  static A load(const void* p, size_t i) { return static_cast<const double*>(p)[i]; }
  static void store(void* p, size_t i, A v) { static_cast<double*>(p)[i] = v; }
  static A round(A v) { return v; }
};
struct BF16 {
  using A = float;
  static uint16_t bits(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
  static float value(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
  static A load(const void* p, size_t i) { return value(static_cast<const uint16_t*>(p)[i]); }
  static void store(void* p, size_t i, A v) { static_cast<uint16_t*>(p)[i] = bits(v); }
  static A round(A v) { return value(bits(v)); }
};

template <class T>
typename T::A combine(ncclRedOp_t op, typename T::A a, typename T::A b) {
  switch (op) {
    case ncclProd: return T::round(a * b);
    case ncclMax: return a < b ? b : a;
    case ncclMin: return b < a ? b : a;
    default: return T::round(a + b);  // sum; avg sums the premultiplied values
  }
}

// Element i of rank r's send buffer as the reduction reads it: ncclAvg premultiplies each
// rank's value by 1/N rounded to the type.
template <class T>
typename T::A input(const Call& c, int n, size_t i) {
  const typename T::A v = T::load(c.send, i);
  if (c.op != ncclAvg) return v;
  return T::round(v * T::round(typename T::A(1) / typename T::A(n)));
}

// The reduction of element i over the ranks, in ring order from rank `first`.
template <class T>
typename T::A reduce_at(const std::vector<Call>& calls, int first, size_t i) {
  const int n = int(calls.size());
  typename T::A acc = input<T>(calls[first], n, i);
  for (int j = 1; j < n; ++j) acc = combine<T>(calls[0].op, acc, input<T>(calls[(first + j) % n], n, i));
  return acc;
}

template <class T>
void compute(const std::vector<Call>& calls) {
  const int n = int(calls.size());
  const Call& c0 = calls[0];
  const size_t L = c0.count;
  if (c0.kind == Kind::Broadcast) {
    const Call& root = calls[c0.root];
    for (const Call& c : calls)
      if (c.recv != root.send) std::memmove(c.recv, root.send, L * type_size(c0.type));
    return;
  }
  std::vector<typename T::A> out(L);
  if (c0.kind == Kind::Reduce) {
    for (size_t i = 0; i < L; ++i) out[i] = reduce_at<T>(calls, (c0.root + 1) % n, i);
    for (size_t i = 0; i < L; ++i) T::store(calls[c0.root].recv, i, out[i]);
    return;
  }
  // The ring's chunks: chunk k of N, [k·L/N, (k+1)·L/N), reduced starting at rank k + 1.
  for (int k = 0; k < n; ++k)
    for (size_t i = L * k / n; i < L * (k + 1) / n; ++i) out[i] = reduce_at<T>(calls, (k + 1) % n, i);
  for (const Call& c : calls)
    for (size_t i = 0; i < L; ++i) T::store(c.recv, i, out[i]);
}

// Rank `rank`'s collective, when its stream reaches it.
void run_collective(Clique& c, int rank, const Call& call) {
  std::unique_lock<std::mutex> lock(c.m);
  if (c.aborted[rank]) return;
  if (c.running[rank])
    stop("NCCL: rank " + std::to_string(rank) + " started a " + describe(call) +
         " while another collective of its communicator was running (two streams with no order "
         "between them); NCCL would hang or mix them up");
  c.running[rank] = 1;
  const uint64_t k = c.executed[rank]++;
  Round& r = c.rounds[k];
  if (r.calls.empty()) r.calls.resize(c.nranks);
  r.calls[rank] = call;
  if (++r.arrived == c.nranks) {
    for (int j = 1; j < c.nranks; ++j)
      if (!same(r.calls[j], r.calls[0]))
        stop("NCCL: collective #" + std::to_string(k) + " is a " + describe(r.calls[0]) + " on rank 0 and a " +
             describe(r.calls[j]) + " on rank " + std::to_string(j) +
             "; every rank must call the same collectives in the same order");
    switch (call.type) {
      case ncclFloat32: compute<F32>(r.calls); break;
      case ncclFloat64: compute<F64>(r.calls); break;
      default: compute<BF16>(r.calls); break;
    }
    r.done = true;
    c.cv.notify_all();
  } else {
    c.cv.wait(lock, [&] { return r.done || c.aborted[rank]; });
  }
  c.running[rank] = 0;
  if (r.done && ++r.left == c.nranks) c.rounds.erase(k);
}

ncclResult_t wait_ready(ncclComm_t comm) {
  Clique& c = *comm->clique;
  std::unique_lock<std::mutex> lock(c.m);
  c.cv.wait(lock, [&] { return c.state[comm->rank] != ncclInProgress || c.aborted[comm->rank]; });
  return c.aborted[comm->rank] ? ncclRemoteError : c.state[comm->rank];
}

ncclResult_t init(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank, bool blocking) {
  if (!out || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return ncclUnhandledCudaError;
  const std::string key(id.internal, NCCL_UNIQUE_ID_BYTES);
  std::shared_ptr<Clique> clique;
  {
    std::lock_guard<std::mutex> ids(g_ids_mutex);
    auto& slot = g_forming[key];
    if (!slot) slot = std::make_shared<Clique>(nranks);
    clique = slot;
    std::lock_guard<std::mutex> lock(clique->m);
    if (clique->nranks != nranks || clique->taken[rank]) return ncclInvalidUsage;
    clique->taken[rank] = 1;
    clique->devices[rank] = device;
    if (++clique->joined == nranks) {
      g_forming.erase(key);
      // NCCL refuses two ranks of one communicator on one GPU.
      ncclResult_t st = ncclSuccess;
      for (int a = 0; a < nranks; ++a)
        for (int b = 0; b < a; ++b)
          if (clique->devices[a] == clique->devices[b]) {
            std::fprintf(stderr, "NCCL WARN Duplicate GPU detected : rank %d and rank %d both on cuda:%d\n", b, a,
                         clique->devices[a]);
            st = ncclInvalidUsage;
          }
      std::fill(clique->state.begin(), clique->state.end(), st);
      clique->cv.notify_all();
    }
  }
  *out = new ncclComm{clique, rank, device, blocking};
  if (!blocking) {
    std::lock_guard<std::mutex> lock(clique->m);
    return clique->state[rank] == ncclSuccess ? ncclSuccess : ncclInProgress;
  }
  if (t_group_depth > 0) {
    t_group_blocking.push_back(*out);
    return ncclSuccess;
  }
  return wait_ready(*out);
}

// Forms the clique of each colour of a split every rank has called.
void complete_split(Clique& parent, SplitRound& r) {
  std::map<int, std::vector<int>> by_color;
  for (int j = 0; j < parent.nranks; ++j) {
    if (r.calls[j].color == NCCL_SPLIT_NOCOLOR) {
      *r.calls[j].out = nullptr;
      continue;
    }
    by_color[r.calls[j].color].push_back(j);
  }
  for (auto& [color, members] : by_color) {
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return r.calls[a].key < r.calls[b].key; });
    auto child = std::make_shared<Clique>(int(members.size()));
    child->joined = child->nranks;
    for (int i = 0; i < child->nranks; ++i) {
      child->taken[i] = 1;
      child->devices[i] = parent.devices[members[i]];
      child->state[i] = ncclSuccess;
    }
    for (int i = 0; i < child->nranks; ++i) {
      const SplitCall& sc = r.calls[members[i]];
      *sc.out = new ncclComm{child, i, child->devices[i], sc.blocking};
    }
  }
  for (auto& s : parent.state)
    if (s == ncclInProgress) s = ncclSuccess;
  r.done = true;
  parent.cv.notify_all();
}

ncclResult_t collective(const Call& call, ncclComm_t comm, cudaStream_t stream, const char* name) {
  if (!comm) return ncclInvalidArgument;
  const size_t elem = type_size(call.type);
  if (!elem) return ncclInvalidArgument;
  if (stream_device(stream) != comm->device) return ncclInvalidArgument;
  const bool root = call.root == comm->rank;
  const bool reads = call.kind != Kind::Broadcast || root;
  const bool writes = call.kind != Kind::Reduce || root;
  const std::string who = std::string("NCCL ") + name + " on rank " + std::to_string(comm->rank);
  if (call.count > 0) {
    const auto check = [&](const void* p, const char* which) {
      if (!p) return false;
      const int w = memory_device(p, call.count * elem, (who + "'s " + which + " buffer").c_str());
      if (w != comm->device)
        stop(who + " (cuda:" + std::to_string(comm->device) + "): its " + which + " buffer is " +
             (w == -2 ? "host memory" : w == -1 ? "pinned host memory" : "cuda:" + std::to_string(w) + "'s memory"));
      return true;
    };
    if ((reads && !check(call.send, "send")) || (writes && !check(call.recv, "receive")))
      return ncclInvalidArgument;
  }
  {
    Clique& c = *comm->clique;
    std::lock_guard<std::mutex> lock(c.m);
    if (c.aborted[comm->rank] || c.state[comm->rank] != ncclSuccess) return ncclInvalidUsage;
    if (call.kind != Kind::AllReduce && (call.root < 0 || call.root >= c.nranks)) return ncclInvalidArgument;
  }
  // NCCL works on the communicator's device, whatever the caller's current one.
  int saved = 0;
  cudaGetDevice(&saved);
  cudaSetDevice(comm->device);
  const cudaError_t e = enqueue(stream, [clique = comm->clique, rank = comm->rank, call] {
    run_collective(*clique, rank, call);
  });
  cudaSetDevice(saved);
  if (e == cudaSuccess) return ncclSuccess;
  // A launch that fails (a capture refusing it) stays a non-blocking communicator's error, as
  // NCCL keeps it: the communicator is of no further use.
  if (!comm->blocking) {
    std::lock_guard<std::mutex> lock(comm->clique->m);
    comm->clique->state[comm->rank] = ncclUnhandledCudaError;
  }
  return ncclUnhandledCudaError;
}

}  // namespace
}  // namespace unetcu_emu

using namespace unetcu_emu;

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

// With NCCL_COMM_ID every caller gets the same id, as NCCL's own rendezvous gives: the ranks
// that meet are this process's (the emulator has no network).
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return ncclInvalidArgument;
  std::memset(id->internal, 0, sizeof id->internal);
  const char* env = std::getenv("NCCL_COMM_ID");
  const std::string key = env && *env ? std::string("env:") + env : "id:" + std::to_string(g_next_id++);
  std::memcpy(id->internal, key.data(), std::min(key.size(), sizeof id->internal));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  return init(comm, nranks, id, rank, config ? config->blocking != 0 : true);
}
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return init(comm, nranks, id, rank, true);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  if (!comm || !newcomm) return ncclInvalidArgument;
  const bool blocking = config ? config->blocking != 0 : comm->blocking;
  Clique& c = *comm->clique;
  std::unique_lock<std::mutex> lock(c.m);
  if (c.aborted[comm->rank] || c.state[comm->rank] != ncclSuccess) return ncclInvalidUsage;
  const uint64_t k = c.splits[comm->rank]++;
  SplitRound& r = c.split_rounds[k];
  if (r.calls.empty()) r.calls.resize(c.nranks);
  r.calls[comm->rank] = {color, key, newcomm, blocking};
  *newcomm = nullptr;  // filled in once every rank has called
  if (!blocking) c.state[comm->rank] = ncclInProgress;
  if (++r.arrived == c.nranks) {
    complete_split(c, r);
    return ncclSuccess;
  }
  if (!blocking) return ncclInProgress;
  c.cv.wait(lock, [&] { return r.done || c.aborted[comm->rank]; });
  return r.done ? ncclSuccess : ncclRemoteError;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (!comm || !state) return ncclInvalidArgument;
  Clique& c = *comm->clique;
  std::lock_guard<std::mutex> lock(c.m);
  *state = c.state[comm->rank];
  return ncclSuccess;
}

// The emulated collectives hold their clique, not the communicator: what is still queued
// finishes (or, after an abort, returns) without it.
ncclResult_t ncclCommFinalize(ncclComm_t comm) { return comm ? ncclSuccess : ncclInvalidArgument; }
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
// The rank's collectives waiting, and every later one, return at once (NCCL's abort ends the
// communicator's kernels); its peers' do not.
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  {
    Clique& c = *comm->clique;
    std::lock_guard<std::mutex> lock(c.m);
    c.aborted[comm->rank] = 1;
    c.cv.notify_all();
  }
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++t_group_depth;
  return ncclSuccess;
}
// Waits for the blocking communicators the group initialised; non-blocking ones are polled by
// the caller (ncclInProgress while one is still forming).
ncclResult_t ncclGroupEnd() {
  if (t_group_depth == 0) return ncclInvalidUsage;
  if (--t_group_depth > 0) return ncclSuccess;
  std::vector<ncclComm_t> deferred;
  deferred.swap(t_group_blocking);
  ncclResult_t result = ncclSuccess;
  for (ncclComm_t c : deferred) {
    const ncclResult_t r = wait_ready(c);
    if (result == ncclSuccess) result = r;
  }
  return result;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return collective({Kind::AllReduce, sendbuff, recvbuff, count, datatype, op, 0}, comm, stream, "all-reduce");
}
ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return collective({Kind::Reduce, sendbuff, recvbuff, count, datatype, op, root}, comm, stream, "reduce");
}
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  return collective({Kind::Broadcast, sendbuff, recvbuff, count, datatype, ncclSum, root}, comm, stream, "broadcast");
}
