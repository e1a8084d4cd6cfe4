#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <memory>
#include <optional>

#include <sys/stat.h>

#include "data/data_config.h"
#include "data/loader.h"
#include "train/callback.h"
#include "train/callbacks/checkpoints.h"
#include "train/callbacks/clip_record.h"
#include "train/callbacks/early_stopping.h"
#include "train/callbacks/interrupts.h"
#include "train/callbacks/metrics_file.h"
#include "train/callbacks/profiling.h"
#include "train/callbacks/progress.h"
#include "train/inference.h"
#include "train/interrupt.h"
#include "data/metrics.h"
#include "engine/checkpoint.h"
#include "runtime/cuda_api.h"
#include "engine/profiler.h"
#include "runtime/allocator.h"

namespace unetcu {

namespace {

// A non-finite loss as a message names it: "nan" whatever its sign bit (which depends on the
// operations that made it), "inf" or "-inf".
const char* non_finite_name(double v) { return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A whole number >= 1 of a checkpoint's run record, or 0 where the checkpoint has none (written
// before the record kept it).
int64_t record_count(const RunRecord& r, const std::string& key, const std::string& file) {
  const auto it = r.find(key);
  if (it == r.end()) return 0;
  const std::string& s = it->second;
  bool digits = !s.empty() && s.size() <= 15;
  for (char c : s) digits = digits && c >= '0' && c <= '9';
  const int64_t v = digits ? std::stoll(s) : 0;
  UNETCU_CHECK(v >= 1, file, ": the run's record has ", key, " '", s, "', not a whole number >= 1");
  return v;
}

}  // namespace

void check_writable(const std::string& path, const char* what) {
  if (path.empty()) return;
  std::string dir = ".";
  const auto slash = path.rfind('/');
  if (slash != std::string::npos) dir = slash == 0 ? "/" : path.substr(0, slash);
  struct stat st {};
  UNETCU_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "cannot write the ", what,
               " '", path, "': folder '", dir, "' does not exist");
  UNETCU_CHECK(::access(dir.c_str(), W_OK) == 0, "cannot write the ", what, " '", path,
               "': folder '", dir, "' is not writable");
  UNETCU_CHECK(::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode), "cannot write the ", what,
               " '", path, "': it exists and is not a regular file");
}

bool same_file(const std::string& a, const std::string& b) {
  namespace fs = std::filesystem;
  // absolute() first: weakly_canonical leaves a relative path none of whose parts exist as it is.
  const auto resolved = [](const std::string& p, fs::path* out) {
    std::error_code e;
    const fs::path abs = fs::absolute(p, e);
    if (!e) *out = fs::weakly_canonical(abs, e);
    return !e;
  };
  fs::path ca, cb;
  return resolved(a, &ca) && resolved(b, &cb) ? ca == cb : a == b;
}

void FitOptions::check() const {
  // Upper bounds keep every size computed from them far from overflow (and from libgomp's
  // limits); they are documented in docs/cli.md.
  UNETCU_CHECK(epochs >= 1 && epochs <= kMaxEpochs, setting("epochs"), " must be in 1..", kMaxEpochs, ", got ",
               epochs);
  UNETCU_CHECK(batch_size >= 1 && batch_size <= kMaxBatch, setting("batch_size"), " must be in 1..", kMaxBatch,
               ", got ", batch_size);
  UNETCU_CHECK(accumulate_grad_batches >= 1 && accumulate_grad_batches <= kMaxAccumulate,
               setting("accumulate_grad_batches"), " must be in 1..", kMaxAccumulate, ", got ",
               accumulate_grad_batches);
  UNETCU_CHECK(crop_size == 0 || (crop_size >= 32 && crop_size % 32 == 0 && crop_size <= kMaxImageSize),
               setting("crop_size"), " must be a multiple of 32 in 32..", kMaxImageSize, ", got ", crop_size);
  UNETCU_CHECK(monitor.patience >= 0 && monitor.patience <= kMaxPatience, setting("early_stop"), " must be in 0..",
               kMaxPatience, " epochs, got ", monitor.patience);
  UNETCU_CHECK(save_best.empty() || checkpoint.empty() || !same_file(save_best, checkpoint), setting("save_best"),
               " and ", setting("checkpoint"), " name the same file: the best epoch's would be overwritten");
  UNETCU_CHECK(workers >= 0 && workers <= kMaxWorkers, setting("workers"), " must be in 0..", kMaxWorkers, ", got ",
               workers);
  UNETCU_CHECK(log_every >= 0 && log_every <= kMaxSamples, setting("log_every"), " must be between 0 and ",
               kMaxSamples, ", got ", log_every);
  UNETCU_CHECK(log_every == 0 || !log.empty(), setting("log_every"), " needs ", setting("log"), " FILE");
}

