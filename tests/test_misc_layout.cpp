// relu, sigmoid, add, scale, max_pool2d, upsample_nearest2x, concat_channels,
// upsample_nearest2x_concat and the losses in NHWC and bfloat16 on the CPU.
//
// Each op runs forward and two backward passes: the first writes the input gradients (beta 0),
// the second adds to them (beta 1), so both store paths are covered.
//
// NHWC against NCHW, same dtype: the kernels do the same arithmetic in the same order per
// element (copies, maxima, the 2×2 sums in one fixed order, max-pool scatters in output
// order), so everything is compared for equality — except the losses, whose sums run over
// memory order and so differ by summation order only (bounds stated there).
//
// bfloat16 against float32 on the same bfloat16-representable inputs: a bfloat16 kernel reads
// its operands as float, does the float32 op's arithmetic and rounds once when it stores. So
// each bfloat16 result is the float32 result rounded to bfloat16 (round to nearest even),
// which is within bfloat16's unit roundoff u = 2^-8 of it: |b - f| <= u |b|. Copies and maxima
// are exact. For the accumulating pass the float32 op starts from the bfloat16 op's first
// gradient (widened exactly), so both add to the same destination; both the exact rounding
// and the bound are checked. Sigmoid's backward reads its saved output, which bfloat16 has
// rounded, so it gets a bound of its own (derived below).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "engine/ops.h"
#include "kernels/launchers.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

constexpr MemoryFormat kNCHW = MemoryFormat::NCHW, kNHWC = MemoryFormat::NHWC;
const double kU = std::ldexp(1.0, -8);  // bfloat16's unit roundoff

using Op = std::function<Tensor(const std::vector<Tensor>&)>;

// float64 values that bfloat16 holds exactly (so every dtype sees the same inputs).
Tensor bf16_values(const Shape& s, Rng& rng, double lo, double hi) {
  return random_tensor(s, rng, lo, hi, DType::F64).to(DType::BF16).to(DType::F64);
}

// A shuffled ramp of bfloat16-representable distinct values: no ties in a pooling window, and
// every gap far above a gradient check's step.
Tensor distinct_values(const Shape& s, Rng& rng) {
  Tensor t = Tensor::empty(s, DType::F64);
  std::vector<int64_t> perm(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) perm[i] = i;
  for (int64_t i = t.numel() - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, 0.01 * double(perm[i]) - 1.0);
  return t;
}

// t in ref's dtype and (for a 4-dimensional ref) memory format.
Tensor like(const Tensor& t, DType dtype, MemoryFormat format) {
  Tensor r = t.to(dtype);
  return t.ndim() == 4 ? r.to(format) : r;
}

struct Case {
  const char* name;
  Op op;
  std::vector<Tensor> inputs;  // float64 values, converted to the dtype under test
  std::vector<bool> needs_grad;
  bool exact_forward;  // copies or maxima: the same values in every dtype
};

struct Result {
  Tensor y;
  std::vector<Tensor> grad1, grad2;  // after the first (written) and second (accumulated) pass
};

// Runs c on its inputs in dtype and format; back-propagates g1, then g2. With reseed, each
// gradient is overwritten with reseed[i] (converted) between the passes.
Result run(const Case& c, DType dtype, MemoryFormat format, const Tensor& g1, const Tensor& g2,
           const std::vector<Tensor>* reseed = nullptr) {
  std::vector<Tensor> xs;
  for (size_t i = 0; i < c.inputs.size(); ++i)
    xs.push_back(like(c.inputs[i], dtype, format).set_requires_grad(c.needs_grad[i]));
  Result r;
  for (int pass = 0; pass < 2; ++pass) {
    Tape tape;
    Tensor y;
    {
      TapeScope scope(tape);
      y = c.op(xs);
    }
    if (pass == 0) {
      r.y = y;
      if (y.ndim() == 4) CHECK(y.format() == format);
    }
    tape.backward({y}, {like(pass == 0 ? g1 : g2, y.dtype(), y.format())});
    for (size_t i = 0; i < xs.size(); ++i) {
      if (!c.needs_grad[i]) continue;
      Tensor g = xs[i].grad();
      REQUIRE(g.defined());
      CHECK(g.dtype() == dtype);
      CHECK(g.format() == xs[i].format());
      (pass == 0 ? r.grad1 : r.grad2).push_back(g.clone());
      if (pass == 0 && reseed) xs[i].grad().copy_((*reseed)[r.grad1.size() - 1]);
    }
  }
  return r;
}

