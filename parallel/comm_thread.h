// A rank's communication thread for CPU communicators (the in-process ring and MPI): runs the
// submitted collectives in order, one at a time, on one thread budget, so an asynchronous
// all-reduce overlaps with the compute thread's backward. Started on first use, joined (after
// the queued jobs) on destruction.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "engine/profiler.h"
#include "parallel/communicator.h"
#include "runtime/device.h"

namespace unetcu {

class CommThread {
 public:
  explicit CommThread(std::string track) : track_(std::move(track)) {}
  ~CommThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  // Queues `job` (named `what` in the profile, moving `bytes`); wait() on the result blocks
  // until it has run and rethrows what it threw.
  std::unique_ptr<Work> submit(std::string what, double bytes, std::function<void()> job) {
    auto done = std::make_shared<std::promise<void>>();
    auto work = std::make_unique<FutureWork>(done->get_future());
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
      queue_.push_back([what = std::move(what), bytes, job = std::move(job), done] {
        try {
          ProfileRange range(what, "comm", 0, bytes);
          job();
          done->set_value();
        } catch (...) {
          done->set_exception(std::current_exception());
        }
      });
    }
    cv_.notify_one();
    return work;
  }

 private:
  struct FutureWork : Work {
    explicit FutureWork(std::future<void> f) : f_(std::move(f)) {}
    void wait() override { f_.get(); }
    std::future<void> f_;
  };

  void loop() {
    set_cpu_threads(1);
    Profiler::set_thread_track(track_);
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }

  std::string track_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::thread thread_;
  bool stop_ = false;
};

}  // namespace unetcu
