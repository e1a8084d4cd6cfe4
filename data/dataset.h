// Datasets beyond the synthetic set: a common interface, image folders read through
// stb_image, seeded augmentation applied identically to image and mask, and batching.
//
// Folder layouts (pairs matched by file stem):
//   DIR/images/*.{png,jpg,jpeg,bmp} + DIR/masks/*            (ours)
//   DIR/img/*                      + DIR/masks_machine/*     (the article's data set)
// optionally restricted to the names listed in a file (one per line; a CSV's first column).
// Masks are binarised (> 0); images are resized to the training size bilinearly, masks by
// nearest neighbour; images are normalised with the ImageNet mean/std by make_batch.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "data/synthetic.h"
#include "engine/named.h"
#include "engine/random.h"

namespace unetcu {

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual int image_size() const = 0;
  // image [3, S, S] in [0, 1], mask [S, S] in {0, 1}.
  virtual void load(int64_t index, float* image, float* mask) const = 0;
};

enum class Augment { None, Light, Heavy };
inline constexpr NamedValue<Augment> kAugmentNames[] = {
    {"none", Augment::None}, {"light", Augment::Light}, {"heavy", Augment::Heavy}};

// In place on one sample: light = horizontal flip and brightness/contrast; heavy adds a
// vertical flip, a random scale-crop (up to 1.4x) and a small rotation (up to ±15°). Geometry
// moves image (bilinear) and mask (nearest) together.
void augment_sample(float* image, float* mask, int size, Augment level, Rng& rng);

// Normalised batch of the given samples; sample i of epoch e is augmented with a generator
// seeded by (seed, e, index), so any run is reproducible. pinned: page-locked (GPU uploads).
Batch make_batch(const Dataset& ds, const std::vector<int64_t>& indices, DType dtype,
                 bool pinned = false, Augment augment = Augment::None, uint64_t seed = 0,
                 int epoch = 0);

// Samples [offset, offset + count) of the synthetic set.
class SyntheticDataset : public Dataset {
 public:
  SyntheticDataset(const SyntheticSegmentation& s, int64_t offset, int64_t count)
      : s_(s), offset_(offset), count_(count) {}
  int64_t size() const override { return count_; }
  int image_size() const override { return s_.image_size(); }
  void load(int64_t index, float* image, float* mask) const override;

 private:
  const SyntheticSegmentation& s_;
  int64_t offset_, count_;
};

class FolderDataset : public Dataset {
 public:
  struct Pair {
    std::string stem, image, mask;
  };
  // Scans `dir` (either layout). `list`: optional file of names to keep.
  static std::vector<Pair> scan(const std::string& dir, const std::string& list = "");
  FolderDataset(std::vector<Pair> pairs, int image_size);
  int64_t size() const override { return int64_t(pairs_.size()); }
  int image_size() const override { return size_; }
  void load(int64_t index, float* image, float* mask) const override;
  const std::vector<Pair>& pairs() const { return pairs_; }

 private:
  std::vector<Pair> pairs_;
  int size_;
};

struct Image;
// An 8-bit image (any size) to planar floats in [0, 1] at S x S, bilinear; a mask image to
// {0, 1} at S x S, nearest (> 0 is foreground).
void resize_bilinear(const Image& in, int size, float* out);
void resize_nearest_mask(const Image& in, int size, float* out);

// Splits pairs into train and validation: a seeded shuffle, the last `fraction` for validation.
void split_pairs(const std::vector<FolderDataset::Pair>& all, double fraction, uint64_t seed,
                 std::vector<FolderDataset::Pair>* train, std::vector<FolderDataset::Pair>* val);

// Writes samples [0, count) of the synthetic set as DIR/images/NNNNN.png + DIR/masks/NNNNN.png.
void write_synthetic_folder(const std::string& dir, int count, int image_size, uint64_t seed);

}  // namespace unetcu
