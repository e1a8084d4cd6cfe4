// The data a training run reads: the built-in synthetic set, or an image folder; filled by a
// program's flags, checked here before anything is read.
#pragma once
#include <cstdint>
#include <string>

#include "data/image_io.h"
#include "data/labels.h"

namespace unetcu {

// Upper bounds of the sizes a user gives: far from any overflow of what is computed from them.
constexpr int kMaxImageSize = 8192;
constexpr int64_t kMaxSamples = 100000000;

struct DataConfig {
  int image_size = 64;             // the height (S or WxH)
  int image_width = 0;             // 0: image_size (square)
  int width() const { return image_width ? image_width : image_size; }
  int height() const { return image_size; }
  LabelRule labels;                // how masks become targets (classes, ignore index, colours)
  std::string class_colors;        // a file of one r,g,b[,name] line per class (RGB masks)
  int64_t train_size = 512;        // synthetic
  int64_t val_size = 128;          // synthetic
  std::string data, data_list, val_data;  // a folder, the images of it to read, a validation folder
  double val_fraction = 0.1;       // held out of `data` without `val_data`
  int64_t max_image_pixels = kDefaultMaxImagePixels;  // images above this are refused unread

  // A bad value, or settings that do not go together: one line naming the setting
  // (runtime/common.h setting()). labels.classes is the run's class count.
  void check() const;
};

}  // namespace unetcu