// The same values in logical order (a NaN matches a NaN).
bool same_values(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == y[i] || (std::isnan(x[i]) && std::isnan(y[i])))) return false;
  return true;
}

// b (bfloat16) is f (float32) rounded once to bfloat16, and within u |b| of it.
void check_rounded(const Tensor& b, const Tensor& f) {
  REQUIRE(b.shape() == f.shape());
  int64_t wrong = 0, outside = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    const double bv = b.at(i), fv = f.at(i);
    if (std::isnan(bv) && std::isnan(fv)) continue;
    if (bv != double(float(bf16(float(fv))))) ++wrong;
    if (std::fabs(bv - fv) > kU * std::fabs(bv)) ++outside;
  }
  CHECK(wrong == 0);
  CHECK(outside == 0);
}

using Values = Tensor (*)(const Shape&, Rng&, double, double);

Tensor random_like_output(const Case& c, Rng& rng, Values values) {
  Tensor y = c.op(c.inputs);  // float64, no tape: only for the shape
  return values(y.shape(), rng, -1, 1);
}

// Values of full float64 precision: rounding to float32 keeps 24 bits, so sums of them round
// and their order shows.
Tensor full_values(const Shape& s, Rng& rng, double lo, double hi) {
  return random_tensor(s, rng, lo, hi, DType::F64);
}

