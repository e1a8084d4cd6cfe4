// On a GPU: the batch-norm ops (batch_norm2d, batch_norm_relu, batch_norm_add_relu and the
// synchronized batch_norm2d, which between them run every batch-norm launcher) in float32 and
// bfloat16, NCHW and NHWC, equal the CPU float64 ops on the same inputs, forward and backward
// over two backward passes (the second accumulates, beta = 1), training and eval.
//
// The inputs are bf16-representable (activations and the output gradient) and
// float32-representable (per-channel tensors), so every variant reads the same values:
//  - float32: ‖cuda − cpu‖ / ‖cpu‖ < 1e-5 (float32 arithmetic, double sums), as
//    tests/cuda/test_cuda_ops.cpp.
//  - bfloat16: each stored element within its rounding bound of the float64 value, u = 2^-8
//    (8 significant bits): y within u |y|; grad_x and the residual's gradient after two
//    passes within (1.5u + u²/2) |g| (pass 1 stores bf16(v), pass 2 bf16(bf16(v) + v)); each
//    bound plus 1e-5 of the tensor's largest value for the float32 arithmetic before the
//    rounding. The statistics and dgamma/dbeta are float32: 1e-5 relative.
// Shapes include planes of several reduction blocks, more than one NHWC channel group with a
// partial last one, odd sizes, and many blocks per channel: NCHW [16, 4, 128, 128] (128
// partials a channel), NHWC [9, 64, 128, 128] (576 float32 or 288 bf16 chunks a channel).
// Device blocks are poisoned with NaN, so an element a kernel forgets to write fails.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "../bn_mask_check.h"
#include "../bn_ops.h"
#include "engine/ops.h"
#include "engine/random.h"
#include "engine/tape.h"
#include "runtime/cuda_api.h"

using namespace unetcu;
using namespace unetcu::testing_bn;

