// Learning-rate schedules (--lr-schedule, --warmup-steps): the rate of each optimizer step as
// PyTorch's schedulers give it when stepped once after every optimizer step. The rate of step t
// (0-based, counted over the whole run: t = (epoch - 1) · steps per epoch + step in the epoch)
// is a function of t alone, so a run resumed mid-epoch continues on the same curve and every
// replica and stage, in one process or several, computes the same rate.
//
//   constant  lr
//   cosine    min_lr + (lr - min_lr) · (1 + cos(π p)) / 2      CosineAnnealingLR(T_max = T - W)
//   poly      lr · (1 - p)^power                                PolynomialLR(total_iters = T - W)
//   step      lr · gamma^floor((epoch - 1) / step_epochs)       StepLR(step_size = step_epochs
//                                                                 epochs), epochs counted from 1
//
// with p = max(0, t - W) / (T - W) the progress after the warmup (T steps in the run, W warmup
// steps). Warmup multiplies the rate of steps t < W by (t + 1) / W: LinearLR(start_factor = 1/W,
// total_iters = W - 1), so the first step is not wasted and step W - 1 reaches the full rate;
// cosine and poly then start from lr at t = W (SequentialLR), step decay runs beside it
// (ChainedScheduler). tests/lr_schedule_test.sh compares the rates unet_train logs with
// torch.optim.lr_scheduler's.
#pragma once
#include <cstdint>
#include <string>

#include "engine/named.h"

namespace unetcu {

enum class LrScheduleKind { Constant, Cosine, Poly, Step };
inline constexpr NamedValue<LrScheduleKind> kLrScheduleNames[] = {{"constant", LrScheduleKind::Constant},
                                                                  {"cosine", LrScheduleKind::Cosine},
                                                                  {"poly", LrScheduleKind::Poly},
                                                                  {"step", LrScheduleKind::Step}};

// Bounds of the values a schedule takes (apps/ checks its flags against them too).
constexpr int64_t kMaxWarmupSteps = 1000000000;
constexpr double kMaxLrPower = 100;

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::Constant;
  double lr = 1e-3;            // the base rate (--lr)
  int64_t warmup_steps = 0;    // W; 0 or 1: none
  double min_lr = 0;           // cosine: the rate at the end of the run
  double power = 0.9;          // poly: the exponent (0.9: DeepLab's "poly" schedule)
  int step_epochs = 1;         // step: the rate is multiplied by gamma every this many epochs
  double gamma = 0.1;          // step

  // Whether the rate ever differs from lr (otherwise the epoch loop leaves the optimizers'
  // rates as they are).
  bool varies() const { return kind != LrScheduleKind::Constant || warmup_steps > 1; }
  // Throws an Error for values no schedule takes. `total_steps` (> 0 once the run's size is
  // known, else 0: not checked yet) must exceed the warmup.
  void check(int64_t total_steps = 0) const;
  // The rate of step t (0-based over the run) of a run of `total_steps` steps, `steps_per_epoch`
  // an epoch.
  double at(int64_t t, int64_t steps_per_epoch, int64_t total_steps) const;
  // "cosine to 1e-05 after 100 warmup steps" and the like, for the run's header.
  std::string describe() const;
};

}  // namespace unetcu
