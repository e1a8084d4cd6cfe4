// Prediction (train/inference.h): an image made into the network's input as the training data
// is; the logits of a batch are each image's alone (batch norm on its running statistics); the
// test-time flips are the mean of the mirrored images' logits, mirrored back, computed here
// from separate passes with the test's own mirroring; the model's device, precision and memory
// format are the forward's own.
#include <cmath>
#include <vector>

#include "data/synthetic.h"
#include "engine/tape.h"
#include "testing.h"
#include "train/inference.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

// A small UNet whose batch-norm running statistics have moved off their initial values (two
// training-mode forwards), then in evaluation mode.
UNetConfig small(DType dt) {
  UNetConfig cfg;
  cfg.width_divisor = 16;
  cfg.dtype = dt;
  cfg.seed = 5;
  return cfg;
}
void settle(UNet& model, uint64_t seed) {
  Rng rng(seed);
  NoGradScope no_grad;
  for (int i = 0; i < 2; ++i)
    model.forward(random_tensor({2, 3, 64, 64}, rng, -1, 1, model.config().dtype).to(model.config().device));
  model.eval();
}

// Rows [lo, hi) of a CPU tensor, as a tensor of their own.
Tensor rows(const Tensor& t, int64_t lo, int64_t hi) { return t.rows(lo, hi).clone(); }

// The test's own mirror of a float32 NCHW tensor:
// out[n][c][y][x] = in[n][c][v ? H-1-y : y][h ? W-1-x : x].
Tensor mirror(const Tensor& t, bool h, bool v) {
  const int64_t N = t.dim(0), C = t.dim(1), H = t.dim(2), W = t.dim(3);
  Tensor out = Tensor::empty(t.shape());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t y = 0; y < H; ++y)
        for (int64_t x = 0; x < W; ++x)
          out.set(((n * C + c) * H + y) * W + x,
                  t.at(((n * C + c) * H + (v ? H - 1 - y : y)) * W + (h ? W - 1 - x : x)));
  return out;
}

// max |a - b| / max |b|.
double rel_max(const Tensor& a, const Tensor& b) {
  double den = 0;
  for (int64_t i = 0; i < b.numel(); ++i) den = std::max(den, std::fabs(b.at(i)));
  return max_abs_diff(a, b) / den;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.to_vector() == b.to_vector();
}

}  // namespace

TEST_CASE("an image becomes the network's input as the training data: resized, scaled to [0, 1], normalised") {
  Image img{1, 1, 3, {128, 64, 255}};  // one pixel, so every resized pixel is it
  std::vector<float> x(3 * 32 * 32);
  prepare_input(img, 32, x.data());
  const float v[3] = {128, 64, 255};
  for (int c = 0; c < 3; ++c)
    for (int q = 0; q < 32 * 32; ++q) {
      CAPTURE(c);
      REQUIRE(x[size_t(c) * 1024 + q] == doctest::Approx((v[c] / 255.0 - kImageMean[c]) / kImageStd[c]).epsilon(1e-6));
    }
  Image gray{4, 4, 1, std::vector<uint8_t>(16, 7)};
  CHECK_THROWS_WITH(prepare_input(gray, 32, x.data()), doctest::Contains("needs an RGB image"));
}

TEST_CASE("the logits of a batch are each image's alone, float64 and float32") {
  // Batch norm on running statistics treats every image alone, so only the kernels' rounding
  // for another batch size can differ: float64's (1e-12) and float32's (1e-5) relative error.
  for (DType dt : {DType::F64, DType::F32}) {
    const std::string type = dtype_name(dt);
    CAPTURE(type);
    UNet model(small(dt));
    settle(model, 3);
    Rng rng(11);
    const Tensor x = random_tensor({3, 3, 64, 64}, rng, -2, 2, DType::F32);
    const Tensor all = predict_logits(model, x);
    REQUIRE(all.shape() == Shape{3, 1, 64, 64});
    CHECK(all.dtype() == DType::F32);
    CHECK(all.device().is_cpu());
    const double tol = dt == DType::F64 ? 1e-6 : 1e-5;  // the logits come back in float32
    for (int64_t i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(rel_max(rows(all, i, i + 1), predict_logits(model, rows(x, i, i + 1))) <= tol);
    }
    CHECK(rel_max(rows(all, 1, 3), predict_logits(model, rows(x, 1, 3))) <= tol);
  }
}

