// Data parallelism on CPU devices against one device: the same global batch, one thread per
// replica (and one for the single device), median step time over timed steps after warm-up.
// Prints the table the article's Table 2 has for GPUs: time per step and per epoch, speedup.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "kernels/cpu/cpu_select.h"
#include "apps/cli.h"
#include "bench/bench_util.h"

using namespace unetcu;
using Clock = std::chrono::steady_clock;

using bench::median;

int main(int argc, char** argv) {
  unetcu::kernels::cpu::select_gemm_kernels(argv);  // first: it may run the program again
  int global_batch = 8, image = 64, width_divisor = 1, warmup = 1, steps = 3, train_size = 512;
  std::string counts = "1,2,4";
  AllReduceAlgo allreduce = AllReduceAlgo::Ring;
  CLI::App app{"bench_dp: data parallelism on CPU devices (one thread each) vs one device"};
  app.add_option("--global-batch", global_batch, "Images per step, split over the replicas")->capture_default_str();
  app.add_option("--image-size", image, "Image size")->capture_default_str();
  app.add_option("--width-divisor", width_divisor, "Model width divisor")->capture_default_str();
  app.add_option("--replicas", counts, "Replica counts to run, comma separated")->capture_default_str();
  cli::add_enum(app, "--allreduce", allreduce, kAllReduceNames, "All-reduce");
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
    std::vector<int64_t> all;
    for (int i = 0; i < global_batch; ++i) all.push_back(i);

    // One device, one thread, the whole global batch.
    set_cpu_threads(1);
    const std::vector<double> single_times =
        bench::time_single_device_steps(mc, data.batch(all), warmup, steps);
    const double single = median(single_times);
    const double steps_per_epoch = double(train_size) / global_batch;
    std::printf("global batch %d at %dx%d, width/%d, %s all-reduce; epoch = %d images\n\n",
                global_batch, image, image, width_divisor, name_of(kAllReduceNames, allreduce), train_size);
    std::printf("| mode | replicas x batch | threads | step (s) | epoch (s) | speedup |\n");
    std::printf("|---|---|---|---|---|---|\n");
    std::printf("| single | 1 x %d | 1 | %.3f | %.1f | 1.00 |\n", global_batch, single,
                single * steps_per_epoch);
    std::fflush(stdout);
    for (const int n : cli::parse_int_list(counts)) {
      UNETCU_CHECK(n >= 1 && global_batch % n == 0, "--global-batch ", global_batch,
                   " is not divisible by ", n, " replicas");
      DataParallelOptions o;
      for (int r = 0; r < n; ++r) o.devices.push_back(Device::cpu(r));
      o.algo = allreduce;
      o.threads_per_replica = 1;
      DataParallelStrategy dp(mc, o, optimizer_factory({}), LossKind::BCEDice);
      const int b = global_batch / n;  // replica r takes rows [r*b, (r+1)*b) of the batch
      const double t = median(bench::time_steps(dp, data.batch(all), warmup, steps));
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
