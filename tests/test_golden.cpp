// The engine against PyTorch: tests/golden/unet_w16.safetensors was written by
// tools/pytorch_reference.py (PyTorch 1.13, float64): SMP's UNet-ResNet34 at width/16 with
// random weights, one training forward and backward on a fixed batch. Same weights and batch
// here: the logits, the loss, the gradients and a running mean must agree to float64 rounding
// (1e-10 relative: the two frameworks sum in different orders).
#include <cstring>
#include <memory>

#include "engine/checkpoint.h"
#include "engine/optim.h"
#include "engine/tape.h"
#include "models/unet.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {
Tensor to_tensor(const SafeTensor& t) {
  REQUIRE(t.dtype == "F64");
  Tensor out = Tensor::empty(t.shape, DType::F64);
  std::memcpy(out.raw(), t.data.data(), t.data.size());
  return out;
}
double rel_err(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    num += std::pow(a.at(i) - b.at(i), 2);
    den += b.at(i) * b.at(i);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// A golden file's model (its state loaded strictly, in training mode) after one forward and
// backward of the engine's loss on the file's input and target; the golden.* entries.
struct GoldenRun {
  SafeTensors golden;
  std::unique_ptr<UNet> model;
  Tensor logits, loss;
};
GoldenRun run_golden(const std::string& file, int classes, EncoderKind encoder = EncoderKind::ResNet34,
                     size_t entries = 278) {
  const std::string path = std::string(UNETCU_SOURCE_DIR) + "/tests/golden/" + file;
  SafeTensors all = read_safetensors(path);
  SafeTensors state;
  GoldenRun r;
  for (auto& [name, t] : all) (name.rfind("golden.", 0) == 0 ? r.golden : state).emplace(name, t);
  REQUIRE(state.size() == entries);
  UNetConfig cfg;
  cfg.encoder = encoder;
  cfg.width_divisor = 16;
  cfg.dtype = DType::F64;
  cfg.classes = classes;
  r.model = std::make_unique<UNet>(cfg);
  load_model_state(*r.model, state, path);  // strict: every name and shape of PyTorch's model
  r.model->train();
  const Tensor x = to_tensor(r.golden.at("golden.input")), t = to_tensor(r.golden.at("golden.target"));
  Tape tape;
  {
    TapeScope s(tape);
    r.logits = r.model->forward(x);
    r.loss = segmentation_loss(LossKind::BCEDice, r.logits, t);
  }
  tape.backward(r.loss);
  return r;
}

// Every gradient against the file's, then one Adam step from the file's gradients: each
// parameter after it against the file's. The step starts from PyTorch's own gradients because
// the first step is lr * g / (|g| + eps): where |g| is near eps (1e-8; resnet50's gradients at
// width/16 reach 2e-8) an error dg moves it by lr * eps * dg / (|g| + eps)^2, about 1e4 dg, so
// the gradients' float64 rounding (checked above) would show through; from the same
// gradients the two steps differ by their own rounding, far below 1e-12.
void check_gradients_and_adam(UNet& model, const SafeTensors& golden, size_t parameters) {
  const auto params = model.named_parameters();
  CHECK(params.size() == parameters);
  std::vector<Tensor> list;
  for (const auto& [name, p] : params) {
    CAPTURE(name);
    const Tensor g = to_tensor(golden.at("golden.grad." + name));
    CHECK(rel_err(p.grad(), g) < 1e-10);
    p.grad().copy_(g);
    list.push_back(p);
  }
  Adam adam(list, AdamOptions{});
  adam.step();
  for (const auto& [name, p] : params) {
    CAPTURE(name);
    CHECK(max_abs_diff(p, to_tensor(golden.at("golden.adam." + name))) < 1e-12);
  }
}
}  // namespace

