// Datasets beyond the synthetic set: a common interface, image folders read through
// stb_image, seeded augmentation applied identically to image and mask, and batching.
//
// Folder layouts (pairs matched by file stem):
//   DIR/images/*.{png,jpg,jpeg,bmp} + DIR/masks/*            (ours)
//   DIR/img/*                      + DIR/masks_machine/*     (the article's data set)
// optionally restricted to the names listed in a file (one per line; a CSV's first column).
// Masks become targets by a LabelRule (data/labels.h): with one class > 0 is foreground, with
// more a class index per pixel; the ignore index becomes -1 (ignored by losses and metrics).
// Images are resized to the training size bilinearly, masks by nearest neighbour, or kept at
// their own size for random crops; make_batch normalises with the ImageNet mean/std.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "data/labels.h"
#include "data/synthetic.h"
#include "engine/named.h"
#include "engine/random.h"

namespace unetcu {

// One sample: image [C, H, W] in [0, 1], mask [H, W] of targets (class index or 0/1; -1 ignored).
struct Sample {
  int width = 0, height = 0, channels = 3;
  std::vector<float> image, mask;
  void resize(int w, int h, int c = 3) {
    width = w, height = h, channels = c;
    image.resize(size_t(c) * w * h);
    mask.resize(size_t(w) * h);
  }
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  // The channels of every sample's image and how make_batch normalises them: ImageNet's
  // statistics over 3 channels unless set otherwise (--in-channels, --normalize).
  int channels() const { return normalization_.channels(); }
  const Normalization& normalization() const { return normalization_; }
  void set_normalization(Normalization n) { normalization_ = std::move(n); }
  virtual int64_t size() const = 0;
  // The size of every sample, or 0 x 0 when each keeps its own (then make_batch crops).
  virtual int width() const = 0;
  virtual int height() const = 0;
  virtual void load(int64_t index, Sample* out) const = 0;

 private:
  Normalization normalization_;
};

inline constexpr NamedValue<Normalization::Kind> kNormalizationNames[] = {
    {"imagenet", Normalization::ImageNet}, {"dataset", Normalization::Dataset}, {"none", Normalization::None}};
// A normalisation's values as a checkpoint records them, "m0,m1,...;s0,s1,..." (shortest
// round-trip decimal floats), and back; a malformed text is an error naming `what`.
std::string normalization_values(const Normalization& n);
Normalization normalization_from_values(Normalization::Kind kind, const std::string& text, const std::string& what);

// The mean and deviation of each channel over every image of the set (each at the size the set
// gives it, no augmentation), in double: --normalize dataset. A channel without variation keeps
// a deviation of 1.
Normalization dataset_normalization(const Dataset& ds);

enum class Augment { None, Light, Heavy };
inline constexpr NamedValue<Augment> kAugmentNames[] = {
    {"none", Augment::None}, {"light", Augment::Light}, {"heavy", Augment::Heavy}};

// In place on one sample: light = horizontal flip and brightness/contrast; heavy adds a
// vertical flip, a random scale-crop (up to 1.4x) and a small rotation (up to ±15°). Geometry
// moves image (bilinear) and mask (nearest) together.
void augment_sample(float* image, float* mask, int width, int height, Augment level, Rng& rng, int channels = 3);
inline void augment_sample(float* image, float* mask, int size, Augment level, Rng& rng) {
  augment_sample(image, mask, size, size, level, rng);
}

// Normalised batch of the given samples (ds.channels() channels, ds.normalization()); sample i of epoch e is augmented with a generator
// seeded by (seed, e, index), so any run is reproducible. pinned: page-locked (GPU uploads).
// crop > 0: each sample (augmented at its own size) gives one random crop x crop window, the
// same generator choosing where; a side shorter than the crop is padded, the image with 0 (the
// mean colour, after normalisation) and the mask with -1 (ignored). crop = 0: every sample
// must have the dataset's size.
Batch make_batch(const Dataset& ds, const std::vector<int64_t>& indices, DType dtype,
                 bool pinned = false, Augment augment = Augment::None, uint64_t seed = 0,
                 int epoch = 0, int crop = 0);

// Samples [offset, offset + count) of the synthetic set.
class SyntheticDataset : public Dataset {
 public:
  SyntheticDataset(const SyntheticSegmentation& s, int64_t offset, int64_t count)
      : s_(s), offset_(offset), count_(count) {}
  int64_t size() const override { return count_; }
  int width() const override { return s_.width(); }
  int height() const override { return s_.height(); }
  void load(int64_t index, Sample* out) const override;

 private:
  const SyntheticSegmentation& s_;
  int64_t offset_, count_;
};

class FolderDataset : public Dataset {
 public:
  struct Pair {
    std::string stem, image, mask;
  };
  // Scans `dir` (either layout). `list`: optional file of names to keep. A file of either
  // folder that is not a regular image file (a folder or a dangling link named like an image)
  // is an error naming it.
  static std::vector<Pair> scan(const std::string& dir, const std::string& list = "");
  // Samples resized to width x height, or at their own size when both are 0.
  FolderDataset(std::vector<Pair> pairs, int width, int height, LabelRule labels = {});
  FolderDataset(std::vector<Pair> pairs, int image_size) : FolderDataset(std::move(pairs), image_size, image_size) {}
  int64_t size() const override { return int64_t(pairs_.size()); }
  int width() const override { return width_; }
  int height() const override { return height_; }
  void load(int64_t index, Sample* out) const override;
  const std::vector<Pair>& pairs() const { return pairs_; }

 private:
  std::vector<Pair> pairs_;
  int width_, height_;
  LabelRule labels_;
};

struct Image;
struct ImageValues;
// An 8-bit image (any size) to planar floats in [0, 1] at W x H, bilinear; a target map (one
// float per pixel) to W x H, nearest.
void resize_bilinear(const Image& in, int width, int height, float* out);
// The same for samples of any depth (ImageValues: 16-bit, float, any channel count).
void resize_bilinear(const ImageValues& in, int width, int height, float* out);
inline void resize_bilinear(const Image& in, int size, float* out) { resize_bilinear(in, size, size, out); }
void resize_nearest(const float* in, int in_width, int in_height, int width, int height, float* out);
// A mask image to {0, 1} at S x S, nearest (> 0 is foreground).
void resize_nearest_mask(const Image& in, int size, float* out);

// Splits pairs into train and validation: a seeded shuffle, the last `fraction` for validation.
void split_pairs(const std::vector<FolderDataset::Pair>& all, double fraction, uint64_t seed,
                 std::vector<FolderDataset::Pair>* train, std::vector<FolderDataset::Pair>* val);

// Writes samples [0, count) of the synthetic set as DIR/images/NNNNN.png + DIR/masks/NNNNN.png
// (one class: 0/255; more: the class index per pixel, 8-bit gray). The images: RGB (3
// channels), gray (1: the mean of R, G and B; at 8 or 16 bits) or RGB and that gray level as a
// fourth channel (4, an RGBA PNG).
void write_synthetic_folder(const std::string& dir, int count, int width, int height, uint64_t seed,
                            int classes = 1, int channels = 3, int bit_depth = 8);
inline void write_synthetic_folder(const std::string& dir, int count, int image_size, uint64_t seed) {
  write_synthetic_folder(dir, count, image_size, image_size, seed);
}

}  // namespace unetcu
