// The article's experiment end to end (apps/unet_bench parses its flags): single device, data
// parallelism over all devices (ring and PS all-reduce), model parallelism over two stages for
// every cut x split_size; prints Table 1 (MP cut x split_size, best in bold) and Table 2 (mean
// epoch time, std, speedup over one device) as Markdown on stdout, and writes them as Markdown,
// CSV and JSON beside the machine, devices, batch sizes and image size. Under a launcher
// (mpirun -np W, srun, torchrun's variables) it measures the same across W processes, one CPU
// device each (only process 0 prints and writes).
#pragma once
#include <string>

#include "models/unet.h"

namespace unetcu {

struct BenchConfig {
  std::string devices = "cpu:0,cpu:1";  // MP uses the first two; one device: two stages on it
  int image_size = 64;
  int batch_size = 4;                   // of the single device and of each DP replica
  int mp_batch = 0;                     // 0: batch x devices
  std::string split_sizes;              // MP split sizes, comma separated (default 1, 2, 4, ...)
  int epoch_images = 0;                 // 0: 4 x the DP global batch
  int epochs = 2, warmup = 1, mp_steps = 2;
  int width_divisor = 1;
  EncoderKind encoder = EncoderKind::ResNet34;
  std::string precision = "fp32", memory_format = "nchw";
  int threads = 0;                      // per CPU device (0: cores / devices)
  std::string out = "bench_out";        // table1/table2 .md/.csv and bench.json
  bool plot = false;
  std::string plot_script;              // tools/plot.py, for plot
};

// Runs the benchmark; an unetcu::Error naming the setting (runtime/common.h setting()) for bad
// input. Returns the exit status.
int run_article_bench(BenchConfig config);

}  // namespace unetcu
