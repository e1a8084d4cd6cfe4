// fit()'s callbacks (train/callbacks/), each on its own: its hooks called directly on a
// FitContext over a real, tiny strategy (one CPU, width / 16), without running fit(), so that
// a callback that is wrong fails here by name rather than somewhere in a whole run.
//  - Progress: the epoch line, field by field, and the per-stage peak of live micro-batches;
//  - MetricsFile: the lead process's file, step rows every log_every steps, the epoch row;
//  - Checkpoints: the files refused before training, the epoch and best checkpoints and their
//    run record, a NaN parameter refused with the last good file kept, the interrupt's
//    mid-epoch checkpoint and the resume from it;
//  - EarlyStopping: best and patience (with and without min_delta), its record round trip;
//  - ClipRecord: the optimizers' clip statistics into the epoch's figures;
//  - Interrupts: where a request stops the run and what Interrupted says;
//  - Profiling: the profiler on over the run, its summary and trace file.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "engine/checkpoint.h"
#include "engine/profiler.h"
#include "testing.h"
#include "train/callback.h"
#include "train/callbacks/checkpoints.h"
#include "train/callbacks/clip_record.h"
#include "train/callbacks/early_stopping.h"
#include "train/callbacks/interrupts.h"
#include "train/callbacks/metrics_file.h"
#include "train/callbacks/profiling.h"
#include "train/callbacks/progress.h"
#include "train/interrupt.h"
#include "train/strategy.h"
#include "train/trainer.h"

using namespace unetcu;

namespace {

// The strategy of tests/test_strategies.cpp's FitRun, and batches of its synthetic set.
struct Rig {
  SyntheticSegmentation synthetic{64, 7};
  SyntheticDataset train{synthetic, 0, 20};
  std::ostringstream out;
  FitOptions options;

  Rig() {
    options.epochs = 2;
    options.batch_size = 4;
    options.progress = false;
  }
  explicit Rig(const FitOptions& o) : options(o) {}
  static std::unique_ptr<TrainingStrategy> make(double max_grad_norm = 0) {
    StrategyConfig c;
    c.mode = Mode::Single;
    c.devices = {Device::cpu()};
    c.model.width_divisor = 16;
    c.optimizer = {OptimizerKind::Adam, 1e-2, 0.9, 0, max_grad_norm};
    std::ostringstream ignored;
    return make_strategy(c, nullptr, ignored);
  }
  // One optimizer step on one sample (a smaller batch: faster).
  double step(TrainingStrategy& s, int64_t sample = 0) {
    return s.step(s.place(make_batch(train, {sample}, DType::F32)));
  }
};

// fit()'s plan of the rig's run: 20 samples in steps of 4, 5 steps an epoch.
FitContext context(Rig& rig, TrainingStrategy& s, bool lead = true) {
  FitContext ctx(s, rig.options, rig.out, lead);
  ctx.steps = 5;
  ctx.total_steps = 5 * int64_t(rig.options.epochs);
  return ctx;
}

// The Checkpoints callback over a rig's context and strategy, with the EarlyStopping watch it
// asks whether an epoch is the best, both in the context's callbacks as fit() would have them.
struct Watched {
  Rig rig;
  std::unique_ptr<TrainingStrategy> s = Rig::make();
  FitContext ctx;
  EarlyStopping watch;
  Checkpoints checkpoints;
  explicit Watched(const FitOptions& options)
      : rig(options), ctx(context(rig, *s)), watch(rig.options), checkpoints(ctx, watch) {
    ctx.callbacks = {&checkpoints, &watch};
  }
  // The rig's run, saving each epoch to `checkpoint` and the best to `best`.
  Watched(const std::string& checkpoint, const std::string& best) : Watched(saving(checkpoint, best)) {}
  static FitOptions saving(const std::string& checkpoint, const std::string& best) {
    FitOptions o = Rig().options;
    o.checkpoint = checkpoint;
    o.save_best = best;
    return o;
  }
};

// A strategy that only answers what the callbacks under test ask: the live micro-batches a
// pipeline reports after each step, and a process rank of several.
class FakeStrategy : public TrainingStrategy {
 public:
  FakeStrategy(int rank = 0, int count = 1)
      : TrainingStrategy(LossKind::BCEDice, {Device::cpu()}, Device::cpu(), {1, rank, count, rank, count}) {}
  // What a pipeline reports after a step.
  void set_live(std::vector<int> live) { live_micro_batches_ = std::move(live); }
  std::string describe() const override { return "fake"; }
  PlacedBatch place(Batch) override { throw Error("fake strategy: no place"); }
  StepLoss step_async(const PlacedBatch&) override { throw Error("fake strategy: no step"); }
  Tensor infer(const Tensor&) override { throw Error("fake strategy: no infer"); }
  void set_training(bool) override {}
  Module& model() override { throw Error("fake strategy: no model"); }
  std::vector<Optimizer*> optimizers() override { return {}; }
};

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(f, l);) lines.push_back(l);
  return lines;
}