// The cases, on inputs from values(shape, rng, lo, hi).
std::vector<Case> layout_cases(Rng& rng, Values values) {
  std::vector<Case> cases;
  const Shape s{2, 5, 9, 11};
  cases.push_back({"relu", [](const std::vector<Tensor>& v) { return relu(v[0]); },
                   {values(s, rng, -1, 1)}, {true}, true});
  cases.push_back({"sigmoid", [](const std::vector<Tensor>& v) { return sigmoid(v[0]); },
                   {values(s, rng, -6, 6)}, {true}, false});
  cases.push_back({"add", [](const std::vector<Tensor>& v) { return add(v[0], v[1]); },
                   {values(s, rng, -1, 1), values(s, rng, -1, 1)}, {true, true}, false});
  cases.push_back({"scale", [](const std::vector<Tensor>& v) { return scale(v[0], -1.5); },
                   {values(s, rng, -1, 1)}, {true}, false});
  cases.push_back({"max_pool2d 3x3/2 pad 1",
                   [](const std::vector<Tensor>& v) {
                     return max_pool2d(v[0], Pool2dOptions::square(3, 2, 1));
                   },
                   {values(s, rng, -1, 1)}, {true}, true});
  cases.push_back({"max_pool2d 2x3/(1,2) pad (1,1)",
                   [](const std::vector<Tensor>& v) {
                     return max_pool2d(v[0], Pool2dOptions{2, 3, 1, 2, 1, 1});
                   },
                   {values({1, 3, 7, 9}, rng, -1, 1)}, {true}, true});
  // More channels than one NHWC channel block (64), and a window wider than the stride.
  cases.push_back({"max_pool2d 3x3/2 pad 1, 70 channels",
                   [](const std::vector<Tensor>& v) {
                     return max_pool2d(v[0], Pool2dOptions::square(3, 2, 1));
                   },
                   {values({2, 70, 6, 5}, rng, -1, 1)}, {true}, true});
  // Ties everywhere (values from {0, 1, 2}) and NaNs: the first maximum in window order wins.
  Tensor ties = Tensor::empty({2, 3, 9, 11}, DType::F64);
  for (int64_t i = 0; i < ties.numel(); ++i) ties.set(i, double(rng.below(3)));
  ties.set(4 * 11 + 5, NAN);
  ties.set(99 + 8 * 11 + 10, NAN);
  ties.set(2 * 99 + 3, NAN);
  cases.push_back({"max_pool2d ties and NaN",
                   [](const std::vector<Tensor>& v) {
                     return max_pool2d(v[0], Pool2dOptions::square(3, 2, 1));
                   },
                   {ties}, {true}, true});
  cases.push_back({"max_pool2d ties and NaN, 3x3/1 pad 1",
                   [](const std::vector<Tensor>& v) {
                     return max_pool2d(v[0], Pool2dOptions::square(3, 1, 1));
                   },
                   {ties}, {true}, true});
  cases.push_back({"max_pool2d 2x2/2",
                   [](const std::vector<Tensor>& v) {
                     return max_pool2d(v[0], Pool2dOptions::square(2, 2, 0));
                   },
                   {values({2, 4, 6, 8}, rng, -1, 1)}, {true}, true});
  cases.push_back({"upsample_nearest2x",
                   [](const std::vector<Tensor>& v) { return upsample_nearest2x(v[0]); },
                   {values({2, 3, 3, 5}, rng, -1, 1)}, {true}, true});
  cases.push_back({"concat_channels",
                   [](const std::vector<Tensor>& v) { return concat_channels({v[0], v[1], v[2]}); },
                   {values({2, 2, 3, 4}, rng, -1, 1), values({2, 3, 3, 4}, rng, -1, 1),
                    values({2, 1, 3, 4}, rng, -1, 1)},
                   {true, false, true}, true});
  const Op up_cat = [](const std::vector<Tensor>& v) {
    return upsample_nearest2x_concat(v[0], v[1]);
  };
  cases.push_back({"upsample_nearest2x_concat", up_cat,
                   {values({2, 3, 3, 4}, rng, -1, 1), values({2, 2, 6, 8}, rng, -1, 1)},
                   {true, true}, true});
  cases.push_back({"upsample_nearest2x_concat, x only", up_cat,
                   {values({1, 2, 2, 3}, rng, -1, 1), values({1, 3, 4, 6}, rng, -1, 1)},
                   {true, false}, true});
  cases.push_back({"upsample_nearest2x_concat, skip only", up_cat,
                   {values({1, 2, 2, 3}, rng, -1, 1), values({1, 3, 4, 6}, rng, -1, 1)},
                   {false, true}, true});
  cases.push_back({"upsample_nearest2x_concat, 70 + 1 channels", up_cat,
                   {values({1, 70, 2, 3}, rng, -1, 1), values({1, 1, 4, 6}, rng, -1, 1)},
                   {true, true}, true});
  return cases;
}

}  // namespace

TEST_CASE("misc ops in NHWC equal NCHW exactly, forward and both backward passes") {
  Rng rng(101);
  std::vector<Case> cases = layout_cases(rng, full_values);
  cases.push_back({"add, the same input twice",
                   [](const std::vector<Tensor>& v) { return add(v[0], v[0]); },
                   {full_values({2, 3, 4, 5}, rng, -1, 1)}, {true}, false});
  for (const Case& c : cases) {
    const std::string name = c.name;
    CAPTURE(name);
    const Tensor g1 = random_like_output(c, rng, full_values);
    const Tensor g2 = random_like_output(c, rng, full_values);
    for (DType dt : {DType::F64, DType::F32, DType::BF16}) {
      CAPTURE(dtype_name(dt));
      const Result a = run(c, dt, kNCHW, g1, g2), b = run(c, dt, kNHWC, g1, g2);
      CHECK(b.y.dtype() == dt);
      CHECK(same_values(b.y, a.y));
      REQUIRE(a.grad1.size() == b.grad1.size());
      for (size_t i = 0; i < a.grad1.size(); ++i) {
        CAPTURE(i);
        CHECK(same_values(b.grad1[i], a.grad1[i]));
        CHECK(same_values(b.grad2[i], a.grad2[i]));
      }
    }
  }
}

