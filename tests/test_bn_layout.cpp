// Batch norm in bfloat16 and channels-last on the CPU (engine/ops/batchnorm.cpp,
// kernels/cpu/batchnorm.cpp). The ops cover every launcher:
//   batch_norm2d: training batchnorm_forward_train + batchnorm_backward; eval
//     batchnorm_forward_eval + batchnorm_eval_stats + batchnorm_backward (constants);
//   batch_norm_relu / batch_norm_add_relu: batchnorm_stats (training) or batchnorm_eval_stats,
//     batchnorm_add_relu_forward, batchnorm_add_relu_backward;
//   batch_norm2d under a BatchNormSyncScope (training): batchnorm_channel_sums,
//     batchnorm_sync_stats, batchnorm_apply, batchnorm_grad_sums, batchnorm_param_grads,
//     batchnorm_grad_apply.
// Each op in NHWC equals the op in NCHW (float64 and float32), forward and backward over two
// backward passes (the second accumulates, beta = 1); in bfloat16 it equals the float32 op on
// the same bf16-rounded inputs up to the rounding of what it stores; bf16 statistics stay exact
// for a channel with a large mean over a million values; the fused ops' NHWC gradients pass
// the finite-difference check; the per-channel tensors must be in the compute dtype.
#include <algorithm>
#include <cmath>
#include <vector>

#include "bn_mask_check.h"
#include "bn_ops.h"
#include "bn_stats.h"
#include "engine/ops.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;
using namespace unetcu::testing_bn;

namespace {

constexpr double kBf16Roundoff = 0x1p-8;  // unit roundoff of bf16: 8 significant bits

constexpr Op kOps[] = {Op::BatchNorm, Op::BatchNormRelu, Op::BatchNormAddRelu, Op::BatchNormSync};

// ‖a − b‖ / ‖b‖ (‖a‖ when b is zero), in logical order whatever the formats and dtypes.
double rel_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const std::vector<double> u = a.to_vector(), v = b.to_vector();
  double num = 0, den = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    num += (u[i] - v[i]) * (u[i] - v[i]);
    den += v[i] * v[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// The op's inputs, and R, the gradient of its output.

Inputs make_inputs(const Shape& s, Rng& rng) {
  const int64_t C = s[1];
  Inputs in;
  in.x = random_tensor(s, rng, -2, 3);
  in.gamma = random_tensor({C}, rng, 0.5, 1.5);
  in.beta = random_tensor({C}, rng, -0.5, 0.5);
  in.residual = random_tensor(s, rng, -1, 1);
  in.rm = random_tensor({C}, rng, -1, 1);
  in.rv = random_tensor({C}, rng, 0.5, 2);
  in.R = random_tensor(s, rng, -1, 1);
  return in;
}

// The inputs for activations of dtype `act` in format `fmt`: x, the residual and R in (act,
// fmt); the per-channel tensors in the compute dtype (float32 for bf16).
Inputs cast(const Inputs& in, DType act, MemoryFormat fmt) {
  const DType cd = act == DType::BF16 ? DType::F32 : act;
  Inputs o;
  for (auto [dst, src] : {std::pair{&o.x, &in.x}, {&o.residual, &in.residual}, {&o.R, &in.R}})
    *dst = src->to(act).to(fmt).clone();
  for (auto [dst, src] : {std::pair{&o.gamma, &in.gamma}, {&o.beta, &in.beta}, {&o.rm, &in.rm},
                          {&o.rv, &in.rv}})
    *dst = src->to(cd);
  return o;
}

// The inputs rounded to bf16 (activations and R) and float32 (per-channel tensors), still in
// float64: the same values for the float32 and the bfloat16 runs.
Inputs round_bf16(const Inputs& in) {
  Inputs o;
  for (auto [dst, src] : {std::pair{&o.x, &in.x}, {&o.residual, &in.residual}, {&o.R, &in.R}})
    *dst = src->to(DType::BF16).to(DType::F64);
  for (auto [dst, src] : {std::pair{&o.gamma, &in.gamma}, {&o.beta, &in.beta}, {&o.rm, &in.rm},
                          {&o.rv, &in.rv}})
    *dst = src->to(DType::F32).to(DType::F64);
  return o;
}

// testing_bn::run (tests/bn_ops.h), and the dtypes and formats of what it gives.
Result run_op(Op op, const Inputs& in, bool training, bool with_residual) {
  Result r = run(op, in, training, with_residual);
  // Outputs and gradients of activations in x's dtype and format; the rest in the compute dtype.
  CHECK(r.y.dtype() == in.x.dtype());
  CHECK(r.y.format() == in.x.format());
  CHECK(r.gx.dtype() == in.x.dtype());
  CHECK(r.gx.format() == in.x.format());
  CHECK(r.ggamma.dtype() == in.gamma.dtype());
  CHECK(r.rm.dtype() == in.gamma.dtype());
  return r;
}

bool has_residual(Op op) { return op == Op::BatchNormAddRelu; }

// The second pass added its gradient to the first's (beta = 1). Both passes see the same x,
// batch statistics and R (only the running statistics move), so they compute the same
// gradient and the sum is exactly twice the first in float32 and float64 (v + v = 2v).
bool accumulated_twice(const Tensor& sum, const Tensor& first) {
  const std::vector<double> a = sum.to_vector(), b = first.to_vector();
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != 2 * b[i]) return false;
  return true;
}

// Odd planes; a single-value-wide one; a plane of one value; NHWC runs of several reduction
// chunks with a partial last one (4551 pixels, 819 a chunk at C = 5), and a channel count
// above a chunk's values (one pixel a chunk).
const Shape kShapes[] = {{1, 1, 3, 5},  {2, 3, 5, 7},   {3, 5, 7, 3},    {1, 4, 11, 13},
                         {3, 2, 1, 9},  {2, 5, 9, 1},   {1, 3, 2, 1},    {3, 5, 37, 41},
                         {2, 4100, 1, 2}};

}  // namespace

