#include "parallel/gloo_group.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "runtime/common.h"

#ifdef UNETCU_HAVE_GLOO
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "parallel/rendezvous.h"
#endif

namespace unetcu {

#ifndef UNETCU_HAVE_GLOO

bool gloo_built() { return false; }
void init_gloo(int, int world, int, const std::string&, int) {
  throw Error(str_cat("a process group of ", world, " without an MPI launcher needs the Gloo build: install "
                      "libgloo-dev (tools/setup.sh) and rebuild"));
}
std::shared_ptr<ProcessGroup> make_gloo_world_group(double) {
  throw Error("a process group over Gloo needs the Gloo build (libgloo-dev; tools/setup.sh)");
}
void abort_gloo(int) {}

#else

namespace {

using Clock = std::chrono::steady_clock;

// This process's part of the job. Never destroyed: rank 0 serves the rendezvous until the
// process ends (a rank that ends later may still be answered), and the groups' connections
// close with the process.
struct GlooJob {
  int rank = 0, world = 1, local_size = 1;
  std::string addr;
  int port = 0;
  std::shared_ptr<RendezvousServer> server;  // rank 0
  std::shared_ptr<RendezvousStore> store;    // after the first world group
  std::shared_ptr<gloo::transport::Device> device;
  int worlds = 0;  // world groups made, for their key prefixes
  std::mutex mu;
};
GlooJob* g_job = nullptr;

[[noreturn]] void end_this_rank(int code) {
  std::fflush(nullptr);
  tell_rendezvous_abort(g_job->addr, g_job->port, g_job->rank);
  std::_Exit(code);
}

class GlooGroup : public ProcessGroup {
 public:
  // Collective: every rank of the new group calls it with the same prefix. Prefixes nest
  // (a child's is its parent's and a counter of the parent's children), so groups made by
  // different parents never meet, whatever order the parents make them in.
  GlooGroup(std::string prefix, int rank, int size, double timeout)
      : prefix_(std::move(prefix)), rank_(rank), size_(size), timeout_(timeout),
        store_(prefix_, *g_job->store) {
    context_ = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
    context_->setTimeout(std::chrono::milliseconds(int64_t(timeout_ * 1000)));
    guarded("connect", [&] { context_->connectFullMesh(store_, g_job->device); });
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string transport() const override { return "Gloo"; }
  double timeout() const override { return timeout_; }

  // The tag is the slot: Gloo matches a message to a receive by (peer, slot), in the order
  // sent. Gloo's collectives use slots with a high prefix byte, apart from these.
  void send(const void* data, size_t bytes, int peer, int tag) override {
    if (!bytes) return;
    guarded("send", [&] {
      auto buf = context_->createUnboundBuffer(const_cast<void*>(data), bytes);
      buf->send(peer, uint64_t(tag));
      buf->waitSend();
    });
  }
  std::unique_ptr<Request> isend(const void* data, size_t bytes, int peer, int tag) override {
    auto r = std::make_unique<GlooRequest>(this);
    if (bytes)
      guarded("send", [&] {
        r->buf = context_->createUnboundBuffer(const_cast<void*>(data), bytes);
        r->buf->send(peer, uint64_t(tag));
      });
    return r;
  }
  void recv(void* data, size_t bytes, int peer, int tag) override {
    if (!bytes) return;
    guarded("receive", [&] {
      auto buf = context_->createUnboundBuffer(data, bytes);
      buf->recv(peer, uint64_t(tag));
      buf->waitRecv();
    });
  }
  void send_recv(const void* send_data, size_t send_bytes, int to, void* recv_data, size_t recv_bytes,
                 int from, int tag) override {
    guarded("send/receive", [&] {
      std::unique_ptr<gloo::transport::UnboundBuffer> in, out;
      if (recv_bytes) {  // posted first: the left neighbour's message has somewhere to land
        in = context_->createUnboundBuffer(recv_data, recv_bytes);
        in->recv(from, uint64_t(tag));
      }
      if (send_bytes) {
        out = context_->createUnboundBuffer(const_cast<void*>(send_data), send_bytes);
        out->send(to, uint64_t(tag));
      }
      if (out) out->waitSend();
      if (in) in->waitRecv();
    });
  }
  void broadcast(void* data, size_t bytes, int root) override {
    if (!bytes) return;
    guarded("broadcast", [&] {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<uint8_t*>(data), bytes);
      opts.setRoot(root);
      gloo::broadcast(opts);
    });
  }
  void barrier() override {
    guarded("barrier", [&] {
      gloo::BarrierOptions opts(context_);
      gloo::barrier(opts);
    });
  }
  void all_reduce_sum(void* data, int64_t count, DType dtype) override {
    UNETCU_CHECK(dtype == DType::F32 || dtype == DType::F64, "Gloo all-reduce of ", dtype_name(dtype));
    if (!count) return;
    using Reduce = void (*)(void*, const void*, const void*, size_t);
    guarded("gloo::allreduce", [&] {
      gloo::AllreduceOptions opts(context_);
      if (dtype == DType::F32) {
        opts.setOutput(static_cast<float*>(data), size_t(count));
        opts.setReduceFunction(static_cast<Reduce>(&gloo::sum<float>));
      } else {
        opts.setOutput(static_cast<double*>(data), size_t(count));
        opts.setReduceFunction(static_cast<Reduce>(&gloo::sum<double>));
      }
      gloo::allreduce(opts);
    });
  }

