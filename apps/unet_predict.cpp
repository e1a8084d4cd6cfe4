// unet_predict: a checkpoint and images (files or folders) in, mask PNGs out at each image's
// own size (one class: sigmoid > threshold, 0/255; several: the class index per pixel),
// optionally an overlay of the mask on the image, probabilities, and IoU/Dice (mIoU and per
// class IoU) when ground-truth masks are given. The images go through the network in batches
// (or, with --tile, each image in overlapping tiles, batches of tiles), in the precision and
// memory format asked for, optionally with test-time flips (train/inference.h). How the model
// was trained (classes, width divisor, training size or crop, ignore index, class colours)
// comes from the checkpoint's settings (engine/checkpoint.h).
//
// Every input is checked from its header (a regular file, within the pixel limit, the size of
// its ground-truth mask) before the model is loaded or anything is written; each output is
// written to a temporary name and renamed. Should decoding or writing still fail part way, the
// error says which masks were already written: those of the batches before the failing one (a
// batch's images are all decoded before its masks are written).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "kernels/cpu/cpu_select.h"
#include "cli/cli.h"
#include "apps/train_config.h"
#include "engine/checkpoint.h"
#include "data/dataset.h"
#include "data/image_io.h"
#include "data/labels.h"
#include "models/unet.h"
#include "train/inference.h"

using namespace unetcu;
namespace fs = std::filesystem;

