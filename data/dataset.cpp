#include "data/dataset.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "data/image_io.h"
#include "kernels/cpu/parallel.h"

namespace unetcu {

namespace fs = std::filesystem;

void SyntheticDataset::load(int64_t index, float* image, float* mask) const {
  UNETCU_CHECK(index >= 0 && index < count_, "sample ", index, " out of range");
  s_.sample(offset_ + index, image, mask);
}

// ---- folders ---------------------------------------------------------------------------

static bool is_image_file(const fs::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(), ::tolower);
  return e == ".png" || e == ".jpg" || e == ".jpeg" || e == ".bmp";
}

std::vector<FolderDataset::Pair> FolderDataset::scan(const std::string& dir, const std::string& list) {
  fs::path root(dir), images, masks;
  UNETCU_CHECK(fs::is_directory(root), "image folder '", dir, "' is not a folder");
  if (fs::is_directory(root / "images") && fs::is_directory(root / "masks")) {
    images = root / "images", masks = root / "masks";
  } else if (fs::is_directory(root / "img") && fs::is_directory(root / "masks_machine")) {
    images = root / "img", masks = root / "masks_machine";
  } else {
    throw Error("image folder '" + dir + "' has neither images/ + masks/ nor img/ + masks_machine/");
  }
  std::set<std::string> keep;
  if (!list.empty()) {
    check_regular_file(list, "the name list");  // a folder would read as empty, a FIFO block
    std::ifstream f(list);
    UNETCU_CHECK(f, "cannot read the name list '", list, "'");
    for (std::string line; std::getline(f, line);) {
      std::string name = line.substr(0, line.find(','));
      while (!name.empty() && (name.back() == '\r' || name.back() == ' ')) name.pop_back();
      if (!name.empty()) keep.insert(fs::path(name).stem().string());
    }
  }
  std::map<std::string, std::string> mask_of;
  for (const auto& e : fs::directory_iterator(masks))
    if (e.is_regular_file() && is_image_file(e.path())) mask_of[e.path().stem().string()] = e.path().string();
  std::vector<Pair> out;
  for (const auto& e : fs::directory_iterator(images)) {
    if (!e.is_regular_file() || !is_image_file(e.path())) continue;
    const std::string stem = e.path().stem().string();
    if (!keep.empty() && !keep.count(stem)) continue;
    auto it = mask_of.find(stem);
    UNETCU_CHECK(it != mask_of.end(), "image '", e.path().string(), "' has no mask in ", masks.string());
    out.push_back({stem, e.path().string(), it->second});
  }
  UNETCU_CHECK(!out.empty(), "image folder '", dir, "' holds no images", keep.empty() ? "" : " from the name list");
  std::sort(out.begin(), out.end(), [](const Pair& a, const Pair& b) { return a.stem < b.stem; });
  return out;
}

FolderDataset::FolderDataset(std::vector<Pair> pairs, int image_size)
    : pairs_(std::move(pairs)), size_(image_size) {
  UNETCU_CHECK(image_size > 0 && image_size % 32 == 0, "image size must be a positive multiple of 32");
}

// Bilinear (channels of an interleaved 8-bit image -> planar floats in [0, 1]).
void resize_bilinear(const Image& in, int S, float* out) {
  const size_t plane = size_t(S) * S;
  for (int y = 0; y < S; ++y) {
    const float fy = std::max(0.f, (y + 0.5f) * in.height / S - 0.5f);
    const int y0 = std::min(int(fy), in.height - 1), y1 = std::min(y0 + 1, in.height - 1);
    const float wy = fy - y0;
    for (int x = 0; x < S; ++x) {
      const float fx = std::max(0.f, (x + 0.5f) * in.width / S - 0.5f);
      const int x0 = std::min(int(fx), in.width - 1), x1 = std::min(x0 + 1, in.width - 1);
      const float wx = fx - x0;
      for (int c = 0; c < in.channels; ++c) {
        auto px = [&](int yy, int xx) { return float(in.pixels[(size_t(yy) * in.width + xx) * in.channels + c]); };
        const float v = (1 - wy) * ((1 - wx) * px(y0, x0) + wx * px(y0, x1)) + wy * ((1 - wx) * px(y1, x0) + wx * px(y1, x1));
        out[c * plane + size_t(y) * S + x] = v / 255.f;
      }
    }
  }
}