TEST_CASE("misc ops in bfloat16 are the float32 results rounded once, NCHW and NHWC") {
  Rng rng(102);
  const std::vector<Case> cases = layout_cases(rng, bf16_values);
  for (const Case& c : cases) {
    const std::string name = c.name;
    CAPTURE(name);
    const bool is_sigmoid = std::strcmp(c.name, "sigmoid") == 0;
    const Tensor g1 = random_like_output(c, rng, bf16_values);
    const Tensor g2 = random_like_output(c, rng, bf16_values);
    for (MemoryFormat fmt : {kNCHW, kNHWC}) {
      CAPTURE(format_name(fmt));
      const Result b = run(c, DType::BF16, fmt, g1, g2);
      const Result f = run(c, DType::F32, fmt, g1, g2, &b.grad1);
      CHECK(b.y.dtype() == DType::BF16);
      if (c.exact_forward)
        CHECK(same_values(b.y, f.y));
      else
        check_rounded(b.y, f.y);
      for (size_t i = 0; i < b.grad1.size(); ++i) {
        CAPTURE(i);
        if (!is_sigmoid) {
          check_rounded(b.grad1[i], f.grad1[i]);
          check_rounded(b.grad2[i], f.grad2[i]);
          continue;
        }
        // Sigmoid: the bfloat16 op differentiates at its stored y_b = y (1 + e), |e| <= u, so
        // the value it adds, g y_b (1 - y_b), differs from the float32 one by at most
        // |g| (u y |1 - 2y| + u^2 y^2) (a Taylor step, exact for this quadratic), plus float32
        // rounding of each (three operations, < 2^-22 |g|); then the store rounds once (u |b|).
        const Tensor y = f.y, gy1 = g1, gy2 = g2;
        for (int pass = 0; pass < 2; ++pass) {
          const Tensor& gb = pass == 0 ? b.grad1[i] : b.grad2[i];
          const Tensor& gf = pass == 0 ? f.grad1[i] : f.grad2[i];
          const Tensor& g = pass == 0 ? gy1 : gy2;
          int64_t outside = 0;
          for (int64_t k = 0; k < gb.numel(); ++k) {
            const double yk = y.at(k), gk = std::fabs(g.at(k));
            const double bound = kU * std::fabs(gb.at(k)) +
                                 gk * (kU * yk * std::fabs(1 - 2 * yk) + kU * kU * yk * yk) +
                                 std::ldexp(gk, -22);
            if (std::fabs(gb.at(k) - gf.at(k)) > bound) ++outside;
          }
          CHECK(outside == 0);
        }
      }
    }
  }
}

