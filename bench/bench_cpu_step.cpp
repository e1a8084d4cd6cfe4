// Times one CPU training step (forward, loss, backward, Adam) of the full UNet-ResNet34:
// batch 4 at 128×128 and batch 2 at 256×256 by default, median of several steps after warm-up.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "kernels/cpu/cpu_select.h"
#include "bench/bench_util.h"

using namespace unetcu;

static double time_steps(int batch, int size, int warmup, int steps, std::vector<double>* all) {
  SyntheticSegmentation data(size, 1);
  std::vector<int64_t> idx;
  for (int i = 0; i < batch; ++i) idx.push_back(i);
  *all = bench::time_single_device_steps(UNetConfig{}, data.batch(idx), warmup, steps);
  return bench::median(*all);
}

int main(int argc, char** argv) {
  unetcu::kernels::cpu::select_gemm_kernels(argv);  // first: it may run the program again
  int threads = 2, warmup = 2, steps = 7;
  CLI::App app{"bench_cpu_step: median CPU Adam training step of the full UNet-ResNet34"};
  app.add_option("--threads", threads, "CPU threads")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    set_cpu_threads(threads);
    std::printf("%s\n\n", kernels::cpu::cpu_gemm_line().c_str());
    std::printf("| batch | image | threads | median step (s) | min (s) | max (s) | img/s |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    for (auto [batch, size] : {std::pair{4, 128}, std::pair{2, 256}}) {
      std::vector<double> all;
      const double med = time_steps(batch, size, warmup, steps, &all);
      std::printf("| %d | %dx%d | %d | %.3f | %.3f | %.3f | %.1f |\n", batch, size, size, threads,
                  med, *std::min_element(all.begin(), all.end()),
                  *std::max_element(all.begin(), all.end()), batch / med);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_cpu_step: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