bool exists(const std::string& path) { return std::filesystem::exists(path); }

void remove_checkpoint(const std::string& p) {
  std::remove(p.c_str());
  std::remove((p + ".train").c_str());
}

// What a checkpoint holds: its epoch, step and run record, loaded into a fresh strategy.
struct Loaded {
  int epoch = 0;
  int64_t step = -1;
  RunRecord record;
};
Loaded load(const std::string& path) {
  auto s = Rig::make();
  Loaded l;
  l.epoch = load_checkpoint(path, s->model(), s->optimizers(), &l.step, &l.record);
  return l;
}

// An epoch's figures, every one set to a value whose printed form is known.
EpochStats figures() {
  EpochStats st;
  st.epoch = 2;
  st.seconds = 1.5;
  st.train_loss = 0.123456;   // %.4f: 0.1235
  st.val_loss = 0.5;
  st.val_iou = 0.25;
  st.val_dice = 0.4;
  st.images_per_second = 13.34;  // %.1f: 13.3
  st.images = 20;
  st.lr = 0.001;
  st.peak_device_bytes = size_t(3) << 20;  // 3 MiB
  st.load_seconds = 2;                     // 20 images: 10 img/s
  st.wait_seconds = 0.25;
  return st;
}

}  // namespace

TEST_CASE("callback Progress: the epoch line, field by field, with clip figures, a schedule's lr, live micro-batches") {
  const std::string base =
      "epoch 2/5  time 1.50s  loss 0.1235  val_loss 0.5000  val_iou 0.2500  val_dice 0.4000  13.3 img/s"
      "  peak_mem 3 MiB  loader 10 img/s, waited 0.25s";
  EpochStats st = figures();
  CHECK(Progress::epoch_line(st, 5, false, {}) == base + "\n");
  // A schedule's rate only where the rate varies.
  CHECK(Progress::epoch_line(st, 5, true, {}) == base + "  lr 0.001\n");
  // No loader time: 0 img/s, not a division by zero.
  {
    EpochStats idle = st;
    idle.load_seconds = 0;
    CHECK(Progress::epoch_line(idle, 5, false, {}).find("  loader 0 img/s, waited 0.25s") != std::string::npos);
  }
  // Clip figures only where clipping saw steps.
  st.grad_norm = 1.5;
  st.grad_norm_max = 3.25;
  CHECK(Progress::epoch_line(st, 5, false, {}) == base + "\n");
  st.clip_steps = 5;
  st.clip_clipped = 2;
  CHECK(Progress::epoch_line(st, 5, false, {}) == base + "  grad_norm 1.5 (max 3.25, 2/5 clipped)\n");
  CHECK(Progress::epoch_line(st, 5, true, {4, 1}) ==
        base + "  grad_norm 1.5 (max 3.25, 2/5 clipped)  lr 0.001  live_micro_batches 4 1\n");
}

TEST_CASE("callback Progress: the epoch line printed at the epoch's end, with each stage's most live micro-batches") {
  Rig rig;
  rig.options.epochs = 5;
  FakeStrategy fake;
  FitContext ctx = context(rig, fake);
  Progress progress;
  const EpochStats st = figures();
  ctx.epoch = 2;
  progress.on_epoch_start(ctx);
  // Per stage, the most over the epoch's steps (not the last step's, nor the sum).
  for (const std::vector<int>& live : {std::vector<int>{1, 2}, {3, 1}, {2, 2}}) {
    fake.set_live(live);
    progress.on_step_end(ctx, 1);
  }
  progress.on_train_epoch_end(ctx);
  progress.on_epoch_end(ctx, st);
  CHECK(rig.out.str() == Progress::epoch_line(st, 5, false, {3, 2}));
  CHECK(rig.out.str().find("  live_micro_batches 3 2\n") != std::string::npos);
  // The next epoch starts its own record; a schedule adds its rate.
  rig.out.str("");
  ctx.scheduled = true;
  progress.on_epoch_start(ctx);
  fake.set_live({1, 1});
  progress.on_step_end(ctx, 1);
  progress.on_epoch_end(ctx, st);
  CHECK(rig.out.str() == Progress::epoch_line(st, 5, true, {1, 1}));
  // A strategy without a pipeline reports none.
  rig.out.str("");
  auto single = Rig::make();
  FitContext one = context(rig, *single);
  progress.on_epoch_start(one);
  progress.on_step_end(one, 1);
  progress.on_epoch_end(one, st);
  CHECK(rig.out.str() == Progress::epoch_line(st, 5, false, {}));
  CHECK(rig.out.str().find("live_micro_batches") == std::string::npos);
}