  std::shared_ptr<ProcessGroup> split(int colour) override {
    const std::string prefix = child_prefix();
    std::vector<int> colours(size_t(size_), 0);
    // Every rank tells its colour through the rendezvous and reads the others'.
    guarded("split", [&] {
      gloo::rendezvous::PrefixStore store(prefix, *g_job->store);
      store.set("colour/" + std::to_string(rank_),
                std::vector<char>(reinterpret_cast<const char*>(&colour),
                                  reinterpret_cast<const char*>(&colour) + sizeof colour));
      std::vector<std::string> keys;
      for (int r = 0; r < size_; ++r) keys.push_back("colour/" + std::to_string(r));
      store.wait(keys, std::chrono::milliseconds(int64_t(timeout_ * 1000)));
      for (int r = 0; r < size_; ++r) {
        const std::vector<char> v = store.get(keys[size_t(r)]);
        UNETCU_CHECK(v.size() == sizeof(int), "split: a colour of ", v.size(), " bytes");
        std::memcpy(&colours[size_t(r)], v.data(), sizeof(int));
      }
    });
    int rank = 0, size = 0;
    for (int r = 0; r < size_; ++r) {
      if (colours[size_t(r)] != colour) continue;
      if (r < rank_) ++rank;
      ++size;
    }
    return std::make_shared<GlooGroup>(prefix + "/colour" + std::to_string(colour), rank, size, timeout_);
  }
  std::shared_ptr<ProcessGroup> duplicate() override {
    return std::make_shared<GlooGroup>(child_prefix(), rank_, size_, timeout_);
  }
  [[noreturn]] void abort(int code) override { end_this_rank(code); }

 private:
  struct GlooRequest : Request {
    explicit GlooRequest(GlooGroup* g) : group(g) {}
    ~GlooRequest() override { wait(); }
    void wait() override {
      if (!buf) return;
      group->guarded("send (wait)", [&] { buf->waitSend(); });
      buf.reset();
    }
    GlooGroup* group;
    std::unique_ptr<gloo::transport::UnboundBuffer> buf;
  };

  std::string child_prefix() { return prefix_ + "/" + std::to_string(children_++); }

  // Runs one call; when Gloo throws (its timeout, or a peer's connection closed because that
  // rank ended) prints which rank waited in which call and ends this rank.
  template <class F>
  void guarded(const char* op, F&& f) {
    const auto start = Clock::now();
    try {
      f();
    } catch (const std::exception& e) {
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      std::string line =
          waited >= timeout_ * 0.99
              ? str_cat("error: collective timed out: rank ", g_job->rank, " waited ", timeout_, " s in ", op,
                        " for the other ranks (collective timeout); ending this rank\n")
              : str_cat("error: rank ", g_job->rank, " lost the other ranks in ", op, " (", e.what(),
                        "): a rank ended or failed; ending this rank\n");
      std::fwrite(line.data(), 1, line.size(), stderr);  // one write: ranks' lines do not mix
      end_this_rank(1);
    }
  }

  std::string prefix_;
  int rank_, size_;
  double timeout_;
  gloo::rendezvous::PrefixStore store_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  int children_ = 0;
};

}  // namespace

bool gloo_built() { return true; }

void init_gloo(int rank, int world, int local_size, const std::string& addr, int port) {
  UNETCU_CHECK(!g_job, "init_gloo: called twice");
  auto job = std::make_unique<GlooJob>();
  job->rank = rank;
  job->world = world;
  job->local_size = local_size;
  job->addr = addr;
  job->port = port;
  if (rank == 0) job->server = serve_rendezvous(port);
  g_job = job.release();
}

std::shared_ptr<ProcessGroup> make_gloo_world_group(double timeout_s) {
  UNETCU_CHECK(g_job, "a process group over Gloo needs init_process_group first");
  UNETCU_CHECK(timeout_s > 0, "the collective timeout must be positive, got ", timeout_s, " s");
  std::lock_guard<std::mutex> lock(g_job->mu);
  if (!g_job->store) {
    auto store = std::make_shared<RendezvousStore>(g_job->addr, g_job->port, g_job->rank, g_job->world, timeout_s);
    store->arrive();
    // Gloo's own connections listen on the address this host reaches rank 0 by.
    const std::string& local = store->local_address();
    const bool loopback = local.rfind("127.", 0) == 0 || local == "::1";
    UNETCU_CHECK(!loopback || g_job->world <= g_job->local_size, "rank ", g_job->rank, " reaches MASTER_ADDR=",
                 g_job->addr, " at the loopback address ", local, ", which the other hosts of this ",
                 g_job->world, "-process job cannot reach: set MASTER_ADDR to rank 0's address on the "
                 "network (a hostname mapped to 127.x in /etc/hosts does this)");
    gloo::transport::tcp::attr attr;
    attr.hostname = local;
    g_job->device = gloo::transport::tcp::CreateDevice(attr);
    g_job->store = std::move(store);
  }
  return std::make_shared<GlooGroup>("world" + std::to_string(g_job->worlds++), g_job->rank, g_job->world,
                                     timeout_s);
}

void abort_gloo(int code) {
  if (g_job) end_this_rank(code);
}

#endif  // UNETCU_HAVE_GLOO

}  // namespace unetcu
