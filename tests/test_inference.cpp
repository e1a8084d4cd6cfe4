// Prediction (train/inference.h): an image made into the network's input as the training data
// is; the logits of a batch are each image's alone (batch norm on its running statistics); the
// test-time flips are the mean of the mirrored images' logits, mirrored back, computed here
// from separate passes with the test's own mirroring; the model's device, precision and memory
// format are the forward's own.
#include <cmath>
#include <vector>

#include "data/synthetic.h"
#include "engine/tape.h"
#include "runtime/allocator.h"
#include "testing.h"
#include "train/inference.h"
#include "small_models.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

// A small UNet whose batch-norm running statistics have moved off their initial values (two
// training-mode forwards), then in evaluation mode.
UNetConfig small(DType dt) { return testing::small_unet(5, Device::cpu(), dt); }
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

TEST_CASE("tiles: starts cover every border, one tile covering the image equals the whole-image prediction") {
  CHECK(tile_starts(64, 64, 0.5) == std::vector<int>{0});
  CHECK(tile_starts(40, 64, 0.5) == std::vector<int>{0});
  CHECK(tile_starts(160, 64, 0.5) == std::vector<int>{0, 32, 64, 96});
  CHECK(tile_starts(97, 64, 0.5) == std::vector<int>{0, 17, 33});
  CHECK(tile_starts(8192, 32, 0.99999).size() == 8192 - 32 + 1);  // a stride of one pixel at most
  for (int len : {65, 97, 131, 1000})
    for (double ov : {0.0, 0.25, 0.5, 0.75}) {
      const std::vector<int> s = tile_starts(len, 64, ov);
      CHECK(s.front() == 0);
      CHECK(s.back() == len - 64);  // the last tile ends at the border
      for (size_t i = 1; i < s.size(); ++i) CHECK(s[i] - s[i - 1] <= int(std::lround(64 * (1 - ov))) + 1);
    }
  for (const int classes : {1, 3}) {
    CAPTURE(classes);
    UNetConfig cfg = small(DType::F32);
    cfg.classes = classes;
    UNet model(cfg);
    settle(model, 11);
    Rng rng(12);
    const Tensor image = random_tensor({1, 3, 64, 96}, rng, -1, 1, DType::F32);
    // One tile of 96 covers the 64x96 image (padded with 0 below it): with the same padded
    // input the whole-image forward gives the same logits, the tile's probabilities the same.
    Tensor padded = Tensor::zeros({1, 3, 96, 96});
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t y = 0; y < 64; ++y)
        for (int64_t x = 0; x < 96; ++x) padded.set((c * 96 + y) * 96 + x, image.at((c * 64 + y) * 96 + x));
    const Tensor whole = predict_logits(model, padded);
    const Tensor probs = predict_tiled(image, 96, 0.5, 4, [&](const Tensor& t) { return predict_logits(model, t); });
    REQUIRE(probs.shape() == Shape{1, classes, 64, 96});
    double worst = 0;
    for (int64_t y = 0; y < 64; ++y)
      for (int64_t x = 0; x < 96; ++x) {
        double z = 0, mx = -1e300;
        for (int64_t c = 0; c < classes; ++c) mx = std::max(mx, whole.at((c * 96 + y) * 96 + x));
        for (int64_t c = 0; c < classes; ++c) z += std::exp(whole.at((c * 96 + y) * 96 + x) - mx);
        for (int64_t c = 0; c < classes; ++c) {
          const double l = whole.at((c * 96 + y) * 96 + x);
          const double p = classes == 1 ? 1 / (1 + std::exp(-l)) : std::exp(l - mx) / z;
          worst = std::max(worst, std::fabs(probs.at((c * 64 + y) * 96 + x) - p));
        }
      }
    CHECK(worst < 1e-6);  // float32 exp and division of the same logits
  }
}

