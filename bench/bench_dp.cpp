// Data parallelism on CPU devices against one device: the same global batch, one thread per
// replica (and one for the single device), median step time over timed steps after warm-up.
// Prints the table the article's Table 2 has for GPUs: time per step and per epoch, speedup.
// With --allreduce-precision bf16, also the error the bfloat16 all-reduce puts on the mean
// gradient: relative L2 distance to the full-precision all-reduce's, after one step from the
// same start on the same batch.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "kernels/cpu/cpu_select.h"
#include "cli/cli.h"
#include "train/step_timing.h"

using namespace unetcu;
using Clock = std::chrono::steady_clock;

using bench::median;

int main(int argc, char** argv) {
  unetcu::kernels::cpu::select_gemm_kernels(argv);  // first: it may run the program again
  int global_batch = 8, image = 64, width_divisor = 1, warmup = 1, steps = 3, train_size = 512;
  std::string counts = "1,2,4";
  AllReduceAlgo allreduce = AllReduceAlgo::Ring;
  bool bf16_allreduce = false;
  CLI::App app{"bench_dp: data parallelism on CPU devices (one thread each) vs one device"};
  app.add_option("--global-batch", global_batch, "Images per step, split over the replicas")->capture_default_str();
  app.add_option("--image-size", image, "Image size")->capture_default_str();
  app.add_option("--width-divisor", width_divisor, "Model width divisor")->capture_default_str();
  app.add_option("--replicas", counts, "Replica counts to run, comma separated")->capture_default_str();
  cli::add_enum(app, "--allreduce", allreduce, kAllReduceNames, "All-reduce");
  cli::add_enum(app, "--allreduce-precision", bf16_allreduce, kAllReducePrecisionNames,
                "Gradients on the wire: their own dtype or bfloat16");
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
    std::printf("global batch %d at %dx%d, width/%d, %s all-reduce in %s; epoch = %d images\n\n",
                global_batch, image, image, width_divisor, name_of(kAllReduceNames, allreduce),
                bf16_allreduce ? "bfloat16" : "the gradients' dtype", train_size);
    const char* err_head = bf16_allreduce ? " mean-gradient error (rel. L2) |" : "";
    std::printf("| mode | replicas x batch | threads | step (s) | epoch (s) | speedup |%s\n", err_head);
    std::printf("|---|---|---|---|---|---|%s\n", bf16_allreduce ? "---|" : "");
    std::printf("| single | 1 x %d | 1 | %.3f | %.1f | 1.00 |%s\n", global_batch, single,
                single * steps_per_epoch, bf16_allreduce ? " |" : "");
    std::fflush(stdout);
    for (const int n : cli::parse_int_list(counts)) {
      UNETCU_CHECK(n >= 1 && global_batch % n == 0, "--global-batch ", global_batch,
                   " is not divisible by ", n, " replicas");
      DataParallelOptions o;
      for (int r = 0; r < n; ++r) o.devices.push_back(Device::cpu(r));
      o.allreduce = allreduce;
      o.threads = 1;
      std::string err_cell;
      if (bf16_allreduce) {
        // One step each from the same start: the mean gradients of full and bf16 all-reduce.
        auto mean_grads = [&](bool bf16) {
          DataParallelOptions ob = o;
          ob.bf16_allreduce = bf16;
          DataParallelStrategy dp(mc, ob, optimizer_factory({}), LossKind::BCEDice);
          dp.step(dp.place(data.batch(all)));
          std::vector<double> g;
          for (const Tensor& p : dp.model().parameters())
            for (double v : p.grad().to_vector()) g.push_back(v);
          return g;
        };
        const std::vector<double> full = mean_grads(false), low = mean_grads(true);
        double e2 = 0, n2 = 0;
        for (size_t i = 0; i < full.size(); ++i) e2 += (low[i] - full[i]) * (low[i] - full[i]), n2 += full[i] * full[i];
        char cell[64];
        std::snprintf(cell, sizeof cell, " %.2e |", std::sqrt(e2 / n2));
        err_cell = cell;
      }
      o.bf16_allreduce = bf16_allreduce;
      DataParallelStrategy dp(mc, o, optimizer_factory({}), LossKind::BCEDice);
      const int b = global_batch / n;  // replica r takes rows [r*b, (r+1)*b) of the batch
      const double t = median(bench::time_steps(dp, data.batch(all), warmup, steps));
      std::printf("| dp | %d x %d | %d x 1 | %.3f | %.1f | %.2f |%s\n", n, b, n, t, t * steps_per_epoch,
                  single / t, err_cell.c_str());
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_dp: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
