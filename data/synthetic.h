// The embedded synthetic segmentation set: RGB images of random shapes (ellipses, rotated
// rectangles, triangles) on a textured, noisy background, with the binary mask of the shapes.
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
  // image_size must be a positive multiple of 32.
  SyntheticSegmentation(int image_size, uint64_t seed);
  int image_size() const { return size_; }

  // Writes sample `index`: image [3, S, S] in [0, 1] (not normalised) and mask [S, S].
  void render(int64_t index, float* image, float* mask) const;

  // Keeps rendered samples [0, count) in memory so later epochs copy instead of drawing
  // (drawing a 512×512 sample costs milliseconds of transcendental math). Not thread-safe
  // against batch() calls running at the same time for the same index.
  void enable_cache(int64_t count);
  static size_t sample_bytes(int image_size) { return size_t(4) * image_size * image_size * sizeof(float); }
  // Sample `index` (image in [0, 1], mask), from the cache when it is on.
  void sample(int64_t index, float* image, float* mask) const;
  // Normalised images and masks of the given sample indices.
  // pinned: page-locked host memory, so the upload to a GPU does not wait (needs CUDA).
  Batch batch(const std::vector<int64_t>& indices, DType dtype = DType::F32,
              Device device = Device::cpu(), bool pinned = false) const;

 private:
  int size_;
  uint64_t seed_;
  mutable std::vector<std::vector<float>> cache_;  // image (3 planes) then mask, per index
};

// Writes one sample (image [3, S, S] in [0, 1], mask [S, S]) as row b of a batch, the image
// normalised with the ImageNet mean/std, in the batch's dtype.
void store_normalized(const float* image, const float* mask, Batch& out, int64_t b);

// A seeded permutation of [0, n) for one epoch (the same seed and epoch give the same order).
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int epoch);

// ImageNet normalisation used by torchvision / SMP encoders.
constexpr float kImageMean[3] = {0.485f, 0.456f, 0.406f};
constexpr float kImageStd[3] = {0.229f, 0.224f, 0.225f};

}  // namespace unetcu
