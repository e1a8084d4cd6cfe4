// Image folders and augmentation.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "data/dataset.h"
#include "data/image_io.h"
#include "testing.h"

using namespace unetcu;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) : path(fs::temp_directory_path() / ("unetcu_" + name)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

Image solid(int w, int h, int channels, uint8_t v) {
  return Image{w, h, channels, std::vector<uint8_t>(size_t(w) * h * channels, v)};
}

}  // namespace

TEST_CASE("folder dataset: pairing by stem, both layouts, name lists, resize, normalisation") {
  TempDir d("layouts");
  fs::create_directories(d.path / "a" / "images");
  fs::create_directories(d.path / "a" / "masks");
  // A 48x40 gray image (value 128) with a mask whose left half is set.
  Image mask = solid(48, 40, 1, 0);
  for (int y = 0; y < 40; ++y)
    for (int x = 0; x < 24; ++x) mask.pixels[size_t(y) * 48 + x] = 200;
  save_image((d.path / "a" / "images" / "b.jpg").string(), solid(48, 40, 3, 128));
  save_image((d.path / "a" / "masks" / "b.png").string(), mask);
  save_image((d.path / "a" / "images" / "a.bmp").string(), solid(48, 40, 3, 10));
  save_image((d.path / "a" / "masks" / "a.png").string(), solid(48, 40, 1, 0));
  const auto pairs = FolderDataset::scan((d.path / "a").string());
  REQUIRE(pairs.size() == 2);
  CHECK(pairs[0].stem == "a");  // sorted by stem, each with its own mask
  CHECK(fs::path(pairs[1].mask).filename() == "b.png");
  FolderDataset ds(pairs, 32);
  const Batch b = make_batch(ds, {1}, DType::F32);
  REQUIRE(b.images.shape() == Shape{1, 3, 32, 32});
  for (int c = 0; c < 3; ++c)  // JPEG keeps a flat gray within a level or two
    CHECK(b.images.at(c * 32 * 32 + 5 * 32 + 7) ==
          doctest::Approx((128 / 255.0 - kImageMean[c]) / kImageStd[c]).epsilon(0.02));
  for (int x = 0; x < 32; ++x) CHECK(b.masks.at(10 * 32 + x) == (x < 16 ? 1.0 : 0.0));  // nearest, binarised
  // The article's layout, restricted by a CSV list.
  fs::create_directories(d.path / "art" / "img");
  fs::create_directories(d.path / "art" / "masks_machine");
  for (const char* n : {"p1", "p2", "p3"}) {
    save_image((d.path / "art" / "img" / (std::string(n) + ".png")).string(), solid(32, 32, 3, 50));
    save_image((d.path / "art" / "masks_machine" / (std::string(n) + ".png")).string(), solid(32, 32, 1, 1));
  }
  std::ofstream((d.path / "list.csv").string()) << "p3.png,x\np1,y\n";
  const auto listed = FolderDataset::scan((d.path / "art").string(), (d.path / "list.csv").string());
  REQUIRE(listed.size() == 2);
  CHECK(listed[0].stem == "p1");
  CHECK(listed[1].stem == "p3");
  std::vector<FolderDataset::Pair> tr, va;
  split_pairs(FolderDataset::scan((d.path / "art").string()), 0.34, 1, &tr, &va);
  CHECK(tr.size() == 2);
  CHECK(va.size() == 1);
}

TEST_CASE("folder dataset: each bad input gives one clear error naming the file") {
  TempDir d("bad");
  fs::create_directories(d.path / "images");
  fs::create_directories(d.path / "masks");
  CHECK_THROWS_WITH(FolderDataset::scan(d.path.string()), doctest::Contains("holds no images"));
  save_image((d.path / "images" / "x.png").string(), solid(32, 32, 3, 1));
  CHECK_THROWS_WITH(FolderDataset::scan(d.path.string()), doctest::Contains("x.png' has no mask"));
  save_image((d.path / "masks" / "x.png").string(), solid(16, 32, 1, 1));
  FolderDataset ds(FolderDataset::scan(d.path.string()), 32);
  CHECK_THROWS_WITH(make_batch(ds, {0}, DType::F32), doctest::Contains("is 16x32 but its image"));
  std::ofstream((d.path / "images" / "y.png").string()) << "not a png at all";
  save_image((d.path / "masks" / "y.png").string(), solid(32, 32, 1, 1));
  FolderDataset ds2(FolderDataset::scan(d.path.string()), 32);
  CHECK_THROWS_WITH(make_batch(ds2, {1}, DType::F32), doctest::Contains("cannot read image"));
  CHECK_THROWS_WITH(FolderDataset::scan((d.path / "nope").string()), doctest::Contains("is not a folder"));
  CHECK_THROWS_WITH(FolderDataset::scan((d.path / "images").string()), doctest::Contains("has neither"));
}

TEST_CASE("augmentation keeps image and mask aligned (a marked spot moves with its mask)") {
  const int S = 64;
  const size_t plane = size_t(S) * S;
  for (Augment level : {Augment::Light, Augment::Heavy})
    for (uint64_t seed = 0; seed < 20; ++seed) {
      CAPTURE(seed);
      std::vector<float> img(3 * plane, 0.f), msk(plane, 0.f);
      const int mx = 20 + int(seed % 7) * 3, my = 25 + int(seed % 5) * 3;  // a 5x5 marked spot
      for (int y = my - 2; y <= my + 2; ++y)
        for (int x = mx - 2; x <= mx + 2; ++x) {
          img[size_t(y) * S + x] = 1.f;  // channel 0 only
          msk[size_t(y) * S + x] = 1.f;
        }
      Rng rng(seed);
      augment_sample(img.data(), msk.data(), S, level, rng);
      // Centroids of the mask and of the bright part of channel 0 (minus channel 1, which has
      // the same brightness/contrast change but no spot).
      double mxs = 0, mys = 0, mn = 0, ixs = 0, iys = 0, in = 0;
      for (int y = 0; y < S; ++y)
        for (int x = 0; x < S; ++x) {
          const size_t o = size_t(y) * S + x;
          if (msk[o] > 0.5f) mxs += x, mys += y, ++mn;
          const float spot = img[o] - img[plane + o];
          if (spot > 0.3f) ixs += x, iys += y, ++in;
        }
      REQUIRE(mn > 0);
      REQUIRE(in > 0);
      CHECK(std::fabs(mxs / mn - ixs / in) < 1.0);
      CHECK(std::fabs(mys / mn - iys / in) < 1.0);
    }
  // Reproducible: the same seed gives the same sample.
  std::vector<float> a(3 * plane, 0.3f), am(plane, 1.f), b(a), bm(am);
  Rng r1(9), r2(9);
  augment_sample(a.data(), am.data(), S, Augment::Heavy, r1);
  augment_sample(b.data(), bm.data(), S, Augment::Heavy, r2);
  CHECK(a == b);
  CHECK(am == bm);
}
