// The run's watch on one validation metric, epoch after epoch: the best value so far (for the
// best checkpoint) and the epochs since the metric last improved (for early stopping), with
// the semantics of PyTorch Lightning's ModelCheckpoint(monitor, mode) and
// EarlyStopping(monitor, min_delta, patience, mode):
//
//   best     replaced by an epoch's value strictly better than it (the first epoch sets it);
//   stale    epochs since the value last beat `reference` by more than min_delta (then
//            reference = the value and stale = 0; otherwise stale + 1); the run stops once
//            stale reaches patience (patience 0: never).
//
// "Better" is higher for val_iou, val_dice and val_miou, lower for val_loss. The record is kept in the
// checkpoint's training state (engine/checkpoint.h RunRecord), so a resumed run counts on from
// where it stopped: the same epochs saved and the same stop as an uninterrupted run.
#pragma once
#include <map>
#include <optional>
#include <string>

#include "engine/named.h"

namespace unetcu {

// val_iou and val_dice: the foreground's for one class, the means over classes present for
// more; val_miou: the mean IoU over classes present, background included (data/metrics.h).
enum class MonitorKind { ValIou, ValDice, ValLoss, ValMiou };
inline constexpr NamedValue<MonitorKind> kMonitorNames[] = {
    {"val_iou", MonitorKind::ValIou}, {"val_dice", MonitorKind::ValDice}, {"val_loss", MonitorKind::ValLoss},
    {"val_miou", MonitorKind::ValMiou}};

// Bound of the patience a run takes (apps/ checks its flag against it).
constexpr int kMaxPatience = 100000;

struct MonitorOptions {
  MonitorKind metric = MonitorKind::ValIou;
  int patience = 0;        // epochs without an improvement before the run stops; 0: never
  double min_delta = 0;    // an improvement beats the reference by more than this (>= 0)
  // Throws an Error for values no monitor takes.
  void check() const;
};

class MetricMonitor {
 public:
  explicit MetricMonitor(MonitorOptions o);

  struct Verdict {
    bool best = false;   // the value is the best of the run so far
    bool stop = false;   // the patience ran out: the run ends after this epoch
  };
  // Takes epoch `epoch`'s value (finite) of the monitored metric.
  Verdict update(int epoch, double value);

  const MonitorOptions& options() const { return o_; }
  MonitorKind metric() const { return o_.metric; }
  const char* metric_name() const;
  bool has_best() const { return best_.has_value(); }
  double best() const { return best_.value_or(0); }
  int best_epoch() const { return best_epoch_; }
  int stale() const { return stale_; }
  double reference() const { return reference_.value_or(0); }  // what an improvement must beat

  // The record as strings (exact: a value comes back bit for bit), and back. restore() checks
  // every value and throws an Error naming `file` for one that is not a possible record; a
  // record of another metric, or none, leaves the monitor fresh and returns false.
  std::map<std::string, std::string> record() const;
  bool restore(const std::map<std::string, std::string>& record, int epoch, const std::string& file);

 private:
  bool better(double a, double b, double delta) const;
  MonitorOptions o_;
  std::optional<double> best_, reference_;
  int best_epoch_ = 0;
  int stale_ = 0;
};

}  // namespace unetcu
