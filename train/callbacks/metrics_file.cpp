#include "train/callbacks/metrics_file.h"

namespace unetcu {

void MetricsFile::on_fit_start(FitContext& ctx) {
  log_ = std::make_unique<MetricsLog>(ctx.lead ? ctx.options.log : "", !ctx.options.resume.empty(),
                                      ctx.options.class_names);
}

void MetricsFile::on_step_loss(FitContext& ctx, const StepDone& s) {
  const int64_t every = ctx.options.log_every;
  if (every > 0 && s.step % every == 0) log_->step(ctx.epoch, s.step, s.loss, s.seconds, s.images, s.lr);
}

void MetricsFile::on_epoch_end(FitContext&, const EpochStats& st) { log_->epoch(st, st.lr); }

}  // namespace unetcu
