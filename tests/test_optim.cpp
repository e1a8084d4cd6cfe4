// Optimizers against hand-computed steps, BN running statistics, gradient accumulation.
#include "engine/module.h"
#include "engine/optim.h"
#include "kernels/launchers.h"

#include <cmath>
#include <cstring>
#include "engine/tape.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {
void set_grad(Tensor& p, const std::vector<double>& g) {
  p.zero_grad();
  Tape tape;
  Tensor y;
  {
    TapeScope s(tape);
    y = scale(p, 1.0);
  }
  tape.backward({y}, {Tensor::from_vector(p.shape(), g, p.dtype())});
}
}  // namespace

TEST_CASE("Adam: two steps against the torch.optim.Adam formulas, with and without weight decay") {
  for (double wd : {0.0, 0.1}) {
    Tensor p = Tensor::from_vector({3}, {1.0, -2.0, 0.5}, DType::F64).set_requires_grad(true);
    AdamOptions o;
    o.lr = 0.01;
    o.weight_decay = wd;
    Adam adam({p}, o);
    const std::vector<std::vector<double>> grads = {{0.5, -0.1, 0.0}, {-0.2, 0.3, 1.0}};
    std::vector<double> ref = {1.0, -2.0, 0.5}, m(3, 0), v(3, 0);
    for (int t = 1; t <= 2; ++t) {
      set_grad(p, grads[t - 1]);
      adam.step();
      for (int i = 0; i < 3; ++i) {
        const double g = grads[t - 1][i] + wd * ref[i];
        m[i] = 0.9 * m[i] + 0.1 * g;
        v[i] = 0.999 * v[i] + 0.001 * g * g;
        const double mhat = m[i] / (1 - std::pow(0.9, t)), vhat = v[i] / (1 - std::pow(0.999, t));
        ref[i] -= 0.01 * mhat / (std::sqrt(vhat) + 1e-8);
      }
      for (int i = 0; i < 3; ++i) CHECK(p.at(i) == doctest::Approx(ref[i]).epsilon(1e-12));
    }
  }
  // Step one moves each weight by lr * sign(g) (mhat / sqrt(vhat) = g / |g|).
  Tensor q = Tensor::from_vector({2}, {1.0, 1.0}, DType::F64).set_requires_grad(true);
  Adam a2({q}, AdamOptions{});
  set_grad(q, {3.0, -0.001});
  a2.step();
  CHECK(q.at(0) == doctest::Approx(1.0 - 1e-3).epsilon(1e-9));
  CHECK(q.at(1) == doctest::Approx(1.0 + 1e-3).epsilon(1e-6));
}

TEST_CASE("SGD with momentum: two steps by hand, parameters without a gradient are skipped") {
  Tensor p = Tensor::from_vector({2}, {1.0, -1.0}, DType::F64).set_requires_grad(true);
  Tensor untouched = Tensor::from_vector({1}, {5.0}, DType::F64).set_requires_grad(true);
  SgdOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.weight_decay = 0.01;
  SGD sgd({p, untouched}, o);
  set_grad(p, {0.5, 2.0});
  sgd.step();
  // g = 0.5 + 0.01*1 = 0.51; buf = g; p = 1 - 0.1*0.51
  CHECK(p.at(0) == doctest::Approx(0.949).epsilon(1e-12));
  CHECK(p.at(1) == doctest::Approx(-1.0 - 0.1 * (2.0 - 0.01)).epsilon(1e-12));
  set_grad(p, {-1.0, 0.0});
  sgd.step();
  const double g0 = -1.0 + 0.01 * 0.949, buf0 = 0.9 * 0.51 + g0;
  CHECK(p.at(0) == doctest::Approx(0.949 - 0.1 * buf0).epsilon(1e-12));
  CHECK(untouched.at(0) == 5.0);
}

