// Prediction with a trained model: an image made into the network's input as the training data
// is, and the forward pass in evaluation mode (batch norm's running statistics, no tape) over a
// batch of inputs, optionally averaged over flipped copies (test-time augmentation).
#pragma once
#include "data/image_io.h"
#include "engine/named.h"
#include "engine/tensor.h"
#include "models/unet.h"

namespace unetcu {

// Test-time augmentation: the logits of the image alone, or the mean of the logits of the image
// and of its mirror images, each mirrored back (hflip: left-right; flips: left-right, top-bottom
// and both).
enum class Tta { None, HFlip, Flips };
inline constexpr NamedValue<Tta> kTtaNames[] = {{"none", Tta::None}, {"hflip", Tta::HFlip}, {"flips", Tta::Flips}};
int tta_passes(Tta tta);

// The network's input for one image: resized to size x size (bilinear), scaled to [0, 1] and
// normalised with the ImageNet mean and deviation, as the training data is: planar float32
// [3, size, size] at `out`.
void prepare_input(const Image& img, int size, float* out);

// The logits [N, classes, H, W] (float32, NCHW, on the CPU) of `model` (in evaluation mode) for
// the inputs [N, 3, H, W] (float32, NCHW, on the CPU), one forward pass per augmentation over
// the whole batch on the model's device, the passes' logits added in a fixed order and divided
// by their number. In evaluation mode each image's logits do not depend on the others in its
// batch (up to the float32 rounding of the library's kernels for another batch size).
Tensor predict_logits(UNet& model, const Tensor& inputs, Tta tta = Tta::None);

}  // namespace unetcu
