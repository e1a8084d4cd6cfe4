// Fused batch norm + ReLU and batch norm + residual add + ReLU (engine/ops/batchnorm.cpp):
// each equals its unfused composition relu(add(batch_norm2d(x), residual)) forward and
// backward, passes the finite-difference check, agrees in float32 with float64, and computes
// its training statistics well conditioned (shifted sums) however large the channel's mean and
// however many values the channel holds.
#include <cmath>
#include <vector>

#include "bn_stats.h"
#include "engine/ops.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

// ‖a − b‖ / ‖b‖ (‖a‖ when b is zero).
double rel_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  double num = 0, den = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    num += std::pow(a.at(i) - b.at(i), 2);
    den += b.at(i) * b.at(i);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

struct Inputs {
  Tensor x, gamma, beta, residual, rm, rv;
};

Inputs make_inputs(const Shape& s, Rng& rng, DType dt = DType::F64) {
  const int64_t C = s[1];
  Inputs in;
  in.x = random_tensor(s, rng, -2, 3, dt);
  in.gamma = random_tensor({C}, rng, 0.5, 1.5, dt);
  in.beta = random_tensor({C}, rng, -0.5, 0.5, dt);
  in.residual = random_tensor(s, rng, -1, 1, dt);
  in.rm = random_tensor({C}, rng, -1, 1, dt);
  in.rv = random_tensor({C}, rng, 0.5, 2, dt);
  return in;
}

// The op under test (fused or not) on clones of the inputs, forward and then backward of
// sum(y * R) twice (the second pass accumulates into the leaves' gradients): y, the running
// statistics and the gradients of x, gamma, beta and the residual.
struct Result {
  Tensor y, rm, rv, gx, ggamma, gbeta, gres;
};

Result run(const Inputs& in, bool fused, bool with_residual, bool training, const Tensor& R) {
  Tensor x = in.x.clone().set_requires_grad(true);
  Tensor gamma = in.gamma.clone().set_requires_grad(true);
  Tensor beta = in.beta.clone().set_requires_grad(true);
  Tensor res = in.residual.clone().set_requires_grad(true);
  Result r;
  r.rm = in.rm.clone();
  r.rv = in.rv.clone();
  for (int pass = 0; pass < 2; ++pass) {
    Tape tape;
    {
      TapeScope scope(tape);
      if (fused) {
        r.y = with_residual
                  ? batch_norm_add_relu(x, gamma, beta, res, r.rm, r.rv, training, 0.1, 1e-5)
                  : batch_norm_relu(x, gamma, beta, r.rm, r.rv, training, 0.1, 1e-5);
      } else {
        Tensor h = batch_norm2d(x, gamma, beta, r.rm, r.rv, training, 0.1, 1e-5);
        r.y = relu(with_residual ? add(h, res) : h);
      }
    }
    tape.backward({r.y}, {R});
  }
  r.gx = x.grad();
  r.ggamma = gamma.grad();
  r.gbeta = beta.grad();
  if (with_residual) r.gres = res.grad();
  return r;
}

const Shape kOddShapes[] = {{1, 1, 3, 5}, {2, 3, 5, 7}, {3, 5, 7, 3}, {1, 4, 11, 13},
                            {3, 2, 1, 9}, {2, 5, 9, 1}, {1, 3, 2, 1}};

}  // namespace

TEST_CASE("fused batch norm (+ add) + relu equals the unfused ops, float64, forward and backward") {
  Rng rng(101);
  for (const Shape& s : kOddShapes)
    for (bool training : {true, false})
      for (bool with_residual : {false, true}) {
        CAPTURE(shape_str(s));
        CAPTURE(training);
        CAPTURE(with_residual);
        const Inputs in = make_inputs(s, rng);
        const Tensor R = random_tensor(s, rng);
        const Result f = run(in, true, with_residual, training, R);
        const Result u = run(in, false, with_residual, training, R);
        // Same-order sums in float64: the two differ only by the order of the statistics'
        // additions (plane sums combined, against one sum per channel).
        CHECK(rel_diff(f.y, u.y) < 1e-12);
        CHECK(rel_diff(f.rm, u.rm) < 1e-12);
        CHECK(rel_diff(f.rv, u.rv) < 1e-12);
        CHECK(rel_diff(f.gx, u.gx) < 1e-12);
        CHECK(rel_diff(f.ggamma, u.ggamma) < 1e-12);
        CHECK(rel_diff(f.gbeta, u.gbeta) < 1e-12);
        if (with_residual) CHECK(rel_diff(f.gres, u.gres) < 1e-12);
        if (!training) {  // eval never touches the running statistics
          CHECK(max_abs_diff(f.rm, in.rm) == 0);
          CHECK(max_abs_diff(f.rv, in.rv) == 0);
        }
      }
}

