// Only in the Gloo build: the store implements Gloo's Store interface.
#ifdef UNETCU_HAVE_GLOO
#include "parallel/rendezvous.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include "runtime/common.h"

namespace unetcu {

// The wire: each message is a 4-byte little-endian length, then that many bytes: one letter
// naming the request or the answer, then its fields (numbers as 4 or 8 little-endian bytes,
// strings as a 4-byte length and the bytes).
//   requests  H rank world          hello: who this connection is
//             S key value           set
//             G timeout_ms key      get, waiting for the key
//             W timeout_ms n keys   wait for every key
//             A rank                a rank ended the job (no answer)
//   answers   K [value]             done (get: the value)
//             T present             timed out; `present` of the keys exist
//             E message             refused, or the job was ended
namespace {

using Clock = std::chrono::steady_clock;

void put_u32(std::vector<char>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(char((v >> (8 * i)) & 0xff));
}
void put_u64(std::vector<char>& b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(char((v >> (8 * i)) & 0xff));
}
void put_bytes(std::vector<char>& b, const char* p, size_t n) {
  put_u32(b, uint32_t(n));
  const size_t at = b.size();
  b.resize(at + n);
  if (n) std::memcpy(b.data() + at, p, n);
}
void put_str(std::vector<char>& b, const std::string& s) { put_bytes(b, s.data(), s.size()); }

// Reads the fields of one message; `ok` turns false on a short message.
struct Reader {
  const char* p;
  size_t n;
  bool ok = true;
  uint64_t num(int bytes) {
    if (n < size_t(bytes)) return ok = false, 0;
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= uint64_t(uint8_t(p[i])) << (8 * i);
    p += bytes, n -= size_t(bytes);
    return v;
  }
  std::string str() {
    const size_t len = size_t(num(4));
    if (!ok || n < len) return ok = false, std::string();
    std::string s(p, len);
    p += len, n -= len;
    return s;
  }
};

std::vector<char> frame(const std::vector<char>& payload) {
  std::vector<char> f;
  f.reserve(4 + payload.size());
  put_bytes(f, payload.data(), payload.size());  // the length, then the payload
  return f;
}

bool write_all(int fd, const char* p, size_t n) {
  while (n) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w, n -= size_t(w);
  }
  return true;
}

// Reads n bytes before `deadline`; false on a closed connection, an error or the deadline.
bool read_all(int fd, char* p, size_t n, Clock::time_point deadline) {
  while (n) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, int(std::min<long long>(left, 1000)));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return false;
    if (r == 0) continue;
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got, n -= size_t(got);
  }
  return true;
}

std::string host_port(const std::string& addr, int port) {
  return (addr.find(':') != std::string::npos ? "[" + addr + "]" : addr) + ":" + std::to_string(port);
}

std::string seconds(double s) { return str_cat(s); }

addrinfo* resolve(const std::string& addr, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res);
  UNETCU_CHECK(rc == 0 && res, "rendezvous at ", host_port(addr, port), ": cannot resolve MASTER_ADDR '",
               addr, "' (", ::gai_strerror(rc), ")");
  return res;
}

// One connection attempt to any of the resolved addresses, each given `limit_ms` (a host
// that drops the packets would otherwise hold connect() for minutes); -1 and errno when none
// answers.
int connect_once(addrinfo* res, int limit_ms) {
  int err = ECONNREFUSED;
  for (addrinfo* a = res; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    timeval limit{limit_ms / 1000, (limit_ms % 1000) * 1000};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);  // bounds connect() on Linux
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      timeval none{0, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none);
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return fd;
    }
    err = errno;
    ::close(fd);
  }
  errno = err;
  return -1;
}

}  // namespace

// ---- rank 0: the server ---------------------------------------------------------------------

class RendezvousServer {
 public:
  explicit RendezvousServer(int listen_fd) : listen_fd_(listen_fd) {
    // Serves until the process ends: ranks end at different times, and a rank still waiting
    // must be answered, so nothing stops it (the thread and this object are never destroyed).
    std::thread([this] { loop(); }).detach();
  }

