// Segmentation metrics over a whole evaluation set: pixels are predicted positive where the
// logit is > 0 (probability > 0.5); IoU = TP/(TP+FP+FN), Dice = 2TP/(2TP+FP+FN), both summed
// over every pixel of every image before dividing (1 when there is nothing to find or predict).
#pragma once
#include <cstdint>

#include "engine/tensor.h"

namespace unetcu {

struct SegmentationCounts {
  int64_t tp = 0, fp = 0, fn = 0, tn = 0;
  void add(const Tensor& logits, const Tensor& masks);
  double iou() const;
  double dice() const;
  double accuracy() const;
};

}  // namespace unetcu
