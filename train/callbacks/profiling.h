// The profiler (engine/profiler.h) over the run, with options.profile set: every op and block
// recorded from the first epoch on, the tables printed at the end and the trace written there
// (process r > 0 of several writes FILE.rank<r>).
#pragma once
#include "train/callback.h"

namespace unetcu {

class Profiling : public Callback {
 public:
  explicit Profiling(FitContext& ctx);  // checks the trace can be written
  void on_fit_start(FitContext& ctx) override;
  void on_fit_end(FitContext& ctx, TrainResult& result) override;
};

}  // namespace unetcu
