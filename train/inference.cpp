#include "train/inference.h"

#include <algorithm>
#include <cmath>

#include "data/dataset.h"
#include "data/synthetic.h"
#include "engine/tape.h"

namespace unetcu {

int tta_passes(Tta tta) { return tta == Tta::None ? 1 : tta == Tta::HFlip ? 2 : 4; }

void prepare_input(const Image& img, int size, float* out) { prepare_input(img, size, size, out); }

void prepare_input(const Image& img, int width, int height, float* out) {
  UNETCU_CHECK(img.channels == 3 && img.width > 0 && img.height > 0, "prediction needs an RGB image, got ",
               img.width, "x", img.height, "x", img.channels);
  resize_bilinear(img, width, height, out);
  const size_t plane = size_t(width) * height;
  for (int c = 0; c < 3; ++c)
    for (size_t q = 0; q < plane; ++q) out[c * plane + q] = (out[c * plane + q] - kImageMean[c]) / kImageStd[c];
}

void prepare_input(const ImageValues& img, int width, int height, const Normalization& norm, float* out) {
  UNETCU_CHECK(img.channels == norm.channels() && img.width > 0 && img.height > 0, "prediction needs an image of ",
               norm.channels(), " channels, got ", img.width, "x", img.height, "x", img.channels);
  resize_bilinear(img, width, height, out);
  const size_t plane = size_t(width) * height;
  for (int c = 0; c < img.channels; ++c)
    for (size_t q = 0; q < plane; ++q)
      out[c * plane + q] = (out[c * plane + q] - norm.mean[size_t(c)]) / norm.std[size_t(c)];
}

namespace {

// A float32 NCHW CPU tensor mirrored left-right (h) and/or top-bottom (v): a new tensor.
Tensor mirrored(const Tensor& t, bool h, bool v) {
  const int64_t planes = t.dim(0) * t.dim(1), H = t.dim(2), W = t.dim(3);
  Tensor out = Tensor::empty(t.shape());
  const float* src = t.data<float>();
  float* dst = out.data<float>();
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t y = 0; y < H; ++y) {
      const float* row = src + (p * H + (v ? H - 1 - y : y)) * W;
      float* o = dst + (p * H + y) * W;
      if (h)
        std::reverse_copy(row, row + W, o);
      else
        std::copy(row, row + W, o);
    }
  return out;
}

}  // namespace

Tensor predict_logits(UNet& model, const Tensor& inputs, Tta tta) {
  UNETCU_CHECK(inputs.ndim() == 4 && inputs.dtype() == DType::F32 && inputs.device().is_cpu() &&
                   inputs.format() == MemoryFormat::NCHW,
               "prediction takes float32 NCHW images on the CPU, got ", shape_str(inputs.shape()), " ",
               dtype_name(inputs.dtype()), " on ", inputs.device().str());
  UNETCU_CHECK(!model.is_training(), "prediction needs the model in evaluation mode (batch norm's running statistics)");
  const UNetConfig& cfg = model.config();
  NoGradScope no_grad;
  // One pass: the images (mirrored) to the model's device and type, the logits back to the CPU
  // in float32, mirrored back.
  auto pass = [&](bool h, bool v) {
    Tensor x = h || v ? mirrored(inputs, h, v) : inputs;
    if (cfg.dtype != DType::F32) x = x.to(cfg.dtype);
    if (cfg.device != x.device()) x = x.to(cfg.device);
    Tensor logits = model.forward(x);
    if (logits.device() != Device::cpu()) logits = logits.to(Device::cpu());
    if (logits.dtype() != DType::F32) logits = logits.to(DType::F32);
    return h || v ? mirrored(logits, h, v) : logits;
  };
  Tensor sum = pass(false, false);
  if (tta == Tta::None) return sum;
  const std::pair<bool, bool> flips[] = {{true, false}, {false, true}, {true, true}};
  const int passes = tta_passes(tta);
  float* s = sum.data<float>();
  const int64_t n = sum.numel();
  for (int k = 0; k + 1 < passes; ++k) {
    const Tensor l = pass(flips[k].first, flips[k].second);
    const float* lp = l.data<float>();
    for (int64_t i = 0; i < n; ++i) s[i] += lp[i];
  }
  for (int64_t i = 0; i < n; ++i) s[i] /= float(passes);
  return sum;
}

std::vector<int> tile_starts(int len, int tile, double overlap) {
  UNETCU_CHECK(tile > 0 && overlap >= 0 && overlap < 1, "tiles of ", tile, " with overlap ", overlap);
  if (len <= tile) return {0};
  // At most one window per pixel of the slack (a stride of at least 1).
  const int n = int(std::min(std::ceil(double(len - tile) / (double(tile) * (1 - overlap))), double(len - tile))) + 1;
  std::vector<int> out;
  const double step = double(len - tile) / double(n - 1);
  for (int i = 0; i < n; ++i) out.push_back(int(std::lround(i * step)));
  return out;
}

