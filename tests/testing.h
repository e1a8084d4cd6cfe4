// Test helpers: random tensors and a central finite-difference gradient checker.
//
// gradcheck(f, inputs): y = f(inputs) on a tape; the analytic gradient of the scalar
// L = sum(y * R), R a fixed random tensor, comes from tape.backward({y}, {R}); the numeric one
// from (L(x + h) - L(x - h)) / 2h per checked element. In float64 with h = 1e-6:
//  - truncation error h²/6 |L'''| ~ 2e-13 |L'''|;
//  - rounding: L and every y_i are sums, each carrying ~ε = 2.2e-16 times the sum of the
//    magnitudes of its terms, so L carries ~ε·A with A = sum |y_i R_i| (more through deep
//    graphs); differenced over 2h that is ~ε·A/h.
// The tolerance is rtol (1e-7) relative to max(1, |analytic|, |numeric|) plus 4ε·A/h.
//
// Kinks (relu at 0, a max-pool window changing its winner) make L non-smooth: an element whose
// x ± h straddles one gets a wrong central difference. Each element is therefore
// differenced at h and at h/2; on a smooth stretch the two agree to within the tolerance, and
// across a kink at distance d they differ by ~slope_change * d / 2h, so a disagreement marks
// the element as straddling a kink and it is skipped (and counted; a test bounds the count).
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "engine/random.h"
#include "engine/tape.h"
#include "engine/tensor.h"

namespace unetcu::testing {

inline Tensor random_tensor(const Shape& shape, Rng& rng, double lo = -1, double hi = 1,
                            DType dtype = DType::F64) {
  Tensor t = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.uniform(lo, hi));
  return t;
}

inline double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.at(i) * b.at(i);
  return s;
}

inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(a.at(i) - b.at(i)));
  return m;
}

struct GradcheckOptions {
  double h = 1e-6;
  double rtol = 1e-7;
  int max_checks_per_input = 60;  // random subset of elements for large inputs
  uint64_t seed = 7;
  double max_kink_fraction = 0;  // share of checked elements that may be skipped as kinks
};

// Checks d sum(f(inputs) * R) / d inputs[i] for every input that requires a gradient.
// Returns the number of elements compared (checked minus skipped kinks).
inline int gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                     std::vector<Tensor> inputs, const GradcheckOptions& opt = {}) {
  Rng rng(opt.seed);
  for (Tensor& t : inputs)
    if (t.requires_grad()) t.zero_grad();
  Tensor y;
  Tape tape;
  {
    TapeScope scope(tape);
    y = f(inputs);
  }
  REQUIRE(y.requires_grad());
  Tensor R = random_tensor(y.shape(), rng, -1, 1, y.dtype());
  tape.backward({y}, {R});
  auto L = [&]() { return dot(f(inputs), R); };  // no tape active: nothing recorded
  double A = 0;  // sum |y_i R_i|: the scale of L's rounding error
  for (int64_t i = 0; i < y.numel(); ++i) A += std::fabs(y.at(i) * R.at(i));
  const double noise = 4 * 2.2e-16 * A / opt.h;
  int checked = 0, kinks = 0;
  for (size_t k = 0; k < inputs.size(); ++k) {
    Tensor& x = inputs[k];
    if (!x.defined() || !x.requires_grad()) continue;
    Tensor g = x.grad();
    REQUIRE_MESSAGE(g.defined(), "input ", k, " got no gradient");
    std::vector<int64_t> idx;
    if (x.numel() <= opt.max_checks_per_input) {
      for (int64_t i = 0; i < x.numel(); ++i) idx.push_back(i);
    } else {
      for (int i = 0; i < opt.max_checks_per_input; ++i) idx.push_back(rng.below(x.numel()));
    }
    for (int64_t i : idx) {
      const double orig = x.at(i);
      auto central = [&](double h) {
        x.set(i, orig + h);
        const double lp = L();
        x.set(i, orig - h);
        const double lm = L();
        x.set(i, orig);
        return (lp - lm) / (2 * h);
      };
      const double numeric = central(opt.h), half = central(opt.h / 2);
      const double analytic = g.at(i);
      const double tol = opt.rtol * std::max({1.0, std::fabs(numeric), std::fabs(analytic)}) + noise;
      ++checked;
      // The h/2 difference carries twice the rounding noise: 3 tol bounds the two together.
      if (std::fabs(numeric - half) > 3 * tol) {  // straddles a kink (see above)
        ++kinks;
        continue;
      }
      INFO("input ", k, " element ", i, ": analytic ", analytic, " numeric ", numeric);
      CHECK(std::fabs(analytic - numeric) <= tol);
    }
  }
  INFO(kinks, " of ", checked, " elements straddled a kink");
  CHECK(kinks <= opt.max_kink_fraction * checked);
  return checked - kinks;
}

}  // namespace unetcu::testing
