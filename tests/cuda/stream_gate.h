// Holds a stream at a host function until released (or the scope ends), so the work queued
// behind it, and the events recorded after it, stay pending for as long as a case wants: how
// the CUDA suite shows that the host did not wait for that work (test_cuda_ops.cpp,
// test_cuda_dp.cpp).
#pragma once
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "runtime/cuda/runtime.cuh"

namespace unetcu::testing {

struct StreamGate {
  std::atomic<bool> open{false};
  void hold(const cuda::Stream& s) {
    cuda::DeviceGuard on(s.device());  // a stream takes work on its own device only
    CUDA_CHECK(cudaLaunchHostFunc(
        s.get(),
        [](void* flag) {
          while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
        },
        &open));
  }
};

// Opens the gate when the scope ends, before the streams held behind it are destroyed (their
// destructors wait for the host function): declare it after the gate and after the streams.
struct OpenAtExit {
  StreamGate& gate;
  ~OpenAtExit() { gate.open = true; }
};

// Opens the gates after `seconds` unless its scope ends first, and at the end of its scope in
// any case (then joins): a case whose step waited for the held streams sees the gates open
// when the step returns, and a case that throws leaves no thread behind.
class Safeguard {
 public:
  Safeguard(std::vector<StreamGate*> gates, double seconds)
      : gates_(std::move(gates)), thread_([this, seconds] {
          const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
          while (!done_ && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          for (StreamGate* g : gates_) g->open = true;
        }) {}
  ~Safeguard() {
    done_ = true;
    thread_.join();
  }
  Safeguard(const Safeguard&) = delete;
  Safeguard& operator=(const Safeguard&) = delete;

 private:
  std::vector<StreamGate*> gates_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

}  // namespace unetcu::testing
