// Contract 2: every CUDA op equals the CPU float64 op on the same random input, forward and
// backward; a reduced-width UNet training step on CUDA equals the CPU step.
//
// Inputs are drawn fresh (the seed is printed on failure), rounded to float32, and given to
// both backends: the CUDA op in float32, the CPU op in float64. Every new device block is
// filled with NaN first (poisoned allocations), so an element a kernel forgets to write fails.
// Error measure: ‖cuda − cpu‖ / ‖cpu‖. Float32 accumulation over up to ~10^4 terms stays under
// 1e-5; convolutions are checked with TF32 off at 1e-5, and once with TF32 on at 2e-3 (TF32
// keeps 10 mantissa bits: ~5e-4 relative per product). A convolution's results are sums of
// products that may cancel (the bias gradient of one output channel is one sum of random
// output gradients, near zero now and then), and a float32 sum is exact only to its terms'
// scale, |fl(Σt) − Σt| ≤ γ_n Σ|t|: convolutions are measured against ‖the op on the absolute
// values‖ (inputs and output gradient), which is Σ|t| per element.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "cli/parse.h"
#include "data/metrics.h"
#include "runtime/cuda/nccl.cuh"
#include "runtime/algo_cache.h"
#include "runtime/cuda_api.h"
#include "engine/ops.h"
#include "engine/optim.h"
#include "engine/random.h"
#include "engine/tape.h"
#include "kernels/cuda/conv_reset.h"
#include "kernels/launchers.h"
#include "models/unet.h"
#include "parallel/data_parallel.h"
#include "parallel/pipeline.h"
#include "train/strategy.h"
#include "same_state.h"
#include "stream_gate.h"
#include "env_scope.h"

using namespace unetcu;
using unetcu::testing::EnvScope;

