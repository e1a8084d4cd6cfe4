#include "train/predict_files.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "data/data_config.h"
#include "data/labels.h"
#include "data/synthetic.h"
#include "engine/checkpoint.h"
#include "models/unet.h"
#include "train/trainer.h"

namespace unetcu {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// printf into a string.
std::string format(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

// A fixed palette for classes without colours (class 0, the background, is left as it is).
std::array<uint8_t, 3> default_color(int c) {
  static const std::array<uint8_t, 3> base[] = {{0, 0, 0},     {230, 25, 75},  {60, 180, 75},  {0, 130, 200},
                                                {255, 225, 25}, {145, 30, 180}, {70, 240, 240}, {245, 130, 48},
                                                {240, 50, 230}, {210, 245, 60}, {0, 128, 128},  {170, 110, 40}};
  if (c < 12) return base[c];
  const uint32_t h = uint32_t(c) * 2654435761u;
  return {uint8_t(h >> 24), uint8_t(h >> 16), uint8_t(h >> 8)};
}

// An input image as the network's normalised input at its own size, [1, C, H, W].
Tensor normalised(const ImageValues& img, const Normalization& norm) {
  const int C = img.channels;
  Tensor t = Tensor::empty({1, C, img.height, img.width});
  float* o = t.data<float>();
  const size_t plane = size_t(img.width) * img.height;
  for (int c = 0; c < C; ++c)
    for (size_t q = 0; q < plane; ++q)
      o[c * plane + q] = (img.values[q * C + size_t(c)] / img.divisor - norm.mean[size_t(c)]) / norm.std[size_t(c)];
  return t;
}

// The 8-bit RGB picture the masks are drawn over: the image itself when it is one; else its
// first three channels, or its first repeated (gray), each scaled to 0..255.
Image picture_of(const ImageValues& v) {
  Image img;
  img.width = v.width, img.height = v.height, img.channels = 3;
  img.pixels.resize(size_t(v.width) * v.height * 3);
  const size_t plane = size_t(v.width) * v.height;
  for (size_t q = 0; q < plane; ++q)
    for (int c = 0; c < 3; ++c) {
      const float x = v.values[q * size_t(v.channels) + size_t(v.channels >= 3 ? c : 0)];
      img.pixels[q * 3 + size_t(c)] =
          v.divisor == 255.f ? uint8_t(x) : uint8_t(std::lround(std::clamp(x / v.divisor, 0.f, 1.f) * 255));
    }
  return img;
}

int recorded(const CheckpointSettings& s, const char* key, int fallback, const std::string& file) {
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

// The model and data as the checkpoint records them, with what the settings choose instead.
struct Trained {
  int classes = 1, width_divisor = 1, height = 512, width = 512, tile = 0;
  EncoderKind encoder = EncoderKind::ResNet34;
  Normalization normalization;  // its channels: the model's input channels
  LabelRule labels;
  std::vector<std::array<uint8_t, 3>> colors;  // the class colours, where recorded
  std::vector<std::string> names;              // one per class
};

Trained read_trained(const PredictConfig& c) {
  const std::string& file = c.checkpoint;
  check_regular_file(file, "checkpoint");  // a FIFO would block the reader
  const CheckpointSettings settings = read_checkpoint_settings(file);
  Trained t;
  t.classes = recorded(settings, "classes", 1, file);
  t.encoder = recorded_encoder(settings, file);
  const int channels = recorded(settings, "in_channels", 3, file);
  UNETCU_CHECK(channels >= 1 && channels <= 64, "checkpoint '", file, "' records in_channels ", channels);
  const std::string what = "checkpoint '" + file + "'";
  const Normalization::Kind kind =
      settings.count("normalization")
          ? parse_named(kNormalizationNames, "normalization", settings.at("normalization"))
          : Normalization::ImageNet;
  if (kind == Normalization::Dataset) {
    UNETCU_CHECK(settings.count("normalization_values"), what, " records normalization dataset without its values");
    t.normalization = normalization_from_values(kind, settings.at("normalization_values"), what);
  } else {
    t.normalization = kind == Normalization::None ? Normalization::none(channels) : Normalization{};
  }
  UNETCU_CHECK(t.normalization.channels() == channels, what, " records ", channels, " input channels and a ",
               "normalization of ", t.normalization.channels());
  UNETCU_CHECK(t.classes >= 1 && t.classes <= 256, "checkpoint '", file, "' records ", t.classes, " classes");
  const int trained_divisor = recorded(settings, "width_divisor", 1, file);
  t.width_divisor = c.width_divisor.value_or(trained_divisor);
  UNETCU_CHECK(!settings.count("width_divisor") || t.width_divisor == trained_divisor, setting("width_divisor"), " ",
               t.width_divisor, " contradicts the checkpoint '", file, "', trained with ", trained_divisor);
  int w = 0;
  if (c.image_size)
    parse_image_size(*c.image_size, &w, &t.height);
  else if (settings.count("image_size"))
    parse_image_size(settings.at("image_size"), &w, &t.height);
  t.width = w ? w : t.height;
  t.tile = c.tile ? *c.tile : recorded(settings, "crop_size", 0, file);
  t.labels.classes = t.classes;
  UNETCU_CHECK(trained_divisor >= 1 && trained_divisor <= 64, "checkpoint '", file, "' records width_divisor ",
               trained_divisor, ", outside 1..64");
  if (settings.count("ignore_index") && settings.at("ignore_index") != "none") {
    t.labels.ignore_index = recorded(settings, "ignore_index", -1, file);
    UNETCU_CHECK(t.labels.ignore_index >= 0 && t.labels.ignore_index <= 255, "checkpoint '", file,
                 "' records ignore_index ", t.labels.ignore_index, ", outside 0..255");
  }
  // The class colours (one per class) and the ignored pixels' colours.
  if (settings.count("class_colors")) t.labels.colors = colors_from_text(settings.at("class_colors"), what);
  if (settings.count("ignore_colors")) t.labels.ignored = colors_from_text(settings.at("ignore_colors"), what);
  UNETCU_CHECK(t.labels.colors.empty() || int(t.labels.colors.size()) == t.classes, "checkpoint '", file,
               "' records ", t.labels.colors.size(), " class colours for ", t.classes, " classes");
  for (const ClassColor& k : t.labels.colors) t.colors.push_back({k.r, k.g, k.b});
  if (settings.count("class_names")) {
    std::stringstream ss(settings.at("class_names"));
    for (std::string item; std::getline(ss, item, ',');) t.names.push_back(item);
  }
  while (int(t.names.size()) < t.classes) t.names.push_back(std::to_string(t.names.size()));
  return t;
}

void check(const PredictConfig& c, const Trained& t) {
  for (int side : {t.height, t.width})
    UNETCU_CHECK(side >= 32 && side % 32 == 0 && side <= kMaxImageSize, setting("image_size"),
                 " must be a multiple of 32 in 32..", kMaxImageSize, ", got ", side);
  UNETCU_CHECK(t.tile == 0 || (t.tile >= 32 && t.tile % 32 == 0 && t.tile <= kMaxImageSize), setting("tile"),
               " must be a multiple of 32 in 32..", kMaxImageSize, ", got ", t.tile);
  UNETCU_CHECK(c.overlap >= 0 && c.overlap <= 0.95, setting("overlap"), " must be in 0..0.95, got ", c.overlap);
  UNETCU_CHECK(c.threshold > 0 && c.threshold < 1, setting("threshold"), " must be between 0 and 1");
  UNETCU_CHECK(c.max_image_pixels >= 1, setting("max_image_pixels"), " must be at least 1");
  UNETCU_CHECK(c.batch_size >= 1 && c.batch_size <= kMaxBatch, setting("batch_size"), " must be in 1..", kMaxBatch,
               ", got ", c.batch_size);
}

// The images of the inputs, by stem: one output per stem, and never over an input.
std::vector<fs::path> list_inputs(const PredictConfig& c) {
  std::vector<fs::path> files;
  for (const auto& in : c.inputs) {
    if (fs::is_directory(in)) {
      for (const auto& e : fs::directory_iterator(in))  // as image folders are scanned: files only
        if (e.is_regular_file() && is_image_path(e.path().string())) files.push_back(e.path());
    } else {
      check_regular_file(in, "image");
      files.push_back(in);
    }
  }
  UNETCU_CHECK(!files.empty(), "no images found in the inputs");
  std::sort(files.begin(), files.end());
  std::sort(files.begin(), files.end(), [](const fs::path& a, const fs::path& b) { return a.stem() < b.stem(); });
  for (size_t i = 1; i < files.size(); ++i)
    UNETCU_CHECK(files[i].stem() != files[i - 1].stem(), "two inputs share the name '", files[i].stem().string(),
                 "' (", files[i - 1].string(), ", ", files[i].string(),
                 "): their masks would overwrite each other");
  const fs::path out_abs = fs::weakly_canonical(c.out);
  for (const auto& f : files)
    UNETCU_CHECK(fs::weakly_canonical(f).parent_path() != out_abs, setting("out"), " ", c.out,
                 " holds the input images: masks would overwrite them");
  return files;
}

// Every input from its header before any output: the pixel limit, and the ground truth's size
// before it is decoded. The ground-truth mask of each image (none without c.masks).
std::vector<fs::path> match_truths(const PredictConfig& c, const std::vector<fs::path>& files) {
  // Ground truth by stem; a stem found twice is an error only for an image that needs it.
  std::map<std::string, fs::path> truth_of;
  std::set<std::string> truth_twice;
  if (!c.masks.empty()) {
    UNETCU_CHECK(fs::is_directory(c.masks), setting("masks"), " '", c.masks, "' is not a folder");
    for (const auto& e : fs::directory_iterator(c.masks))
      if (e.is_regular_file() && is_image_path(e.path().string()))
        if (!truth_of.emplace(e.path().stem().string(), e.path()).second) truth_twice.insert(e.path().stem().string());
  }
  std::vector<fs::path> truths(files.size());
  for (size_t i = 0; i < files.size(); ++i) {
    const ImageInfo info = read_image_info(files[i].string());
    if (c.masks.empty()) continue;
    const std::string stem = files[i].stem().string();
    UNETCU_CHECK(!truth_twice.count(stem), "two ground-truth masks named '", stem, "' in ", c.masks);
    auto it = truth_of.find(stem);
    UNETCU_CHECK(it != truth_of.end(), "no ground-truth mask for '", files[i].string(), "' in ", c.masks);
    truths[i] = it->second;
    const ImageInfo g = read_image_info(truths[i].string());
    UNETCU_CHECK(g.width == info.width && g.height == info.height, "mask '", truths[i].string(), "' is ", g.width,
                 "x", g.height, " but its image '", files[i].string(), "' is ", info.width, "x", info.height);
  }
  return truths;
}

// The IoU of class c in confusion matrix m (K x K, truth-major); `seen`: whether the class is
// present (in the truth or the prediction).
double class_iou(const std::vector<double>& m, int K, int c, bool* seen) {
  double row = 0, col = 0;
  for (int j = 0; j < K; ++j) row += m[size_t(c * K + j)], col += m[size_t(j * K + c)];
  const double tp = m[size_t(c * K + c)], uni = row + col - tp;
  if (seen) *seen = uni > 0;
  return uni > 0 ? tp / uni : 1.0;
}

// One image's prediction at its own size: each pixel's class and (with probabilities) each
// class's probability, from the tiles' blended probabilities (`probs`, [C, n]), or from the
// logits at the model's size (`logits`, [C, height, width]), nearest.
struct ImageMask {
  Image mask;
  std::vector<std::vector<uint16_t>> prob;
};

ImageMask mask_of(const PredictConfig& c, const Trained& t, const Image& img, const float* probs,
                  const float* logits) {
  const int classes = t.classes, size = t.height, size_w = t.width;
  const size_t n = size_t(img.width) * img.height, plane = size_t(size) * size_t(size_w);
  const double logit_threshold = std::log(c.threshold / (1 - c.threshold));
  ImageMask r{Image{img.width, img.height, 1, std::vector<uint8_t>(n)},
              std::vector<std::vector<uint16_t>>(c.save_probabilities ? size_t(classes) : 0,
                                                 std::vector<uint16_t>(n))};
  std::vector<float> p(static_cast<size_t>(classes));
  for (int y = 0; y < img.height; ++y)
    for (int xx = 0; xx < img.width; ++xx) {
      const size_t q = size_t(y) * img.width + xx;
      int cls = 0;
      if (probs) {
        for (int k = 0; k < classes; ++k) p[size_t(k)] = probs[size_t(k) * n + q];
        if (classes == 1)
          cls = p[0] > c.threshold;
        else
          cls = int(std::max_element(p.begin(), p.end()) - p.begin());
        for (size_t k = 0; k < r.prob.size(); ++k) r.prob[k][q] = uint16_t(std::lround(65535.0 * p[k]));
      } else {
        const int sy = std::min(size - 1, int((y + 0.5) * size / img.height));
        const int sx = std::min(size_w - 1, int((xx + 0.5) * size_w / img.width));
        const float* at = logits + size_t(sy) * size_w + sx;
        if (classes == 1) {
          cls = at[0] > logit_threshold;
          if (c.save_probabilities) r.prob[0][q] = uint16_t(std::lround(65535.0 / (1.0 + std::exp(-double(at[0])))));
        } else {
          double mx = at[0], z = 0;
          for (int k = 1; k < classes; ++k)
            if (at[size_t(k) * plane] > mx) mx = at[size_t(k) * plane], cls = k;
          if (c.save_probabilities) {
            for (int k = 0; k < classes; ++k) z += std::exp(at[size_t(k) * plane] - mx);
            for (int k = 0; k < classes; ++k)
              r.prob[size_t(k)][q] = uint16_t(std::lround(65535.0 * std::exp(at[size_t(k) * plane] - mx) / z));
          }
        }
      }
      r.mask.pixels[q] = classes == 1 ? (cls ? 255 : 0) : uint8_t(cls);
    }
  return r;
}

// The mask over the image: one class in red; several, each class but the background in its
// colour, half and half.
Image overlay_of(const Image& img, const Image& mask, const Trained& t) {
  Image o = img;
  for (size_t q = 0; q < mask.pixels.size(); ++q) {
    if (!mask.pixels[q]) continue;
    if (t.classes == 1) {
      o.pixels[q * 3] = uint8_t(std::min(255, o.pixels[q * 3] / 2 + 128));
      o.pixels[q * 3 + 1] /= 2;
      o.pixels[q * 3 + 2] /= 2;
    } else {
      const int k = mask.pixels[q];
      const std::array<uint8_t, 3> col = size_t(k) < t.colors.size() ? t.colors[size_t(k)] : default_color(k);
      for (int j = 0; j < 3; ++j)
        o.pixels[q * 3 + size_t(j)] = uint8_t((o.pixels[q * 3 + size_t(j)] + col[size_t(j)]) / 2);
    }
  }
  return o;
}

// Writes one image's outputs; returns its line (with its IoU or mIoU against `truth_file`, its
// pixels' counts added to `confusion`).
std::string write_image(const PredictConfig& c, const Trained& t, const fs::path& f, const Image& img,
                        const ImageMask& r, const fs::path& truth_file, std::vector<double>& confusion,
                        PredictProgress* progress) {
  const int classes = t.classes, K = std::max(2, classes);
  const size_t n = size_t(img.width) * img.height;
  const std::string stem = f.stem().string();
  // The ground truth is read (as the training read masks) before anything of this image is written.
  std::vector<float> truth;
  if (!c.masks.empty()) {
    int gw = 0, gh = 0;
    truth = load_mask_targets(truth_file.string(), t.labels, &gw, &gh);
  }
  const fs::path out = c.out;
  save_png((out / (stem + ".png")).string(), r.mask);
  progress->written.push_back(stem + ".png");
  if (c.save_probabilities) {
    if (classes == 1)
      save_png16((out / (stem + "_prob.png")).string(), img.width, img.height, r.prob[0]);
    else
      for (int k = 0; k < classes; ++k)
        save_png16((out / (stem + "_prob_" + std::to_string(k) + ".png")).string(), img.width, img.height,
                   r.prob[size_t(k)]);
  }
  if (c.overlay) {
    save_png((out / (stem + "_overlay.png")).string(), overlay_of(img, r.mask, t));
    ++progress->overlays;
  }
  std::string line = f.string() + " -> " + (out / (stem + ".png")).string();
  if (c.masks.empty()) return line;
  std::vector<double> m(size_t(K) * size_t(K), 0.0);
  for (size_t q = 0; q < n; ++q)
    if (truth[q] >= 0) m[size_t(truth[q]) * size_t(K) + (classes == 1 ? r.mask.pixels[q] > 0 : r.mask.pixels[q])] += 1;
  for (size_t j = 0; j < m.size(); ++j) confusion[j] += m[j];
  if (classes == 1) return line + format("  IoU %.4f", class_iou(m, K, 1, nullptr));
  double sum = 0;
  int seen_n = 0;
  for (int k = 0; k < K; ++k) {
    bool seen = false;
    const double v = class_iou(m, K, k, &seen);
    if (seen) sum += v, ++seen_n;
  }
  return line + format("  mIoU %.4f", seen_n ? sum / seen_n : 1.0);
}

// The whole set's IoU and Dice (one class) or mIoU and each class's IoU.
std::string summary_of(const Trained& t, const std::vector<double>& confusion, size_t images) {
  const int K = std::max(2, t.classes);
  if (t.classes == 1) {
    const double tp = confusion[size_t(K + 1)], fp = confusion[1], fn = confusion[size_t(K)];
    const double d = tp + fp + fn;
    return format("all %zu images: IoU %.4f  Dice %.4f\n", images, d ? tp / d : 1.0,
                  2 * tp + fp + fn ? 2.0 * tp / (2 * tp + fp + fn) : 1.0);
  }
  double sum = 0;
  int seen_n = 0;
  std::string per;
  for (int k = 0; k < K; ++k) {
    bool seen = false;
    const double v = class_iou(confusion, K, k, &seen);
    per += seen ? format("%s%s %.4f", k ? ", " : "", t.names[size_t(k)].c_str(), v)
                : str_cat(k ? ", " : "", t.names[size_t(k)], " -");
    if (seen) sum += v, ++seen_n;
  }
  return format("all %zu images: mIoU %.4f (over the classes present); IoU per class: ", images,
                seen_n ? sum / seen_n : 1.0) +
         per + "\n";
}

}  // namespace

void predict_files(const PredictConfig& c, std::ostream& out, PredictProgress* progress) {
  const Trained t = read_trained(c);
  check(c, t);
  set_max_image_pixels(c.max_image_pixels);
  std::string note;
  const Device device = resolve_device(c.device, &note);
  apply_precision(c.precision, /*tf32=*/true, device);
  const std::vector<fs::path> files = list_inputs(c);
  const std::vector<fs::path> truths = match_truths(c, files);
  UNetConfig cfg;
  cfg.width_divisor = t.width_divisor;
  cfg.classes = t.classes;
  cfg.encoder = t.encoder;
  cfg.in_channels = t.normalization.channels();
  cfg.device = device;
  cfg.bf16_activations = c.precision == Precision::BF16;
  cfg.format = memory_format_of(c.memory_format);
  UNet model(cfg);
  load_model_state(model, read_safetensors(c.checkpoint), c.checkpoint);
  model.eval();
  fs::create_directories(c.out);
  progress->total = files.size();
  const int K = std::max(2, t.classes);  // one class: background and foreground
  std::vector<double> confusion(size_t(K) * size_t(K), 0.0);
  const size_t plane = size_t(t.height) * size_t(t.width);
  double network_seconds = 0;
  const auto t0 = Clock::now();
  const auto forward = [&](const Tensor& x) { return predict_logits(model, x, c.tta); };
  // Tiled: one image at a time, batch_size tiles per forward pass.
  const size_t per_batch = t.tile ? 1 : size_t(c.batch_size);
  for (size_t first = 0; first < files.size(); first += per_batch) {
    // A batch: every image decoded and made into the network's input, then one forward pass
    // (per augmentation) for all of them, then each image's outputs.
    const size_t count = std::min(per_batch, files.size() - first);
    std::vector<Image> images;
    Tensor batch_logits, probs;
    const int C = t.normalization.channels();
    if (t.tile) {
      const ImageValues v = load_image_values(files[first].string(), C);
      images.push_back(picture_of(v));
      const auto n0 = Clock::now();
      probs = predict_tiled(normalised(v, t.normalization), t.tile, c.overlap, c.batch_size, forward);
      network_seconds += std::chrono::duration<double>(Clock::now() - n0).count();
    } else {
      Tensor x = Tensor::empty({int64_t(count), C, t.height, t.width});
      for (size_t k = 0; k < count; ++k) {
        const ImageValues v = load_image_values(files[first + k].string(), C);
        images.push_back(picture_of(v));
        prepare_input(v, t.width, t.height, t.normalization, x.data<float>() + k * C * plane);
      }
      const auto n0 = Clock::now();
      batch_logits = forward(x);
      network_seconds += std::chrono::duration<double>(Clock::now() - n0).count();
    }
    for (size_t k = 0; k < count; ++k) {
      const ImageMask r = mask_of(c, t, images[k], t.tile ? probs.data<float>() : nullptr,
                                  t.tile ? nullptr : batch_logits.data<float>() + k * size_t(t.classes) * plane);
      out << write_image(c, t, files[first + k], images[k], r, truths[first + k], confusion, progress) << "\n";
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const char* arithmetic = c.precision == Precision::BF16                          ? "bf16"
                           : device.is_cuda() && c.precision != Precision::FP32 ? "tf32"
                                                                                : "fp32";
  out << format("%zu images in %.2f s (%.1f images/s; the network alone %.1f images/s), batch %d, %s %s, tta %s, %s\n",
                files.size(), seconds, double(files.size()) / seconds, double(files.size()) / network_seconds,
                c.batch_size, arithmetic, format_name(cfg.format), name_of(kTtaNames, c.tta), device.str().c_str());
  if (t.tile) out << format("tiles of %dx%d, overlap %.2f, Gaussian-weighted\n", t.tile, t.tile, c.overlap);
  if (!c.masks.empty()) out << summary_of(t, confusion, files.size());
  out.flush();
}

}  // namespace unetcu
