// The training strategies behind the one epoch loop: every feature in every mode.
//  - resume (DP, MP with both schedules) continues exactly like an uninterrupted run;
//  - checkpoints move between strategies (optimizer state keyed by parameter name);
//  - the loader's worker threads feed DP and MP without changing what they train on;
//  - place() puts each part where its step reads it;
//  - DP gradients live in the all-reduce buckets; the pipeline schedules on their own;
//  - a learning-rate schedule reaches every replica's and stage's optimizer, and resumes (a
//    resume into a run of another length says it follows the new curve);
//  - the best checkpoint and early stopping follow the monitored metric, across a resume;
//  - gradient accumulation: an optimizer step takes N batches in every mode, and resumes.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "train/run.h"
#include "data/dataset.h"
#include "engine/checkpoint.h"
#include "testing.h"
#include "train_runs.h"
#include "train/interrupt.h"
#include "train/metrics_log.h"
#include "train/strategy.h"
#include "train/trainer.h"

using namespace unetcu;
using testing::remove_checkpoint;
using testing::slurp;

namespace {

// A small run: width/16 at 64x64, 16 training images (two steps of 4 per replica with DP).
TrainConfig small_run(Mode mode) {
  TrainConfig cfg = testing::cpu_run(2, 64, 16, 4, 16);
  cfg.fit.batch_size = 4;
  cfg.strategy.optimizer.lr = 1e-2;
  cfg.strategy.mode = mode;
  if (mode != Mode::Single) cfg.device.reset(), cfg.strategy.devices = {Device::cpu(0), Device::cpu(1)};
  if (mode == Mode::MP) cfg.strategy.mp.split_size = 2;
  return cfg;
}

std::string name_of_case(const TrainConfig& c) {
  return std::string(name_of(kModeNames, c.strategy.mode)) + "_" + name_of(kScheduleNames, c.strategy.mp.schedule);
}

}  // namespace

TEST_CASE("resume after epoch 1 equals an uninterrupted run, byte for byte, in DP and MP") {
  std::vector<TrainConfig> cases = {small_run(Mode::DP), small_run(Mode::MP),
                                    small_run(Mode::MP)};
  cases[2].strategy.mp.schedule = Schedule::OneFOneB;
  cases[0].strategy.optimizer.kind = OptimizerKind::SGD;  // momentum state goes through the checkpoint too
  for (TrainConfig cfg : cases) {
    const std::string tag = name_of_case(cfg);
    CAPTURE(tag);
    testing::check_resume_equals_whole(cfg, "strategy_" + tag);
  }
}

TEST_CASE("a checkpoint moves between strategies with its optimizer state") {
  std::ostringstream log;
  // DP writes one; single mode, a pipeline and DP again each load it and write it back
  // unchanged: the state is keyed by parameter name, whoever holds the parameter.
  TrainConfig dp_cfg = small_run(Mode::DP);
  dp_cfg.fit.epochs = 1;
  dp_cfg.fit.checkpoint = "strategy_dp.safetensors";
  train_unet(dp_cfg, log);
  UNetConfig model;
  model.width_divisor = 16;
  const OptimizerFactory adam = optimizer_factory({OptimizerKind::Adam, 1e-2, 0.9, 0});
  std::vector<std::unique_ptr<TrainingStrategy>> strategies;
  model.device = Device::cpu(1);
  strategies.push_back(std::make_unique<SingleDeviceStrategy>(model, Placement{}, adam, LossKind::BCEDice));
  PipelineOptions po;
  po.devices = {Device::cpu(0), Device::cpu(1)};
  po.cuts = {6};  // after decoder.blocks.0: skips cross the cut
  po.split_size = 2;
  strategies.push_back(std::make_unique<PipelineStrategy>(model, po, adam, LossKind::BCEDice));
  DataParallelOptions dpo;
  dpo.devices = {Device::cpu(0), Device::cpu(1), Device::cpu(2)};
  strategies.push_back(std::make_unique<DataParallelStrategy>(model, dpo, adam, LossKind::BCEDice));
  for (auto& s : strategies) {
    CAPTURE(s->describe());
    RunRecord record;  // the run's record of its validation metric: passed through
    CHECK(load_checkpoint(dp_cfg.fit.checkpoint, s->model(), s->optimizers(), nullptr, &record) == 1);
    CHECK(record.count("best"));
    s->state_loaded();
    save_checkpoint("strategy_again.safetensors", s->model(), s->optimizers(), 1, 0, record,
                    read_checkpoint_settings(dp_cfg.fit.checkpoint));
    CHECK(slurp("strategy_again.safetensors") == slurp(dp_cfg.fit.checkpoint));
    CHECK(slurp("strategy_again.safetensors.train") == slurp(dp_cfg.fit.checkpoint + ".train"));
  }
  // DP: every replica got rank 0's state, optimizer included.
  auto& dp = static_cast<DataParallelStrategy*>(strategies[2].get())->data_parallel();
  for (int r = 1; r < dp.size(); ++r) {
    Optimizer& a = dp.optimizer(0);
    Optimizer& b = dp.optimizer(r);
    for (size_t i = 0; i < a.params().size(); ++i) {
      const auto sa = a.param_state(i), sb = b.param_state(i);
      for (size_t k = 0; k < sa.tensors.size(); ++k)
        REQUIRE(sa.tensors[k].second.to_vector() == sb.tensors[k].second.to_vector());
      for (size_t k = 0; k < sa.counters.size(); ++k) REQUIRE(*sa.counters[k].second == *sb.counters[k].second);
      REQUIRE(a.params()[i].to_vector() == b.params()[i].to_vector());
    }
    const auto s0 = dp.replica(0).state(), sr = dp.replica(r).state();  // BN statistics too
    REQUIRE(s0.size() == sr.size());
    for (size_t i = 0; i < s0.size(); ++i)
      if (!s0[i].is_parameter && s0[i].tensor.defined())
        REQUIRE(s0[i].tensor.to_vector() == sr[i].tensor.to_vector());
  }
  // The runs continue from it: single mode resumes the DP checkpoint, DP a single-mode one.
  TrainConfig single = small_run(Mode::Single);
  single.fit.resume = dp_cfg.fit.checkpoint;
  single.fit.checkpoint = "strategy_single.safetensors";
  const TrainResult r1 = train_unet(single, log);
  REQUIRE(r1.epochs.size() == 1);
  CHECK(r1.epochs[0].epoch == 2);
  TrainConfig back = small_run(Mode::DP);
  back.fit.epochs = 3;
  back.fit.resume = single.fit.checkpoint;
  const TrainResult r2 = train_unet(back, log);
  REQUIRE(r2.epochs.size() == 1);
  CHECK(r2.epochs[0].epoch == 3);
  // Another optimizer's state is named as such.
  TrainConfig sgd = small_run(Mode::MP);
  sgd.strategy.optimizer.kind = OptimizerKind::SGD;
  sgd.fit.resume = dp_cfg.fit.checkpoint;
  CHECK_THROWS_WITH(train_unet(sgd, log), doctest::Contains("holds adam state; this run uses sgd"));
  for (const auto& p : {dp_cfg.fit.checkpoint, std::string("strategy_again.safetensors"), single.fit.checkpoint})
    remove_checkpoint(p);
}

