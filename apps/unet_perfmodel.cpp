// unet_perfmodel: the performance and memory models' report (planning/perf_report.h) for the
// article's setting or another.
#include <CLI/CLI.hpp>

#include <iostream>

#include "cli/cli.h"
#include "cli/parse.h"
#include "planning/perf_model.h"
#include "planning/perf_report.h"

using namespace unetcu;

namespace {

// Every flag, filling its field of `c`.
void add_perfmodel_flags(CLI::App& app, PerfModelConfig& c) {
  std::string presets;
  for (const auto& p : link_presets()) presets += std::string(p.name) + ", ";
  app.add_option("--link", c.link, "Link between the devices: " + presets + "or \"<GB/s>,<latency us>\"")
      ->capture_default_str();
  app.add_option("--dp-link", c.dp_link, "Link of the --dp-ranks table (many machines): as --link")
      ->capture_default_str();
  app.add_option("--gpu", c.gpu, "rtx2070s (the article's: 9.06 TFLOP/s float32, 40 SMs) or h200 (67, 132)")
      ->capture_default_str();
  app.add_option("--gpu-tflops", c.gpu_tflops, "Peak float32 TFLOP/s of one device (0: the --gpu's)")
      ->capture_default_str();
  app.add_option("--gpu-sms", c.gpu_sms,
                 "SMs of one device for the under-fill curve (planning/perf_model.h GpuFill; -1: the "
                 "--gpu's; 0: no under-fill, every micro-batch at the full rate)")
      ->capture_default_str();
  app.add_option("--efficiency", c.efficiency,
                 "Fraction of that peak the layers reach (an assumption: cuDNN float32 convs "
                 "on large planes)")
      ->capture_default_str();
  app.add_option("--image-size", c.image_size, "Image size")->capture_default_str();
  cli::add_enum(app, "--encoder", c.encoder, kEncoderNames, "The UNet's encoder (SMP's name)");
  app.add_option("--dp-batch", c.dp_batch, "Batch per replica (the article: 14)")->capture_default_str();
  app.add_option("--mp-batch", c.mp_batch, "MP batch (the article: 30)")->capture_default_str();
  app.add_option("--mp-split", c.mp_split, "The article's MP split_size (6)")->capture_default_str();
  app.add_option("--loader-rate", c.loader_rate, "Images/s the host can deliver (0: unlimited)")
      ->capture_default_str();
  app.add_option("--dp-ranks", c.dp_ranks,
                 "Also DP (ring, buckets overlapping backward) at these rank counts, e.g. many "
                 "machines over --dp-link: --dp-ranks 8,64")
      ->delimiter(',')
      ->capture_default_str();
  app.add_flag("--no-memory", c.no_memory,
               "Skip the memory table (it measures a step at batches of 1 and 2 of the full model on the CPU at "
               "--image-size: seconds, and that memory)");
}

}  // namespace

int main(int argc, char** argv) {
  cli::name_settings_as_flags();  // errors name the flags
  PerfModelConfig c;
  CLI::App app{"unet_perfmodel: predicted DP and MP step times and speedups of UNet-ResNet34"};
  add_perfmodel_flags(app, c);
  CLI11_PARSE(app, argc, argv);
  try {
    print_perf_model(c);
  } catch (const std::exception& e) {
    std::cerr << "unet_perfmodel: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