 private:
  struct Conn {
    int fd;
    int rank = -1;
    std::string in;
  };
  struct Pending {
    int fd;
    char op;  // 'G' or 'W'
    std::vector<std::string> keys;
    Clock::time_point deadline;
  };

  void answer(int fd, const std::vector<char>& payload) {
    const std::vector<char> f = frame(payload);
    write_all(fd, f.data(), f.size());  // a rank that is gone needs no answer
  }
  void answer_error(int fd, const std::string& message) {
    std::vector<char> p{'E'};
    put_str(p, message);
    answer(fd, p);
  }
  int present(const std::vector<std::string>& keys) const {
    int n = 0;
    for (const std::string& k : keys) n += kv_.count(k) ? 1 : 0;
    return n;
  }
  // Answers `p` if it can be answered now; false when it must go on waiting.
  bool try_answer(const Pending& p, Clock::time_point now) {
    const int have = present(p.keys);
    if (have == int(p.keys.size())) {
      std::vector<char> a{'K'};
      if (p.op == 'G') {
        const std::vector<char>& v = kv_.at(p.keys[0]);
        put_bytes(a, v.data(), v.size());
      }
      answer(p.fd, a);
      return true;
    }
    if (!ended_.empty()) {
      answer_error(p.fd, ended_);
      return true;
    }
    if (now >= p.deadline) {
      std::vector<char> a{'T'};
      put_u32(a, uint32_t(have));
      answer(p.fd, a);
      return true;
    }
    return false;
  }
  void sweep() {
    const auto now = Clock::now();
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [&](const Pending& p) { return try_answer(p, now); }),
                   pending_.end());
  }
  void end_job(const std::string& why) {
    if (ended_.empty()) ended_ = why;
    sweep();
  }

  // One request; false when the connection is to be closed.
  bool handle(Conn& c, const char* p, size_t n) {
    Reader r{p + 1, n - 1};
    switch (n ? p[0] : 0) {
      case 'H': {
        const int rank = int(r.num(4)), world = int(r.num(4));
        if (!r.ok) return false;
        if (world_ == 0) world_ = world;
        if (world != world_) {
          answer_error(c.fd, str_cat("rank ", rank, " was started with WORLD_SIZE=", world,
                                     ", an earlier rank with WORLD_SIZE=", world_));
          return false;
        }
        if (ranks_.count(rank)) {
          answer_error(c.fd, str_cat("two processes were started with RANK=", rank));
          return false;
        }
        ranks_.insert(rank);
        c.rank = rank;
        answer(c.fd, {'K'});
        return true;
      }
      case 'S': {
        const std::string key = r.str(), value = r.str();
        if (!r.ok) return false;
        kv_[key] = std::vector<char>(value.begin(), value.end());
        answer(c.fd, {'K'});
        sweep();
        return true;
      }
      case 'G':
      case 'W': {
        Pending w{c.fd, p[0], {}, {}};
        w.deadline = Clock::now() + std::chrono::milliseconds(r.num(8));
        const uint32_t count = p[0] == 'G' ? 1 : uint32_t(r.num(4));
        for (uint32_t i = 0; i < count && r.ok; ++i) w.keys.push_back(r.str());
        if (!r.ok) return false;
        if (!try_answer(w, Clock::now())) pending_.push_back(std::move(w));
        return true;
      }
      case 'A': {
        const int rank = int(r.num(4));
        end_job(str_cat("rank ", rank, " ended the job (its message is on its own output)"));
        return false;
      }
      default: return false;
    }
  }

  void close_conn(size_t i) {
    Conn& c = conns_[i];
    if (c.rank >= 0) {
      ranks_.erase(c.rank);
      // A rank gone while others wait for what it would have set ends those waits at once.
      end_job(str_cat("rank ", c.rank, " left the job (its connection to the rendezvous closed)"));
    }
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [&](const Pending& p) { return p.fd == c.fd; }),
                   pending_.end());
    ::close(c.fd);
    conns_.erase(conns_.begin() + long(i));
  }

  void loop() {
    for (;;) {
      std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
      for (const Conn& c : conns_) fds.push_back({c.fd, POLLIN, 0});
      int wait_ms = 1000;
      const auto now = Clock::now();
      for (const Pending& p : pending_)
        wait_ms = std::min<int>(wait_ms, int(std::max<long long>(
            0, std::chrono::duration_cast<std::chrono::milliseconds>(p.deadline - now).count() + 1)));
      if (::poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) return;
      if (fds[0].revents & POLLIN) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) conns_.push_back(Conn{fd, -1, {}});
      }
      // Back to front: closing a connection removes it from conns_.
      for (size_t i = fds.size() - 1; i >= 1; --i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        Conn& c = conns_[i - 1];
        char buf[65536];
        const ssize_t got = ::recv(c.fd, buf, sizeof buf, 0);
        if (got < 0 && errno == EINTR) continue;
        bool keep = got > 0;
        if (keep) c.in.append(buf, size_t(got));
        while (keep && c.in.size() >= 4) {
          Reader len{c.in.data(), 4};
          const size_t n = size_t(len.num(4));
          if (c.in.size() < 4 + n) break;
          keep = handle(c, c.in.data() + 4, n);
          c.in.erase(0, 4 + n);
        }
        if (!keep) close_conn(i - 1);
      }
      sweep();
    }
  }

  int listen_fd_;
  std::vector<Conn> conns_;
  std::vector<Pending> pending_;
  std::map<std::string, std::vector<char>> kv_;
  std::set<int> ranks_;
  int world_ = 0;
  std::string ended_;  // set once a rank has ended the job or left it
};

