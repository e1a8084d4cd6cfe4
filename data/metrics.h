// Segmentation metrics over a whole evaluation set, from a confusion matrix accumulated on the
// logits' device (one copy to the host when a metric is read).
//
// Pixels are predicted as in bodies/loss.h: one channel, foreground where the logit is > 0
// (probability > 0.5); C >= 2 channels, the largest logit. Ignored pixels (negative targets)
// are not counted. One channel gives a 2 x 2 matrix (background 0, foreground 1); iou() and
// dice() are then the foreground's, TP/(TP+FP+FN) and 2TP/(2TP+FP+FN), 1 when there is nothing
// to find or predict. For C >= 2, per class c: IoU_c = TP_c / (TP_c + FP_c + FN_c) and
// Dice_c = 2 TP_c / (2 TP_c + FP_c + FN_c); mIoU (miou(), and iou()) is their mean over the
// classes whose union TP_c + FP_c + FN_c is non-empty, as torchmetrics' and MMSegmentation's
// mean IoU; mean_dice() (and dice()) the same over Dice.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/tensor.h"

namespace unetcu {

class SegmentationCounts {
 public:
  explicit SegmentationCounts(int classes = 1);
  // logits [N, C, H, W]; masks the loss's target ([N, 1, H, W], float32 or the logits' dtype)
  // on the same device. Nothing waits for the device.
  void add(const Tensor& logits, const Tensor& masks);
  int classes() const { return classes_; }
  // The matrix, counts[truth * K + predicted], K = max(2, classes).
  const std::vector<double>& matrix() const;
  int64_t tp() const { return count(1, 1); }  // one channel: the foreground's
  int64_t fp() const { return count(0, 1); }
  int64_t fn() const { return count(1, 0); }
  int64_t tn() const { return count(0, 0); }
  double class_iou(int c) const;   // 1 for a class with an empty union
  double class_dice(int c) const;
  bool class_seen(int c) const;    // its union is non-empty
  double miou() const;             // mean over seen classes (1 when none is seen)
  double mean_dice() const;
  double iou() const { return classes_ == 1 ? class_iou(1) : miou(); }
  double dice() const { return classes_ == 1 ? class_dice(1) : mean_dice(); }
  double accuracy() const;

 private:
  int64_t count(int truth, int pred) const { return int64_t(matrix()[size_t(truth * k_ + pred)]); }
  struct ClassTotals {
    double tp, truth, predicted;  // a class's diagonal, row and column sums
  };
  ClassTotals totals(int c) const;
  int classes_, k_;
  Tensor counts_;                         // on the device of the first logits
  mutable std::vector<double> host_;
  mutable bool stale_ = true;
};

}  // namespace unetcu
