#include "train/callbacks/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iomanip>
#include <sstream>

namespace unetcu {

void Progress::on_epoch_start(FitContext& ctx) {
  bar_ = ctx.options.progress && ctx.lead && isatty(STDERR_FILENO);
  epoch_ = ctx.epoch;
  total_ = ctx.steps;
  last_ = -1;
  peak_live_.clear();
}

void Progress::on_step_loss(FitContext&, const StepDone& s) {
  if (!bar_) return;
  if (s.step < total_ && s.seconds - last_ < 0.1) return;
  last_ = s.seconds;
  const int width = 30;
  const int fill = int(width * s.step / total_);
  const double rate = s.seconds > 0 ? double(s.images) / s.seconds : 0;
  const double eta = s.step > 0 ? s.seconds * double(total_ - s.step) / double(s.step) : 0;
  std::fprintf(stderr, "\repoch %d [%.*s%*s] %lld/%lld  %.1f img/s  ETA %.0fs   ", epoch_, fill,
               "##############################", width - fill, "", (long long)s.step, (long long)total_,
               rate, eta);
  std::fflush(stderr);
}

void Progress::on_step_end(FitContext& ctx, int64_t) {
  const auto live = ctx.strategy.live_micro_batches();
  if (peak_live_.empty()) peak_live_ = live;
  for (size_t i = 0; i < live.size(); ++i) peak_live_[i] = std::max(peak_live_[i], live[i]);
}

void Progress::finish_bar() {
  if (bar_) std::fprintf(stderr, "\r%*s\r", 90, "");
  bar_ = false;
}

void Progress::on_epoch_end(FitContext& ctx, const EpochStats& st) {
  ctx.out << epoch_line(st, ctx.options.epochs, ctx.scheduled, peak_live_);
  ctx.out.flush();
}

std::string Progress::epoch_line(const EpochStats& st, int epochs, bool scheduled, const std::vector<int>& live) {
  std::ostringstream out;
  char line[256];
  // Several classes: the mean IoU and Dice over the classes present (data/metrics.h).
  std::snprintf(line, sizeof line,
                st.val_class_iou.empty() ? "epoch %d/%d  time %.2fs  loss %.4f  val_loss %.4f  val_iou %.4f  "
                                           "val_dice %.4f  %.1f img/s"
                                         : "epoch %d/%d  time %.2fs  loss %.4f  val_loss %.4f  val_miou %.4f  "
                                           "val_mdice %.4f  %.1f img/s",
                st.epoch, epochs, st.seconds, st.train_loss, st.val_loss, st.val_iou, st.val_dice,
                st.images_per_second);
  out << line;
  out << "  peak_mem " << std::fixed << std::setprecision(0) << double(st.peak_device_bytes) / (1 << 20)
      << " MiB" << std::defaultfloat;
  // The loader: its rate, and how much of the epoch the step waited for it.
  out << "  loader " << std::fixed << std::setprecision(0)
      << (st.load_seconds > 0 ? double(st.images) / st.load_seconds : 0.0) << " img/s, waited "
      << std::setprecision(2) << st.wait_seconds << "s" << std::defaultfloat;
  if (st.clip_steps > 0) {
    char norms[96];
    std::snprintf(norms, sizeof norms, "  grad_norm %.4g (max %.4g, %lld/%lld clipped)", st.grad_norm,
                  st.grad_norm_max, static_cast<long long>(st.clip_clipped), static_cast<long long>(st.clip_steps));
    out << norms;
  }
  if (scheduled) {  // the rate of the epoch's last step
    char rate[32];
    std::snprintf(rate, sizeof rate, "  lr %.4g", st.lr);
    out << rate;
  }
  if (!live.empty()) {
    out << "  live_micro_batches";
    for (int v : live) out << " " << v;
  }
  out << "\n";
  return out.str();
}

}  // namespace unetcu