TEST_CASE("fused batch norm ops: gradients equal finite differences") {
  Rng rng(102);
  for (bool training : {true, false})
    for (bool with_residual : {false, true}) {
      CAPTURE(training);
      CAPTURE(with_residual);
      Inputs in = make_inputs({2, 3, 5, 3}, rng);
      std::vector<Tensor> args = {in.x.set_requires_grad(true), in.gamma.set_requires_grad(true),
                                  in.beta.set_requires_grad(true)};
      if (with_residual) args.push_back(in.residual.set_requires_grad(true));
      // Statistics from a copy each time: every forward of the check sees the same ones.
      gradcheck([&](const std::vector<Tensor>& v) {
        Tensor rm = in.rm.clone(), rv = in.rv.clone();
        return with_residual ? batch_norm_add_relu(v[0], v[1], v[2], v[3], rm, rv, training)
                             : batch_norm_relu(v[0], v[1], v[2], rm, rv, training);
      }, args);
    }
}

TEST_CASE("batch_norm_add_relu with the input as its own residual") {
  Rng rng(103);
  Inputs in = make_inputs({2, 2, 4, 3}, rng);
  in.x.set_requires_grad(true);
  in.gamma.set_requires_grad(true);
  in.beta.set_requires_grad(true);
  for (bool training : {true, false}) {
    CAPTURE(training);
    gradcheck([&](const std::vector<Tensor>& v) {
      Tensor rm = in.rm.clone(), rv = in.rv.clone();
      return batch_norm_add_relu(v[0], v[1], v[2], v[0], rm, rv, training);
    }, {in.x, in.gamma, in.beta});
  }
}

TEST_CASE("fused batch norm ops: the backward masks the gradient where the output is zero") {
  // Half the outputs are clamped to zero: a backward that forgets the ReLU mask passes the
  // whole gradient there, to the residual and (through the batch norm) to x, gamma and beta.
  Rng rng(104);
  const Shape s = {2, 3, 6, 5};
  const Inputs in = make_inputs(s, rng);
  const Tensor R = random_tensor(s, rng);
  for (bool training : {true, false}) {
    CAPTURE(training);
    const Result f = run(in, true, true, training, R);
    const Result u = run(in, false, true, training, R);
    int64_t masked = 0;
    for (int64_t i = 0; i < f.y.numel(); ++i) {
      if (f.y.at(i) > 0) continue;
      ++masked;
      CHECK(f.gres.at(i) == 0);
    }
    CHECK(masked > f.y.numel() / 10);
    CHECK(rel_diff(f.gx, u.gx) < 1e-12);
    CHECK(rel_diff(f.ggamma, u.ggamma) < 1e-12);
    CHECK(rel_diff(f.gbeta, u.gbeta) < 1e-12);
    const Result g = run(in, true, false, training, R);
    const Result v = run(in, false, false, training, R);
    CHECK(rel_diff(g.gx, v.gx) < 1e-12);
    CHECK(rel_diff(g.ggamma, v.ggamma) < 1e-12);
  }
}

TEST_CASE("fused batch norm ops in float32 agree with float64") {
  Rng rng(105);
  const Shape s = {3, 5, 13, 11};
  const Inputs in64 = make_inputs(s, rng);
  Inputs in32 = in64;
  for (Tensor* t : {&in32.x, &in32.gamma, &in32.beta, &in32.residual, &in32.rm, &in32.rv})
    *t = t->to(DType::F32);
  const Tensor R = random_tensor(s, rng);
  for (bool training : {true, false})
    for (bool with_residual : {false, true}) {
      CAPTURE(training);
      CAPTURE(with_residual);
      const Result a = run(in32, true, with_residual, training, R.to(DType::F32));
      const Result b = run(in64, true, with_residual, training, R);
      // float32 epsilon 6e-8; sums over 429 values per channel, accumulated in double.
      CHECK(rel_diff(a.y.to(DType::F64), b.y) < 1e-5);
      CHECK(rel_diff(a.rm.to(DType::F64), b.rm) < 1e-6);
      CHECK(rel_diff(a.rv.to(DType::F64), b.rv) < 1e-6);
      CHECK(rel_diff(a.gx.to(DType::F64), b.gx) < 1e-5);
      CHECK(rel_diff(a.ggamma.to(DType::F64), b.ggamma) < 1e-5);
      CHECK(rel_diff(a.gbeta.to(DType::F64), b.gbeta) < 1e-5);
      if (with_residual) CHECK(rel_diff(a.gres.to(DType::F64), b.gres) < 1e-5);
    }
}