TEST_CASE("the loader's workers feed DP and MP: the same parameters with and without them") {
  const std::string dir = "strategy_folder_data";
  std::filesystem::remove_all(dir);
  write_synthetic_folder(dir, 20, 64, 3);
  for (Mode mode : {Mode::DP, Mode::MP}) {
    CAPTURE(name_of(kModeNames, mode));
    std::vector<std::vector<char>> files;
    for (int workers : {0, 2}) {
      TrainConfig cfg = small_run(mode);
      cfg.data.data = dir;
      cfg.data.val_fraction = 0.2;
      cfg.fit.augment = Augment::Heavy;
      cfg.fit.workers = workers;
      cfg.fit.checkpoint = "strategy_workers.safetensors";
      std::ostringstream log;
      train_unet(cfg, log);
      INFO(log.str());
      CHECK(log.str().find("16 train / 4 validation") != std::string::npos);
      files.push_back(slurp(cfg.fit.checkpoint));
      files.push_back(slurp(cfg.fit.checkpoint + ".train"));
      remove_checkpoint(cfg.fit.checkpoint);
    }
    CHECK(files[0] == files[2]);
    CHECK(files[1] == files[3]);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("MP: an epoch's smaller last batch trains, also when smaller than the split size") {
  for (int split : {0, 3}) {  // 0: micro-batches of the whole batch (4), then a last batch of 2
    CAPTURE(split);
    TrainConfig cfg = small_run(Mode::MP);
    cfg.fit.epochs = 1;
    cfg.data.train_size = 10;  // steps of 4, 4, 2
    cfg.strategy.mp.split_size = split;
    std::ostringstream log;
    const TrainResult r = train_unet(cfg, log);
    INFO(log.str());
    REQUIRE(r.epochs.size() == 1);
    CHECK(std::isfinite(r.epochs[0].train_loss));
  }
}

TEST_CASE("place() puts each part where its step reads it") {
  SyntheticSegmentation data(64, 4);
  const Batch host = data.batch({0, 1, 2, 3, 4, 5});
  UNetConfig model;
  model.width_divisor = 16;
  const OptimizerFactory sgd = optimizer_factory({OptimizerKind::SGD, 1e-2, 0.9, 0});
  SUBCASE("one device, cpu:2") {
    model.device = Device::cpu(2);
    SingleDeviceStrategy s(model, {}, sgd, LossKind::BCE);
    const PlacedBatch p = s.place(host);
    REQUIRE(p.parts.size() == 1);
    CHECK(p.parts[0].images.device() == Device::cpu(2));
    CHECK(p.parts[0].masks.device() == Device::cpu(2));
    CHECK(std::isfinite(s.step(p)));
  }
  SUBCASE("data parallel: replica r gets rows [r*b, (r+1)*b) on its device") {
    DataParallelOptions o;
    o.devices = {Device::cpu(0), Device::cpu(1), Device::cpu(2)};
    DataParallelStrategy s(model, o, sgd, LossKind::BCE);
    const PlacedBatch p = s.place(host);
    REQUIRE(p.parts.size() == 3);
    for (int r = 0; r < 3; ++r) {
      CHECK(p.parts[r].images.device() == Device::cpu(r));
      CHECK(p.parts[r].images.to_vector() == host.images.rows(2 * r, 2 * r + 2).to_vector());
      CHECK(p.parts[r].masks.to_vector() == host.masks.rows(2 * r, 2 * r + 2).to_vector());
    }
    CHECK_THROWS_WITH(s.place(data.batch({0, 1, 2, 3})), doctest::Contains("does not split into 3"));
  }
  SUBCASE("pipeline: micro-batches, images on the first stage, masks on the last") {
    PipelineOptions o;
    o.devices = {Device::cpu(3), Device::cpu(1)};
    o.cuts = {4};
    o.split_size = 4;
    PipelineStrategy s(model, o, sgd, LossKind::BCE);
    const PlacedBatch p = s.place(host);
    REQUIRE(p.parts.size() == 2);  // 4 + 2
    CHECK(p.parts[1].images.dim(0) == 2);
    for (const Batch& b : p.parts) {
      CHECK(b.images.device() == Device::cpu(3));
      CHECK(b.masks.device() == Device::cpu(1));
    }
    CHECK(p.parts[1].images.to_vector() == host.images.rows(4, 6).to_vector());
    CHECK(std::isfinite(s.step(p)));
  }
}

TEST_CASE("data parallel: the gradients are views into the all-reduce buckets") {
  UNetConfig model;
  model.width_divisor = 16;
  model.dtype = DType::F64;
  DataParallelOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1)};
  o.first_bucket_bytes = 4096;
  o.bucket_bytes = 64 << 10;
  DataParallelStrategy s(model, o, optimizer_factory({OptimizerKind::SGD, 1e-2, 0, 0}), LossKind::BCE);
  DataParallel& dp = s.data_parallel();
  SyntheticSegmentation data(64, 5);
  s.step(s.place(data.batch({0, 1, 2, 3}, DType::F64)));
  for (int r = 0; r < dp.size(); ++r) {
    const auto buckets = dp.buckets(r);
    REQUIRE(buckets.size() == dp.bucket_count());
    REQUIRE(buckets.size() > 2);
    int64_t in_buckets = 0;
    for (const Tensor& b : buckets) in_buckets += b.numel();
    CHECK(in_buckets >= dp.replica(r).parameter_count());  // with alignment padding
    for (const Tensor& p : dp.replica(r).parameters()) {
      const Tensor g = p.grad();
      REQUIRE(g.defined());
      bool inside = false;
      for (const Tensor& b : buckets) {
        const char* lo = static_cast<const char*>(b.raw());
        const char* at = static_cast<const char*>(g.raw());
        if (g.same_storage(b) && at >= lo && at + g.nbytes() <= lo + b.nbytes()) {
          inside = true;
          CHECK((at - lo) % 256 == 0);  // as aligned as the buffer, for cuDNN and the GEMMs
        }
      }
      CHECK(inside);
    }
  }
  // After the all-reduce both replicas hold the same averaged gradient, in place.
  const auto g0 = dp.replica(0).parameters(), g1 = dp.replica(1).parameters();
  for (size_t i = 0; i < g0.size(); ++i) REQUIRE(g0[i].grad().to_vector() == g1[i].grad().to_vector());
}

