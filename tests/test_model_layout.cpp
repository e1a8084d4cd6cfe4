// The whole UNet in channels-last and in bfloat16 (UNetConfig::format, bf16_activations): one
// training step (forward, BCE+Dice loss, backward) gives the NCHW float results — to float64
// rounding in float64, to float32 rounding in float32 — and the bf16 step stays within
// bfloat16's error of the float32 one (while showing bfloat16's error, so the test cannot pass
// on a silently float32 path). The activations really are NHWC / bfloat16 inside, and the
// logits come back NCHW in the parameters' dtype.
#include <cmath>
#include <vector>

#include "engine/ops.h"
#include "engine/tape.h"
#include "models/unet.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

struct Step {
  Tensor logits, loss;
  std::vector<Tensor> grads;  // every parameter's, in order
};

// round_params: the float32 parameters rounded to bfloat16 first. eval: batch norm on its
// running statistics (gradients still flow).
Step train_step(const UNetConfig& cfg, const Tensor& x, const Tensor& target,
                bool round_params = false, bool eval = false) {
  UNet model(cfg);
  if (eval) model.eval();
  if (round_params)
    for (Tensor p : model.parameters()) p.copy_(p.to(DType::BF16));
  Step s;
  Tape tape;
  {
    TapeScope scope(tape);
    s.logits = model.forward(x);
    s.loss = segmentation_loss(LossKind::BCEDice, s.logits, target);
  }
  tape.backward(s.loss);
  for (const Tensor& p : model.parameters()) {
    REQUIRE(p.grad().defined());
    CHECK(p.grad().dtype() == cfg.dtype);
    CHECK(p.grad().format() == MemoryFormat::NCHW);
    s.grads.push_back(p.grad());
  }
  return s;
}

// ‖a − b‖ / ‖b‖ over logical elements.
double rel(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  REQUIRE(x.size() == y.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// The worst relative difference over the logits, the loss and (with_grads) every parameter
// gradient.
double worst_rel(const Step& a, const Step& b, bool with_grads = true) {
  double w = rel(a.logits, b.logits);
  w = std::max(w, std::fabs(a.loss.item() - b.loss.item()) / std::fabs(b.loss.item()));
  if (with_grads)
    for (size_t i = 0; i < a.grads.size(); ++i) w = std::max(w, rel(a.grads[i], b.grads[i]));
  return w;
}

struct Data {
  Tensor x, target;
};
Data make_data(DType dt, uint64_t seed) {
  Rng rng(seed);
  Data d;
  d.x = random_tensor({2, 3, 64, 64}, rng, -1, 1, dt);
  d.target = Tensor::empty({2, 1, 64, 64}, dt);
  for (int64_t i = 0; i < d.target.numel(); ++i) d.target.set(i, rng.uniform(0, 1) < 0.3 ? 1 : 0);
  return d;
}

UNetConfig small(DType dt) {
  UNetConfig cfg;
  cfg.width_divisor = 8;
  cfg.dtype = dt;
  cfg.seed = 21;
  return cfg;
}

}  // namespace

TEST_CASE("UNet step in NHWC equals NCHW, float64 and float32") {
  for (DType dt : {DType::F64, DType::F32}) {
    CAPTURE(dtype_name(dt));
    const Data d = make_data(dt, 5);
    UNetConfig nchw = small(dt), nhwc = small(dt);
    nhwc.format = MemoryFormat::NHWC;
    const Step a = train_step(nchw, d.x, d.target);
    const Step b = train_step(nhwc, d.x, d.target);
    CHECK(b.logits.format() == MemoryFormat::NCHW);
    CHECK(b.logits.dtype() == dt);
    const double w = worst_rel(b, a);
    CAPTURE(w);
    // The same arithmetic in another summation order: float64 rounding (2^-53 per operation)
    // carried through ~10^3-term sums and ~40 layers stays far below 1e-10; float32's 2^-24
    // the same way stays below 1e-4 (batch-norm backward divides by the batch spread, which
    // amplifies the relative error of small gradients).
    CHECK(w <= (dt == DType::F64 ? 1e-10 : 1e-4));
  }
}

TEST_CASE("UNet activations are NHWC and bfloat16 inside, the logits float32 NCHW") {
  UNetConfig cfg = small(DType::F32);
  cfg.format = MemoryFormat::NHWC;
  cfg.bf16_activations = true;
  UNet model(cfg);
  const Data d = make_data(DType::F32, 6);
  const std::vector<Tensor> outs = model.forward_all(d.x);
  for (size_t b = 0; b + 1 < outs.size(); ++b) {
    CAPTURE(model.blocks()[b].name);
    CHECK(outs[b].dtype() == DType::BF16);
    CHECK(outs[b].format() == MemoryFormat::NHWC);
  }
  CHECK(outs.back().dtype() == DType::F32);
  CHECK(outs.back().format() == MemoryFormat::NCHW);
  UNetConfig bad = small(DType::F64);
  bad.bf16_activations = true;
  CHECK_THROWS_WITH_AS(UNet{bad}, doctest::Contains("float32 parameters"), Error);
}

TEST_CASE("UNet step in bfloat16 stays within bfloat16's error of float32, NCHW and NHWC") {
  // How far a bfloat16 step may be from the float32 one depends on the network's conditioning:
  // a small UNet at initialisation, with batch norm over a few values per channel in the deep
  // layers, turns a relative perturbation of 2^-8 into large changes of some gradients (those
  // that nearly cancel). So the yardstick is measured, not assumed: `one` is the float32 step
  // on the input and parameters rounded once to bfloat16 — the effect of a single bfloat16
  // rounding of everything. The bf16 step rounds every layer's stored output and gradient
  // once more, L ~ 40 layers deep; independent roundings add like a random walk, sqrt(L) ~ 6.3
  // times one. Held: the bf16 step within 8 times `one`, and above 1/8 of it (bfloat16's
  // scale, not float32's, whose effect is ~10^5 times smaller). In training mode the
  // gradients are too ill-conditioned to compare (one rounding alone moves some by over
  // 100%), so there the logits and loss are compared; with batch norm on running statistics
  // (eval) the gradients too.
  const Data d = make_data(DType::F32, 7);
  for (bool eval : {false, true}) {
    CAPTURE(eval);
    const Step ref = train_step(small(DType::F32), d.x, d.target, false, eval);
    const Step one = train_step(small(DType::F32), d.x.to(DType::BF16).to(DType::F32), d.target, true, eval);
    const double yardstick = worst_rel(one, ref, eval);
    CAPTURE(yardstick);
    REQUIRE(yardstick > 1e-3);  // a bfloat16 rounding shows
    for (MemoryFormat f : {MemoryFormat::NCHW, MemoryFormat::NHWC}) {
      CAPTURE(format_name(f));
      UNetConfig cfg = small(DType::F32);
      cfg.bf16_activations = true;
      cfg.format = f;
      const Step s = train_step(cfg, d.x, d.target, false, eval);
      const double w = worst_rel(s, ref, eval);
      CAPTURE(w);
      CHECK(w <= 8 * yardstick);
      CHECK(w >= yardstick / 8);
    }
  }
}
