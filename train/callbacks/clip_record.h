// Gradient clipping's record of each epoch (the optimizers' max_grad_norm): the mean and
// largest gradient norm before clipping and the share of the steps the clip scaled down. Every
// stage of a pipeline clips by the same norm and a replica's is rank 0's, so the first
// optimizer that clipped speaks for the epoch; across processes, this process's stage's.
#pragma once
#include "train/callback.h"

namespace unetcu {

class ClipRecord : public Callback {
 public:
  // The record starts with the epoch (steps before fit() or before the epoch are not its).
  void on_epoch_start(FitContext& ctx) override;
  // The steps are done and their last loss was read: st's clip figures, NaN without clipping.
  void on_validation_end(FitContext& ctx, EpochStats& st) override;
};

}  // namespace unetcu