TEST_CASE("BatchNorm2d running statistics after two training steps, then eval") {
  Rng rng(4);
  BatchNorm2d bn(3, DType::F64);
  Tensor x1 = random_tensor({4, 3, 2, 5}, rng, -1, 3), x2 = random_tensor({2, 3, 3, 3}, rng, -2, 1);
  bn.forward(x1);
  bn.forward(x2);
  CHECK(bn.num_batches_tracked == 2);
  for (int64_t c = 0; c < 3; ++c) {
    double rm = 0, rv = 1;
    for (const Tensor* x : {&x1, &x2}) {
      const int64_t N = x->dim(0), HW = x->dim(2) * x->dim(3), M = N * HW;
      double mean = 0, sq = 0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t q = 0; q < HW; ++q) mean += x->at((n * 3 + c) * HW + q);
      mean /= M;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t q = 0; q < HW; ++q) sq += std::pow(x->at((n * 3 + c) * HW + q) - mean, 2);
      rm = 0.9 * rm + 0.1 * mean;
      rv = 0.9 * rv + 0.1 * sq / (M - 1);
    }
    CHECK(bn.running_mean.at(c) == doctest::Approx(rm).epsilon(1e-13));
    CHECK(bn.running_var.at(c) == doctest::Approx(rv).epsilon(1e-13));
  }
  bn.eval();
  Tensor y = bn.forward(x1);
  CHECK(bn.num_batches_tracked == 2);
  CHECK(y.at(7) == doctest::Approx((x1.at(7) - bn.running_mean.at(0)) /
                                   std::sqrt(bn.running_var.at(0) + 1e-5)).epsilon(1e-12));
}

TEST_CASE("gradient accumulation over two half-batches equals one full batch (no BN)") {
  Rng rng(5);
  Rng init(6);
  Conv2d c1(3, 4, 3, 1, 1, true, Init::PyTorchDefault, init, DType::F64);
  Conv2d c2(4, 1, 3, 2, 1, true, Init::PyTorchDefault, init, DType::F64);
  Tensor x = random_tensor({4, 3, 8, 8}, rng);
  Tensor t = Tensor::empty({4, 1, 4, 4}, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.uniform() < 0.5);
  auto params = [&] { return std::vector<Tensor>{c1.weight, c1.bias, c2.weight, c2.bias}; };
  auto run = [&](int64_t lo, int64_t hi, double weight) {
    Tensor xs = Tensor::empty({hi - lo, 3, 8, 8}, DType::F64), ts = Tensor::empty({hi - lo, 1, 4, 4}, DType::F64);
    for (int64_t i = 0; i < xs.numel(); ++i) xs.set(i, x.at(lo * 192 + i));
    for (int64_t i = 0; i < ts.numel(); ++i) ts.set(i, t.at(lo * 16 + i));
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      loss = scale(bce_with_logits(c2.forward(relu(c1.forward(xs))), ts), weight);
    }
    tape.backward(loss);
  };
  run(0, 4, 1.0);
  std::vector<Tensor> full;
  for (Tensor& p : params()) {
    full.push_back(p.grad().clone());
    p.zero_grad();
  }
  run(0, 2, 0.5);
  run(2, 4, 0.5);
  auto ps = params();
  for (size_t i = 0; i < ps.size(); ++i) CHECK(max_abs_diff(ps[i].grad(), full[i]) < 1e-14);
}