TEST_CASE("tiles at odd sizes: every pixel covered, each tile's output lands where its window lies") {
  // A "network" that reports where it looked: class 1's logit is the input's channel 0, so the
  // blended probability at each pixel is a known function of that pixel alone.
  auto fake = [](const Tensor& tiles) {
    const int64_t B = tiles.dim(0), S = tiles.dim(2);
    Tensor out = Tensor::zeros({B, 2, S, S});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t q = 0; q < S * S; ++q) out.set((b * 2 + 1) * S * S + q, tiles.at(b * 3 * S * S + q));
    return out;
  };
  for (const auto& [H, W] : std::vector<std::pair<int, int>>{{37, 101}, {64, 64}, {130, 67}, {20, 20}}) {
    CAPTURE(H);
    CAPTURE(W);
    Rng rng(uint64_t(H * 1000 + W));
    const Tensor image = random_tensor({1, 3, H, W}, rng, -2, 2, DType::F32);
    int calls = 0;
    const Tensor probs = predict_tiled(image, 32, 0.5, 3, [&](const Tensor& t) {
      ++calls;
      CHECK(t.dim(0) <= 3);  // at most --batch-size tiles at once
      return fake(t);
    });
    const int tiles = int(tile_starts(H, 32, 0.5).size() * tile_starts(W, 32, 0.5).size());
    CHECK(calls == (tiles + 2) / 3);
    double worst = 0;
    for (int64_t q = 0; q < int64_t(H) * W; ++q) {
      const double p1 = 1 / (1 + std::exp(-image.at(q)));  // softmax of (0, x) at class 1
      worst = std::max(worst, std::fabs(probs.at(int64_t(H) * W + q) - p1));
      worst = std::max(worst, std::fabs(probs.at(q) - (1 - p1)));
    }
    CHECK(worst < 1e-6);
  }
}

TEST_CASE("tiles: a 4000x3000 image in 64x64 tiles holds the image, its probabilities and one batch of tiles") {
  // A stand-in network (2 classes, class 1's logit the input's channel 0) keeps the case fast;
  // the memory is predict_tiled's own: the host allocator's peak over the call.
  const int64_t H = 3000, W = 4000, C = 2, S = 64;
  Tensor image = Tensor::zeros({1, 3, H, W});
  for (int64_t q = 0; q < H * W; q += 97) image.set(q, 1.0);
  auto fake = [&](const Tensor& tiles) {
    const int64_t B = tiles.dim(0);
    Tensor out = Tensor::zeros({B, C, S, S});
    for (int64_t b = 0; b < B; ++b)
      std::copy(tiles.data<float>() + b * 3 * S * S, tiles.data<float>() + (b * 3 + 1) * S * S,
                out.data<float>() + (b * C + 1) * S * S);
    return out;
  };
  size_t peaks[2];
  const int batches[2] = {4, 64};
  for (int k = 0; k < 2; ++k) {
    HostAllocator::reset_peak();
    const size_t before = HostAllocator::stats().current_bytes;
    Tensor probs = predict_tiled(image, int(S), 0.5, batches[k], fake);
    peaks[k] = HostAllocator::stats().peak_bytes - before;
    CHECK(probs.shape() == Shape{1, C, H, W});
    CHECK(probs.at(H * W + 97 * 1000) == doctest::Approx(1 / (1 + std::exp(-1.0))).epsilon(1e-6));
  }
  // Probabilities (C planes) and weights (one plane), float32; a batch of tiles in (3 planes)
  // and out (C planes).
  const size_t whole = size_t((C + 1) * H * W * 4);
  for (int k = 0; k < 2; ++k) {
    const size_t tiles = size_t(batches[k]) * size_t((3 + C) * S * S * 4);
    MESSAGE("4000x3000 in 64x64 tiles, batch ", batches[k], ": peak ", peaks[k] / (1 << 20), " MiB beyond the image (",
            whole / (1 << 20), " MiB of probabilities and weights, ", tiles / 1024, " KiB of tiles)");
    CHECK(peaks[k] <= whole + 2 * tiles + (1 << 20));
  }
}
