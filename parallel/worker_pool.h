// One persistent host thread per device (data-parallel replica or pipeline stage): run(f)
// calls f(rank) on every thread and waits for all, rethrowing the first error. A CPU device's
// thread gets its own OpenMP thread budget.
#pragma once
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/device.h"
#include "engine/profiler.h"

namespace unetcu {

class WorkerPool {
 public:
  // role: names each thread's profiler track, "<device> <role> <rank>".
  WorkerPool(const std::vector<Device>& devices, int threads_per_replica,
             const std::string& role = "worker") {
    for (size_t r = 0; r < devices.size(); ++r)
      threads.emplace_back([this, r, threads_per_replica, role, d = devices[r]] {
        if (d.is_cpu()) set_cpu_threads(threads_per_replica);
        Profiler::set_thread_track(d.str() + " " + role + " " + std::to_string(r));
        loop(int(r));
      });
  }
  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    for (auto& t : threads) t.join();
  }
  void run(const std::function<void(int)>& f) {
    {
      std::lock_guard<std::mutex> lock(mu);
      job = &f;
      pending = int(threads.size());
      error = nullptr;
      ++generation;
    }
    cv.notify_all();
    std::unique_lock<std::mutex> lock(mu);
    done_cv.wait(lock, [&] { return pending == 0; });
    job = nullptr;
    if (error) std::rethrow_exception(error);
  }
 private:
  void loop(int rank) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* f;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || generation != seen; });
        if (stop) return;
        seen = generation;
        f = job;
      }
      std::exception_ptr err;
      try {
        (*f)(rank);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu);
      if (err && !error) error = err;
      if (--pending == 0) done_cv.notify_all();
    }
  }
  std::vector<std::thread> threads;
  std::mutex mu;
  std::condition_variable cv, done_cv;
  const std::function<void(int)>* job = nullptr;
  int pending = 0;
  uint64_t generation = 0;
  bool stop = false;
  std::exception_ptr error;
};

}  // namespace unetcu
