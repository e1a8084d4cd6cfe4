// The watch on a validation metric (train/monitor.h): the best epoch and the early stop of a
// sequence of values, in both directions, with and without a smallest improvement; its record
// through a checkpoint and back, and the records it refuses. That the epoch loop saves the best
// epoch's model and stops where the monitor says, in every mode and across a resume, is in
// test_strategies.cpp.
#include <cmath>
#include <cstdio>
#include <vector>

#include "engine/checkpoint.h"
#include "models/unet.h"
#include "testing.h"
#include "train/monitor.h"

using namespace unetcu;

namespace {

struct Run {
  std::vector<int> best_epochs;  // the epochs a best checkpoint would be written after
  int stopped = 0;               // the epoch the patience ran out at (0: never)
};

Run watch(MonitorOptions o, const std::vector<double>& values) {
  MetricMonitor m(o);
  Run r;
  for (size_t i = 0; i < values.size(); ++i) {
    const int epoch = int(i) + 1;
    const auto v = m.update(epoch, values[i]);
    if (v.best) r.best_epochs.push_back(epoch);
    if (v.stop) {
      r.stopped = epoch;
      break;
    }
  }
  return r;
}

}  // namespace

TEST_CASE("the monitor: best epochs and the early stop of a sequence of values") {
  MonitorOptions o;
  SUBCASE("val_iou: higher is better; a tie is no improvement") {
    o.patience = 3;
    const Run r = watch(o, {0.5, 0.6, 0.6, 0.55, 0.7, 0.69, 0.7, 0.65, 0.8});
    CHECK(r.best_epochs == std::vector<int>{1, 2, 5});
    CHECK(r.stopped == 8);  // 6, 7 and 8 do not beat 0.7
  }
  SUBCASE("val_loss: lower is better") {
    o.metric = MonitorKind::ValLoss;
    o.patience = 3;
    const Run r = watch(o, {1.0, 0.9, 0.95, 0.8, 0.85, 0.81, 0.8, 0.7});
    CHECK(r.best_epochs == std::vector<int>{1, 2, 4});
    CHECK(r.stopped == 7);
  }
  SUBCASE("patience 0 never stops") {
    o.metric = MonitorKind::ValDice;
    const Run r = watch(o, {0.5, 0.4, 0.3, 0.2, 0.1});
    CHECK(r.best_epochs == std::vector<int>{1});
    CHECK(r.stopped == 0);
  }
  SUBCASE("a smallest improvement: small gains still make a best epoch but do not reset the patience") {
    o.patience = 3;
    o.min_delta = 0.05;
    // 0.52 and 0.54 are best epochs but within 0.05 of the reference 0.5; 0.56 beats it
    // (a reference of 0.56 follows); 0.6 is within 0.05 of 0.56.
    const Run r = watch(o, {0.5, 0.52, 0.54, 0.56, 0.6, 0.6, 0.59});
    CHECK(r.best_epochs == std::vector<int>{1, 2, 3, 4, 5});
    CHECK(r.stopped == 7);
  }
  SUBCASE("one epoch of patience stops at the first epoch without improvement") {
    o.patience = 1;
    CHECK(watch(o, {0.1, 0.2, 0.3, 0.3, 0.4}).stopped == 4);
  }
  SUBCASE("values no monitor takes") {
    o.patience = -1;
    CHECK_THROWS_WITH_AS(MetricMonitor{o}, doctest::Contains("patience must be in 0..100000"), Error);
    o.patience = 1;
    o.min_delta = -0.1;
    CHECK_THROWS_WITH_AS(MetricMonitor{o}, doctest::Contains("a finite number >= 0, got -0.1"), Error);
    o.min_delta = 0;
    MetricMonitor m(o);
    CHECK_THROWS_AS(m.update(1, NAN), Error);
  }
}