TEST_CASE("Adam over many parameters in one pass gives the bits of one pass per parameter") {
  // adam_update_many cuts the tensors into chunks of one parallel loop; every element gets the
  // same arithmetic as adam_update, so the results must be identical, not merely close.
  for (DType dt : {DType::F32, DType::F64}) {
    CAPTURE(dtype_name(dt));
    const std::vector<int64_t> sizes = {1, 7, 16384, 16385, 40000, 3};  // across chunk edges
    std::vector<Tensor> pa, pb, ga, ma, va, mb, vb;
    std::vector<kernels::AdamTensor> many;
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::vector<double> p(size_t(sizes[k])), g(p.size()), m(p.size()), v(p.size());
      for (size_t i = 0; i < p.size(); ++i) {
        p[i] = std::sin(0.37 * double(i + 11 * k));
        g[i] = std::cos(0.91 * double(i + 5 * k)) * 1e-2;
        m[i] = 1e-3 * std::sin(double(i));
        v[i] = 1e-5 * (1.5 + std::cos(double(i)));
      }
      const Shape s = {sizes[k]};
      pa.push_back(Tensor::from_vector(s, p, dt));
      pb.push_back(Tensor::from_vector(s, p, dt));
      ga.push_back(Tensor::from_vector(s, g, dt));
      ma.push_back(Tensor::from_vector(s, m, dt));
      mb.push_back(Tensor::from_vector(s, m, dt));
      va.push_back(Tensor::from_vector(s, v, dt));
      vb.push_back(Tensor::from_vector(s, v, dt));
    }
    for (size_t k = 0; k < sizes.size(); ++k) {
      // Each tensor its own step count (bias corrections) and weight decay.
      const double t = double(k + 1);
      const kernels::AdamStep s{1e-3, 0.9, 0.999, 1e-8, k % 2 ? 0.01 : 0.0, 1 - std::pow(0.9, t),
                                1 - std::pow(0.999, t)};
      kernels::cpu::adam_update(pa[k], ga[k], ma[k], va[k], s);
      many.push_back({pb[k], ga[k], mb[k], vb[k], s});
    }
    kernels::cpu::adam_update_many(many);
    for (size_t k = 0; k < sizes.size(); ++k) {
      CAPTURE(sizes[k]);
      CHECK(std::memcmp(pa[k].raw(), pb[k].raw(), pa[k].nbytes()) == 0);
      CHECK(std::memcmp(ma[k].raw(), mb[k].raw(), ma[k].nbytes()) == 0);
      CHECK(std::memcmp(va[k].raw(), vb[k].raw(), va[k].nbytes()) == 0);
      CHECK(max_abs_diff(pa[k], pb[k]) == 0);
    }
    // The step moved the parameters (a pass that did nothing would also compare equal to one
    // that did nothing).
    CHECK(pa[2].at(5) != std::sin(0.37 * double(5 + 22)));
  }
}

namespace {
// Tensors of sizes across the square sum's chunk edges, values of mixed sign and magnitude.
std::vector<Tensor> clip_tensors(DType dt, double magnitude) {
  const std::vector<int64_t> sizes = {1, 4095, 4096, 4097, 10000, 3};
  std::vector<Tensor> out;
  for (size_t k = 0; k < sizes.size(); ++k) {
    std::vector<double> v(size_t(sizes[k]));
    for (size_t i = 0; i < v.size(); ++i) v[i] = magnitude * std::sin(0.37 * double(i) + 1.3 * double(k));
    out.push_back(Tensor::from_vector({sizes[k]}, v, dt));
  }
  return out;
}

double square_sum_by_hand(const std::vector<Tensor>& xs) {  // long double, element by element
  long double s = 0;
  for (const Tensor& x : xs)
    for (double v : x.to_vector()) s += (long double)v * v;
  return double(s);
}
}  // namespace

TEST_CASE("gradient clipping: the square sum of many tensors, the same bits for any thread count") {
  for (DType dt : {DType::F32, DType::F64}) {
    CAPTURE(dtype_name(dt));
    const std::vector<Tensor> xs = clip_tensors(dt, 0.5);
    const std::vector<TensorRef> refs(xs.begin(), xs.end());
    Tensor a = Tensor::empty({1}, DType::F64), b = Tensor::empty({1}, DType::F64);
    const int threads = cpu_threads();
    set_cpu_threads(1);
    kernels::cpu::square_sum_many(refs, a);
    set_cpu_threads(3);
    kernels::cpu::square_sum_many(refs, b);
    set_cpu_threads(threads);
    // Float64 sums of about 2·10⁴ terms of one sign: relative error below 2·10⁴ · 2⁻⁵³ ≈ 2e-12
    // (the float32 values are exact in float64, so both dtypes are held to it).
    CHECK(a.item() == doctest::Approx(square_sum_by_hand(xs)).epsilon(1e-12));
    CHECK(std::memcmp(a.raw(), b.raw(), sizeof(double)) == 0);
  }
  Tensor none = Tensor::full({1}, 7.0, DType::F64);
  kernels::cpu::square_sum_many({}, none);
  CHECK(none.item() == 0);  // written, not accumulated
}