std::shared_ptr<RendezvousServer> serve_rendezvous(int port) {
  // Every interface, IPv6 and IPv4 both where the host has IPv6.
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1, zero = 0;
  int rc = -1;
  if (fd >= 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(uint16_t(port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    if (rc != 0 && errno != EADDRINUSE && errno != EACCES) {
      ::close(fd);
      fd = -1;
    }
  }
  if (fd < 0) {  // no IPv6 here
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    UNETCU_CHECK(fd >= 0, "rendezvous: rank 0 cannot open a socket: ", std::strerror(errno));
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(uint16_t(port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  if (rc == 0) rc = ::listen(fd, 1024);
  if (rc != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(str_cat("rendezvous: rank 0 cannot serve on port ", port, ": ", std::strerror(err),
                        err == EADDRINUSE ? " (another program, or an earlier job, holds it: pick a free MASTER_PORT)" : ""));
  }
  return std::make_shared<RendezvousServer>(fd);
}

// ---- every rank: the client -----------------------------------------------------------------

RendezvousStore::RendezvousStore(const std::string& addr, int port, int rank, int world, double timeout_s)
    : addr_(addr), port_(port), rank_(rank), world_(world), timeout_s_(timeout_s) {
  addrinfo* res = resolve(addr, port);
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  int err = 0;
  while ((fd_ = connect_once(res, 2000)) < 0) {
    err = errno;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // rank 0 may not listen yet
  }
  if (fd_ >= 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    char host[NI_MAXHOST] = {0};
    if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&local), len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) == 0)
      local_address_ = host;
  }
  ::freeaddrinfo(res);
  UNETCU_CHECK(fd_ >= 0, "rendezvous at ", where(), ": rank ", rank, " could not connect within ",
               seconds(timeout_s), " s (", std::strerror(err), "): is rank 0 running, with the same "
               "MASTER_ADDR and MASTER_PORT?");
  std::vector<char> hello{'H'};
  put_u32(hello, uint32_t(rank));
  put_u32(hello, uint32_t(world));
  call(hello, 0);
}

RendezvousStore::~RendezvousStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::string RendezvousStore::where() const { return host_port(addr_, port_); }

std::vector<char> RendezvousStore::call(const std::vector<char>& request, double wait_s) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<char> f = frame(request);
  UNETCU_CHECK(write_all(fd_, f.data(), f.size()), "rendezvous at ", where(), ": rank ", rank_,
               " lost its connection to rank 0 (", std::strerror(errno), "): rank 0 has ended");
  // The server answers by the request's own deadline; more than a minute past it, rank 0 is
  // stopped or gone.
  const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t((wait_s + 60) * 1000));
  char len_bytes[4];
  bool ok = read_all(fd_, len_bytes, 4, deadline);
  std::vector<char> answer;
  if (ok) {
    Reader len{len_bytes, 4};
    answer.resize(size_t(len.num(4)));
    ok = !answer.empty() && read_all(fd_, answer.data(), answer.size(), deadline);
  }
  UNETCU_CHECK(ok, "rendezvous at ", where(), ": rank ", rank_, " got no answer from rank 0 (it has ended, "
               "or is stopped)");
  if (answer[0] == 'E') {
    Reader r{answer.data() + 1, answer.size() - 1};
    throw Error(str_cat("rendezvous at ", where(), ": ", r.str()));
  }
  return answer;
}

