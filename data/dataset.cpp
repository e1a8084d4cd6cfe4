#include "data/dataset.h"

#include "runtime/allocator.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "data/image_io.h"
#include "kernels/cpu/parallel.h"

namespace unetcu {

namespace fs = std::filesystem;

void SyntheticDataset::load(int64_t index, Sample* out) const {
  UNETCU_CHECK(index >= 0 && index < count_, "sample ", index, " out of range");
  out->resize(s_.width(), s_.height());
  s_.sample(offset_ + index, out->image.data(), out->mask.data());
  const int C = channels();
  if (C == 3) return;
  // Another channel count: the RGB rendering's channels, then its gray level (their mean).
  const size_t plane = size_t(out->width) * out->height;
  std::vector<float> rgb = std::move(out->image);
  out->resize(out->width, out->height, C);
  for (int c = 0; c < C; ++c)
    for (size_t q = 0; q < plane; ++q)
      out->image[c * plane + q] = C > 3 && c < 3 ? rgb[c * plane + q]
                                                 : (rgb[q] + rgb[plane + q] + rgb[2 * plane + q]) / 3.f;
}

std::string normalization_values(const Normalization& n) {
  std::string out;
  for (const std::vector<float>* v : {&n.mean, &n.std}) {
    if (v == &n.std) out += ";";
    for (size_t c = 0; c < v->size(); ++c) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.9g", double((*v)[c]));
      out += (c ? "," : "") + std::string(buf);
    }
  }
  return out;
}

Normalization normalization_from_values(Normalization::Kind kind, const std::string& text, const std::string& what) {
  Normalization n;
  n.kind = kind;
  n.mean.clear(), n.std.clear();
  const size_t semi = text.find(';');
  UNETCU_CHECK(semi != std::string::npos, what, " records normalization values '", text, "', not 'means;deviations'");
  for (int part = 0; part < 2; ++part) {
    std::stringstream ss(part == 0 ? text.substr(0, semi) : text.substr(semi + 1));
    for (std::string item; std::getline(ss, item, ',');) {
      char* end = nullptr;
      const float v = std::strtof(item.c_str(), &end);
      UNETCU_CHECK(!item.empty() && end && *end == '\0' && std::isfinite(v) && (part == 0 || v > 0), what,
                   " records normalization values '", text, "': '", item, "' is not a ",
                   part == 0 ? "number" : "positive number");
      (part == 0 ? n.mean : n.std).push_back(v);
    }
  }
  UNETCU_CHECK(!n.mean.empty() && n.mean.size() == n.std.size() && n.mean.size() <= 64, what,
               " records normalization values '", text, "' of unequal or impossible lengths");
  return n;
}

Normalization dataset_normalization(const Dataset& ds) {
  const int C = ds.channels();
  std::vector<double> sum(size_t(C), 0.0), sumsq(size_t(C), 0.0);
  double count = 0;
  Sample s;
  for (int64_t i = 0; i < ds.size(); ++i) {
    ds.load(i, &s);
    const size_t plane = size_t(s.width) * s.height;
    for (int c = 0; c < C; ++c)
      for (size_t q = 0; q < plane; ++q) {
        const double v = s.image[c * plane + q];
        sum[size_t(c)] += v;
        sumsq[size_t(c)] += v * v;
      }
    count += double(plane);
  }
  Normalization n = Normalization::none(C);
  n.kind = Normalization::Dataset;
  for (int c = 0; c < C; ++c) {
    const double mean = sum[size_t(c)] / count, var = std::max(0.0, sumsq[size_t(c)] / count - mean * mean);
    n.mean[size_t(c)] = float(mean);
    n.std[size_t(c)] = var > 1e-12 ? float(std::sqrt(var)) : 1.f;
  }
  return n;
}