TEST_CASE("callback MetricsFile: the lead process's file, a step row every log_every steps, an epoch row") {
  Rig rig;
  rig.options.log = "cb_metrics.csv";
  rig.options.log_every = 2;
  auto s = Rig::make();
  FitContext ctx = context(rig, *s);
  const std::string header =
      "kind,epoch,step,time_s,train_loss,val_loss,val_iou,val_dice,images_per_s,lr,peak_mem_mib,loader_wait_s,"
      "grad_norm,grad_norm_max,clipped_fraction";
  {
    MetricsFile metrics;
    CHECK_FALSE(exists("cb_metrics.csv"));
    metrics.on_fit_start(ctx);
    CHECK(read_lines("cb_metrics.csv") == std::vector<std::string>{header});
    ctx.epoch = 1;
    // Step s: 0.5 s a step, 4 images a step (8 img/s), loss 1/s, rate 0.01.
    for (int64_t step = 1; step <= 5; ++step)
      metrics.on_step_loss(ctx, StepDone{step, 1.0 / double(step), 0.01, 0.5 * double(step), 4 * step});
    EpochStats st;
    st.epoch = 1;
    st.seconds = 2.5;
    st.train_loss = 0.25;
    st.val_loss = 0.5;
    st.val_iou = 0.75;
    st.val_dice = 0.875;
    st.images_per_second = 8;
    st.lr = 0.01;
    st.wait_seconds = 0.125;
    metrics.on_epoch_end(ctx, st);
    // Columns: time, loss, 3 validation ones, img/s, lr, peak memory (none on a CPU), wait, 3 clip ones.
    CHECK(read_lines("cb_metrics.csv") == std::vector<std::string>{
                                              header,
                                              "step,1,2,1,0.5,,,,8,0.01,,,,,",
                                              "step,1,4,2,0.25,,,,8,0.01,,,,,",
                                              "epoch,1,,2.5,0.25,0.5,0.75,0.875,8,0.01,,0.125,,,",
                                          });
  }
  // A resumed run appends; a fresh one starts anew; log_every 0 writes no step rows.
  {
    rig.options.resume = "cb_resumed.safetensors";
    rig.options.log_every = 0;
    MetricsFile metrics;
    metrics.on_fit_start(ctx);
    metrics.on_step_loss(ctx, StepDone{2, 1, 0.01, 1, 8});
    CHECK(read_lines("cb_metrics.csv").size() == 4);
    rig.options.resume.clear();
    MetricsFile fresh;
    fresh.on_fit_start(ctx);
    CHECK(read_lines("cb_metrics.csv") == std::vector<std::string>{header});
  }
  // Another process writes nothing.
  {
    rig.options.log = "cb_metrics_other.csv";
    rig.options.log_every = 1;
    FitContext other = context(rig, *s, false);
    other.epoch = 1;
    MetricsFile metrics;
    metrics.on_fit_start(other);
    metrics.on_step_loss(other, StepDone{1, 1, 0.01, 1, 8});
    metrics.on_epoch_end(other, EpochStats{});
    CHECK_FALSE(exists("cb_metrics_other.csv"));
  }
  std::remove("cb_metrics.csv");
}

