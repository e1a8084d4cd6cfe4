// Loader throughput: PNG decode + resize + augmentation + normalisation of an image folder,
// with 1..N loader threads, against what one CPU training step consumes.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "cli/cli.h"
#include "data/dataset.h"
#include "data/loader.h"

using namespace unetcu;

int main(int argc, char** argv) {
  int size = 512, count = 32, batch = 4, epochs = 2;
  std::string threads_s = "1,2";
  Augment aug = Augment::Heavy;
  CLI::App app{"bench_loader: images/s of the batch loader on an image folder"};
  app.add_option("--image-size", size, "Image size (files and training)")->capture_default_str();
  app.add_option("--count", count, "Images in the folder")->capture_default_str();
  app.add_option("--batch-size", batch, "Batch size")->capture_default_str();
  cli::add_enum(app, "--augment", aug, kAugmentNames, "Augmentation");
  app.add_option("--workers", threads_s, "Loader thread counts to try")->capture_default_str();
  app.add_option("--epochs", epochs, "Passes over the folder per measurement")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const auto dir = std::filesystem::temp_directory_path() / "unetcu_bench_loader";
    write_synthetic_folder(dir.string(), count, size, 3);
    FolderDataset ds(FolderDataset::scan(dir.string()), size);
    std::printf("| workers | images | seconds | img/s |\n|---|---|---|---|\n");
    std::stringstream ss(threads_s);
    for (std::string item; std::getline(ss, item, ',');) {
      const int workers = std::stoi(item);
      const int64_t steps = int64_t(count / batch) * epochs;
      const auto t0 = std::chrono::steady_clock::now();
      {
        BatchLoader loader(steps, [&](int64_t s) {
          std::vector<int64_t> idx;
          for (int i = 0; i < batch; ++i) idx.push_back((s * batch + i) % count);
          return make_batch(ds, idx, DType::F32, false, aug, 1, int(s));
        }, workers, 4);
        for (int64_t s = 0; s < steps; ++s) loader.next();
      }
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("| %d | %lld | %.2f | %.1f |\n", workers, (long long)(steps * batch), sec, steps * batch / sec);
    }
    std::filesystem::remove_all(dir);
  } catch (const std::exception& e) {
    std::cerr << "bench_loader: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
