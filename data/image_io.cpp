#include "data/image_io.h"

#include <cctype>
#include <cstdio>

#include "runtime/common.h"

#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_ONLY_BMP
#include <stb_image.h>
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb_image_write.h>

namespace unetcu {

Image load_image(const std::string& path, int channels) {
  UNETCU_CHECK(channels == 1 || channels == 3, "load_image: 1 or 3 channels");
  int w = 0, h = 0, stored = 0;
  unsigned char* data = stbi_load(path.c_str(), &w, &h, &stored, channels);
  if (!data) throw Error("cannot read image '" + path + "': " + stbi_failure_reason());
  Image img;
  img.width = w, img.height = h, img.channels = channels;
  img.pixels.assign(data, data + size_t(w) * h * channels);
  stbi_image_free(data);
  return img;
}

void save_png(const std::string& path, const Image& image) {
  const std::string tmp = path + ".tmp.png";
  if (!stbi_write_png(tmp.c_str(), image.width, image.height, image.channels, image.pixels.data(),
                      image.width * image.channels)) {
    std::remove(tmp.c_str());
    throw Error("cannot write '" + path + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("cannot write '" + path + "'");
  }
}

void save_image(const std::string& path, const Image& image) {
  const auto dot = path.rfind('.');
  std::string ext = dot == std::string::npos ? "" : path.substr(dot + 1);
  for (char& c : ext) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (ext == "png") return save_png(path, image);
  if (ext != "bmp") throw Error("cannot write '" + path + "': PNG or BMP only (by the extension)");
  if (!stbi_write_bmp(path.c_str(), image.width, image.height, image.channels, image.pixels.data()))
    throw Error("cannot write '" + path + "'");
}

}  // namespace unetcu