TEST_CASE("callback Checkpoints: the files are refused before training") {
  Rig rig;
  auto s = Rig::make();
  EarlyStopping watch(rig.options);
  {
    rig.options.checkpoint = "cb_no_such_folder/c.safetensors";
    FitContext ctx = context(rig, *s);
    CHECK_THROWS_WITH(Checkpoints(ctx, watch),
                      doctest::Contains("cannot write the checkpoint 'cb_no_such_folder/c.safetensors': folder "
                                        "'cb_no_such_folder' does not exist"));
    // Only process 0 writes it, so only process 0 checks it.
    FitContext other = context(rig, *s, false);
    CHECK_NOTHROW(Checkpoints(other, watch));
  }
  {
    rig.options.checkpoint = "c.safetensors";
    rig.options.save_best = "cb_no_such_folder/b.safetensors";
    FitContext ctx = context(rig, *s);
    CHECK_THROWS_WITH(Checkpoints(ctx, watch), doctest::Contains("cannot write the best checkpoint"));
  }
  {
    rig.options.checkpoint = "cb_same.safetensors";
    rig.options.save_best = "./cb_same.safetensors";
    FitContext ctx = context(rig, *s);
    CHECK_THROWS_WITH(Checkpoints(ctx, watch), doctest::Contains("must be different files"));
  }
  // What a failure leaves: nothing to keep yet, or the configured file not overwritten.
  {
    rig.options.checkpoint = "cb_c.safetensors";
    rig.options.save_best.clear();
    FitContext ctx = context(rig, *s);
    Checkpoints checkpoints(ctx, watch);
    CHECK(ctx.kept == "; cb_c.safetensors was not overwritten");
    rig.options.checkpoint.clear();
    FitContext none = context(rig, *s);
    Checkpoints no_file(none, watch);
    CHECK(none.kept.empty());
  }
  CHECK_FALSE(exists("c.safetensors"));
  CHECK_FALSE(exists("cb_same.safetensors"));
}

TEST_CASE(
    "callback Checkpoints: the epoch's checkpoint with the run's record, the best only when best, a NaN refused") {
  Watched w("cb_epoch.safetensors", "cb_best.safetensors");
  auto& [rig, s, ctx, watch, checkpoints] = w;
  EpochStats st;
  // Epoch 1, the best so far: both files.
  ctx.epoch = 1;
  st.val_iou = 0.5;
  watch.on_validation_end(ctx, st);
  REQUIRE(watch.best_now());
  checkpoints.on_epoch_end(ctx, st);
  CHECK(rig.out.str() == "best val_iou so far (0.5000): saved to cb_best.safetensors\n");
  CHECK(ctx.kept == "; the checkpoint of epoch 1 is kept");
  for (const char* file : {"cb_epoch.safetensors", "cb_best.safetensors"}) {
    CAPTURE(file);
    const Loaded l = load(file);
    CHECK(l.epoch == 1);
    CHECK(l.step == 0);
    CHECK(l.record.at("steps_per_epoch") == "5");
    CHECK(l.record.at("total_steps") == "10");
    CHECK(l.record.at("monitor") == "val_iou");  // the watch's record goes with it
    CHECK(l.record.at("best_epoch") == "1");
    CHECK(l.record == ctx.record());
  }
  // Epoch 2, worse: the epoch's checkpoint only.
  rig.out.str("");
  ctx.epoch = 2;
  st.val_iou = 0.25;
  watch.on_validation_end(ctx, st);
  REQUIRE_FALSE(watch.best_now());
  checkpoints.on_epoch_end(ctx, st);
  CHECK(rig.out.str().empty());
  CHECK(load("cb_epoch.safetensors").epoch == 2);
  CHECK(load("cb_best.safetensors").epoch == 1);
  // Epoch 3, a parameter NaN: refused naming what is kept, and the files stay as they were.
  Tensor p = s->model().parameters().at(0);
  const double was = p.at(0);
  p.set(0, NAN);
  CHECK_FALSE(parameters_finite(s->model()));
  ctx.epoch = 3;
  st.val_iou = 0.75;
  watch.on_validation_end(ctx, st);
  REQUIRE(watch.best_now());
  CHECK_THROWS_WITH(checkpoints.on_epoch_end(ctx, st),
                    "a parameter is not finite after epoch 3; the checkpoint of epoch 2 is kept");
  CHECK(load("cb_epoch.safetensors").epoch == 2);
  CHECK(load("cb_best.safetensors").epoch == 1);
  p.set(0, was);
  CHECK(parameters_finite(s->model()));
  // Another process writes nothing.
  remove_checkpoint("cb_epoch.safetensors");
  remove_checkpoint("cb_best.safetensors");
  FitContext other = context(rig, *s, false);
  other.epoch = 3;
  checkpoints.on_epoch_end(other, st);
  CHECK_FALSE(exists("cb_epoch.safetensors"));
  CHECK_FALSE(exists("cb_best.safetensors"));
}

