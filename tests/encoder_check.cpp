// encoder_check WEIGHTS GOLDEN [ENCODER [IN_CHANNELS]]: loads torchvision ResNet weights
// exported by `tools/pytorch_reference.py export-encoder --dtype float64` (any --format: a
// torch.save .pth, or safetensors under torchvision's or SMP's names) the way
// `unet_train --encoder-weights` does (every encoder tensor of the model must be in the file;
// a first convolution of 3 channels is adapted to IN_CHANNELS), runs the engine's encoder
// (ENCODER, default resnet34) in eval mode on the golden input and compares its five feature
// maps with torchvision's (float64 on both sides: relative L2 error < 1e-10). Exit 0 when they
// match.
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <exception>

#include "engine/checkpoint.h"
#include "engine/tape.h"
#include "models/encoder_weights.h"
#include "models/unet.h"

using namespace unetcu;

int main(int argc, char** argv) {
  if (argc < 3 || argc > 5) {
    std::fprintf(stderr, "usage: encoder_check WEIGHTS GOLDEN.safetensors [ENCODER [IN_CHANNELS]]\n");
    return 2;
  }
  try {
    UNetConfig cfg;
    cfg.dtype = DType::F64;
    if (argc > 3) cfg.encoder = parse_named(kEncoderNames, "encoder", argv[3]);
    if (argc > 4) cfg.in_channels = std::atoi(argv[4]);
    UNet model(cfg);
    const SafeTensors weights = read_encoder_weights(argv[1], model);
    load_model_state(model, weights, argv[1], "encoder.");
    model.eval();
    const SafeTensors golden = read_safetensors(argv[2]);
    auto tensor = [&](const std::string& name) {
      const SafeTensor& t = golden.at(name);
      UNETCU_CHECK(t.dtype == "F64", name, " is ", t.dtype, ", expected F64");
      Tensor out = Tensor::empty(t.shape, DType::F64);
      std::memcpy(out.raw(), t.data.data(), t.data.size());
      return out;
    };
    NoGradScope no_grad;
    const std::vector<Tensor> outs = model.forward_all(tensor("golden.input"));
    int failures = 0;
    for (int i = 0; i < 5; ++i) {
      const Tensor want = tensor("golden.feature." + std::to_string(i));
      const Tensor& got = outs.at(size_t(i));
      double num = 0, den = 0;
      UNETCU_CHECK(got.shape() == want.shape(), "feature ", i, ": shape ", shape_str(got.shape()),
                   ", torchvision's ", shape_str(want.shape()));
      const double* g = got.data<double>();
      const double* w = want.data<double>();
      for (int64_t k = 0; k < want.numel(); ++k) {
        num += (g[k] - w[k]) * (g[k] - w[k]);
        den += w[k] * w[k];
      }
      const double rel = std::sqrt(num / std::max(den, 1e-300));
      std::printf("%s %s: relative error %.3g\n", model.blocks()[size_t(i)].name.c_str(),
                  shape_str(got.shape()).c_str(), rel);
      if (!(rel < 1e-10)) ++failures;
    }
    std::printf("%zu encoder tensors loaded; %s\n", weights.size(), failures ? "MISMATCH" : "all five feature maps match");
    return failures ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "encoder_check: error: %s\n", e.what());
    return 1;
  }
}
