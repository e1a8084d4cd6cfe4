#include "train/callbacks/early_stopping.h"

#include <cstdio>

namespace unetcu {

namespace {

double monitored(MonitorKind m, const EpochStats& st) {
  return m == MonitorKind::ValLoss ? st.val_loss : m == MonitorKind::ValDice ? st.val_dice
         : m == MonitorKind::ValMiou ? st.val_miou : st.val_iou;
}

}  // namespace

EarlyStopping::EarlyStopping(const FitOptions& o)
    : monitor_(o.monitor), watching_(!o.save_best.empty() || o.monitor.patience > 0) {}

void EarlyStopping::load_state(FitContext& ctx, const RunRecord& record, std::ostream& line) {
  // A run that watches nothing keeps the metric the resumed run watched, so that a later
  // resume which watches it again counts on.
  if (!watching_)
    if (const auto it = record.find("monitor"); it != record.end())
      for (const auto& m : kMonitorNames)
        if (it->second == m.name) monitor_ = MetricMonitor(MonitorOptions{m.value});
  const bool restored = monitor_.restore(record, ctx.first_epoch - 1, ctx.options.resume + ".train");
  if (watching_ && restored) {
    char s[160];
    std::snprintf(s, sizeof s, "; best %s %.4f at epoch %d, %d epoch%s without improvement",
                  monitor_.metric_name(), monitor_.best(), monitor_.best_epoch(), monitor_.stale(),
                  monitor_.stale() == 1 ? "" : "s");
    line << s;
  } else if (watching_ && ctx.first_epoch > 1) {
    line << "; it holds no record of " << monitor_.metric_name() << ", counted from here";
  }
}

void EarlyStopping::save_state(RunRecord& r) const {
  for (auto& [k, v] : monitor_.record()) r[k] = v;
}

void EarlyStopping::on_validation_end(FitContext& ctx, EpochStats& st) {
  verdict_ = monitor_.update(ctx.epoch, monitored(monitor_.metric(), st));
}

void EarlyStopping::on_epoch_end(FitContext& ctx, const EpochStats&) {
  // Every process ends at the same epoch (their validations agree, but the decision is one).
  if (!ctx.strategy.any_process(verdict_.stop) || ctx.epoch >= ctx.options.epochs) return;
  char s[200];
  std::snprintf(s, sizeof s, "early stop after epoch %d of %d: %s has not improved", ctx.epoch,
                ctx.options.epochs, monitor_.metric_name());
  ctx.out << s;
  if (monitor_.options().min_delta > 0) {  // the value to beat is not the best's then
    std::snprintf(s, sizeof s, " on epoch %d's %.4f by more than %g", ctx.epoch - monitor_.stale(),
                  monitor_.reference(), monitor_.options().min_delta);
    ctx.out << s;
  }
  std::snprintf(s, sizeof s, " for %d epoch%s (best %.4f at epoch %d)\n", monitor_.stale(),
                monitor_.stale() == 1 ? "" : "s", monitor_.best(), monitor_.best_epoch());
  ctx.out << s;
  ctx.stop = true;
}

void EarlyStopping::on_fit_end(FitContext& ctx, TrainResult& result) {
  result.stopped_early = ctx.stop;
  result.best_epoch = monitor_.best_epoch();
  result.best_value = monitor_.best();
  if (!watching_ || !monitor_.has_best()) return;
  char s[160];
  std::snprintf(s, sizeof s, "best %s %.4f at epoch %d", monitor_.metric_name(), monitor_.best(),
                monitor_.best_epoch());
  ctx.out << s;
  const std::string& best_file = ctx.options.save_best;
  if (!best_file.empty() && monitor_.best_epoch() >= ctx.first_epoch) ctx.out << " (" << best_file << ")";
  ctx.out << "\n";
}

}  // namespace unetcu
