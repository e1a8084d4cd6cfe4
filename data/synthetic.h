// The embedded synthetic segmentation set: RGB images of random shapes (ellipses, rotated
// rectangles, triangles) on a textured, noisy background, with the mask of the shapes: with
// one class, 1 on every shape; with C = 2..4 classes, the class of each pixel: 0 background and
// 1..C-1 one kind of shape each (C = 2: every shape is class 1; C = 3: ellipses 1, rectangles
// 2; C = 4: triangles 3), each kind's colour leaning to a tint of its own (red, blue, green)
// from C = 3 on.
// Sample i is a pure function of (seed, i), so any subset is reproducible and training and
// validation samples never overlap (they are different index ranges).
#pragma once
#include <cstdint>
#include <vector>

#include "data/batch.h"
#include "engine/tensor.h"

namespace unetcu {

class SyntheticSegmentation {
 public:
  // width and height must be positive multiples of 32; classes 1..4.
  SyntheticSegmentation(int width, int height, uint64_t seed, int classes = 1);
  SyntheticSegmentation(int image_size, uint64_t seed) : SyntheticSegmentation(image_size, image_size, seed) {}
  int width() const { return width_; }
  int height() const { return height_; }
  int classes() const { return classes_; }

  // Writes sample `index`: image [3, H, W] in [0, 1] (not normalised) and mask [H, W].
  void render(int64_t index, float* image, float* mask) const;

  // Keeps rendered samples [0, count) in memory so later epochs copy instead of drawing
  // (drawing a 512×512 sample costs milliseconds of transcendental math). Not thread-safe
  // against batch() calls running at the same time for the same index.
  void enable_cache(int64_t count);
  static size_t sample_bytes(int width, int height) { return size_t(4) * width * height * sizeof(float); }
  // Sample `index` (image in [0, 1], mask), from the cache when it is on.
  void sample(int64_t index, float* image, float* mask) const;
  // Normalised images and masks of the given sample indices.
  // pinned: page-locked host memory, so the upload to a GPU does not wait (needs CUDA).
  Batch batch(const std::vector<int64_t>& indices, DType dtype = DType::F32,
              Device device = Device::cpu(), bool pinned = false) const;

 private:
  int width_, height_;
  uint64_t seed_;
  int classes_;
  mutable std::vector<std::vector<float>> cache_;  // image (3 planes) then mask, per index
};

// ImageNet normalisation used by torchvision / SMP encoders.
constexpr float kImageMean[3] = {0.485f, 0.456f, 0.406f};
constexpr float kImageStd[3] = {0.229f, 0.224f, 0.225f};

// How an image in [0, 1] becomes the network's input: (value - mean[c]) / std[c] for each of
// its channels (as many as mean holds).
struct Normalization {
  enum Kind { ImageNet, Dataset, None };  // the names: kNormalizationNames (data/dataset.h)
  Kind kind = ImageNet;
  std::vector<float> mean{kImageMean[0], kImageMean[1], kImageMean[2]};
  std::vector<float> std{kImageStd[0], kImageStd[1], kImageStd[2]};
  int channels() const { return int(mean.size()); }
  static Normalization none(int channels) {
    return {None, std::vector<float>(size_t(channels), 0.f), std::vector<float>(size_t(channels), 1.f)};
  }
};

// Writes one sample (image [C, H, W] in [0, 1], mask [H, W]) as row b of a batch, the image
// normalised by `norm` (C of its channels: the batch's), in the batch's dtype.
void store_normalized(const float* image, const float* mask, Batch& out, int64_t b,
                      const Normalization& norm = Normalization{});

// A seeded permutation of [0, n) for one epoch (the same seed and epoch give the same order).
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int epoch);

}  // namespace unetcu
