#include "train/trainer.h"
#include "train/metrics_log.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <memory>

#include <sys/stat.h>

#include "data/loader.h"
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

// A one-line progress bar on stderr, redrawn at most ~10 times a second.
class Progress {
 public:
  Progress(bool enabled, int epoch, int64_t total)
      : on_(enabled && isatty(STDERR_FILENO)), epoch_(epoch), total_(total) {}
  void update(int64_t done, double elapsed, int64_t images) {
    if (!on_) return;
    if (done < total_ && elapsed - last_ < 0.1) return;
    last_ = elapsed;
    const int width = 30;
    const int fill = int(width * done / total_);
    const double rate = elapsed > 0 ? images / elapsed : 0;
    const double eta = done > 0 ? elapsed * (total_ - done) / done : 0;
    std::fprintf(stderr, "\repoch %d [%.*s%*s] %lld/%lld  %.1f img/s  ETA %.0fs   ", epoch_,
                 fill, "##############################", width - fill, "", (long long)done,
                 (long long)total_, rate, eta);
    std::fflush(stderr);
  }
  void finish() {
    if (on_) std::fprintf(stderr, "\r%*s\r", 90, "");
  }

 private:
  bool on_;
  int epoch_;
  int64_t total_;
  double last_ = -1;
};

// Refuses, before any training, an output path that cannot be written: a missing or read-only
// folder, or a folder where the file should be.
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

bool parameters_finite(Module& model) {
  for (const Tensor& p : model.parameters()) {
    const Tensor host = p.device().is_cpu() ? p : p.to(Device::cpu());
    bool ok = true;
    UNETCU_DISPATCH_FLOAT(host.dtype(), T, {
      const T* d = host.data<T>();
      for (int64_t i = 0; i < host.numel() && ok; ++i) ok = std::isfinite(d[i]);
    });
    if (!ok) return false;
  }
  return true;
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

double monitored(MonitorKind m, const EpochStats& st) {
  return m == MonitorKind::ValLoss ? st.val_loss : m == MonitorKind::ValDice ? st.val_dice : st.val_iou;
}

}  // namespace

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

