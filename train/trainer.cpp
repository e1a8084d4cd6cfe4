#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <memory>

#include "data/loader.h"
#include "data/metrics.h"
#include "engine/checkpoint.h"
#include "runtime/cuda_api.h"
#include "engine/profiler.h"

namespace unetcu {

namespace {

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

}  // namespace

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
                const FitOptions& o, std::ostream& out,
                const std::function<void(const EpochStats&)>& on_epoch) {
  UNETCU_CHECK(o.epochs >= 1 && o.batch_size >= 1, "training needs at least one epoch and one sample a step");
  std::vector<Device> gpus;
  for (const Device& d : strategy.devices())
    if (d.is_cuda()) gpus.push_back(d);
  const bool on_gpu = !gpus.empty();
  int first_epoch = 1;
  if (!o.init_encoder.empty()) {
    load_model_state(strategy.model(), read_safetensors(o.init_encoder), o.init_encoder, "encoder.");
    strategy.state_loaded();
    out << "encoder weights from " << o.init_encoder << "\n";
  }
  if (!o.resume.empty()) {
    UNETCU_CHECK(std::ifstream(o.resume + ".train").good(), "resume from ", o.resume, ": no ",
                 o.resume, ".train beside it (optimizer state and epoch); load only the encoder "
                 "or the weights another way to start over");
    first_epoch = load_checkpoint(o.resume, strategy.model(), strategy.optimizers()) + 1;
    strategy.state_loaded();
    out << "resumed from " << o.resume << " after epoch " << first_epoch - 1 << "\n";
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
  const int64_t steps = steps_per_epoch(train_n, N, o.batch_size);
  const int64_t epoch_samples = per_rank * N;
  // Loader threads: one on the CPU (the cores train), a few for GPUs.
  const int workers = o.workers > 0 ? o.workers : (on_gpu ? 4 : 1);

  if (!o.profile.empty()) {
    Profiler::reset();
    Profiler::enable(true);
  }
  for (int epoch = first_epoch; epoch <= o.epochs; ++epoch) {
    EpochStats st;
    st.epoch = epoch;
    strategy.set_training(true);
    std::vector<int> peak_live;
    const auto perm = epoch_permutation(train_n, o.seed, epoch);
    // The workers make the epoch's global batches ahead of the step, in order (pinned for a GPU).
    BatchLoader loader(
        steps,
        [&](int64_t s) {
          return make_batch(train_ds, global_batch_indices(perm, N, o.batch_size, s), o.dtype,
                            on_gpu, o.augment, o.seed, epoch);
        },
        workers, workers + 1);
    Progress bar(o.progress, epoch, steps);
    for (const Device& d : gpus) cuda::reset_device_peak(d.index);
    const auto t0 = Clock::now();
    double loss_sum = 0;
    int64_t seen = 0;
    PlacedBatch next = strategy.place(loader.next());
    for (int64_t s = 0; s < steps; ++s) {
      const PlacedBatch batch = std::move(next);
      if (s + 1 < steps) next = strategy.place(loader.next());  // the next upload is queued first
      const double loss = strategy.step(batch);
      UNETCU_CHECK(std::isfinite(loss), "loss is not finite (", loss, ") at epoch ", epoch,
                   " step ", s + 1, "; lower the learning rate");
      loss_sum += loss * double(batch.size());
      seen += batch.size();
      bar.update(s + 1, seconds_since(t0), seen);
      const auto live = strategy.live_micro_batches();
      if (peak_live.empty()) peak_live = live;
      for (size_t i = 0; i < live.size(); ++i) peak_live[i] = std::max(peak_live[i], live[i]);
    }
    st.seconds = seconds_since(t0);
    st.load_seconds = loader.busy_seconds() / workers;  // its workers run side by side
    st.wait_seconds = loader.wait_seconds();
    bar.finish();
    st.train_loss = loss_sum / double(seen);
    st.images_per_second = double(epoch_samples) / st.seconds;

    // Validation: eval-mode BN, no tape, batches of batch_size.
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
      counts.add(logits, masks);
    }
    st.val_loss = val_loss / double(val_n);
    st.val_iou = counts.iou();
    st.val_dice = counts.dice();
    for (const Device& d : gpus)
      st.peak_device_bytes = std::max(st.peak_device_bytes, cuda::device_memory_stats(d.index).peak_bytes);

    char line[256];
    std::snprintf(line, sizeof line,
                  "epoch %d/%d  time %.2fs  loss %.4f  val_loss %.4f  val_iou %.4f  "
                  "val_dice %.4f  %.1f img/s",
                  epoch, o.epochs, st.seconds, st.train_loss, st.val_loss, st.val_iou, st.val_dice,
                  st.images_per_second);
    out << line;
    if (on_gpu)
      out << "  peak_mem " << std::fixed << std::setprecision(0)
          << double(st.peak_device_bytes) / (1 << 20) << " MiB" << std::defaultfloat;
    // The loader: its rate, and how much of the epoch the step waited for it.
    out << "  loader " << std::fixed << std::setprecision(0)
        << (st.load_seconds > 0 ? double(epoch_samples) / st.load_seconds : 0.0) << " img/s, waited "
        << std::setprecision(2) << st.wait_seconds << "s" << std::defaultfloat;
    if (!peak_live.empty()) {
      out << "  live_micro_batches";
      for (int v : peak_live) out << " " << v;
    }
    out << "\n";
    out.flush();
    result.epochs.push_back(st);
    if (!o.checkpoint.empty())
      save_checkpoint(o.checkpoint, strategy.model(), strategy.optimizers(), epoch);
    if (on_epoch) on_epoch(st);
  }

  if (!o.profile.empty()) {
    Profiler::enable(false);
    out << "\nprofile (" << Profiler::records().size() << " ranges; trace in " << o.profile
        << "):\n" << Profiler::summary() << "\n";
    Profiler::write_trace(o.profile);
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