Tensor predict_tiled(const Tensor& image, int tile, double overlap, int batch,
                     const std::function<Tensor(const Tensor&)>& forward) {
  UNETCU_CHECK(image.ndim() == 4 && image.dim(0) == 1 && image.dim(1) >= 1 && image.dtype() == DType::F32 &&
                   image.device().is_cpu() && image.format() == MemoryFormat::NCHW,
               "tiled prediction takes one float32 NCHW image [1, C, H, W] on the CPU, got ",
               shape_str(image.shape()));
  const int64_t in_channels = image.dim(1);
  UNETCU_CHECK(batch >= 1, "tiled prediction needs a batch of at least one tile");
  const int H = int(image.dim(2)), W = int(image.dim(3));
  const std::vector<int> ys = tile_starts(H, tile, overlap), xs = tile_starts(W, tile, overlap);
  std::vector<std::pair<int, int>> windows;
  for (int y : ys)
    for (int x : xs) windows.push_back({y, x});
  // nnU-Net's Gaussian importance map: sigma = tile / 8 around the centre, largest 1.
  std::vector<float> g1(size_t(tile), 0.f);
  const double sigma = tile / 8.0, centre = tile / 2.0;
  for (int i = 0; i < tile; ++i) g1[size_t(i)] = float(std::exp(-std::pow(i + 0.5 - centre, 2) / (2 * sigma * sigma)));
  const float gmax = *std::max_element(g1.begin(), g1.end());
  for (float& v : g1) v /= gmax;
  const float* src = image.data<float>();
  const size_t plane = size_t(H) * W, tplane = size_t(tile) * tile;
  Tensor probs, weights = Tensor::zeros({int64_t(H), int64_t(W)});
  int64_t C = 0;
  for (size_t first = 0; first < windows.size(); first += size_t(batch)) {
    const size_t count = std::min(windows.size() - first, size_t(batch));
    Tensor tiles = Tensor::zeros({int64_t(count), in_channels, tile, tile});
    float* t = tiles.data<float>();
    for (size_t k = 0; k < count; ++k) {
      const auto [y0, x0] = windows[first + k];
      for (int64_t c = 0; c < in_channels; ++c)
        for (int y = 0; y < tile && y0 + y < H; ++y)
          std::copy(src + c * plane + size_t(y0 + y) * W + x0, src + c * plane + size_t(y0 + y) * W + std::min(W, x0 + tile),
                    t + size_t(int64_t(k) * in_channels + c) * tplane + size_t(y) * tile);
    }
    Tensor logits = forward(tiles);
    if (!logits.device().is_cpu()) logits = logits.to(Device::cpu());
    if (logits.dtype() != DType::F32) logits = logits.to(DType::F32);
    if (logits.format() != MemoryFormat::NCHW) logits = logits.to(MemoryFormat::NCHW);
    UNETCU_CHECK(logits.ndim() == 4 && logits.dim(0) == int64_t(count) && logits.dim(2) == tile && logits.dim(3) == tile,
                 "tiled prediction: the network gave ", shape_str(logits.shape()), " for ", count, " tiles of ", tile);
    if (!probs.defined()) C = logits.dim(1), probs = Tensor::zeros({1, C, int64_t(H), int64_t(W)});
    const float* l = logits.data<float>();
    float* pr = probs.data<float>();
    float* wt = weights.data<float>();
    std::vector<float> p(static_cast<size_t>(C));
    for (size_t k = 0; k < count; ++k) {
      const auto [y0, x0] = windows[first + k];
      for (int y = 0; y < tile && y0 + y < H; ++y)
        for (int x = 0; x < tile && x0 + x < W; ++x) {
          const size_t q = size_t(y) * tile + x, o = size_t(y0 + y) * W + size_t(x0 + x);
          const float* lk = l + k * size_t(C) * tplane + q;
          if (C == 1) {
            p[0] = 1.f / (1.f + std::exp(-lk[0]));
          } else {
            float mx = lk[0], sum = 0;
            for (int64_t c = 1; c < C; ++c) mx = std::max(mx, lk[size_t(c) * tplane]);
            for (int64_t c = 0; c < C; ++c) sum += (p[size_t(c)] = std::exp(lk[size_t(c) * tplane] - mx));
            for (float& v : p) v /= sum;
          }
          const float w = g1[size_t(y)] * g1[size_t(x)];
          for (int64_t c = 0; c < C; ++c) pr[size_t(c) * plane + o] += w * p[size_t(c)];
          wt[o] += w;
        }
    }
  }
  float* pr = probs.data<float>();
  const float* wt = weights.data<float>();
  for (int64_t c = 0; c < C; ++c)
    for (size_t o = 0; o < plane; ++o) pr[size_t(c) * plane + o] /= wt[o];
  return probs;
}

Tensor logits_of_probabilities(const Tensor& probs) {
  Tensor out = Tensor::empty(probs.shape());
  const float* p = probs.data<float>();
  float* o = out.data<float>();
  const bool binary = probs.dim(1) == 1;
  for (int64_t i = 0; i < probs.numel(); ++i) {
    const double v = std::clamp(double(p[i]), 1e-7, 1 - 1e-7);
    o[i] = float(binary ? std::log(v / (1 - v)) : std::log(v));
  }
  return out;
}

}  // namespace unetcu
