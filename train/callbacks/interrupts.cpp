#include "train/callbacks/interrupts.h"

#include "train/interrupt.h"

namespace unetcu {

void Interrupts::on_step_end(FitContext& ctx, int64_t done) {
  // An interrupt at the epoch's last step waits for its validation: the epoch's checkpoint then
  // holds the epoch's metrics (best, early stopping) as an uninterrupted run's.
  const bool decide = done < ctx.steps && (ctx.strategy.layout().process_count == 1 || done % 8 == 0);
  if (decide && ctx.strategy.any_process(interrupt_requested())) ctx.interrupted = true;
}

void Interrupts::on_interrupt(FitContext& ctx, int64_t done) {
  // The other processes wait for process 0's checkpoint before they end (a launcher ends the
  // whole job when one process exits).
  ctx.strategy.any_process(false);
  throw Interrupted(str_cat("interrupted at epoch ", ctx.epoch, " after step ", done, " of ", ctx.steps, "; ",
                            ctx.interrupt_note));
}

void Interrupts::on_epoch_end(FitContext& ctx, const EpochStats&) {
  if (ctx.stop || ctx.epoch >= ctx.options.epochs || !ctx.strategy.any_process(interrupt_requested())) return;
  const std::string& file = ctx.options.checkpoint;
  throw Interrupted(str_cat("interrupted after epoch ", ctx.epoch, "; ",
                            file.empty() ? "no checkpoint was configured" : "checkpoint written to " + file));
}

}  // namespace unetcu