TEST_CASE("gradient clipping: scaled by max_norm / (norm + 1e-6) when the norm is larger, untouched when not") {
  for (DType dt : {DType::F32, DType::F64}) {
    CAPTURE(dtype_name(dt));
    const std::vector<Tensor> xs = clip_tensors(dt, 0.5);
    const double sq = square_sum_by_hand(xs), norm = std::sqrt(sq);
    REQUIRE(norm > 10);
    // Below the norm: every element times max_norm / (norm + 1e-6), as clip_grad_norm_.
    std::vector<Tensor> clipped;
    for (const Tensor& x : xs) clipped.push_back(x.clone());
    const Tensor sum = Tensor::full({1}, sq, DType::F64);
    kernels::cpu::clip_scale_many(std::vector<TensorRef>(clipped.begin(), clipped.end()), sum, 2.0);
    const double coef = 2.0 / (norm + 1e-6);
    const double tol = dt == DType::F64 ? 1e-15 : 1e-7;  // one rounding of the product
    for (size_t k = 0; k < xs.size(); ++k) {
      const std::vector<double> before = xs[k].to_vector(), after = clipped[k].to_vector();
      for (size_t i = 0; i < before.size(); ++i)
        REQUIRE(after[i] == doctest::Approx(before[i] * coef).epsilon(tol).scale(1e-30));
    }
    CHECK(square_sum_by_hand(clipped) == doctest::Approx(4.0).epsilon(1e-6));
    // At or above the norm: the same bits (PyTorch multiplies by exactly 1).
    for (double max_norm : {norm + 1.0, 1e9}) {
      std::vector<Tensor> kept;
      for (const Tensor& x : xs) kept.push_back(x.clone());
      kernels::cpu::clip_scale_many(std::vector<TensorRef>(kept.begin(), kept.end()), sum, max_norm);
      for (size_t k = 0; k < xs.size(); ++k) CHECK(std::memcmp(kept[k].raw(), xs[k].raw(), xs[k].nbytes()) == 0);
    }
    // A non-finite norm passes through (torch.clamp keeps NaN): the gradients become NaN.
    std::vector<Tensor> bad{xs[0].clone()};
    kernels::cpu::clip_scale_many({bad[0]}, Tensor::full({1}, std::nan(""), DType::F64), 1.0);
    CHECK(std::isnan(bad[0].at(0)));
  }
}

