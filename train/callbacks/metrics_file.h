// The metrics file (--log, train/metrics_log.h) as the run writes it: opened when the run
// starts (appended to when resuming), a step row every options.log_every steps, a row per
// epoch. Process 0 writes it.
#pragma once
#include <memory>

#include "train/callback.h"
#include "train/metrics_log.h"

namespace unetcu {

class MetricsFile : public Callback {
 public:
  void on_fit_start(FitContext& ctx) override;
  void on_step_loss(FitContext& ctx, const StepDone& s) override;
  void on_epoch_end(FitContext& ctx, const EpochStats& st) override;

 private:
  std::unique_ptr<MetricsLog> log_;
};

}  // namespace unetcu