TEST_CASE("fill and axpby on bfloat16: one rounding of the float32 value and sum") {
  Tensor t = Tensor::full({2, 3, 4, 5}, 0.1, DType::BF16, Device::cpu());
  for (int64_t i = 0; i < t.numel(); ++i) REQUIRE(t.at(i) == double(float(bf16(0.1f))));
  Rng rng(103);
  const Shape s{3, 4, 5, 6};
  for (MemoryFormat fmt : {kNCHW, kNHWC}) {
    const Tensor d0 = like(bf16_values(s, rng, -1, 1), DType::BF16, fmt);
    const Tensor src = like(bf16_values(s, rng, -1, 1), DType::BF16, fmt);
    Tensor d = d0.clone();
    // alpha a power of two: alpha * src is exact in float32, so a fused multiply-add and a
    // separate product give the same float32 sum, and only the final rounding remains.
    kernels::cpu::axpby(d, 0.25, src, 1.0);  // d = 0.25 src + d
    Tensor w = d0.clone();
    kernels::cpu::axpby(w, -2.0, src, 0.0);  // w = -2 src
    int64_t wrong = 0;
    for (int64_t i = 0; i < d.numel(); ++i) {
      const float acc = float(d0.at(i)) + 0.25f * float(src.at(i));
      if (d.at(i) != double(float(bf16(acc)))) ++wrong;
      if (w.at(i) != double(float(bf16(-2.0f * float(src.at(i)))))) ++wrong;
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("NHWC ops lay out their output channels last, upsample_concat per pixel") {
  Rng rng(104);
  const Tensor x = bf16_values({2, 3, 3, 4}, rng, -1, 1), skip = bf16_values({2, 2, 6, 8}, rng, -1, 1);
  for (DType dt : {DType::F32, DType::BF16}) {
    CAPTURE(dtype_name(dt));
    const Tensor y = upsample_nearest2x_concat(like(x, dt, kNHWC), like(skip, dt, kNHWC));
    REQUIRE(y.format() == kNHWC);
    REQUIRE(y.shape() == Shape{2, 5, 6, 8});
    // Raw memory: pixel (n, oh, ow) holds x's channels [0, 3) of pixel (oh/2, ow/2), then
    // skip's channels [0, 2) of its own pixel.
    const Tensor y32 = y.to(DType::F32);  // same format, float to read
    const float* p = y32.data<float>();
    int64_t wrong = 0;
    for (int64_t n = 0; n < 2; ++n)
      for (int64_t oh = 0; oh < 6; ++oh)
        for (int64_t ow = 0; ow < 8; ++ow)
          for (int64_t c = 0; c < 5; ++c) {
            const double want = c < 3 ? x.at(((n * 3 + c) * 3 + oh / 2) * 4 + ow / 2)
                                      : skip.at(((n * 2 + (c - 3)) * 6 + oh) * 8 + ow);
            if (double(p[((n * 6 + oh) * 8 + ow) * 5 + c]) != want) ++wrong;
          }
    CHECK(wrong == 0);
  }
}

TEST_CASE("float64 NHWC gradient checks: max_pool2d, upsample, concat, upsample_concat") {
  Rng rng(105);
  // The checker seeds backward with an NCHW tensor: each op's NHWC output is converted to NCHW
  // (convert's backward hands the op an NHWC gradient).
  auto nchw = [](const Tensor& t) { return convert(t, DType::F64, kNCHW); };
  struct Pool {
    Shape x;
    Pool2dOptions o;
  };
  for (const Pool& c : {Pool{{2, 3, 9, 8}, Pool2dOptions::square(3, 2, 1)},
                        Pool{{1, 70, 5, 6}, Pool2dOptions::square(3, 2, 1)},
                        Pool{{1, 3, 7, 9}, Pool2dOptions{3, 2, 1, 2, 1, 0}}}) {
    Tensor x = distinct_values(c.x, rng).to(kNHWC).set_requires_grad(true);
    const Pool2dOptions o = c.o;
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return nchw(max_pool2d(in[0], o)); },
                    {x}) > 0);
  }
  Tensor u = random_tensor({2, 3, 3, 5}, rng).to(kNHWC).set_requires_grad(true);
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return nchw(upsample_nearest2x(in[0])); },
                  {u}) > 0);
  Tensor a = random_tensor({2, 2, 3, 3}, rng).to(kNHWC).set_requires_grad(true);
  Tensor b = random_tensor({2, 3, 3, 3}, rng).to(kNHWC);
  Tensor c = random_tensor({2, 1, 3, 3}, rng).to(kNHWC).set_requires_grad(true);
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return nchw(concat_channels({in[0], b, in[1]})); },
                  {a, c}) > 0);
  Tensor x = random_tensor({2, 3, 3, 4}, rng).to(kNHWC).set_requires_grad(true);
  Tensor s = random_tensor({2, 2, 6, 8}, rng).to(kNHWC).set_requires_grad(true);
  CHECK(gradcheck([&](const std::vector<Tensor>& in) {
          return nchw(upsample_nearest2x_concat(in[0], in[1]));
        },
        {x, s}) > 0);
}