TEST_CASE("batch norm ops: NHWC equals NCHW in float64 and float32, forward and backward") {
  Rng rng(201);
  for (DType dt : {DType::F64, DType::F32})
    for (const Shape& s : kShapes)
      for (Op op : kOps)
        for (bool training : {true, false})
          for (bool with_residual : {false, true}) {
            if (with_residual && !has_residual(op)) continue;
            CAPTURE(dtype_name(dt));
            CAPTURE(shape_str(s));
            CAPTURE(op_name(op));
            CAPTURE(training);
            CAPTURE(with_residual);
            const Inputs in = make_inputs(s, rng);
            const Result a = run_op(op, cast(in, dt, MemoryFormat::NHWC), training, with_residual);
            const Result b = run_op(op, cast(in, dt, MemoryFormat::NCHW), training, with_residual);
            // The same arithmetic; only the order of the double sums of a channel differs (plane
            // partials against pixel-chunk partials). float64: ~1e-16 per sum; float32: the
            // statistics and sums rounded to float32 (6e-8) may land one ulp apart.
            const double tol = dt == DType::F64 ? 1e-12 : 1e-5;
            CHECK(rel_diff(a.y, b.y) < tol);
            CHECK(rel_diff(a.rm, b.rm) < tol);
            CHECK(rel_diff(a.rv, b.rv) < tol);
            CHECK(rel_diff(a.gx, b.gx) < tol);
            CHECK(rel_diff(a.ggamma, b.ggamma) < tol);
            CHECK(rel_diff(a.gbeta, b.gbeta) < tol);
            if (with_residual) CHECK(rel_diff(a.gres, b.gres) < tol);
            if (!training) {  // eval leaves the running statistics alone
              CHECK(max_abs_diff(a.rm, in.rm.to(dt)) == 0);
              CHECK(max_abs_diff(a.rv, in.rv.to(dt)) == 0);
            }
            for (const Result* r : {&a, &b}) {
              CHECK(accumulated_twice(r->gx, r->gx1));
              CHECK(accumulated_twice(r->ggamma, r->ggamma1));
              CHECK(accumulated_twice(r->gbeta, r->gbeta1));
              if (with_residual) CHECK(accumulated_twice(r->gres, r->gres1));
            }
          }
}

namespace {

// Largest |got - want| - bound(|want|) over the elements (in logical order); <= 0 when every
// element is within its bound.
template <class Bound>
double worst_excess(const Tensor& got, const Tensor& want, Bound bound) {
  REQUIRE(got.shape() == want.shape());
  const std::vector<double> g = got.to_vector(), w = want.to_vector();
  double worst = -INFINITY;
  for (size_t i = 0; i < g.size(); ++i)
    worst = std::max(worst, std::fabs(g[i] - w[i]) - bound(std::fabs(w[i])));
  return worst;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.to_vector()) m = std::max(m, std::fabs(v));
  return m;
}

}  // namespace

