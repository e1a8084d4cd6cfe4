// On a GPU: relu, sigmoid, add, scale, max_pool2d, upsample_nearest2x, concat_channels,
// upsample_nearest2x_concat and the losses in bfloat16 and NHWC equal the CPU op in the same
// dtype and format (the CPU ops are held to NCHW/float32 in tests/test_misc_layout.cpp), on the
// same inputs, forward and over two backward passes (the second accumulates).
//
// Exact where both backends do the same float32 operations in the same order: copies and
// maxima (forward), the 2×2 and concat gradients, the max-pool gradient written and accumulated
// (the CUDA gather adds a window's gradients onto grad_x's value in the CPU scatter's order,
// channel by channel also where it moves packs of channels).
// Elsewhere each backend's float32 value differs by float32 roundings only (CUDA contracts
// a*b + c into an FMA, its exp/log1p are not the CPU's), and a bfloat16 store rounds each, so
// the two stored values are at most one bfloat16 step apart: |gpu - cpu| <= 2u |cpu|
// (u = 2^-8). A value stored on top of an earlier stored one (the accumulating pass, the
// second loss of BCE + Dice) inherits that one's step: 2u |earlier| more. A float32-level
// 2^-20 of the tensor's largest element covers sums that cancel; float32 results are held to
// 2^-20 relative and that absolute term.
// Device blocks are poisoned with NaN, so an element a kernel forgets to write fails; the large
// cases exceed one grid-stride pass (4096 blocks of 256 threads), the packed ones in packs.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "engine/ops.h"
#include "engine/random.h"
#include "engine/tape.h"
#include "kernels/launchers.h"
#include "runtime/cuda_api.h"

using namespace unetcu;

namespace {

const Device kGpu = Device::cuda(0);
constexpr MemoryFormat kNCHW = MemoryFormat::NCHW, kNHWC = MemoryFormat::NHWC;

using Op = std::function<Tensor(const std::vector<Tensor>&)>;

Tensor random_host(const Shape& s, Rng& rng, DType dt, MemoryFormat fmt, double lo = -1,
                   double hi = 1) {
  Tensor t = Tensor::empty(s, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.uniform(lo, hi));
  Tensor r = t.to(dt);
  return s.size() == 4 ? r.to(fmt) : r;
}

// |t| per element, in logical order.
std::vector<double> magnitudes(const Tensor& t) {
  std::vector<double> m = t.to_vector();
  for (double& v : m) v = std::fabs(v);
  return m;
}

// The GPU result against the CPU one: same dims, dtype and format; equal values (a NaN
// matching a NaN), or within the bound above, earlier[i] the magnitude of what element i was
// stored on top of (empty: nothing).
void check_agree(const Tensor& gpu, const Tensor& cpu, bool exact,
                 const std::vector<double>& earlier = {}) {
  REQUIRE(gpu.device() == kGpu);
  const Tensor h = gpu.to(Device::cpu());
  REQUIRE(h.shape() == cpu.shape());
  CHECK(h.dtype() == cpu.dtype());
  CHECK(h.format() == cpu.format());
  const std::vector<double> a = h.to_vector(), b = cpu.to_vector();
  double scale = 0;
  for (double v : b)
    if (std::isfinite(v)) scale = std::max(scale, std::fabs(v));
  const double rel = cpu.dtype() == DType::BF16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -20);
  const double abs = std::ldexp(scale, -20);
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      bad += !(std::isnan(a[i]) && std::isnan(b[i]));
      continue;
    }
    const double bound = rel * (std::fabs(b[i]) + (earlier.empty() ? 0.0 : earlier[i])) + abs;
    if (exact ? a[i] != b[i] : std::fabs(a[i] - b[i]) > bound) ++bad;
  }
  CHECK(bad == 0);
}

struct Case {
  const char* name;
  Op op;
  std::vector<Shape> shapes;
  std::vector<bool> needs_grad;
  bool exact_y, exact_grad1, exact_grad2;
  double lo = -1, hi = 1;
  Tensor fixed = Tensor();  // when defined, the first input (float64), instead of random values
};

