// UNet with a ResNet encoder, exactly segmentation_models_pytorch's
// Unet(encoder, classes=N, in_channels=C) for encoder resnet18, 34, 50, 101 or 152: same
// layers, same parameter/buffer names, and the initialisation of Unet(..., encoder_weights=None)
// (pretrained encoder weights are loaded separately).
//
// The model is a list of named blocks with explicit skip edges, so it can be cut between any
// two blocks (model parallelism). With resnet34 (BasicBlocks 3, 4, 6, 3):
//    0 encoder.stem       conv1 7×7/2 + bn1 + relu          in: image        -> 64,  H/2
//    1 encoder.layer1     maxpool 3×3/2 + 3 BasicBlocks      in: 0            -> 64,  H/4
//    2 encoder.layer2     4 BasicBlocks (first /2)           in: 1            -> 128, H/8
//    3 encoder.layer3     6 BasicBlocks (first /2)           in: 2            -> 256, H/16
//    4 encoder.layer4     3 BasicBlocks (first /2)           in: 3            -> 512, H/32
//    5 decoder.blocks.0   up×2, cat skip, 2×(conv3×3+BN+ReLU) in: 4, skip 3  -> 256, H/16
//    6 decoder.blocks.1                                      in: 5, skip 2    -> 128, H/8
//    7 decoder.blocks.2                                      in: 6, skip 1    -> 64,  H/4
//    8 decoder.blocks.3                                      in: 7, skip 0    -> 32,  H/2
//    9 decoder.blocks.4   (no skip)                          in: 8            -> 16,  H
//   10 segmentation_head  conv3×3 16→1 with bias             in: 9            -> 1,   H
// resnet18 has 2, 2, 2, 2 BasicBlocks; resnet50, 101 and 152 have Bottlenecks (3, 4, 6, 3;
// 3, 4, 23, 3; 3, 8, 36, 3) whose layers end in 256, 512, 1024 and 2048 channels, and the
// decoder takes those as its inputs and skips, as SMP's does. The blocks are the same 11.
// Channel counts are divided by `width_divisor` (at least 1) for small test models.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "engine/module.h"
#include "engine/named.h"

namespace unetcu {

// The encoders: torchvision's ResNets under SMP's encoder names.
enum class EncoderKind { ResNet18, ResNet34, ResNet50, ResNet101, ResNet152 };
inline constexpr NamedValue<EncoderKind> kEncoderNames[] = {{"resnet18", EncoderKind::ResNet18},
                                                            {"resnet34", EncoderKind::ResNet34},
                                                            {"resnet50", EncoderKind::ResNet50},
                                                            {"resnet101", EncoderKind::ResNet101},
                                                            {"resnet152", EncoderKind::ResNet152}};
inline const char* encoder_name(EncoderKind k) { return name_of(kEncoderNames, k); }
struct EncoderSpec {
  int blocks[4];    // residual blocks in layer1..layer4
  bool bottleneck;  // Bottleneck (1×1, 3×3, 1×1, ×4 channels) rather than BasicBlock
};
const EncoderSpec& encoder_spec(EncoderKind kind);
// The encoder a checkpoint's settings (engine/checkpoint.h) record under "encoder": resnet34
// where the entry is absent (it is what every checkpoint without it holds); an unknown name
// is an error naming the file.
EncoderKind recorded_encoder(const std::map<std::string, std::string>& settings, const std::string& file);
// The channels of the encoder's five features (stem, layer1..layer4) at width divisor d.
std::vector<int> encoder_channels(EncoderKind kind, int d);

struct UNetConfig {
  EncoderKind encoder = EncoderKind::ResNet34;
  int width_divisor = 1;
  DType dtype = DType::F32;  // parameters (and the logits)
  // Mixed precision: activations (and their gradients) stored in bfloat16, computed in float32;
  // parameters, optimizer, batch-norm statistics and the loss stay `dtype` (float32).
  bool bf16_activations = false;
  // Memory format of the activations: NHWC is channels-last. The input is converted at the
  // stem and the logits back to NCHW at the head.
  MemoryFormat format = MemoryFormat::NCHW;
  Device device = Device::cpu();
  uint64_t seed = 0;  // initialisation
  int in_channels = 3;
  int classes = 1;
  // Blocks whose activations are recomputed in the backward (UNet::run_block), one flag per
  // block in blocks() order (kBlocks); empty: none.
  std::vector<bool> recompute;
};

class UNet : public Module {
 public:
  explicit UNet(const UNetConfig& cfg);
  static constexpr int kBlocks = 11;  // stem, layer1-4, decoder blocks 0-4, head

  struct Block {
    std::string name;
    std::vector<int> inputs;        // indices of earlier blocks; -1 is the model input
    std::vector<Module*> modules;   // the modules whose parameters this block uses
    std::function<Tensor(const std::vector<Tensor>&)> forward;
  };
  const std::vector<Block>& blocks() const { return blocks_; }
  // The blocks' names, in order (the names a cut or a recomputed block is given by).
  static const std::vector<std::string>& block_names();

  // Logits [N, classes, H, W] in `dtype`, NCHW; H and W must be multiples of 32.
  Tensor forward(const Tensor& x);
  // The output of every block, in order (the last is the logits).
  std::vector<Tensor> forward_all(const Tensor& x);

  // Block b's forward on its inputs, named for the profiler. A block marked for
  // recomputation (engine/recompute.h) keeps only its inputs and output on the tape; its
  // backward runs its forward again first.
  Tensor run_block(size_t b, const std::vector<Tensor>& in) const;
  void set_recompute(std::vector<bool> blocks);  // one flag per block; empty: none
  const std::vector<bool>& recompute() const { return recompute_; }

  const UNetConfig& config() const { return cfg_; }
  DType activation_dtype() const { return cfg_.bf16_activations ? DType::BF16 : cfg_.dtype; }
  static void check_input(const Tensor& x, int in_channels);

 private:
  UNetConfig cfg_;
  std::vector<Block> blocks_;
  std::vector<bool> recompute_;
};

}  // namespace unetcu