void resize_nearest_mask(const Image& in, int S, float* out) {  // > 0 is foreground
  for (int y = 0; y < S; ++y) {
    const int sy = std::min(in.height - 1, int((y + 0.5) * in.height / S));
    for (int x = 0; x < S; ++x) {
      const int sx = std::min(in.width - 1, int((x + 0.5) * in.width / S));
      out[size_t(y) * S + x] = in.pixels[size_t(sy) * in.width + sx] > 0 ? 1.f : 0.f;
    }
  }
}

void FolderDataset::load(int64_t index, float* image, float* mask) const {
  const Pair& p = pairs_.at(size_t(index));
  // Sizes from the headers first: a mismatch is reported as such, before decoding either.
  const ImageInfo img_info = read_image_info(p.image), msk_info = read_image_info(p.mask);
  UNETCU_CHECK(img_info.width == msk_info.width && img_info.height == msk_info.height, "mask '", p.mask,
               "' is ", msk_info.width, "x", msk_info.height, " but its image '", p.image, "' is ",
               img_info.width, "x", img_info.height);
  const Image img = load_image(p.image, 3);
  const Image msk = load_image(p.mask, 1);
  resize_bilinear(img, size_, image);
  resize_nearest_mask(msk, size_, mask);
}

void split_pairs(const std::vector<FolderDataset::Pair>& all, double fraction, uint64_t seed,
                 std::vector<FolderDataset::Pair>* train, std::vector<FolderDataset::Pair>* val) {
  UNETCU_CHECK(fraction > 0 && fraction < 1, "the validation fraction must be between 0 and 1, got ", fraction);
  const auto perm = epoch_permutation(int64_t(all.size()), seed, -1);
  const int64_t n_val = std::max<int64_t>(1, int64_t(std::lround(fraction * all.size())));
  UNETCU_CHECK(n_val < int64_t(all.size()), "a validation fraction of ", fraction, " leaves no training images");
  train->clear(), val->clear();
  for (size_t i = 0; i < perm.size(); ++i)
    (int64_t(i) >= int64_t(perm.size()) - n_val ? val : train)->push_back(all[size_t(perm[i])]);
}

// ---- augmentation -----------------------------------------------------------------------

