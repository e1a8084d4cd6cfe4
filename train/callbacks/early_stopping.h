// The watch on one validation metric (options.monitor, train/monitor.h): after each epoch it
// says whether the epoch is the best so far (the checkpoints save it as the best checkpoint)
// and, with a patience, ends the run once the metric has not improved for that many epochs,
// in every process at once. Its record goes into every checkpoint, so a resumed run counts on.
#pragma once
#include "train/callback.h"
#include "train/monitor.h"

namespace unetcu {

class EarlyStopping : public Callback {
 public:
  explicit EarlyStopping(const FitOptions& o);

  void load_state(FitContext& ctx, const RunRecord& record, std::ostream& resume_line) override;
  void save_state(RunRecord& r) const override;
  void on_validation_end(FitContext& ctx, EpochStats& st) override;
  void on_epoch_end(FitContext& ctx, const EpochStats& st) override;
  void on_fit_end(FitContext& ctx, TrainResult& result) override;

  const MetricMonitor& monitor() const { return monitor_; }
  // The epoch just validated is the best of the run so far.
  bool best_now() const { return verdict_.best; }

 private:
  MetricMonitor monitor_;
  bool watching_;  // a best checkpoint or a patience: the monitor is reported
  MetricMonitor::Verdict verdict_;
};

}  // namespace unetcu
