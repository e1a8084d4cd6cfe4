#include "train/lr_schedule.h"

#include <cmath>

#include "runtime/common.h"

namespace unetcu {

void LrSchedule::check(int64_t total_steps) const {
  UNETCU_CHECK(lr > 0 && std::isfinite(lr), "learning-rate schedule: the rate must be positive, got ", lr);
  UNETCU_CHECK(warmup_steps >= 0 && warmup_steps <= kMaxWarmupSteps, "learning-rate schedule: the warmup must be 0..",
               kMaxWarmupSteps, " steps, got ", warmup_steps);
  UNETCU_CHECK(min_lr >= 0 && min_lr <= lr, "learning-rate schedule: the final rate must be in 0..", lr, ", got ",
               min_lr);
  UNETCU_CHECK(power > 0 && power <= kMaxLrPower, "learning-rate schedule: the power must be in (0, ", kMaxLrPower,
               "], got ", power);
  UNETCU_CHECK(step_epochs >= 1, "learning-rate schedule: the epochs between decays must be at least 1, got ",
               step_epochs);
  UNETCU_CHECK(gamma > 0 && gamma <= 1, "learning-rate schedule: the decay factor must be in (0, 1], got ", gamma);
  UNETCU_CHECK(total_steps <= 0 || warmup_steps <= 1 || warmup_steps < total_steps, "learning-rate schedule: a warmup of ",
               warmup_steps, " steps leaves no step at the full rate: the run has ", total_steps, " steps");
}

double LrSchedule::at(int64_t t, int64_t steps_per_epoch, int64_t total_steps) const {
  const int64_t W = warmup_steps > 1 ? warmup_steps : 0;  // one warmup step is none
  // Progress after the warmup, 0 at step W; a run no longer than its warmup stays at 0.
  const double p = t <= W || total_steps <= W ? 0.0 : double(t - W) / double(total_steps - W);
  double rate = lr;
  switch (kind) {
    case LrScheduleKind::Constant:
      break;
    case LrScheduleKind::Cosine:
      rate = min_lr + (lr - min_lr) * (1 + std::cos(M_PI * p)) / 2;
      break;
    case LrScheduleKind::Poly:
      rate = lr * std::pow(1 - p, power);
      break;
    case LrScheduleKind::Step: {
      const int64_t epoch = steps_per_epoch > 0 ? t / steps_per_epoch : 0;  // 0-based
      rate = lr * std::pow(gamma, double(epoch / step_epochs));
      break;
    }
  }
  if (t < W) rate *= double(t + 1) / double(W);
  return rate;
}

std::string LrSchedule::describe() const {
  std::string s = name_of(kLrScheduleNames, kind);
  switch (kind) {
    case LrScheduleKind::Constant:
      break;
    case LrScheduleKind::Cosine:
      s += str_cat(" to ", min_lr);
      break;
    case LrScheduleKind::Poly:
      s += str_cat(" power ", power);
      break;
    case LrScheduleKind::Step:
      s += str_cat(" x", gamma, " every ", step_epochs, step_epochs == 1 ? " epoch" : " epochs");
      break;
  }
  if (warmup_steps > 1) s += str_cat(", ", warmup_steps, " warmup steps");
  return s;
}

}  // namespace unetcu
