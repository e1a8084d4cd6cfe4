// Times the UNet's layer kinds one by one — 3×3 convolution (C -> C, and C -> 1 with a bias as
// the segmentation head), fused batch norm + ReLU, 3×3/2 max-pool, ×2 upsample into the
// concat buffer — forward and backward, in float32 NCHW,
// float32 NHWC, bf16 NCHW and bf16 NHWC, on the CPU (or --device cuda:0): median of the timed
// repetitions after warm-up, one table row per layer and variant. Shows where channels-last and
// bfloat16 storage pay and where they cost.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "engine/ops.h"
#include "engine/random.h"
#include "engine/tape.h"
#include "kernels/cpu/conv_dnnl.h"
#include "kernels/cpu/conv_narrow.h"
#include "kernels/cpu/cpu_select.h"
#include "runtime/cuda_api.h"
#include "train/step_timing.h"

using namespace unetcu;

namespace {

struct Variant {
  const char* name;
  DType dtype;
  MemoryFormat format;
};

Tensor random_on(const Shape& s, Rng& rng, const Variant& v, Device dev) {
  Tensor t = Tensor::empty(s, DType::F32);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = float(rng.uniform(-1, 1));
  return t.to(v.dtype).to(v.format).to(dev);
}

// Seconds of forward and backward of `layer` (the inputs given require gradients), medians.
std::pair<double, double> time_layer(const std::function<Tensor()>& layer, Device dev, int warmup,
                                     int reps, std::vector<Tensor> grads_of) {
  std::vector<double> fwd, bwd;
  for (int r = 0; r < warmup + reps; ++r) {
    for (Tensor& t : grads_of) t.zero_grad();
    Tape tape;
    Tensor y;
    const auto t0 = std::chrono::steady_clock::now();
    {
      TapeScope scope(tape);
      y = layer();
    }
    if (dev.is_cuda()) cuda::synchronize(dev.index);
    const auto t1 = std::chrono::steady_clock::now();
    const Tensor g = Tensor::full(y.shape(), 1e-3, y.dtype(), y.device()).to(y.format());
    if (dev.is_cuda()) cuda::synchronize(dev.index);
    const auto t1b = std::chrono::steady_clock::now();  // the seed gradient is not timed
    tape.backward({y}, {g});
    if (dev.is_cuda()) cuda::synchronize(dev.index);
    const auto t2 = std::chrono::steady_clock::now();
    if (r < warmup) continue;
    fwd.push_back(std::chrono::duration<double>(t1 - t0).count());
    bwd.push_back(std::chrono::duration<double>(t2 - t1b).count());
  }
  return {bench::median(fwd), bench::median(bwd)};
}

}  // namespace