TEST_CASE("batch norm ops in bfloat16 equal float32 on the same bf16-rounded inputs") {
  // Both runs read the same values (x, the residual and the output gradient R rounded to bf16;
  // the per-channel tensors float32) and compute in float32 with double sums in the same order,
  // so they differ only where the bf16 op rounds what it stores:
  //  - y = bf16(y32): |y - y32| <= u |y32| (u = 2^-8). The ReLU mask of the backward reads the
  //    stored y; rounding keeps the sign, so it is the same mask.
  //  - the statistics, running statistics and dgamma, dbeta are sums of the same values in
  //    float32/double: equal up to float32 rounding (1e-6 relative allows a few ulps).
  //  - grad_x and the residual's gradient after two passes: pass 1 stores bf16(v), pass 2
  //    bf16(bf16(v) + v) = v (2 + e1)(1 + e2), |e1|, |e2| <= u, against 2v in float32: at most
  //    (3u + u²) |v| = (1.5u + u²/2) |2v|.
  // Each element bound also carries 4 float32 ulps of the tensor's largest value (the float32
  // arithmetic of the two instantiations may contract a product into an FMA differently).
  const double u = kBf16Roundoff;
  Rng rng(202);
  const Shape shapes[] = {{2, 3, 5, 7}, {3, 5, 37, 41}, {1, 4, 11, 13}, {2, 4100, 1, 2}};
  for (MemoryFormat fmt : {MemoryFormat::NCHW, MemoryFormat::NHWC})
    for (const Shape& s : shapes)
      for (Op op : kOps)
        for (bool training : {true, false})
          for (bool with_residual : {false, true}) {
            if (with_residual && !has_residual(op)) continue;
            CAPTURE(format_name(fmt));
            CAPTURE(shape_str(s));
            CAPTURE(op_name(op));
            CAPTURE(training);
            CAPTURE(with_residual);
            const Inputs in = round_bf16(make_inputs(s, rng));
            const Result b = run_op(op, cast(in, DType::BF16, fmt), training, with_residual);
            const Result f = run_op(op, cast(in, DType::F32, fmt), training, with_residual);
            const double ulp32 = 0x1p-24;
            auto within = [&](const Tensor& got, const Tensor& want, double rel) {
              const double slack = 4 * ulp32 * max_abs(want);
              return worst_excess(got, want, [&](double w) { return rel * w + slack; }) <= 0;
            };
            CHECK(within(b.y, f.y, u));
            CHECK(rel_diff(b.y, f.y) > 0);  // the bf16 output is rounded: a real comparison
            CHECK(rel_diff(b.rm, f.rm) < 1e-6);
            CHECK(rel_diff(b.rv, f.rv) < 1e-6);
            CHECK(rel_diff(b.ggamma, f.ggamma) < 1e-6);
            CHECK(rel_diff(b.gbeta, f.gbeta) < 1e-6);
            CHECK(within(b.gx, f.gx, 1.5 * u + u * u / 2));
            if (with_residual) CHECK(within(b.gres, f.gres, 1.5 * u + u * u / 2));
          }
}

TEST_CASE("bfloat16 training statistics stay exact with a large mean over a million values") {
  // bf16 near 1e4 is spaced by 64 (8 significant bits), so a channel of 1e4 ± 1 would hold
  // one value; the channels hold 9984 + 64 k, k uniform in [-3, 3] (exact in bf16): mean ~1e4,
  // standard deviation 128, 2^20 values each. A one-pass float32 E[x²] - E[x]² loses the
  // variance (E[x²] = 1e8 has an ulp of 8, and its float32 sum of 2^20 terms far more); the
  // kernels' sums, shifted and in double, keep it to float32's rounding of the results.
  Rng rng(203);
  const Shape s = {4, 2, 512, 512};
  Tensor x64 = Tensor::empty(s, DType::F64);
  {
    std::vector<double> v(size_t(x64.numel()));
    for (double& e : v) e = 9984.0 + 64.0 * double(rng.below(7) - 3);
    x64 = Tensor::from_vector(s, v, DType::F64);
  }
  std::vector<double> m_ref, v_ref;
  two_pass_stats(x64, &m_ref, &v_ref);
  // The naive float32 formula on the same values (what a float32 one-pass kernel computes).
  const double naive_err = naive_variance_error<float>(x64, v_ref);
  INFO("naive float32 variance relative error ", naive_err);
  CHECK(naive_err > 1e-2);  // the naive formula fails: this input is a real test
  const double M = double(s[0] * s[2] * s[3]);
  for (MemoryFormat fmt : {MemoryFormat::NCHW, MemoryFormat::NHWC})
    for (bool fused : {false, true}) {
      CAPTURE(format_name(fmt));
      CAPTURE(fused);
      const Tensor x = x64.to(DType::BF16).to(fmt);
      // momentum 1: the running statistics become the batch mean and unbiased variance.
      Tensor rm = Tensor::zeros({2}), rv = Tensor::zeros({2});
      const Tensor g = Tensor::full({2}, 1.0), b = Tensor::zeros({2});
      if (fused)
        batch_norm_relu(x, g, b, rm, rv, true, 1.0);
      else
        batch_norm2d(x, g, b, rm, rv, true, 1.0);
      for (int64_t c = 0; c < 2; ++c) {
        // mean and variance rounded once to float32 (6e-8).
        CHECK(std::fabs(rm.at(c) - m_ref[c]) <= 1e-7 * m_ref[c]);
        CHECK(std::fabs(rv.at(c) * (M - 1) / M - v_ref[c]) <= 1e-6 * v_ref[c]);
      }
    }
}