namespace {

const Device kGpu = Device::cuda(0);

// A new seed per check, printed with any failure (CAPTURE) so it can be replayed:
// UNETCU_TEST_SEED=<seed> gives every check that seed.
uint64_t fresh_seed() {
  if (const char* s = std::getenv("UNETCU_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
}
#define FRESH_RNG(name)               \
  const uint64_t name##_seed = fresh_seed(); \
  CAPTURE(name##_seed);               \
  Rng name(name##_seed)

// A float32-representable random host tensor in float64.
Tensor random64(const Shape& s, Rng& rng, double lo = -1, double hi = 1) {
  Tensor t = Tensor::empty(s, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, double(float(rng.uniform(lo, hi))));
  return t;
}

Tensor gpu(const Tensor& t64) { return t64.to(DType::F32).to(kGpu); }

// ‖got − want‖ / ‖scale‖ (scale: want itself unless given).
double rel(const Tensor& got, const Tensor& want, const Tensor& scale = Tensor()) {
  const std::vector<double> a = got.to_vector(), b = want.to_vector();
  const std::vector<double> m = scale.defined() ? scale.to_vector() : b;
  REQUIRE(a.size() == b.size());
  REQUIRE(m.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;  // unwritten (poisoned) or overflowed
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += m[i] * m[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// |t| elementwise, float64 on the CPU.
Tensor abs64(const Tensor& t) {
  std::vector<double> v = t.to_vector();
  for (double& e : v) e = std::fabs(e);
  return Tensor::from_vector(t.shape(), v, DType::F64);
}

// SGD with momentum: an update linear in the gradient, for step-for-step comparisons.
std::unique_ptr<Optimizer> make_sgd(std::vector<Tensor> p) {
  SgdOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  return std::make_unique<SGD>(std::move(p), o);
}

struct Setup {
  Setup() {
    cuda::set_poison_allocations(true);
    cuda::set_allow_tf32(false);
    cuda::set_deterministic(true);  // as main() sets it: no atomics, FFT or Winograd in conv
  }
};

// Runs f on the CPU (float64) and on the GPU (float32) with the same inputs, back-propagates
// the same random output gradient twice (the second pass accumulates), and compares the
// output and every input gradient. With `of_magnitudes` (sums of products: convolutions) each
// error is measured against f and its gradients on the absolute values of the inputs and the
// output gradient, Σ|t| of each result's terms, instead of against the result.
void check_op(const char* name, const std::function<Tensor(const std::vector<Tensor>&)>& f,
              const std::vector<Tensor>& inputs64, const std::vector<bool>& needs_grad,
              double tol = 1e-5, bool of_magnitudes = false) {
  CAPTURE(name);
  std::vector<Tensor> cpu_in, gpu_in, abs_in;
  for (size_t i = 0; i < inputs64.size(); ++i) {
    cpu_in.push_back(inputs64[i].clone().set_requires_grad(needs_grad[i]));
    gpu_in.push_back(gpu(inputs64[i]).set_requires_grad(needs_grad[i]));
    if (of_magnitudes) abs_in.push_back(abs64(inputs64[i]).set_requires_grad(needs_grad[i]));
  }
  FRESH_RNG(rng);
  Tensor ref_out;
  for (int pass = 0; pass < 2; ++pass) {
    Tape tc, tg, ta;
    Tensor yc, yg, ya;
    {
      TapeScope s(tc);
      yc = f(cpu_in);
    }
    {
      TapeScope s(tg);
      yg = f(gpu_in);
    }
    if (of_magnitudes) {
      TapeScope s(ta);
      ya = f(abs_in);
    }
    CHECK(yg.device() == kGpu);
    CHECK(rel(yg, yc, ya) < tol);
    if (!ref_out.defined()) ref_out = random64(yc.shape(), rng);
    tc.backward({yc}, {ref_out});
    tg.backward({yg}, {gpu(ref_out)});
    if (of_magnitudes) ta.backward({ya}, {abs64(ref_out)});
    for (size_t i = 0; i < inputs64.size(); ++i) {
      if (!needs_grad[i]) continue;
      CAPTURE(i);
      CAPTURE(pass);
      CHECK(rel(gpu_in[i].grad(), cpu_in[i].grad(), of_magnitudes ? abs_in[i].grad() : Tensor()) <
            tol);
    }
  }
}

}  // namespace

TEST_CASE("CUDA conv2d equals the CPU float64 conv (TF32 off), forward and backward") {
  Setup setup;
  FRESH_RNG(rng);
  struct Case {
    Shape x, w;
    Conv2dOptions o;
    bool bias;
  };
  const Case cases[] = {{{2, 3, 33, 31}, {8, 3, 7, 7}, {2, 2, 3, 3}, false},
                        {{2, 16, 17, 19}, {12, 16, 3, 3}, {1, 1, 1, 1}, true},
                        {{3, 8, 16, 16}, {16, 8, 3, 3}, {2, 2, 1, 1}, false},
                        {{2, 8, 15, 15}, {4, 8, 1, 1}, {2, 2, 0, 0}, false},
                        {{1, 16, 32, 32}, {1, 16, 3, 3}, {1, 1, 1, 1}, true}};
  for (const Case& c : cases) {
    CAPTURE(shape_str(c.x));
    std::vector<Tensor> in = {random64(c.x, rng), random64(c.w, rng),
                              c.bias ? random64({c.w[0]}, rng) : Tensor()};
    std::vector<bool> need = {true, true, c.bias};
    if (!c.bias) {
      in.pop_back();
      need.pop_back();
    }
    check_op("conv2d", [&](const std::vector<Tensor>& v) {
      return conv2d(v[0], v[1], v.size() > 2 ? v[2] : Tensor(), c.o);
    }, in, need, 1e-5, true);
  }
}

TEST_CASE("CUDA conv2d with TF32 tensor cores stays within 2e-3 of float64") {
  Setup setup;
  cuda::set_allow_tf32(true);
  FRESH_RNG(rng);
  check_op("conv2d tf32", [](const std::vector<Tensor>& v) { return conv2d(v[0], v[1], Tensor(), 1, 1); },
           {random64({4, 64, 32, 32}, rng), random64({64, 64, 3, 3}, rng)}, {true, true}, 2e-3);
  cuda::set_allow_tf32(false);
}

TEST_CASE("CUDA batch_norm2d equals the CPU op: training (with running statistics) and eval") {
  Setup setup;
  FRESH_RNG(rng);
  const Shape xs = {4, 6, 9, 7};
  Tensor rm64 = random64({6}, rng), rv64 = random64({6}, rng, 0.5, 2);
  for (bool training : {true, false}) {
    CAPTURE(training);
    Tensor rmc = rm64.clone(), rvc = rv64.clone(), rmg = gpu(rm64), rvg = gpu(rv64);
    check_op("batch_norm2d", [&](const std::vector<Tensor>& v) {
      const bool on_gpu = v[0].device().is_cuda();
      return batch_norm2d(v[0], v[1], v[2], on_gpu ? rmg : rmc, on_gpu ? rvg : rvc, training);
    }, {random64(xs, rng, -2, 3), random64({6}, rng, 0.5, 1.5), random64({6}, rng)},
             {true, true, true});
    // Both ran the forward twice: the running statistics moved the same way.
    CHECK(rel(rmg, rmc) < 1e-5);
    CHECK(rel(rvg, rvc) < 1e-5);
  }
}

TEST_CASE("CUDA fused batch norm + (add +) relu equals the CPU ops, training and eval") {
  Setup setup;
  FRESH_RNG(rng);
  // Odd planes, a single-value-wide one, and a plane larger than one reduction block
  // (2048 values), so a channel's sums cross several blocks of several samples.
  const Shape shapes[] = {{4, 6, 9, 7}, {3, 5, 1, 13}, {2, 3, 67, 61}};
  for (const Shape& xs : shapes)
    for (bool training : {true, false})
      for (bool with_residual : {false, true}) {
        CAPTURE(shape_str(xs));
        CAPTURE(training);
        CAPTURE(with_residual);
        const int64_t C = xs[1];
        Tensor rm64 = random64({C}, rng), rv64 = random64({C}, rng, 0.5, 2);
        Tensor rmc = rm64.clone(), rvc = rv64.clone(), rmg = gpu(rm64), rvg = gpu(rv64);
        std::vector<Tensor> in = {random64(xs, rng, -2, 3), random64({C}, rng, 0.5, 1.5),
                                  random64({C}, rng)};
        if (with_residual) in.push_back(random64(xs, rng));
        // Away from the ReLU's kink: where bn(x) (+ r) is within 1e-3 of 0 the GPU's float32
        // and the CPU's float64 may mask differently (a gradient of ~1 against ~1e-5). The
        // residual moves it without touching the statistics; without one, x moves by 1e-2
        // (gamma * invstd >= 0.35 here: at least 3.5e-3).
        {
          Tensor prm = rm64.clone(), prv = rv64.clone();
          const Tensor pre = batch_norm2d(in[0], in[1], in[2], prm, prv, training, 0.1, 1e-5);
          Tensor& moved = with_residual ? in[3] : in[0];
          for (int64_t i = 0; i < pre.numel(); ++i) {
            const double p = pre.at(i) + (with_residual ? in[3].at(i) : 0.0);
            if (std::fabs(p) < 1e-3) moved.set(i, moved.at(i) + (p < 0 ? -1e-2 : 1e-2));
          }
        }
        check_op(with_residual ? "batch_norm_add_relu" : "batch_norm_relu",
                 [&](const std::vector<Tensor>& v) {
                   const bool on_gpu = v[0].device().is_cuda();
                   Tensor& rm = on_gpu ? rmg : rmc;
                   Tensor& rv = on_gpu ? rvg : rvc;
                   return v.size() > 3 ? batch_norm_add_relu(v[0], v[1], v[2], v[3], rm, rv, training)
                                       : batch_norm_relu(v[0], v[1], v[2], rm, rv, training);
                 },
                 in, std::vector<bool>(in.size(), true));
        CHECK(rel(rmg, rmc) < 1e-5);
        CHECK(rel(rvg, rvc) < 1e-5);
      }
}

TEST_CASE("CUDA fused batch norm statistics: a large mean, many blocks per channel") {
  Setup setup;
  FRESH_RNG(rng);
  // 1e4 + U(-1, 1): float32 E[x²] - E[x]² would lose every digit of the variance; 2 x 1 x 300 x
  // 300 values in one channel span 88 reduction blocks.
  const Shape xs = {2, 1, 300, 300};
  Tensor x64 = Tensor::empty(xs, DType::F64);
  for (int64_t i = 0; i < x64.numel(); ++i) x64.set(i, double(float(1e4 + rng.uniform(-1, 1))));
  Tensor rmc = Tensor::zeros({1}, DType::F64), rvc = Tensor::zeros({1}, DType::F64);
  Tensor rmg = gpu(rmc), rvg = gpu(rvc);
  const Tensor g = Tensor::full({1}, 1.0, DType::F64), b = Tensor::zeros({1}, DType::F64);
  batch_norm_relu(x64, g, b, rmc, rvc, true, 1.0);
  batch_norm_relu(gpu(x64), gpu(g), gpu(b), rmg, rvg, true, 1.0);
  CHECK(rel(rmg, rmc) < 1e-7);
  CHECK(rel(rvg, rvc) < 1e-5);
}

TEST_CASE("CUDA elementwise, pooling, resampling and concat equal the CPU ops") {
  Setup setup;
  FRESH_RNG(rng);
  const Shape s = {2, 5, 13, 11};
  check_op("relu", [](const std::vector<Tensor>& v) { return relu(v[0]); }, {random64(s, rng)}, {true});
  check_op("sigmoid", [](const std::vector<Tensor>& v) { return sigmoid(v[0]); },
           {random64(s, rng, -6, 6)}, {true});
  check_op("add", [](const std::vector<Tensor>& v) { return add(v[0], v[1]); },
           {random64(s, rng), random64(s, rng)}, {true, true});
  check_op("scale", [](const std::vector<Tensor>& v) { return scale(v[0], -1.5); }, {random64(s, rng)},
           {true});
  check_op("max_pool2d 3x3/2 pad 1", [](const std::vector<Tensor>& v) {
    return max_pool2d(v[0], Pool2dOptions::square(3, 2, 1));
  }, {random64(s, rng)}, {true});
  check_op("max_pool2d 2x3/(1,2)", [](const std::vector<Tensor>& v) {
    return max_pool2d(v[0], Pool2dOptions{2, 3, 1, 2, 1, 1});
  }, {random64(s, rng)}, {true});
  check_op("upsample_nearest2x", [](const std::vector<Tensor>& v) { return upsample_nearest2x(v[0]); },
           {random64(s, rng)}, {true});
  check_op("concat_channels", [](const std::vector<Tensor>& v) { return concat_channels({v[0], v[1], v[2]}); },
           {random64({2, 3, 7, 5}, rng), random64({2, 1, 7, 5}, rng), random64({2, 4, 7, 5}, rng)},
           {true, false, true});
  check_op("to_device round trip", [](const std::vector<Tensor>& v) {
    // cuda -> cpu -> cuda (or cpu -> cpu): the gradient must travel back through both moves.
    const Device home = v[0].device();
    return to_device(scale(to_device(v[0], Device::cpu()), 2.0), home);
  }, {random64(s, rng)}, {true});
}

TEST_CASE("CUDA losses equal the CPU losses, values and gradients") {
  Setup setup;
  FRESH_RNG(rng);
  // One channel (0/1 targets) and four classes (indices 0..2: class 3 absent), each with about
  // one pixel in ten ignored (-1), in both memory formats of the logits.
  for (int64_t C : {1, 4}) {
    const Shape s = {3, C, 40, 37}, ts = {3, 1, 40, 37};
    Tensor target = Tensor::empty(ts, DType::F64);
    for (int64_t i = 0; i < target.numel(); ++i) {
      const double u = rng.uniform();
      target.set(i, u < 0.1 ? -1.0 : C == 1 ? (u < 0.4 ? 1.0 : 0.0) : double(int64_t(rng.uniform() * 3)));
    }
    const Tensor tc = target, tg = gpu(target);
    for (MemoryFormat f : {MemoryFormat::NCHW, MemoryFormat::NHWC})
      for (LossKind k : {LossKind::BCE, LossKind::Dice, LossKind::BCEDice}) {
        CAPTURE(C);
        CAPTURE(format_name(f));
        check_op(loss_kind_name(k, int(C)), [&](const std::vector<Tensor>& v) {
          return segmentation_loss(k, v[0], v[0].device().is_cuda() ? tg : tc);
        }, {random64(s, rng, -8, 8).to(f)}, {true});
      }
  }
}

TEST_CASE("CUDA confusion matrix equals the CPU's: one channel and four classes, ignored pixels, NHWC") {
  Setup setup;
  FRESH_RNG(rng);
  for (int64_t C : {1, 4}) {
    CAPTURE(C);
    const Shape s = {3, C, 40, 37}, ts = {3, 1, 40, 37};
    Tensor target = Tensor::empty(ts, DType::F64);
    for (int64_t i = 0; i < target.numel(); ++i) {
      const double u = rng.uniform();
      target.set(i, u < 0.1 ? -1.0 : C == 1 ? (u < 0.4 ? 1.0 : 0.0) : double(int64_t(rng.uniform() * 3)));
    }
    const Tensor logits = random64(s, rng, -4, 4).to(DType::F32);
    for (MemoryFormat f : {MemoryFormat::NCHW, MemoryFormat::NHWC}) {
      CAPTURE(format_name(f));
      SegmentationCounts cpu{int(C)}, gpu_counts{int(C)};
      for (int pass = 0; pass < 2; ++pass) {  // accumulated over batches
        cpu.add(logits.to(f), target.to(DType::F32));
        gpu_counts.add(logits.to(f).to(kGpu), gpu(target));
      }
      CHECK(gpu_counts.matrix() == cpu.matrix());
      double total = 0;
      for (double v : cpu.matrix()) total += v;
      int64_t counted = 0;
      for (int64_t i = 0; i < target.numel(); ++i) counted += target.at(i) >= 0;
      CHECK(total == double(2 * counted));
    }
  }
}

namespace {
// One optimizer step of `opt` over the parameter p, whose gradient is set to `grad` first.
void step_with_gradient(Tensor& p, Optimizer& opt, const Tensor& grad) {
  opt.zero_grad();
  Tape t;
  Tensor y;
  {
    TapeScope s(t);
    y = scale(p, 1.0);
  }
  t.backward({y}, {grad});
  opt.step();
}
}  // namespace

TEST_CASE("CUDA Adam and SGD steps equal the CPU steps") {
  Setup setup;
  FRESH_RNG(rng);
  for (int which = 0; which < 2; ++which) {
    Tensor p64 = random64({1000}, rng), g1 = random64({1000}, rng), g2 = random64({1000}, rng);
    Tensor pc = p64.clone().set_requires_grad(true), pg = gpu(p64).set_requires_grad(true);
    std::unique_ptr<Optimizer> oc, og;
    if (which == 0) {
      AdamOptions o;
      o.weight_decay = 0.01;
      oc = std::make_unique<Adam>(std::vector<Tensor>{pc}, o);
      og = std::make_unique<Adam>(std::vector<Tensor>{pg}, o);
    } else {
      SgdOptions o;
      o.lr = 0.1;
      o.momentum = 0.9;
      oc = std::make_unique<SGD>(std::vector<Tensor>{pc}, o);
      og = std::make_unique<SGD>(std::vector<Tensor>{pg}, o);
    }
    for (const Tensor* g : {&g1, &g2}) {
      step_with_gradient(pc, *oc, g->clone());
      step_with_gradient(pg, *og, gpu(*g));
    }
    CAPTURE(which);
    CHECK(rel(pg, pc) < 1e-6);
  }
}

TEST_CASE("CUDA gradient clipping equals the CPU's: the square sum over many tensors, the scaling, a clipped step") {
  Setup setup;
  FRESH_RNG(rng);
  // 300 tensors: two launches of at most 256; sizes across the 4096-element chunks.
  std::vector<Tensor> c64, g32;
  for (int k = 0; k < 300; ++k) {
    const int64_t n = k % 5 == 0 ? 4095 + k % 3 : 1 + (k * 37) % 900;
    c64.push_back(random64({n}, rng));
    g32.push_back(gpu(c64.back()));
  }
  const std::vector<TensorRef> rc(c64.begin(), c64.end()), rg(g32.begin(), g32.end());
  Tensor sc = Tensor::empty({1}, DType::F64), sg = Tensor::empty({1}, DType::F64, kGpu);
  kernels::cpu::square_sum_many(rc, sc);
  kernels::cuda::square_sum_many(rg, sg);
  // Both sum the same float32 values in float64, in other orders: ~1e-16 relative per term.
  CHECK(std::fabs(sg.item() - sc.item()) <= 1e-12 * sc.item());
  Tensor again = Tensor::empty({1}, DType::F64, kGpu);
  kernels::cuda::square_sum_many(rg, again);
  CHECK(again.item() == sg.item());  // a fixed order: the same bits every time
  const double norm = std::sqrt(sc.item());
  // Scaled to norm 1 on both; untouched above the norm.
  kernels::cpu::clip_scale_many(rc, sc, 1.0);
  kernels::cuda::clip_scale_many(rg, sg, 1.0);
  for (size_t k = 0; k < c64.size(); ++k) REQUIRE(rel(g32[k], c64[k]) < 1e-6);
  const std::vector<double> before = g32[7].to_vector();
  kernels::cuda::clip_scale_many(rg, sg, 2 * norm);
  CHECK(g32[7].to_vector() == before);
  // A clipped SGD step.
  Tensor p64 = random64({5000}, rng), g = random64({5000}, rng, -10, 10);
  Tensor pc = p64.clone().set_requires_grad(true), pg = gpu(p64).set_requires_grad(true);
  auto oc = make_sgd({pc}), og = make_sgd({pg});
  oc->set_max_grad_norm(0.5);
  og->set_max_grad_norm(0.5);
  step_with_gradient(pc, *oc, g.clone());
  step_with_gradient(pg, *og, gpu(g));
  CHECK(rel(pg, pc) < 1e-6);
  // The clip's record, kept on the device.
  const Optimizer::ClipStats sc_ = oc->take_clip_stats(), sg_ = og->take_clip_stats();
  CHECK(sg_.steps == 1);
  CHECK(sg_.clipped == 1);
  CHECK(std::fabs(sg_.norm_max - sc_.norm_max) <= 1e-6 * sc_.norm_max);
  CHECK(sg_.norm_mean == sg_.norm_max);
  double moved = 0;  // no element moves more than lr × max_norm
  for (int64_t i = 0; i < pc.numel(); ++i) moved = std::max(moved, std::fabs(pc.at(i) - p64.at(i)));
  CHECK(moved <= 0.1 * 0.5 * (1 + 1e-12));
  CHECK(moved > 0.1 * 0.5 * 0.01);
  // An infinite largest norm measures and never scales: the unclipped step's bits, the norm
  // recorded, no step counted clipped.
  Tensor pm = gpu(p64).set_requires_grad(true), pu = gpu(p64).set_requires_grad(true);
  auto om = make_sgd({pm}), ou = make_sgd({pu});
  om->set_max_grad_norm(INFINITY);
  step_with_gradient(pm, *om, gpu(g));
  step_with_gradient(pu, *ou, gpu(g));
  CHECK(testing::same_bits(pm, pu));
  const Optimizer::ClipStats sm = om->take_clip_stats();
  CHECK(sm.steps == 1);
  CHECK(sm.clipped == 0);
  CHECK(std::fabs(sm.norm_max - sc_.norm_max) <= 1e-6 * sc_.norm_max);
}

namespace {

// How far one training step (BCE+Dice, Adam) of the reduced-width UNet on the GPU (float32)
// lies from the same step on the CPU (float64), from the same parameters, on the input drawn
// by Rng(seed).
struct StepGap {
  double loss = 0;        // relative
  double grad = 0;        // the largest relative gradient error over the parameter tensors
  int moved = 0;          // Adam updates that differ (below)
  double statistics = 0;  // the largest relative error of the batch-norm running statistics
};

StepGap unet_step_gap(uint64_t seed) {
  Rng rng(seed);
  UNetConfig cg;
  cg.width_divisor = 8;
  cg.seed = 5;
  cg.device = kGpu;
  UNet mg(cg);
  UNetConfig cc = cg;
  cc.device = Device::cpu();
  cc.dtype = DType::F64;
  UNet mc(cc);
  // Same starting values: the CPU model takes the GPU model's float32 parameters.
  auto sg = mg.state(), sc = mc.state();
  REQUIRE(sg.size() == sc.size());
  for (size_t i = 0; i < sg.size(); ++i)
    if (sg[i].tensor.defined()) sc[i].tensor.copy_(sg[i].tensor);
  Tensor x = random64({2, 3, 64, 64}, rng, -2, 2);
  Tensor t = Tensor::empty({2, 1, 64, 64}, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.uniform() < 0.4 ? 1.0 : 0.0);
  std::vector<Tensor> before;
  for (auto& e : sc)
    if (e.is_parameter) before.push_back(e.tensor.clone());
  Adam ac(mc.parameters()), ag(mg.parameters());
  double losses[2];
  for (int k = 0; k < 2; ++k) {
    UNet& m = k ? mg : mc;
    Adam& opt = k ? ag : ac;
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      loss = segmentation_loss(LossKind::BCEDice, m.forward(k ? gpu(x) : x), k ? gpu(t) : t);
    }
    tape.backward(loss);
    opt.step();
    losses[k] = loss.item();
  }
  StepGap gap;
  gap.loss = std::fabs(losses[1] - losses[0]) / std::fabs(losses[0]);
  const auto pc = mc.parameters(), pg = mg.parameters();
  for (size_t i = 0; i < pc.size(); ++i) {
    gap.grad = std::max(gap.grad, rel(pg[i].grad(), pc[i].grad()));
    // Adam's first step moves a weight by lr * g / (|g| + eps): where |g| is far above float32
    // noise both steps agree to a tiny fraction of lr; where g is noise-level (< 1e-3 of the
    // tensor's RMS gradient) the direction may legitimately differ, so those are left out.
    const std::vector<double> g = pc[i].grad().to_vector(), b = before[i].to_vector();
    const std::vector<double> ac_ = pc[i].to_vector(), ag_ = pg[i].to_vector();
    double rms = 0;
    for (double v : g) rms += v * v;
    rms = std::sqrt(rms / double(g.size()));
    for (size_t k = 0; k < g.size(); ++k)
      if (std::fabs(g[k]) > 1e-3 * rms && std::fabs((ag_[k] - b[k]) - (ac_[k] - b[k])) > 1e-2 * 1e-3)
        ++gap.moved;
  }
  // Running statistics after one training forward.
  for (size_t i = 0; i < sg.size(); ++i)
    if (!sg[i].is_parameter && sg[i].tensor.defined())
      gap.statistics = std::max(gap.statistics, rel(sg[i].tensor, sc[i].tensor));
  return gap;
}

}  // namespace

// Six fixed inputs. On about one input in three (seeds 1 to 12 measured: 4 on the emulated
// cuDNN, 3 with the CPU backend's float32 convolutions, two summation orders) some ReLU's input
// lies within float32 rounding of zero, the float32 and float64 runs take different branches
// there, and every earlier layer's gradient moves by about 1/sqrt(elements) of its norm:
// 1.5e-3 to 5.1e-2 measured, against 2e-5 to 7e-5 otherwise. Which inputs do depends on the
// convolutions' summation order (cuDNN's algorithms, the GPU), so no input can be fixed that is
// flip-free on every machine. Every input must agree within what a flip moves (1e-1; the loss
// and the running statistics are not moved), and at least one, flip-free, within float32
// rounding over ~40 layers (1e-4): a kernel's error moves every input alike. All six flipping
// has a chance of about 0.3^6 (1e-3).
TEST_CASE("one training step of the reduced-width UNet on CUDA equals the CPU step") {
  Setup setup;
  int tight = 0;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    CAPTURE(seed);
    const StepGap gap = unet_step_gap(seed);
    MESSAGE("seed ", seed, ": loss ", gap.loss, ", gradients ", gap.grad, ", Adam updates apart ",
            gap.moved, ", running statistics ", gap.statistics);
    CHECK(gap.loss <= 1e-4);
    CHECK(gap.statistics < 1e-4);
    CHECK(gap.grad < 1e-1);
    if (gap.grad < 1e-4 && gap.moved == 0) ++tight;
  }
  CHECK(tight >= 1);
}

TEST_CASE("the CUDA runtime: device name, allocator statistics, NCCL linked") {
  Setup setup;
  CHECK(!cuda::device_name(0).empty());
  cuda::reset_device_peak(0);
  const size_t before = cuda::device_memory_stats(0).current_bytes;
  {
    Tensor t = Tensor::zeros({1 << 20}, DType::F32, kGpu);  // 4 MiB
    CHECK(cuda::device_memory_stats(0).current_bytes >= before + (size_t(4) << 20));
    CHECK(t.to_vector()[12345] == 0.0);  // zeros overwrote the poison
  }
  CHECK(cuda::device_memory_stats(0).current_bytes == before);
  CHECK(cuda::device_memory_stats(0).peak_bytes >= before + (size_t(4) << 20));
  CHECK(cuda::nccl_version() >= 20000);
  CHECK_THROWS_WITH(Tensor::zeros({1}, DType::F32, Device::cuda(999)), doctest::Contains("does not exist"));
}

TEST_CASE("host code cannot read a CUDA tensor's elements through a pointer, only through copies") {
  // A GPU faults on a host read of device memory; the emulator's device memory is host memory,
  // so the refusal is what keeps such a read from passing here.
  Setup setup;
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor t = Tensor::zeros({2, 3}, dt, kGpu);
    if (dt == DType::F32) {
      CHECK_THROWS_WITH(t.data<float>(), doctest::Contains("host access to the elements of a tensor on cuda:0"));
    } else {
      CHECK_THROWS_WITH(t.data<bf16>(), doctest::Contains("host access to the elements of a tensor on cuda:0"));
    }
    t.set(4, 2.5);  // element access copies, one element each way
    CHECK(t.at(4) == 2.5);
    CHECK(t.to_vector() == std::vector<double>{0, 0, 0, 0, 2.5, 0});
    Tensor host = t.to(Device::cpu());
    CHECK(host.at(4) == 2.5);
    if (dt == DType::F32) CHECK(host.data<float>()[4] == 2.5f);
  }
}

TEST_CASE("data parallelism through NCCL with one GPU rank equals the single-GPU step") {
  Setup setup;
  for (bool sync_bn : {false, true}) {
  CAPTURE(sync_bn);
  FRESH_RNG(rng);
  UNetConfig c;
  c.width_divisor = 8;
  c.seed = 6;
  c.device = kGpu;
  DataParallelOptions o;
  o.devices = {kGpu};
  o.sync_bn = sync_bn;  // one rank: the synchronized kernels against cuDNN's batch norm
  o.first_bucket_bytes = 4096;  // several buckets, each through NCCL
  o.bucket_bytes = 64 << 10;
  DataParallel dp(c, o, make_sgd);
  UNet single(c);
  auto opt = make_sgd(single.parameters());
  for (int step = 0; step < 2; ++step) {
    Batch b{random64({2, 3, 64, 64}, rng, -2, 2).to(DType::F32), Tensor::empty({2, 1, 64, 64})};
    for (int64_t i = 0; i < b.masks.numel(); ++i) b.masks.set(i, rng.uniform() < 0.4);
    const double dp_loss = dp.step({b}, LossKind::BCEDice)[0];
    opt->zero_grad();
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      loss = segmentation_loss(LossKind::BCEDice, single.forward(b.images.to(kGpu)), b.masks.to(kGpu));
    }
    tape.backward(loss);
    opt->step();
    // Same device, an average over one rank, deterministic algorithms (no run-to-run
    // differences): equal up to float32 rounding, which with sync_bn includes two batch-norm
    // implementations through the network.
    const double tol = sync_bn ? 1e-4 : 1e-5;
    CHECK(std::fabs(dp_loss - loss.item()) <= tol * std::fabs(loss.item()));
    const auto pa = dp.replica(0).parameters(), pb = single.parameters();
    for (size_t i = 0; i < pa.size(); ++i) CHECK(rel(pa[i], pb[i]) < tol);
    // The BN running statistics, which data parallelism keeps packed in one buffer: the
    // kernels update them through their slots.
    const auto sa = dp.replica(0).state(), sb = single.state();
    REQUIRE(sa.size() == sb.size());
    for (size_t i = 0; i < sa.size(); ++i)
      if (!sa[i].is_parameter && sa[i].tensor.defined()) CHECK(rel(sa[i].tensor, sb[i].tensor) < tol);
  }
  }
}

// One rank: NCCL's bfloat16 sum of one buffer is the buffer (then divided by 1), so the
// gradients the optimizer sees are the single-GPU step's, rounded once to bfloat16 (u = 2^-8),
// plus float32 noise.
TEST_CASE("bfloat16 all-reduce through NCCL with one GPU rank: the single-GPU gradients rounded once") {
  Setup setup;
  FRESH_RNG(rng);
  UNetConfig c;
  c.width_divisor = 8;
  c.seed = 6;
  c.device = kGpu;
  DataParallelOptions o;
  o.devices = {kGpu};
  o.bf16_allreduce = true;
  o.first_bucket_bytes = 4096;  // several buckets, each through NCCL
  o.bucket_bytes = 64 << 10;
  DataParallel dp(c, o, make_sgd);
  UNet single(c);
  Batch b{random64({2, 3, 64, 64}, rng, -2, 2).to(DType::F32), Tensor::empty({2, 1, 64, 64})};
  for (int64_t i = 0; i < b.masks.numel(); ++i) b.masks.set(i, rng.uniform() < 0.4);
  dp.step({b}, LossKind::BCEDice);
  Tape tape;
  Tensor loss;
  {
    TapeScope s(tape);
    loss = segmentation_loss(LossKind::BCEDice, single.forward(b.images.to(kGpu)), b.masks.to(kGpu));
  }
  tape.backward(loss);
  const auto pa = dp.replica(0).parameters(), pb = single.parameters();
  const double u = std::ldexp(1.0, -8);
  int64_t bad = 0, n = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    const auto got = pa[i].grad().to_vector(), want = pb[i].grad().to_vector();
    double scale = 0;
    for (double w : want) scale = std::max(scale, std::fabs(w));
    for (size_t k = 0; k < got.size(); ++k, ++n) {
      const bool is_bf16 = double(bf16(got[k])) == got[k];
      const bool close = std::fabs(got[k] - want[k]) <= u * std::fabs(want[k]) + 1e-5 * scale;
      bad += !(is_bf16 && close);
    }
  }
  CHECK(n > 1000);
  CHECK(bad == 0);
}

TEST_CASE("two pipeline stages on one GPU (two streams) equal the single-GPU step") {
  Setup setup;
  FRESH_RNG(rng);
  UNetConfig c;
  c.width_divisor = 8;
  c.seed = 7;
  c.device = kGpu;
  for (Schedule sched : {Schedule::GPipe, Schedule::OneFOneB}) {
    CAPTURE(int(sched));
    PipelineOptions o;
    o.devices = {kGpu, kGpu};
    o.cuts = cli::parse_cuts("layer3");
    o.split_size = 2;
    o.schedule = sched;
    // GPipe with gradient clipping: both stages clip by the whole model's norm, read from the
    // stages' streams on the host.
    const double max_norm = sched == Schedule::GPipe ? 0.05 : 0.0;
    auto make = [max_norm](std::vector<Tensor> p) {
      auto opt = make_sgd(std::move(p));
      opt->set_max_grad_norm(max_norm);
      return opt;
    };
    Pipeline pipe(c, o, make);
    UNet single(c);
    auto opt = make(single.parameters());
    for (int step = 0; step < 2; ++step) {
      Batch b{random64({5, 3, 64, 64}, rng, -2, 2).to(DType::F32), Tensor::empty({5, 1, 64, 64})};
      for (int64_t i = 0; i < b.masks.numel(); ++i) b.masks.set(i, rng.uniform() < 0.4);
      const double mp_loss = pipe.step(b, LossKind::BCEDice);
      opt->zero_grad();
      double loss = 0;
      for (int64_t lo = 0; lo < 5; lo += 2) {  // the same micro-batches, accumulated
        const int64_t hi = std::min<int64_t>(lo + 2, 5);
        Tensor x = Tensor::empty({hi - lo, 3, 64, 64}), m = Tensor::empty({hi - lo, 1, 64, 64});
        for (int64_t k = 0; k < x.numel(); ++k) x.set(k, b.images.at(lo * 3 * 64 * 64 + k));
        for (int64_t k = 0; k < m.numel(); ++k) m.set(k, b.masks.at(lo * 64 * 64 + k));
        Tape tape;
        Tensor l;
        {
          TapeScope s(tape);
          l = scale(segmentation_loss(LossKind::BCEDice, single.forward(x.to(kGpu)), m.to(kGpu)),
                    double(hi - lo) / 5);
        }
        loss += l.item();
        tape.backward(l);
      }
      if (max_norm > 0) CHECK(std::sqrt(opt->grad_square_sum().item()) > 10 * max_norm);  // in force
      opt->step();
      // Same kernels and, with one plan per shape and deterministic algorithms, the same
      // algorithms on the same GPU: what remains is float32 rounding where the pipeline adds
      // gradients in another order (a cut tensor's readers' gradients are summed first).
      CHECK(std::fabs(mp_loss - loss) <= 1e-5 * std::fabs(loss));
      const auto pa = pipe.model().parameters(), pb = single.parameters();
      for (size_t i = 0; i < pa.size(); ++i) CHECK(rel(pa[i], pb[i]) < 1e-5);
    }
  }
}

TEST_CASE("deterministic convolutions give the same bits twice, and their choices are kept on disk") {
  Setup setup;
  FRESH_RNG(rng);
  // A shape where cuDNN has atomic backward-filter algorithms to offer.
  const Tensor x64 = random64({8, 32, 40, 40}, rng), w64 = random64({32, 32, 3, 3}, rng);
  const Tensor dy64 = random64({8, 32, 40, 40}, rng);
  std::vector<double> first[3];
  for (int run = 0; run < 2; ++run) {
    Tensor x = gpu(x64).set_requires_grad(true), w = gpu(w64).set_requires_grad(true);
    Tape tape;
    Tensor y;
    {
      TapeScope s(tape);
      y = conv2d(x, w, Tensor(), 1, 1);
    }
    tape.backward({y}, {gpu(dy64)});
    const std::vector<double> now[3] = {y.to_vector(), x.grad().to_vector(), w.grad().to_vector()};
    for (int k = 0; k < 3; ++k) {
      CAPTURE(k);
      if (run == 0)
        first[k] = now[k];
      else
        CHECK(now[k] == first[k]);  // bit for bit
    }
  }
  const std::string path = default_conv_algo_cache_path();
  if (path.empty()) return;  // turned off by the environment
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  ConvAlgoEntries entries;
  std::string error;
  REQUIRE(parse_conv_algo_cache(text.str(), &entries, &error));
  int found = 0;
  for (const auto& [key, choice] : entries)
    if (key.find("x=8x32x40x40 w=32x32x3x3") != std::string::npos &&
        key.find("tf32=0 det=1") != std::string::npos) {
      ++found;
      CHECK(choice.deterministic);
    }
  CHECK(found == 3);  // forward, backward data, backward filter
}

using unetcu::testing::OpenAtExit;
using unetcu::testing::StreamGate;

namespace {

// The on-disk choices of the three directions of the convolutions whose key holds `shape`
// ("x=3x24x20x20 w=24x24x3x3"): how many, and how many of them are provisional.
struct DiskChoices {
  int entries = 0, provisional = 0;
};
DiskChoices disk_choices(const std::string& shape) {
  DiskChoices d;
  const std::string path = default_conv_algo_cache_path();
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  ConvAlgoEntries entries;
  std::string error;
  if (!parse_conv_algo_cache(text.str(), &entries, &error)) return d;
  for (const auto& [key, choice] : entries)
    if (key.find(shape) != std::string::npos) {
      ++d.entries;
      d.provisional += choice.provisional;
    }
  return d;
}

// A forward and backward convolution of x [n, c, s, s] with an o x c 3x3 filter, on cuda:0.
void conv_step(int64_t n, int64_t c, int64_t s, int64_t o) {
  Rng rng(5);
  Tensor x = gpu(random64({n, c, s, s}, rng)).set_requires_grad(true);
  Tensor w = gpu(random64({o, c, 3, 3}, rng)).set_requires_grad(true);
  Tape tape;
  Tensor y;
  {
    TapeScope scope(tape);
    y = conv2d(x, w, Tensor(), 1, 1);
  }
  tape.backward({y}, {gpu(random64(y.shape(), rng))});
  cuda::synchronize(0);
}

}  // namespace

// A search timed beside other work of the process (another stream of the GPU busy: a second
// pipeline stage, NCCL, an upload) is used for the run and kept as provisional; the next
// process, alone on the GPU, searches again and keeps its choice for good; a final choice is
// never replaced by a provisional one.
TEST_CASE("convolution choices searched beside other work are provisional, and searched again alone") {
  Setup setup;
  if (default_conv_algo_cache_path().empty()) return;  // turned off by the environment
  const std::string shape = "x=3x24x20x20 w=24x24x3x3";
  if (disk_choices(shape).entries != 0) {
    MESSAGE("not checked: the algorithm cache (UNETCU_CACHE_DIR) already holds this shape");
    return;
  }
  {
    StreamGate gate;
    cuda::Stream busy(0);
    OpenAtExit open_at_exit{gate};
    gate.hold(busy);
    kernels::cuda::forget_conv_plans();
    conv_step(3, 24, 20, 24);
  }
  DiskChoices d = disk_choices(shape);
  CHECK(d.entries == 3);
  CHECK(d.provisional == 3);
  kernels::cuda::forget_conv_plans();  // a new process, nothing else on the GPU
  int searches = kernels::cuda::conv_searches();
  conv_step(3, 24, 20, 24);
  CHECK(kernels::cuda::conv_searches() == searches + 3);  // each direction searched again
  d = disk_choices(shape);
  CHECK(d.entries == 3);
  CHECK(d.provisional == 0);
  {
    StreamGate gate;
    cuda::Stream busy(0);
    OpenAtExit open_at_exit{gate};
    gate.hold(busy);
    kernels::cuda::forget_conv_plans();  // busy again: the final choices are taken as they are
    searches = kernels::cuda::conv_searches();
    conv_step(3, 24, 20, 24);
    CHECK(kernels::cuda::conv_searches() == searches);
  }
  d = disk_choices(shape);
  CHECK(d.entries == 3);
  CHECK(d.provisional == 0);
}

// A search that got less workspace than the policy's (a quarter of the GPU's memory, at most
// 1 GiB) while an algorithm it could take needed more, because memory was short, is
// provisional too; the directions none of whose algorithms wanted more are final.
TEST_CASE("convolution choices searched with memory short of the workspace policy are provisional") {
  Setup setup;
  if (default_conv_algo_cache_path().empty()) return;
#ifdef UNETCU_CUDA_EMU
  const std::string shape = "x=1x64x128x128 w=8x64x3x3";
  if (disk_choices(shape).entries != 0) {
    MESSAGE("not checked: the algorithm cache (UNETCU_CACHE_DIR) already holds this shape");
    return;
  }
  conv_step(1, 8, 8, 8);  // the GPU's properties read at its full size: the policy is 1 GiB
  {
    // An emulated GPU of 96 MiB: the search gets under 24 MiB. The deterministic algorithms
    // with an im2col buffer (forward GEMM, backward-filter 1) want 4 * 576 * 16384 = 37.7 MB
    // at this shape; backward data's deterministic ones want at most a small table.
    const EnvScope small("UNETCU_EMU_DEVICE_MEMORY", std::to_string(size_t(96) << 20).c_str());
    cuda::release_device_cache(0);  // what earlier cases of this process left cached
    kernels::cuda::forget_conv_plans();
    conv_step(1, 64, 128, 8);
  }
  DiskChoices d = disk_choices(shape);
  CHECK(d.entries == 3);
  CHECK(d.provisional == 2);
  kernels::cuda::forget_conv_plans();
  conv_step(1, 64, 128, 8);
  d = disk_choices(shape);
  CHECK(d.entries == 3);
  CHECK(d.provisional == 0);
#else
  MESSAGE("the emulated GPU's memory is what this case shrinks; a real GPU's is not");
#endif
}

TEST_CASE("the caching allocator hands a block to another stream, or the host, only after its work") {
  Setup setup;
  StreamGate gate;  // outlives the streams: their destructors wait for the host function
  cuda::Stream a(0), b(0);
  OpenAtExit open_at_exit{gate};
  cuda::release_device_cache(0);  // no earlier block of these sizes
  const int64_t n = (int64_t(1) << 18) + 777;  // an unusual size: ~1 MiB
  gate.hold(a);
  void* freed = nullptr;
  {
    cuda::StreamScope on_a(a);
    Tensor t = Tensor::zeros({n}, DType::F32, kGpu);  // zeroed on a, behind the gate
    freed = t.raw();
  }
  Tensor kept;
  {
    cuda::StreamScope on_b(b);
    kept = Tensor::empty({n}, DType::F32, kGpu);
    CHECK(kept.raw() != freed);  // a has not reached the free yet
  }
  {
    cuda::StreamScope on_a(a);
    Tensor same_stream = Tensor::empty({n}, DType::F32, kGpu);
    CHECK(same_stream.raw() == freed);  // stream order makes it safe on a itself
  }
  gate.open = true;
  CUDA_CHECK(cudaStreamSynchronize(a.get()));
  {
    cuda::StreamScope on_b(b);
    Tensor later = Tensor::empty({n}, DType::F32, kGpu);
    CHECK(later.raw() == freed);  // a is past it now
  }

  // Pinned memory read by an asynchronous upload is not rewritten by the host before it ran.
  gate.open = false;
  gate.hold(a);
  const int64_t m = (int64_t(1) << 16) + 333;
  void* pinned = nullptr;
  Tensor uploaded;
  {
    Tensor host = Tensor::empty_pinned({m});
    for (int64_t i = 0; i < m; ++i) host.set(i, double(i % 97));
    pinned = host.raw();
    cuda::StreamScope on_a(a);
    uploaded = host.to(kGpu);  // queued on a behind the gate; host is freed at the brace
  }
  {
    Tensor next = Tensor::empty_pinned({m});
    CHECK(next.raw() != pinned);
    for (int64_t i = 0; i < m; ++i) next.set(i, -1.0);  // would corrupt the pending upload
  }
  gate.open = true;
  CUDA_CHECK(cudaStreamSynchronize(a.get()));
  const std::vector<double> got = uploaded.to_vector();
  int wrong = 0;
  for (int64_t i = 0; i < m; ++i) wrong += got[size_t(i)] != double(i % 97);
  CHECK(wrong == 0);
}

TEST_CASE("an upload runs beside the compute stream's work, and the work queued after it waits for it") {
  Setup setup;  // poisoned allocations: a read before the copy lands sees NaN
  StreamGate compute_gate, upload_gate;  // outlive the streams (their host functions)
  cuda::Stream compute(0);
  OpenAtExit open_compute{compute_gate}, open_upload{upload_gate};
  cuda::StreamScope on_compute(compute);  // this thread's current stream: the consumer
  const int64_t n = (int64_t(1) << 16) + 5;
  Tensor host = Tensor::empty_pinned({n});
  for (int64_t i = 0; i < n; ++i) host.set(i, double(i % 89));
  auto wrong_in = [&](const std::vector<double>& got) {
    int wrong = 0;
    for (int64_t i = 0; i < n; ++i) wrong += got[size_t(i)] != double(i % 89);
    return wrong;
  };

  // Beside: with the compute stream held, the upload still lands. (Read on a third stream,
  // which nothing orders after the compute stream.)
  compute_gate.hold(compute);
  const Tensor beside = host.upload_to(kGpu);
  {
    cuda::Stream reader(0);
    cuda::StreamScope on_reader(reader);
    CUDA_CHECK(cudaStreamSynchronize(cuda::upload_stream(0).get()));
    CHECK(wrong_in(beside.to(Device::cpu()).to_vector()) == 0);
  }
  compute_gate.open = true;

  // After: with the upload stream held, the compute stream's next work (a copy back to the
  // host, which returns once it ran) waits for the upload instead of reading the block first.
  upload_gate.hold(cuda::upload_stream(0));
  const Tensor after = host.upload_to(kGpu);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    upload_gate.open = true;
  });
  const std::vector<double> got = after.to(Device::cpu()).to_vector();
  opener.join();
  CHECK(wrong_in(got) == 0);
}

