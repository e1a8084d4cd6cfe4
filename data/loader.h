// The batch loader: worker threads make an epoch's batches (decode, augment, normalise, in
// pinned memory when they go to a GPU) ahead of the training step, into a bounded queue, in
// order. It reports how fast it produced images and how long the step waited for it.
#pragma once
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "data/synthetic.h"

namespace unetcu {

class BatchLoader {
 public:
  using MakeBatch = std::function<Batch(int64_t step)>;
  // Batches 0..steps-1 made by `make` on `workers` threads (one OpenMP thread each), at most
  // `depth` ready batches ahead of the consumer.
  BatchLoader(int64_t steps, MakeBatch make, int workers, int depth);
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  Batch next();  // batch of the next step, in order; rethrows a worker's error

  double wait_seconds() const { return wait_s_; }  // consumer time spent waiting
  double busy_seconds() const;                       // worker time spent making batches

 private:
  void work();
  int64_t steps_;
  MakeBatch make_;
  int depth_;
  std::vector<std::thread> threads_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, Batch> ready_;
  int64_t next_to_make_ = 0, next_to_take_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  double wait_s_ = 0, busy_s_ = 0;
};

}  // namespace unetcu