void check_case(const Case& c, DType dt, MemoryFormat fmt, Rng& rng) {
  const std::string name = c.name;
  CAPTURE(name);
  CAPTURE(std::string(dtype_name(dt)));
  CAPTURE(std::string(format_name(fmt)));
  std::vector<Tensor> cpu_in, gpu_in;
  for (size_t i = 0; i < c.shapes.size(); ++i) {
    Tensor x = i == 0 && c.fixed.defined()
                   ? c.fixed.to(dt).to(fmt)
                   : random_host(c.shapes[i], rng, dt, fmt, c.lo, c.hi);
    cpu_in.push_back(x.clone().set_requires_grad(c.needs_grad[i]));
    gpu_in.push_back(x.to(kGpu).set_requires_grad(c.needs_grad[i]));
  }
  Tensor g[2];
  std::vector<std::vector<double>> first(cpu_in.size());  // |CPU gradient| after pass 0
  for (int pass = 0; pass < 2; ++pass) {
    CAPTURE(pass);
    Tape tc, tg;
    Tensor yc, yg;
    {
      TapeScope s(tc);
      yc = c.op(cpu_in);
    }
    {
      TapeScope s(tg);
      yg = c.op(gpu_in);
    }
    if (pass == 0) check_agree(yg, yc, c.exact_y);
    if (!g[pass].defined()) g[pass] = random_host(yc.shape(), rng, yc.dtype(), yc.format());
    tc.backward({yc}, {g[pass]});
    tg.backward({yg}, {g[pass].to(kGpu)});
    for (size_t i = 0; i < cpu_in.size(); ++i) {
      if (!c.needs_grad[i]) continue;
      CAPTURE(i);
      const Tensor gc = cpu_in[i].grad();
      if (pass == 0) {
        check_agree(gpu_in[i].grad(), gc, c.exact_grad1);
        first[i] = magnitudes(gc);
      } else {
        check_agree(gpu_in[i].grad(), gc, c.exact_grad2, first[i]);
      }
    }
  }
}

struct Setup {
  Setup() {
    cuda::set_poison_allocations(true);
    cuda::set_deterministic(true);
  }
};

Op pool(Pool2dOptions o) {
  return [o](const std::vector<Tensor>& v) { return max_pool2d(v[0], o); };
}

}  // namespace

