// Image files, image folders and augmentation.
//
// The JPEG and PNG files these tests read are written byte by byte here (no encoder: stb's
// JPEG writer has undefined behaviour, and a bad file is easiest to say exactly in bytes).
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "data/dataset.h"
#include "data/image_io.h"
#include "data/labels.h"
#include "data/metrics.h"
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

using Bytes = std::vector<uint8_t>;

void write_file(const fs::path& path, const Bytes& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

Bytes read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), {});
}

void put16be(Bytes& b, uint32_t v) { b.push_back(uint8_t(v >> 8)), b.push_back(uint8_t(v)); }
void put32be(Bytes& b, uint32_t v) { put16be(b, v >> 16), put16be(b, v & 0xFFFF); }
void put16le(Bytes& b, uint32_t v) { b.push_back(uint8_t(v)), b.push_back(uint8_t(v >> 8)); }
void put32le(Bytes& b, uint32_t v) { put16le(b, v & 0xFFFF), put16le(b, v >> 16); }

// A JPEG marker segment: FF m, a big-endian length that counts itself, the body.
Bytes segment(uint8_t marker, const Bytes& body) {
  Bytes s{0xFF, marker};
  put16be(s, uint32_t(body.size() + 2));
  s.insert(s.end(), body.begin(), body.end());
  return s;
}

// Bits most significant first into bytes, with JPEG's stuffing: a 00 after every FF byte.
struct JpegBits {
  Bytes out;
  uint32_t acc = 0;
  int count = 0;
  void put(uint32_t bits, int n) {
    for (int i = n - 1; i >= 0; --i) {
      acc = acc << 1 | ((bits >> i) & 1);
      if (++count == 8) {
        out.push_back(uint8_t(acc));
        if (acc == 0xFF) out.push_back(0x00);
        acc = 0, count = 0;
      }
    }
  }
  void pad() {  // to a whole byte with 1 bits, as encoders do before a marker
    while (count != 0) put(1, 1);
  }
};

