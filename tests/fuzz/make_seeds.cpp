// Writes the valid seed inputs of every fuzz target as OUTDIR/<target>/seed_*: tools/fuzz.sh
// starts each fuzzer from them, fresh for the current model, and `tools/fuzz.sh --update-seeds`
// refreshes the committed ones in tests/corpus/. Checkpoints come from the project's own writer
// (save_checkpoint); images from a private copy of stb_image_write (the system's header), so
// the seeds do not depend on which formats save_image writes. Each seed is run through its
// target before it is kept: a seed must load.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "tests/fuzz/targets.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#include <stb_image_write.h>

UNETCU_FUZZ_UBSAN_DEFAULTS

namespace {

using namespace unetcu;
using Files = std::map<std::string, std::vector<uint8_t>>;

Files checkpoint_seeds(const std::string& dir) {
  UNet model(fuzz::fuzz_model_config());
  Adam adam(model.parameters());
  const std::string path = dir + "/model.safetensors";
  save_checkpoint(path, model, {&adam}, 1);
  return {{"safetensors/seed_unet_w64.safetensors", fuzz::read_bytes(path)},
          {"train/seed_unet_w64_adam.train", fuzz::read_bytes(path + ".train")}};
}

// A small pattern with edges and a gradient, RGB and gray, as PNG, BMP and baseline JPEG.
Files image_seeds(const std::string& dir) {
  Files out;
  const int w = 13, h = 9;
  for (int channels : {3, 1}) {
    std::vector<uint8_t> px;
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x)
        for (int c = 0; c < channels; ++c)
          px.push_back(uint8_t((x * 19 + y * 7 + c * 80) % 256 * ((x + y) % 3 != 0)));
    const std::string tag = channels == 3 ? "rgb" : "gray";
    for (const std::string ext : {"png", "bmp", "jpg"}) {
      if (channels == 1 && ext == "bmp") continue;  // stb writes every BMP as 24-bit
      const std::string file = dir + "/seed_" + tag + "." + ext;
      const int ok = ext == "png"   ? stbi_write_png(file.c_str(), w, h, channels, px.data(), w * channels)
                     : ext == "bmp" ? stbi_write_bmp(file.c_str(), w, h, channels, px.data())
                                    : stbi_write_jpg(file.c_str(), w, h, channels, px.data(), 90);
      if (!ok) throw std::runtime_error("cannot write " + file);
      out["image/seed_" + tag + "." + ext] = fuzz::read_bytes(file);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
    return 2;
  }
  try {
    const std::string scratch = fuzz::scratch_dir() + "/seeds";
    std::filesystem::create_directories(scratch);
    Files seeds = checkpoint_seeds(scratch);
    seeds.merge(image_seeds(scratch));
    for (const auto& [name, bytes] : seeds) {
      const std::string target = name.substr(0, name.find('/'));
      fuzz::targets().at(target)(bytes.data(), bytes.size());  // throws if it does not load
      const std::string file = std::string(argv[1]) + "/" + name;
      std::filesystem::create_directories(std::filesystem::path(file).parent_path());
      fuzz::write_bytes(file, bytes.data(), bytes.size());
      std::printf("%s (%zu bytes)\n", name.c_str(), bytes.size());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
