// The metrics file of a training run (--log): one row per epoch — epoch, training time, train
// loss, validation loss / IoU / Dice, images/s, learning rate, peak device memory, loader
// wait, and with gradient clipping the epoch's mean and largest gradient norm and the share of
// steps clipped — and, every N steps, a step row (step, loss, images/s, learning rate). CSV
// with a header, or JSON Lines when the name ends in ".jsonl". Every row is flushed when
// written, so a run that stops leaves every finished row; a resumed run appends (a fresh one
// starts the file anew). With several classes each epoch row ends with each class's IoU.
#pragma once
#include <cstdio>
#include <string>
#include <vector>

#include "train/trainer.h"

namespace unetcu {

class MetricsLog {
 public:
  // Opens `path` (truncated, or appended to when `append`); Error when it cannot be written, or
  // when a CSV to append to starts with another header than this version writes.
  // An empty path: no file, every write is a no-op.
  // class_names (two or more): a column val_iou_<name> per class after the others.
  MetricsLog(const std::string& path, bool append, const std::vector<std::string>& class_names = {});
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  bool enabled() const { return f_ != nullptr; }
  void epoch(const EpochStats& st, double lr);
  // step: steps done in the epoch; seconds: since the epoch started; images: seen since then;
  // lr: the step's learning rate.
  void step(int epoch, int64_t step, double loss, double seconds, int64_t images, double lr);

 private:
  void row(const char* kind, int epoch, int64_t step, const std::string* fields, const std::vector<double>& extra);
  std::vector<std::string> extra_;  // the per-class columns
  std::FILE* f_ = nullptr;
  bool jsonl_ = false;
  std::string path_;
};

}  // namespace unetcu