TEST_CASE("CUDA misc ops in bfloat16 and NHWC equal the CPU ops in the same dtype and format") {
  Setup setup;
  Rng rng(211);
  const Shape s{2, 5, 13, 11}, s16{2, 16, 4, 3};
  Tensor ties = Tensor::empty({2, 3, 9, 11}, DType::F64);
  for (int64_t i = 0; i < ties.numel(); ++i) ties.set(i, double(rng.below(3)));
  ties.set(4 * 11 + 5, NAN);
  ties.set(99 + 8 * 11 + 10, NAN);
  // The same in 16 channels, where NHWC holds whole packs: NaNs in several channels of one
  // pack, next to ties.
  Tensor ties16 = Tensor::empty({2, 16, 9, 11}, DType::F64);
  for (int64_t i = 0; i < ties16.numel(); ++i) ties16.set(i, double(rng.below(3)));
  for (int64_t c : {0, 3, 7, 8, 15}) ties16.set((c * 9 + 4) * 11 + 5, NAN);
  ties16.set(((16 + 9) * 9 + 8) * 11 + 10, NAN);
  const Op up_cat = [](const std::vector<Tensor>& v) { return upsample_nearest2x_concat(v[0], v[1]); };
  std::vector<Case> cases = {
      {"relu", [](const std::vector<Tensor>& v) { return relu(v[0]); }, {s}, {true}, true, true, true},
      {"sigmoid", [](const std::vector<Tensor>& v) { return sigmoid(v[0]); }, {s}, {true}, false,
       false, false, -6, 6},
      {"add", [](const std::vector<Tensor>& v) { return add(v[0], v[1]); }, {s, s}, {true, true},
       false, true, true},
      {"scale", [](const std::vector<Tensor>& v) { return scale(v[0], -1.5); }, {s}, {true}, false,
       false, false},
      {"max_pool2d 3x3/2 pad 1", pool(Pool2dOptions::square(3, 2, 1)), {s}, {true}, true, true, true},
      {"max_pool2d 2x3/(1,2) pad (1,1)", pool(Pool2dOptions{2, 3, 1, 2, 1, 1}), {s}, {true}, true,
       true, true},
      {"max_pool2d ties and NaN", pool(Pool2dOptions::square(3, 2, 1)), {ties.shape()}, {true}, true,
       true, true, -1, 1, ties},
      {"max_pool2d 70 channels", pool(Pool2dOptions::square(3, 2, 1)), {{2, 70, 6, 5}}, {true},
       true, true, true},
      {"max_pool2d large", pool(Pool2dOptions::square(3, 2, 1)), {{4, 64, 64, 72}}, {true}, true,
       true, true},
      // 70 channels take no packs: the scalar NHWC kernel past one grid-stride pass backward.
      {"max_pool2d large, 70 channels", pool(Pool2dOptions::square(3, 2, 1)), {{4, 70, 64, 72}},
       {true}, true, true, true},
      {"upsample_nearest2x", [](const std::vector<Tensor>& v) { return upsample_nearest2x(v[0]); },
       {s}, {true}, true, true, true},
      {"concat_channels",
       [](const std::vector<Tensor>& v) { return concat_channels({v[0], v[1], v[2]}); },
       {{2, 3, 7, 5}, {2, 1, 7, 5}, {2, 4, 7, 5}}, {true, false, true}, true, true, true},
      {"upsample_nearest2x_concat", up_cat, {{2, 3, 5, 7}, {2, 2, 10, 14}}, {true, true}, true,
       true, true},
      {"upsample_nearest2x_concat, x only", up_cat, {{2, 3, 5, 7}, {2, 2, 10, 14}}, {true, false},
       true, true, true},
      {"upsample_nearest2x_concat, skip only", up_cat, {{2, 3, 5, 7}, {2, 2, 10, 14}},
       {false, true}, true, true, true},
      {"upsample_nearest2x_concat large", up_cat, {{2, 64, 64, 64}, {2, 64, 128, 128}},
       {true, true}, true, true, true},
      // Element counts, channel counts and concat offsets that hold whole 16-byte packs, so
      // the kernels move 8 bf16 or 4 floats a thread access (kernels/cuda/elementwise.cu,
      // resample.cu); of the cases above only the large ones (and float32 concat's third
      // input) do.
      {"relu 16 channels", [](const std::vector<Tensor>& v) { return relu(v[0]); }, {s16}, {true},
       true, true, true},
      {"sigmoid 16 channels", [](const std::vector<Tensor>& v) { return sigmoid(v[0]); }, {s16},
       {true}, false, false, false, -6, 6},
      {"add 16 channels", [](const std::vector<Tensor>& v) { return add(v[0], v[1]); },
       {s16, s16}, {true, true}, false, true, true},
      {"scale 16 channels", [](const std::vector<Tensor>& v) { return scale(v[0], -1.5); }, {s16},
       {true}, false, false, false},
      {"upsample_nearest2x 16 channels",
       [](const std::vector<Tensor>& v) { return upsample_nearest2x(v[0]); }, {{2, 16, 5, 7}},
       {true}, true, true, true},
      {"concat_channels 8, 16, 8 channels",
       [](const std::vector<Tensor>& v) { return concat_channels({v[0], v[1], v[2]}); },
       {{2, 8, 5, 3}, {2, 16, 5, 3}, {2, 8, 5, 3}}, {true, false, true}, true, true, true},
      {"upsample_nearest2x_concat 24 + 8 channels", up_cat, {{2, 24, 3, 5}, {2, 8, 6, 10}},
       {true, true}, true, true, true},
      {"upsample_nearest2x_concat 24 + 8 channels, x only", up_cat,
       {{2, 24, 3, 5}, {2, 8, 6, 10}}, {true, false}, true, true, true},
      {"upsample_nearest2x_concat 24 + 8 channels, skip only", up_cat,
       {{2, 24, 3, 5}, {2, 8, 6, 10}}, {false, true}, true, true, true},
      {"max_pool2d 3x3/2 pad 1, 16 channels", pool(Pool2dOptions::square(3, 2, 1)),
       {{2, 16, 13, 11}}, {true}, true, true, true},
      {"max_pool2d 2x3/(1,2) pad (1,1), 16 channels", pool(Pool2dOptions{2, 3, 1, 2, 1, 1}),
       {{2, 16, 7, 6}}, {true}, true, true, true},
      {"max_pool2d ties and NaN, 16 channels", pool(Pool2dOptions::square(3, 2, 1)),
       {ties16.shape()}, {true}, true, true, true, -1, 1, ties16},
      // Packs past one grid-stride pass: 1.1 M bf16 packs of grad_x.
      {"max_pool2d packs large", pool(Pool2dOptions::square(3, 2, 1)), {{2, 64, 256, 272}},
       {true}, true, true, true},
      // Packs past one grid-stride pass: 2^21 bf16 packs forward, 1.3 M backward.
      {"upsample_nearest2x_concat packs large", up_cat, {{1, 128, 128, 128}, {1, 128, 256, 256}},
       {true, true}, true, true, true},
  };
  for (const Case& c : cases)
    for (DType dt : {DType::BF16, DType::F32})
      for (MemoryFormat fmt : {kNHWC, kNCHW}) {
        if (dt == DType::F32 && fmt == kNCHW) continue;  // tests/cuda/test_cuda_ops.cpp
        check_case(c, dt, fmt, rng);
      }
}