TEST_CASE("gradient clipping in the optimizer: clip_grad_norm_ then SGD, by hand, also split over two optimizers") {
  const std::vector<double> g1 = {3.0, -4.0}, g2 = {12.0};  // total norm 13
  for (double max_norm : {0.0, 6.5, 13.5}) {
    CAPTURE(max_norm);
    const double coef = max_norm == 0 ? 1.0 : std::min(1.0, max_norm / (13.0 + 1e-6));
    // One optimizer over both parameters.
    Tensor p = Tensor::from_vector({2}, {1.0, 1.0}, DType::F64).set_requires_grad(true);
    Tensor q = Tensor::from_vector({1}, {-1.0}, DType::F64).set_requires_grad(true);
    SgdOptions o;
    o.lr = 0.1;
    o.momentum = 0;
    SGD sgd({p, q}, o);
    sgd.set_max_grad_norm(max_norm);
    set_grad(p, g1);
    set_grad(q, g2);
    sgd.step();
    CHECK(p.at(0) == doctest::Approx(1.0 - 0.1 * coef * 3.0).epsilon(1e-15));
    CHECK(p.at(1) == doctest::Approx(1.0 + 0.1 * coef * 4.0).epsilon(1e-15));
    CHECK(q.at(0) == doctest::Approx(-1.0 - 0.1 * coef * 12.0).epsilon(1e-15));
    if (max_norm == 0) continue;
    // Two optimizers (two pipeline stages): each alone would clip by its own norm (5 and 12);
    // given the sum of both square sums they clip by the model's, 13.
    Tensor p2 = Tensor::from_vector({2}, {1.0, 1.0}, DType::F64).set_requires_grad(true);
    Tensor q2 = Tensor::from_vector({1}, {-1.0}, DType::F64).set_requires_grad(true);
    SGD a({p2}, o), b({q2}, o);
    a.set_max_grad_norm(max_norm);
    b.set_max_grad_norm(max_norm);
    set_grad(p2, g1);
    set_grad(q2, g2);
    const double sa = a.grad_square_sum().item(), sb = b.grad_square_sum().item();
    CHECK(sa == 25.0);
    CHECK(sb == 144.0);
    const Tensor total = Tensor::full({1}, sa + sb, DType::F64);
    a.step_clipped_by(total);
    b.step_clipped_by(total);
    CHECK(std::memcmp(p2.raw(), p.raw(), p.nbytes()) == 0);
    CHECK(std::memcmp(q2.raw(), q.raw(), q.nbytes()) == 0);
  }
  // The record of clipped steps: norms 13 (scaled down to 6.5) and 5 (kept), then a new record.
  {
    Tensor p = Tensor::from_vector({2}, {1.0, 1.0}, DType::F64).set_requires_grad(true);
    SGD sgd({p}, SgdOptions{});
    sgd.set_max_grad_norm(6.5);
    CHECK(sgd.take_clip_stats().steps == 0);
    set_grad(p, {5.0, -12.0});
    sgd.step();
    set_grad(p, {3.0, 4.0});
    sgd.step();
    const Optimizer::ClipStats c = sgd.take_clip_stats();
    CHECK(c.steps == 2);
    CHECK(c.clipped == 1);
    CHECK(c.norm_mean == doctest::Approx(9.0).epsilon(1e-15));
    CHECK(c.norm_max == doctest::Approx(13.0).epsilon(1e-15));
    set_grad(p, {0.0, 1.0});
    sgd.step();
    const Optimizer::ClipStats next = sgd.take_clip_stats();
    CHECK(next.steps == 1);
    CHECK(next.clipped == 0);
    CHECK(next.norm_max == doctest::Approx(1.0).epsilon(1e-15));
  }
  // An infinite largest norm measures and records, and scales by 1: the step is the unclipped
  // one, bit for bit, also given a larger square sum (two optimizers'); an infinite norm makes
  // the gradients NaN, as PyTorch's factor inf / inf does.
  {
    Tensor p = Tensor::from_vector({2}, {1.0, 1.0}, DType::F64).set_requires_grad(true);
    Tensor q = Tensor::from_vector({2}, {1.0, 1.0}, DType::F64).set_requires_grad(true);
    SgdOptions o;
    o.lr = 0.1;
    SGD measured({p}, o), plain({q}, o);
    measured.set_max_grad_norm(INFINITY);
    for (const std::vector<double>& g : {std::vector<double>{5.0, -12.0}, std::vector<double>{3.0, 4.0}}) {
      set_grad(p, g);
      set_grad(q, g);
      measured.step();
      plain.step();
    }
    CHECK(std::memcmp(p.raw(), q.raw(), p.nbytes()) == 0);
    set_grad(p, {1e30, 0.0});
    set_grad(q, {1e30, 0.0});
    measured.step_clipped_by(Tensor::full({1}, 4e60, DType::F64));
    plain.step();
    CHECK(std::memcmp(p.raw(), q.raw(), p.nbytes()) == 0);
    const Optimizer::ClipStats c = measured.take_clip_stats();
    CHECK(c.steps == 3);
    CHECK(c.clipped == 0);
    CHECK(c.norm_max == doctest::Approx(2e30).epsilon(1e-15));
    CHECK(c.norm_mean == doctest::Approx((13.0 + 5.0 + 2e30) / 3).epsilon(1e-15));
    set_grad(p, {1.0, 1.0});
    measured.step_clipped_by(Tensor::full({1}, INFINITY, DType::F64));
    CHECK(std::isnan(p.at(0)));
  }
  Tensor r = Tensor::from_vector({1}, {1.0}, DType::F64).set_requires_grad(true);
  SGD s({r}, SgdOptions{});
  CHECK_THROWS_WITH(s.set_max_grad_norm(-1), doctest::Contains("largest gradient norm"));
  CHECK_THROWS_WITH(s.set_max_grad_norm(std::nan("")), doctest::Contains("largest gradient norm"));
  CHECK_THROWS_WITH(s.step_clipped_by(Tensor::full({1}, 1.0, DType::F64)), doctest::Contains("needs a largest"));
}