namespace {

// The fused op's batch statistics: with momentum 1 the running statistics become the batch
// mean and the unbiased batch variance, here turned back into the biased one.
void fused_stats(const Tensor& x, std::vector<double>* mean, std::vector<double>* var) {
  const int64_t C = x.dim(1);
  const double M = double(x.numel() / C);
  Tensor rm = Tensor::zeros({C}, x.dtype()), rv = Tensor::zeros({C}, x.dtype());
  batch_norm_relu(x, Tensor::full({C}, 1.0, x.dtype()), Tensor::zeros({C}, x.dtype()), rm, rv,
                  true, 1.0);
  mean->resize(C);
  var->resize(C);
  for (int64_t c = 0; c < C; ++c) {
    (*mean)[c] = rm.at(c);
    (*var)[c] = rv.at(c) * (M - 1) / M;
  }
}

// The largest relative error of each variance over x's channels against the two-pass
// reference: the naive one-pass E[x²] - E[x]² with sums in T (what a one-pass kernel in T
// would compute), and the fused op's shifted sums. The fused op's means are checked on the
// way, to `mean_tol` relative.
struct VarianceErrors {
  double naive = 0, shifted = 0;
};
template <class T>
VarianceErrors variance_errors(const Tensor& x, double mean_tol) {
  std::vector<double> m_ref, v_ref, m, v;
  two_pass_stats(x, &m_ref, &v_ref);
  fused_stats(x, &m, &v);
  VarianceErrors e;
  e.naive = naive_variance_error<T>(x, v_ref);
  for (size_t c = 0; c < v.size(); ++c) {
    e.shifted = std::max(e.shifted, std::fabs(v[c] - v_ref[c]) / v_ref[c]);
    CHECK(std::fabs(m[c] - m_ref[c]) <= mean_tol * std::fabs(m_ref[c]));
  }
  return e;
}

}  // namespace

TEST_CASE("training statistics stay exact with a large mean: shifted sums, not E[x²] - E[x]²") {
  Rng rng(106);
  SUBCASE("float32 values 1e4 + N(0, 1)") {
    // Single-pass E[x²] - E[x]² with float32 sums (what a float32 one-pass kernel would
    // compute) gets the variance wrong by 165 relative here (E[x²] = 1e8 has an ulp of 8),
    // while the shifted sums are off by 4.9e-8 (float32's rounding of the running variance).
    Tensor x = Tensor::empty({2, 3, 48, 40}, DType::F32);
    for (int64_t i = 0; i < x.numel(); ++i) x.set(i, 1e4 + rng.normal());
    const VarianceErrors e = variance_errors<float>(x, 1e-7);
    INFO("variance relative error: naive float32 ", e.naive, ", shifted sums ", e.shifted);
    CHECK(e.naive > 1);  // the naive formula fails: this input is a real test
    CHECK(e.shifted < 1e-6);
  }
  SUBCASE("float64 values 1e8 + N(0, 1)") {
    // In double, E[x²] = 1e16 has an ulp of 2: E[x²] - E[x]² (double sums) is wrong by 13
    // relative here, while the shifted sums are off by 2e-15.
    Tensor x = Tensor::empty({3, 2, 17, 19}, DType::F64);
    for (int64_t i = 0; i < x.numel(); ++i) x.set(i, 1e8 + rng.normal());
    const VarianceErrors e = variance_errors<double>(x, 1e-14);
    INFO("variance relative error: naive float64 ", e.naive, ", shifted sums ", e.shifted);
    CHECK(e.naive > 1e-3);
    CHECK(e.shifted < 1e-12);
  }
}

TEST_CASE("training statistics of a channel of 32 M values (float32)") {
  // 2 x 4096 x 4096 values of 1e3 + U(-1, 1) in one channel: the sums of 2^25 values,
  // accumulated in double per plane and combined, against a two-pass double reference.
  Rng rng(107);
  Tensor x = Tensor::empty({2, 1, 4096, 4096}, DType::F32);
  float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] = float(1e3 + rng.uniform(-1, 1));
  std::vector<double> m_ref, v_ref, m, v;
  two_pass_stats(x, &m_ref, &v_ref);
  fused_stats(x, &m, &v);
  CHECK(std::fabs(m[0] - m_ref[0]) <= 1e-7 * m_ref[0]);
  CHECK(std::fabs(v[0] - v_ref[0]) <= 1e-6 * v_ref[0]);
}