// A baseline JPEG whose 8x8 blocks are each flat: value(c, bx, by) is component c's sample
// value in block (bx, by), 1 component (gray) or 3 (YCbCr), no subsampling. A flat block's
// DC coefficient is 8 * (value - 128) and every AC coefficient is 0; the quantisation table
// divides the DC by 8 (so the coded DC is value - 128: any bits, FF bytes included) and the
// rest by 1. Huffman tables: DC, the 12 categories 0..11 as 4-bit codes (code = the
// category); AC, one 1-bit code "0" for end-of-block. `restarts`: a restart interval of one MCU
// with RST markers between MCUs. `blocks`: how many MCUs to encode (all by default; fewer
// leaves the image data short, for a header that claims more than the file holds).
Bytes flat_jpeg(int width, int height, int components, const std::function<int(int, int, int)>& value,
                bool restarts = false, int64_t blocks = -1) {
  Bytes j{0xFF, 0xD8};
  auto add = [&](const Bytes& s) { j.insert(j.end(), s.begin(), s.end()); };
  Bytes dqt{0x00, 8};
  dqt.resize(65, 1);
  add(segment(0xDB, dqt));
  Bytes sof{8};
  put16be(sof, uint32_t(height)), put16be(sof, uint32_t(width));
  sof.push_back(uint8_t(components));
  for (int c = 0; c < components; ++c) sof.insert(sof.end(), {uint8_t(c + 1), 0x11, 0x00});
  add(segment(0xC0, sof));
  Bytes dht{0x00, 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  for (uint8_t category = 0; category < 12; ++category) dht.push_back(category);
  dht.insert(dht.end(), {0x10, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x00});
  add(segment(0xC4, dht));
  if (restarts) add(segment(0xDD, {0x00, 0x01}));
  Bytes sos{uint8_t(components)};
  for (int c = 0; c < components; ++c) sos.insert(sos.end(), {uint8_t(c + 1), 0x00});
  sos.insert(sos.end(), {0, 63, 0});
  add(segment(0xDA, sos));
  const int bw = (width + 7) / 8, bh = (height + 7) / 8;
  const int64_t mcus = blocks < 0 ? int64_t(bw) * bh : blocks;
  JpegBits bits;
  std::vector<int> previous(size_t(components), 0);
  for (int64_t m = 0; m < mcus; ++m) {
    for (int c = 0; c < components; ++c) {
      const int dc = value(c, int(m % bw), int(m / bw)) - 128, diff = dc - previous[size_t(c)];
      previous[size_t(c)] = dc;
      int category = 0;
      while ((std::abs(diff) >> category) != 0) ++category;
      bits.put(uint32_t(category), 4);
      bits.put(uint32_t(diff >= 0 ? diff : diff + (1 << category) - 1), category);
      bits.put(0, 1);  // end of block
    }
    if (restarts && m + 1 < mcus) {
      bits.pad();
      bits.out.insert(bits.out.end(), {0xFF, uint8_t(0xD0 + m % 8)});
      std::fill(previous.begin(), previous.end(), 0);
    }
  }
  bits.pad();
  add(bits.out);
  add({0xFF, 0xD9});
  return j;
}

Bytes flat_jpeg(int width, int height, std::vector<int> values) {
  return flat_jpeg(width, height, int(values.size()), [values](int c, int, int) { return values[size_t(c)]; });
}

// A DHT segment of one table (class 1 = AC, id 3) whose 16 code counts add up to 510, each
// count at most 255 and all codes 15 or 16 bits long, so the code lengths themselves are fine
// and stb_image 2.27 would build the table, writing 510 entries into arrays of 256 and 257.
Bytes oversized_huffman_table() {
  Bytes body{0x13};
  for (int length = 1; length <= 16; ++length) body.push_back(length >= 15 ? 255 : 0);
  body.resize(body.size() + 510, 0x00);
  return segment(0xC4, body);
}

// `bytes` inserted into a JPEG at byte `at`, just after SOI, or just before EOI.
Bytes insert_at(Bytes jpeg, size_t at, const Bytes& bytes) {
  jpeg.insert(jpeg.begin() + std::ptrdiff_t(at), bytes.begin(), bytes.end());
  return jpeg;
}
Bytes after_soi(const Bytes& jpeg, const Bytes& bytes) { return insert_at(jpeg, 2, bytes); }
Bytes before_eoi(const Bytes& jpeg, const Bytes& bytes) { return insert_at(jpeg, jpeg.size() - 2, bytes); }

// A 54-byte BMP header (24 bits a pixel) with no pixels after it.
Bytes bmp_header(uint32_t width, uint32_t height) {
  const uint32_t row = (width * 3 + 3) / 4 * 4;
  Bytes b{'B', 'M'};
  put32le(b, uint32_t(54 + uint64_t(row) * height)), put32le(b, 0), put32le(b, 54);
  put32le(b, 40), put32le(b, width), put32le(b, height), put16le(b, 1), put16le(b, 24);
  put32le(b, 0), put32le(b, 0), put32le(b, 2835), put32le(b, 2835), put32le(b, 0), put32le(b, 0);
  return b;
}

uint32_t crc32(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return ~c;
}

void png_chunk(Bytes& png, const char* type, const Bytes& data) {
  put32be(png, uint32_t(data.size()));
  const size_t start = png.size();
  png.insert(png.end(), type, type + 4);
  png.insert(png.end(), data.begin(), data.end());
  put32be(png, crc32(png.data() + start, png.size() - start));
}

// A 1x1 gray PNG whose image data inflates to `inflated` bytes (all zero) from about
// inflated / 160 bytes: one fixed-Huffman deflate block of a literal 0 and then copies of
// 258 bytes at distance 1 (13 bits each). A PNG decoder that inflates all of it first holds
// megabytes for one pixel.
Bytes png_inflating_to(size_t inflated) {
  Bytes deflate;
  int bit = 0;
  auto put_bit = [&](uint32_t b) {
    if (bit % 8 == 0) deflate.push_back(0);
    deflate.back() |= uint8_t(b << (bit % 8));
    ++bit;
  };
  auto huffman = [&](uint32_t code, int length) {  // Huffman codes go most significant bit first
    for (int i = length - 1; i >= 0; --i) put_bit((code >> i) & 1);
  };
  put_bit(1), put_bit(1), put_bit(0);  // the final block; type 01 (fixed codes), low bit first
  huffman(0x30, 8), huffman(0x30, 8);  // literal 0 twice: the row's filter byte and the pixel
  size_t out = 2;
  for (; out + 258 <= inflated; out += 258) huffman(0xC5, 8), huffman(0, 5);  // length 258, distance 1
  huffman(0, 7);                                                               // end of block
  uint32_t a = 1, b = 0;  // Adler-32 of `out` zero bytes
  for (size_t i = 0; i < out; ++i) b = (b + a) % 65521;
  Bytes zlib{0x78, 0x01};
  zlib.insert(zlib.end(), deflate.begin(), deflate.end());
  put32be(zlib, b << 16 | a);
  Bytes png{0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  Bytes ihdr;
  put32be(ihdr, 1), put32be(ihdr, 1);
  ihdr.insert(ihdr.end(), {8, 0, 0, 0, 0});  // 8-bit gray, not interlaced
  png_chunk(png, "IHDR", ihdr);
  png_chunk(png, "IDAT", zlib);
  png_chunk(png, "IEND", {});
  return png;
}

// doctest::Contains of a composed message (it takes a C string).
doctest::Contains contains(const std::string& text) { return doctest::Contains(text.c_str()); }

// Sets the process-wide pixel limit for one test and puts the default back.
struct PixelLimit {
  explicit PixelLimit(int64_t pixels) { set_max_image_pixels(pixels); }
  ~PixelLimit() { set_max_image_pixels(kDefaultMaxImagePixels); }
};

}  // namespace

TEST_CASE("folder dataset: pairing by stem, both layouts, name lists, resize, normalisation") {
  TempDir d("layouts");
  fs::create_directories(d.path / "a" / "images");
  fs::create_directories(d.path / "a" / "masks");
  // A 48x40 gray image (value 128) with a mask whose left half is set.
  Image mask = solid(48, 40, 1, 0);
  for (int y = 0; y < 40; ++y)
    for (int x = 0; x < 24; ++x) mask.pixels[size_t(y) * 48 + x] = 200;
  write_file(d.path / "a" / "images" / "b.jpg", flat_jpeg(48, 40, {128, 128, 128}));
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
  for (int c = 0; c < 3; ++c)  // a flat gray JPEG decodes to its value
    CHECK(b.images.at(c * 32 * 32 + 5 * 32 + 7) ==
          doctest::Approx((128 / 255.0 - kImageMean[c]) / kImageStd[c]));
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

TEST_CASE("images: a hand-written baseline JPEG decodes (colour, stuffed FF bytes, restart markers)") {
  TempDir d("jpeg_read");
  // YCbCr (100, 150, 90) is RGB (46.7, 119.6, 139.0) by JFIF's conversion.
  write_file(d.path / "colour.jpg", flat_jpeg(20, 12, {100, 150, 90}));
  const ImageInfo info = read_image_info((d.path / "colour.jpg").string());
  CHECK(info.width == 20);
  CHECK(info.height == 12);
  CHECK(info.channels == 3);
  const Image rgb = load_image((d.path / "colour.jpg").string(), 3);
  REQUIRE(rgb.pixels.size() == size_t(20 * 12 * 3));
  for (size_t q = 0; q < size_t(20 * 12); ++q) {
    CHECK(std::abs(rgb.pixels[q * 3] - 46.7) < 1.5);
    CHECK(std::abs(rgb.pixels[q * 3 + 1] - 119.6) < 1.5);
    CHECK(std::abs(rgb.pixels[q * 3 + 2] - 139.0) < 1.5);
  }
  // Gray blocks: a checkerboard of 0 and 255, whose jumps of +255 code as eight 1 bits, some
  // of them a whole FF byte (stuffed as FF 00); and varied values with restart markers FF D0..D7
  // between blocks. Neither the stuffing nor the markers end the image data.
  auto checker = [](int, int bx, int by) { return (bx + by) % 2 ? 255 : 0; };
  auto varied = [](int, int bx, int by) { return (bx * 53 + by * 97 + bx * by * 31) % 256; };
  for (bool restarts : {false, true}) {
    CAPTURE(restarts);
    const auto& value = restarts ? varied : checker;
    const Bytes jpeg = flat_jpeg(64, 48, 1, value, restarts);
    size_t stuffed = 0, markers = 0;
    for (size_t i = 0; i + 1 < jpeg.size(); ++i)
      stuffed += jpeg[i] == 0xFF && jpeg[i + 1] == 0x00, markers += jpeg[i] == 0xFF && (jpeg[i + 1] & 0xF8) == 0xD0;
    CHECK((restarts ? markers : stuffed) > 0);  // the case is there
    write_file(d.path / "blocks.jpg", jpeg);
    const Image gray = load_image((d.path / "blocks.jpg").string(), 1);
    REQUIRE(gray.width == 64);
    for (int y = 0; y < 48; ++y)
      for (int x = 0; x < 64; ++x) CHECK(std::abs(gray.pixels[size_t(y) * 64 + x] - value(0, x / 8, y / 8)) <= 1);
  }
  // Nothing writes JPEG (stb's encoder has undefined behaviour).
  CHECK_THROWS_WITH(save_image((d.path / "out.jpg").string(), solid(8, 8, 3, 0)), doctest::Contains("PNG or BMP only"));
}

TEST_CASE("images: a JPEG Huffman table of more than 256 codes is refused before stb builds it") {
  TempDir d("jpeg_dht");
  const Bytes good = flat_jpeg(16, 16, {128, 128, 128});
  // In the header, where stbi_info reads it too.
  const std::string head = (d.path / "head.jpg").string();
  write_file(head, after_soi(good, oversized_huffman_table()));
  for (int pass = 0; pass < 2; ++pass) {
    auto read = [&] { return pass == 0 ? load_image(head, 3).width : read_image_info(head).width; };
    CHECK_THROWS_WITH(read(), contains("cannot read image '" + head + "': corrupt JPEG: Huffman table"));
    CHECK_THROWS_WITH(read(), doctest::Contains("has 510 codes, more than the 256"));
  }
  // After the scan (progressive files define tables between scans): the whole file is walked.
  const std::string tail = (d.path / "tail.jpg").string();
  write_file(tail, before_eoi(good, oversized_huffman_table()));
  CHECK_THROWS_WITH(load_image(tail, 3), doctest::Contains("has 510 codes, more than the 256"));
  CHECK(read_image_info(tail).width == 16);  // the header alone is sound
  // A table cut off by its segment's end, and a class/id stb has no table for.
  Bytes table(17, 0);  // class 0 id 0, four 3-bit codes, but two symbols
  table[3] = 4;
  table.insert(table.end(), {1, 2});
  write_file(head, after_soi(good, segment(0xC4, table)));
  CHECK_THROWS_WITH(load_image(head, 3), doctest::Contains("is cut off by the end of its segment"));
  table = Bytes(17, 0);
  table[0] = 0x24;
  write_file(head, after_soi(good, segment(0xC4, table)));
  CHECK_THROWS_WITH(load_image(head, 3), doctest::Contains("has class 2 and id 4"));
}

TEST_CASE("images: truncated or garbled JPEG structure is refused") {
  TempDir d("jpeg_structure");
  const std::string path = (d.path / "x.jpg").string();
  const Bytes good = flat_jpeg(16, 16, {128, 128, 128});
  write_file(path, Bytes(good.begin(), good.end() - 2));  // no end-of-image marker
  CHECK_THROWS_WITH(load_image(path, 1), doctest::Contains("corrupt JPEG: the file ends inside the image data (truncated?)"));
  write_file(path, Bytes(good.begin(), good.begin() + 90));  // the frame header, then nothing
  CHECK_THROWS_WITH(load_image(path, 1), doctest::Contains("corrupt JPEG: the file ends before its end-of-image marker"));
  write_file(path, Bytes(good.begin(), good.begin() + 30));  // inside the quantisation table
  CHECK_THROWS_WITH(load_image(path, 1), doctest::Contains("the file ends inside the segment FFDB at byte 2"));
  CHECK_THROWS_WITH(read_image_info(path), doctest::Contains("the file ends inside the segment FFDB"));
  Bytes short_length = good;
  short_length[4] = 0, short_length[5] = 1;  // the DQT segment's length: 1 cannot count itself
  write_file(path, short_length);
  CHECK_THROWS_WITH(load_image(path, 1), doctest::Contains("segment FFDB at byte 2 has length 1"));
  // Stray bytes between segments: stb skips them before the frame header (SOF, bytes 71..89
  // here), not after it.
  write_file(path, insert_at(good, 71, {0x12, 0x34}));
  CHECK(load_image(path, 1).width == 16);
  write_file(path, insert_at(good, 90, {0x12, 0x34}));
  CHECK_THROWS_WITH(load_image(path, 1), doctest::Contains("expected a marker at byte 90"));
  write_file(path, before_eoi(good, segment(0xC0, {8, 0, 16, 0, 16, 1, 1, 0x11, 0})));
  CHECK_THROWS_WITH(load_image(path, 1), doctest::Contains("a second frame header"));
  write_file(path, before_eoi(good, {0xFF, 0x01}));
  CHECK_THROWS_WITH(load_image(path, 1), doctest::Contains("unexpected marker FF01"));
}

TEST_CASE("images: a JPEG whose image data cannot cover its blocks is refused before decoding") {
  TempDir d("jpeg_short");
  const std::string path = (d.path / "x.jpg").string();
  // Within the pixel limit, a few hundred bytes claiming 8000x8000 (a million 8x8 blocks, so at
  // least 125,000 bytes of image data): stb would decode seconds of gray.
  write_file(path, flat_jpeg(8000, 8000, 1, [](int, int, int) { return 128; }, false, 4));
  CHECK(fs::file_size(path) < 1024);
  CHECK_THROWS_WITH(load_image(path, 1),
                    contains("cannot read image '" + path + "': corrupt JPEG: its image data (3 bytes) is too short for "
                             "a 8000x8000 image, which needs at least one bit per 8x8 block (1000000 blocks): truncated?"));
  CHECK(read_image_info(path).width == 8000);  // the header alone is sound
  // A 64x64 gray image is 64 blocks, 8 bytes at one bit each. flat_jpeg spends 5 bits on a flat
  // block (a 4-bit DC code, a 1-bit end of block): 12 blocks are 60 bits, 8 bytes once padded,
  // just enough for the bound (what stb then makes of the missing blocks is its own matter).
  write_file(path, flat_jpeg(64, 64, 1, [](int, int, int) { return 128; }, false, 12));
  std::string at_bound = "decoded";
  try {
    load_image(path, 1);
  } catch (const Error& e) {
    at_bound = e.what();
  }
  CHECK_MESSAGE(at_bound.find("too short") == std::string::npos, at_bound);
  write_file(path, flat_jpeg(64, 64, 1, [](int, int, int) { return 128; }, false, 11));  // 55 bits: 7 bytes
  CHECK_THROWS_WITH(load_image(path, 1), doctest::Contains("its image data (7 bytes) is too short for a 64x64 image"));
  // Every block coded decodes, colour too.
  write_file(path, flat_jpeg(64, 64, {10, 200, 30}));
  CHECK(load_image(path, 3).width == 64);
}

TEST_CASE("images: the pixel limit refuses an image from its header, before any decoding") {
  TempDir d("bombs");
  // 54 bytes claiming 9000x9000 (81 Mi pixels): stb would allocate 243 MB and read zeros.
  const std::string bmp = (d.path / "big.bmp").string();
  write_file(bmp, bmp_header(9000, 9000));
  CHECK_THROWS_WITH(load_image(bmp, 3), contains("image '" + bmp + "' is 9000x9000 (81000000 pixels), more than the limit of 67108864 pixels"));
  CHECK_THROWS_WITH(read_image_info(bmp), doctest::Contains("more than the limit"));
  // A JPEG of a few hundred bytes claiming 9000x9000.
  const std::string jpg = (d.path / "big.jpg").string();
  write_file(jpg, flat_jpeg(9000, 9000, 1, [](int, int, int) { return 128; }, false, 4));
  CHECK(fs::file_size(jpg) < 1024);
  CHECK_THROWS_WITH(load_image(jpg, 3), doctest::Contains("is 9000x9000 (81000000 pixels), more than the limit"));
  // A top-down BMP (negative height) is as tall as its height's magnitude.
  Bytes top_down = bmp_header(9000, 9000);
  const uint32_t minus_9000 = uint32_t(-9000);
  std::memcpy(top_down.data() + 22, &minus_9000, 4);
  write_file(bmp, top_down);
  CHECK_THROWS_WITH(load_image(bmp, 3), doctest::Contains("is 9000x9000 (81000000 pixels)"));
  // The limit is the process's, set by the apps' --max-image-pixels.
  CHECK(max_image_pixels() == kDefaultMaxImagePixels);
  CHECK_THROWS_WITH(set_max_image_pixels(0), doctest::Contains("at least 1"));
  const std::string png = (d.path / "small.png").string();
  save_png(png, solid(40, 30, 3, 9));
  {
    PixelLimit limit(40 * 30 - 1);
    CHECK_THROWS_WITH(load_image(png, 3), doctest::Contains("is 40x30 (1200 pixels), more than the limit of 1199 pixels set for images"));
    CHECK_THROWS_WITH(read_image_info(png), doctest::Contains("more than the limit of 1199"));
  }
  {
    PixelLimit limit(40 * 30);
    CHECK(load_image(png, 3).width == 40);
    // Files too long for any image within the limit are not even read (8 bytes a pixel + 64 MiB).
    const std::string huge = (d.path / "huge.png").string();
    write_file(huge, read_file(png));
    fs::resize_file(huge, 40 * 30 * 8 + (64 << 20) + 1);
    CHECK_THROWS_WITH(read_image_info(huge), doctest::Contains("bytes, more than an image within the limit of 1200 pixels needs"));
  }
}

TEST_CASE("images: a PNG that inflates far past its size is refused while decoding") {
  TempDir d("png_bomb");
  const std::string path = (d.path / "bomb.png").string();
  write_file(path, png_inflating_to(size_t(16) << 20));
  CHECK(fs::file_size(path) < 200 * 1024);
  const ImageInfo info = read_image_info(path);  // a sound 1x1 header
  CHECK(info.width * info.height == 1);
  CHECK_THROWS_WITH(load_image(path, 1), contains("cannot read image '" + path + "': decoding it needs more memory than a 1x1 image can"));
  // The same construction at the size the pixel needs decodes: the cap is no false alarm.
  write_file(path, png_inflating_to(2));
  CHECK(load_image(path, 1).pixels == std::vector<uint8_t>{0});
}

TEST_CASE("images: a BMP shorter than its header promises is refused, not read as black") {
  TempDir d("bmp_short");
  const std::string path = (d.path / "short.bmp").string();
  write_file(path, bmp_header(100, 50));
  CHECK_THROWS_WITH(load_image(path, 3), doctest::Contains("truncated BMP: 100x50 at 24 bits per pixel needs at least 15054 bytes, the file has 54"));
  CHECK_THROWS_WITH(read_image_info(path), doctest::Contains("truncated BMP"));
  Bytes whole = bmp_header(100, 50);
  whole.resize(15054, 7);
  write_file(path, whole);
  CHECK(load_image(path, 3).pixels[0] == 7);
  save_image(path, solid(5, 3, 3, 200));  // and what stb writes reads back
  CHECK(load_image(path, 3).pixels == solid(5, 3, 3, 200).pixels);
}

TEST_CASE("images: only regular files are read (a FIFO does not block, a folder is no image)") {
  TempDir d("special_files");
  const std::string fifo = (d.path / "pipe.png").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH(load_image(fifo, 3), contains("image '" + fifo + "' is a FIFO (named pipe), not a regular file"));
  CHECK_THROWS_WITH(read_image_info(fifo), doctest::Contains("is a FIFO (named pipe), not a regular file"));
  fs::create_directories(d.path / "folder.png");
  CHECK_THROWS_WITH(load_image((d.path / "folder.png").string(), 3), doctest::Contains("is a folder, not a regular file"));
  CHECK_THROWS_WITH(load_image((d.path / "none.png").string(), 3), doctest::Contains("none.png' cannot be opened: No such file"));
  CHECK_THROWS_WITH(check_regular_file(fifo, "the name list"), contains("the name list '" + fifo + "' is a FIFO"));
  // A link to a regular file is read.
  save_png((d.path / "real.png").string(), solid(4, 4, 1, 3));
  fs::create_symlink(d.path / "real.png", d.path / "link.png");
  CHECK(load_image((d.path / "link.png").string(), 1).width == 4);
}

TEST_CASE("folder dataset: a name list must be a regular file (a folder is not ignored, a FIFO does not block)") {
  TempDir d("list_kinds");
  fs::create_directories(d.path / "data" / "images");
  fs::create_directories(d.path / "data" / "masks");
  save_png((d.path / "data" / "images" / "a.png").string(), solid(32, 32, 3, 1));
  save_png((d.path / "data" / "masks" / "a.png").string(), solid(32, 32, 1, 1));
  const std::string data = (d.path / "data").string();
  CHECK_THROWS_WITH(FolderDataset::scan(data, (d.path / "data" / "images").string()),
                    contains("name list '" + (d.path / "data" / "images").string() + "' is a folder"));
  const std::string fifo = (d.path / "list.txt").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH(FolderDataset::scan(data, fifo), doctest::Contains("is a FIFO (named pipe), not a regular file"));
  CHECK_THROWS_WITH(FolderDataset::scan(data, (d.path / "none.txt").string()), doctest::Contains("none.txt' cannot be opened"));
}

TEST_CASE("folder dataset: image and mask sizes are compared from their headers, before decoding") {
  TempDir d("sizes_first");
  fs::create_directories(d.path / "images");
  fs::create_directories(d.path / "masks");
  // The image's pixels are damaged (its header is whole) and the mask is the wrong size: the
  // size is the error, found before either is decoded.
  save_png((d.path / "images" / "x.png").string(), solid(32, 32, 3, 1));
  Bytes png = read_file(d.path / "images" / "x.png");
  png.resize(40);
  write_file(d.path / "images" / "x.png", png);
  save_png((d.path / "masks" / "x.png").string(), solid(16, 32, 1, 1));
  FolderDataset ds(FolderDataset::scan(d.path.string()), 32);
  CHECK_THROWS_WITH(make_batch(ds, {0}, DType::F32), contains("mask '" + (d.path / "masks" / "x.png").string() + "' is 16x32 but its image"));
  // The right size: now the damage is the error.
  save_png((d.path / "masks" / "x.png").string(), solid(32, 32, 1, 1));
  CHECK_THROWS_WITH(make_batch(ds, {0}, DType::F32), contains("cannot read image '" + (d.path / "images" / "x.png").string() + "'"));
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

TEST_CASE("16-bit grayscale PNG: written and read back sample for sample") {
  // Every value that matters at the ends (0, 1, 255, 256, 65534, 65535) and a ramp, on an odd
  // size, so byte order, row filters and the deflate stream are all exercised.
  const int w = 37, h = 5;
  std::vector<uint16_t> v(size_t(w) * h);
  for (size_t i = 0; i < v.size(); ++i) v[i] = uint16_t((i * 1777u) % 65536u);
  const uint16_t ends[] = {0, 1, 255, 256, 65534, 65535};
  for (size_t i = 0; i < 6; ++i) v[i] = ends[i];
  const std::string path = "png16_test.png";
  save_png16(path, w, h, v);
  int rw = 0, rh = 0;
  const std::vector<uint16_t> back = load_png16(path, &rw, &rh);
  CHECK(rw == w);
  CHECK(rh == h);
  CHECK(back == v);
  std::remove(path.c_str());
  CHECK_THROWS_WITH(save_png16(path, w, h, std::vector<uint16_t>(3)), doctest::Contains("3 samples"));
}

TEST_CASE("segmentation counts: IoU, Dice and accuracy from pixels, logit > 0 against mask > 0.5") {
  // pred (logit > 0): 1 0 1 0 1 0; truth (mask > 0.5): 1 1 0 0 1 0 -> TP 2, FP 1, FN 1, TN 2.
  const Tensor logits = Tensor::from_vector({1, 1, 2, 3}, {1, -1, 2, -2, 0.5, 0}, DType::F32);
  const Tensor masks = Tensor::from_vector({1, 1, 2, 3}, {1, 0.75, 0.5, 0, 1, 0}, DType::F32);
  SegmentationCounts c;
  c.add(logits, masks);
  CHECK(c.tp() == 2);
  CHECK(c.fp() == 1);
  CHECK(c.fn() == 1);
  CHECK(c.tn() == 2);
  CHECK(c.iou() == doctest::Approx(0.5).epsilon(1e-15));
  CHECK(c.dice() == doctest::Approx(4.0 / 6.0).epsilon(1e-15));
  CHECK(c.accuracy() == doctest::Approx(4.0 / 6.0).epsilon(1e-15));
  c.add(logits, masks);  // sums over batches before dividing
  CHECK(c.tp() == 4);
  CHECK(c.iou() == doctest::Approx(0.5).epsilon(1e-15));

  SegmentationCounts empty;
  CHECK(empty.iou() == 1.0);  // nothing to find and nothing predicted
  CHECK_THROWS_WITH_AS(c.add(logits, Tensor::zeros({1, 1, 3, 2}, DType::F32)),
                       doctest::Contains("SegmentationCounts::add"), Error);
  CHECK_THROWS_WITH_AS(c.add(logits, Tensor::zeros({1, 1, 2, 3}, DType::F64)),
                       doctest::Contains("logits are float32, masks float64"), Error);
}

TEST_CASE("segmentation counts, several classes: confusion matrix, per-class IoU, mIoU over classes present, ignored pixels") {
  // 3 classes, 6 pixels, logits [1, 3, 1, 6]: predicted 0 1 2 2 0 1; truth 0 1 1 -1 0 2.
  const std::vector<double> x = {5, 0, 0, 0, 5, 0,   // class 0's logits
                                 0, 5, 0, 0, 0, 5,   // class 1's
                                 0, 0, 5, 5, 0, 0};  // class 2's
  const Tensor logits = Tensor::from_vector({1, 3, 1, 6}, x, DType::F32);
  const Tensor masks = Tensor::from_vector({1, 1, 1, 6}, {0, 1, 1, -1, 0, 2}, DType::F32);
  SegmentationCounts c(3);
  c.add(logits, masks);
  // Counted (pixel 3 ignored): class 0: TP 2; class 1: TP 1, FN 1 (pixel 2 -> 2), FP 1 (pixel 5);
  // class 2: TP 0, FP 1 (pixel 2), FN 1 (pixel 5).
  const std::vector<double>& m = c.matrix();
  CHECK(m == std::vector<double>{2, 0, 0, 0, 1, 1, 0, 1, 0});
  CHECK(c.class_iou(0) == 1.0);
  CHECK(c.class_iou(1) == doctest::Approx(1.0 / 3));
  CHECK(c.class_iou(2) == 0.0);
  CHECK(c.class_dice(1) == doctest::Approx(0.5));
  CHECK(c.miou() == doctest::Approx((1.0 + 1.0 / 3 + 0.0) / 3));
  CHECK(c.iou() == c.miou());
  CHECK(c.accuracy() == doctest::Approx(3.0 / 5));
  // A class absent from truth and prediction does not count in the mean.
  SegmentationCounts d(4);
  const std::vector<double> x4 = {5, 0, 0, 5, 0, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  d.add(Tensor::from_vector({1, 4, 1, 4}, x4, DType::F32), Tensor::from_vector({1, 1, 1, 4}, {0, 1, 1, 0}, DType::F32));
  CHECK(!d.class_seen(2));
  CHECK(!d.class_seen(3));
  CHECK(d.miou() == 1.0);
  // One channel: ignored pixels count nowhere; miou is background's and foreground's mean.
  SegmentationCounts b;
  b.add(Tensor::from_vector({1, 1, 1, 4}, {1, -1, 1, -1}, DType::F32), Tensor::from_vector({1, 1, 1, 4}, {1, 0, -1, 1}, DType::F32));
  CHECK(b.tp() == 1);
  CHECK(b.tn() == 1);
  CHECK(b.fn() == 1);
  CHECK(b.fp() == 0);
  CHECK(b.iou() == doctest::Approx(0.5));
  CHECK(b.miou() == doctest::Approx((0.5 + 0.5) / 2));
  CHECK_THROWS_WITH_AS(c.add(logits, Tensor::zeros({1, 3, 1, 6})), doctest::Contains("masks [1, 3, 1, 6]"), Error);
}

TEST_CASE("masks as users have them: class indices in grayscale and indexed PNGs, RGB through colours, the ignore index") {
  TempDir d("labels");
  const std::string gray = (d.path / "gray.png").string(), pal = (d.path / "pal.png").string();
  const std::string rgb = (d.path / "rgb.png").string(), colors = (d.path / "colors.txt").string();
  // 7 x 5, values 0, 1, 2 and 255 in a pattern; an indexed PNG with the same indices.
  Image g = solid(7, 5, 1, 0);
  std::vector<uint8_t> idx(35);
  for (size_t q = 0; q < 35; ++q) idx[q] = g.pixels[q] = q % 11 == 3 ? 255 : uint8_t(q * 7 % 3);
  save_image(gray, g);
  std::vector<std::array<uint8_t, 3>> palette(256, {0, 0, 0});
  palette[1] = {200, 0, 0}, palette[2] = {0, 200, 0}, palette[255] = {255, 255, 255};
  save_png_indexed(pal, 7, 5, idx, palette);
  CHECK(read_image_info(pal).palette);
  CHECK(load_palette_indices(pal).pixels == idx);  // the five row filters undone
  LabelRule rule{3, 255, {}, {}};
  int w = 0, h = 0;
  for (const std::string& f : {gray, pal}) {
    CAPTURE(f);
    const std::vector<float> t = load_mask_targets(f, rule, &w, &h);
    REQUIRE(t.size() == 35);
    CHECK(w == 7);
    CHECK(h == 5);
    for (size_t q = 0; q < 35; ++q) CHECK(t[q] == (idx[q] == 255 ? -1.f : float(idx[q])));
  }
  // A value >= N that is not the ignore index: one error naming the file, the value and N.
  CHECK_THROWS_WITH(load_mask_targets(gray, LabelRule{3, -1, {}, {}}, &w, &h),
                    doctest::Contains("gray.png': pixel (3, 0) holds 255, not one of the 3 classes (0..2) and no ignore index is set"));
  CHECK_THROWS_WITH(load_mask_targets(gray, LabelRule{2, 255, {}, {}}, &w, &h), doctest::Contains("holds 2, not one of the 2 classes"));
  // One class: > 0 is foreground, the ignore index ignored.
  const std::vector<float> b = load_mask_targets(gray, LabelRule{1, 255, {}, {}}, &w, &h);
  for (size_t q = 0; q < 35; ++q) CHECK(b[q] == (idx[q] == 255 ? -1.f : idx[q] > 0 ? 1.f : 0.f));
  // RGB: through the colour table; without it, one clear error; an unknown colour is named.
  Image c = solid(7, 5, 3, 0);
  for (size_t q = 0; q < 35; ++q)
    for (int k = 0; k < 3; ++k) c.pixels[q * 3 + size_t(k)] = idx[q] == 255 ? 0 : palette[idx[q]][size_t(k)];
  save_image(rgb, c);
  CHECK_THROWS_WITH(load_mask_targets(rgb, rule, &w, &h), doctest::Contains("rgb.png' is an RGB image; with 3 classes give a class colour table"));
  std::ofstream(colors) << "# r,g,b,name\n0,0,0,background\n200,0,0,car\n0,200,0\n";
  LabelRule with{3, -1, read_class_colors(colors), {}};
  CHECK(class_names(with) == std::vector<std::string>{"background", "car", "2"});
  const std::vector<float> r = load_mask_targets(rgb, with, &w, &h);
  for (size_t q = 0; q < 35; ++q) CHECK(r[q] == (idx[q] == 255 ? 0.f : float(idx[q])));
  c.pixels[3 * 8 + 1] = 7;
  save_image(rgb, c);
  CHECK_THROWS_WITH(load_mask_targets(rgb, with, &w, &h),
                    doctest::Contains("rgb.png': colour 0,7,0 at (1, 1) is not in the class colour table"));
  // A line named "ignore" is the colour of ignored pixels, not a class.
  std::ofstream(colors) << "0,0,0\n200,0,0\n0,200,0\n0,7,0,ignore\n";
  LabelRule ig{3, -1, {}, {}};
  ig.colors = read_class_colors(colors, &ig.ignored);
  REQUIRE(ig.colors.size() == 3);
  REQUIRE(ig.ignored.size() == 1);
  const std::vector<float> ri = load_mask_targets(rgb, ig, &w, &h);
  CHECK(ri[8] == -1.f);
  CHECK(ri[0] == r[0]);
  CHECK_THROWS_WITH(read_class_colors(colors), doctest::Contains("'ignore' is not read here"));
  std::ofstream(colors) << "0,0,0,a\"b\n";
  CHECK_THROWS_WITH(read_class_colors(colors), doctest::Contains("may hold letters, digits"));
  std::ofstream(colors) << "0,0,0,car\n1,1,1,car\n";
  CHECK_THROWS_WITH(read_class_colors(colors), doctest::Contains("the name 'car' is listed twice"));
  // One class reads an indexed PNG's gray values (> 0 foreground), as before several classes:
  // index 0 drawn in gray is foreground there, not background.
  std::vector<std::array<uint8_t, 3>> gray_zero = palette;
  gray_zero[0] = {90, 90, 90};
  const std::string pal1 = (d.path / "pal1.png").string();
  save_png_indexed(pal1, 7, 5, idx, gray_zero);
  const std::vector<float> b1 = load_mask_targets(pal1, LabelRule{1, -1, {}, {}}, &w, &h);
  for (size_t q = 0; q < 35; ++q) CHECK(b1[q] == 1.f);
  // A 16-bit mask holds no 8-bit class index: refused with several classes.
  save_png16((d.path / "wide.png").string(), 7, 5, std::vector<uint16_t>(35, 1));
  CHECK_THROWS_WITH(load_mask_targets((d.path / "wide.png").string(), rule, &w, &h), doctest::Contains("is a 16-bit PNG"));
  std::ofstream(colors) << "1,2\n";
  CHECK_THROWS_WITH(read_class_colors(colors), doctest::Contains("line 1: expected r,g,b"));
  std::ofstream(colors) << "1,2,300\n";
  CHECK_THROWS_WITH(read_class_colors(colors), doctest::Contains("'300' is not a value in 0..255"));
}

TEST_CASE("crops: random windows of samples at their own size, padding ignored, reproducible, from non-square synthetic classes") {
  SyntheticSegmentation s(160, 96, 5, 3);
  SyntheticDataset ds(s, 0, 6);
  std::set<float> values;
  Sample one;
  ds.load(0, &one);
  CHECK(one.width == 160);
  CHECK(one.height == 96);
  for (float v : one.mask) values.insert(v);
  for (float v : values) CHECK((v == 0.f || v == 1.f || v == 2.f));
  const Batch a = make_batch(ds, {0, 1, 2}, DType::F32, false, Augment::Heavy, 9, 2, 64);
  const Batch b = make_batch(ds, {0, 1, 2}, DType::F32, false, Augment::Heavy, 9, 2, 64);
  REQUIRE(a.images.shape() == Shape{3, 3, 64, 64});
  CHECK(testing::max_abs_diff(a.images, b.images) == 0.0);
  CHECK(testing::max_abs_diff(a.masks, b.masks) == 0.0);
  // Without augmentation a crop is the sample's pixels at some offset: find it.
  const Batch c = make_batch(ds, {0}, DType::F32, false, Augment::None, 9, 0, 64);
  int found = 0;
  for (int y0 = 0; y0 + 64 <= 96; ++y0)
    for (int x0 = 0; x0 + 64 <= 160; ++x0) {
      bool same = true;
      for (int y = 0; y < 64 && same; y += 7)
        for (int x = 0; x < 64 && same; x += 5) same = c.masks.at(y * 64 + x) == one.mask[size_t(y0 + y) * 160 + x0 + x];
      found += same && c.images.at(30 * 64 + 30) == doctest::Approx((one.image[size_t(y0 + 30) * 160 + x0 + 30] - kImageMean[0]) / kImageStd[0]);
    }
  CHECK(found >= 1);
  // A crop larger than the sample: the padding is image 0 and mask -1, the sample whole inside.
  const Batch p = make_batch(ds, {0}, DType::F32, false, Augment::None, 9, 0, 192);
  int64_t pad = 0, inside = 0;
  for (int64_t i = 0; i < 192 * 192; ++i) {
    if (p.masks.at(i) < 0) {
      ++pad;
      CHECK(p.images.at(i) == 0.0);
    } else {
      ++inside;
    }
  }
  CHECK(inside == 160 * 96);
  CHECK(pad == 192 * 192 - 160 * 96);
}