TrainResult fit(TrainingStrategy& strategy, const Dataset& train_ds, const Dataset& val_ds,
                const FitOptions& o, std::ostream& lead_out,
                const std::function<void(const EpochStats&)>& on_epoch) {
  // Several processes: process 0 prints, writes checkpoints and the metrics file; the others
  // train and validate alike, silently.
  const bool lead = strategy.process_rank() == 0;
  std::ostream null_out(nullptr);
  std::ostream& out = lead ? lead_out : null_out;
  UNETCU_CHECK(o.epochs >= 1 && o.batch_size >= 1 && o.accumulate >= 1,
               "training needs at least one epoch and one sample a step");
  const int step_batch = o.batch_size * o.accumulate;  // per replica and optimizer step
  std::vector<Device> gpus;
  for (const Device& d : strategy.devices())
    if (d.is_cuda()) gpus.push_back(d);
  const bool on_gpu = !gpus.empty();
  if (lead) check_writable(o.checkpoint, "checkpoint");
  if (lead) check_writable(o.save_best, "best checkpoint");
  UNETCU_CHECK(o.save_best.empty() || o.checkpoint.empty() || !same_file(o.save_best, o.checkpoint),
               "the best checkpoint and the checkpoint of every epoch must be different files, both are ",
               o.save_best);
  check_writable(o.profile, "profile trace");
  MetricMonitor monitor(o.monitor);
  const bool watching = !o.save_best.empty() || o.monitor.patience > 0;
  int first_epoch = 1;
  int64_t first_step = 0;  // > 0: a run stopped mid-epoch resumes at this step
  RunRecord record;        // the resumed run's
  if (!o.init_encoder.empty()) {
    load_model_state(strategy.model(), read_safetensors(o.init_encoder), o.init_encoder, "encoder.");
    strategy.state_loaded();
    out << "encoder weights from " << o.init_encoder << "\n";
  }
  if (!o.resume.empty()) {
    struct stat train_file {};  // stat, not open: a FIFO must not block here
    UNETCU_CHECK(::stat((o.resume + ".train").c_str(), &train_file) == 0, "resume from ", o.resume, ": no ",
                 o.resume, ".train beside it (optimizer state and epoch); load only the encoder "
                 "or the weights another way to start over");
    first_epoch = load_checkpoint(o.resume, strategy.model(), strategy.optimizers(), &first_step, &record) + 1;
    strategy.state_loaded();
    // A run that watches nothing keeps the metric the resumed run watched, so that a later
    // resume which watches it again counts on.
    if (!watching)
      if (const auto it = record.find("monitor"); it != record.end())
        for (const auto& m : kMonitorNames)
          if (it->second == m.name) monitor = MetricMonitor(MonitorOptions{m.value});
    const bool restored = monitor.restore(record, first_epoch - 1, o.resume + ".train");
    out << "resumed from " << o.resume << " after epoch " << first_epoch - 1;
    if (first_step) out << " and " << first_step << " steps of epoch " << first_epoch;
    if (watching && restored) {
      char line[160];
      std::snprintf(line, sizeof line, "; best %s %.4f at epoch %d, %d epoch%s without improvement",
                    monitor.metric_name(), monitor.best(), monitor.best_epoch(), monitor.stale(),
                    monitor.stale() == 1 ? "" : "s");
      out << line;
    } else if (watching && first_epoch > 1) {
      out << "; it holds no record of " << monitor.metric_name() << ", counted from here";
    }
    out << "\n";
    UNETCU_CHECK(first_epoch <= o.epochs, "resume: the checkpoint is from epoch ", first_epoch - 1,
                 ", nothing left to do with ", o.epochs, " epochs");
  }
  TrainResult result;
  result.parameter_count = strategy.model().parameter_count();
  const int N = strategy.replicas();
  const int64_t train_n = train_ds.size(), val_n = val_ds.size();
  const int64_t per_rank = train_n / N;
  UNETCU_CHECK(per_rank >= 1, "the ", train_n, " training samples give each of the ", N,
               " replicas none");
  UNETCU_CHECK(val_n >= 1, "training needs at least one validation sample");
  const int64_t steps = steps_per_epoch(train_n, N, step_batch);
  // The learning rate of step t of the run (0-based over every epoch, so a resumed run takes
  // up the same curve); the same in every process.
  const LrSchedule& schedule = o.lr_schedule;
  const bool scheduled = schedule.varies();
  const int64_t total_steps = steps * o.epochs;
  if (scheduled) schedule.check(total_steps);
  // What the resumed run planned: its epochs' steps and its length. Another batch size, data set
  // or replica count, or another number of epochs, is this run's to choose, but said.
  const int64_t was_steps = record_count(record, "steps_per_epoch", o.resume + ".train"),
                was_total = record_count(record, "total_steps", o.resume + ".train");
  if (first_step > 0 && was_steps > 0 && was_steps != steps) {
    out << "note: epoch " << first_epoch << " had " << was_steps << " steps in the resumed run and has " << steps
        << " in this one: ";
    if (first_step < steps)
      out << "it continues at step " << first_step + 1 << "\n";
    else
      out << "its " << first_step << " steps done cover it, it is validated\n";
  }
  const int64_t next_step = int64_t(first_epoch - 1) * steps + std::min(first_step, steps);  // 0-based
  if (scheduled && was_total > 0 && was_total != total_steps && next_step < total_steps) {
    char line[200];
    std::snprintf(line, sizeof line, "note: the resumed run was %lld steps long and this one is %lld: from step %lld "
                  "the learning rate follows this run's schedule (%.6g there)\n",
                  (long long)was_total, (long long)total_steps, (long long)next_step + 1,
                  schedule.at(next_step, steps, total_steps));
    out << line;
  }
  // The record every checkpoint of this run carries: the monitor's and the run's plan.
  const auto run_record = [&] {
    RunRecord r = monitor.record();
    r["steps_per_epoch"] = std::to_string(steps);
    r["total_steps"] = std::to_string(total_steps);
    return r;
  };
  // Loader threads: one on the CPU (the cores train), a few for GPUs.
  const int workers = o.workers > 0 ? o.workers : (on_gpu ? 4 : 1);

  MetricsLog metrics(lead ? o.log : "", !o.resume.empty());
  if (!o.profile.empty()) {
    Profiler::reset();
    Profiler::enable(true);
  }
  // What a failure leaves: the checkpoint of the last good epoch, if one was written.
  std::string kept = o.checkpoint.empty() ? "" : "; " + o.checkpoint + " was not overwritten";
  for (int epoch = first_epoch; epoch <= o.epochs; ++epoch) {
    EpochStats st;
    st.epoch = epoch;
    strategy.set_training(true);
    // Gradient clipping's record starts with the epoch (steps before fit() are not its).
    for (Optimizer* opt : strategy.optimizers()) opt->take_clip_stats();
    std::vector<int> peak_live;
    const auto perm = epoch_permutation(train_n, o.seed, epoch);
    // A run resumed mid-epoch starts at the step it stopped at; the batches are those it would
    // have had (the order and augmentation depend only on the seed, the epoch and the index).
    const int64_t start = epoch == first_epoch ? std::min(first_step, steps) : 0;
    // The workers make the epoch's global batches ahead of the step, in order (pinned for a GPU).
    BatchLoader loader(
        steps - start,
        [&](int64_t k) {
          std::vector<int64_t> idx = global_batch_indices(perm, N, step_batch, start + k);
          if (strategy.shard_count() > 1) {  // this process's shard only
            const int64_t b = int64_t(idx.size()) / N, r = strategy.shard_rank();
            idx = std::vector<int64_t>(idx.begin() + r * b, idx.begin() + (r + 1) * b);
          }
          return make_batch(train_ds, idx, o.dtype, on_gpu, o.augment, o.seed, epoch);
        },
        workers, workers + 1);
    Progress bar(o.progress && lead, epoch, steps);
    for (const Device& d : gpus) cuda::reset_device_peak(d.index);
    if (!on_gpu) HostAllocator::reset_peak();
    const auto t0 = Clock::now();
    double loss_sum = 0;
    int64_t seen = 0;
    PlacedBatch next;
    if (start < steps) next = strategy.place(loader.next());
    // The rate of the step being queued and of the step whose loss is pending (its metrics
    // row), as the optimizers hold it.
    double step_lr = strategy.learning_rate();
    double pending_lr = step_lr;
    // The loss of the step before, read after this step is queued (StepLoss); its batch stays
    // alive with it until then, as the copies from it may still be in flight.
    StepLoss pending;
    PlacedBatch pending_batch;
    int64_t pending_step = 0;
    auto settle = [&] {
      if (!pending.valid()) return;
      const double loss = pending.get();
      UNETCU_CHECK(std::isfinite(loss), "loss is not finite (", non_finite_name(loss), ") at epoch ", epoch,
                   " step ", pending_step + 1, "; lower the learning rate", kept);
      loss_sum += loss * double(pending_batch.size());
      seen += pending_batch.size();
      bar.update(pending_step + 1, seconds_since(t0), seen);
      if (o.log_every > 0 && (pending_step + 1) % o.log_every == 0)
        metrics.step(epoch, pending_step + 1, loss, seconds_since(t0), seen, pending_lr);
      pending = StepLoss();
      pending_batch = PlacedBatch();
    };
    for (int64_t s = start; s < steps; ++s) {
      PlacedBatch batch = std::move(next);
      // The next batch's upload beside this step's work on a GPU (Tensor::upload_to): placed
      // after the step is queued, so the host waits for the loader while the device computes;
      // placed before it where the step waits for the devices (a pipeline across processes),
      // its streams then waiting for the upload only at the next step
      // (TrainingStrategy::places_ahead).
      const bool ahead = strategy.places_ahead();
      if (ahead && s + 1 < steps) next = strategy.place(loader.next());
      if (scheduled) {
        strategy.set_learning_rate(schedule.at(int64_t(epoch - 1) * steps + s, steps, total_steps));
        step_lr = strategy.learning_rate();
      }
      StepLoss loss = strategy.step_async(batch);
      if (!ahead && s + 1 < steps) next = strategy.place(loader.next());
      settle();  // the step before's loss: its kernels ran while this step was being queued
      pending = std::move(loss);
      pending_batch = std::move(batch);
      pending_step = s;
      pending_lr = step_lr;
      // Step hooks, interrupts and the epoch's last step read this step's loss now.
      if (s + 1 == steps || o.on_step) settle();
      const auto live = strategy.live_micro_batches();
      if (peak_live.empty()) peak_live = live;
      for (size_t i = 0; i < live.size(); ++i) peak_live[i] = std::max(peak_live[i], live[i]);
      if (o.on_step) o.on_step(epoch, s + 1);
      // Every process stops at the same step (a pipeline's stages, the replicas' collectives);
      // several processes agree every 8 steps (the agreement is a collective: on GPUs a wait for
      // the device). An interrupt at the epoch's last step waits for its validation: the epoch's
      // checkpoint then holds the epoch's metrics (best, early stopping) as an uninterrupted run's.
      const bool decide = s + 1 < steps && (strategy.process_count() == 1 || (s + 1) % 8 == 0);
      if (decide && strategy.any_process(interrupt_requested())) {
        settle();
        strategy.collect_state();
        bar.finish();
        std::string saved = "no checkpoint was configured";
        if (!o.checkpoint.empty() && lead) {
          UNETCU_CHECK(parameters_finite(strategy.model()), "a parameter is not finite at epoch ", epoch,
                       " step ", s + 1, kept);
          // Steps done into this epoch: a resume continues right after them.
          save_checkpoint(o.checkpoint, strategy.model(), strategy.optimizers(), epoch - 1, s + 1, run_record());
          saved = "checkpoint written to " + o.checkpoint + " (resuming continues from there)";
        }
        // The other processes wait for process 0's checkpoint before they end (a launcher ends
        // the whole job when one process exits).
        strategy.any_process(false);
        if (!lead && !o.checkpoint.empty()) saved = "checkpoint written by process 0";
        throw Interrupted(str_cat("interrupted at epoch ", epoch, " after step ", s + 1, " of ", steps,
                                  "; ", saved));
      }
    }
    st.seconds = seconds_since(t0);
    st.load_seconds = loader.busy_seconds() / workers;  // its workers run side by side
    st.wait_seconds = loader.wait_seconds();
    bar.finish();
    st.train_loss = seen ? loss_sum / double(seen) : 0.0;
    st.images_per_second = double(seen) * strategy.shard_count() / st.seconds;  // every replica's

    // Validation: eval-mode BN, no tape, batches of batch_size; the whole model in every process.
    strategy.collect_state();
    strategy.set_training(false);
    SegmentationCounts counts;
    double val_loss = 0;
    const Device out_dev = strategy.output_device();
    for (int64_t lo = 0; lo < val_n; lo += o.batch_size) {
      const int64_t hi = std::min<int64_t>(lo + o.batch_size, val_n);
      std::vector<int64_t> idx;
      for (int64_t i = lo; i < hi; ++i) idx.push_back(i);
      const Batch host = make_batch(val_ds, idx, o.dtype, on_gpu);  // alive until the loss is read
      const Tensor logits = strategy.infer(host.images);
      const Tensor masks = host.masks.device() == out_dev ? host.masks : host.masks.to(out_dev);
      val_loss += segmentation_loss(strategy.loss_kind(), logits, masks).item() * double(hi - lo);
      counts.add(logits, host.masks);  // the masks' host copy: no round trip through the GPU
    }
    st.val_loss = val_loss / double(val_n);
    UNETCU_CHECK(std::isfinite(st.val_loss), "validation loss is not finite (", non_finite_name(st.val_loss),
                 ") after epoch ", epoch, "; lower the learning rate", kept);
    st.val_iou = counts.iou();
    st.val_dice = counts.dice();
    // Gradient clipping's record of the epoch (the steps are done: their last loss was read).
    // Every stage of a pipeline clips by the same norm; a replica's is rank 0's; across
    // processes this process's stage's.
    bool clip_seen = false;
    int64_t clip_steps = 0, clip_clipped = 0;
    for (Optimizer* opt : strategy.optimizers()) {
      const Optimizer::ClipStats c = opt->take_clip_stats();
      if (c.steps == 0 || clip_seen) continue;
      clip_seen = true;
      clip_steps = c.steps;
      clip_clipped = c.clipped;
      st.grad_norm = c.norm_mean;
      st.grad_norm_max = c.norm_max;
      st.clipped_fraction = double(c.clipped) / double(c.steps);
    }
    for (const Device& d : gpus)
      st.peak_device_bytes = std::max(st.peak_device_bytes, cuda::device_memory_stats(d.index).peak_bytes);
    if (!on_gpu) st.peak_device_bytes = HostAllocator::stats().peak_bytes;

    char line[256];
    std::snprintf(line, sizeof line,
                  "epoch %d/%d  time %.2fs  loss %.4f  val_loss %.4f  val_iou %.4f  "
                  "val_dice %.4f  %.1f img/s",
                  epoch, o.epochs, st.seconds, st.train_loss, st.val_loss, st.val_iou, st.val_dice,
                  st.images_per_second);
    out << line;
    out << "  peak_mem " << std::fixed << std::setprecision(0) << double(st.peak_device_bytes) / (1 << 20)
        << " MiB" << std::defaultfloat;
    // The loader: its rate, and how much of the epoch the step waited for it.
    out << "  loader " << std::fixed << std::setprecision(0)
        << (st.load_seconds > 0 ? double(seen) / st.load_seconds : 0.0) << " img/s, waited "
        << std::setprecision(2) << st.wait_seconds << "s" << std::defaultfloat;
    if (clip_seen) {
      char norms[96];
      std::snprintf(norms, sizeof norms, "  grad_norm %.4g (max %.4g, %lld/%lld clipped)", st.grad_norm,
                    st.grad_norm_max, static_cast<long long>(clip_clipped), static_cast<long long>(clip_steps));
      out << norms;
    }
    if (scheduled) {  // the rate of the epoch's last step
      char rate[32];
      std::snprintf(rate, sizeof rate, "  lr %.4g", step_lr);
      out << rate;
    }
    if (!peak_live.empty()) {
      out << "  live_micro_batches";
      for (int v : peak_live) out << " " << v;
    }
    out << "\n";
    out.flush();
    metrics.epoch(st, strategy.learning_rate());
    result.epochs.push_back(st);
    const MetricMonitor::Verdict verdict = monitor.update(epoch, monitored(monitor.metric(), st));
    const bool save_best = verdict.best && !o.save_best.empty() && lead;
    if ((!o.checkpoint.empty() || save_best) && lead)
      UNETCU_CHECK(parameters_finite(strategy.model()), "a parameter is not finite after epoch ",
                   epoch, kept);
    if (save_best) {
      // The same files as the epoch's checkpoint, record included.
      save_checkpoint(o.save_best, strategy.model(), strategy.optimizers(), epoch, 0, run_record());
      char line[160];
      std::snprintf(line, sizeof line, "best %s so far (%.4f): saved to ", monitor.metric_name(), monitor.best());
      out << line << o.save_best << "\n";
    }
    if (!o.checkpoint.empty() && lead) {
      save_checkpoint(o.checkpoint, strategy.model(), strategy.optimizers(), epoch, 0, run_record());
      kept = "; the checkpoint of epoch " + std::to_string(epoch) + " is kept";
    }
    out.flush();
    if (on_epoch) on_epoch(st);
    // Every process ends at the same epoch (their validations agree, but the decision is one).
    if (strategy.any_process(verdict.stop) && epoch < o.epochs) {
      char line[200];
      std::snprintf(line, sizeof line, "early stop after epoch %d of %d: %s has not improved", epoch,
                    o.epochs, monitor.metric_name());
      out << line;
      if (o.monitor.min_delta > 0) {  // the value to beat is not the best's then
        std::snprintf(line, sizeof line, " on epoch %d's %.4f by more than %g", epoch - monitor.stale(),
                      monitor.reference(), o.monitor.min_delta);
        out << line;
      }
      std::snprintf(line, sizeof line, " for %d epoch%s (best %.4f at epoch %d)\n", monitor.stale(),
                    monitor.stale() == 1 ? "" : "s", monitor.best(), monitor.best_epoch());
      out << line;
      result.stopped_early = true;
      break;
    }
    if (strategy.any_process(interrupt_requested()) && epoch < o.epochs)
      throw Interrupted(str_cat("interrupted after epoch ", epoch, "; ",
                                o.checkpoint.empty() ? "no checkpoint was configured"
                                                     : "checkpoint written to " + o.checkpoint));
  }

  if (!o.profile.empty()) {
    Profiler::enable(false);
    out << "\nprofile (" << Profiler::records().size() << " ranges; trace in " << o.profile
        << "):\n" << Profiler::summary() << "\n";
    // One trace per process: process r > 0 writes FILE.rank<r>.
    Profiler::write_trace(strategy.process_count() > 1 && !lead
                              ? o.profile + ".rank" + std::to_string(strategy.process_rank())
                              : o.profile);
  }
  result.best_epoch = monitor.best_epoch();
  result.best_value = monitor.best();
  if (watching && monitor.has_best()) {
    char line[160];
    std::snprintf(line, sizeof line, "best %s %.4f at epoch %d", monitor.metric_name(), monitor.best(),
                  monitor.best_epoch());
    out << line;
    if (!o.save_best.empty() && monitor.best_epoch() >= first_epoch) out << " (" << o.save_best << ")";
    out << "\n";
  }
  double sum = 0, sq = 0;
  for (const auto& e : result.epochs) sum += e.seconds;
  result.mean_epoch_seconds = sum / double(result.epochs.size());
  for (const auto& e : result.epochs)
    sq += (e.seconds - result.mean_epoch_seconds) * (e.seconds - result.mean_epoch_seconds);
  // Sample standard deviation (n - 1), 0 for a single epoch.
  result.std_epoch_seconds =
      result.epochs.size() > 1 ? std::sqrt(sq / double(result.epochs.size() - 1)) : 0.0;
  char line[160];
  std::snprintf(line, sizeof line, "mean epoch time %.3fs, std %.3fs over %zu epochs",
                result.mean_epoch_seconds, result.std_epoch_seconds, result.epochs.size());
  out << line << "\n";
  return result;
}

}  // namespace unetcu