namespace {

// 0/1 targets, as the UNet's masks (every dtype holds them exactly).
// The target of logits of shape s: for one channel 0 or 1 per element, for C >= 2 channels
// [N, 1, H, W] class indices; about one element in eight ignored (-1) either way.
Tensor mask_values(const Shape& s, Rng& rng) {
  const int64_t C = s[1];
  Tensor t = Tensor::empty(C == 1 ? s : Shape{s[0], 1, s[2], s[3]}, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double u = rng.uniform();
    t.set(i, u < 0.125 ? -1.0 : C == 1 ? (u < 0.5 ? 1.0 : 0.0) : double(int64_t(rng.uniform() * double(C))));
  }
  return t;
}

struct LossRun {
  Tensor loss, grad;
};

LossRun run_loss(LossKind kind, const Tensor& logits64, DType dt, MemoryFormat fmt,
                 const Tensor& target64, DType target_dt, MemoryFormat target_fmt) {
  Tensor x = like(logits64, dt, fmt).set_requires_grad(true);
  const Tensor t = like(target64, target_dt, target_fmt);
  Tape tape;
  Tensor loss;
  {
    TapeScope scope(tape);
    loss = segmentation_loss(kind, x, t);
  }
  tape.backward(loss);
  Tensor g = x.grad();
  REQUIRE(g.defined());
  CHECK(g.dtype() == dt);
  CHECK(g.format() == fmt);
  return {loss, g.clone()};
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t.at(i)));
  return m;
}

}  // namespace

TEST_CASE("losses on NHWC logits, either target format, equal NCHW to summation order") {
  Rng rng(106);
  for (const Shape& s : {Shape{2, 1, 6, 5}, Shape{2, 3, 4, 5}}) {
    CAPTURE(s[1]);
    const Tensor logits = full_values(s, rng, -4, 4), target = mask_values(s, rng);
    for (LossKind k : {LossKind::BCE, LossKind::Dice, LossKind::BCEDice}) {
      CAPTURE(loss_kind_name(k));
      for (DType dt : {DType::F64, DType::F32}) {
        CAPTURE(dtype_name(dt));
        const LossRun ref = run_loss(k, logits, dt, kNCHW, target, dt, kNCHW);
        // The per-element terms are the same numbers; only the order of the float64 sums
        // differs: n = 120 terms of magnitude <= 5 change a sum by < 120 * 2^-53 * 600, far
        // below 1e-12 relative. The float32 loss is rounded from such sums, so it can move by
        // one float32 ulp (2^-23 relative); the Dice gradient reads the float32-rounded sums
        // (one ulp each), which moves it by < 5 ulps of its largest element (the numerator
        // 2t(S + s) - (2I + s) is at least S + s, so nothing cancels).
        const double loss_tol = dt == DType::F64 ? 1e-12 : std::ldexp(1.0, -23);
        const double grad_tol = dt == DType::F64 ? 1e-12 : 8 * std::ldexp(1.0, -23);
        for (MemoryFormat lf : {kNCHW, kNHWC})
          for (MemoryFormat tf : {kNCHW, kNHWC}) {
            CAPTURE(format_name(lf));
            CAPTURE(format_name(tf));
            const LossRun r = run_loss(k, logits, dt, lf, target, dt, tf);
            CHECK(r.loss.dtype() == dt);
            CHECK(std::fabs(r.loss.item() - ref.loss.item()) <=
                  loss_tol * std::fabs(ref.loss.item()));
            CHECK(max_abs_diff(r.grad, ref.grad) <= grad_tol * max_abs(ref.grad));
          }
      }
    }
  }
}

