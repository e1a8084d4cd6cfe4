#include "train/callbacks/checkpoints.h"

#include <sys/stat.h>

#include <cmath>
#include <cstdio>

#include "models/encoder_weights.h"

namespace unetcu {

bool parameters_finite(Module& model) {
  for (const Tensor& p : model.parameters()) {
    const Tensor host = p.device().is_cpu() ? p : p.to(Device::cpu());
    bool ok = true;
    UNETCU_DISPATCH_FLOAT(host.dtype(), T, {
      const T* d = host.data<T>();
      for (int64_t i = 0; i < host.numel() && ok; ++i) ok = std::isfinite(d[i]);
    });
    if (!ok) return false;
  }
  return true;
}

Checkpoints::Checkpoints(FitContext& ctx, const EarlyStopping& watch) : watch_(watch) {
  const FitOptions& o = ctx.options;
  if (ctx.lead) check_writable(o.checkpoint, "checkpoint");
  if (ctx.lead) check_writable(o.save_best, "best checkpoint");
  UNETCU_CHECK(o.save_best.empty() || o.checkpoint.empty() || !same_file(o.save_best, o.checkpoint),
               "the best checkpoint and the checkpoint of every epoch must be different files, both are ",
               o.save_best);
  ctx.kept = o.checkpoint.empty() ? "" : "; " + o.checkpoint + " was not overwritten";
}

RunRecord Checkpoints::start(FitContext& ctx) {
  const FitOptions& o = ctx.options;
  TrainingStrategy& strategy = ctx.strategy;
  RunRecord record;
  if (!o.encoder_weights.empty()) {
    load_encoder_weights(strategy.model(), o.encoder_weights);
    strategy.state_loaded();
    ctx.out << "encoder weights from " << o.encoder_weights << "\n";
  }
  if (o.resume.empty()) return record;
  struct stat train_file {};  // stat, not open: a FIFO must not block here
  UNETCU_CHECK(::stat((o.resume + ".train").c_str(), &train_file) == 0, "resume from ", o.resume, ": no ",
               o.resume, ".train beside it (optimizer state and epoch); load only the encoder "
               "or the weights another way to start over");
  ctx.first_epoch = load_checkpoint(o.resume, strategy.model(), strategy.optimizers(), &ctx.first_step, &record) + 1;
  strategy.state_loaded();
  ctx.out << "resumed from " << o.resume << " after epoch " << ctx.first_epoch - 1;
  if (ctx.first_step) ctx.out << " and " << ctx.first_step << " steps of epoch " << ctx.first_epoch;
  for (Callback* c : ctx.callbacks) c->load_state(ctx, record, ctx.out);
  ctx.out << "\n";
  UNETCU_CHECK(ctx.first_epoch <= o.epochs, "resume: the checkpoint is from epoch ", ctx.first_epoch - 1,
               ", nothing left to do with ", o.epochs, " epochs");
  return record;
}

void Checkpoints::on_interrupt(FitContext& ctx, int64_t steps_done) {
  const std::string& file = ctx.options.checkpoint;
  if (file.empty()) return;
  if (!ctx.lead) {
    ctx.interrupt_note = "checkpoint written by process 0";
    return;
  }
  UNETCU_CHECK(parameters_finite(ctx.strategy.model()), "a parameter is not finite at epoch ", ctx.epoch,
               " step ", steps_done, ctx.kept);
  // Steps done into this epoch: a resume continues right after them.
  save_checkpoint(file, ctx.strategy.model(), ctx.strategy.optimizers(), ctx.epoch - 1, steps_done, ctx.record(),
                  ctx.options.settings);
  ctx.interrupt_note = "checkpoint written to " + file + " (resuming continues from there)";
}

void Checkpoints::on_epoch_end(FitContext& ctx, const EpochStats&) {
  if (!ctx.lead) return;
  const FitOptions& o = ctx.options;
  const bool save_best = watch_.best_now() && !o.save_best.empty();
  if (!o.checkpoint.empty() || save_best)
    UNETCU_CHECK(parameters_finite(ctx.strategy.model()), "a parameter is not finite after epoch ",
                 ctx.epoch, ctx.kept);
  if (save_best) {
    // The same files as the epoch's checkpoint, record included.
    save_checkpoint(o.save_best, ctx.strategy.model(), ctx.strategy.optimizers(), ctx.epoch, 0, ctx.record(),
                    o.settings);
    char line[160];
    std::snprintf(line, sizeof line, "best %s so far (%.4f): saved to ", watch_.monitor().metric_name(),
                  watch_.monitor().best());
    ctx.out << line << o.save_best << "\n";
  }
  if (!o.checkpoint.empty()) {
    save_checkpoint(o.checkpoint, ctx.strategy.model(), ctx.strategy.optimizers(), ctx.epoch, 0, ctx.record(),
                    o.settings);
    ctx.kept = "; the checkpoint of epoch " + std::to_string(ctx.epoch) + " is kept";
  }
  ctx.out.flush();
}

}  // namespace unetcu
