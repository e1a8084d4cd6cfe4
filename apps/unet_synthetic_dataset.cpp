// unet_synthetic_dataset: writes the embedded synthetic set as an image folder
// (DIR/images/NNNNN.png + DIR/masks/NNNNN.png), the layout unet_train --data reads.
#include <CLI/CLI.hpp>

#include <iostream>

#include "cli/parse.h"
#include "data/dataset.h"

int main(int argc, char** argv) {
  std::string dir;
  int count = 64, width = 0, height = 128, classes = 1, channels = 3, bit_depth = 8;
  std::string size_text;
  uint64_t seed = 0;
  CLI::App app{"unet_synthetic_dataset: the synthetic set as PNG files, to show the folder format"};
  app.add_option("dir", dir, "Output folder")->required();
  app.add_option("--count", count, "Number of image/mask pairs")->capture_default_str();
  app.add_option("--image-size,--size", size_text, "Image size S or WxH (multiples of 32)")->default_str("128");
  app.add_option("--classes", classes,
                 "1: binary masks (0/255); 2..4: the class index per pixel (background 0, a kind of shape each)")
      ->capture_default_str();
  app.add_option("--channels", channels,
                 "Image channels: 3 (RGB), 1 (gray: the mean of R, G, B) or 4 (RGB + that gray level, RGBA)")
      ->capture_default_str();
  app.add_option("--bit-depth", bit_depth, "8, or 16 (gray images, --channels 1: 16-bit PNGs)")->capture_default_str();
  app.add_option("--seed", seed, "Seed")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    UNETCU_CHECK(count >= 1, "--count must be at least 1");
    if (!size_text.empty()) unetcu::cli::parse_size(size_text, &width, &height);
    unetcu::write_synthetic_folder(dir, count, width ? width : height, height, seed, classes, channels, bit_depth);
    std::cout << "wrote " << count << " pairs to " << dir << "/images and " << dir << "/masks\n";
  } catch (const std::exception& e) {
    std::cerr << "unet_synthetic_dataset: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