int64_t steps_per_epoch(int64_t train_size, int replicas, int batch_size) {
  const int64_t per_rank = train_size / replicas;
  return (per_rank + batch_size - 1) / batch_size;
}

std::vector<int64_t> global_batch_indices(const std::vector<int64_t>& perm, int N, int b, int64_t s) {
  const int64_t per_rank = int64_t(perm.size()) / N;
  const int64_t lo = s * b, hi = std::min<int64_t>((s + 1) * b, per_rank);
  std::vector<int64_t> idx;
  for (int r = 0; r < N; ++r)
    for (int64_t i = lo; i < hi; ++i) idx.push_back(perm[size_t(r + i * N)]);
  return idx;
}

namespace {

// The caller's hooks: FitOptions::on_step and fit()'s on_epoch.
class Hooks : public Callback {
 public:
  Hooks(const std::function<void(int, int64_t)>& step, const std::function<void(const EpochStats&)>& epoch)
      : step_(step), epoch_(epoch) {}
  void on_step_end(FitContext& ctx, int64_t done) override {
    if (step_) step_(ctx.epoch, done);
  }
  void on_epoch_end(FitContext&, const EpochStats& st) override {
    if (epoch_) epoch_(st);
  }

 private:
  const std::function<void(int, int64_t)>& step_;
  const std::function<void(const EpochStats&)>& epoch_;
};

// What the resumed run planned, its epochs' steps and its length, where this run differs: this
// run's to choose, but said.
void note_resumed_plan(FitContext& ctx, const RunRecord& record) {
  const FitOptions& o = ctx.options;
  const int64_t was_steps = record_count(record, "steps_per_epoch", o.resume + ".train"),
                was_total = record_count(record, "total_steps", o.resume + ".train");
  if (ctx.first_step > 0 && was_steps > 0 && was_steps != ctx.steps) {
    ctx.out << "note: epoch " << ctx.first_epoch << " had " << was_steps << " steps in the resumed run and has "
            << ctx.steps << " in this one: ";
    if (ctx.first_step < ctx.steps)
      ctx.out << "it continues at step " << ctx.first_step + 1 << "\n";
    else
      ctx.out << "its " << ctx.first_step << " steps done cover it, it is validated\n";
  }
  const int64_t next_step = int64_t(ctx.first_epoch - 1) * ctx.steps + std::min(ctx.first_step, ctx.steps);
  if (ctx.scheduled && was_total > 0 && was_total != ctx.total_steps && next_step < ctx.total_steps) {
    char line[200];
    std::snprintf(line, sizeof line, "note: the resumed run was %lld steps long and this one is %lld: from step %lld "
                  "the learning rate follows this run's schedule (%.6g there)\n",
                  (long long)was_total, (long long)ctx.total_steps, (long long)next_step + 1,
                  o.lr_schedule.at(next_step, ctx.steps, ctx.total_steps));
    ctx.out << line;
  }
}

// Validation: eval-mode BN, no tape, batches of batch_size; the whole model in every process.
// With crops, whole images in overlapping crop x crop tiles (predict_tiled), batch_size tiles
// at a time, the loss and metrics of the blended prediction.
void validate(FitContext& ctx, const Dataset& val_ds, bool on_gpu, EpochStats& st) {
  TrainingStrategy& strategy = ctx.strategy;
  strategy.collect_state();
  strategy.set_training(false);
  std::optional<SegmentationCounts> counts;  // of as many classes as the logits have channels
  auto count = [&](const Tensor& logits, const Tensor& masks) {
    if (!counts) counts.emplace(int(logits.dim(1)));
    counts->add(logits, masks);
  };
  double val_loss = 0;
  const Device out_dev = strategy.output_device();
  const int64_t val_n = val_ds.size(), b = ctx.options.batch_size;
  if (ctx.options.crop_size > 0) {
    for (int64_t i = 0; i < val_n; ++i) {
      Sample s;
      val_ds.load(i, &s);
      Tensor image = Tensor::empty({1, val_ds.channels(), s.height, s.width});
      Tensor mask = Tensor::empty({1, 1, s.height, s.width});
      Batch one{image, mask};
      store_normalized(s.image.data(), s.mask.data(), one, 0, val_ds.normalization());
      const Tensor probs = predict_tiled(image, ctx.options.crop_size, 0.5, int(b), [&](const Tensor& tiles) {
        return strategy.infer(ctx.options.dtype == DType::F32 ? tiles : tiles.to(ctx.options.dtype));
      });
      const Tensor logits = logits_of_probabilities(probs);
      val_loss += segmentation_loss(strategy.loss_kind(), logits, mask).item();
      count(logits, mask);
    }
  } else {
    for (int64_t lo = 0; lo < val_n; lo += b) {
      const int64_t hi = std::min<int64_t>(lo + b, val_n);
      std::vector<int64_t> idx;
      for (int64_t i = lo; i < hi; ++i) idx.push_back(i);
      const Batch host = make_batch(val_ds, idx, ctx.options.dtype, on_gpu);  // alive until the loss is read
      const Tensor logits = strategy.infer(host.images);
      const Tensor masks = host.masks.device() == out_dev ? host.masks : host.masks.to(out_dev);
      val_loss += segmentation_loss(strategy.loss_kind(), logits, masks).item() * double(hi - lo);
      count(logits, masks);
    }
  }
  st.val_loss = val_loss / double(val_n);
  UNETCU_CHECK(std::isfinite(st.val_loss), "validation loss is not finite (", non_finite_name(st.val_loss),
               ") after epoch ", ctx.epoch, "; lower the learning rate", ctx.kept);
  st.val_iou = counts->iou();
  st.val_dice = counts->dice();
  st.val_miou = counts->miou();
  st.val_class_iou.clear();
  if (counts->classes() > 1)
    for (int c = 0; c < counts->classes(); ++c) st.val_class_iou.push_back(counts->class_iou(c));
}

// The most held in tensors at once since the last reset: GPUs, the largest peak of their
// caching allocators; CPU devices, the host allocator's (all of them and the loader together).
void reset_peak_memory(const std::vector<Device>& gpus) {
  for (const Device& d : gpus) cuda::reset_device_peak(d.index);
  if (gpus.empty()) HostAllocator::reset_peak();
}
size_t peak_memory(const std::vector<Device>& gpus) {
  size_t peak = 0;
  for (const Device& d : gpus) peak = std::max(peak, cuda::device_memory_stats(d.index).peak_bytes);
  return gpus.empty() ? HostAllocator::stats().peak_bytes : peak;
}

// The mean epoch time and its sample standard deviation (n - 1; 0 for a single epoch), printed.
void summarize_epoch_times(TrainResult& result, std::ostream& out) {
  double sum = 0, sq = 0;
  for (const auto& e : result.epochs) sum += e.seconds;
  result.mean_epoch_seconds = sum / double(result.epochs.size());
  for (const auto& e : result.epochs)
    sq += (e.seconds - result.mean_epoch_seconds) * (e.seconds - result.mean_epoch_seconds);
  result.std_epoch_seconds = result.epochs.size() > 1 ? std::sqrt(sq / double(result.epochs.size() - 1)) : 0.0;
  char line[160];
  std::snprintf(line, sizeof line, "mean epoch time %.3fs, std %.3fs over %zu epochs", result.mean_epoch_seconds,
                result.std_epoch_seconds, result.epochs.size());
  out << line << "\n";
}

// The loader of an epoch's steps [start, steps): its workers make the global batches ahead of
// the step, in order (pinned for a GPU); with several processes, this process's shard of each.
std::unique_ptr<BatchLoader> epoch_loader(const TrainingStrategy& strategy, const Dataset& train_ds,
                                          const FitOptions& o, int epoch, int64_t start, int64_t steps,
                                          bool on_gpu, int workers) {
  const int N = strategy.layout().replicas, step_batch = o.batch_size * o.accumulate_grad_batches;
  const int shards = strategy.layout().shard_count, shard = strategy.layout().shard_rank;
  return std::make_unique<BatchLoader>(
      steps - start,
      [&train_ds, &o, perm = epoch_permutation(train_ds.size(), o.seed, epoch), N, step_batch, shards, shard,
       start, epoch, on_gpu](int64_t k) {
        std::vector<int64_t> idx = global_batch_indices(perm, N, step_batch, start + k);
        if (shards > 1) {  // this process's shard only
          const int64_t b = int64_t(idx.size()) / N;
          idx = std::vector<int64_t>(idx.begin() + shard * b, idx.begin() + (shard + 1) * b);
        }
        return make_batch(train_ds, idx, o.dtype, on_gpu, o.augment, o.seed, epoch, o.crop_size);
      },
      workers, workers + 1);
}

}  // namespace

