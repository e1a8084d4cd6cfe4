// unet_bench: the article's experiment (train/article_bench.h runs it) on the given devices, or
// across the processes of a launcher.
#include <CLI/CLI.hpp>

#include <iostream>

#include "cli/cli.h"
#include "kernels/cpu/cpu_select.h"
#include "parallel/dist.h"
#include "train/article_bench.h"

using namespace unetcu;

namespace {

// Every flag, filling its field of `c`.
void add_bench_flags(CLI::App& app, BenchConfig& c) {
  app.add_option("--devices", c.devices,
                 "Devices, e.g. cpu:0,cpu:1 or cuda:0,cuda:1 (MP uses the first two; one device: two stages on it)")
      ->capture_default_str();
  app.add_option("--image-size", c.image_size, "Image size")->capture_default_str();
  cli::add_enum(app, "--encoder", c.encoder, kEncoderNames, "The UNet's encoder (SMP's name)");
  app.add_option("--batch-size", c.batch_size, "Batch of the single device and of each DP replica (the article: 14)")
      ->capture_default_str();
  app.add_option("--mp-batch", c.mp_batch, "MP batch (0: batch x devices; the article: 30)")->capture_default_str();
  app.add_option("--split-sizes", c.split_sizes, "MP split sizes (default 1, 2, 4, ... up to the MP batch)");
  app.add_option("--epoch-images", c.epoch_images, "Images per epoch (0: 4 x the DP global batch)")
      ->capture_default_str();
  app.add_option("--epochs", c.epochs, "Timed epochs per method")->capture_default_str();
  app.add_option("--warmup", c.warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--mp-steps", c.mp_steps, "Timed steps per Table 1 cell")->capture_default_str();
  app.add_option("--width-divisor", c.width_divisor, "Model width divisor (1: the real model)")->capture_default_str();
  app.add_option("--precision", c.precision,
                 "fp32 (GPUs: TF32 convolutions allowed), or bf16 (mixed precision, as unet_train --precision bf16)")
      ->capture_default_str();
  app.add_option("--memory-format", c.memory_format, "nchw, or nhwc (channels-last)")->capture_default_str();
  app.add_option("--threads", c.threads, "CPU threads per device (0: cores / devices)")->capture_default_str();
  app.add_option("--out", c.out, "Folder for table1/table2 .md/.csv and bench.json")->capture_default_str();
  app.add_flag("--plot", c.plot,
               "Also draw table1.png (step time per cut x split size, the best marked) and "
               "table2.png (epoch time per method with error bars) with tools/plot.py, when "
               "matplotlib is installed (tools/setup.sh --plots)");
}

}  // namespace

int main(int argc, char** argv) {
  cli::name_settings_as_flags();  // errors name the flags
  kernels::cpu::select_gemm_kernels(argv);  // first: it may run the program again
  BenchConfig c;
  c.plot_script = std::string(UNETCU_SOURCE_DIR) + "/tools/plot.py";
  CLI::App app{"unet_bench: the article's Table 1 and Table 2 on the given devices"};
  add_bench_flags(app, c);
  CLI11_PARSE(app, argc, argv);
  try {
    return run_article_bench(c);
  } catch (const std::exception& e) {
    std::cerr << "unet_bench: error: " << e.what() << "\n";
    abort_process_group(1);  // one process's failure ends every process of the job
    return 1;
  }
}