TEST_CASE("callback Checkpoints: an interrupt's checkpoint holds the steps done, and start() resumes from it") {
  Watched w("cb_int.safetensors", "cb_int_best.safetensors");
  auto& [rig, s, ctx, watch, checkpoints] = w;
  // Epoch 1 validated (the watch's record), then 3 steps of epoch 2 and the interrupt.
  ctx.epoch = 1;
  EpochStats st;
  st.val_iou = 0.5;
  watch.on_validation_end(ctx, st);
  ctx.epoch = 2;
  rig.step(*s);
  checkpoints.on_interrupt(ctx, 3);
  CHECK(ctx.interrupt_note == "checkpoint written to cb_int.safetensors (resuming continues from there)");
  const Loaded l = load("cb_int.safetensors");
  CHECK(l.epoch == 1);
  CHECK(l.step == 3);
  CHECK(l.record == ctx.record());
  CHECK_FALSE(exists("cb_int_best.safetensors"));  // an interrupt writes no best checkpoint
  // The resume: the model as saved, first_epoch and first_step, the line with the watch's part.
  FitOptions resuming = rig.options;
  resuming.resume = "cb_int.safetensors";
  Watched r(resuming);
  auto& [again, resumed, rctx, rwatch, rcheckpoints] = r;
  const RunRecord record = rcheckpoints.start(rctx);
  CHECK(rctx.first_epoch == 2);
  CHECK(rctx.first_step == 3);
  CHECK(record == l.record);
  CHECK(again.out.str() ==
        "resumed from cb_int.safetensors after epoch 1 and 3 steps of epoch 2; best val_iou 0.5000 at epoch 1, "
        "0 epochs without improvement\n");
  CHECK(rwatch.monitor().best() == 0.5);
  const Tensor a = s->model().parameters().at(0), b = resumed->model().parameters().at(0);
  CHECK(testing::max_abs_diff(a, b) == 0);
  // Nothing left to do: the checkpoint's epoch is the run's last.
  {
    Rig done;
    done.options.epochs = 1;
    done.options.resume = "cb_int.safetensors";
    auto t = Rig::make();
    FitContext dctx = context(done, *t);
    EarlyStopping dwatch(done.options);
    Checkpoints dcheckpoints(dctx, dwatch);
    CHECK_THROWS_WITH(dcheckpoints.start(dctx), doctest::Contains("nothing left to do with 1 epochs"));
  }
  // No training state beside the model: refused, saying so.
  std::remove("cb_int.safetensors.train");
  CHECK_THROWS_WITH(Checkpoints(rctx, rwatch).start(rctx), doctest::Contains("no cb_int.safetensors.train beside it"));
  // Another process leaves the file to process 0; no checkpoint configured, no note.
  remove_checkpoint("cb_int.safetensors");
  FitContext other = context(rig, *s, false);
  checkpoints.on_interrupt(other, 3);
  CHECK(other.interrupt_note == "checkpoint written by process 0");
  CHECK_FALSE(exists("cb_int.safetensors"));
  rig.options.checkpoint.clear();
  FitContext none = context(rig, *s);
  Checkpoints(none, watch).on_interrupt(none, 3);
  CHECK(none.interrupt_note == "no checkpoint was configured");
}

