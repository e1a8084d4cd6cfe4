// Where the ranks of a Gloo job find each other: a small key-value store over TCP at
// MASTER_ADDR:MASTER_PORT, the address torchrun's variables (and a SLURM job's, given
// MASTER_ADDR/MASTER_PORT) name. Rank 0 serves it from a thread; every rank, rank 0 included,
// is a client. Gloo's contexts exchange their addresses through it (gloo::rendezvous::Store),
// and a rank's failure is told to the ranks waiting in it.
//
// Why a store of our own: Gloo ships a file store (a directory every rank shares), an
// in-process hash store and a Redis store (a server to run beside the job); no Debian package
// gives a rendezvous served by rank 0 at MASTER_ADDR:MASTER_PORT (PyTorch's TCPStore lives
// inside libtorch). Set, get and wait over one socket per rank are all the job needs.
//
// Only in the Gloo build (UNETCU_HAVE_GLOO).
#pragma once
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

namespace unetcu {

// The port is MASTER_PORT, or the one after it when torchrun's agent serves its own store at
// MASTER_PORT (parallel/dist.cpp).
//
// Rank 0's side: listens on `port` on every interface and answers until the process ends.
// Error when the port cannot be bound (in use, not allowed).
class RendezvousServer;
std::shared_ptr<RendezvousServer> serve_rendezvous(int port);

class RendezvousStore : public gloo::rendezvous::Store {
 public:
  // Connects to addr:port, retrying until `timeout_s` has passed (rank 0 may start later than
  // the others), and says who it is. Error when the address does not resolve, when nothing
  // answers within the timeout, or when the server has already met a rank with this number
  // or another world size.
  RendezvousStore(const std::string& addr, int port, int rank, int world, double timeout_s);
  ~RendezvousStore() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  // Waits (the timeout given at construction) until the key exists.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // Returns once every rank of the world has arrived; Error "only K of N ranks arrived within
  // T s" after the timeout.
  void arrive();
  // The address of this host on the route to rank 0: what the other ranks can reach it by.
  std::string local_address() const { return local_address_; }
  std::string where() const;  // "ADDR:PORT"

 private:
  std::vector<char> call(const std::vector<char>& request, double wait_s);

  std::string addr_;
  int port_, rank_, world_;
  double timeout_s_;
  int fd_ = -1;
  std::string local_address_;
  std::mutex mu_;  // one request at a time on the socket
};

// Tells the ranks waiting at addr:port (and those that arrive later) that `rank` ended the
// job; best effort, bounded by about a second, prints nothing.
void tell_rendezvous_abort(const std::string& addr, int port, int rank);

}  // namespace unetcu
