// unet_perfmodel: the performance model of data and model parallelism for UNet-ResNet34
// (planning/perf_model.h) on N = 2, 4, 8 devices, and the article's setting held against the
// article's measured speedups, and DP over many machines next to PyTorch DDP's published
// scaling; then the memory model (planning/memory_model.h): each device's predicted peak for
// the same settings, from a memory profile measured on the CPU at the image size.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

#include "cli/parse.h"
#include "data/synthetic.h"
#include "planning/memory_model.h"
#include "planning/perf_model.h"

using namespace unetcu;

int main(int argc, char** argv) {
  std::string link_name = "pcie3", dp_link_name = "ib-ndr", gpu = "rtx2070s";
  double tflops = 0, efficiency = 0.5, loader = 0;
  int sms = -1;
  int image = 512, dp_batch = 14, mp_batch = 30, mp_split = 6;
  CLI::App app{"unet_perfmodel: predicted DP and MP step times and speedups of UNet-ResNet34"};
  std::string presets;
  for (const auto& p : link_presets()) presets += std::string(p.name) + ", ";
  app.add_option("--link", link_name, "Link between the devices: " + presets + "or \"<GB/s>,<latency us>\"")
      ->capture_default_str();
  app.add_option("--dp-link", dp_link_name, "Link of the --dp-ranks table (many machines): as --link")
      ->capture_default_str();
  app.add_option("--gpu", gpu, "rtx2070s (the article's: 9.06 TFLOP/s float32, 40 SMs) or h200 (67, 132)")
      ->capture_default_str();
  app.add_option("--gpu-tflops", tflops, "Peak float32 TFLOP/s of one device (0: the --gpu's)")->capture_default_str();
  app.add_option("--gpu-sms", sms,
                 "SMs of one device for the under-fill curve (planning/perf_model.h GpuFill; -1: the "
                 "--gpu's; 0: no under-fill, every micro-batch at the full rate)")
      ->capture_default_str();
  app.add_option("--efficiency", efficiency,
                 "Fraction of that peak the layers reach (an assumption: cuDNN float32 convs "
                 "on large planes)")
      ->capture_default_str();
  app.add_option("--image-size", image, "Image size")->capture_default_str();
  app.add_option("--dp-batch", dp_batch, "Batch per replica (the article: 14)")->capture_default_str();
  app.add_option("--mp-batch", mp_batch, "MP batch (the article: 30)")->capture_default_str();
  app.add_option("--mp-split", mp_split, "The article's MP split_size (6)")->capture_default_str();
  app.add_option("--loader-rate", loader, "Images/s the host can deliver (0: unlimited)")->capture_default_str();
  std::vector<int> dp_ranks = {8, 64};
  app.add_option("--dp-ranks", dp_ranks,
                 "Also DP (ring, buckets overlapping backward) at these rank counts, e.g. many "
                 "machines over --dp-link: --dp-ranks 8,64")
      ->delimiter(',')
      ->capture_default_str();
  bool no_memory = false;
  app.add_flag("--no-memory", no_memory,
               "Skip the memory table (it measures a step at batches of 1 and 2 of the full model on the CPU at "
               "--image-size: seconds, and that memory)");
  CLI11_PARSE(app, argc, argv);
  try {
    double preset_tflops = 0;
    int preset_sms = 0;
    if (gpu == "rtx2070s") preset_tflops = 9.06, preset_sms = 40;
    else if (gpu == "h200") preset_tflops = 67, preset_sms = 132;
    else throw Error("--gpu: rtx2070s or h200, not '" + gpu + "'");
    if (tflops == 0) tflops = preset_tflops;
    if (sms < 0) sms = preset_sms;
    UNETCU_CHECK(tflops > 0 && efficiency > 0 && efficiency <= 1, "bad --gpu-tflops or --efficiency");
    const LinkModel link = link_by_name(link_name);
    const LinkModel dp_link = link_by_name(dp_link_name);
    GpuFill fill;
    fill.sms = sms;
    const auto blocks = flop_derived_profile(image, tflops * 1e12 * efficiency, fill);
    const double param_bytes = 24436369.0 * 4;
    std::printf("UNet-ResNet34 at %dx%d, per-block times from FLOPs at %.2f TFLOP/s x %.2f, link %s "
                "(%.1f GB/s, %.0f us), loader %s\n",
                image, image, tflops, efficiency, link_name.c_str(), link.bandwidth / 1e9,
                link.latency * 1e6, loader > 0 ? (std::to_string(int(loader)) + " img/s").c_str() : "unlimited");
    if (sms > 0)
      std::printf("under-fill: %d SMs x %.0f output elements in flight each: a launch with fewer than %.2f M "
                  "output elements runs at that fraction of the rate (planning/perf_model.h GpuFill)\n\n",
                  sms, fill.elements_per_sm, fill.saturating_elements() / 1e6);
    else
      std::printf("no under-fill: every micro-batch at the full rate\n\n");
    std::cout << perf_model_report(blocks, param_bytes, dp_batch, mp_batch, link, loader) << "\n";
    std::printf("DP across machines over %s (%.1f GB/s, %.1f us), ring all-reduce in 25 MB buckets "
                "overlapping backward, batch %d per rank:\n\n",
                dp_link_name.c_str(), dp_link.bandwidth / 1e9, dp_link.latency * 1e6, dp_batch);
    std::printf("| DP ranks | step (s) | all-reduce alone (s) | speedup | efficiency | PyTorch DDP, published |\n"
                "|---|---|---|---|---|---|\n");
    for (int n : dp_ranks) {
      UNETCU_CHECK(n >= 1 && n <= 100000, "--dp-ranks wants counts from 1 to 100000, got ", n);
      const auto p = predict_dp(blocks, param_bytes, n, dp_batch, AllReduceAlgo::Ring, dp_link, 25e6, loader);
      std::printf("| %d | %.4f | %.4f | %.2f | %.1f %% | %s |\n", n, p.step_s, p.allreduce_s, p.speedup,
                  100.0 * p.speedup / n, n == 8 ? "~93 %" : "-");
    }
    std::printf("\n");
    const auto dp = predict_dp(blocks, param_bytes, 2, dp_batch, AllReduceAlgo::Ring, link, 25e6, loader);
    const double mp_t = std::max(predict_step(blocks, {4}, mp_batch, mp_split, Schedule::GPipe, link),
                                 loader > 0 ? mp_batch / loader : 0.0);
    const double single_mp = std::max(single_step_seconds(blocks, mp_batch), loader > 0 ? mp_batch / loader : 0.0);
    std::printf("| the article's setting, 2 devices | model | the article (measured) |\n|---|---|---|\n");
    std::printf("| DP, batch %d per GPU, ring | %.2fx | ~1.30x |\n", dp_batch, dp.speedup);
    std::printf("| MP, batch %d, split_size %d, cut after layer3, GPipe | %.2fx | ~1.04x |\n", mp_batch,
                mp_split, single_mp / mp_t);
    if (!no_memory) {
      UNETCU_CHECK(image >= 64 && image % 32 == 0, "--image-size: a multiple of 32, at least 64, for the memory "
                   "profile (or --no-memory)");
      UNetConfig cfg;
      cfg.device = Device::cpu(0);
      MemoryProfile profile;
      {
        SyntheticSegmentation data(image, 1);
        UNet model(cfg);
        auto adam = optimizer_factory({OptimizerKind::Adam, 1e-3, 0.9, 0})(model.parameters());
        profile = profile_memory(model, *adam, LossKind::BCEDice, data.batch({0}), data.batch({0, 1}));
      }
      const std::vector<bool> all(size_t(UNet::kBlocks), true);
      const std::vector<Device> two = {Device::cuda(0), Device::cuda(1)};
      std::printf("\nMemory per device (planning/memory_model.h), float32 NCHW, Adam, BCE+Dice, %dx%d: the profile "
                  "measured on the CPU (a GPU holds the same tensors, with cuDNN's workspace for the CPU's "
                  "scratch), the batch copied onto each device:\n\n| plan | peak per device (MiB) |\n|---|---|\n",
                  image, image);
      const auto row = [&](const std::string& name, MemoryPlan plan) {
        std::string cells;
        for (double b : predict_peaks(profile, plan))
          cells += (cells.empty() ? "" : " / ") + std::to_string(int64_t(b / (1 << 20) + 0.5));
        std::printf("| %s | %s |\n", name.c_str(), cells.c_str());
      };
      for (const bool again : {false, true}) {
        const std::string rc = again ? ", every block recomputed" : "";
        MemoryPlan one;
        one.batch = mp_batch;
        one.devices = {Device::cuda(0)};
        one.recompute = again ? all : std::vector<bool>();
        row(str_cat("one device, batch ", mp_batch, rc), one);
        MemoryPlan dp = one;
        dp.kind = MemoryPlan::DataParallel;
        dp.batch = dp_batch;
        dp.devices = two;
        row(str_cat("DP x2, batch ", dp_batch, " per replica", rc), dp);
        for (const Schedule s : {Schedule::GPipe, Schedule::OneFOneB}) {
          MemoryPlan mp = one;
          mp.kind = MemoryPlan::Pipeline;
          mp.devices = two;
          mp.cuts = cli::parse_cuts("layer3");
          mp.split_size = mp_split;
          mp.schedule = s;
          row(str_cat("MP x2, batch ", mp_batch, ", split_size ", mp_split, ", cut after layer3, ",
                      name_of(kScheduleNames, s), rc),
              mp);
        }
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "unet_perfmodel: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