TEST_CASE("fused batch norm ops in float64 NHWC: gradients equal finite differences") {
  Rng rng(204);
  for (bool training : {true, false})
    for (bool with_residual : {false, true}) {
      CAPTURE(training);
      CAPTURE(with_residual);
      const Inputs in = cast(make_inputs({2, 3, 5, 3}, rng), DType::F64, MemoryFormat::NHWC);
      std::vector<Tensor> args;
      for (const Tensor* t : {&in.x, &in.gamma, &in.beta, &in.residual})
        if (t != &in.residual || with_residual) args.push_back(t->clone().set_requires_grad(true));
      REQUIRE(args[0].format() == MemoryFormat::NHWC);
      // The checker's output gradient is NCHW: the NHWC output is converted (with autograd),
      // so the fused op's backward still receives an NHWC gradient.
      gradcheck([&](const std::vector<Tensor>& v) {
        Tensor rm = in.rm.clone(), rv = in.rv.clone();
        const Tensor y = with_residual
                             ? batch_norm_add_relu(v[0], v[1], v[2], v[3], rm, rv, training)
                             : batch_norm_relu(v[0], v[1], v[2], rm, rv, training);
        REQUIRE(y.format() == MemoryFormat::NHWC);
        return convert(y, DType::F64, MemoryFormat::NCHW);
      }, args);
    }
}

TEST_CASE("batch norm ops take per-channel tensors in the compute dtype and a residual in x's format") {
  Rng rng(205);
  const Shape s = {2, 3, 4, 5};
  const Inputs in = make_inputs(s, rng);
  const Inputs b16 = cast(in, DType::BF16, MemoryFormat::NHWC);
  Tensor rm = b16.rm.clone(), rv = b16.rv.clone();
  // bf16 activations with float32 statistics and parameters: accepted.
  CHECK_NOTHROW(batch_norm2d(b16.x, b16.gamma, b16.beta, rm, rv, true));
  CHECK_NOTHROW(batch_norm_add_relu(b16.x, b16.gamma, b16.beta, b16.residual, rm, rv, true));
  // bf16 or float64 per-channel tensors with bf16 activations: refused.
  Tensor rm16 = rm.to(DType::BF16), rm64 = rm.to(DType::F64);
  CHECK_THROWS_AS(batch_norm2d(b16.x, b16.gamma.to(DType::BF16), b16.beta, rm, rv, true), Error);
  CHECK_THROWS_AS(batch_norm_relu(b16.x, b16.gamma, b16.beta, rm16, rv, true), Error);
  CHECK_THROWS_AS(batch_norm2d(b16.x, b16.gamma, b16.beta, rm64, rv, false), Error);
  // float32 activations keep float32 per-channel tensors; float64 ones are refused.
  const Inputs f32 = cast(in, DType::F32, MemoryFormat::NCHW);
  CHECK_THROWS_AS(batch_norm_relu(f32.x, f32.gamma.to(DType::F64), f32.beta, rm, rv, true), Error);
  // A residual in another format or dtype than x: refused.
  CHECK_THROWS_AS(batch_norm_add_relu(b16.x, b16.gamma, b16.beta,
                                      b16.residual.to(MemoryFormat::NCHW), rm, rv, true),
                  Error);
  CHECK_THROWS_AS(batch_norm_add_relu(b16.x, b16.gamma, b16.beta, b16.residual.to(DType::F32),
                                      rm, rv, true),
                  Error);
}

TEST_CASE("batch_norm_relu's backward recomputes the forward's ReLU mask from x, bit for bit") {
  // tests/bn_mask_check.h: inputs on the edges where a mask recomputed with other roundings
  // than the forward's goes wrong (a cancelling multiply-add, bf16's rounding to zero), in
  // every dtype and format, planes and channel counts that take packs and ones that do not.
  for (DType act : {DType::F64, DType::F32, DType::BF16})
    for (MemoryFormat fmt : {MemoryFormat::NCHW, MemoryFormat::NHWC})
      for (const Shape& s : {Shape{2, 16, 5, 7}, Shape{2, 16, 4, 8}, Shape{3, 5, 3, 3}}) {
        CAPTURE(std::string(dtype_name(act)));
        CAPTURE(std::string(format_name(fmt)));
        CAPTURE(shape_str(s));
        testing_bn::check_relu_mask_recomputed(Device::cpu(), act, fmt, s, 7);
      }
}