void RendezvousStore::set(const std::string& key, const std::vector<char>& data) {
  std::vector<char> req{'S'};
  put_str(req, key);
  put_bytes(req, data.data(), data.size());
  call(req, 0);
}

std::vector<char> RendezvousStore::get(const std::string& key) {
  std::vector<char> req{'G'};
  put_u64(req, uint64_t(timeout_s_ * 1000));
  put_str(req, key);
  const std::vector<char> a = call(req, timeout_s_);
  UNETCU_CHECK(a[0] == 'K', "rendezvous at ", where(), ": rank ", rank_, " waited ", seconds(timeout_s_),
               " s for key '", key, "' (a rank stopped, stuck or gone)");
  Reader r{a.data() + 1, a.size() - 1};
  const std::string v = r.str();
  return std::vector<char>(v.begin(), v.end());
}

void RendezvousStore::wait(const std::vector<std::string>& keys) {
  wait(keys, std::chrono::milliseconds(int64_t(timeout_s_ * 1000)));
}

void RendezvousStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  std::vector<char> req{'W'};
  put_u64(req, uint64_t(std::max<int64_t>(0, timeout.count())));
  put_u32(req, uint32_t(keys.size()));
  for (const std::string& k : keys) put_str(req, k);
  const std::vector<char> a = call(req, double(timeout.count()) / 1000);
  if (a[0] == 'K') return;
  Reader r{a.data() + 1, a.size() - 1};
  const size_t have = size_t(r.num(4));
  throw Error(str_cat("rendezvous at ", where(), ": rank ", rank_, " waited ", seconds(timeout.count() / 1000.0),
                      " s for ", keys.size() - have, " of ", keys.size(),
                      " keys the other ranks set (a rank stopped, stuck or gone)"));
}

void RendezvousStore::arrive() {
  set("arrived/" + std::to_string(rank_), {'1'});
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back("arrived/" + std::to_string(r));
  std::vector<char> req{'W'};
  put_u64(req, uint64_t(timeout_s_ * 1000));
  put_u32(req, uint32_t(keys.size()));
  for (const std::string& k : keys) put_str(req, k);
  const std::vector<char> a = call(req, timeout_s_);
  if (a[0] == 'K') return;
  Reader r{a.data() + 1, a.size() - 1};
  throw Error(str_cat("rendezvous at ", where(), ": only ", r.num(4), " of ", world_, " ranks arrived within ",
                      seconds(timeout_s_), " s (start every rank with the same MASTER_ADDR, MASTER_PORT "
                      "and WORLD_SIZE)"));
}

void tell_rendezvous_abort(const std::string& addr, int port, int rank) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) return;
  const int fd = connect_once(res, 1000);  // refused at once when rank 0 is gone
  ::freeaddrinfo(res);
  if (fd < 0) return;
  std::vector<char> req{'A'};
  put_u32(req, uint32_t(rank));
  const std::vector<char> f = frame(req);
  write_all(fd, f.data(), f.size());
  // Wait (up to a second) for rank 0 to read it and close, so the message is not lost when
  // this process ends.
  char c;
  read_all(fd, &c, 1, Clock::now() + std::chrono::seconds(1));
  ::close(fd);
}

}  // namespace unetcu

#endif  // UNETCU_HAVE_GLOO
