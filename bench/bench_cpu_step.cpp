// Times one CPU training step (forward, loss, backward, Adam) of the full UNet-ResNet34:
// batch 4 at 128×128 and batch 2 at 256×256 by default (--size BxS, repeatable, for others),
// median of several steps after warm-up. --json prints one JSON line per size instead of the
// table (bench/cpu_vs_pytorch.py reads it).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "kernels/cpu/conv_dnnl.h"
#include "kernels/cpu/cpu_select.h"
#include "train/step_timing.h"

using namespace unetcu;

static double time_steps(const UNetConfig& model, int batch, int size, int warmup, int steps,
                         std::vector<double>* all) {
  SyntheticSegmentation data(size, 1);
  std::vector<int64_t> idx;
  for (int i = 0; i < batch; ++i) idx.push_back(i);
  *all = bench::time_single_device_steps(model, data.batch(idx), warmup, steps);
  return bench::median(*all);
}

int main(int argc, char** argv) {
  unetcu::kernels::cpu::select_gemm_kernels(argv);  // first: it may run the program again
  int threads = 2, warmup = 2, steps = 7;
  std::vector<std::string> sizes;
  bool json = false;
  CLI::App app{"bench_cpu_step: median CPU Adam training step of the full UNet-ResNet34"};
  app.add_option("--threads", threads, "CPU threads")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  app.add_option("--size", sizes, "Batch x image size, e.g. 1x512 (repeatable; default 4x128 2x256)");
  app.add_flag("--json", json, "One JSON line per size: batch, size, threads, steps, median");
  std::string precision = "fp32", format = "nchw";
  app.add_option("--precision", precision, "fp32, or bf16 (activations and gradients in bfloat16, "
                 "float32 math and parameters, as unet_train --precision bf16)")->capture_default_str();
  app.add_option("--memory-format", format, "nchw, or nhwc (channels-last)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    UNETCU_CHECK(precision == "fp32" || precision == "bf16", "--precision: fp32 or bf16, got '", precision, "'");
    UNETCU_CHECK(format == "nchw" || format == "nhwc", "--memory-format: nchw or nhwc, got '", format, "'");
    UNetConfig model;
    model.bf16_activations = precision == "bf16";
    model.format = format == "nhwc" ? MemoryFormat::NHWC : MemoryFormat::NCHW;
    set_cpu_threads(threads);
    UNETCU_CHECK(threads >= 1 && warmup >= 0 && steps >= 1,
                 "--threads and --steps must be at least 1, --warmup at least 0");
    std::vector<std::pair<int, int>> runs;
    if (sizes.empty()) runs = {{4, 128}, {2, 256}};
    for (const std::string& text : sizes) {
      int b = 0, sz = 0;
      char end = 0;
      UNETCU_CHECK(std::sscanf(text.c_str(), "%dx%d%c", &b, &sz, &end) == 2 && b >= 1 && b <= 64 &&
                       sz >= 32 && sz <= 2048 && sz % 32 == 0,
                   "--size wants BATCHxSIZE with batch 1..64 and size a multiple of 32 up to "
                   "2048, e.g. 1x512; got '", text, "'");
      runs.push_back({b, sz});
    }
    if (!json) {
      std::printf("%s\nprecision %s, %s\n\n", kernels::cpu::cpu_gemm_line().c_str(), precision.c_str(),
                  format.c_str());
      std::printf("| batch | image | threads | median step (s) | min (s) | max (s) | img/s |\n");
      std::printf("|---|---|---|---|---|---|---|\n");
    }
    for (auto [batch, size] : runs) {
      std::vector<double> all;
      const double med = time_steps(model, batch, size, warmup, steps, &all);
      if (json) {
        std::printf("{\"batch\": %d, \"size\": %d, \"threads\": %d, \"precision\": \"%s\", "
                    "\"memory_format\": \"%s\", \"steps\": [", batch, size, threads, precision.c_str(),
                    format.c_str());
        for (size_t i = 0; i < all.size(); ++i) std::printf("%s%.6f", i ? ", " : "", all[i]);
        std::printf("], \"median\": %.6f, \"kernels\": \"%s\"}\n", med,
                    kernels::cpu::cpu_gemm_line().c_str());
      } else {
        std::printf("| %d | %dx%d | %d | %.3f | %.3f | %.3f | %.1f |\n", batch, size, size,
                    threads, med, *std::min_element(all.begin(), all.end()),
                    *std::max_element(all.begin(), all.end()), batch / med);
      }
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_cpu_step: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