TEST_CASE("pipeline schedules: every micro-batch once forward then once backward, no deadlock") {
  using A = PipelineAction;
  CHECK(stage_schedule(Schedule::GPipe, 0, 2, 3) ==
        std::vector<A>{{A::Forward, 0}, {A::Forward, 1}, {A::Forward, 2},
                       {A::Backward, 0}, {A::Backward, 1}, {A::Backward, 2}});
  // 1F1B on the first of 3 stages: two forwards of warm-up, then alternate, then drain.
  CHECK(stage_schedule(Schedule::OneFOneB, 0, 3, 4) ==
        std::vector<A>{{A::Forward, 0}, {A::Forward, 1}, {A::Forward, 2}, {A::Backward, 0},
                       {A::Forward, 3}, {A::Backward, 1}, {A::Backward, 2}, {A::Backward, 3}});
  CHECK(stage_schedule(Schedule::OneFOneB, 2, 3, 4) ==
        std::vector<A>{{A::Forward, 0}, {A::Backward, 0}, {A::Forward, 1}, {A::Backward, 1},
                       {A::Forward, 2}, {A::Backward, 2}, {A::Forward, 3}, {A::Backward, 3}});
  for (Schedule sched : {Schedule::GPipe, Schedule::OneFOneB})
    for (int S = 1; S <= 5; ++S)
      for (int M = 1; M <= 7; ++M) {
        CAPTURE(int(sched));
        CAPTURE(S);
        CAPTURE(M);
        std::vector<std::vector<A>> plan;
        for (int s = 0; s < S; ++s) {
          plan.push_back(stage_schedule(sched, s, S, M));
          std::vector<int> fwd(M, 0), bwd(M, 0);
          int live = 0, peak = 0;
          for (const A& a : plan.back()) {
            if (a.kind == A::Forward) {
              REQUIRE(fwd[a.micro_batch]++ == 0);
              peak = std::max(peak, ++live);
            } else {
              REQUIRE(fwd[a.micro_batch] == 1);  // backward after its forward
              REQUIRE(bwd[a.micro_batch]++ == 0);
              --live;
            }
          }
          for (int m = 0; m < M; ++m) REQUIRE((fwd[m] == 1 && bwd[m] == 1));
          CHECK(peak == (sched == Schedule::GPipe ? M : std::min(M, S - s)));
        }
        // Run the stages' schedules against each other with the pipeline's dependencies
        // (F(s,m) after F(s-1,m); B(s,m) after B(s+1,m)): every stage must finish.
        std::vector<size_t> pos(S, 0);
        std::vector<std::vector<char>> fdone(S, std::vector<char>(M, 0)), bdone = fdone;
        for (bool moved = true; moved;) {
          moved = false;
          for (int s = 0; s < S; ++s) {
            if (pos[s] == plan[s].size()) continue;
            const A& a = plan[s][pos[s]];
            const bool ready = a.kind == A::Forward ? (s == 0 || fdone[s - 1][a.micro_batch])
                                                    : (s == S - 1 || bdone[s + 1][a.micro_batch]);
            if (!ready) continue;
            (a.kind == A::Forward ? fdone : bdone)[s][a.micro_batch] = 1;
            ++pos[s];
            moved = true;
          }
        }
        for (int s = 0; s < S; ++s) CHECK(pos[s] == plan[s].size());
      }
  CHECK_THROWS_WITH(stage_schedule(Schedule::GPipe, 2, 2, 1), doctest::Contains("stage 2 of 2"));
}

