// Images of any depth and channel count (--in-channels, data/image_io.h load_image_values):
// 16-bit PNGs scaled from 65535 (not cut to their high byte), gray, RGB and RGBA PNGs at their
// own channel count, NumPy .npy arrays (uint8, uint16, float32; H x W and H x W x N), and the
// refusals: another channel count, Fortran order, an element type not read, a short file. Then
// the dataset's per-channel normalisation (--normalize dataset) and its checkpoint text.
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/image_io.h"
#include "scratch_dir.h"
#include "testing.h"

using namespace unetcu;

namespace {

// A .npy file (version 1) of `descr` and shape, holding `bytes`.
void write_npy(const std::string& path, const std::string& descr, const std::string& shape, const std::string& bytes,
               bool fortran = false) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
                       ", 'shape': " + shape + ", }";
  while ((10 + header.size() + 1) % 64) header += ' ';
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  f << "\x93NUMPY" << char(1) << char(0) << char(header.size() & 255) << char(header.size() >> 8) << header << bytes;
}

template <class T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

}  // namespace

TEST_CASE("images at their own depth: 16-bit PNGs from 65535, gray, RGB and RGBA at their channel count") {
  testing::ScratchDir dir;
  // 16 bits: 0x1234 is 4660 / 65535, where its high byte would give 18 / 255 (a 0.5 % error).
  save_png16("wide.png", 2, 1, {0x1234, 65535});
  const ImageValues w = load_image_values("wide.png", 1);
  REQUIRE(w.channels == 1);
  CHECK(w.divisor == 65535.f);
  CHECK(w.values[0] / w.divisor == doctest::Approx(4660.0 / 65535).epsilon(1e-7));
  CHECK(w.values[1] / w.divisor == 1.f);
  // The same 16-bit PNG as RGB (3 channels: a gray image is expanded, as before).
  const ImageValues w3 = load_image_values("wide.png", 3);
  CHECK(w3.channels == 3);
  CHECK(w3.values[2] == w.values[0]);
  // RGBA: 4 channels kept; as 3 the alpha is dropped; as 1 refused naming the file.
  save_png("rgba.png", Image{1, 1, 4, {10, 20, 30, 40}});
  CHECK(load_image_values("rgba.png", 4).values == std::vector<float>{10, 20, 30, 40});
  CHECK(load_image_values("rgba.png", 3).values == std::vector<float>{10, 20, 30});
  const std::string four = "image 'rgba.png' has 4 channels, not the 1 of " + setting("in_channels") +
                           " (images are never converted to another count)";
  CHECK_THROWS_WITH(load_image_values("rgba.png", 1), four.c_str());
  save_png("gray.png", Image{1, 1, 1, {77}});
  CHECK(load_image_values("gray.png", 1).values == std::vector<float>{77});
  CHECK_THROWS_WITH(load_image_values("gray.png", 4), doctest::Contains("has 1 channel, not the 4"));
}