TEST_CASE("losses with bfloat16 logits: float32 loss equal to the float32 op's, gradient rounded once") {
  Rng rng(107);
  for (const Shape& s : {Shape{2, 1, 6, 5}, Shape{2, 3, 4, 5}}) {
    CAPTURE(s[1]);
    const Tensor logits = bf16_values(s, rng, -4, 4), target = mask_values(s, rng);
    for (MemoryFormat lf : {kNCHW, kNHWC})
      for (MemoryFormat tf : {kNCHW, kNHWC})
        for (DType tdt : {DType::F32, DType::BF16}) {
          CAPTURE(format_name(lf));
          CAPTURE(format_name(tf));
          CAPTURE(dtype_name(tdt));
          // BCE and Dice: each element is computed in float32 from the same values as by the
          // float32 op, and summed in float64 in the same order: the loss is the same float32
          // number, and each gradient element the float32 one rounded once (|b - f| <= u |b|).
          for (LossKind k : {LossKind::BCE, LossKind::Dice}) {
            CAPTURE(loss_kind_name(k));
            const LossRun f = run_loss(k, logits, DType::F32, lf, target, DType::F32, tf);
            const LossRun b = run_loss(k, logits, DType::BF16, lf, target, tdt, tf);
            CHECK(b.loss.dtype() == DType::F32);
            CHECK(b.loss.item() == f.loss.item());
            check_rounded(b.grad, f.grad);
          }
          // BCE + Dice: the loss is the sum of the two equal values above. The second loss's
          // backward adds to the first's stored (rounded) gradient: b = rn(rn(f1) + f2), so
          // |b - f| <= u |b| + u |rn(f1)| (+ float32 rounding of the sum, < 2^-23 |f|), f1
          // either term (whichever the tape runs first).
          const LossRun f = run_loss(LossKind::BCEDice, logits, DType::F32, lf, target, DType::F32, tf);
          const LossRun b = run_loss(LossKind::BCEDice, logits, DType::BF16, lf, target, tdt, tf);
          const LossRun b_bce = run_loss(LossKind::BCE, logits, DType::BF16, lf, target, tdt, tf);
          const LossRun b_dice = run_loss(LossKind::Dice, logits, DType::BF16, lf, target, tdt, tf);
          CHECK(b.loss.dtype() == DType::F32);
          CHECK(b.loss.item() == f.loss.item());
          int64_t outside = 0;
          for (int64_t i = 0; i < b.grad.numel(); ++i) {
            const double first = std::max(std::fabs(b_bce.grad.at(i)), std::fabs(b_dice.grad.at(i)));
            const double bound = kU * (std::fabs(b.grad.at(i)) + first) +
                                 std::ldexp(std::fabs(f.grad.at(i)), -23);
            if (std::fabs(b.grad.at(i) - f.grad.at(i)) > bound) ++outside;
          }
          CHECK(outside == 0);
        }
  }
}

TEST_CASE("float64 gradient check of the losses on NHWC logits with an NCHW target") {
  Rng rng(108);
  for (const Shape& s : {Shape{2, 1, 4, 3}, Shape{2, 3, 3, 4}}) {
    Tensor x = random_tensor(s, rng, -3, 3).to(kNHWC).set_requires_grad(true);
    const Tensor t = mask_values(s, rng);
    for (LossKind k : {LossKind::BCE, LossKind::Dice, LossKind::BCEDice}) {
      CAPTURE(loss_kind_name(k));
      CHECK(gradcheck([&](const std::vector<Tensor>& in) { return segmentation_loss(k, in[0], t); },
                      {x}) > 0);
    }
  }
}

TEST_CASE("misc ops refuse operands that differ in memory format or dtype") {
  const Tensor a = Tensor::zeros({1, 2, 4, 4}), h = a.to(kNHWC);
  CHECK_THROWS_WITH_AS(add(a, h), doctest::Contains("memory format mismatch"), Error);
  CHECK_THROWS_WITH_AS(concat_channels({h, a}), doctest::Contains("memory format mismatch"), Error);
  CHECK_THROWS_WITH_AS(upsample_nearest2x_concat(h, Tensor::zeros({1, 1, 8, 8})),
                       doctest::Contains("memory format mismatch"), Error);
  const Tensor one = Tensor::zeros({1, 1, 4, 4});
  CHECK_THROWS_WITH_AS(bce_with_logits(one, Tensor::zeros({1, 1, 4, 4}, DType::F64)),
                       doctest::Contains("float32 or the logits' dtype"), Error);
  CHECK_THROWS_WITH_AS(dice_loss(one.to(DType::BF16), Tensor::zeros({1, 1, 4, 4}, DType::F64)),
                       doctest::Contains("float32 or the logits' dtype"), Error);
  CHECK_THROWS_WITH_AS(cross_entropy(a, Tensor::zeros({1, 1, 4, 4}, DType::F64)),
                       doctest::Contains("float32 or the logits' dtype"), Error);
}