TEST_CASE("callback EarlyStopping: best, patience and the stop line, and its record restored counts on") {
  Rig rig;
  rig.options.epochs = 10;
  rig.options.monitor = {MonitorKind::ValLoss, 2, 0};
  auto s = Rig::make();
  FitContext ctx = context(rig, *s);
  EarlyStopping watch(rig.options);
  // val_loss: lower is better. Epochs 3 and 4 do not beat epoch 2's 0.8: stale 2 = patience.
  const double losses[] = {1.0, 0.8, 0.9, 0.85};
  const bool best[] = {true, true, false, false};
  for (int e = 1; e <= 4; ++e) {
    CAPTURE(e);
    ctx.epoch = e;
    EpochStats st;
    st.val_loss = losses[e - 1];
    st.val_iou = 1;  // not the metric watched
    watch.on_validation_end(ctx, st);
    CHECK(watch.best_now() == best[e - 1]);
    watch.on_epoch_end(ctx, st);
    CHECK(ctx.stop == (e == 4));
  }
  CHECK(rig.out.str() ==
        "early stop after epoch 4 of 10: val_loss has not improved for 2 epochs (best 0.8000 at epoch 2)\n");
  TrainResult result;
  rig.out.str("");
  watch.on_fit_end(ctx, result);
  CHECK(result.stopped_early);
  CHECK(result.best_epoch == 2);
  CHECK(result.best_value == 0.8);
  CHECK(rig.out.str() == "best val_loss 0.8000 at epoch 2\n");

  // The record, into a resumed run's watch (the checkpoint of epoch 4): the same best and stale
  // epochs, so one more epoch without improvement stops it, where a fresh watch would go on.
  RunRecord record;
  watch.save_state(record);
  CHECK(record.at("monitor") == "val_loss");
  CHECK(record.at("stale") == "2");
  Rig again;
  again.options = rig.options;
  again.options.resume = "cb_watch.safetensors";
  again.options.monitor.patience = 3;
  FitContext rctx = context(again, *s);
  rctx.first_epoch = 5;
  EarlyStopping resumed(again.options), fresh(again.options);
  std::ostringstream line;
  resumed.load_state(rctx, record, line);
  CHECK(line.str() == "; best val_loss 0.8000 at epoch 2, 2 epochs without improvement");
  CHECK(resumed.monitor().best() == 0.8);
  CHECK(resumed.monitor().best_epoch() == 2);
  CHECK(resumed.monitor().stale() == 2);
  RunRecord back;
  resumed.save_state(back);
  CHECK(back == record);
  rctx.epoch = 5;
  EpochStats st;
  st.val_loss = 0.81;
  resumed.on_validation_end(rctx, st);
  fresh.on_validation_end(rctx, st);
  CHECK_FALSE(resumed.best_now());
  CHECK(fresh.best_now());
  resumed.on_epoch_end(rctx, st);
  CHECK(rctx.stop);
  CHECK(again.out.str().find("early stop after epoch 5 of 10: val_loss has not improved for 3 epochs (best 0.8000 at "
                             "epoch 2)") != std::string::npos);
  rctx.stop = false;
  fresh.on_epoch_end(rctx, st);
  CHECK_FALSE(rctx.stop);
  // A record of another metric is none: counted from here.
  rctx.first_epoch = 5;
  again.options.monitor = {MonitorKind::ValIou, 2, 0};
  EarlyStopping iou(again.options);
  std::ostringstream none;
  iou.load_state(rctx, record, none);
  CHECK(none.str() == "; it holds no record of val_iou, counted from here");
  CHECK_FALSE(iou.monitor().has_best());
}

TEST_CASE(
    "callback EarlyStopping: min_delta names the value to beat, and neither the last epoch nor no patience stops") {
  Rig rig;
  rig.options.epochs = 10;
  rig.options.monitor = {MonitorKind::ValLoss, 2, 0.05};
  rig.options.save_best = "cb_es_best.safetensors";
  auto s = Rig::make();
  FitContext ctx = context(rig, *s);
  EarlyStopping watch(rig.options);
  // 0.97 and 0.96 are each the best, but neither beats 1.0 by more than 0.05.
  const double losses[] = {1.0, 0.97, 0.96};
  for (int e = 1; e <= 3; ++e) {
    CAPTURE(e);
    ctx.epoch = e;
    EpochStats st;
    st.val_loss = losses[e - 1];
    watch.on_validation_end(ctx, st);
    CHECK(watch.best_now());
    watch.on_epoch_end(ctx, st);
    CHECK(ctx.stop == (e == 3));
  }
  CHECK(rig.out.str() ==
        "early stop after epoch 3 of 10: val_loss has not improved on epoch 1's 1.0000 by more than 0.05 for 2 epochs "
        "(best 0.9600 at epoch 3)\n");
  rig.out.str("");
  TrainResult result;
  watch.on_fit_end(ctx, result);
  CHECK(result.best_epoch == 3);
  CHECK(result.best_value == 0.96);
  CHECK(rig.out.str() == "best val_loss 0.9600 at epoch 3 (cb_es_best.safetensors)\n");
  // The run's last epoch: it ends anyway, not early.
  {
    Rig last;
    last.options.epochs = 3;
    last.options.monitor = rig.options.monitor;
    FitContext lctx = context(last, *s);
    EarlyStopping lwatch(last.options);
    for (int e = 1; e <= 3; ++e) {
      lctx.epoch = e;
      EpochStats st;
      st.val_loss = losses[e - 1];
      lwatch.on_validation_end(lctx, st);
      lwatch.on_epoch_end(lctx, st);
    }
    CHECK_FALSE(lctx.stop);
    CHECK(last.out.str().empty());
    TrainResult r;
    lwatch.on_fit_end(lctx, r);
    CHECK_FALSE(r.stopped_early);
    CHECK(r.best_epoch == 3);
  }
  // No patience: never; no best file nor patience: nothing reported.
  {
    Rig never;
    never.options.epochs = 10;
    FitContext nctx = context(never, *s);
    EarlyStopping nwatch(never.options);
    for (int e = 1; e <= 5; ++e) {
      nctx.epoch = e;
      EpochStats st;
      st.val_iou = 0.5;
      nwatch.on_validation_end(nctx, st);
      CHECK(nwatch.best_now() == (e == 1));
      nwatch.on_epoch_end(nctx, st);
    }
    CHECK_FALSE(nctx.stop);
    TrainResult r;
    nwatch.on_fit_end(nctx, r);
    CHECK(r.best_epoch == 1);
    CHECK(never.out.str().empty());
  }
}