TEST_CASE(".npy arrays: uint8, uint16 and float32, H x W x N and H x W, and their refusals") {
  testing::ScratchDir dir;
  write_npy("u8.npy", "|u1", "(1, 2, 5)", bytes_of(std::vector<uint8_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 255}));
  const ImageValues a = load_image_values("u8.npy", 5);
  CHECK(a.width == 2);
  CHECK(a.height == 1);
  CHECK(a.divisor == 255.f);
  CHECK(a.values[9] == 255.f);
  CHECK(read_image_info("u8.npy").channels == 5);
  write_npy("u16.npy", "<u2", "(2, 1)", bytes_of(std::vector<uint16_t>{65535, 1000}));
  const ImageValues b = load_image_values("u16.npy", 1);
  CHECK(b.divisor == 65535.f);
  CHECK(b.values == std::vector<float>{65535, 1000});
  write_npy("f32.npy", "<f4", "(1, 1, 2)", bytes_of(std::vector<float>{0.25f, -1.5f}));
  const ImageValues c = load_image_values("f32.npy", 2);
  CHECK(c.divisor == 1.f);
  CHECK(c.values == std::vector<float>{0.25f, -1.5f});
  const std::string two =
      "array 'f32.npy' has 2 channels, not the 3 of " + setting("in_channels") + " (arrays are never converted)";
  CHECK_THROWS_WITH(load_image_values("f32.npy", 3), two.c_str());
  write_npy("fortran.npy", "<f4", "(1, 1, 2)", bytes_of(std::vector<float>{0, 0}), true);
  CHECK_THROWS_WITH(load_image_values("fortran.npy", 2), doctest::Contains("Fortran order"));
  write_npy("f64.npy", "<f8", "(1, 1)", bytes_of(std::vector<double>{0}));
  CHECK_THROWS_WITH(load_image_values("f64.npy", 1), doctest::Contains("element type '<f8'"));
  write_npy("short.npy", "<u2", "(2, 2)", bytes_of(std::vector<uint16_t>{1, 2, 3}));
  CHECK_THROWS_WITH(load_image_values("short.npy", 1), doctest::Contains("its data is 6 bytes, its header says 8"));
  write_npy("nan.npy", "<f4", "(1, 1)", bytes_of(std::vector<float>{NAN}));
  CHECK_THROWS_WITH(load_image_values("nan.npy", 1), doctest::Contains("not finite"));
  std::ofstream("junk.npy") << "not an array";
  CHECK_THROWS_WITH(load_image_values("junk.npy", 1), doctest::Contains("not a .npy file"));
}

TEST_CASE("--normalize dataset: each channel's mean and deviation over the set, and its checkpoint text") {
  testing::ScratchDir dir;
  // Two 1-channel 32x32 images of constant 0.2 and 0.6 (uint8 51 and 153): mean 0.4, deviation 0.2.
  std::filesystem::create_directories("d/images");
  std::filesystem::create_directories("d/masks");
  for (int i = 0; i < 2; ++i) {
    write_npy("d/images/" + std::to_string(i) + ".npy", "|u1", "(32, 32)",
              std::string(32 * 32, char(i == 0 ? 51 : 153)));
    save_png("d/masks/" + std::to_string(i) + ".png", Image{32, 32, 1, std::vector<uint8_t>(32 * 32, 0)});
  }
  FolderDataset ds(FolderDataset::scan("d"), 32, 32, LabelRule{});
  ds.set_normalization(Normalization::none(1));
  const Normalization n = dataset_normalization(ds);
  REQUIRE(n.channels() == 1);
  CHECK(n.kind == Normalization::Dataset);
  CHECK(n.mean[0] == doctest::Approx(0.4).epsilon(1e-6));
  CHECK(n.std[0] == doctest::Approx(0.2).epsilon(1e-6));
  // The batch: (0.2 - 0.4) / 0.2 = -1 and (0.6 - 0.4) / 0.2 = 1.
  ds.set_normalization(n);
  const Batch b = make_batch(ds, {0, 1}, DType::F32);
  CHECK(b.images.shape() == Shape{2, 1, 32, 32});
  CHECK(b.images.at(0) == doctest::Approx(-1).epsilon(1e-5));
  CHECK(b.images.at(32 * 32) == doctest::Approx(1).epsilon(1e-5));
  // Recorded and read back exactly; a malformed record is refused naming the file.
  const Normalization back = normalization_from_values(Normalization::Dataset, normalization_values(n), "f");
  CHECK(back.mean == n.mean);
  CHECK(back.std == n.std);
  CHECK_THROWS_WITH(normalization_from_values(Normalization::Dataset, "0.5;0", "checkpoint 'x'"),
                    doctest::Contains("'0' is not a positive number"));
  CHECK_THROWS_WITH(normalization_from_values(Normalization::Dataset, "0.5,0.1;0.2", "checkpoint 'x'"),
                    doctest::Contains("unequal"));
}
