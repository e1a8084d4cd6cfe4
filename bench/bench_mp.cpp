// Model parallelism on CPU devices against one device: the article's cut (after layer3) on two
// CPU devices with one thread each, for several split sizes and both schedules, against one
// device with one thread on the same batch; median step time over timed steps after warm-up.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "kernels/cpu/cpu_select.h"
#include "cli/cli.h"
#include "train/step_timing.h"

using namespace unetcu;
using bench::median;

int main(int argc, char** argv) {
  unetcu::kernels::cpu::select_gemm_kernels(argv);  // first: it may run the program again
  int batch = 8, image = 128, width_divisor = 1, warmup = 1, steps = 3;
  std::string splits = "1,2,4,8", cut = "layer3", devices = "cpu:0,cpu:1";
  CLI::App app{"bench_mp: pipeline model parallelism on CPU devices (one thread each) vs one device"};
  app.add_option("--batch-size", batch, "Images per step")->capture_default_str();
  app.add_option("--image-size", image, "Image size")->capture_default_str();
  app.add_option("--width-divisor", width_divisor, "Model width divisor")->capture_default_str();
  app.add_option("--split", cut, "Cut(s), as unet_train --split")->capture_default_str();
  app.add_option("--devices", devices, "Stage devices")->capture_default_str();
  app.add_option("--split-sizes", splits, "Micro-batch sizes to run")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    UNetConfig mc;
    mc.width_divisor = width_divisor;
    SyntheticSegmentation data(image, 1);
    std::vector<int64_t> idx;
    for (int i = 0; i < batch; ++i) idx.push_back(i);
    const Batch b = data.batch(idx);
    std::vector<int> cuts, split_sizes;
    std::vector<Device> stage_devices;
    try {
      cuts = cli::parse_cuts(cut);
      split_sizes = cli::parse_int_list(splits);
      stage_devices = cli::parse_device_list(devices);
    } catch (const Error& e) {
      throw Error(std::string("bad --split, --split-sizes or --devices: ") + e.what());
    }

    set_cpu_threads(1);
    const double single = median(bench::time_single_device_steps(mc, b, warmup, steps));
    std::printf("batch %d at %dx%d, width/%d, cut after %s on %s (one thread each)\n\n", batch,
                image, image, width_divisor, cut.c_str(), devices.c_str());
    std::printf("| mode | schedule | split_size | micro-batches | step (s) | speedup | live micro-batches per stage |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    std::printf("| single | - | %d | 1 | %.3f | 1.00 | - |\n", batch, single);
    std::fflush(stdout);
    for (Schedule sched : {Schedule::GPipe, Schedule::OneFOneB}) {
      for (int split : split_sizes) {
        PipelineOptions o;
        o.devices = stage_devices;
        o.cuts = cuts;
        o.split_size = split;
        o.schedule = sched;
        o.threads = 1;
        PipelineStrategy pipe(mc, o, optimizer_factory({}), LossKind::BCEDice);
        const double t = median(bench::time_steps(pipe, b, warmup, steps));
        std::string live;
        for (int v : pipe.live_micro_batches()) live += (live.empty() ? "" : " ") + std::to_string(v);
        std::printf("| mp | %s | %d | %d | %.3f | %.2f | %s |\n", name_of(kScheduleNames, sched),
                    split, (batch + split - 1) / split, t, single / t, live.c_str());
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_mp: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
