#include "models/unet.h"

#include <algorithm>
#include <array>

#include "engine/profiler.h"
#include "engine/recompute.h"

namespace unetcu {

const EncoderSpec& encoder_spec(EncoderKind kind) {
  static const EncoderSpec kSpecs[] = {{{2, 2, 2, 2}, false},   // resnet18
                                       {{3, 4, 6, 3}, false},   // resnet34
                                       {{3, 4, 6, 3}, true},    // resnet50
                                       {{3, 4, 23, 3}, true},   // resnet101
                                       {{3, 8, 36, 3}, true}};  // resnet152
  return kSpecs[int(kind)];
}

EncoderKind recorded_encoder(const std::map<std::string, std::string>& settings, const std::string& file) {
  const auto it = settings.find("encoder");
  if (it == settings.end()) return EncoderKind::ResNet34;
  for (const auto& e : kEncoderNames)
    if (it->second == e.name) return e.value;
  throw Error(str_cat("checkpoint '", file, "' records encoder '", it->second, "', not one of ",
                      names_list(kEncoderNames)));
}

std::vector<int> encoder_channels(EncoderKind kind, int d) {
  const int x = encoder_spec(kind).bottleneck ? 4 : 1;
  const auto w = [d](int c) { return std::max(1, c / d); };
  return {w(64), x * w(64), x * w(128), x * w(256), x * w(512)};
}

namespace {

int width(int channels, int divisor) { return std::max(1, channels / divisor); }

// Every BatchNorm2d of the model has PyTorch's defaults; the fused ops below take them too.
constexpr double kBnMomentum = 0.1, kBnEps = 1e-5;

std::unique_ptr<BatchNorm2d> make_bn(int channels, DType dt, Device dev) {
  return std::make_unique<BatchNorm2d>(channels, dt, dev, kBnMomentum, kBnEps);
}

// relu(bn(x)) and relu(bn(x) + residual) as one fused op each (engine/ops.h), with the layer's
// parameters and running statistics, counting the batch as BatchNorm2d::forward does.
Tensor bn_relu(BatchNorm2d* bn, const Tensor& x) {
  BatchNorm2d::Running r = bn->begin_forward();
  return batch_norm_relu(x, bn->weight, bn->bias, r.mean, r.var, bn->is_training(), kBnMomentum,
                         kBnEps);
}
Tensor bn_add_relu(BatchNorm2d* bn, const Tensor& x, const Tensor& residual) {
  BatchNorm2d::Running r = bn->begin_forward();
  return batch_norm_add_relu(x, bn->weight, bn->bias, residual, r.mean, r.var, bn->is_training(),
                             kBnMomentum, kBnEps);
}

// A container whose children are named "0", "1", ... like nn.Sequential.
class Sequential : public Module {
 public:
  template <class M>
  M* add(std::unique_ptr<M> m) {
    return add_child(std::to_string(count_++), std::move(m));
  }

 private:
  int count_ = 0;
};

// torchvision BasicBlock: conv3×3(stride)+BN+ReLU, conv3×3+BN, + identity or 1×1/stride
// conv+BN downsample, ReLU.
class BasicBlock : public Module {
 public:
  BasicBlock(int in, int out, int stride, Rng& rng, DType dt, Device dev) {
    conv1 = add_child("conv1", std::make_unique<Conv2d>(in, out, 3, stride, 1, false,
                                                         Init::KaimingNormalFanOut, rng, dt, dev));
    bn1 = add_child("bn1", make_bn(out, dt, dev));
    conv2 = add_child("conv2", std::make_unique<Conv2d>(out, out, 3, 1, 1, false,
                                                         Init::KaimingNormalFanOut, rng, dt, dev));
    bn2 = add_child("bn2", make_bn(out, dt, dev));
    if (stride != 1 || in != out) {
      auto ds = std::make_unique<Sequential>();
      down_conv = ds->add(std::make_unique<Conv2d>(in, out, 1, stride, 0, false,
                                                   Init::KaimingNormalFanOut, rng, dt, dev));
      down_bn = ds->add(make_bn(out, dt, dev));
      add_child("downsample", std::move(ds));
    }
  }
  // The tail relu(bn2(conv2(h)) + identity) is one fused op; the downsample branch runs before
  // it, after conv2 (as before fusion, so the backward accumulates x's gradient in one order).
  Tensor forward(const Tensor& x) {
    Tensor h = conv2->forward(bn_relu(bn1, conv1->forward(x)));
    Tensor identity = down_conv ? down_bn->forward(down_conv->forward(x)) : x;
    return bn_add_relu(bn2, h, identity);
  }

