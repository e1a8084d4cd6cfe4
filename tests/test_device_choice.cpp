// The device guards' rules (runtime/cuda/device_choice.h) over a fake of cudaGetDevice and
// cudaSetDevice that, like CUDA 12, opens a device's context when the device is set. Each case
// runs on a fresh thread: a thread starts on CUDA's default device 0 with no device chosen.
#include <doctest/doctest.h>

#include <exception>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "runtime/cuda/device_choice.h"

using unetcu::cuda::DeviceChoice;
using unetcu::cuda::thread_device;

namespace {

struct FakeCuda {
  static thread_local int current;  // CUDA's current device of the thread: 0 until set
  static std::mutex mu;
  static std::set<int> opened;      // devices whose context a set opened
  static int sets;                  // set calls
  static int refused;               // a device whose set fails after making it current (-1: none)

  static bool get(int* device) {
    *device = current;
    return true;
  }
  static bool set(int device) {
    std::lock_guard<std::mutex> lock(mu);
    ++sets;
    current = device;  // CUDA binds the device's context before it may fail
    opened.insert(device);
    return device != refused;
  }
  static void reset() {
    std::lock_guard<std::mutex> lock(mu);
    opened.clear();
    sets = 0;
    refused = -1;
  }
};
thread_local int FakeCuda::current = 0;
std::mutex FakeCuda::mu;
std::set<int> FakeCuda::opened;
int FakeCuda::sets = 0;
int FakeCuda::refused = -1;

using Guard = DeviceChoice<FakeCuda>;

// Runs `body` on a fresh thread (its own thread-local device state) and waits for it. A
// failing REQUIRE throws on that thread: the exception is carried back and rethrown here, so
// doctest reports it instead of std::terminate ending the test program.
void on_fresh_thread(const std::function<void()>& body) {
  FakeCuda::reset();
  std::exception_ptr failure;
  std::thread t([&] {
    try {
      body();
    } catch (...) {
      failure = std::current_exception();
    }
  });
  t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

TEST_CASE("a device guard on a thread that chose no device opens no context on GPU 0") {
  int after = -2, chosen = -2;
  on_fresh_thread([&] {
    Guard g;
    CHECK(g.enter(3));
    CHECK(FakeCuda::current == 3);
    CHECK(g.leave());
    after = FakeCuda::current;
    chosen = thread_device();
  });
  // Putting back CUDA's default device would have opened GPU 0's context.
  CHECK(FakeCuda::opened == std::set<int>{3});
  CHECK(after == 3);   // the thread stays on its first device
  CHECK(chosen == 3);
}

TEST_CASE("device guards inside one another, and on a thread with a device, put back the device they found") {
  on_fresh_thread([&] {
    Guard outer;
    REQUIRE(outer.enter(3));
    {
      Guard inner;
      REQUIRE(inner.enter(5));
      CHECK(FakeCuda::current == 5);
      CHECK(thread_device() == 5);
      CHECK(inner.leave());
    }
    CHECK(FakeCuda::current == 3);
    CHECK(thread_device() == 3);
    CHECK(outer.leave());
    CHECK(FakeCuda::current == 3);
    // Later guards on this thread come back to its device, 3.
    Guard later;
    REQUIRE(later.enter(1));
    CHECK(later.leave());
    CHECK(FakeCuda::current == 3);
    CHECK(thread_device() == 3);
  });
  CHECK(FakeCuda::opened == std::set<int>{1, 3, 5});
}

TEST_CASE("a device guard undoes a raw cudaSetDevice made inside it") {
  int after = -2;
  on_fresh_thread([&] {
    Guard g;
    REQUIRE(g.enter(2));
    FakeCuda::set(6);  // NCCL's per-rank loops set each rank's device in turn
    CHECK(g.leave());
    after = FakeCuda::current;
  });
  CHECK(after == 2);
}

TEST_CASE("a device guard sets nothing when the device is already current") {
  on_fresh_thread([&] {
    Guard g;
    REQUIRE(g.enter(0));  // CUDA's default: current without a set
    CHECK(g.leave());
    CHECK(thread_device() == 0);
  });
  CHECK(FakeCuda::sets == 0);
  CHECK(FakeCuda::opened.empty());
}

TEST_CASE("a device guard that cannot set its device puts back the thread's device, never GPU 0") {
  on_fresh_thread([&] {
    FakeCuda::refused = 7;
    Guard g;
    CHECK_FALSE(g.enter(7));
    CHECK(thread_device() == -1);
    CHECK(g.leave());  // nothing to put back: the thread had no device

    Guard first;
    REQUIRE(first.enter(2));
    CHECK(first.leave());
    Guard refused;
    CHECK_FALSE(refused.enter(7));
    CHECK(FakeCuda::current == 2);  // the failed set had made 7 current
    CHECK(thread_device() == 2);
    CHECK(refused.leave());
    CHECK(FakeCuda::current == 2);
    CHECK(thread_device() == 2);
  });
  CHECK(FakeCuda::opened == std::set<int>{2, 7});  // 7 by the failed sets; 0 never
}

TEST_CASE("a device guard opened inside a raw cudaSetDevice puts back the raw device") {
  on_fresh_thread([&] {
    Guard outer;
    REQUIRE(outer.enter(2));
    FakeCuda::set(6);  // one rank of NCCL's per-rank loop
    {
      Guard inner;  // e.g. an event freed inside the loop
      REQUIRE(inner.enter(4));
      CHECK(inner.leave());
    }
    CHECK(FakeCuda::current == 6);  // the loop goes on on its rank's device
    CHECK(outer.leave());
    CHECK(FakeCuda::current == 2);
    CHECK(thread_device() == 2);
  });
}
