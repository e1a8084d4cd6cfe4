// The progress bar on stderr (only when it is a terminal, redrawn at most ~10 times a second)
// and the one line each epoch prints: its time, losses, metrics, rate, peak memory, the
// loader, and where they apply the gradient norms, the learning rate and a pipeline's live
// micro-batches.
#pragma once
#include <string>
#include <vector>

#include "train/callback.h"

namespace unetcu {

class Progress : public Callback {
 public:
  void on_epoch_start(FitContext& ctx) override;
  void on_step_loss(FitContext& ctx, const StepDone& s) override;
  void on_step_end(FitContext& ctx, int64_t steps_done) override;
  void on_interrupt(FitContext&, int64_t) override { finish_bar(); }
  void on_train_epoch_end(FitContext&) override { finish_bar(); }
  void on_epoch_end(FitContext& ctx, const EpochStats& st) override;

  // The epoch line (with its newline) of epoch st.epoch of `epochs`; `live`: a pipeline's
  // most live micro-batches per stage over the epoch (empty: none).
  static std::string epoch_line(const EpochStats& st, int epochs, bool scheduled,
                                const std::vector<int>& live);

 private:
  void finish_bar();
  bool bar_ = false;
  int epoch_ = 0;
  int64_t total_ = 0;
  double last_ = -1;
  std::vector<int> peak_live_;
};

}  // namespace unetcu
