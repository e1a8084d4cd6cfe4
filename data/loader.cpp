#include "data/loader.h"

#include <chrono>

#include "runtime/device.h"

namespace unetcu {

using Clock = std::chrono::steady_clock;

BatchLoader::BatchLoader(int64_t steps, MakeBatch make, int workers, int depth)
    : steps_(steps), make_(std::move(make)), depth_(std::max(1, depth)) {
  try {
    for (int i = 0; i < std::max(1, workers); ++i) threads_.emplace_back([this] { work(); });
  } catch (...) {  // could not start a thread: stop the ones running before giving up
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    throw Error("cannot start the loader's threads");
  }
}

BatchLoader::~BatchLoader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void BatchLoader::work() {
  set_cpu_threads(1);
  for (;;) {
    int64_t step;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Claim the next batch once the queue has room for it (batches ahead of the consumer).
      cv_.wait(lock, [&] { return stop_ || (next_to_make_ < steps_ && next_to_make_ < next_to_take_ + depth_); });
      if (stop_ || next_to_make_ >= steps_) return;
      step = next_to_make_++;
    }
    const auto t0 = Clock::now();
    Batch b;
    std::exception_ptr err;
    try {
      b = make_(step);
    } catch (...) {
      err = std::current_exception();
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_s_ += dt;
      if (err && !error_) error_ = err;
      ready_[step] = std::move(b);
    }
    cv_.notify_all();
  }
}

Batch BatchLoader::next() {
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  UNETCU_CHECK(next_to_take_ < steps_, "the loader has no more batches this epoch");
  cv_.wait(lock, [&] { return error_ || ready_.count(next_to_take_); });
  wait_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
  if (error_) std::rethrow_exception(error_);
  Batch b = std::move(ready_[next_to_take_]);
  ready_.erase(next_to_take_++);
  lock.unlock();
  cv_.notify_all();
  return b;
}

double BatchLoader::busy_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_s_;
}

}  // namespace unetcu
