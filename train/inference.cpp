#include "train/inference.h"

#include <algorithm>

#include "data/dataset.h"
#include "data/synthetic.h"
#include "engine/tape.h"

namespace unetcu {

int tta_passes(Tta tta) { return tta == Tta::None ? 1 : tta == Tta::HFlip ? 2 : 4; }

void prepare_input(const Image& img, int size, float* out) {
  UNETCU_CHECK(img.channels == 3 && img.width > 0 && img.height > 0, "prediction needs an RGB image, got ",
               img.width, "x", img.height, "x", img.channels);
  resize_bilinear(img, size, out);
  const size_t plane = size_t(size) * size;
  for (int c = 0; c < 3; ++c)
    for (size_t q = 0; q < plane; ++q) out[c * plane + q] = (out[c * plane + q] - kImageMean[c]) / kImageStd[c];
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

}  // namespace unetcu
