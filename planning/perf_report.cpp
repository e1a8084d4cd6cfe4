#include "planning/perf_report.h"

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "data/synthetic.h"
#include "planning/memory_model.h"
#include "planning/perf_model.h"

namespace unetcu {

void print_perf_model(PerfModelConfig c) {
  double preset_tflops = 0;
  int preset_sms = 0;
  if (c.gpu == "rtx2070s") preset_tflops = 9.06, preset_sms = 40;
  else if (c.gpu == "h200") preset_tflops = 67, preset_sms = 132;
  else throw Error(str_cat(setting("gpu"), ": rtx2070s or h200, not '", c.gpu, "'"));
  if (c.gpu_tflops == 0) c.gpu_tflops = preset_tflops;
  if (c.gpu_sms < 0) c.gpu_sms = preset_sms;
  UNETCU_CHECK(c.gpu_tflops > 0 && c.efficiency > 0 && c.efficiency <= 1, "bad ", setting("gpu_tflops"), " or ",
               setting("efficiency"));
  const LinkModel link = link_by_name(c.link);
  const LinkModel dp_link = link_by_name(c.dp_link);
  GpuFill fill;
  fill.sms = c.gpu_sms;
  const auto blocks = flop_derived_profile(c.image_size, c.gpu_tflops * 1e12 * c.efficiency, fill, c.encoder);
  UNetConfig full;
  full.encoder = c.encoder;
  const double param_bytes = 4.0 * double(UNet(full).parameter_count());  // float32 gradients
  std::printf(
      "UNet-%s at %dx%d, per-block times from FLOPs at %.2f TFLOP/s x %.2f, link %s "
      "(%.1f GB/s, %.0f us), loader %s\n",
      c.encoder == EncoderKind::ResNet34 ? "ResNet34" : encoder_name(c.encoder), c.image_size, c.image_size, c.gpu_tflops, c.efficiency, c.link.c_str(), link.bandwidth / 1e9, link.latency * 1e6,
      c.loader_rate > 0 ? (std::to_string(int(c.loader_rate)) + " img/s").c_str() : "unlimited");
  if (c.gpu_sms > 0)
    std::printf("under-fill: %d SMs x %.0f output elements in flight each: a launch with fewer than %.2f M "
                "output elements runs at that fraction of the rate (planning/perf_model.h GpuFill)\n\n",
                c.gpu_sms, fill.elements_per_sm, fill.saturating_elements() / 1e6);
  else
    std::printf("no under-fill: every micro-batch at the full rate\n\n");
  std::cout << perf_model_report(blocks, param_bytes, c.dp_batch, c.mp_batch, link, c.loader_rate) << "\n";
  std::printf("DP across machines over %s (%.1f GB/s, %.1f us), ring all-reduce in 25 MB buckets "
              "overlapping backward, batch %d per rank:\n\n",
              c.dp_link.c_str(), dp_link.bandwidth / 1e9, dp_link.latency * 1e6, c.dp_batch);
  std::printf("| DP ranks | step (s) | all-reduce alone (s) | speedup | efficiency | PyTorch DDP, published |\n"
              "|---|---|---|---|---|---|\n");
  for (int n : c.dp_ranks) {
    UNETCU_CHECK(n >= 1 && n <= 100000, setting("dp_ranks"), " wants counts from 1 to 100000, got ", n);
    const auto p = predict_dp(blocks, param_bytes, n, c.dp_batch, AllReduceAlgo::Ring, dp_link, 25e6, c.loader_rate);
    std::printf("| %d | %.4f | %.4f | %.2f | %.1f %% | %s |\n", n, p.step_s, p.allreduce_s, p.speedup,
                100.0 * p.speedup / n, n == 8 ? "~93 %" : "-");
  }
  std::printf("\n");
  const auto dp = predict_dp(blocks, param_bytes, 2, c.dp_batch, AllReduceAlgo::Ring, link, 25e6, c.loader_rate);
  const double mp_t = std::max(predict_step(blocks, {4}, c.mp_batch, c.mp_split, Schedule::GPipe, link),
                               c.loader_rate > 0 ? c.mp_batch / c.loader_rate : 0.0);
  const double single_mp =
      std::max(single_step_seconds(blocks, c.mp_batch), c.loader_rate > 0 ? c.mp_batch / c.loader_rate : 0.0);
  std::printf("| the article's setting, 2 devices | model | the article (measured) |\n|---|---|---|\n");
  std::printf("| DP, batch %d per GPU, ring | %.2fx | ~1.30x |\n", c.dp_batch, dp.speedup);
  std::printf("| MP, batch %d, split_size %d, cut after layer3, GPipe | %.2fx | ~1.04x |\n", c.mp_batch,
              c.mp_split, single_mp / mp_t);
  if (!c.no_memory) {
    UNETCU_CHECK(c.image_size >= 64 && c.image_size % 32 == 0, setting("image_size"),
                 ": a multiple of 32, at least 64, for the memory profile (or ", setting("no_memory"), ")");
    UNetConfig cfg;
    cfg.encoder = c.encoder;
    cfg.device = Device::cpu(0);
    MemoryProfile profile;
    {
      SyntheticSegmentation data(c.image_size, 1);
      UNet model(cfg);
      auto adam = optimizer_factory({OptimizerKind::Adam, 1e-3, 0.9, 0})(model.parameters());
      profile = profile_memory(model, *adam, LossKind::BCEDice, data.batch({0}), data.batch({0, 1}));
    }
    const std::vector<bool> all(size_t(UNet::kBlocks), true);
    const std::vector<Device> two = {Device::cuda(0), Device::cuda(1)};
    std::printf("\nMemory per device (planning/memory_model.h), float32 NCHW, Adam, BCE+Dice, %dx%d: the profile "
                "measured on the CPU (a GPU holds the same tensors, with cuDNN's workspace for the CPU's "
                "scratch), the batch copied onto each device:\n\n| plan | peak per device (MiB) |\n|---|---|\n",
                c.image_size, c.image_size);
    const auto row = [&](const std::string& name, MemoryPlan plan) {
      std::string cells;
      for (double b : predict_peaks(profile, plan))
        cells += (cells.empty() ? "" : " / ") + std::to_string(int64_t(b / (1 << 20) + 0.5));
      std::printf("| %s | %s |\n", name.c_str(), cells.c_str());
    };
    for (const bool again : {false, true}) {
      const std::string rc = again ? ", every block recomputed" : "";
      MemoryPlan one;
      one.batch = c.mp_batch;
      one.devices = {Device::cuda(0)};
      one.recompute = again ? all : std::vector<bool>();
      row(str_cat("one device, batch ", c.mp_batch, rc), one);
      MemoryPlan dp = one;
      dp.kind = MemoryPlan::DataParallel;
      dp.batch = c.dp_batch;
      dp.devices = two;
      row(str_cat("DP x2, batch ", c.dp_batch, " per replica", rc), dp);
      for (const Schedule s : {Schedule::GPipe, Schedule::OneFOneB}) {
        MemoryPlan mp = one;
        mp.kind = MemoryPlan::Pipeline;
        mp.devices = two;
        mp.cuts = {4};  // after layer3
        mp.split_size = c.mp_split;
        mp.schedule = s;
        row(str_cat("MP x2, batch ", c.mp_batch, ", split_size ", c.mp_split, ", cut after layer3, ",
                    name_of(kScheduleNames, s), rc),
            mp);
      }
    }
  }
}

}  // namespace unetcu
