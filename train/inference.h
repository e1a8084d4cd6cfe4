// Prediction with a trained model: an image made into the network's input as the training data
// is, and the forward pass in evaluation mode (batch norm's running statistics, no tape) over a
// batch of inputs, optionally averaged over flipped copies (test-time augmentation).
#pragma once
#include <functional>
#include <vector>

#include "data/image_io.h"
#include "data/synthetic.h"
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
// The same at width x height.
void prepare_input(const Image& img, int width, int height, float* out);
// Any image read by load_image_values (its channels: the normalisation's), normalised by `norm`:
// planar float32 [C, height, width] at `out`.
void prepare_input(const ImageValues& img, int width, int height, const Normalization& norm, float* out);

// The logits [N, classes, H, W] (float32, NCHW, on the CPU) of `model` (in evaluation mode) for
// the inputs [N, 3, H, W] (float32, NCHW, on the CPU), one forward pass per augmentation over
// the whole batch on the model's device, the passes' logits added in a fixed order and divided
// by their number. In evaluation mode each image's logits do not depend on the others in its
// batch (up to the float32 rounding of the library's kernels for another batch size).
Tensor predict_logits(UNet& model, const Tensor& inputs, Tta tta = Tta::None);

// Sliding-window prediction, as nnU-Net's: `image` [1, C, H, W] (normalised, float32, NCHW,
// CPU; any H, W) is covered by tile x tile windows overlapping by `overlap` (0 <= overlap < 1:
// along each side n = min(ceil((L - tile) / (tile (1 - overlap))), L - tile) + 1 windows, evenly spaced from
// edge to edge; one window, padded with 0, where L <= tile). `forward` gives the logits
// [B, C, tile, tile] of a batch of windows, at most `batch` at once; each window's
// probabilities (softmax over C, sigmoid for one channel) are added with a Gaussian weight
// (sigma = tile / 8, centred) and divided by the weights' sum at each pixel. Returns the
// probabilities [1, C, H, W] (float32, CPU): memory is the image's, its probabilities and
// one batch of windows.
Tensor predict_tiled(const Tensor& image, int tile, double overlap, int batch,
                     const std::function<Tensor(const Tensor&)>& forward);

// The window starts along a side of `len` (predict_tiled's rule).
std::vector<int> tile_starts(int len, int tile, double overlap);

// Logits whose softmax (sigmoid for one channel) is `probs` ([N, C, H, W] float32 CPU):
// log p for C >= 2, log(p / (1 - p)) for one channel, p clamped to [1e-7, 1 - 1e-7]; the loss
// of a blended prediction is the loss of these.
Tensor logits_of_probabilities(const Tensor& probs);

}  // namespace unetcu