int main(int argc, char** argv) {
  unetcu::kernels::cpu::select_gemm_kernels(argv);  // first: it may run the program again
  int threads = 2, warmup = 2, reps = 7;
  std::vector<int64_t> shape = {8, 64, 128, 128};
  std::string device = "cpu";
  CLI::App app{"bench_layers: forward+backward time of each UNet layer kind in fp32/bf16, NCHW/NHWC"};
  app.add_option("--threads", threads, "CPU threads")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed repetitions first")->capture_default_str();
  app.add_option("--reps", reps, "Timed repetitions")->capture_default_str();
  app.add_option("--shape", shape, "N C H W of the layers' input")->expected(4)->capture_default_str();
  app.add_option("--device", device, "cpu or cuda:K")->capture_default_str();
  std::string only;
  app.add_option("--layer", only, "Only the layers whose name starts with this (e.g. conv, upsample)");
  CLI11_PARSE(app, argc, argv);
  try {
    UNETCU_CHECK(threads >= 1 && warmup >= 0 && reps >= 1, "--threads and --reps must be at least 1, "
                 "--warmup at least 0");
    UNETCU_CHECK(shape[0] >= 1 && shape[1] >= 1 && shape[2] >= 2 && shape[3] >= 2 && shape[2] % 2 == 0 &&
                     shape[3] % 2 == 0 && shape[0] * shape[1] * shape[2] * shape[3] <= (int64_t(1) << 30),
                 "--shape wants N C H W, H and W even, at most 2^30 elements");
    const Device dev = Device::parse(device);
    set_cpu_threads(threads);
    const int64_t N = shape[0], C = shape[1], H = shape[2], W = shape[3];
    std::printf("%s\n%s, input [%lld, %lld, %lld, %lld], median of %d after %d warm-up\n\n",
                kernels::cpu::cpu_gemm_line().c_str(), dev.str().c_str(), (long long)N, (long long)C,
                (long long)H, (long long)W, reps, warmup);
    std::printf("| layer | variant | forward (ms) | backward (ms) | total (ms) | vs fp32 NCHW |\n");
    std::printf("|---|---|---|---|---|---|\n");
    const Variant variants[] = {{"fp32 NCHW", DType::F32, MemoryFormat::NCHW},
                                {"fp32 NHWC", DType::F32, MemoryFormat::NHWC},
                                {"bf16 NCHW", DType::BF16, MemoryFormat::NCHW},
                                {"bf16 NHWC", DType::BF16, MemoryFormat::NHWC}};
    // The head's conv twice on the CPU: on its direct path (kernels/cpu/conv_narrow.h) and,
    // "(library)", on oneDNN or im2col + GEMM as every other convolution.
    const char* layers[] = {"conv 3x3 C->C", "conv 3x3 C->1 + bias",
                            "conv 3x3 C->1 + bias (library)", "batch_norm_relu",
                            "max_pool 3x3/2", "upsample2x_concat"};
    for (const char* layer : layers) {
      if (std::string(layer).rfind(only, 0) != 0) continue;
      double base = 0;
      for (const Variant& v : variants) {
        Rng rng(1);
        const std::string name = layer;
        Tensor x = random_on({N, C, H, W}, rng, v, dev).set_requires_grad(true);
        std::function<Tensor()> f;
        std::vector<Tensor> leaves = {x};
        Tensor w, gamma, beta, rm, rv, low;
        if (name == "conv 3x3 C->C") {
          w = random_on({C, C, 3, 3}, rng, v, dev).set_requires_grad(true);
          leaves = {x, w};
          f = [&] { return conv2d(x, w, Tensor(), Conv2dOptions{1, 1, 1, 1}); };
        } else if (name.rfind("conv", 0) == 0) {  // the segmentation head: one output channel
          w = random_on({1, C, 3, 3}, rng, v, dev).set_requires_grad(true);
          beta = Tensor::full({1}, 0.1, v.dtype, dev).set_requires_grad(true);  // the bias
          leaves = {x, w, beta};
          f = [&] { return conv2d(x, w, beta, Conv2dOptions{1, 1, 1, 1}); };
        } else if (name == "batch_norm_relu") {
          gamma = Tensor::full({C}, 1.0, DType::F32, dev).set_requires_grad(true);
          beta = Tensor::zeros({C}, DType::F32, dev).set_requires_grad(true);
          rm = Tensor::zeros({C}, DType::F32, dev);
          rv = Tensor::full({C}, 1.0, DType::F32, dev);
          leaves = {x, gamma, beta};
          f = [&] { return batch_norm_relu(x, gamma, beta, rm, rv, true); };
        } else if (name.rfind("max_pool", 0) == 0) {
          f = [&] { return max_pool2d(x, Pool2dOptions::square(3, 2, 1)); };
        } else {  // the decoder: x at half size into channels [0, C) beside a skip of C
          low = random_on({N, C, H / 2, W / 2}, rng, v, dev).set_requires_grad(true);
          leaves = {low, x};
          f = [&] { return upsample_nearest2x_concat(low, x); };
        }
        kernels::cpu::set_narrow_conv_allowed(name.find("(library)") == std::string::npos);
        const auto [fw, bw] = time_layer(f, dev, warmup, reps, leaves);
        kernels::cpu::set_narrow_conv_allowed(true);
        if (v.dtype == DType::F32 && v.format == MemoryFormat::NCHW) base = fw + bw;
        std::printf("| %s | %s | %.2f | %.2f | %.2f | %.2fx |\n", layer, v.name, fw * 1e3, bw * 1e3,
                    (fw + bw) * 1e3, base / (fw + bw));
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_layers: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