 private:
  Conv2d* conv1;
  BatchNorm2d* bn1;
  Conv2d* conv2;
  BatchNorm2d* bn2;
  Conv2d* down_conv = nullptr;
  BatchNorm2d* down_bn = nullptr;
};

// torchvision Bottleneck (ResNet v1.5, the stride on the 3×3): conv1×1+BN+ReLU,
// conv3×3(stride)+BN+ReLU, conv1×1 to 4× the channels+BN, + identity or 1×1/stride conv+BN
// downsample, ReLU.
class Bottleneck : public Module {
 public:
  Bottleneck(int in, int planes, int stride, Rng& rng, DType dt, Device dev) {
    const int out = 4 * planes;
    conv1 = add_child("conv1", std::make_unique<Conv2d>(in, planes, 1, 1, 0, false, Init::KaimingNormalFanOut, rng,
                                                         dt, dev));
    bn1 = add_child("bn1", make_bn(planes, dt, dev));
    conv2 = add_child("conv2", std::make_unique<Conv2d>(planes, planes, 3, stride, 1, false,
                                                         Init::KaimingNormalFanOut, rng, dt, dev));
    bn2 = add_child("bn2", make_bn(planes, dt, dev));
    conv3 = add_child("conv3", std::make_unique<Conv2d>(planes, out, 1, 1, 0, false, Init::KaimingNormalFanOut, rng,
                                                         dt, dev));
    bn3 = add_child("bn3", make_bn(out, dt, dev));
    if (stride != 1 || in != out) {
      auto ds = std::make_unique<Sequential>();
      down_conv = ds->add(std::make_unique<Conv2d>(in, out, 1, stride, 0, false, Init::KaimingNormalFanOut, rng, dt,
                                                   dev));
      down_bn = ds->add(make_bn(out, dt, dev));
      add_child("downsample", std::move(ds));
    }
  }
  Tensor forward(const Tensor& x) {
    Tensor h = conv3->forward(bn_relu(bn2, conv2->forward(bn_relu(bn1, conv1->forward(x)))));
    Tensor identity = down_conv ? down_bn->forward(down_conv->forward(x)) : x;
    return bn_add_relu(bn3, h, identity);
  }

 private:
  Conv2d *conv1, *conv2, *conv3;
  BatchNorm2d *bn1, *bn2, *bn3;
  Conv2d* down_conv = nullptr;
  BatchNorm2d* down_bn = nullptr;
};

// A torchvision layer: `count` blocks of one kind, the first with the stride (and the
// downsample where the shape changes). `planes` is a Bottleneck's inner width; its output has
// 4× that.
class ResLayer : public Sequential {
 public:
  ResLayer(bool bottleneck, int in, int planes, int count, int stride, Rng& rng, DType dt, Device dev) {
    const int out = bottleneck ? 4 * planes : planes;
    for (int i = 0; i < count; ++i) {
      const int cin = i == 0 ? in : out, s = i == 0 ? stride : 1;
      if (bottleneck) {
        Bottleneck* b = add(std::make_unique<Bottleneck>(cin, planes, s, rng, dt, dev));
        blocks.push_back([b](const Tensor& x) { return b->forward(x); });
      } else {
        BasicBlock* b = add(std::make_unique<BasicBlock>(cin, planes, s, rng, dt, dev));
        blocks.push_back([b](const Tensor& x) { return b->forward(x); });
      }
    }
  }
  Tensor forward(Tensor x) {
    for (const auto& b : blocks) x = b(x);
    return x;
  }

 private:
  std::vector<std::function<Tensor(const Tensor&)>> blocks;
};

// SMP Conv2dReLU: Sequential(conv3×3 no bias, BN, ReLU) -> names "<name>.0.weight", "<name>.1.*".
class ConvBnRelu : public Sequential {
 public:
  ConvBnRelu(int in, int out, Rng& rng, DType dt, Device dev) {
    conv = add(std::make_unique<Conv2d>(in, out, 3, 1, 1, false, Init::KaimingUniformFanIn, rng, dt, dev));
    bn = add(make_bn(out, dt, dev));
  }
  Tensor forward(const Tensor& x) { return bn_relu(bn, conv->forward(x)); }

 private:
  Conv2d* conv;
  BatchNorm2d* bn;
};

// SMP DecoderBlock: nearest ×2 upsample, concat the skip (if any), two ConvBnRelu.
class DecoderBlock : public Module {
 public:
  DecoderBlock(int in, int skip, int out, Rng& rng, DType dt, Device dev) {
    conv1 = add_child("conv1", std::make_unique<ConvBnRelu>(in + skip, out, rng, dt, dev));
    conv2 = add_child("conv2", std::make_unique<ConvBnRelu>(out, out, rng, dt, dev));
  }
  Tensor forward(const Tensor& x, const Tensor* skip) {
    // With a skip the upsample is written straight into its slot of the concat buffer.
    const Tensor h = skip ? upsample_nearest2x_concat(x, *skip) : upsample_nearest2x(x);
    return conv2->forward(conv1->forward(h));
  }

