// Image files through stb_image / stb_image_write: PNG, JPEG, BMP in; PNG (and BMP) out.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace unetcu {

struct Image {
  int width = 0, height = 0, channels = 0;  // channels as stored: 1 gray, 3 RGB (loaded as asked)
  std::vector<uint8_t> pixels;              // row-major, interleaved
};

// Loads with `channels` channels (1 or 3, converting as needed). Throws unetcu::Error naming
// the file and stb's reason when it cannot be read or decoded.
Image load_image(const std::string& path, int channels);
// Writes a PNG to a temporary file and renames it.
void save_png(const std::string& path, const Image& image);
// PNG or BMP by the path's extension. (No JPEG: stb_image_write's JPEG encoder has undefined
// behaviour, a left shift of negative values, under -fsanitize=undefined.)
void save_image(const std::string& path, const Image& image);

}  // namespace unetcu