TEST_CASE("CUDA losses on bfloat16 and NHWC logits equal the CPU losses") {
  Setup setup;
  Rng rng(212);
  for (const Shape& s : {Shape{3, 1, 40, 37}, Shape{2, 3, 9, 10}})
    for (DType dt : {DType::BF16, DType::F32})
      for (MemoryFormat lf : {kNHWC, kNCHW})
        for (MemoryFormat tf : {kNHWC, kNCHW})
          for (DType tdt : {DType::F32, dt}) {
            CAPTURE(s[1]);
            CAPTURE(std::string(dtype_name(dt)));
            CAPTURE(std::string(format_name(lf)));
            CAPTURE(std::string(format_name(tf)));
            CAPTURE(std::string(dtype_name(tdt)));
            // One channel: 0/1; three: class indices [N, 1, H, W]; one pixel in ten ignored.
            Tensor t = Tensor::empty({s[0], 1, s[2], s[3]}, DType::F64);
            for (int64_t i = 0; i < t.numel(); ++i) {
              const double u = rng.uniform();
              t.set(i, u < 0.1 ? -1.0 : s[1] == 1 ? (u < 0.4 ? 1.0 : 0.0) : double(int64_t(rng.uniform() * 3)));
            }
            const Tensor tc = t.to(tdt).to(tf), tg = tc.to(kGpu);
            const Tensor x = random_host(s, rng, dt, lf, -8, 8);
            // BCE + Dice stores the second loss's gradient on the first's: their CPU
            // gradients bound what it was stored on.
            std::vector<double> parts(x.numel(), 0.0);
            for (LossKind k : {LossKind::BCE, LossKind::Dice}) {
              Tensor xk = x.clone().set_requires_grad(true);
              Tape tape;
              Tensor l;
              {
                TapeScope sc(tape);
                l = segmentation_loss(k, xk, tc);
              }
              tape.backward(l);
              const std::vector<double> m = magnitudes(xk.grad());
              for (size_t i = 0; i < m.size(); ++i) parts[i] += m[i];
            }
            for (LossKind k : {LossKind::BCE, LossKind::Dice, LossKind::BCEDice}) {
              CAPTURE(loss_kind_name(k));
              Tensor xc = x.clone().set_requires_grad(true), xg = x.to(kGpu).set_requires_grad(true);
              std::vector<double> earlier =
                  k == LossKind::BCEDice ? parts : std::vector<double>(x.numel(), 0.0);
              for (int pass = 0; pass < 2; ++pass) {
                CAPTURE(pass);
                Tape tpc, tpg;
                Tensor lc, lg;
                {
                  TapeScope sc(tpc);
                  lc = segmentation_loss(k, xc, tc);
                }
                {
                  TapeScope sc(tpg);
                  lg = segmentation_loss(k, xg, tg);
                }
                CHECK(lg.dtype() == DType::F32);
                const double vc = lc.item(), vg = lg.to(Device::cpu()).item();
                // float64 sums of float32 terms that differ by a few float32 ulps.
                CHECK(std::fabs(vg - vc) <= 1e-5 * std::fabs(vc));
                tpc.backward(lc);
                tpg.backward(lg);
                check_agree(xg.grad(), xc.grad(), false, earlier);
                const std::vector<double> m = magnitudes(xc.grad());
                for (size_t i = 0; i < m.size(); ++i) earlier[i] += m[i];
              }
            }
          }
}