 private:
  ConvBnRelu* conv1;
  ConvBnRelu* conv2;
};

class Encoder : public Module {
 public:
  Encoder(EncoderKind kind, int in_channels, int d, Rng& rng, DType dt, Device dev) {
    const EncoderSpec& e = encoder_spec(kind);
    const int c64 = width(64, d);
    const std::vector<int> out = encoder_channels(kind, d);
    conv1 = add_child("conv1", std::make_unique<Conv2d>(in_channels, c64, 7, 2, 3, false,
                                                         Init::KaimingNormalFanOut, rng, dt, dev));
    bn1 = add_child("bn1", make_bn(c64, dt, dev));
    ResLayer* layers[4];
    for (int l = 0; l < 4; ++l) {
      const int planes = width(64 << l, d);
      layers[l] = add_child("layer" + std::to_string(l + 1),
                            std::make_unique<ResLayer>(e.bottleneck, out[l], planes, e.blocks[l], l == 0 ? 1 : 2,
                                                       rng, dt, dev));
    }
    layer1 = layers[0], layer2 = layers[1], layer3 = layers[2], layer4 = layers[3];
  }
  Conv2d* conv1;
  BatchNorm2d* bn1;
  ResLayer *layer1, *layer2, *layer3, *layer4;
};

class Decoder : public Module {
 public:
  Decoder(EncoderKind encoder, int d, Rng& rng, DType dt, Device dev) {
    auto seq = std::make_unique<Sequential>();
    // in: previous decoder output (the first: encoder layer4); skip: encoder features, deepest
    // first.
    const std::vector<int> c = encoder_channels(encoder, d);
    const int enc[5] = {c[4], c[3], c[2], c[1], c[0]};
    const int dec[5] = {width(256, d), width(128, d), width(64, d), width(32, d), width(16, d)};
    for (int i = 0; i < 5; ++i) {
      const int in = i == 0 ? enc[0] : dec[i - 1];
      const int skip = i < 4 ? enc[i + 1] : 0;
      blocks.push_back(seq->add(std::make_unique<DecoderBlock>(in, skip, dec[i], rng, dt, dev)));
    }
    add_child("blocks", std::move(seq));
  }
  std::vector<DecoderBlock*> blocks;
};

class Head : public Sequential {
 public:
  Head(int in, int classes, Rng& rng, DType dt, Device dev) {
    conv = add(std::make_unique<Conv2d>(in, classes, 3, 1, 1, true, Init::XavierUniform, rng, dt, dev));
  }
  Conv2d* conv;
};

}  // namespace

UNet::UNet(const UNetConfig& cfg) : cfg_(cfg) {
  UNETCU_CHECK(cfg.width_divisor >= 1, "width divisor must be >= 1, got ", cfg.width_divisor);
  UNETCU_CHECK(!cfg.bf16_activations || cfg.dtype == DType::F32,
               "bfloat16 activations go with float32 parameters, not ", dtype_name(cfg.dtype));
  Rng rng(cfg.seed);
  const int d = cfg.width_divisor;
  UNETCU_CHECK(cfg.in_channels >= 1, "in_channels must be >= 1, got ", cfg.in_channels);
  Encoder* enc =
      add_child("encoder", std::make_unique<Encoder>(cfg.encoder, cfg.in_channels, d, rng, cfg.dtype, cfg.device));
  Decoder* dec = add_child("decoder", std::make_unique<Decoder>(cfg.encoder, d, rng, cfg.dtype, cfg.device));
  Head* head = add_child("segmentation_head",
                         std::make_unique<Head>(width(16, d), cfg.classes, rng, cfg.dtype, cfg.device));

  // The activations' dtype and format start at the stem (the image is converted once) and end
  // at the head (the logits go back to the parameters' dtype, NCHW, for the loss).
  const DType act = activation_dtype();
  const MemoryFormat fmt = cfg.format;
  blocks_.push_back({"encoder.stem", {-1}, {enc->conv1, enc->bn1},
                     [enc, act, fmt](const std::vector<Tensor>& in) {
                       return bn_relu(enc->bn1, enc->conv1->forward(convert(in[0], act, fmt)));
                     }});
  blocks_.push_back({"encoder.layer1", {0}, {enc->layer1}, [enc](const std::vector<Tensor>& in) {
                       return enc->layer1->forward(max_pool2d(in[0], Pool2dOptions::square(3, 2, 1)));
                     }});
  ResLayer* layers[3] = {enc->layer2, enc->layer3, enc->layer4};
  for (int i = 0; i < 3; ++i) {
    ResLayer* l = layers[i];
    blocks_.push_back({"encoder.layer" + std::to_string(i + 2), {i + 1}, {l},
                       [l](const std::vector<Tensor>& in) { return l->forward(in[0]); }});
  }
  for (int i = 0; i < 5; ++i) {
    DecoderBlock* b = dec->blocks[i];
    std::vector<int> inputs = {4 + i};
    if (i < 4) inputs.push_back(3 - i);  // skips: layer3, layer2, layer1, stem
    blocks_.push_back({"decoder.blocks." + std::to_string(i), inputs, {b},
                       [b](const std::vector<Tensor>& in) {
                         return b->forward(in[0], in.size() > 1 ? &in[1] : nullptr);
                       }});
  }
  const DType out_dtype = cfg.dtype;
  blocks_.push_back({"segmentation_head", {9}, {head}, [head, out_dtype](const std::vector<Tensor>& in) {
                       return convert(head->conv->forward(in[0]), out_dtype, MemoryFormat::NCHW);
                     }});
  UNETCU_CHECK(int(blocks_.size()) == kBlocks, "the UNet has ", blocks_.size(), " blocks");
  set_recompute(cfg.recompute);
}

void UNet::check_input(const Tensor& x, int in_channels) {
  UNETCU_CHECK(x.ndim() == 4, "UNet input must be [N, C, H, W], got ", shape_str(x.shape()));
  UNETCU_CHECK(x.dim(1) == in_channels, "UNet input has ", x.dim(1), " channels, expected ",
               in_channels);
  UNETCU_CHECK(x.dim(2) % 32 == 0 && x.dim(3) % 32 == 0 && x.dim(2) > 0 && x.dim(3) > 0,
               "UNet input height and width must be multiples of 32, got ", x.dim(2), "x",
               x.dim(3));
}

void UNet::set_recompute(std::vector<bool> blocks) {
  UNETCU_CHECK(blocks.empty() || blocks.size() == blocks_.size(), "recompute: ", blocks.size(),
               " flags for ", blocks_.size(), " blocks");
  recompute_ = std::move(blocks);
}

Tensor UNet::run_block(size_t b, const std::vector<Tensor>& in) const {
  const Block& block = blocks_.at(b);
  BlockScope scope(block.name);
  ProfileRange range(block.name, "block");
  if (recompute_.empty() || !recompute_[b]) return block.forward(in);
  const auto fn = [&block](const std::vector<Tensor>& x) { return std::vector<Tensor>{block.forward(x)}; };
  // The parameters as they are now: a pipeline moves its blocks' modules after construction,
  // and a list taken earlier would keep the old device's copies alive.
  std::vector<Tensor> params;
  for (Module* m : block.modules)
    for (const Tensor& p : m->parameters()) params.push_back(p);
  return checkpoint("recompute", fn, in, params).at(0);
}

std::vector<Tensor> UNet::forward_all(const Tensor& x) {
  check_input(x, cfg_.in_channels);
  std::vector<Tensor> outs;
  outs.reserve(blocks_.size());
  for (size_t b = 0; b < blocks_.size(); ++b) {
    std::vector<Tensor> in;
    for (int i : blocks_[b].inputs) in.push_back(i < 0 ? x : outs[i]);
    outs.push_back(run_block(b, in));
  }
  return outs;
}

Tensor UNet::forward(const Tensor& x) {
  check_input(x, cfg_.in_channels);
  // Keeps only the tensors later blocks still read, so inference frees activations early.
  std::vector<Tensor> outs(blocks_.size());
  std::vector<int> last_use(blocks_.size(), -1);
  for (size_t b = 0; b < blocks_.size(); ++b)
    for (int i : blocks_[b].inputs)
      if (i >= 0) last_use[i] = int(b);
  for (size_t b = 0; b < blocks_.size(); ++b) {
    std::vector<Tensor> in;
    for (int i : blocks_[b].inputs) in.push_back(i < 0 ? x : outs[i]);
    outs[b] = run_block(b, in);
    for (int i : blocks_[b].inputs)
      if (i >= 0 && last_use[i] == int(b)) outs[i] = Tensor();
  }
  return outs.back();
}

const std::vector<std::string>& UNet::block_names() {
  static const std::vector<std::string> names = [] {
    UNetConfig probe;
    probe.width_divisor = 64;  // only the block names are read
    UNet model(probe);
    std::vector<std::string> out;
    for (const auto& b : model.blocks()) out.push_back(b.name);
    return out;
  }();
  return names;
}

}  // namespace unetcu
