// The run's checkpoints (engine/checkpoint.h): the encoder weights or the checkpoint it starts
// from, the checkpoint written after every epoch (options.checkpoint), the best one
// (options.save_best, when the watched metric is the best so far) and the one an interrupt
// writes mid-epoch. Process 0 writes them; a non-finite parameter is refused before a file is
// touched, so the last good checkpoint stays.
#pragma once
#include "train/callback.h"
#include "train/callbacks/early_stopping.h"

namespace unetcu {

class Checkpoints : public Callback {
 public:
  // Checks the files can be written before any training. `watch` tells the best epochs.
  Checkpoints(FitContext& ctx, const EarlyStopping& watch);

  // Loads options.encoder_weights and options.resume into the strategy: sets ctx.first_epoch and
  // ctx.first_step, prints the "resumed from" line (every callback's load_state adds to it)
  // and returns the resumed run's record (empty without a resume).
  RunRecord start(FitContext& ctx);

  void on_interrupt(FitContext& ctx, int64_t steps_done) override;
  void on_epoch_end(FitContext& ctx, const EpochStats& st) override;

 private:
  const EarlyStopping& watch_;
};

// Whether every parameter of the model is finite.
bool parameters_finite(Module& model);

}  // namespace unetcu
