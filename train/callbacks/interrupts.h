// Ctrl-C (train/interrupt.h) as the run honours it: the run stops after the step in progress,
// in every process at the same step (several processes agree every 8 steps, as agreeing is a
// collective), and after an epoch's validation when it came at the epoch's last step. The
// checkpoints write theirs first (on_interrupt); then Interrupted is thrown, saying where the
// run stopped and what was saved. Last in the list of callbacks.
#pragma once
#include "train/callback.h"

namespace unetcu {

class Interrupts : public Callback {
 public:
  void on_step_end(FitContext& ctx, int64_t steps_done) override;
  [[noreturn]] void on_interrupt(FitContext& ctx, int64_t steps_done) override;
  void on_epoch_end(FitContext& ctx, const EpochStats& st) override;
};

}  // namespace unetcu