TEST_CASE("golden: the engine matches PyTorch on SMP's UNet-ResNet34 (width/16, float64)") {
  GoldenRun r = run_golden("unet_w16.safetensors", 1);
  UNet& model = *r.model;
  const SafeTensors& golden = r.golden;
  const Tensor &logits = r.logits, &loss = r.loss;
  CHECK(rel_err(logits, to_tensor(golden.at("golden.logits"))) < 1e-10);
  CHECK(loss.item() == doctest::Approx(to_tensor(golden.at("golden.loss")).item()).epsilon(1e-12));
  const auto params = model.named_parameters();
  int grads = 0;
  for (const auto& [name, p] : params) {
    auto it = golden.find("golden.grad." + name);
    if (it == golden.end()) continue;
    CAPTURE(name);
    CHECK(rel_err(p.grad(), to_tensor(it->second)) < 1e-10);
    ++grads;
  }
  CHECK(grads == 6);
  for (const StateEntry& e : model.state())
    if (e.name == "encoder.layer1.1.bn1.running_mean")
      CHECK(rel_err(e.tensor, to_tensor(golden.at("golden.after.encoder.layer1.1.bn1.running_mean"))) < 1e-12);
}

// tests/golden/unet_w16_c3.safetensors: the same at classes=3 (pytorch_reference.py golden
// --classes 3 --ignore-index 255), loss nn.CrossEntropyLoss(ignore_index=255) + SMP's
// DiceLoss('multiclass', ignore_index=255) on targets drawn from classes 0 and 1 only (class 2
// absent: its Dice term is zeroed) with 640 pixels ignored (-1 in golden.target). Every
// parameter's gradient, then one torch.optim.Adam step (lr 1e-3): every parameter after it.
// The Adam step (from PyTorch's gradients, check_gradients_and_adam) is 1e-3 against weights
// of ~1e-1: the two frameworks' rounding of it stays below 1e-12 absolute.
TEST_CASE("golden: three classes with ignored pixels match PyTorch, gradients and one Adam step (float64)") {
  GoldenRun r = run_golden("unet_w16_c3.safetensors", 3);
  UNet& model = *r.model;
  const SafeTensors& golden = r.golden;
  const Tensor &logits = r.logits, &loss = r.loss;
  const Tensor t = to_tensor(golden.at("golden.target"));
  int ignored = 0;
  for (int64_t i = 0; i < t.numel(); ++i) ignored += t.at(i) < 0;
  CHECK(ignored == 640);
  CHECK(rel_err(logits, to_tensor(golden.at("golden.logits"))) < 1e-10);
  CHECK(loss.item() == doctest::Approx(to_tensor(golden.at("golden.loss")).item()).epsilon(1e-12));
  check_gradients_and_adam(model, golden, 140);
}

// tests/golden/unet_r18_w16.safetensors and unet_r50_w16.safetensors (pytorch_reference.py
// golden --encoder resnet18 / resnet50 --width-divisor 16): the BasicBlock encoder at its other
// depth, and the Bottleneck one with its 4x-wide layers feeding the decoder. Binary, the
// engine's bce+dice; the logits, the loss, every gradient and one Adam step.
TEST_CASE("golden: resnet18 and resnet50 encoders match PyTorch, gradients and one Adam step (float64)") {
  struct Case {
    const char* file;
    EncoderKind encoder;
    size_t entries, parameters;
  };
  for (const Case& k : {Case{"unet_r18_w16.safetensors", EncoderKind::ResNet18, 182, 92},
                        Case{"unet_r50_w16.safetensors", EncoderKind::ResNet50, 380, 191}}) {
    CAPTURE(std::string(k.file));
    GoldenRun r = run_golden(k.file, 1, k.encoder, k.entries);
    CHECK(rel_err(r.logits, to_tensor(r.golden.at("golden.logits"))) < 1e-10);
    CHECK(r.loss.item() == doctest::Approx(to_tensor(r.golden.at("golden.loss")).item()).epsilon(1e-12));
    for (const StateEntry& e : r.model->state())
      if (e.name == "encoder.layer1.1.bn1.running_mean")
        CHECK(rel_err(e.tensor, to_tensor(r.golden.at("golden.after.encoder.layer1.1.bn1.running_mean"))) < 1e-12);
    check_gradients_and_adam(*r.model, r.golden, k.parameters);
  }
}
