#include "data/data_config.h"

#include "runtime/common.h"

namespace unetcu {

void DataConfig::check() const {
  for (int side : {width(), height()})
    UNETCU_CHECK(side >= 32 && side % 32 == 0 && side <= kMaxImageSize, setting("image_size"),
                 " must be a multiple of 32 in 32..", kMaxImageSize, " on each side, got ", width(), "x", height());
  const int classes = labels.classes;
  UNETCU_CHECK(classes >= 1 && classes <= 256, setting("classes"), " must be in 1..256, got ", classes);
  UNETCU_CHECK(!data.empty() || classes <= 4,
               "the synthetic set has 1 to 4 classes (background and up to three kinds of shapes), got ",
               setting("classes"), " ", classes, "; train on a folder (", setting("data"), ") for more");
  UNETCU_CHECK(labels.ignore_index >= -1 && labels.ignore_index <= 255, setting("ignore_index"),
               " must be a mask value in 0..255, got ", labels.ignore_index);
  UNETCU_CHECK(labels.ignore_index < 0 || labels.ignore_index >= classes || classes == 1, setting("ignore_index"), " ",
               labels.ignore_index, " is one of the ", classes, " classes (0..", classes - 1, ")");
  UNETCU_CHECK(labels.colors.empty() || int(labels.colors.size()) == classes, setting("class_colors"), " lists ",
               labels.colors.size(), " colours for ", setting("classes"), " ", classes);
  UNETCU_CHECK(class_colors.empty() || !data.empty(), setting("class_colors"), " reads RGB masks of ",
               setting("data"));
  UNETCU_CHECK(train_size >= 1 && train_size <= kMaxSamples, setting("train_size"), " must be in 1..", kMaxSamples,
               ", got ", train_size);
  UNETCU_CHECK(val_size >= 1 && val_size <= kMaxSamples, setting("val_size"), " must be in 1..", kMaxSamples,
               ", got ", val_size);
  UNETCU_CHECK(max_image_pixels >= 1, setting("max_image_pixels"), " must be at least 1, got ", max_image_pixels);
  UNETCU_CHECK(data.empty() || (val_fraction > 0 && val_fraction < 1) || !val_data.empty(), setting("val_fraction"),
               " must be between 0 and 1");
  UNETCU_CHECK(!data.empty() || (val_data.empty() && data_list.empty()), setting("val_data"), " and ",
               setting("data_list"), " need ", setting("data"));
}

}  // namespace unetcu
