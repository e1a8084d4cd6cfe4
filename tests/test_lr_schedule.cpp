// Learning-rate schedules (train/lr_schedule.h): each at its landmarks, from its formula. That
// the epoch loop gives every optimizer these rates is in test_strategies.cpp; that they are
// PyTorch's schedulers' rates, in tests/lr_schedule_test.sh.
#include <cmath>

#include "testing.h"
#include "train/lr_schedule.h"

using namespace unetcu;

namespace {

LrSchedule make(LrScheduleKind kind, int64_t warmup = 0) {
  LrSchedule s;
  s.kind = kind;
  s.lr = 0.01;
  s.warmup_steps = warmup;
  return s;
}

}  // namespace

TEST_CASE("learning-rate schedules at their landmarks") {
  const int64_t per_epoch = 10, T = 100;  // 10 epochs of 10 steps
  // The values below are a few roundings from exact: 1e-14 relative, unless said.
  auto near = [](double a, double b, double tol = 1e-14) { return std::abs(a - b) <= tol * std::abs(b); };

  SUBCASE("constant: lr at every step; with warmup, step t at (t+1)/W of it") {
    const LrSchedule c = make(LrScheduleKind::Constant);
    CHECK(!c.varies());
    for (int64_t t : {0, 1, 50, 99}) CHECK(c.at(t, per_epoch, T) == 0.01);
    const LrSchedule w = make(LrScheduleKind::Constant, 4);
    CHECK(w.varies());
    CHECK(near(w.at(0, per_epoch, T), 0.01 / 4));
    CHECK(near(w.at(2, per_epoch, T), 0.01 * 3 / 4));
    CHECK(w.at(3, per_epoch, T) == 0.01);
    CHECK(w.at(99, per_epoch, T) == 0.01);
    // One warmup step is none: its only step is at the full rate, and the decays start at 0.
    CHECK(!make(LrScheduleKind::Constant, 1).varies());
    CHECK(make(LrScheduleKind::Constant, 1).at(0, per_epoch, T) == 0.01);
    for (LrScheduleKind k : {LrScheduleKind::Cosine, LrScheduleKind::Poly})
      for (int64_t t : {0, 1, 2, 50, 99}) CHECK(make(k, 1).at(t, per_epoch, T) == make(k, 0).at(t, per_epoch, T));
    CHECK_NOTHROW(make(LrScheduleKind::Cosine, 1).check(1));
  }

  SUBCASE("cosine: lr after the warmup, halfway between lr and min_lr halfway, falling to min_lr") {
    LrSchedule s = make(LrScheduleKind::Cosine, 20);
    s.min_lr = 1e-4;
    CHECK(near(s.at(0, per_epoch, T), 0.01 / 20));
    CHECK(near(s.at(19, per_epoch, T), 0.01));
    CHECK(near(s.at(20, per_epoch, T), 0.01));                          // p = 0
    CHECK(near(s.at(60, per_epoch, T), (0.01 + 1e-4) / 2));            // p = 1/2
    // p = 79/80 at the last step: min_lr + (lr - min_lr)(1 + cos(79π/80))/2, just above min_lr.
    const double last = s.at(99, per_epoch, T);
    CHECK(near(last, 1e-4 + (0.01 - 1e-4) * (1 + std::cos(M_PI * 79 / 80)) / 2));
    CHECK(last > 1e-4);
    for (int64_t t = 20; t < 99; ++t) CHECK(s.at(t + 1, per_epoch, T) < s.at(t, per_epoch, T));
  }

  SUBCASE("poly: lr (1 - p)^power after the warmup") {
    LrSchedule s = make(LrScheduleKind::Poly);
    s.power = 2;
    CHECK(s.at(0, per_epoch, T) == 0.01);
    CHECK(near(s.at(50, per_epoch, T), 0.01 / 4));
    // 1 - 99/100 carries 99/100's rounding (5.6e-17) into 0.01: 1.1e-14 relative once squared.
    CHECK(near(s.at(99, per_epoch, T), 0.01 * 1e-4, 1e-13));
    s.warmup_steps = 10;
    CHECK(near(s.at(4, per_epoch, T), 0.01 * 5 / 10));
    CHECK(near(s.at(55, per_epoch, T), 0.01 / 4));  // p = 45/90
  }

  SUBCASE("step: lr gamma^floor(epoch / step_epochs), epochs from 0, beside the warmup") {
    LrSchedule s = make(LrScheduleKind::Step, 5);
    s.step_epochs = 3;
    s.gamma = 0.5;
    CHECK(near(s.at(0, per_epoch, T), 0.01 / 5));
    CHECK(s.at(29, per_epoch, T) == 0.01);        // epoch 3 (1-based) still at lr
    CHECK(s.at(30, per_epoch, T) == 0.005);       // epoch 4
    CHECK(s.at(60, per_epoch, T) == 0.0025);      // epoch 7
    CHECK(near(s.at(99, per_epoch, T), 0.00125));  // epoch 10
    // Decay and warmup multiply: one epoch of 2 steps decayed once inside a 4-step warmup.
    s.step_epochs = 1;
    s.warmup_steps = 4;
    CHECK(near(s.at(3, 2, 8), 0.01 * 0.5 * 4 / 4));
    CHECK(near(s.at(2, 2, 8), 0.01 * 0.5 * 3 / 4));
  }

  SUBCASE("descriptions") {
    LrSchedule s = make(LrScheduleKind::Cosine, 100);
    s.min_lr = 1e-5;
    CHECK(s.describe() == "cosine to 1e-05, 100 warmup steps");
    s = make(LrScheduleKind::Step);
    s.step_epochs = 30;
    CHECK(s.describe() == "step x0.1 every 30 epochs");
    CHECK(make(LrScheduleKind::Poly).describe() == "poly power 0.9");
  }
}

TEST_CASE("learning-rate schedules refuse what no schedule takes") {
  // unet_train names its flags in its own messages (tests/cli_test.sh).
  LrSchedule s = make(LrScheduleKind::Cosine);
  CHECK_NOTHROW(s.check());
  s.min_lr = 0.02;
  CHECK_THROWS_WITH(s.check(), doctest::Contains("the final rate must be in 0..0.01, got 0.02"));
  s = make(LrScheduleKind::Poly);
  s.power = 0;
  CHECK_THROWS_WITH(s.check(), doctest::Contains("the power must be in (0, 100]"));
  s = make(LrScheduleKind::Step);
  s.gamma = 1.5;
  CHECK_THROWS_WITH(s.check(), doctest::Contains("the decay factor must be in (0, 1]"));
  s = make(LrScheduleKind::Step);
  s.step_epochs = 0;
  CHECK_THROWS_WITH(s.check(), doctest::Contains("the epochs between decays must be at least 1"));
  s = make(LrScheduleKind::Constant, -1);
  CHECK_THROWS_WITH(s.check(), doctest::Contains("the warmup must be 0.."));
  s = make(LrScheduleKind::Cosine, 10);
  CHECK_NOTHROW(s.check(11));
  CHECK_THROWS_WITH(s.check(10), doctest::Contains("a warmup of 10 steps leaves no step at the full rate: the run "
                                                   "has 10 steps"));
}