TrainResult fit(TrainingStrategy& strategy, const Dataset& train_ds, const Dataset& val_ds,
                const FitOptions& o, std::ostream& lead_out,
                const std::function<void(const EpochStats&)>& on_epoch) {
  // Several processes: process 0 prints, writes checkpoints and the metrics file; the others
  // train and validate alike, silently.
  const bool lead = strategy.layout().process_rank == 0;
  std::ostream null_out(nullptr);
  FitContext ctx(strategy, o, lead ? lead_out : null_out, lead);
  UNETCU_CHECK(o.epochs >= 1 && o.batch_size >= 1 && o.accumulate_grad_batches >= 1,
               "training needs at least one epoch and one sample a step");
  // What happens around the loop (train/callback.h), in the order it is called.
  EarlyStopping watch(o);
  Checkpoints checkpoints(ctx, watch);
  Profiling profiling(ctx);
  Progress progress;
  ClipRecord clip;
  MetricsFile metrics;
  Hooks hooks(o.on_step, on_epoch);
  Interrupts interrupts;
  ctx.callbacks = {&clip, &progress, &metrics, &profiling, &checkpoints, &hooks, &watch, &interrupts};
  const auto each = [&](auto&& call) {
    for (Callback* c : ctx.callbacks) call(*c);
  };
  const RunRecord resumed = checkpoints.start(ctx);

  TrainResult result;
  result.parameter_count = strategy.model().parameter_count();
  std::vector<Device> gpus;
  for (const Device& d : strategy.devices())
    if (d.is_cuda()) gpus.push_back(d);
  const bool on_gpu = !gpus.empty();
  const int N = strategy.layout().replicas;
  const int step_batch = o.batch_size * o.accumulate_grad_batches;  // per replica and optimizer step
  const int64_t train_n = train_ds.size();
  UNETCU_CHECK(train_n / N >= 1, "the ", train_n, " training samples give each of the ", N, " replicas none");
  UNETCU_CHECK(val_ds.size() >= 1, "training needs at least one validation sample");
  ctx.steps = steps_per_epoch(train_n, N, step_batch);
  // The learning rate of step t of the run (0-based over every epoch, so a resumed run takes
  // up the same curve); the same in every process.
  ctx.total_steps = ctx.steps * o.epochs;
  ctx.scheduled = o.lr_schedule.varies();
  if (ctx.scheduled) o.lr_schedule.check(ctx.total_steps);
  note_resumed_plan(ctx, resumed);
  const int64_t steps = ctx.steps;
  const int workers = o.workers > 0 ? o.workers : (on_gpu ? 4 : 1);  // the CPU's cores train

  each([&](Callback& c) { c.on_fit_start(ctx); });
  for (int epoch = ctx.first_epoch; epoch <= o.epochs && !ctx.stop; ++epoch) {
    ctx.epoch = epoch;
    EpochStats st;
    st.epoch = epoch;
    strategy.set_training(true);
    each([&](Callback& c) { c.on_epoch_start(ctx); });
    // A run resumed mid-epoch starts at the step it stopped at; the batches are those it would
    // have had (the order and augmentation depend only on the seed, the epoch and the index).
    const int64_t start = epoch == ctx.first_epoch ? std::min(ctx.first_step, steps) : 0;
    const auto loader = epoch_loader(strategy, train_ds, o, epoch, start, steps, on_gpu, workers);
    reset_peak_memory(gpus);
    const auto t0 = Clock::now();
    double loss_sum = 0;
    PlacedBatch next;
    if (start < steps) next = strategy.place(loader->next());
    // The loss of the step before, read after this step is queued; its batch stays alive with
    // it until then, as the copies from it may still be in flight.
    StepLoss pending;
    PlacedBatch pending_batch;
    StepDone done;
    const auto settle = [&] {
      if (!pending.valid()) return;
      done.loss = pending.get();
      UNETCU_CHECK(std::isfinite(done.loss), "loss is not finite (", non_finite_name(done.loss), ") at epoch ",
                   epoch, " step ", done.step, "; lower the learning rate", ctx.kept);
      loss_sum += done.loss * double(pending_batch.size());
      st.images += pending_batch.size();
      done.seconds = seconds_since(t0);
      done.images = st.images;
      each([&](Callback& c) { c.on_step_loss(ctx, done); });
      pending = StepLoss();
      pending_batch = PlacedBatch();
    };
    for (int64_t s = start; s < steps; ++s) {
      PlacedBatch batch = std::move(next);
      // The next batch's upload beside this step's work on a GPU: placed after the step is
      // queued, or before it where the step waits for the devices (TrainingStrategy::places_ahead).
      const bool ahead = strategy.places_ahead();
      if (ahead && s + 1 < steps) next = strategy.place(loader->next());
      if (ctx.scheduled)
        strategy.set_learning_rate(o.lr_schedule.at(int64_t(epoch - 1) * steps + s, steps, ctx.total_steps));
      const double lr = strategy.learning_rate();
      StepLoss loss = strategy.step_async(batch);
      if (!ahead && s + 1 < steps) next = strategy.place(loader->next());
      settle();  // the step before's loss: its kernels ran while this step was being queued
      pending = std::move(loss);
      pending_batch = std::move(batch);
      done.step = s + 1;
      done.lr = lr;
      // Step hooks, interrupts and the epoch's last step read this step's loss now.
      if (s + 1 == steps || o.on_step) settle();
      each([&](Callback& c) { c.on_step_end(ctx, s + 1); });
      if (ctx.interrupted) {
        settle();
        strategy.collect_state();
        each([&](Callback& c) { c.on_interrupt(ctx, s + 1); });
      }
    }
    st.seconds = seconds_since(t0);
    st.load_seconds = loader->busy_seconds() / workers;  // its workers run side by side
    st.wait_seconds = loader->wait_seconds();
    st.train_loss = st.images ? loss_sum / double(st.images) : 0.0;
    st.images_per_second = double(st.images) * strategy.layout().shard_count / st.seconds;  // every replica's
    each([&](Callback& c) { c.on_train_epoch_end(ctx); });
    validate(ctx, val_ds, on_gpu, st);
    st.peak_device_bytes = peak_memory(gpus);
    st.lr = strategy.learning_rate();
    each([&](Callback& c) { c.on_validation_end(ctx, st); });
    result.epochs.push_back(st);
    each([&](Callback& c) { c.on_epoch_end(ctx, st); });
  }
  each([&](Callback& c) { c.on_fit_end(ctx, result); });

  summarize_epoch_times(result, ctx.out);
  return result;
}

}  // namespace unetcu
