// Data parallelism on CPU devices against one device: the same global batch, one thread per
// replica (and one for the single device), median step time over timed steps after warm-up.
// Prints the table the article's Table 2 has for GPUs: time per step and per epoch, speedup.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "engine/data.h"
#include "engine/optim.h"
#include "engine/tape.h"
#include "bench/bench_util.h"
#include "models/unet.h"
#include "parallel/data_parallel.h"

using namespace unetcu;
using Clock = std::chrono::steady_clock;

using bench::median;

int main(int argc, char** argv) {
  int global_batch = 8, image = 64, width_divisor = 1, warmup = 1, steps = 3, train_size = 512;
  std::string counts = "1,2,4", allreduce = "ring";
  CLI::App app{"bench_dp: data parallelism on CPU devices (one thread each) vs one device"};
  app.add_option("--global-batch", global_batch, "Images per step, split over the replicas")->capture_default_str();
  app.add_option("--image-size", image, "Image size")->capture_default_str();
  app.add_option("--width-divisor", width_divisor, "Model width divisor")->capture_default_str();
  app.add_option("--replicas", counts, "Replica counts to run, comma separated")->capture_default_str();
  app.add_option("--allreduce", allreduce, "ring or ps")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  app.add_option("--train-size", train_size, "Images per epoch (epoch time = steps x step time)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    UNetConfig mc;
    mc.width_divisor = width_divisor;
    SyntheticSegmentation data(image, 1);
    data.enable_cache(global_batch);
    auto make_adam = [](std::vector<Tensor> p) { return std::unique_ptr<Optimizer>(new Adam(std::move(p))); };
    std::vector<int64_t> all;
    for (int i = 0; i < global_batch; ++i) all.push_back(i);

    // One device, one thread, the whole global batch.
    set_cpu_threads(1);
    const std::vector<double> single_times =
        bench::time_single_device_steps(mc, data.batch(all), warmup, steps);
    const double single = median(single_times);
    const double steps_per_epoch = double(train_size) / global_batch;
    std::printf("global batch %d at %dx%d, width/%d, %s all-reduce; epoch = %d images\n\n",
                global_batch, image, image, width_divisor, allreduce.c_str(), train_size);
    std::printf("| mode | replicas x batch | threads | step (s) | epoch (s) | speedup |\n");
    std::printf("|---|---|---|---|---|---|\n");
    std::printf("| single | 1 x %d | 1 | %.3f | %.1f | 1.00 |\n", global_batch, single,
                single * steps_per_epoch);
    std::fflush(stdout);
    std::stringstream ss(counts);
    std::string item;
    while (std::getline(ss, item, ',')) {
      const int n = std::stoi(item);
      UNETCU_CHECK(n >= 1 && global_batch % n == 0, "--global-batch ", global_batch,
                   " is not divisible by ", n, " replicas");
      DataParallelOptions o;
      for (int r = 0; r < n; ++r) o.devices.push_back(Device::cpu(r));
      o.algo = parse_allreduce(allreduce);
      o.threads_per_replica = 1;
      DataParallel dp(mc, o, make_adam);
      std::vector<Batch> shards;
      const int b = global_batch / n;
      for (int r = 0; r < n; ++r)
        shards.push_back(data.batch(std::vector<int64_t>(all.begin() + r * b, all.begin() + (r + 1) * b)));
      std::vector<double> times;
      for (int s = 0; s < warmup + steps; ++s) {
        const auto t0 = Clock::now();
        dp.step(shards, LossKind::BCEDice);
        if (s >= warmup) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      const double t = median(times);
      std::printf("| dp | %d x %d | %d x 1 | %.3f | %.1f | %.2f |\n", n, b, n, t, t * steps_per_epoch,
                  single / t);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_dp: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
