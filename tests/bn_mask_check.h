// The fused batch_norm_relu's backward recomputes its ReLU mask from x, gamma and beta instead of
// reading y (bodies/batchnorm.h, bn_relu_passes). This check holds the recomputation to
// the forward's bits on inputs built to sit on the edges where a recomputation that differs
// from the forward in any rounding gets the mask wrong:
//  - cancellation: in channels 1..C-2, half the values are x0, and beta = -fl(t0 * gamma) with
//    t0 = fl(x0 * invstd) the forward's normalised x0, so bn(x0) = t0 * gamma + beta is the
//    rounding error of the product, positive or negative by channel, when the multiply-add is
//    fused, and exactly 0 when it is not: a backward that rounds differently from the forward
//    there flips the mask of those elements;
//  - bfloat16's zero: channel 0 has gamma = 1e-39 and beta = 0, so bn(x) = 1e-39 * t, and about
//    half of its positive values are under 2^-134, which bf16 rounds to 0 (y = 0: masked);
//  - the last channel is ordinary.
// In eval mode dx = g * gamma * invstd element by element, g = dy where y > 0: with dy never
// zero, dx != 0 exactly where y > 0. Shared by the CPU tests (tests/test_bn_layout.cpp) and the
// CUDA suite (tests/cuda/test_cuda_bn_layout.cpp).
#pragma once
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/ops.h"
#include "engine/random.h"
#include "engine/tape.h"

namespace unetcu::testing_bn {

// The values of one run: (x, gamma, beta, dy) in logical order, built in the compute type T
// (double for float64 activations, float otherwise) so beta cancels the forward's product.
// On bf16's grid (8 significant bits), so every activation dtype reads the same values.
inline std::vector<double> on_bf16(const Shape& s, const std::vector<double>& v) {
  return Tensor::from_vector(s, v, DType::BF16).to_vector();
}

// The values of one run: (x, gamma, beta, dy) in logical order, built in the compute type T
// (double for float64 activations, float otherwise) so beta cancels the forward's product.
template <class T>
void build_mask_inputs(const Shape& s, uint64_t seed, double eps, std::vector<double>& x,
                       std::vector<double>& gamma, std::vector<double>& beta,
                       std::vector<double>& dy, std::vector<double>& x0) {
  const int64_t N = s[0], C = s[1], HW = s[2] * s[3];
  Rng rng(seed);
  const auto uniform = [&](double lo, double hi) { return lo + (hi - lo) * rng.uniform(); };
  const T invstd = T(1.0 / std::sqrt(1.0 + eps));  // running_var = 1, running_mean = 0
  gamma.assign(size_t(C), 0.0);
  beta.assign(size_t(C), 0.0);
  x0.assign(size_t(C), 0.0);
  gamma[0] = double(T(1e-39));
  gamma[C - 1] = 1.0;
  beta[C - 1] = 0.25;
  for (int64_t c = 1; c + 1 < C; ++c) {
    x0[c] = (c % 2 ? 1 : -1) * double(4 + c) / 16;  // a few bits: exact in bf16
    const T g = T(uniform(0.3, 1.7));
    const T t0 = (T(x0[c]) - T(0)) * invstd;
    const T prod = t0 * g;  // rounded once: the statement stores it
    gamma[c] = double(g);
    beta[c] = -double(prod);
  }
  x.assign(size_t(N * C * HW), 0.0);
  dy.assign(x.size(), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t q = 0; q < HW; ++q) {
        const size_t i = size_t((n * C + c) * HW + q);
        if (c == 0)
          x[i] = uniform(-0.1, 0.1);
        else if (c + 1 < C && q % 2 == 0)
          x[i] = x0[c];
        else
          x[i] = uniform(-2, 3);
        const double m = uniform(0.5, 1.5);
        dy[i] = rng.uniform() < 0.5 ? -m : m;
      }
  x = on_bf16(s, x);
  dy = on_bf16(s, dy);
}

// Runs the eval-mode fused op on `dev` with activations of dtype `act` in format `fmt` and
// checks dx != 0 exactly where y > 0; also that the inputs reach both edges (where the machine
// fuses the multiply-add: elements of x0 with y > 0 and with y == 0; in bf16: positive x in
// channel 0 with y == 0).
inline void check_relu_mask_recomputed(Device dev, DType act, MemoryFormat fmt, const Shape& s,
                                       uint64_t seed) {
  const double eps = 1e-5;
  const DType cd = act == DType::BF16 ? DType::F32 : act;
  std::vector<double> x, gamma, beta, dy, x0;
  if (act == DType::F64)
    build_mask_inputs<double>(s, seed, eps, x, gamma, beta, dy, x0);
  else
    build_mask_inputs<float>(s, seed, eps, x, gamma, beta, dy, x0);
  const int64_t C = s[1], HW = s[2] * s[3];
  Tensor xt = Tensor::from_vector(s, x, act).to(fmt).to(dev).set_requires_grad(true);
  Tensor gt = Tensor::from_vector({C}, gamma, cd).to(dev).set_requires_grad(true);
  Tensor bt = Tensor::from_vector({C}, beta, cd).to(dev).set_requires_grad(true);
  Tensor rm = Tensor::zeros({C}, cd, dev), rv = Tensor::full({C}, 1.0, cd, dev);
  const Tensor R = Tensor::from_vector(s, dy, act).to(fmt).to(dev);
  Tensor y;
  Tape tape;
  {
    TapeScope scope(tape);
    y = batch_norm_relu(xt, gt, bt, rm, rv, false, 0.1, eps);
  }
  tape.backward({y}, {R});
  const std::vector<double> yv = y.to(Device::cpu()).to_vector();
  const std::vector<double> gx = xt.grad().to(Device::cpu()).to_vector();
  int64_t wrong = 0, x0_pos = 0, x0_zero = 0, rounded_to_zero = 0;
  for (size_t i = 0; i < yv.size(); ++i) {
    const int64_t c = int64_t(i) / HW % C;
    if ((gx[i] != 0) != (yv[i] > 0)) ++wrong;
    if (c > 0 && c + 1 < C && x[i] == x0[size_t(c)]) ++(yv[i] > 0 ? x0_pos : x0_zero);
    if (c == 0 && x[i] > 0 && yv[i] == 0) ++rounded_to_zero;
  }
  CAPTURE(x0_pos);
  CAPTURE(x0_zero);
  CAPTURE(rounded_to_zero);
  CHECK(wrong == 0);
#if defined(__FP_FAST_FMA) && defined(__FP_FAST_FMAF)
  // The GPU fuses every mul_add, and so does this CPU.
  CHECK(x0_pos > 0);
  CHECK(x0_zero > 0);
#endif
  if (act == DType::BF16) CHECK(rounded_to_zero > 0);
}

}  // namespace unetcu::testing_bn
