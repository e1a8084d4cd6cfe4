// unet_perfmodel's report (apps/unet_perfmodel parses its flags): the performance model of
// data and model parallelism for the UNet (the article's UNet-ResNet34, or another encoder;
// planning/perf_model.h) on N = 2, 4, 8 devices,
// the article's setting held against the article's measured speedups, and DP over many
// machines next to PyTorch DDP's published scaling; then the memory model
// (planning/memory_model.h): each device's predicted peak for the same settings, from a memory
// profile measured on the CPU at the image size. Printed on stdout.
#pragma once
#include <string>
#include <vector>

#include "models/unet.h"

namespace unetcu {

struct PerfModelConfig {
  std::string link = "pcie3";      // between the devices: a preset name or "<GB/s>,<latency us>"
  std::string dp_link = "ib-ndr";  // of the DP-ranks table (many machines)
  std::string gpu = "rtx2070s";    // rtx2070s or h200
  double gpu_tflops = 0;           // peak float32 TFLOP/s of one device (0: the gpu's)
  int gpu_sms = -1;                // SMs for the under-fill curve (-1: the gpu's; 0: no under-fill)
  double efficiency = 0.5;         // the fraction of that peak the layers reach
  int image_size = 512, dp_batch = 14, mp_batch = 30, mp_split = 6;
  EncoderKind encoder = EncoderKind::ResNet34;  // the article's
  double loader_rate = 0;          // images/s the host can deliver (0: unlimited)
  std::vector<int> dp_ranks = {8, 64};
  bool no_memory = false;          // skip the memory table (it measures steps on the CPU)
};

// An unetcu::Error naming the setting (runtime/common.h setting()) for bad input.
void print_perf_model(PerfModelConfig config);

}  // namespace unetcu