// The packed kernels (kernels/cuda/common.cuh) take a 16-byte pack per access only where every
// pointer is aligned to one; a GPU faults on a misaligned vector access and the emulator stops
// the run there. Tensors one element past an aligned address, whose channel counts would allow
// packs, go through the launchers one value at a time and give what the aligned tensors give:
// the same bits for the elementwise passes, the batch-norm statistics within float32 rounding
// (their partial sums group otherwise).
TEST_CASE("CUDA packed kernels take one value at a time on tensors not aligned to a pack") {
  Setup setup;
  Rng rng(213);
  namespace kc = kernels::cuda;
  for (DType dt : {DType::BF16, DType::F32}) {
    CAPTURE(std::string(dtype_name(dt)));
    const int64_t es = int64_t(dtype_size(dt));
    // A flat device buffer holding values[first, first + numel) at its start (aligned) or one
    // element in (misaligned), and the 4-dimensional NHWC view of those values.
    struct Buffer {
      Tensor flat;
      TensorRef view;
    };
    auto buffer = [&](const std::vector<double>& values, const Shape& shape, bool misaligned) {
      std::vector<double> v(values);
      if (misaligned) v.insert(v.begin(), 0.0);
      Buffer b{Tensor::from_vector({int64_t(v.size())}, v, DType::F64).to(dt).to(kGpu), {}};
      b.view = TensorRef(static_cast<char*>(b.flat.raw()) + (misaligned ? es : 0), dt, kGpu,
                         shape, kNHWC);
      return b;
    };
    auto values_of = [](const Buffer& b, bool misaligned) {
      std::vector<double> v = b.flat.to(Device::cpu()).to_vector();
      if (misaligned) v.erase(v.begin());
      return v;
    };
    auto random_values = [&](int64_t n) {
      std::vector<double> v(static_cast<size_t>(n));
      for (double& e : v) e = double(float(kernels::bf16(float(rng.uniform(-2, 2)))));
      return v;
    };
    const Shape s{2, 16, 3, 5};
    const int64_t n = shape_numel(s), C = s[1];
    const std::vector<double> xv = random_values(n), rv = random_values(n), zero(size_t(n), 0.0);
    std::vector<std::vector<double>> relu_out, bn_out;
    std::vector<std::vector<double>> stats;
    Tensor mean_a, invstd_a;
    for (bool mis : {false, true}) {
      CAPTURE(mis);
      const Buffer x = buffer(xv, s, mis), r = buffer(rv, s, mis);
      const Buffer y = buffer(zero, s, mis), y2 = buffer(zero, s, mis);
      kc::relu_forward(x.view, y.view);
      relu_out.push_back(values_of(y, mis));
      Tensor mean = Tensor::zeros({C}, DType::F32, kGpu), invstd = Tensor::zeros({C}, DType::F32, kGpu);
      Tensor rm = Tensor::zeros({C}, DType::F32, kGpu), rvar = Tensor::full({C}, 1.0, DType::F32, kGpu);
      kc::batchnorm_stats(x.view, mean, invstd, rm, rvar, 0.1, 1e-5);
      std::vector<double> st = mean.to(Device::cpu()).to_vector();
      for (double e : invstd.to(Device::cpu()).to_vector()) st.push_back(e);
      for (double e : rvar.to(Device::cpu()).to_vector()) st.push_back(e);
      stats.push_back(st);
      if (!mis) {
        mean_a = mean;
        invstd_a = invstd;
      }
      const Tensor gamma = Tensor::full({C}, 1.5, DType::F32, kGpu);
      const Tensor beta = Tensor::full({C}, -0.25, DType::F32, kGpu);
      kc::batchnorm_add_relu_forward(x.view, gamma, beta, mean_a, invstd_a, r.view, y2.view);
      bn_out.push_back(values_of(y2, mis));
    }
    CHECK(relu_out[0] == relu_out[1]);
    CHECK(bn_out[0] == bn_out[1]);
    REQUIRE(stats[0].size() == stats[1].size());
    for (size_t i = 0; i < stats[0].size(); ++i) {
      CAPTURE(i);
      CHECK(std::fabs(stats[1][i] - stats[0][i]) <= 1e-6 * std::fabs(stats[0][i]) + 1e-7);
    }
    // Upsample into the concat buffer with only x misaligned: every pointer is checked.
    const Shape xs{1, 16, 2, 3}, ss{1, 8, 4, 6}, ys{1, 24, 4, 6};
    const std::vector<double> ux = random_values(shape_numel(xs)), us = random_values(shape_numel(ss));
    std::vector<std::vector<double>> cat_out;
    for (bool mis : {false, true}) {
      const Buffer x = buffer(ux, xs, mis), sk = buffer(us, ss, false);
      const Buffer y = buffer(std::vector<double>(size_t(shape_numel(ys)), 0.0), ys, false);
      kc::upsample2x_concat_forward(x.view, sk.view, y.view);
      cat_out.push_back(values_of(y, false));
    }
    CHECK(cat_out[0] == cat_out[1]);
    // Max pooling with x, then grad_y, then grad_x (accumulated onto), then y misaligned in
    // turn.
    const Shape ps{2, 16, 5, 6}, pys{2, 16, 3, 3};
    const kernels::PoolGeometry pg{5, 6, 3, 3, 3, 3, 2, 2, 1, 1};
    const std::vector<double> px = random_values(shape_numel(ps)), pgy = random_values(shape_numel(pys));
    const std::vector<double> pgx = random_values(shape_numel(ps));
    std::vector<std::vector<double>> pool_y, pool_gx;
    for (int mis = 0; mis < 5; ++mis) {  // 0: all aligned, else the one misaligned
      CAPTURE(mis);
      const Buffer x = buffer(px, ps, mis == 1), gy = buffer(pgy, pys, mis == 2);
      const Buffer gx = buffer(pgx, ps, mis == 3);
      const Buffer y = buffer(std::vector<double>(pgy.size()), pys, mis == 4);
      kc::maxpool_forward(x.view, y.view, pg);
      pool_y.push_back(values_of(y, mis == 4));
      kc::maxpool_backward(gy.view, x.view, gx.view, 1.0, pg);
      pool_gx.push_back(values_of(gx, mis == 3));
    }
    for (int mis = 1; mis < 5; ++mis) {
      CHECK(pool_y[size_t(mis)] == pool_y[0]);
      CHECK(pool_gx[size_t(mis)] == pool_gx[0]);
    }
  }
}
