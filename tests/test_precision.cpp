// --precision bf16 on the CPU (kernels/cpu/conv_dnnl.h): convolutions read their inputs rounded
// to bfloat16 and accumulate in float32. Held, element by element, to the bound bfloat16's
// rounding allows, and shown to be bfloat16 (errors at its scale, not float32's).
#include <doctest/doctest.h>

#include <cmath>

#include "engine/ops.h"
#include "engine/tape.h"
#include "kernels/cpu/conv_dnnl.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

Tensor abs_of(const Tensor& t) {
  Tensor a = t.detach().to(DType::F64);
  for (int64_t i = 0; i < a.numel(); ++i) a.set(i, std::fabs(a.at(i)));
  return a;
}

// The largest |got - want| / bound over the elements, and whether every one is within it.
double worst_ratio(const Tensor& got, const Tensor& want, const Tensor& bound) {
  double worst = 0;
  for (int64_t i = 0; i < want.numel(); ++i)
    worst = std::max(worst, std::fabs(got.at(i) - want.at(i)) / std::max(bound.at(i), 1e-300));
  return worst;
}

}  // namespace

TEST_CASE("bf16 convolutions: within bfloat16's rounding bound of float64, forward and backward") {
  if (!kernels::cpu::onednn_built()) {
    WARN_MESSAGE(false, "this build has no oneDNN: bf16 convolutions are not built");
    return;
  }
  // Bound: each input is rounded to bfloat16 (8 significant bits, unit roundoff u = 2^-8), so
  // each product x*w is off by at most (2u + u^2)|x||w|; the float32 accumulation of K
  // products adds at most K * 2^-24 of the sum of |x||w|. Per output element:
  //   |got - exact| <= (2u + u^2 + K 2^-24) * sum |x||w|,
  // the sum of absolute products being the same convolution of |x| and |w| (and, for the
  // gradients, of |dy| with |w| or |x|), computed in float64.
  struct Case {
    Shape x, w;
    Conv2dOptions opt;
  };
  const std::vector<Case> cases = {{{2, 3, 37, 30}, {16, 3, 7, 7}, {2, 2, 3, 3}},
                                   {{2, 16, 17, 13}, {16, 16, 3, 3}, {1, 1, 1, 1}},
                                   {{3, 16, 17, 13}, {32, 16, 3, 3}, {2, 2, 1, 1}},
                                   {{3, 16, 16, 12}, {32, 16, 1, 1}, {2, 2, 0, 0}}};
  const double u = std::ldexp(1.0, -8);
  const kernels::cpu::CpuConvImpl saved = kernels::cpu::cpu_conv_impl();
  kernels::cpu::set_cpu_conv_impl(kernels::cpu::CpuConvImpl::OneDnn);
  Rng rng(5);
  for (const Case& c : cases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    const double K = double(c.x[1] * c.w[2] * c.w[3]);
    const double factor = 2 * u + u * u + K * std::ldexp(1.0, -24);
    Tensor x = random_tensor(c.x, rng), w = random_tensor(c.w, rng);
    // float64 references and the absolute-value bounds.
    Tensor x64 = x.clone().set_requires_grad(true), w64 = w.clone().set_requires_grad(true);
    Tensor y64, gy;
    Tape t64;
    {
      TapeScope s(t64);
      y64 = conv2d(x64, w64, Tensor(), c.opt);
    }
    gy = random_tensor(y64.shape(), rng);
    t64.backward({y64}, {gy});
    Tensor xa = abs_of(x).set_requires_grad(true), wa = abs_of(w).set_requires_grad(true), ya;
    Tape ta;
    {
      TapeScope s(ta);
      ya = conv2d(xa, wa, Tensor(), c.opt);
    }
    ta.backward({ya}, {abs_of(gy)});
    // bfloat16 inputs, float32 accumulation.
    kernels::cpu::set_cpu_conv_bf16(true);
    Tensor x32 = x.to(DType::F32).set_requires_grad(true), w32 = w.to(DType::F32).set_requires_grad(true);
    Tensor y32;
    Tape t32;
    {
      TapeScope s(t32);
      y32 = conv2d(x32, w32, Tensor(), c.opt);
    }
    t32.backward({y32}, {gy.to(DType::F32)});
    kernels::cpu::set_cpu_conv_bf16(false);
    const double fwd = worst_ratio(y32.to(DType::F64), y64, scale(ya, factor));
    const double dx = worst_ratio(x32.grad().to(DType::F64), x64.grad(), scale(xa.grad(), factor));
    const double dw = worst_ratio(w32.grad().to(DType::F64), w64.grad(), scale(wa.grad(), factor));
    CAPTURE(fwd);
    CAPTURE(dx);
    CAPTURE(dw);
    CHECK(fwd <= 1);
    CHECK(dx <= 1);
    CHECK(dw <= 1);
    // At bfloat16's scale: float32 inputs would stay near K 2^-24 / (2u) of the bound (below
    // 2e-3 here); bfloat16's rounding reaches a few percent of it.
    CHECK(fwd > 0.02);
    CHECK(dx > 0.02);
    CHECK(dw > 0.02);
  }
  kernels::cpu::set_cpu_conv_impl(saved);
}

TEST_CASE("bf16 convolutions need oneDNN, and the setting is off unless asked for") {
  CHECK_FALSE(kernels::cpu::cpu_conv_bf16());
  if (!kernels::cpu::onednn_built()) CHECK_THROWS_AS(kernels::cpu::set_cpu_conv_bf16(true), Error);
}
