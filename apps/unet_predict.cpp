// unet_predict: a checkpoint and images (files or folders) in, mask PNGs out (sigmoid >
// threshold, at each image's own size), optionally an overlay of the mask on the image, and
// IoU/Dice when ground-truth masks are given. The images go through the network in batches, in
// the precision and memory format asked for, optionally with test-time flips
// (train/inference.h).
//
// Every input is checked from its header (a regular file, within the pixel limit, the size of
// its ground-truth mask) before the model is loaded or anything is written; each output is
// written to a temporary name and renamed. Should decoding or writing still fail part way, the
// error says which masks were already written: those of the batches before the failing one (a
// batch's images are all decoded before its masks are written).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>

#include "kernels/cpu/cpu_select.h"
#include "cli/cli.h"
#include "apps/train_config.h"
#include "engine/checkpoint.h"
#include "data/dataset.h"
#include "data/image_io.h"
#include "models/unet.h"
#include "train/inference.h"

using namespace unetcu;
namespace fs = std::filesystem;

int main(int argc, char** argv) {
  unetcu::kernels::cpu::select_gemm_kernels(argv);  // first: it may run the program again
  std::string checkpoint, out_dir = "predictions", gt_dir, device_s = "auto";
  std::vector<std::string> inputs;
  int size = 512, width_divisor = 1, batch_size = 1;
  Precision precision = Precision::Auto;
  FormatChoice memory_format = FormatChoice::Auto;
  Tta tta = Tta::None;
  int64_t max_pixels = kDefaultMaxImagePixels;
  double threshold = 0.5;
  bool overlay = false;
  bool save_probabilities = false;
  CLI::App app{"unet_predict: segment images with a trained UNet-ResNet34 checkpoint"};
  app.add_option("inputs", inputs, "Image files or folders (PNG/JPEG/BMP)")->required();
  app.add_option("--checkpoint", checkpoint, "Model file written by unet_train --checkpoint (safetensors)")->required();
  app.add_option("--out", out_dir, "Folder for <stem>.png masks (0/255), overlays and probabilities")->capture_default_str();
  app.add_option("--image-size", size, "Size the model sees (multiple of 32); masks come back at each image's size")->capture_default_str();
  app.add_option("--width-divisor", width_divisor, "The checkpoint's model width divisor")->capture_default_str();
  app.add_option("--threshold", threshold,
                 "Foreground where the probability sigmoid(logit) > this (0 < T < 1); a lower T "
                 "marks more pixels, a higher fewer")
      ->capture_default_str();
  app.add_flag("--save-probabilities", save_probabilities,
               "Also write <stem>_prob.png: the foreground probability of every pixel as a 16-bit "
               "grayscale PNG (0..65535 for 0..1), at the image's own size, for choosing "
               "thresholds or averaging models without running them again");
  app.add_flag("--overlay", overlay, "Also write <stem>_overlay.png: the mask in red over the image");
  app.add_option("--masks", gt_dir, "Ground-truth masks (matched by file stem): report IoU and Dice");
  app.add_option("--device", device_s, "auto, cpu, cpu:N or cuda:N")->capture_default_str();
  app.add_option("--batch-size", batch_size,
                 "Images per forward pass (1..4096): more is faster on a GPU and takes more memory; "
                 "the masks do not depend on it (up to float rounding at the threshold)")
      ->capture_default_str();
  cli::add_enum(app, "--precision", precision, kPrecisionNames,
                "Arithmetic, as unet_train's: auto (tf32 on GPUs, fp32 on the CPU), fp32, tf32 (GPUs), "
                "bf16 (activations in bfloat16, computed in float32; faster on GPUs and AVX-512 "
                "bf16 CPUs, logits close to fp32's)");
  cli::add_enum(app, "--memory-format", memory_format, kFormatNames,
                "Memory order of the activations, as unet_train's: nchw, nhwc (channels-last) or auto (nchw)");
  cli::add_enum(app, "--tta", tta, kTtaNames,
                "Test-time augmentation: none, hflip (the mean of the logits of the image and of its "
                "left-right mirror, mirrored back: 2 passes) or flips (left-right, top-bottom and both "
                "as well: 4 passes)");
  app.add_option("--max-image-pixels", max_pixels,
                 "Refuse images (and masks) of more pixels than this, from their header, before decoding")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::vector<std::string> written;  // masks written so far, for the error message
  size_t overlays_written = 0, total = 0;
  try {
    UNETCU_CHECK(size >= 32 && size % 32 == 0 && size <= kMaxImageSize,
                 "--image-size must be a multiple of 32 in 32..", kMaxImageSize, ", got ", size);
    UNETCU_CHECK(threshold > 0 && threshold < 1, "--threshold must be between 0 and 1");
    UNETCU_CHECK(max_pixels >= 1, "--max-image-pixels must be at least 1");
    UNETCU_CHECK(batch_size >= 1 && batch_size <= kMaxBatch, "--batch-size must be in 1..", kMaxBatch, ", got ",
                 batch_size);
    set_max_image_pixels(max_pixels);
    std::string note;
    const Device device = resolve_device(device_s, &note);
    apply_precision(precision, /*tf32=*/true, device);
    check_regular_file(checkpoint, "checkpoint");  // a FIFO would block the reader
    auto is_image_name = [](const fs::path& p) {
      std::string ext = p.extension().string();
      std::transform(ext.begin(), ext.end(), ext.begin(), ::tolower);
      return ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".bmp";
    };
    std::vector<fs::path> files;
    for (const auto& in : inputs) {
      if (fs::is_directory(in)) {
        for (const auto& e : fs::directory_iterator(in))  // as image folders are scanned: files only
          if (e.is_regular_file() && is_image_name(e.path())) files.push_back(e.path());
      } else {
        check_regular_file(in, "image");
        files.push_back(in);
      }
    }
    UNETCU_CHECK(!files.empty(), "no images found in the inputs");
    std::sort(files.begin(), files.end());
    // One output per stem, and never over an input.
    std::sort(files.begin(), files.end(), [](const fs::path& a, const fs::path& b) { return a.stem() < b.stem(); });
    for (size_t i = 1; i < files.size(); ++i)
      UNETCU_CHECK(files[i].stem() != files[i - 1].stem(), "two inputs share the name '",
                   files[i].stem().string(), "' (", files[i - 1].string(), ", ", files[i].string(),
                   "): their masks would overwrite each other");
    const fs::path out_abs = fs::weakly_canonical(out_dir);
    for (const auto& f : files)
      UNETCU_CHECK(fs::weakly_canonical(f).parent_path() != out_abs, "--out ", out_dir,
                   " holds the input images: masks would overwrite them");
    // Ground truth by stem; a stem found twice is an error only for an image that needs it.
    std::map<std::string, fs::path> truth_of;
    std::set<std::string> truth_twice;
    if (!gt_dir.empty()) {
      UNETCU_CHECK(fs::is_directory(gt_dir), "--masks '", gt_dir, "' is not a folder");
      for (const auto& e : fs::directory_iterator(gt_dir))
        if (e.is_regular_file() && is_image_name(e.path()))
          if (!truth_of.emplace(e.path().stem().string(), e.path()).second) truth_twice.insert(e.path().stem().string());
    }
    // Every input from its header before any output: the pixel limit, and the ground truth's
    // size before it is decoded.
    std::vector<fs::path> truths(files.size());
    for (size_t i = 0; i < files.size(); ++i) {
      const ImageInfo info = read_image_info(files[i].string());
      if (gt_dir.empty()) continue;
      const std::string stem = files[i].stem().string();
      UNETCU_CHECK(!truth_twice.count(stem), "two ground-truth masks named '", stem, "' in ", gt_dir);
      auto it = truth_of.find(stem);
      UNETCU_CHECK(it != truth_of.end(), "no ground-truth mask for '", files[i].string(), "' in ", gt_dir);
      truths[i] = it->second;
      const ImageInfo g = read_image_info(truths[i].string());
      UNETCU_CHECK(g.width == info.width && g.height == info.height, "mask '", truths[i].string(), "' is ",
                   g.width, "x", g.height, " but its image '", files[i].string(), "' is ", info.width, "x",
                   info.height);
    }
    UNetConfig cfg;
    cfg.width_divisor = width_divisor;
    cfg.device = device;
    cfg.bf16_activations = precision == Precision::BF16;
    cfg.format = memory_format_of(memory_format);
    UNet model(cfg);
    load_model_state(model, read_safetensors(checkpoint), checkpoint);
    model.eval();
    fs::create_directories(out_dir);
    total = files.size();
    const double logit_threshold = std::log(threshold / (1 - threshold));
    int64_t tp = 0, fp = 0, fn = 0;
    const size_t plane = size_t(size) * size;
    double network_seconds = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t first = 0; first < files.size(); first += size_t(batch_size)) {
      // A batch: every image decoded and made into the network's input, then one forward pass
      // (per augmentation) for all of them, then each image's outputs.
      const size_t count = std::min(size_t(batch_size), files.size() - first);
      std::vector<Image> images;
      Tensor x = Tensor::empty({int64_t(count), 3, size, size});
      for (size_t k = 0; k < count; ++k) {
        images.push_back(load_image(files[first + k].string(), 3));
        prepare_input(images.back(), size, x.data<float>() + k * 3 * plane);
      }
      const auto n0 = std::chrono::steady_clock::now();
      const Tensor batch_logits = predict_logits(model, x, tta);
      UNETCU_CHECK(batch_logits.dim(1) == 1, "prediction writes one mask per image; the model has ",
                   batch_logits.dim(1), " classes");
      network_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - n0).count();
      for (size_t k = 0; k < count; ++k) {
        const size_t i = first + k;
        const fs::path& f = files[i];
        const Image& img = images[k];
        // Back to the image's own size, nearest.
        Image mask{img.width, img.height, 1, std::vector<uint8_t>(size_t(img.width) * img.height)};
        std::vector<uint16_t> prob(save_probabilities ? mask.pixels.size() : 0);
        const float* l = batch_logits.data<float>() + k * plane;
        for (int y = 0; y < img.height; ++y)
          for (int xx = 0; xx < img.width; ++xx) {
            const int sy = std::min(size - 1, int((y + 0.5) * size / img.height));
            const int sx = std::min(size - 1, int((xx + 0.5) * size / img.width));
            const float logit = l[size_t(sy) * size + sx];
            mask.pixels[size_t(y) * img.width + xx] = logit > logit_threshold ? 255 : 0;
            if (save_probabilities)
              prob[size_t(y) * img.width + xx] =
                  uint16_t(std::lround(65535.0 / (1.0 + std::exp(-double(logit)))));
          }
        const std::string stem = f.stem().string();
        // The ground truth is decoded before anything of this image is written.
        const Image g = gt_dir.empty() ? Image{} : load_image(truths[i].string(), 1);
        save_png((fs::path(out_dir) / (stem + ".png")).string(), mask);
        written.push_back(stem + ".png");
        if (save_probabilities) {
          save_png16((fs::path(out_dir) / (stem + "_prob.png")).string(), img.width, img.height, prob);
        }
        if (overlay) {
          Image o = img;
          for (size_t q = 0; q < mask.pixels.size(); ++q)
            if (mask.pixels[q]) {
              o.pixels[q * 3] = uint8_t(std::min(255, o.pixels[q * 3] / 2 + 128));
              o.pixels[q * 3 + 1] /= 2;
              o.pixels[q * 3 + 2] /= 2;
            }
          save_png((fs::path(out_dir) / (stem + "_overlay.png")).string(), o);
          ++overlays_written;
        }
        std::string line = f.string() + " -> " + (fs::path(out_dir) / (stem + ".png")).string();
        if (!gt_dir.empty()) {
          int64_t t = 0, p2 = 0, n2 = 0;
          for (size_t q = 0; q < g.pixels.size(); ++q) {
            const bool truth = g.pixels[q] > 0, pred = mask.pixels[q] > 0;
            t += truth && pred, p2 += pred && !truth, n2 += truth && !pred;
          }
          tp += t, fp += p2, fn += n2;
          char buf[64];
          std::snprintf(buf, sizeof buf, "  IoU %.4f", t + p2 + n2 ? double(t) / double(t + p2 + n2) : 1.0);
          line += buf;
        }
        std::cout << line << "\n";
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const char* arithmetic = precision == Precision::BF16                          ? "bf16"
                             : device.is_cuda() && precision != Precision::FP32 ? "tf32"
                                                                                : "fp32";
    std::printf("%zu images in %.2f s (%.1f images/s; the network alone %.1f images/s), batch %d, %s %s, tta %s, %s\n",
                files.size(), seconds, double(files.size()) / seconds, double(files.size()) / network_seconds,
                batch_size, arithmetic, format_name(cfg.format), name_of(kTtaNames, tta), device.str().c_str());
    if (!gt_dir.empty()) {
      const int64_t d = tp + fp + fn;
      std::printf("all %zu images: IoU %.4f  Dice %.4f\n", files.size(), d ? double(tp) / d : 1.0,
                  2 * tp + fp + fn ? 2.0 * tp / double(2 * tp + fp + fn) : 1.0);
    }
  } catch (const std::exception& e) {
    std::cerr << "unet_predict: error: " << e.what() << "\n";
    if (!written.empty()) {  // one line: how many, where, and the first few names
      std::string names;
      for (size_t i = 0; i < written.size() && i < 5; ++i) names += (i ? ", " : "") + written[i];
      if (written.size() > 5) names += ", ... (" + std::to_string(written.size() - 5) + " more)";
      std::cerr << "unet_predict: " << written.size() << " of " << total << " masks"
                << (overlays_written ? " (and " + std::to_string(overlays_written) + " overlays)" : "")
                << " were written to " << out_dir << " before the error: " << names << "\n";
    }
    return 1;
  }
  return 0;
}
