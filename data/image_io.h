// Image files through stb_image / stb_image_write: PNG, JPEG, BMP in; PNG (and BMP) out.
//
// Reading is defensive, because image folders and prediction inputs come from anywhere:
// - only regular files are opened (a FIFO would block forever, a folder is no image);
// - the whole file is read into memory, capped by what an image within the pixel limit can
//   need, and stb decodes from memory;
// - JPEG marker segments are walked before stb sees the bytes, and a Huffman table (DHT) with
//   more than 256 codes is refused: Debian's stb_image 2.27 writes past its tables on one;
// - the header's size is checked against a process-wide pixel limit before anything is
//   decoded, and while decoding no single allocation may exceed what an image of that size
//   needs (a small PNG inflating to gigabytes is refused);
// - a BMP too short for the pixels its header promises is refused (stb would fill with zeros).
// Every refusal is one unetcu::Error naming the file.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace unetcu {

struct Image {
  int width = 0, height = 0, channels = 0;  // channels as stored: 1 gray, 3 RGB (loaded as asked)
  std::vector<uint8_t> pixels;              // row-major, interleaved
};

// Images with more pixels than the limit are refused from their header, before decoding.
// 8192 x 8192 (64 Mi pixels) by default; the apps set it from --max-image-pixels.
constexpr int64_t kDefaultMaxImagePixels = int64_t(8192) * 8192;
void set_max_image_pixels(int64_t pixels);  // process-wide; throws unetcu::Error for < 1
int64_t max_image_pixels();

struct ImageInfo {
  int width = 0, height = 0, channels = 0;  // channels as stored in the file
  bool palette = false;                     // an indexed PNG (colour type 3)
  bool wide = false;                        // a 16-bit PNG (read as 8 bits: the high byte)
};

// The size from the header only (reads the file's first bytes, decodes no pixels), with the
// same checks and errors as load_image up to the header: a regular file, the file size cap,
// the JPEG segments up to the frame header, the pixel limit, a BMP's length.
ImageInfo read_image_info(const std::string& path);
// Loads with `channels` channels (1 or 3, converting as needed). Throws unetcu::Error naming
// the file and the reason (stb's, or one of the checks above) when it cannot be used.
Image load_image(const std::string& path, int channels);

// An image's samples as read, not yet scaled (interleaved, row-major, `channels` a pixel):
// 0..255 for 8-bit files, 0..65535 for 16-bit PNGs and uint16 arrays, as stored for float32
// arrays; `divisor` maps them to [0, 1] (255, 65535 or 1).
struct ImageValues {
  int width = 0, height = 0, channels = 0;
  float divisor = 255.f;
  std::vector<float> values;
};
// An image file (PNG of 8 or 16 bits, JPEG, BMP) or a NumPy .npy array (H x W x N or H x W;
// uint8, uint16 or float32, C order, little-endian) with `channels` channels. With 3 channels
// an 8- or 16-bit image is read as RGB (a gray one expanded, alpha dropped, as load_image
// does); any other count, and every .npy array, must hold exactly that many channels: a file
// with another count is refused naming it, never converted. The same checks as load_image
// (regular file, pixel limit from the header, decompression bombs).
ImageValues load_image_values(const std::string& path, int channels);
// Whether `path` names a .npy array (by its extension).
bool is_npy_path(const std::string& path);
// Whether `path` names an input image a folder may hold, by its extension (any case): .png,
// .jpg, .jpeg, .bmp or .npy.
bool is_image_path(const std::string& path);

// Throws unetcu::Error unless `path` names a regular file (after following links), without
// opening it: "<what> '<path>' cannot be opened: ..." when it does not exist or cannot be
// examined, "... is a folder / a FIFO / ..., not a regular file" otherwise.
void check_regular_file(const std::string& path, const std::string& what);

// An indexed (palette) PNG's palette indices, one byte per pixel (channels 1), not the colours
// they stand for: a class index per pixel in a segmentation mask. The same file checks as
// load_image; a PNG that is not indexed, or is interlaced, is refused naming the file.
Image load_palette_indices(const std::string& path);

// Writes a PNG to a temporary file beside it and renames it, so `path` is whole or absent.
void save_png(const std::string& path, const Image& image);
// A 16-bit grayscale PNG (samples 0..65535, row-major, width*height of them), written through a
// temporary file like save_png; load_png16 reads one back (any PNG, converted to 16-bit gray).
void save_png16(const std::string& path, int width, int height, const std::vector<uint16_t>& gray);
std::vector<uint16_t> load_png16(const std::string& path, int* width, int* height);

// An indexed (palette) PNG, 8 bits per index, through a temporary file like save_png.
void save_png_indexed(const std::string& path, int width, int height, const std::vector<uint8_t>& indices,
                      const std::vector<std::array<uint8_t, 3>>& palette);

// PNG or BMP by the path's extension. (No JPEG: stb_image_write's JPEG encoder has undefined
// behaviour, a signed left shift that overflows, under -fsanitize=undefined.)
void save_image(const std::string& path, const Image& image);

// An image size: "S" (width 0: square) or "WxH" (positive whole numbers).
void parse_image_size(const std::string& s, int* width, int* height);

}  // namespace unetcu
