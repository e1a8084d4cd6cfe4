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
