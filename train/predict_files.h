// unet_predict's work: a checkpoint and images (files or folders) in, mask PNGs out at each
// image's own size (one class: sigmoid > threshold, 0/255; several: the class index per pixel),
// optionally an overlay of the mask on the image, probabilities, and IoU/Dice (mIoU and per
// class IoU) when ground-truth masks are given. The images go through the network in batches
// (or, with tiles, each image in overlapping tiles, batches of tiles), in the precision and
// memory format asked for, optionally with test-time flips (train/inference.h). How the model
// was trained (classes, width divisor, training size or crop, ignore index, class colours)
// comes from the checkpoint's settings (engine/checkpoint.h).
//
// Every input is checked from its header (a regular file, within the pixel limit, the size of
// its ground-truth mask) before the model is loaded or anything is written; each output is
// written to a temporary name and renamed. Should decoding or writing still fail part way,
// PredictProgress says which masks were already written: those of the batches before the
// failing one (a batch's images are all decoded before its masks are written).
#pragma once
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "data/image_io.h"
#include "train/inference.h"
#include "train/precision.h"

namespace unetcu {

struct PredictConfig {
  std::vector<std::string> inputs;  // image files or folders
  std::string checkpoint;           // the model (safetensors with its settings)
  std::string out = "predictions";  // folder of <stem>.png, overlays and probabilities
  std::string masks;                // ground truth by stem: IoU and Dice
  std::string device = "auto";
  std::optional<std::string> image_size;  // S or WxH; else the checkpoint's training size, else 512
  std::optional<int> width_divisor;       // else the checkpoint's (another is an error)
  std::optional<int> tile;                // else the checkpoint's crop size (0: no tiles)
  double overlap = 0.5;                   // tiles: the share of a tile its neighbours overlap
  double threshold = 0.5;                 // one class: foreground where sigmoid(logit) > this
  int batch_size = 1;                     // images (tiles) per forward pass
  Precision precision = Precision::Auto;
  FormatChoice memory_format = FormatChoice::Auto;
  Tta tta = Tta::None;
  int64_t max_image_pixels = kDefaultMaxImagePixels;
  bool overlay = false, save_probabilities = false;
};

// What was written so far: the masks (file names) of the images done, their overlays, of how
// many images.
struct PredictProgress {
  std::vector<std::string> written;
  size_t overlays = 0, total = 0;
};

// Predicts every input, a line per image to `out` (with its IoU or mIoU against a given mask)
// and a summary; an unetcu::Error naming the setting (runtime/common.h setting()) for bad input.
void predict_files(const PredictConfig& config, std::ostream& out, PredictProgress* progress);

}  // namespace unetcu
