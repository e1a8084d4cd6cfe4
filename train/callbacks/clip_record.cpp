#include "train/callbacks/clip_record.h"

namespace unetcu {

void ClipRecord::on_epoch_start(FitContext& ctx) {
  for (Optimizer* opt : ctx.strategy.optimizers()) opt->take_clip_stats();
}

void ClipRecord::on_validation_end(FitContext& ctx, EpochStats& st) {
  bool seen = false;
  for (Optimizer* opt : ctx.strategy.optimizers()) {
    const Optimizer::ClipStats c = opt->take_clip_stats();
    if (c.steps == 0 || seen) continue;
    seen = true;
    st.clip_steps = c.steps;
    st.clip_clipped = c.clipped;
    st.grad_norm = c.norm_mean;
    st.grad_norm_max = c.norm_max;
    st.clipped_fraction = double(c.clipped) / double(c.steps);
  }
}

}  // namespace unetcu
