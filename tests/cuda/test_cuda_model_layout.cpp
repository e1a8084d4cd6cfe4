// On a GPU, the whole reduced-width UNet training step (forward, BCE+Dice, backward) in
// channels-last and in bf16: float32 NHWC equals the CPU's float32 NCHW step (TF32 off; float32
// rounding over ~40 layers: 1e-4), and bf16 NCHW / NHWC stay within 8 times the yardstick the
// CPU test uses (tests/test_model_layout.cpp: the float32 step on the input and parameters
// rounded once to bfloat16), and above an eighth of it.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "engine/ops.h"
#include "engine/random.h"
#include "engine/tape.h"
#include "models/unet.h"
#include "runtime/cuda_api.h"

using namespace unetcu;

namespace {

const Device kGpu = Device::cuda(0);

struct Step {
  Tensor logits, loss;
  std::vector<Tensor> grads;
};

Step train_step(UNetConfig cfg, Device dev, const Tensor& x, const Tensor& target,
                bool round_params = false, bool eval = false) {
  cfg.device = dev;
  UNet model(cfg);
  if (eval) model.eval();
  if (round_params)
    for (Tensor p : model.parameters()) p.copy_(p.to(DType::BF16));
  Step s;
  Tape tape;
  {
    TapeScope scope(tape);
    s.logits = model.forward(x.to(dev));
    s.loss = segmentation_loss(LossKind::BCEDice, s.logits, target.to(dev));
  }
  tape.backward(s.loss);
  for (const Tensor& p : model.parameters()) {
    REQUIRE(p.grad().defined());
    s.grads.push_back(p.grad().to(Device::cpu()));
  }
  s.logits = s.logits.to(Device::cpu());
  s.loss = s.loss.to(Device::cpu());
  return s;
}

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

double worst_rel(const Step& a, const Step& b, bool with_grads) {
  double w = rel(a.logits, b.logits);
  w = std::max(w, std::fabs(a.loss.item() - b.loss.item()) / std::fabs(b.loss.item()));
  if (with_grads)
    for (size_t i = 0; i < a.grads.size(); ++i) w = std::max(w, rel(a.grads[i], b.grads[i]));
  return w;
}

UNetConfig small() {
  UNetConfig cfg;
  cfg.width_divisor = 8;
  cfg.seed = 21;
  return cfg;
}

struct Data {
  Tensor x, target;
};
Data make_data(uint64_t seed) {
  Rng rng(seed);
  Data d;
  d.x = Tensor::empty({2, 3, 64, 64});
  for (int64_t i = 0; i < d.x.numel(); ++i) d.x.set(i, rng.uniform(-1, 1));
  d.target = Tensor::empty({2, 1, 64, 64});
  for (int64_t i = 0; i < d.target.numel(); ++i) d.target.set(i, rng.uniform(0, 1) < 0.3 ? 1 : 0);
  return d;
}

struct NoTf32 {
  bool saved = cuda::allow_tf32();
  NoTf32() { cuda::set_allow_tf32(false); }
  ~NoTf32() { cuda::set_allow_tf32(saved); }
};

}  // namespace

TEST_CASE("CUDA UNet step in NHWC float32 equals the CPU NCHW step") {
  NoTf32 no_tf32;
  const Data d = make_data(5);
  const Step cpu = train_step(small(), Device::cpu(), d.x, d.target);
  UNetConfig nhwc = small();
  nhwc.format = MemoryFormat::NHWC;
  const Step gpu = train_step(nhwc, kGpu, d.x, d.target);
  const double w = worst_rel(gpu, cpu, true);
  CAPTURE(w);
  CHECK(w <= 1e-4);
}

TEST_CASE("CUDA UNet step in bf16 stays within bfloat16's error of the float32 step") {
  NoTf32 no_tf32;
  const Data d = make_data(7);
  for (bool eval : {false, true}) {
    CAPTURE(eval);
    const Step ref = train_step(small(), Device::cpu(), d.x, d.target, false, eval);
    const Step one = train_step(small(), Device::cpu(), d.x.to(DType::BF16).to(DType::F32), d.target,
                                true, eval);
    const double yardstick = worst_rel(one, ref, eval);
    CAPTURE(yardstick);
    REQUIRE(yardstick > 1e-3);
    for (MemoryFormat f : {MemoryFormat::NCHW, MemoryFormat::NHWC}) {
      CAPTURE(format_name(f));
      UNetConfig cfg = small();
      cfg.bf16_activations = true;
      cfg.format = f;
      const Step s = train_step(cfg, kGpu, d.x, d.target, false, eval);
      const double w = worst_rel(s, ref, eval);
      CAPTURE(w);
      CHECK(w <= 8 * yardstick);
      CHECK(w >= yardstick / 8);
    }
  }
}