namespace {

const Device kGpu = Device::cuda(0);
constexpr double kU = 0x1p-8;  // bf16 unit roundoff

Tensor random_values(const Shape& s, Rng& rng, double lo, double hi, bool bf16_values) {
  std::vector<double> v(size_t(shape_numel(s)));
  for (double& e : v) {
    const float f = float(rng.uniform(lo, hi));
    e = bf16_values ? double(float(bf16(f))) : double(f);
  }
  return Tensor::from_vector(s, v, DType::F64);
}

// CPU float64 NCHW: activations bf16 values, per-channel tensors float32 values.
Inputs make_inputs(const Shape& s, Rng& rng) {
  const int64_t C = s[1];
  Inputs in;
  in.x = random_values(s, rng, -2, 3, true);
  in.gamma = random_values({C}, rng, 0.5, 1.5, false);
  in.beta = random_values({C}, rng, -0.5, 0.5, false);
  in.residual = random_values(s, rng, -1, 1, true);
  in.rm = random_values({C}, rng, -1, 1, false);
  in.rv = random_values({C}, rng, 0.5, 2, false);
  in.R = random_values(s, rng, -1, 1, true);
  return in;
}

// The inputs on the GPU with activations of dtype `act` in format `fmt`; per-channel tensors
// float32.
Inputs to_gpu(const Inputs& in, DType act, MemoryFormat fmt) {
  Inputs o;
  for (auto [dst, src] : {std::pair{&o.x, &in.x}, {&o.residual, &in.residual}, {&o.R, &in.R}})
    *dst = src->to(act).to(fmt).to(kGpu);
  for (auto [dst, src] : {std::pair{&o.gamma, &in.gamma}, {&o.beta, &in.beta}, {&o.rm, &in.rm},
                          {&o.rv, &in.rv}})
    *dst = src->to(DType::F32).to(kGpu);
  return o;
}

void avoid_kinks(Inputs& in, bool training, bool with_residual) {
  Tensor rm = in.rm.clone(), rv = in.rv.clone();
  const Tensor pre = batch_norm2d(in.x, in.gamma, in.beta, rm, rv, training, 0.1, 1e-5);
  Tensor& moved = with_residual ? in.residual : in.x;
  std::vector<double> p = pre.to_vector(), m = moved.to_vector();
  const std::vector<double> r = with_residual ? in.residual.to_vector() : std::vector<double>();
  for (size_t i = 0; i < p.size(); ++i) {
    const double v = p[i] + (with_residual ? r[i] : 0.0);
    if (std::fabs(v) < 1e-3) m[i] = double(float(bf16(float(m[i] + (v < 0 ? -0.05 : 0.05)))));
  }
  moved = Tensor::from_vector(moved.shape(), m, DType::F64);
}

double rel(const Tensor& got, const Tensor& want) {
  const std::vector<double> a = got.to_vector(), b = want.to_vector();
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;  // unwritten (poisoned) or overflowed
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Every element within rel_bound |want| + 1e-5 max |want|; false on a non-finite element.
bool within_rounding(const Tensor& got, const Tensor& want, double rel_bound) {
  const std::vector<double> a = got.to_vector(), b = want.to_vector();
  REQUIRE(a.size() == b.size());
  double scale = 0;
  for (double v : b) scale = std::max(scale, std::fabs(v));
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (!std::isfinite(a[i]) || std::fabs(a[i] - b[i]) > rel_bound * std::fabs(b[i]) + 1e-5 * scale) {
      if (bad++ == 0) first = i;
    }
  if (bad) {
    INFO(bad, " elements outside the bound; the first (logical index ", first, "): ", a[first],
         " against ", b[first]);
    CHECK(bad == 0);
  }
  return bad == 0;
}

void compare(const Result& g, const Result& c, DType act, bool with_residual) {
  CHECK(g.y.device() == kGpu);
  CHECK(rel(g.rm, c.rm) < 1e-5);
  CHECK(rel(g.rv, c.rv) < 1e-5);
  CHECK(rel(g.ggamma, c.ggamma) < 1e-5);
  CHECK(rel(g.gbeta, c.gbeta) < 1e-5);
  if (act == DType::F32) {
    CHECK(rel(g.y, c.y) < 1e-5);
    CHECK(rel(g.gx, c.gx) < 1e-5);
    if (with_residual) CHECK(rel(g.gres, c.gres) < 1e-5);
  } else {
    CHECK(within_rounding(g.y, c.y, kU));
    CHECK(within_rounding(g.gx, c.gx, 1.5 * kU + kU * kU / 2));
    if (with_residual) CHECK(within_rounding(g.gres, c.gres, 1.5 * kU + kU * kU / 2));
  }
}

// The CPU float64 op once, then the GPU op in float32 and bf16, in each of `formats` (NCHW and
// NHWC unless told), against it.
void check_case(Op op, const Shape& s, bool training, bool with_residual, Rng& rng,
                std::initializer_list<MemoryFormat> formats = {MemoryFormat::NCHW, MemoryFormat::NHWC}) {
  CAPTURE(op_name(op));
  CAPTURE(shape_str(s));
  CAPTURE(training);
  CAPTURE(with_residual);
  Inputs in = make_inputs(s, rng);
  if (op == Op::BatchNormRelu || op == Op::BatchNormAddRelu) avoid_kinks(in, training, with_residual);
  const Result cpu = run(op, in, training, with_residual);
  for (DType act : {DType::F32, DType::BF16})
    for (MemoryFormat fmt : formats) {
      CAPTURE(dtype_name(act));
      CAPTURE(format_name(fmt));
      const Result gpu = run(op, to_gpu(in, act, fmt), training, with_residual);
      CHECK(gpu.y.dtype() == act);
      CHECK(gpu.y.format() == fmt);
      CHECK(gpu.gx.format() == fmt);
      compare(gpu, cpu, act, with_residual);
    }
}

struct Setup {
  Setup() { cuda::set_poison_allocations(true); }
};

}  // namespace

namespace {

void check_shapes(std::initializer_list<Shape> shapes, uint64_t seed) {
  Setup setup;
  Rng rng(seed);
  for (const Shape& s : shapes)
    for (Op op : {Op::BatchNorm, Op::BatchNormRelu, Op::BatchNormAddRelu, Op::BatchNormSync})
      for (bool training : {true, false})
        for (bool with_residual : {false, true}) {
          if (with_residual && op != Op::BatchNormAddRelu) continue;
          check_case(op, s, training, with_residual, rng);
        }
}

}  // namespace

// Two cases (each under the per-test time bound on the emulator). Odd planes; a
// single-value-wide one; planes of 1 value (33 channels: two NHWC channel groups, one of a
// single channel; 3 values per channel, as with 2 the training gradient cancels to a size of
// eps / var (x_hat = +-sqrt(var / (var + eps))), which float32 cannot hold to 1e-5 of itself);
// 70 channels (three groups of 32, the last partial); a plane of 4087 values (two NCHW
// reduction blocks); one channel of 90000 values (44 NCHW blocks, 22 NHWC chunks with a
// partial last one). These move one value at a time but the 90000-value plane.
TEST_CASE("CUDA batch norm ops in float32 and bf16, NCHW and NHWC, equal the CPU float64 ops") {
  check_shapes({{4, 6, 9, 7}, {3, 5, 1, 13}, {3, 33, 1, 1}, {3, 70, 5, 7}, {2, 3, 67, 61}, {1, 1, 300, 300},
                {5, 3, 31, 33}},
               301);
}

// The 16-byte packs (kernels/cuda/common.cuh: 8 bf16 or 4 floats a thread access, where the
// channels in NHWC or a plane in NCHW hold whole packs): 16 channels (NHWC packs in both
// types); 40 channels of 24-value planes (5 bf16 or 10 float packs a pixel: one partial group;
// NCHW packs); 520 channels (65 bf16 packs: three groups of 32, the last of one pack); 12
// channels of 4-value planes (float packs only).
TEST_CASE("CUDA batch norm ops in float32 and bf16, NCHW and NHWC, equal the CPU float64 ops: 16-byte packs") {
  check_shapes({{3, 16, 5, 7}, {2, 40, 4, 6}, {3, 12, 2, 2}}, 302);
}
TEST_CASE("CUDA batch norm ops in float32 and bf16, NCHW and NHWC, equal the CPU float64 ops: 520 channels of packs") {
  check_shapes({{2, 520, 3, 1}}, 303);
}

TEST_CASE("CUDA batch norm ops with many blocks per channel: NCHW [16, 4, 128, 128], NHWC [9, 64, 128, 128]") {
  // NCHW: 16 planes of 16384 values a channel, 8 reduction blocks each, 128 partials a channel
  // (the grid's channels only multiply the blocks: 4 of them, not the 64 of the NHWC shape).
  // NHWC: 576 float32 and 288 bf16 chunks a channel (256 and 512 pixels), more partials than
  // the finishing block has threads, so some of them add two or three.
  Setup setup;
  Rng rng(302);
  for (const auto& [s, fmt] : {std::pair{Shape{16, 4, 128, 128}, MemoryFormat::NCHW},
                               std::pair{Shape{9, 64, 128, 128}, MemoryFormat::NHWC}}) {
    check_case(Op::BatchNormAddRelu, s, true, true, rng, {fmt});
    check_case(Op::BatchNorm, s, true, false, rng, {fmt});
    check_case(Op::BatchNormSync, s, true, false, rng, {fmt});
    check_case(Op::BatchNormRelu, s, false, false, rng, {fmt});
  }
}

TEST_CASE("CUDA batch_norm_relu's backward recomputes the forward's ReLU mask from x, bit for bit") {
  // tests/bn_mask_check.h, as on the CPU: a cancelling multiply-add and bf16's rounding to zero,
  // with NCHW and NHWC packs and without, and [4, 16, 64, 64] (several blocks per channel).
  Setup setup;
  for (DType act : {DType::F32, DType::BF16})
    for (MemoryFormat fmt : {MemoryFormat::NCHW, MemoryFormat::NHWC})
      for (const Shape& s :
           {Shape{2, 16, 5, 7}, Shape{2, 16, 4, 8}, Shape{3, 5, 3, 3}, Shape{4, 16, 64, 64}}) {
        CAPTURE(std::string(dtype_name(act)));
        CAPTURE(std::string(format_name(fmt)));
        CAPTURE(shape_str(s));
        testing_bn::check_relu_mask_recomputed(kGpu, act, fmt, s, 7);
      }
}

TEST_CASE("CUDA batch norm results are the same bits run to run (fixed reduction order)") {
  // The shapes of many blocks per channel above, each in its format.
  Setup setup;
  Rng rng(303);
  auto same_bits = [](const Tensor& a, const Tensor& b) {
    const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
    return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
  };
  for (const auto& [s, fmt] : {std::pair{Shape{16, 4, 128, 128}, MemoryFormat::NCHW},
                               std::pair{Shape{9, 64, 128, 128}, MemoryFormat::NHWC}}) {
    const Inputs in = make_inputs(s, rng);
    for (DType act : {DType::F32, DType::BF16}) {
      CAPTURE(dtype_name(act));
      CAPTURE(format_name(fmt));
      const Inputs g = to_gpu(in, act, fmt);
      const Result a = run(Op::BatchNormAddRelu, g, true, true);
      const Result b = run(Op::BatchNormAddRelu, g, true, true);
      CHECK(same_bits(a.y, b.y));
      CHECK(same_bits(a.rv, b.rv));
      CHECK(same_bits(a.gx, b.gx));
      CHECK(same_bits(a.ggamma, b.ggamma));
      CHECK(same_bits(a.gres, b.gres));
    }
  }
}

TEST_CASE("CUDA bf16 training statistics: a large mean over a million values per channel") {
  // As the CPU test (tests/test_bn_layout.cpp): values 9984 + 64 k, k uniform in [-3, 3], exact
  // in bf16; 2^20 values a channel (512 NCHW blocks and 512 NHWC chunks); mean and variance
  // against a two-pass double reference, rounded once to float32.
  Setup setup;
  Rng rng(304);
  const Shape s = {4, 2, 512, 512};
  std::vector<double> v(size_t(shape_numel(s)));
  for (double& e : v) e = 9984.0 + 64.0 * double(rng.below(7) - 3);
  const Tensor x64 = Tensor::from_vector(s, v, DType::F64);
  const int64_t N = s[0], C = s[1], HW = s[2] * s[3];
  const double M = double(N * HW);
  std::vector<double> m_ref(C), v_ref(C);
  for (int64_t c = 0; c < C; ++c) {
    double sum = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t q = 0; q < HW; ++q) sum += v[size_t((n * C + c) * HW + q)];
    double m = sum / M, corr = 0, ss = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t q = 0; q < HW; ++q) corr += v[size_t((n * C + c) * HW + q)] - m;
    m += corr / M;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t q = 0; q < HW; ++q) {
        const double d = v[size_t((n * C + c) * HW + q)] - m;
        ss += d * d;
      }
    m_ref[c] = m;
    v_ref[c] = ss / M;
  }
  for (MemoryFormat fmt : {MemoryFormat::NCHW, MemoryFormat::NHWC})
    for (bool fused : {false, true}) {
      CAPTURE(format_name(fmt));
      CAPTURE(fused);
      const Tensor x = x64.to(DType::BF16).to(fmt).to(kGpu);
      Tensor rm = Tensor::zeros({C}, DType::F32, kGpu), rv = Tensor::zeros({C}, DType::F32, kGpu);
      const Tensor g = Tensor::full({C}, 1.0, DType::F32, kGpu);
      const Tensor b = Tensor::zeros({C}, DType::F32, kGpu);
      if (fused)
        batch_norm_relu(x, g, b, rm, rv, true, 1.0);
      else
        batch_norm2d(x, g, b, rm, rv, true, 1.0);
      for (int64_t c = 0; c < C; ++c) {
        CHECK(std::fabs(rm.at(c) - m_ref[c]) <= 1e-7 * m_ref[c]);
        CHECK(std::fabs(rv.at(c) * (M - 1) / M - v_ref[c]) <= 1e-6 * v_ref[c]);
      }
    }
}