// ---- folders ---------------------------------------------------------------------------

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
  // An entry named like an image must be one: a folder or a dangling link is named, not skipped.
  auto image_entry = [](const fs::directory_entry& e) {
    if (!is_image_path(e.path().string())) return false;
    std::error_code ec;
    if (!e.is_regular_file(ec)) check_regular_file(e.path().string(), "data file");
    return true;
  };
  std::map<std::string, std::string> mask_of;
  for (const auto& e : fs::directory_iterator(masks))
    if (image_entry(e)) mask_of[e.path().stem().string()] = e.path().string();
  std::vector<Pair> out;
  for (const auto& e : fs::directory_iterator(images)) {
    if (!image_entry(e)) continue;
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

FolderDataset::FolderDataset(std::vector<Pair> pairs, int width, int height, LabelRule labels)
    : pairs_(std::move(pairs)), width_(width), height_(height), labels_(std::move(labels)) {
  UNETCU_CHECK((width == 0 && height == 0) || (width > 0 && width % 32 == 0 && height > 0 && height % 32 == 0),
               "image size must be a positive multiple of 32, got ", width, "x", height);
}

// Bilinear (channels of interleaved samples -> planar floats in [0, 1]).
void resize_bilinear(const ImageValues& in, int W, int H, float* out) {
  const size_t plane = size_t(W) * H;
  for (int y = 0; y < H; ++y) {
    const float fy = std::max(0.f, (y + 0.5f) * in.height / H - 0.5f);
    const int y0 = std::min(int(fy), in.height - 1), y1 = std::min(y0 + 1, in.height - 1);
    const float wy = fy - y0;
    for (int x = 0; x < W; ++x) {
      const float fx = std::max(0.f, (x + 0.5f) * in.width / W - 0.5f);
      const int x0 = std::min(int(fx), in.width - 1), x1 = std::min(x0 + 1, in.width - 1);
      const float wx = fx - x0;
      for (int c = 0; c < in.channels; ++c) {
        auto px = [&](int yy, int xx) { return in.values[(size_t(yy) * in.width + xx) * in.channels + c]; };
        const float v = (1 - wy) * ((1 - wx) * px(y0, x0) + wx * px(y0, x1)) + wy * ((1 - wx) * px(y1, x0) + wx * px(y1, x1));
        out[c * plane + size_t(y) * W + x] = v / in.divisor;
      }
    }
  }
}

void resize_bilinear(const Image& in, int W, int H, float* out) {
  ImageValues v;
  v.width = in.width, v.height = in.height, v.channels = in.channels;
  v.values.assign(in.pixels.begin(), in.pixels.end());
  resize_bilinear(v, W, H, out);
}

void resize_nearest(const float* in, int iw, int ih, int W, int H, float* out) {
  for (int y = 0; y < H; ++y) {
    const int sy = std::min(ih - 1, int((y + 0.5) * ih / H));
    for (int x = 0; x < W; ++x) {
      const int sx = std::min(iw - 1, int((x + 0.5) * iw / W));
      out[size_t(y) * W + x] = in[size_t(sy) * iw + sx];
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

void FolderDataset::load(int64_t index, Sample* out) const {
  const Pair& p = pairs_.at(size_t(index));
  // Sizes from the headers first: a mismatch is reported as such, before decoding either.
  const ImageInfo img_info = read_image_info(p.image), msk_info = read_image_info(p.mask);
  UNETCU_CHECK(img_info.width == msk_info.width && img_info.height == msk_info.height, "mask '", p.mask,
               "' is ", msk_info.width, "x", msk_info.height, " but its image '", p.image, "' is ",
               img_info.width, "x", img_info.height);
  const int C = channels();
  const ImageValues img = load_image_values(p.image, C);
  int mw = 0, mh = 0;
  const std::vector<float> targets = load_mask_targets(p.mask, labels_, &mw, &mh);
  if (width_ == 0) {  // at its own size
    out->resize(img.width, img.height, C);
    const size_t plane = size_t(img.width) * img.height;
    for (size_t q = 0; q < plane; ++q)
      for (int c = 0; c < C; ++c) out->image[c * plane + q] = img.values[q * C + size_t(c)] / img.divisor;
    out->mask = targets;
    return;
  }
  out->resize(width_, height_, C);
  resize_bilinear(img, width_, height_, out->image.data());
  resize_nearest(targets.data(), mw, mh, width_, height_, out->mask.data());
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

void augment_sample(float* image, float* mask, int W, int H, Augment level, Rng& rng, int C) {
  if (level == Augment::None) return;
  const size_t plane = size_t(W) * H;
  // Geometry: one inverse map (output pixel -> source point) for image and mask alike.
  const bool hflip = rng.uniform() < 0.5, vflip = level == Augment::Heavy && rng.uniform() < 0.5;
  double scale = 1, angle = 0, cx = W / 2.0, cy = H / 2.0;
  if (level == Augment::Heavy) {
    scale = rng.uniform(1.0, 1.4);
    angle = rng.uniform(-15.0, 15.0) * 3.141592653589793 / 180.0;
    // crop centre range keeping the view inside
    const double slack_x = W / 2.0 * (1 - 1 / scale), slack_y = H / 2.0 * (1 - 1 / scale);
    cx += rng.uniform(-slack_x, slack_x);
    cy += rng.uniform(-slack_y, slack_y);
  }
  const double ca = std::cos(angle), sa = std::sin(angle);
  std::vector<float> img(image, image + C * plane), msk(mask, mask + plane);
  for (int y = 0; y < H; ++y)
    for (int x = 0; x < W; ++x) {
      double u = x + 0.5 - W / 2.0, v = y + 0.5 - H / 2.0;
      if (hflip) u = -u;
      if (vflip) v = -v;
      const double sx = (ca * u - sa * v) / scale + cx - 0.5, sy = (sa * u + ca * v) / scale + cy - 0.5;
      const size_t o = size_t(y) * W + x;
      // Mask: nearest. Outside the source both image and mask repeat their border, so a
      // rotated corner shows the same content in both.
      const int nx = std::clamp(int(std::floor(sx + 0.5)), 0, W - 1);
      const int ny = std::clamp(int(std::floor(sy + 0.5)), 0, H - 1);
      mask[o] = msk[size_t(ny) * W + nx];
      // Image: bilinear, clamped at the border.
      const double fx = std::clamp(sx, 0.0, W - 1.0), fy = std::clamp(sy, 0.0, H - 1.0);
      const int x0 = int(fx), y0 = int(fy), x1 = std::min(x0 + 1, W - 1), y1 = std::min(y0 + 1, H - 1);
      const float wx = float(fx - x0), wy = float(fy - y0);
      for (int c = 0; c < C; ++c) {
        const float* p = img.data() + c * plane;
        image[c * plane + o] = (1 - wy) * ((1 - wx) * p[y0 * W + x0] + wx * p[y0 * W + x1]) +
                               wy * ((1 - wx) * p[y1 * W + x0] + wx * p[y1 * W + x1]);
      }
    }
  // Photometric, image only.
  const float contrast = float(rng.uniform(0.8, 1.2)), brightness = float(rng.uniform(-0.1, 0.1));
  for (size_t i = 0; i < C * plane; ++i)
    image[i] = std::clamp((image[i] - 0.5f) * contrast + 0.5f + brightness, 0.f, 1.f);
}

namespace {
// The crop x crop window of a sample at (x0, y0) (negative or past the edge: padding), the
// image normalised into row b of the batch, padding 0; the mask's padding -1 (ignored).
void store_crop(const Sample& s, int x0, int y0, int crop, Batch& out, int64_t b, const Normalization& norm) {
  const size_t plane = size_t(crop) * crop, src_plane = size_t(s.width) * s.height;
  const int C = norm.channels();
  UNETCU_DISPATCH_FLOAT(out.images.dtype(), T, {
    T* ip = out.images.data<T>() + b * C * plane;
    T* mp = out.masks.data<T>() + b * plane;
    for (int y = 0; y < crop; ++y)
      for (int x = 0; x < crop; ++x) {
        const int sx = x0 + x, sy = y0 + y;
        const bool inside = sx >= 0 && sx < s.width && sy >= 0 && sy < s.height;
        const size_t o = size_t(y) * crop + x, q = inside ? size_t(sy) * s.width + sx : 0;
        for (int c = 0; c < C; ++c)
          ip[c * plane + o] =
              T(inside ? (s.image[c * src_plane + q] - norm.mean[size_t(c)]) / norm.std[size_t(c)] : 0.f);
        mp[o] = T(inside ? s.mask[q] : -1.f);
      }
  });
}
// Where a crop starts along a side of `len`: anywhere it fits, or a random offset of the
// side inside a longer crop.
int crop_start(int len, int crop, Rng& rng) {
  return len >= crop ? int(rng.below(uint64_t(len - crop + 1))) : -int(rng.below(uint64_t(crop - len + 1)));
}
}  // namespace

Batch make_batch(const Dataset& ds, const std::vector<int64_t>& indices, DType dtype, bool pinned,
                 Augment augment, uint64_t seed, int epoch, int crop) {
  const int64_t B = int64_t(indices.size()), H = crop ? crop : ds.height(), W = crop ? crop : ds.width();
  UNETCU_CHECK(B > 0, "empty batch");
  UNETCU_CHECK(H > 0 && W > 0, "make_batch: samples of their own sizes need a crop size");
  const HostDataScope host_data;  // a loader's batch: host memory, no device's
  const int64_t C = ds.channels();
  Batch out = pinned ? Batch{Tensor::empty_pinned({B, C, H, W}, dtype), Tensor::empty_pinned({B, 1, H, W}, dtype)}
                     : Batch{Tensor::empty({B, C, H, W}, dtype), Tensor::empty({B, 1, H, W}, dtype)};
  std::vector<std::exception_ptr> errors(static_cast<size_t>(B));
  kernels::cpu::parallel_for(B, [&](int64_t b) {
    try {
      Sample s;
      ds.load(indices[b], &s);
      Rng rng(Rng::mix(Rng::mix(seed, uint64_t(epoch)), uint64_t(indices[b])));
      if (augment != Augment::None)
        augment_sample(s.image.data(), s.mask.data(), s.width, s.height, augment, rng, s.channels);
      if (crop) {
        const int x0 = crop_start(s.width, crop, rng), y0 = crop_start(s.height, crop, rng);
        store_crop(s, x0, y0, crop, out, b, ds.normalization());
      } else {
        UNETCU_CHECK(s.width == W && s.height == H, "sample ", indices[b], " is ", s.width, "x", s.height,
                     ", not the batch's ", W, "x", H);
        store_normalized(s.image.data(), s.mask.data(), out, b, ds.normalization());
      }
    } catch (...) {
      errors[size_t(b)] = std::current_exception();  // no throwing out of an OpenMP region
    }
  }, 1);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

void write_synthetic_folder(const std::string& dir, int count, int width, int height, uint64_t seed,
                            int classes, int channels, int bit_depth) {
  UNETCU_CHECK(channels == 1 || channels == 3 || channels == 4, "the synthetic set's images have 1, 3 or 4 channels, not ",
               channels);
  UNETCU_CHECK(bit_depth == 8 || (bit_depth == 16 && channels == 1), "16-bit images are written gray (1 channel)");
  const fs::path root(dir);
  fs::create_directories(root / "images");
  fs::create_directories(root / "masks");
  SyntheticSegmentation s(width, height, seed, classes);
  const size_t plane = size_t(width) * height;
  std::vector<float> img(3 * plane), msk(plane);
  for (int i = 0; i < count; ++i) {
    s.render(i, img.data(), msk.data());
    Image im{width, height, 3, std::vector<uint8_t>(3 * plane)};
    Image mk{width, height, 1, std::vector<uint8_t>(plane)};
    for (size_t q = 0; q < plane; ++q) {
      for (int c = 0; c < 3; ++c) im.pixels[q * 3 + c] = uint8_t(std::lround(std::clamp(img[c * plane + q], 0.f, 1.f) * 255));
      mk.pixels[q] = classes == 1 ? (msk[q] > 0.5f ? 255 : 0) : uint8_t(msk[q]);
    }
    char name[32];
    std::snprintf(name, sizeof name, "%05d.png", i);
    if (channels == 3) {
      save_png((root / "images" / name).string(), im);
    } else if (bit_depth == 16) {  // the gray level (the mean of R, G, B) at 16 bits
      std::vector<uint16_t> gray(plane);
      for (size_t q = 0; q < plane; ++q)
        gray[q] = uint16_t(std::lround(std::clamp((img[q] + img[plane + q] + img[2 * plane + q]) / 3.f, 0.f, 1.f) * 65535));
      save_png16((root / "images" / name).string(), width, height, gray);
    } else {  // gray, or RGB and the gray level as a fourth channel
      Image other{width, height, channels, std::vector<uint8_t>(size_t(channels) * plane)};
      for (size_t q = 0; q < plane; ++q) {
        const uint8_t g = uint8_t((int(im.pixels[q * 3]) + im.pixels[q * 3 + 1] + im.pixels[q * 3 + 2]) / 3);
        for (int c = 0; c < channels; ++c) other.pixels[q * size_t(channels) + size_t(c)] = c < 3 && channels == 4 ? im.pixels[q * 3 + size_t(c)] : g;
      }
      save_png((root / "images" / name).string(), other);
    }
    save_png((root / "masks" / name).string(), mk);
  }
}

}  // namespace unetcu