TEST_CASE("callback ClipRecord: the optimizers' clip statistics of the epoch, NaN without clipping") {
  Rig rig;
  // Measured, not clipped (an infinite largest norm): the gradients stay as the backward left
  // them, so their norm is the one recorded.
  auto s = Rig::make(INFINITY);
  FitContext ctx = context(rig, *s);
  ClipRecord clip;
  rig.step(*s);  // before the epoch: not its
  clip.on_epoch_start(ctx);
  rig.step(*s, 1);
  double square_sum = 0;
  for (const Tensor& p : s->optimizers().at(0)->params()) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    for (int64_t i = 0; i < g.numel(); ++i) square_sum += g.at(i) * g.at(i);
  }
  const double norm = std::sqrt(square_sum);
  REQUIRE(norm > 0);
  EpochStats st;
  clip.on_validation_end(ctx, st);
  CHECK(st.clip_steps == 1);
  CHECK(st.clip_clipped == 0);
  CHECK(st.clipped_fraction == 0);
  CHECK(st.grad_norm == doctest::Approx(norm).epsilon(1e-6));
  CHECK(st.grad_norm_max == doctest::Approx(norm).epsilon(1e-6));
  // Clipped by a norm every step exceeds: every step counted as clipped; the record was taken.
  s->optimizers().at(0)->set_max_grad_norm(1e-9);
  clip.on_epoch_start(ctx);
  rig.step(*s, 2);
  rig.step(*s, 3);
  EpochStats clipped;
  clip.on_validation_end(ctx, clipped);
  CHECK(clipped.clip_steps == 2);
  CHECK(clipped.clip_clipped == 2);
  CHECK(clipped.clipped_fraction == 1);
  CHECK(clipped.grad_norm > 0);
  CHECK(clipped.grad_norm_max >= clipped.grad_norm);
  // Nothing since: NaN and 0, as without clipping.
  EpochStats after;
  clip.on_validation_end(ctx, after);
  CHECK(after.clip_steps == 0);
  CHECK(std::isnan(after.grad_norm));
  // Without clipping.
  auto plain = Rig::make();
  FitContext pctx = context(rig, *plain);
  clip.on_epoch_start(pctx);
  rig.step(*plain);
  EpochStats none;
  clip.on_validation_end(pctx, none);
  CHECK(none.clip_steps == 0);
  CHECK(none.clip_clipped == 0);
  CHECK(std::isnan(none.grad_norm));
  CHECK(std::isnan(none.grad_norm_max));
  CHECK(std::isnan(none.clipped_fraction));
}