TEST_CASE("test-time flips are the mean of the mirrored images' logits, mirrored back") {
  // The reference: the plain prediction of each mirrored batch, mirrored back by the test's own
  // indexing, added in the same order and divided (float32 arithmetic, as predict_logits).
  UNet model(small(DType::F32));
  settle(model, 4);
  Rng rng(12);
  const Tensor x = random_tensor({2, 3, 64, 64}, rng, -2, 2, DType::F32);
  const Tensor plain = predict_logits(model, x);
  const Tensor h = mirror(predict_logits(model, mirror(x, true, false)), true, false);
  const Tensor v = mirror(predict_logits(model, mirror(x, false, true)), false, true);
  const Tensor hv = mirror(predict_logits(model, mirror(x, true, true)), true, true);
  Tensor want2 = Tensor::empty(plain.shape()), want4 = Tensor::empty(plain.shape());
  for (int64_t i = 0; i < plain.numel(); ++i) {
    const float a = float(plain.at(i)), b = float(h.at(i)), c = float(v.at(i)), d = float(hv.at(i));
    want2.set(i, (a + b) / 2.f);
    want4.set(i, (((a + b) + c) + d) / 4.f);
  }
  CHECK(same_bits(predict_logits(model, x, Tta::HFlip), want2));
  CHECK(same_bits(predict_logits(model, x, Tta::Flips), want4));
  CHECK(!same_bits(want2, plain));  // the model is not mirror-symmetric: the flips do something
  CHECK(tta_passes(Tta::None) == 1);
  CHECK(tta_passes(Tta::HFlip) == 2);
  CHECK(tta_passes(Tta::Flips) == 4);
  // So the left-right prediction of a mirrored image is the mirrored prediction, bit for bit (the
  // same two terms, added the other way round), and the four-flip one to float32's rounding.
  const Tensor xm = mirror(x, true, false);
  CHECK(same_bits(mirror(predict_logits(model, xm, Tta::HFlip), true, false), predict_logits(model, x, Tta::HFlip)));
  CHECK(rel_max(mirror(predict_logits(model, mirror(x, false, true), Tta::Flips), false, true),
                predict_logits(model, x, Tta::Flips)) <= 1e-6);
}

TEST_CASE("prediction runs the model's own forward: another CPU device, bfloat16, channels-last") {
  Rng rng(13);
  const Tensor x = random_tensor({2, 3, 64, 64}, rng, -2, 2, DType::F32);
  UNetConfig cfg = small(DType::F32);
  cfg.bf16_activations = true;
  cfg.format = MemoryFormat::NHWC;
  UNet model(cfg);
  settle(model, 6);
  Tensor direct;
  {
    NoGradScope no_grad;
    direct = model.forward(x);
  }
  const Tensor got = predict_logits(model, x);
  CHECK(got.format() == MemoryFormat::NCHW);
  CHECK(same_bits(got, direct));
  // The same weights and statistics on cpu:1: the images go there and the logits come back.
  cfg.device = Device::cpu(1);
  UNet there(cfg);
  settle(there, 6);
  CHECK(same_bits(predict_logits(there, x), direct));
}

TEST_CASE("prediction refuses a model in training mode and images that are not float32 NCHW on the CPU") {
  UNet model(small(DType::F32));
  Rng rng(14);
  const Tensor x = random_tensor({1, 3, 64, 64}, rng, -1, 1, DType::F32);
  CHECK_THROWS_WITH(predict_logits(model, x), doctest::Contains("evaluation mode"));
  model.eval();
  CHECK_THROWS_WITH(predict_logits(model, x.to(DType::F64)), doctest::Contains("float32 NCHW images on the CPU"));
  CHECK_THROWS_WITH(predict_logits(model, x.to(MemoryFormat::NHWC)),
                    doctest::Contains("float32 NCHW images on the CPU"));
}