TEST_CASE("the monitor's record comes back exactly through a checkpoint, and a damaged one is refused") {
  MonitorOptions o;
  o.patience = 3;
  o.min_delta = 0.01;
  MetricMonitor a(o);
  // Values that "%.6g" would not give back.
  a.update(1, 0.1 + 0.2);
  a.update(2, 0.30000000000000004 + 1e-16);
  a.update(3, 1.0 / 3.0);
  const RunRecord record = a.record();
  CHECK(record.at("monitor") == "val_iou");

  UNetConfig cfg;
  cfg.width_divisor = 32;
  UNet model(cfg);
  Adam adam(model.parameters());
  const std::string path = "monitor_record.safetensors";
  save_checkpoint(path, model, {&adam}, 3, 0, record);
  RunRecord back;
  int64_t step = -1;
  CHECK(load_checkpoint(path, model, {&adam}, &step, &back) == 3);
  CHECK(back == record);
  MetricMonitor b(o);
  REQUIRE(b.restore(back, 3, path));
  CHECK(b.best() == a.best());
  CHECK(b.best_epoch() == a.best_epoch());
  CHECK(b.stale() == a.stale());
  CHECK(b.reference() == a.reference());
  // The two go on alike: the same verdicts for the same values.
  for (double v : {0.33, 0.34, 0.2, 0.2}) {
    const auto x = a.update(4, v), y = b.update(4, v);
    CHECK(x.best == y.best);
    CHECK(x.stop == y.stop);
  }
  CHECK(b.stale() == a.stale());

  // A record of another metric, or none, leaves a monitor fresh.
  MonitorOptions loss = o;
  loss.metric = MonitorKind::ValLoss;
  MetricMonitor c(loss);
  CHECK(!c.restore(record, 3, path));
  CHECK(!c.has_best());
  CHECK(!c.restore({}, 3, path));
  // A loss is not a ratio: past 1 it is still a record (epoch 1 set the reference, epoch 2 a
  // better value within the smallest improvement).
  CHECK(c.restore(
      {{"monitor", "val_loss"}, {"best", "1.25"}, {"best_epoch", "2"}, {"reference", "1.5"}, {"stale", "2"}}, 3, path));
  CHECK(c.best() == 1.25);

  // Damaged values: each refused with the file's name and what is wrong.
  auto refused = [&](const std::string& key, const std::string& value, const char* says) {
    RunRecord r = record;
    r[key] = value;
    MetricMonitor m(o);
    CAPTURE(key);
    CAPTURE(value);
    CHECK_THROWS_WITH_AS(m.restore(r, 3, path), doctest::Contains(says), Error);
    CHECK(!m.has_best());  // nothing taken from a record refused
  };
  refused("best", "nan", "has a best that is not a finite number: 'nan'");
  refused("best", "0.5x", "not a finite number");
  refused("reference", "", "not a finite number");
  refused("best_epoch", "4", "has best_epoch '4', not a whole number in 1..3");
  refused("best_epoch", "0", "not a whole number in 1..3");
  refused("stale", "3", "has stale '3', not a whole number in 0..2");
  refused("stale", "-1", "not a whole number");
  refused("reference", "0.9", "has a reference better than its best");
  refused("best", "1.5", "has a value no val_iou takes: 1.5");
  refused("reference", "-0.25", "has a value no val_iou takes: -0.25");
  // Epoch 3 moved the reference (stale 0), so it is the best's epoch too.
  REQUIRE(record.at("stale") == "0");
  refused("best_epoch", "2", "has best_epoch 2, before epoch 3 when its reference last moved");
  RunRecord missing = record;
  missing.erase("stale");
  MetricMonitor m(o);
  CHECK_THROWS_WITH_AS(m.restore(missing, 3, path), doctest::Contains("has no stale"), Error);

  // Run values too long for a checkpoint are refused when saved.
  CHECK_THROWS_AS(save_checkpoint(path, model, {&adam}, 3, 0, {{"monitor", std::string(100, 'x')}}), Error);
  std::remove(path.c_str());
  std::remove((path + ".train").c_str());
}