namespace {

// A fixed palette for classes without colours (class 0, the background, is left as it is).
std::array<uint8_t, 3> default_color(int c) {
  static const std::array<uint8_t, 3> base[] = {{0, 0, 0},     {230, 25, 75},  {60, 180, 75},  {0, 130, 200},
                                                {255, 225, 25}, {145, 30, 180}, {70, 240, 240}, {245, 130, 48},
                                                {240, 50, 230}, {210, 245, 60}, {0, 128, 128},  {170, 110, 40}};
  if (c < 12) return base[c];
  const uint32_t h = uint32_t(c) * 2654435761u;
  return {uint8_t(h >> 24), uint8_t(h >> 16), uint8_t(h >> 8)};
}

// A 8-bit RGB image as the network's normalised input at its own size, [1, 3, H, W].
Tensor normalised(const Image& img) {
  Tensor t = Tensor::empty({1, 3, img.height, img.width});
  float* o = t.data<float>();
  const size_t plane = size_t(img.width) * img.height;
  for (int c = 0; c < 3; ++c)
    for (size_t q = 0; q < plane; ++q)
      o[c * plane + q] = (img.pixels[q * 3 + size_t(c)] / 255.f - kImageMean[c]) / kImageStd[c];
  return t;
}

int setting(const CheckpointSettings& s, const char* key, int fallback, const std::string& file) {
  auto it = s.find(key);
  if (it == s.end()) return fallback;
  try {
    size_t used = 0;
    const int v = std::stoi(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (...) {
  }
  throw Error(str_cat("checkpoint '", file, "' records ", key, " '", it->second, "', not a number"));
}

}  // namespace

int main(int argc, char** argv) {
  unetcu::kernels::cpu::select_gemm_kernels(argv);  // first: it may run the program again
  std::string checkpoint, out_dir = "predictions", gt_dir, device_s = "auto";
  std::vector<std::string> inputs;
  int size = 512, width_divisor = 1, batch_size = 1, tile = 0;
  double overlap = 0.5;
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
  std::string size_text;
  auto* size_opt = app.add_option("--image-size", size_text,
                                  "Size the model sees (multiple of 32; default: the checkpoint's training size, "
                                  "else 512; S or WxH); masks come back at each image's size");
  auto* divisor_opt = app.add_option("--width-divisor", width_divisor,
                                     "The model width divisor (default: the checkpoint's; another is an error)");
  auto* tile_opt = app.add_option("--tile", tile,
                                  "Predict each image at its own size in overlapping S x S tiles (a multiple of 32; "
                                  "default: the checkpoint's --crop-size when it was trained on crops, else off), "
                                  "their probabilities added with a Gaussian weight as nnU-Net does; --batch-size "
                                  "tiles at a time bound the memory");
  app.add_option("--overlap", overlap, "--tile: the share of a tile its neighbours overlap (0..0.95)")
      ->capture_default_str();
  app.add_option("--threshold", threshold,
                 "Foreground where the probability sigmoid(logit) > this (0 < T < 1); a lower T "
                 "marks more pixels, a higher fewer")
      ->capture_default_str();
  app.add_flag("--save-probabilities", save_probabilities,
               "Also write <stem>_prob.png: the foreground probability of every pixel as a 16-bit "
               "grayscale PNG (0..65535 for 0..1), at the image's own size, for choosing "
               "thresholds or averaging models without running them again (several classes: "
               "<stem>_prob_<class>.png, one per class)");
  app.add_flag("--overlay", overlay,
               "Also write <stem>_overlay.png: the mask in red over the image (several classes: each class "
               "but 0 in its colour, the checkpoint's class colours or a fixed palette)");
  app.add_option("--masks", gt_dir,
                 "Ground-truth masks (matched by file stem, read as the training read them): report IoU and "
                 "Dice (several classes: mIoU and each class's IoU)");
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
    check_regular_file(checkpoint, "checkpoint");  // a FIFO would block the reader
    // How the model was trained; flags may choose the size the model sees and the tiles.
    const CheckpointSettings settings = read_checkpoint_settings(checkpoint);
    const int classes = setting(settings, "classes", 1, checkpoint);
    UNETCU_CHECK(classes >= 1 && classes <= 256, "checkpoint '", checkpoint, "' records ", classes, " classes");
    const int trained_divisor = setting(settings, "width_divisor", 1, checkpoint);
    if (divisor_opt->count() == 0) width_divisor = trained_divisor;
    UNETCU_CHECK(!settings.count("width_divisor") || width_divisor == trained_divisor, "--width-divisor ",
                 width_divisor, " contradicts the checkpoint '", checkpoint, "', trained with ", trained_divisor);
    int size_w = 0;
    if (size_opt->count() > 0)
      cli::parse_size(size_text, &size_w, &size);
    else if (settings.count("image_size"))
      cli::parse_size(settings.at("image_size"), &size_w, &size);
    if (size_w == 0) size_w = size;
    if (tile_opt->count() == 0) tile = setting(settings, "crop_size", 0, checkpoint);
    LabelRule labels;
    labels.classes = classes;
    UNETCU_CHECK(trained_divisor >= 1 && trained_divisor <= 64, "checkpoint '", checkpoint, "' records width_divisor ",
                 trained_divisor, ", outside 1..64");
    if (settings.count("ignore_index") && settings.at("ignore_index") != "none") {
      labels.ignore_index = setting(settings, "ignore_index", -1, checkpoint);
      UNETCU_CHECK(labels.ignore_index >= 0 && labels.ignore_index <= 255, "checkpoint '", checkpoint,
                   "' records ignore_index ", labels.ignore_index, ", outside 0..255");
    }
    // The class colours (one per class) and the ignored pixels' colours.
    const std::string what = "checkpoint '" + checkpoint + "'";
    if (settings.count("class_colors")) labels.colors = colors_from_text(settings.at("class_colors"), what);
    if (settings.count("ignore_colors")) labels.ignored = colors_from_text(settings.at("ignore_colors"), what);
    UNETCU_CHECK(labels.colors.empty() || int(labels.colors.size()) == classes, "checkpoint '", checkpoint,
                 "' records ", labels.colors.size(), " class colours for ", classes, " classes");
    std::vector<std::array<uint8_t, 3>> colors;
    for (const ClassColor& k : labels.colors) colors.push_back({k.r, k.g, k.b});
    std::vector<std::string> names;
    if (settings.count("class_names")) {
      std::stringstream ss(settings.at("class_names"));
      for (std::string item; std::getline(ss, item, ',');) names.push_back(item);
    }
    while (int(names.size()) < classes) names.push_back(std::to_string(names.size()));
    for (int side : {size, size_w})
      UNETCU_CHECK(side >= 32 && side % 32 == 0 && side <= kMaxImageSize,
                   "--image-size must be a multiple of 32 in 32..", kMaxImageSize, ", got ", side);
    UNETCU_CHECK(tile == 0 || (tile >= 32 && tile % 32 == 0 && tile <= kMaxImageSize),
                 "--tile must be a multiple of 32 in 32..", kMaxImageSize, ", got ", tile);
    UNETCU_CHECK(overlap >= 0 && overlap <= 0.95, "--overlap must be in 0..0.95, got ", overlap);
    UNETCU_CHECK(threshold > 0 && threshold < 1, "--threshold must be between 0 and 1");
    UNETCU_CHECK(max_pixels >= 1, "--max-image-pixels must be at least 1");
    UNETCU_CHECK(batch_size >= 1 && batch_size <= kMaxBatch, "--batch-size must be in 1..", kMaxBatch, ", got ",
                 batch_size);
    set_max_image_pixels(max_pixels);
    std::string note;
    const Device device = resolve_device(device_s, &note);
    apply_precision(precision, /*tf32=*/true, device);
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
    cfg.classes = classes;
    cfg.device = device;
    cfg.bf16_activations = precision == Precision::BF16;
    cfg.format = memory_format_of(memory_format);
    UNet model(cfg);
    load_model_state(model, read_safetensors(checkpoint), checkpoint);
    model.eval();
    fs::create_directories(out_dir);
    total = files.size();
    const double logit_threshold = std::log(threshold / (1 - threshold));
    const int K = std::max(2, classes);  // one class: background and foreground
    std::vector<double> confusion(size_t(K) * size_t(K), 0.0);
    const size_t plane = size_t(size) * size_t(size_w);
    double network_seconds = 0;
    const auto t0 = std::chrono::steady_clock::now();
    // Tiled: one image at a time, --batch-size tiles per forward pass.
    const size_t per_batch = tile ? 1 : size_t(batch_size);
    for (size_t first = 0; first < files.size(); first += per_batch) {
      // A batch: every image decoded and made into the network's input, then one forward pass
      // (per augmentation) for all of them, then each image's outputs.
      const size_t count = std::min(per_batch, files.size() - first);
      std::vector<Image> images;
      Tensor batch_logits, probs;
      const auto forward = [&](const Tensor& t) { return predict_logits(model, t, tta); };
      if (tile) {
        images.push_back(load_image(files[first].string(), 3));
        const auto n0 = std::chrono::steady_clock::now();
        probs = predict_tiled(normalised(images.back()), tile, overlap, batch_size, forward);
        network_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - n0).count();
      } else {
        Tensor x = Tensor::empty({int64_t(count), 3, size, size_w});
        for (size_t k = 0; k < count; ++k) {
          images.push_back(load_image(files[first + k].string(), 3));
          prepare_input(images.back(), size_w, size, x.data<float>() + k * 3 * plane);
        }
        const auto n0 = std::chrono::steady_clock::now();
        batch_logits = forward(x);
        network_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - n0).count();
      }
      for (size_t k = 0; k < count; ++k) {
        const size_t i = first + k;
        const fs::path& f = files[i];
        const Image& img = images[k];
        const size_t n = size_t(img.width) * img.height;
        // Each pixel's class and (for --save-probabilities) each class's probability, at the
        // image's own size: from the tiles' blended probabilities, or from the logits at the
        // model's size, nearest.
        Image mask{img.width, img.height, 1, std::vector<uint8_t>(n)};
        std::vector<std::vector<uint16_t>> prob(save_probabilities ? size_t(classes) : 0, std::vector<uint16_t>(n));
        std::vector<float> p(static_cast<size_t>(classes));
        const float* l = tile ? nullptr : batch_logits.data<float>() + k * size_t(classes) * plane;
        for (int y = 0; y < img.height; ++y)
          for (int xx = 0; xx < img.width; ++xx) {
            const size_t q = size_t(y) * img.width + xx;
            int cls = 0;
            if (tile) {
              for (int c = 0; c < classes; ++c) p[size_t(c)] = probs.data<float>()[size_t(c) * n + q];
              if (classes == 1)
                cls = p[0] > threshold;
              else
                cls = int(std::max_element(p.begin(), p.end()) - p.begin());
              for (size_t c = 0; c < prob.size(); ++c) prob[c][q] = uint16_t(std::lround(65535.0 * p[c]));
            } else {
              const int sy = std::min(size - 1, int((y + 0.5) * size / img.height));
              const int sx = std::min(size_w - 1, int((xx + 0.5) * size_w / img.width));
              const float* at = l + size_t(sy) * size_w + sx;
              if (classes == 1) {
                cls = at[0] > logit_threshold;
                if (save_probabilities) prob[0][q] = uint16_t(std::lround(65535.0 / (1.0 + std::exp(-double(at[0])))));
              } else {
                double mx = at[0], z = 0;
                for (int c = 1; c < classes; ++c)
                  if (at[size_t(c) * plane] > mx) mx = at[size_t(c) * plane], cls = c;
                if (save_probabilities) {
                  for (int c = 0; c < classes; ++c) z += std::exp(at[size_t(c) * plane] - mx);
                  for (int c = 0; c < classes; ++c)
                    prob[size_t(c)][q] = uint16_t(std::lround(65535.0 * std::exp(at[size_t(c) * plane] - mx) / z));
                }
              }
            }
            mask.pixels[q] = classes == 1 ? (cls ? 255 : 0) : uint8_t(cls);
          }
        const std::string stem = f.stem().string();
        // The ground truth is read (as the training read masks) before anything of this image is written.
        std::vector<float> truth;
        if (!gt_dir.empty()) {
          int gw = 0, gh = 0;
          truth = load_mask_targets(truths[i].string(), labels, &gw, &gh);
        }
        save_png((fs::path(out_dir) / (stem + ".png")).string(), mask);
        written.push_back(stem + ".png");
        if (save_probabilities) {
          if (classes == 1)
            save_png16((fs::path(out_dir) / (stem + "_prob.png")).string(), img.width, img.height, prob[0]);
          else
            for (int c = 0; c < classes; ++c)
              save_png16((fs::path(out_dir) / (stem + "_prob_" + std::to_string(c) + ".png")).string(), img.width,
                         img.height, prob[size_t(c)]);
        }
        if (overlay) {
          Image o = img;
          for (size_t q = 0; q < n; ++q) {
            if (classes == 1) {
              if (mask.pixels[q]) {
                o.pixels[q * 3] = uint8_t(std::min(255, o.pixels[q * 3] / 2 + 128));
                o.pixels[q * 3 + 1] /= 2;
                o.pixels[q * 3 + 2] /= 2;
              }
            } else if (mask.pixels[q]) {  // each class but the background in its colour, half and half
              const int c = mask.pixels[q];
              const std::array<uint8_t, 3> col = size_t(c) < colors.size() ? colors[size_t(c)] : default_color(c);
              for (int j = 0; j < 3; ++j) o.pixels[q * 3 + size_t(j)] = uint8_t((o.pixels[q * 3 + size_t(j)] + col[size_t(j)]) / 2);
            }
          }
          save_png((fs::path(out_dir) / (stem + "_overlay.png")).string(), o);
          ++overlays_written;
        }
        std::string line = f.string() + " -> " + (fs::path(out_dir) / (stem + ".png")).string();
        if (!gt_dir.empty()) {
          std::vector<double> m(size_t(K) * size_t(K), 0.0);
          for (size_t q = 0; q < n; ++q)
            if (truth[q] >= 0) m[size_t(truth[q]) * size_t(K) + (classes == 1 ? mask.pixels[q] > 0 : mask.pixels[q])] += 1;
          for (size_t j = 0; j < m.size(); ++j) confusion[j] += m[j];
          auto iou = [&](const std::vector<double>& mm, int c, bool* seen) {
            double row = 0, col = 0;
            for (int j = 0; j < K; ++j) row += mm[size_t(c * K + j)], col += mm[size_t(j * K + c)];
            const double tp = mm[size_t(c * K + c)], uni = row + col - tp;
            if (seen) *seen = uni > 0;
            return uni > 0 ? tp / uni : 1.0;
          };
          char buf[64];
          if (classes == 1) {
            std::snprintf(buf, sizeof buf, "  IoU %.4f", iou(m, 1, nullptr));
          } else {
            double sum = 0;
            int seen_n = 0;
            for (int c = 0; c < K; ++c) {
              bool seen = false;
              const double v = iou(m, c, &seen);
              if (seen) sum += v, ++seen_n;
            }
            std::snprintf(buf, sizeof buf, "  mIoU %.4f", seen_n ? sum / seen_n : 1.0);
          }
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
    if (tile) std::printf("tiles of %dx%d, overlap %.2f, Gaussian-weighted\n", tile, tile, overlap);
    if (!gt_dir.empty()) {
      const double tp = confusion[size_t(K + 1)], fp = confusion[1], fn = confusion[size_t(K)];
      if (classes == 1) {
        const double d = tp + fp + fn;
        std::printf("all %zu images: IoU %.4f  Dice %.4f\n", files.size(), d ? tp / d : 1.0,
                    2 * tp + fp + fn ? 2.0 * tp / (2 * tp + fp + fn) : 1.0);
      } else {
        double sum = 0;
        int seen_n = 0;
        std::string per;
        for (int c = 0; c < K; ++c) {
          double row = 0, col = 0;
          for (int j = 0; j < K; ++j) row += confusion[size_t(c * K + j)], col += confusion[size_t(j * K + c)];
          const double t = confusion[size_t(c * K + c)], uni = row + col - t;
          char buf[96];
          std::snprintf(buf, sizeof buf, "%s%s %.4f", c ? ", " : "", names[size_t(c)].c_str(), uni > 0 ? t / uni : 1.0);
          per += uni > 0 ? buf : str_cat(c ? ", " : "", names[size_t(c)], " -");
          if (uni > 0) sum += t / uni, ++seen_n;
        }
        std::printf("all %zu images: mIoU %.4f (over the classes present); IoU per class: %s\n", files.size(),
                    seen_n ? sum / seen_n : 1.0, per.c_str());
      }
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