TEST_CASE("callback Interrupts: a request stops after the step (not the epoch's last) and Interrupted says where") {
  struct ClearInterrupt {  // also when a check throws
    ~ClearInterrupt() { clear_interrupt(); }
  } guard;
  clear_interrupt();
  Rig rig;
  rig.options.epochs = 3;
  FakeStrategy fake;
  FitContext ctx = context(rig, fake);
  Interrupts interrupts;
  ctx.epoch = 2;
  interrupts.on_step_end(ctx, 1);
  CHECK_FALSE(ctx.interrupted);
  request_interrupt();
  interrupts.on_step_end(ctx, 5);  // the epoch's last step: its validation first
  CHECK_FALSE(ctx.interrupted);
  interrupts.on_step_end(ctx, 2);
  CHECK(ctx.interrupted);
  CHECK_THROWS_WITH_AS(interrupts.on_interrupt(ctx, 2),
                       "interrupted at epoch 2 after step 2 of 5; no checkpoint was configured", Interrupted);
  ctx.interrupt_note = "checkpoint written to x.safetensors (resuming continues from there)";
  CHECK_THROWS_WITH_AS(interrupts.on_interrupt(ctx, 2),
                       "interrupted at epoch 2 after step 2 of 5; checkpoint written to x.safetensors (resuming "
                       "continues from there)",
                       Interrupted);
  // Between epochs: after the epoch's validation and checkpoint.
  ctx.epoch = 1;
  CHECK_THROWS_WITH_AS(interrupts.on_epoch_end(ctx, EpochStats{}),
                       "interrupted after epoch 1; no checkpoint was configured", Interrupted);
  rig.options.checkpoint = "cb_c.safetensors";
  CHECK_THROWS_WITH_AS(interrupts.on_epoch_end(ctx, EpochStats{}),
                       "interrupted after epoch 1; checkpoint written to cb_c.safetensors", Interrupted);
  // Not when the run ends after this epoch anyway.
  ctx.epoch = 3;
  CHECK_NOTHROW(interrupts.on_epoch_end(ctx, EpochStats{}));
  ctx.epoch = 1;
  ctx.stop = true;
  CHECK_NOTHROW(interrupts.on_epoch_end(ctx, EpochStats{}));
  // Nor without a request.
  ctx.stop = false;
  clear_interrupt();
  CHECK_NOTHROW(interrupts.on_epoch_end(ctx, EpochStats{}));
  ctx.interrupted = false;
  interrupts.on_step_end(ctx, 2);
  CHECK_FALSE(ctx.interrupted);
}

TEST_CASE("callback Profiling: on over the run, its summary printed and its trace written") {
  struct ProfilerOff {  // also when a check throws
    ~ProfilerOff() {
      Profiler::enable(false);
      Profiler::reset();
    }
  } guard;
  Rig rig;
  auto s = Rig::make();
  {
    rig.options.profile = "cb_no_such_folder/t.json";
    FitContext ctx = context(rig, *s);
    CHECK_THROWS_WITH(Profiling{ctx}, doctest::Contains("cannot write the profile trace 'cb_no_such_folder/t.json'"));
  }
  rig.options.profile = "cb_trace.json";
  FitContext ctx = context(rig, *s);
  Profiling profiling(ctx);
  // What was recorded before the run is not the run's.
  Profiler::enable(true);
  { ProfileRange before("cb_before", "op"); }
  profiling.on_fit_start(ctx);
  CHECK(Profiler::enabled());
  { ProfileRange during("cb_during", "op"); }
  TrainResult result;
  profiling.on_fit_end(ctx, result);
  CHECK_FALSE(Profiler::enabled());
  CHECK(rig.out.str().rfind("\nprofile (1 ranges; trace in cb_trace.json):\n", 0) == 0);
  CHECK(rig.out.str().find("cb_during") != std::string::npos);
  CHECK(rig.out.str().find("cb_before") == std::string::npos);
  {
    std::ifstream f("cb_trace.json");
    REQUIRE(f.good());
    const nlohmann::json trace = nlohmann::json::parse(f);
    int during = 0;
    for (const auto& e : trace.at("traceEvents")) {
      CHECK(e.at("name") != "cb_before");
      during += e.at("name") == "cb_during";
    }
    CHECK(during == 1);
  }
  std::remove("cb_trace.json");
  // Process 2 of 3 writes its own file.
  FakeStrategy third(2, 3);
  FitContext other = context(rig, third, false);
  Profiling theirs(other);
  theirs.on_fit_start(other);
  theirs.on_fit_end(other, result);
  CHECK(exists("cb_trace.json.rank2"));
  CHECK_FALSE(exists("cb_trace.json"));
  std::remove("cb_trace.json.rank2");
  // No trace asked for: the profiler stays off, nothing printed.
  rig.options.profile.clear();
  rig.out.str("");
  FitContext plain = context(rig, *s);
  Profiling off(plain);
  off.on_fit_start(plain);
  CHECK_FALSE(Profiler::enabled());
  off.on_fit_end(plain, result);
  CHECK(rig.out.str().empty());
}