namespace {

// fit() on the synthetic set with a fresh strategy of `mode` (two CPU devices for DP).
struct FitRun {
  SyntheticSegmentation synthetic{64, 7};
  SyntheticDataset train{synthetic, 0, 20}, val{synthetic, 20, 4};
  std::unique_ptr<TrainingStrategy> make(Mode mode) {
    StrategyConfig c;
    c.mode = mode;
    c.devices = mode == Mode::Single ? std::vector<Device>{Device::cpu()}
                                     : std::vector<Device>{Device::cpu(0), Device::cpu(1)};
    c.model.width_divisor = 16;
    c.optimizer = {OptimizerKind::Adam, 1e-2, 0.9, 0};
    c.mp.cuts = {4};
    c.mp.split_size = 2;
    std::ostringstream ignored;
    return make_strategy(c, nullptr, ignored);
  }
  FitOptions options(const std::string& checkpoint) {
    FitOptions o;
    o.epochs = 2;
    o.batch_size = 4;
    o.progress = false;
    o.checkpoint = checkpoint;
    return o;
  }
};

}  // namespace

TEST_CASE("the metrics file: a row per epoch with what the epoch line says, step rows, appended on resume") {
  // 20 samples in steps of 4: 5 steps per epoch; step rows every 2 steps: steps 2 and 4.
  for (const char* name : {"metrics_test.csv", "metrics_test.jsonl"}) {
    CAPTURE(name);
    const bool jsonl = std::string(name).find(".jsonl") != std::string::npos;
    FitRun run;
    std::ostringstream log;
    FitOptions o = run.options("metrics_test.safetensors");
    o.log = name;
    o.log_every = 2;
    auto s = run.make(Mode::Single);
    const TrainResult r = fit(*s, run.train, run.val, o, log);
    auto read_lines = [&] {
      std::ifstream f(name);
      std::vector<std::string> lines;
      for (std::string l; std::getline(f, l);) lines.push_back(l);
      return lines;
    };
    std::vector<std::string> lines = read_lines();
    const size_t header = jsonl ? 0 : 1;
    REQUIRE(lines.size() == header + 2 * 3);  // per epoch: two step rows and the epoch row
    if (!jsonl) CHECK(lines[0].rfind("kind,epoch,step,time_s,train_loss,val_loss,val_iou,val_dice", 0) == 0);
    // The epoch rows carry the epoch's own figures (to the 9 digits written).
    for (int e = 0; e < 2; ++e) {
      const std::string& row = lines[header + 3 * e + 2];
      CAPTURE(row);
      const EpochStats& st = r.epochs[size_t(e)];
      char want[64];
      std::snprintf(want, sizeof want, "%.9g", st.val_iou);
      CHECK(row.find(want) != std::string::npos);
      std::snprintf(want, sizeof want, "%.9g", st.train_loss);
      CHECK(row.find(want) != std::string::npos);
      CHECK(row.find(jsonl ? "\"kind\": \"epoch\"" : "epoch,") == 0 + (jsonl ? 1 : 0));
      CHECK(row.find("0.01") != std::string::npos);  // the learning rate
      CHECK(lines[header + 3 * e].find(jsonl ? "\"step\": 2" : ",2,") != std::string::npos);
      CHECK(lines[header + 3 * e].find(jsonl ? "\"lr\": 0.01" : ",0.01,") != std::string::npos);  // its rate
    }
    // A resumed run appends; a fresh run starts the file anew.
    o.epochs = 3;
    o.resume = "metrics_test.safetensors";
    auto again = run.make(Mode::Single);
    fit(*again, run.train, run.val, o, log);
    CHECK(read_lines().size() == header + 3 * 3);
    o.resume.clear();
    o.epochs = 1;
    o.log_every = 0;
    auto fresh = run.make(Mode::Single);
    fit(*fresh, run.train, run.val, o, log);
    CHECK(read_lines().size() == header + 1);
    std::remove(name);
  }
  // A CSV whose header is not this run's (another program's, another version's columns) is not
  // appended to: its rows would fall into the wrong columns.
  {
    std::ofstream("metrics_test.csv") << "kind,epoch,step,time_s,train_loss\nepoch,1,,0.5,1.2\n";
    CHECK_THROWS_WITH(MetricsLog("metrics_test.csv", true),
                      doctest::Contains("has other columns than this run writes"));
    std::ifstream f("metrics_test.csv");
    const std::string kept((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    CHECK(kept == "kind,epoch,step,time_s,train_loss\nepoch,1,,0.5,1.2\n");  // untouched
    std::remove("metrics_test.csv");
  }
  std::remove("metrics_test.safetensors");
  std::remove("metrics_test.safetensors.train");
}

TEST_CASE("an interrupted run saves mid-epoch and its resume ends where an uninterrupted run ends") {
  for (Mode mode : {Mode::Single, Mode::DP, Mode::MP}) {
    CAPTURE(name_of(kModeNames, mode));
    FitRun run;
    std::ostringstream log;
    // Uninterrupted.
    auto whole = run.make(mode);
    fit(*whole, run.train, run.val, run.options("strategy_int_whole.safetensors"), log);
    // Interrupted after step 1 of epoch 2 (as the first Ctrl-C does), then resumed.
    auto first = run.make(mode);
    FitOptions o = run.options("strategy_int.safetensors");
    o.on_step = [](int epoch, int64_t step) {
      if (epoch == 2 && step == 1) request_interrupt();
    };
    CHECK_THROWS_WITH_AS(fit(*first, run.train, run.val, o, log),
                         doctest::Contains("interrupted at epoch 2 after step 1"), Interrupted);
    clear_interrupt();
    std::filesystem::copy_file("strategy_int.safetensors", "strategy_int_mid.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    std::filesystem::copy_file("strategy_int.safetensors.train", "strategy_int_mid.safetensors.train",
                               std::filesystem::copy_options::overwrite_existing);
    auto rest = run.make(mode);
    FitOptions r = run.options("strategy_int.safetensors");
    r.resume = "strategy_int.safetensors";
    fit(*rest, run.train, run.val, r, log);
    INFO(log.str());
    CHECK(log.str().find("note:") == std::string::npos);
    // Resumed mid-epoch with another batch size, the epoch has other steps: the run says where
    // it continues.
    auto smaller = run.make(mode);
    FitOptions b = run.options("");
    b.batch_size = 2;
    b.resume = "strategy_int_mid.safetensors";
    std::ostringstream smaller_log;
    fit(*smaller, run.train, run.val, b, smaller_log);
    CHECK(smaller_log.str().find(str_cat(
              "note: epoch 2 had ", steps_per_epoch(run.train.size(), rest->layout().replicas, 4),
              " steps in the resumed run and has ", steps_per_epoch(run.train.size(), rest->layout().replicas, 2),
              " in this one: it continues at step 2\n")) != std::string::npos);
    remove_checkpoint("strategy_int_mid.safetensors");
    CHECK(log.str().find("resumed from strategy_int.safetensors after epoch 1 and 1 steps of epoch 2") !=
          std::string::npos);
    CHECK(slurp("strategy_int.safetensors") == slurp("strategy_int_whole.safetensors"));
    CHECK(slurp("strategy_int.safetensors.train") == slurp("strategy_int_whole.safetensors.train"));
    remove_checkpoint("strategy_int.safetensors");
    remove_checkpoint("strategy_int_whole.safetensors");
  }
}

namespace {

// Every optimizer that steps: each DP replica's and each pipeline stage's.
std::vector<Optimizer*> stepping_optimizers(TrainingStrategy& s) {
  std::vector<Optimizer*> out;
  if (auto* dp = dynamic_cast<DataParallelStrategy*>(&s)) {
    for (int r = 0; r < dp->data_parallel().size(); ++r) out.push_back(&dp->data_parallel().optimizer(r));
  } else if (auto* mp = dynamic_cast<PipelineStrategy*>(&s)) {
    for (const auto& o : mp->pipeline().optimizers()) out.push_back(o.get());
  } else {
    out = s.optimizers();
  }
  return out;
}

}  // namespace

TEST_CASE("a learning-rate schedule reaches every optimizer at every step, in every mode, and resumes on its curve") {
  LrSchedule schedule;
  schedule.kind = LrScheduleKind::Cosine;
  schedule.lr = 1e-2;  // FitRun's optimizers'
  schedule.warmup_steps = 3;
  schedule.min_lr = 1e-4;
  for (Mode mode : {Mode::Single, Mode::DP, Mode::MP}) {
    CAPTURE(name_of(kModeNames, mode));
    FitRun run;
    std::ostringstream log;
    auto whole = run.make(mode);
    const int64_t steps = steps_per_epoch(run.train.size(), whole->layout().replicas, 4), total = 2 * steps;
    FitOptions o = run.options("strategy_lr_whole.safetensors");
    o.lr_schedule = schedule;
    // Each step's hook comes after its optimizers stepped at the rate set before it.
    int64_t seen = 0;
    o.on_step = [&](int epoch, int64_t step) {
      const double rate = schedule.at((epoch - 1) * steps + step - 1, steps, total);
      for (Optimizer* opt : stepping_optimizers(*whole)) {
        CHECK(opt->lr() == rate);
        ++seen;
      }
    };
    fit(*whole, run.train, run.val, o, log);
    const size_t optimizers = stepping_optimizers(*whole).size();
    CHECK(optimizers == (mode == Mode::Single ? 1u : 2u));
    CHECK(seen == total * int64_t(optimizers));
    INFO(log.str());
    CHECK(log.str().find("  lr ") != std::string::npos);  // the epoch lines give the rate
    if (auto* dp = dynamic_cast<DataParallelStrategy*>(whole.get())) {  // the replicas stay equal
      const auto a = dp->data_parallel().replica(0).parameters(), b = dp->data_parallel().replica(1).parameters();
      for (size_t i = 0; i < a.size(); ++i) CHECK(a[i].to_vector() == b[i].to_vector());
    }
    // Interrupted after step 1 of epoch 2, then resumed: the same bits as the whole run.
    auto first = run.make(mode);
    FitOptions f = run.options("strategy_lr.safetensors");
    f.lr_schedule = schedule;
    f.on_step = [](int epoch, int64_t step) {
      if (epoch == 2 && step == 1) request_interrupt();
    };
    CHECK_THROWS_AS(fit(*first, run.train, run.val, f, log), Interrupted);
    clear_interrupt();
    auto rest = run.make(mode);
    FitOptions r = run.options("strategy_lr.safetensors");
    r.lr_schedule = schedule;
    r.resume = "strategy_lr.safetensors";
    std::ostringstream rest_log;
    fit(*rest, run.train, run.val, r, rest_log);
    CHECK(slurp("strategy_lr.safetensors") == slurp("strategy_lr_whole.safetensors"));
    CHECK(slurp("strategy_lr.safetensors.train") == slurp("strategy_lr_whole.safetensors.train"));
    CHECK(rest_log.str().find("note:") == std::string::npos);  // the same plan: nothing to say
    // A longer run from the whole run's checkpoint follows its own curve, and says so.
    auto longer = run.make(mode);
    FitOptions l = run.options("");
    l.lr_schedule = schedule;
    l.epochs = 3;
    l.resume = "strategy_lr_whole.safetensors";
    std::ostringstream longer_log;
    fit(*longer, run.train, run.val, l, longer_log);
    INFO(longer_log.str());
    const std::string note = str_cat("note: the resumed run was ", total, " steps long and this one is ", 3 * steps,
                                     ": from step ", total + 1, " the learning rate follows this run's schedule");
    CHECK(longer_log.str().find(note) != std::string::npos);
    // The rates reach the arithmetic: without the schedule the weights differ.
    auto plain = run.make(mode);
    fit(*plain, run.train, run.val, run.options("strategy_lr.safetensors"), log);
    CHECK(slurp("strategy_lr.safetensors") != slurp("strategy_lr_whole.safetensors"));
    remove_checkpoint("strategy_lr.safetensors");
    remove_checkpoint("strategy_lr_whole.safetensors");
  }
}

TEST_CASE("a non-finite loss or parameter stops training and keeps the last good checkpoint") {
  FitRun run;
  std::ostringstream log;
  auto s = run.make(Mode::Single);
  FitOptions o = run.options("strategy_nan.safetensors");
  o.epochs = 3;
  // After epoch 1's checkpoint, poison a parameter at the last step of epoch 2: the validation
  // (and the check before saving) must refuse it.
  o.on_step = [&](int epoch, int64_t step) {
    if (epoch == 2 && step == 5) s->model().parameters().back().set(0, std::nan(""));
  };
  CHECK_THROWS_WITH(fit(*s, run.train, run.val, o, log),
                    doctest::Contains("validation loss is not finite (nan) after epoch 2; lower the learning rate; the "
                                      "checkpoint of epoch 1 is kept"));
  std::map<std::string, std::string> meta;
  read_safetensors("strategy_nan.safetensors", &meta);
  CHECK(meta.at("epoch") == "1");
  remove_checkpoint("strategy_nan.safetensors");
}

TEST_CASE("the best checkpoint is the best epoch's, in every mode") {
  struct Case {
    Mode mode;
    MonitorKind metric;
  };
  for (const Case c : {Case{Mode::Single, MonitorKind::ValIou}, Case{Mode::Single, MonitorKind::ValLoss},
                       Case{Mode::DP, MonitorKind::ValDice}, Case{Mode::MP, MonitorKind::ValIou}}) {
    CAPTURE(name_of(kModeNames, c.mode));
    CAPTURE(name_of(kMonitorNames, c.metric));
    FitRun run;
    std::ostringstream log;
    auto s = run.make(c.mode);
    FitOptions o = run.options("strategy_best_each.safetensors");
    o.epochs = 3;
    o.save_best = "strategy_best.safetensors";
    o.monitor.metric = c.metric;
    // Each epoch's checkpoint (its record included) and value, as the epoch ends.
    std::vector<std::vector<char>> model_bytes, train_bytes;
    std::vector<double> values;
    const TrainResult r = fit(*s, run.train, run.val, o, log, [&](const EpochStats& st) {
          model_bytes.push_back(slurp(o.checkpoint));
          train_bytes.push_back(slurp(o.checkpoint + ".train"));
          values.push_back(c.metric == MonitorKind::ValIou    ? st.val_iou
                           : c.metric == MonitorKind::ValDice ? st.val_dice
                                                              : st.val_loss);
        });
    INFO(log.str());
    REQUIRE(values.size() == 3);
    // The first epoch of the best value, and how many epochs were best so far when they ended.
    size_t best = 0, improvements = 1;
    for (size_t e = 1; e < values.size(); ++e) {
      const bool better = c.metric == MonitorKind::ValLoss ? values[e] < values[best] : values[e] > values[best];
      if (better) best = e, ++improvements;
    }
    CHECK(r.best_epoch == int(best) + 1);
    CHECK(r.best_value == values[best]);
    CHECK(!r.stopped_early);
    CHECK(slurp(o.save_best) == model_bytes[best]);
    CHECK(slurp(o.save_best + ".train") == train_bytes[best]);
    size_t said = 0;
    const std::string text = log.str(), line = str_cat("best ", name_of(kMonitorNames, c.metric), " so far (");
    for (size_t at = text.find(line); at != std::string::npos; at = text.find(line, at + 1)) ++said;
    CHECK(said == improvements);
    remove_checkpoint(o.checkpoint);
    remove_checkpoint(o.save_best);
  }
}

TEST_CASE("early stopping ends every mode at the same epoch, and a resumed run counts on") {
  MonitorOptions patience;
  patience.patience = 2;
  patience.min_delta = 1;  // no IoU beats another by more than 1: epochs 2 and 3 do not improve
  for (Mode mode : {Mode::Single, Mode::DP, Mode::MP}) {
    CAPTURE(name_of(kModeNames, mode));
    FitRun run;
    std::ostringstream log;
    FitOptions o = run.options("strategy_es_whole.safetensors");
    o.epochs = 6;
    o.monitor = patience;
    const TrainResult whole = fit(*run.make(mode), run.train, run.val, o, log);
    INFO(log.str());
    CHECK(whole.epochs.size() == 3);
    CHECK(whole.stopped_early);
    CHECK(log.str().find("early stop after epoch 3 of 6: val_iou has not improved on epoch 1's ") != std::string::npos);
    CHECK(log.str().find(" by more than 1 for 2 epochs (best ") != std::string::npos);
    // Two epochs, then resumed for up to six: the record says epoch 2 did not improve, so the
    // run stops after epoch 3 as the whole run did, with the same files.
    FitOptions first = run.options("strategy_es.safetensors");
    first.epochs = 2;
    first.monitor = patience;
    CHECK(!fit(*run.make(mode), run.train, run.val, first, log).stopped_early);
    FitOptions rest = o;
    rest.checkpoint = rest.resume = "strategy_es.safetensors";
    const TrainResult resumed = fit(*run.make(mode), run.train, run.val, rest, log);
    REQUIRE(resumed.epochs.size() == 1);
    CHECK(resumed.epochs[0].epoch == 3);
    CHECK(resumed.stopped_early);
    CHECK(resumed.best_epoch == whole.best_epoch);
    CHECK(log.str().find(str_cat("resumed from strategy_es.safetensors after epoch 2; best val_iou ")) !=
          std::string::npos);
    CHECK(log.str().find(str_cat(" at epoch ", whole.best_epoch, ", 1 epoch without improvement")) !=
          std::string::npos);
    CHECK(slurp("strategy_es.safetensors") == slurp(o.checkpoint));
    CHECK(slurp("strategy_es.safetensors.train") == slurp(o.checkpoint + ".train"));
    // Interrupted at epoch 2's last step, the run validates epoch 2 before it ends: its
    // checkpoint's record counts epoch 2, and the resume stops after epoch 3 again.
    FitOptions cut = o;
    cut.checkpoint = "strategy_es.safetensors";
    const int64_t steps = steps_per_epoch(run.train.size(), run.make(mode)->layout().replicas, o.batch_size);
    cut.on_step = [steps](int epoch, int64_t step) {
      if (epoch == 2 && step == steps) request_interrupt();
    };
    CHECK_THROWS_WITH_AS(fit(*run.make(mode), run.train, run.val, cut, log),
                         doctest::Contains("interrupted after epoch 2; checkpoint written"), Interrupted);
    clear_interrupt();
    std::map<std::string, std::string> meta;
    read_safetensors("strategy_es.safetensors.train", &meta);
    CHECK(meta.at("epoch") == "2");
    CHECK(meta.at("step") == "0");
    CHECK(meta.at("run.stale") == "1");
    CHECK(fit(*run.make(mode), run.train, run.val, rest, log).epochs.size() == 1);
    CHECK(slurp("strategy_es.safetensors.train") == slurp(o.checkpoint + ".train"));
    // Without a patience the same run trains all its epochs.
    FitOptions all = run.options("");
    all.epochs = 4;
    CHECK(fit(*run.make(mode), run.train, run.val, all, log).epochs.size() == 4);
    remove_checkpoint(o.checkpoint);
    remove_checkpoint("strategy_es.safetensors");
  }
  // A resume that watches nothing keeps the resumed run's metric in its record, so a later
  // resume that watches it again counts on.
  FitRun run;
  std::ostringstream log;
  FitOptions loss = run.options("strategy_es_loss.safetensors");
  loss.epochs = 1;
  loss.monitor.metric = MonitorKind::ValLoss;
  loss.monitor.patience = 5;
  fit(*run.make(Mode::Single), run.train, run.val, loss, log);
  FitOptions unwatched = run.options("strategy_es_loss.safetensors");
  unwatched.resume = unwatched.checkpoint;
  fit(*run.make(Mode::Single), run.train, run.val, unwatched, log);
  std::map<std::string, std::string> meta;
  read_safetensors("strategy_es_loss.safetensors.train", &meta);
  CHECK(meta.at("run.monitor") == "val_loss");
  CHECK(meta.at("run.best_epoch") != "");
  CHECK(std::stoi(meta.at("run.best_epoch")) + std::stoi(meta.at("run.stale")) >= 2);  // epoch 2 counted
  remove_checkpoint("strategy_es_loss.safetensors");
}

TEST_CASE("gradient accumulation through train_unet: an optimizer step takes N batches, in every mode") {
  auto step_rows = [](const std::string& csv) {
    std::ifstream f(csv);
    int n = 0;
    for (std::string line; std::getline(f, line);) n += line.rfind("step,", 0) == 0;
    return n;
  };
  // 16 images, 2 epochs: optimizer steps of 2 x 2 images (DP: per replica, 2 replicas).
  for (Mode mode : {Mode::Single, Mode::DP, Mode::MP}) {
    CAPTURE(name_of(kModeNames, mode));
    TrainConfig acc = small_run(mode);
    acc.fit.batch_size = 2;
    acc.fit.accumulate_grad_batches = 2;
    acc.fit.checkpoint = "strategy_acc.safetensors";
    acc.fit.log = "strategy_acc.csv";
    acc.fit.log_every = 1;
    std::ostringstream log;
    const TrainResult r = train_unet(acc, log);
    INFO(log.str());
    const int replicas = mode == Mode::DP ? 2 : 1;
    CHECK(step_rows(acc.fit.log) == 2 * 16 / (4 * replicas));
    CHECK(log.str().find("2 batches accumulated per optimizer step (" + std::to_string(4 * replicas) + " images)") !=
          std::string::npos);
    // Not the run with batches of 4: batch norm saw 2 rows at a time (MP: micro-batches of 2
    // either way, so the same bytes).
    TrainConfig four = small_run(mode);
    four.fit.batch_size = 4;
    four.fit.checkpoint = "strategy_four.safetensors";
    train_unet(four, log);
    if (mode == Mode::MP) {
      CHECK(slurp(acc.fit.checkpoint) == slurp(four.fit.checkpoint));
      CHECK(slurp(acc.fit.checkpoint + ".train") == slurp(four.fit.checkpoint + ".train"));
    } else {
      CHECK(slurp(acc.fit.checkpoint) != slurp(four.fit.checkpoint));
    }
    // Stopped after epoch 1 and resumed: the bytes of the whole run.
    TrainConfig first = acc;
    first.fit.log.clear();
    first.fit.log_every = 0;
    first.fit.checkpoint = "strategy_acc_part.safetensors";
    first.fit.epochs = 1;
    train_unet(first, log);
    TrainConfig rest = acc;
    rest.fit.log.clear();
    rest.fit.log_every = 0;
    rest.fit.resume = first.fit.checkpoint;
    rest.fit.checkpoint = first.fit.checkpoint;
    const TrainResult resumed = train_unet(rest, log);
    REQUIRE(resumed.epochs.size() == 1);
    CHECK(resumed.epochs[0].train_loss == r.epochs[1].train_loss);
    CHECK(slurp(rest.fit.checkpoint) == slurp(acc.fit.checkpoint));
    CHECK(slurp(rest.fit.checkpoint + ".train") == slurp(acc.fit.checkpoint + ".train"));
    for (const auto& p : {acc.fit.checkpoint, four.fit.checkpoint, first.fit.checkpoint}) remove_checkpoint(p);
    std::remove(acc.fit.log.c_str());
  }
  // The pipeline's micro-batches default to --batch-size, not the step's rows.
  TrainConfig mp = small_run(Mode::MP);
  mp.strategy.mp.split_size = 0;
  mp.fit.batch_size = 2;
  mp.fit.accumulate_grad_batches = 2;
  mp.fit.epochs = 1;
  std::ostringstream log;
  train_unet(mp, log);
  CHECK(log.str().find("micro-batches of 2") != std::string::npos);
}

TEST_CASE("gradient clipping through train_unet: the epoch line and the metrics file give the norms, in every mode") {
  for (Mode mode : {Mode::Single, Mode::DP, Mode::MP}) {
    CAPTURE(name_of(kModeNames, mode));
    TrainConfig cfg = small_run(mode);
    cfg.strategy.optimizer.clip_grad_norm = 0.01;  // far below the norms (0.4 to 0.9): every step clipped
    cfg.fit.log = "strategy_clip.csv";
    std::ostringstream log;
    const TrainResult r = train_unet(cfg, log);
    INFO(log.str());
    REQUIRE(r.epochs.size() == 2);
    for (const EpochStats& st : r.epochs) {
      CHECK(st.grad_norm > 10 * cfg.strategy.optimizer.clip_grad_norm);
      CHECK(st.grad_norm_max >= st.grad_norm);
      CHECK(st.clipped_fraction == 1.0);
    }
    // 16 images in steps of 4 (DP: 2 replicas of 4): every step of the epoch clipped.
    const std::string all = mode == Mode::DP ? "2/2 clipped)" : "4/4 clipped)";
    CHECK(log.str().find(all) != std::string::npos);
    // The metrics file's last three columns.
    std::ifstream f(cfg.fit.log);
    std::string header, row;
    std::getline(f, header);
    std::getline(f, row);
    CHECK(header.find(",grad_norm,grad_norm_max,clipped_fraction") != std::string::npos);
    CHECK(row.substr(row.rfind(',')) == ",1");
    // Without clipping: no norms, empty columns.
    TrainConfig plain = small_run(mode);
    plain.fit.epochs = 1;
    plain.fit.log = cfg.fit.log;
    std::ostringstream plain_log;
    const TrainResult p = train_unet(plain, plain_log);
    CHECK(std::isnan(p.epochs[0].grad_norm));
    CHECK(plain_log.str().find("grad_norm") == std::string::npos);
    std::ifstream g(plain.fit.log);
    std::getline(g, header);
    std::getline(g, row);
    CHECK(row.substr(row.size() - 3) == ",,,");
    std::remove(cfg.fit.log.c_str());
  }
}

TEST_CASE("strategies built without devices, or a pipeline without a split size, say so") {
  UNetConfig model;
  model.width_divisor = 16;
  const OptimizerFactory adam = optimizer_factory({});
  CHECK_THROWS_WITH(DataParallelStrategy(model, DataParallelOptions{}, adam, LossKind::BCEDice),
                    doctest::Contains("data parallelism needs at least one device"));
  CHECK_THROWS_WITH(PipelineStrategy(model, PipelineOptions{}, adam, LossKind::BCEDice),
                    doctest::Contains("model parallelism needs at least two stages"));
  // A StrategyConfig's pipeline takes the whole batch unless told (split size 0), which
  // make_strategy refuses: the run sets it to its batch size first.
  StrategyConfig c;
  c.mode = Mode::MP;
  c.devices = {Device::cpu(0), Device::cpu(1)};
  c.model = model;
  c.mp.cuts = {4};
  CHECK(c.mp.split_size == 0);
  std::ostringstream out;
  CHECK_THROWS_WITH(make_strategy(c, nullptr, out), doctest::Contains("the split size must be at least 1"));
}