void augment_sample(float* image, float* mask, int S, Augment level, Rng& rng) {
  if (level == Augment::None) return;
  const size_t plane = size_t(S) * S;
  // Geometry: one inverse map (output pixel -> source point) for image and mask alike.
  const bool hflip = rng.uniform() < 0.5, vflip = level == Augment::Heavy && rng.uniform() < 0.5;
  double scale = 1, angle = 0, cx = S / 2.0, cy = S / 2.0;
  if (level == Augment::Heavy) {
    scale = rng.uniform(1.0, 1.4);
    angle = rng.uniform(-15.0, 15.0) * 3.141592653589793 / 180.0;
    const double slack = S / 2.0 * (1 - 1 / scale);  // crop centre range keeping the view inside
    cx += rng.uniform(-slack, slack);
    cy += rng.uniform(-slack, slack);
  }
  const double ca = std::cos(angle), sa = std::sin(angle);
  std::vector<float> img(image, image + 3 * plane), msk(mask, mask + plane);
  for (int y = 0; y < S; ++y)
    for (int x = 0; x < S; ++x) {
      double u = x + 0.5 - S / 2.0, v = y + 0.5 - S / 2.0;
      if (hflip) u = -u;
      if (vflip) v = -v;
      const double sx = (ca * u - sa * v) / scale + cx - 0.5, sy = (sa * u + ca * v) / scale + cy - 0.5;
      const size_t o = size_t(y) * S + x;
      // Mask: nearest. Outside the source both image and mask repeat their border, so a
      // rotated corner shows the same content in both.
      const int nx = std::clamp(int(std::floor(sx + 0.5)), 0, S - 1);
      const int ny = std::clamp(int(std::floor(sy + 0.5)), 0, S - 1);
      mask[o] = msk[size_t(ny) * S + nx];
      // Image: bilinear, clamped at the border.
      const double fx = std::clamp(sx, 0.0, S - 1.0), fy = std::clamp(sy, 0.0, S - 1.0);
      const int x0 = int(fx), y0 = int(fy), x1 = std::min(x0 + 1, S - 1), y1 = std::min(y0 + 1, S - 1);
      const float wx = float(fx - x0), wy = float(fy - y0);
      for (int c = 0; c < 3; ++c) {
        const float* p = img.data() + c * plane;
        image[c * plane + o] = (1 - wy) * ((1 - wx) * p[y0 * S + x0] + wx * p[y0 * S + x1]) +
                               wy * ((1 - wx) * p[y1 * S + x0] + wx * p[y1 * S + x1]);
      }
    }
  // Photometric, image only.
  const float contrast = float(rng.uniform(0.8, 1.2)), brightness = float(rng.uniform(-0.1, 0.1));
  for (size_t i = 0; i < 3 * plane; ++i)
    image[i] = std::clamp((image[i] - 0.5f) * contrast + 0.5f + brightness, 0.f, 1.f);
}

Batch make_batch(const Dataset& ds, const std::vector<int64_t>& indices, DType dtype, bool pinned,
                 Augment augment, uint64_t seed, int epoch) {
  const int64_t B = int64_t(indices.size()), S = ds.image_size();
  UNETCU_CHECK(B > 0, "empty batch");
  Batch out = pinned ? Batch{Tensor::empty_pinned({B, 3, S, S}, dtype), Tensor::empty_pinned({B, 1, S, S}, dtype)}
                     : Batch{Tensor::empty({B, 3, S, S}, dtype), Tensor::empty({B, 1, S, S}, dtype)};
  const size_t plane = size_t(S) * S;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(B));
  kernels::cpu::parallel_for(B, [&](int64_t b) {
    try {
      std::vector<float> img(3 * plane), msk(plane);
      ds.load(indices[b], img.data(), msk.data());
      if (augment != Augment::None) {
        Rng rng(Rng::mix(Rng::mix(seed, uint64_t(epoch)), uint64_t(indices[b])));
        augment_sample(img.data(), msk.data(), int(S), augment, rng);
      }
      store_normalized(img.data(), msk.data(), out, b);
    } catch (...) {
      errors[size_t(b)] = std::current_exception();  // no throwing out of an OpenMP region
    }
  }, 1);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

void write_synthetic_folder(const std::string& dir, int count, int image_size, uint64_t seed) {
  const fs::path root(dir);
  fs::create_directories(root / "images");
  fs::create_directories(root / "masks");
  SyntheticSegmentation s(image_size, seed);
  const size_t plane = size_t(image_size) * image_size;
  std::vector<float> img(3 * plane), msk(plane);
  for (int i = 0; i < count; ++i) {
    s.render(i, img.data(), msk.data());
    Image im{image_size, image_size, 3, std::vector<uint8_t>(3 * plane)};
    Image mk{image_size, image_size, 1, std::vector<uint8_t>(plane)};
    for (size_t q = 0; q < plane; ++q) {
      for (int c = 0; c < 3; ++c) im.pixels[q * 3 + c] = uint8_t(std::lround(std::clamp(img[c * plane + q], 0.f, 1.f) * 255));
      mk.pixels[q] = msk[q] > 0.5f ? 255 : 0;
    }
    char name[32];
    std::snprintf(name, sizeof name, "%05d.png", i);
    save_png((root / "images" / name).string(), im);
    save_png((root / "masks" / name).string(), mk);
  }
}

}  // namespace unetcu