TEST_CASE("convolutions on two streams of one GPU at once use their own cuDNN handles") {
  Setup setup;
  FRESH_RNG(rng);
  const Tensor x64 = random64({4, 16, 24, 24}, rng), w64 = random64({16, 16, 3, 3}, rng);
  const Tensor want = conv2d(gpu(x64), gpu(w64), Tensor(), 1, 1);
  cuda::Stream s0(0), s1(0);
  std::vector<double> got[2];
  std::string errors[2];
  std::thread threads[2];
  for (int k = 0; k < 2; ++k)
    threads[k] = std::thread([&, k] {
      try {
        cuda::StreamScope on(k ? s1 : s0);
        for (int rep = 0; rep < 20; ++rep) {
          Tensor y = conv2d(gpu(x64), gpu(w64), Tensor(), 1, 1);
          if (rep == 19) got[k] = y.to_vector();
        }
      } catch (const std::exception& e) {
        errors[k] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
  CHECK(got[0] == want.to_vector());  // the same plan and algorithm: the same bits
  CHECK(got[1] == want.to_vector());
}

TEST_CASE("the step loss read a step late equals the loss read at once, and a copy waits for its producer's event") {
  Setup setup;
  FRESH_RNG(rng);
  UNetConfig c;
  c.width_divisor = 8;
  c.seed = 6;
  c.device = kGpu;
  SingleDeviceStrategy now(c, {}, optimizer_factory({}), LossKind::BCEDice);
  SingleDeviceStrategy late(c, {}, optimizer_factory({}), LossKind::BCEDice);
  Batch b{random64({2, 3, 64, 64}, rng, -2, 2).to(DType::F32), Tensor::empty({2, 1, 64, 64})};
  for (int64_t i = 0; i < b.masks.numel(); ++i) b.masks.set(i, rng.uniform() < 0.4);
  const PlacedBatch pn = now.place(b), pl = late.place(b);
  // Two steps queued before the first loss is read, as the epoch loop does; deterministic
  // kernels on the same device: the same bits.
  StepLoss first = late.step_async(pl);
  StepLoss second = late.step_async(pl);
  CHECK(first.get() == now.step(pn));
  CHECK(second.get() == now.step(pn));

  // A producer on its own stream, the copy on this thread's stream ordered only by the
  // producer's event: it sees the finished values.
  cuda::Stream producer(0);
  Tensor src, copy;
  cuda::Event made;
  {
    cuda::StreamScope scope(producer);
    src = Tensor::full({1 << 20}, 3.0, DType::F32, kGpu);
    for (int k = 0; k < 20; ++k) src = add(src, src);  // long enough to still run when copied
    made = cuda::Event::record(0);
  }
  copy = src.to_after(kGpu, made);
  const std::vector<double> v = copy.to(Device::cpu()).to_vector();
  CHECK(v.front() == 3.0 * (1 << 20));
  CHECK(v.back() == 3.0 * (1 << 20));
}
