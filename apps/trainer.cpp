#include "apps/trainer.h"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iomanip>
#include <cmath>
#include <cstdio>
#include <memory>

#include "engine/checkpoint.h"
#include "runtime/cuda_api.h"
#include "engine/data.h"
#include "engine/folder_data.h"
#include "engine/loader.h"
#include "engine/metrics.h"
#include "engine/profiler.h"
#include "engine/optim.h"
#include "engine/tape.h"
#include "models/unet.h"
#include "parallel/data_parallel.h"
#include "parallel/pipeline.h"
#include "parallel/split_search.h"

namespace unetcu {

void validate(const TrainConfig& c) {
  UNETCU_CHECK(c.epochs >= 1, "--epochs must be at least 1, got ", c.epochs);
  UNETCU_CHECK(c.batch_size >= 1, "--batch-size must be at least 1, got ", c.batch_size);
  UNETCU_CHECK(c.image_size >= 32 && c.image_size % 32 == 0,
               "--image-size must be a positive multiple of 32, got ", c.image_size);
  UNETCU_CHECK(c.lr > 0 && std::isfinite(c.lr), "--lr must be a positive number, got ", c.lr);
  // With --data the folder decides the sizes; they are checked once it has been read.
  const bool sized = c.data.empty();
  UNETCU_CHECK(c.train_size >= 1, "--train-size must be at least 1, got ", c.train_size);
  UNETCU_CHECK(c.val_size >= 1, "--val-size must be at least 1, got ", c.val_size);
  UNETCU_CHECK(!sized || c.batch_size <= c.train_size, "--batch-size ", c.batch_size,
               " is larger than the ", c.train_size, " training images");
  UNETCU_CHECK(c.width_divisor >= 1, "--width-divisor must be at least 1");
  UNETCU_CHECK(c.optimizer == "adam" || c.optimizer == "sgd",
               "--optimizer must be adam or sgd, got '", c.optimizer, "'");
  UNETCU_CHECK(c.weight_decay >= 0, "--weight-decay must be >= 0");
  UNETCU_CHECK(c.momentum >= 0 && c.momentum < 1, "--momentum must be in [0, 1)");
  UNETCU_CHECK(c.threads >= 0, "--threads must be >= 0");
  parse_augment(c.augment);
  UNETCU_CHECK(c.data.empty() || (c.val_fraction > 0 && c.val_fraction < 1) || !c.val_data.empty(),
               "--val-fraction must be between 0 and 1");
  UNETCU_CHECK(!c.data.empty() || (c.val_data.empty() && c.data_list.empty()),
               "--val-data and --data-list need --data");
  UNETCU_CHECK(c.mode == "single" || c.mode == "dp" || c.mode == "mp",
               "--mode must be single, dp or mp, got '", c.mode, "'");
  UNETCU_CHECK(c.mode != "single" || c.devices.empty(), "--devices belongs to --mode dp or mp");
  UNETCU_CHECK(c.mode == "dp" || !c.sync_bn, "--sync-bn belongs to --mode dp");
  UNETCU_CHECK(c.mode == "single" || (c.resume.empty() && c.init_encoder.empty()),
               "--resume and --init-encoder work with --mode single");
  if (c.mode == "mp") {
    UNETCU_CHECK(!c.devices.empty(), "--mode mp needs --devices (one per stage, e.g. cpu:0,cpu:1)");
    parse_stage_devices(c.devices);
    parse_schedule(c.schedule);
    UNETCU_CHECK(c.split_size >= 0, "--split-size must be at least 1, got ", c.split_size);
    UNETCU_CHECK(c.split_size <= c.batch_size, "--split-size ", c.split_size,
                 " is larger than --batch-size ", c.batch_size);
  }
  if (c.mode == "dp") {
    UNETCU_CHECK(!c.devices.empty(), "--mode dp needs --devices (e.g. cpu:0,cpu:1)");
    const int64_t n = int64_t(parse_device_list(c.devices).size());
    parse_allreduce(c.allreduce);
    UNETCU_CHECK(!sized || c.train_size / n >= c.batch_size, "the ", c.train_size,
                 " training images give each of the ", n, " replicas ", c.train_size / n,
                 " samples, fewer than --batch-size ", c.batch_size);
  }
  // BN in training mode needs more than one value per channel: at layer4 a sample is
  // (S/32)² values, so a batch of one 32×32 image cannot train.
  const int64_t last = int64_t(c.image_size / 32) * (c.image_size / 32);
  UNETCU_CHECK(int64_t(c.batch_size) * last > 1, "--batch-size 1 with --image-size ",
               c.image_size, " leaves one value per channel for batch norm; use a larger batch "
               "or image");
  // With --mode dp each replica batches its own train_size / N samples.
  const int64_t replicas = c.mode == "dp" ? int64_t(parse_device_list(c.devices).size()) : 1;
  UNETCU_CHECK(!sized || last > 1 || (c.train_size / replicas) % c.batch_size != 1, "--train-size ", c.train_size,
               " leaves a last batch of one ", c.image_size, "x", c.image_size,
               " image: one value per channel for batch norm; change --train-size or --batch-size");
}

namespace {

// Rendered samples are kept in memory when they fit in this much (see enable_cache).
constexpr double kDataCacheBytes = 4.0 * (1 << 30);

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

// --split auto: profile the blocks on the first stage's device, predict every cut × split
// size, run the best few for real, print the article's Table 1, return the fastest.
PipelineOptions search_split(const TrainConfig& cfg, const UNetConfig& mc, PipelineOptions o,
                             const Dataset& data,
                             const OptimizerFactory& make_optimizer, std::ostream& out) {
  UNETCU_CHECK(o.devices.size() == 2, "--split auto searches two-stage cuts: give two --devices");
  std::vector<int64_t> idx;
  for (int i = 0; i < cfg.batch_size; ++i) idx.push_back(i);
  const Batch batch = make_batch(data, idx, cfg.dtype);
  UNetConfig one = mc;
  one.device = o.devices[0];
  UNet probe(one);
  probe.train();
  // Profiled with one stage's thread budget, the budget each stage will run with.
  const int saved_threads = cpu_threads();
  const int stage_threads = o.threads_per_stage > 0 ? o.threads_per_stage
                                                    : std::max(1, saved_threads / int(o.devices.size()));
  if (o.devices[0].is_cpu()) set_cpu_threads(stage_threads);
  const auto blocks = profile_blocks(probe, batch, cfg.loss, 2);
  set_cpu_threads(saved_threads);
  std::vector<int> splits;
  for (int s = 1; s < cfg.batch_size; s *= 2) splits.push_back(s);
  splits.push_back(cfg.batch_size);
  if (cfg.split_size) splits = {cfg.split_size};
  auto plans = rank_plans(blocks, cfg.batch_size, splits, o.schedule, LinkModel{});
  const size_t run = std::min<size_t>(3, plans.size());
  for (size_t k = 0; k < run; ++k) {
    PipelineOptions trial = o;
    trial.cuts = plans[k].cuts;
    trial.split_size = plans[k].split_size;
    Pipeline pipe(mc, trial, make_optimizer);
    std::vector<double> t;
    for (int s = 0; s < 3; ++s) {
      const auto t0 = Clock::now();
      pipe.step(batch, cfg.loss);
      if (s) t.push_back(seconds_since(t0));  // the first step warms up
    }
    plans[k].measured_s = *std::min_element(t.begin(), t.end());
  }
  size_t best = 0;
  for (size_t k = 1; k < run; ++k)
    if (plans[k].measured_s < plans[best].measured_s) best = k;
  out << "split search (" << cfg.schedule << ", batch " << cfg.batch_size
      << "; the best " << run << " predictions run for real):\n"
      << plans_table(plans, blocks) << "chosen: cut after " << blocks[plans[best].cuts[0] - 1].name
      << ", split_size " << plans[best].split_size << "\n";
  o.cuts = plans[best].cuts;
  o.split_size = plans[best].split_size;
  return o;
}

}  // namespace

TrainResult train_unet(const TrainConfig& cfg, std::ostream& out,
                       const std::function<void(const EpochStats&)>& on_epoch) {
  validate(cfg);
  std::string note;
  const bool dp_mode = cfg.mode == "dp", mp_mode = cfg.mode == "mp";
  std::vector<Device> dp_devices;
  Device device;
  if (mp_mode) {
    dp_devices = parse_stage_devices(cfg.devices);
    for (const Device& d : dp_devices) resolve_device(d.str(), nullptr);
    device = dp_devices.back();  // the last stage holds the head: evaluation runs there
    out << "devices: " << cfg.devices << " (model parallel: " << dp_devices.size() << " stages, ";
    if (cfg.split == "auto")
      out << "cut and split size from the search below";
    else
      out << "cut after " << cfg.split << ", batch " << cfg.batch_size << " in micro-batches of "
          << (cfg.split_size ? cfg.split_size : cfg.batch_size);
    out << ", " << cfg.schedule << " schedule; BN statistics per micro-batch)\n";
  } else if (dp_mode) {
    dp_devices = parse_device_list(cfg.devices);
    for (const Device& d : dp_devices) resolve_device(d.str(), nullptr);  // exists?
    device = dp_devices[0];  // rank 0: evaluation and reporting
    out << "devices: " << cfg.devices << " (data parallel: " << dp_devices.size()
        << " replicas x batch " << cfg.batch_size << " = global batch "
        << dp_devices.size() * cfg.batch_size << ", " << cfg.allreduce << " all-reduce"
        << (cfg.sync_bn ? ", synchronized BN" : "") << ")\n";
  } else {
    // float64 is a CPU-only type: "auto" then means the CPU.
    device = resolve_device(
        cfg.device == "auto" && cfg.dtype != DType::F32 ? std::string("cpu") : cfg.device, &note);
    out << "device: " << device.str() << " (" << note << ")\n";
  }
  if (cfg.threads > 0 && !dp_mode && !mp_mode) set_cpu_threads(cfg.threads);
  // The data: the embedded synthetic set, or an image folder.
  std::unique_ptr<SyntheticSegmentation> synthetic;
  std::unique_ptr<Dataset> train_ds, val_ds;
  bool cached = false;
  if (cfg.data.empty()) {
    synthetic = std::make_unique<SyntheticSegmentation>(cfg.image_size, cfg.seed);
    const int64_t total = cfg.train_size + cfg.val_size;
    cached = double(total) * SyntheticSegmentation::sample_bytes(cfg.image_size) <= kDataCacheBytes;
    if (cached) synthetic->enable_cache(total);
    train_ds = std::make_unique<SyntheticDataset>(*synthetic, 0, cfg.train_size);
    val_ds = std::make_unique<SyntheticDataset>(*synthetic, cfg.train_size, cfg.val_size);
  } else {
    auto pairs = FolderDataset::scan(cfg.data, cfg.data_list);
    std::vector<FolderDataset::Pair> train_pairs, val_pairs;
    if (!cfg.val_data.empty()) {
      train_pairs = std::move(pairs);
      val_pairs = FolderDataset::scan(cfg.val_data);
    } else {
      split_pairs(pairs, cfg.val_fraction, cfg.seed, &train_pairs, &val_pairs);
    }
    train_ds = std::make_unique<FolderDataset>(std::move(train_pairs), cfg.image_size);
    val_ds = std::make_unique<FolderDataset>(std::move(val_pairs), cfg.image_size);
    TrainConfig sized = cfg;  // the folder decides the sizes: check them now
    sized.train_size = train_ds->size();
    sized.val_size = val_ds->size();
    sized.data.clear(), sized.val_data.clear(), sized.data_list.clear();
    validate(sized);
  }
  const int64_t train_n = train_ds->size(), val_n = val_ds->size();
  const Augment augment = parse_augment(cfg.augment);
  UNETCU_CHECK(device.is_cpu() || cfg.dtype == DType::F32, "--dtype ", dtype_name(cfg.dtype),
               " is CPU only; ", device.str(), " trains in float32");
  if (device.is_cuda()) cuda::set_allow_tf32(cfg.tf32);
  const bool on_gpu = device.is_cuda();
  // A batch is made on the host (in pinned memory for a GPU) and uploaded; training samples
  // are augmented (seeded by seed, epoch and index), validation samples never.
  int current_epoch = 0;
  double load_seconds = 0;  // time spent making batches, per epoch
  auto timed_batch = [&](const Dataset& ds, const std::vector<int64_t>& idx, bool pinned, Augment aug) {
    const auto t0 = Clock::now();
    Batch b = make_batch(ds, idx, cfg.dtype, pinned, aug, cfg.seed, current_epoch);
    load_seconds += seconds_since(t0);
    return b;
  };
  // Loader threads for the single-device loop: one on the CPU (the cores train), a few on a GPU.
  const int loader_workers = cfg.workers > 0 ? cfg.workers : (on_gpu ? 4 : 1);
  auto host_train_batch = [&](const std::vector<int64_t>& idx) { return timed_batch(*train_ds, idx, false, augment); };
  auto val_batch = [&](const std::vector<int64_t>& idx) { return make_batch(*val_ds, idx, cfg.dtype, on_gpu); };
  auto upload = [&](const Batch& host) {
    return on_gpu ? Batch{host.images.to(device), host.masks.to(device)} : host;
  };

  UNetConfig mc;
  mc.width_divisor = cfg.width_divisor;
  mc.dtype = cfg.dtype;
  mc.seed = cfg.seed;
  mc.device = device;
  std::unique_ptr<UNet> single_model;
  std::unique_ptr<DataParallel> dp;
  const OptimizerFactory make_optimizer = [&](std::vector<Tensor> params) -> std::unique_ptr<Optimizer> {
    if (cfg.optimizer == "adam") {
      AdamOptions o;
      o.lr = cfg.lr;
      o.weight_decay = cfg.weight_decay;
      return std::make_unique<Adam>(std::move(params), o);
    }
    SgdOptions o;
    o.lr = cfg.lr;
    o.momentum = cfg.momentum;
    o.weight_decay = cfg.weight_decay;
    return std::make_unique<SGD>(std::move(params), o);
  };
  std::unique_ptr<Optimizer> opt;
  std::unique_ptr<Pipeline> pipe;
  if (mp_mode) {
    PipelineOptions o;
    o.devices = dp_devices;
    o.schedule = parse_schedule(cfg.schedule);
    o.threads_per_stage = cfg.threads;
    if (cfg.split == "auto") {
      o = search_split(cfg, mc, o, *train_ds, make_optimizer, out);
    } else {
      UNetConfig probe_cfg = mc;
      probe_cfg.device = Device::cpu();
      probe_cfg.width_divisor = 64;  // only the block names are read
      UNet probe(probe_cfg);
      o.cuts = parse_cuts(cfg.split, probe);
      UNETCU_CHECK(o.cuts.size() + 1 == dp_devices.size(), "--split ", cfg.split, " makes ",
                   o.cuts.size() + 1, " stages but --devices lists ", dp_devices.size());
      o.split_size = cfg.split_size ? cfg.split_size : cfg.batch_size;
    }
    pipe = std::make_unique<Pipeline>(mc, o, make_optimizer);
  } else if (dp_mode) {
    DataParallelOptions o;
    o.devices = dp_devices;
    o.algo = parse_allreduce(cfg.allreduce);
    o.sync_bn = cfg.sync_bn;
    o.threads_per_replica = cfg.threads;
    dp = std::make_unique<DataParallel>(mc, o, make_optimizer);
  } else {
    single_model = std::make_unique<UNet>(mc);
    opt = make_optimizer(single_model->parameters());
  }
  UNet& model = pipe ? pipe->model() : dp ? dp->replica(0) : *single_model;
  int first_epoch = 1;
  if (!cfg.init_encoder.empty()) {
    load_model_state(model, read_safetensors(cfg.init_encoder), cfg.init_encoder, "encoder.");
    out << "encoder weights from " << cfg.init_encoder << "\n";
  }
  if (!cfg.resume.empty()) {
    UNETCU_CHECK(std::ifstream(cfg.resume + ".train").good(), "--resume ", cfg.resume, ": no ",
                 cfg.resume, ".train beside it (optimizer state and epoch); use --init-encoder or "
                 "load the weights another way to start over");
    first_epoch = load_checkpoint(cfg.resume, model, opt.get()) + 1;
    out << "resumed from " << cfg.resume << " after epoch " << first_epoch - 1 << "\n";
    UNETCU_CHECK(first_epoch <= cfg.epochs, "--resume: the checkpoint is from epoch ", first_epoch - 1,
                 ", nothing left to do with --epochs ", cfg.epochs);
  }
  TrainResult result;
  result.parameter_count = model.parameter_count();
  const int N = dp ? dp->size() : 1;
  // Data parallel sampling (DistributedSampler semantics): each epoch's permutation is cut to
  // a multiple of N (the last train_size mod N samples of it are dropped) and rank r takes
  // every N-th sample from position r: disjoint, equally sized shards.
  const int64_t per_rank = train_n / N;

  out << "model: Unet(resnet34), " << result.parameter_count << " parameters, width divisor "
      << cfg.width_divisor << ", " << dtype_name(cfg.dtype) << "\n"
      << "data: " << (cfg.data.empty() ? "synthetic" : cfg.data) << " at " << cfg.image_size << "x"
      << cfg.image_size << ", " << train_n << " train / " << val_n << " validation"
      << (augment == Augment::None ? "" : ", augment " + cfg.augment)
      << (cached ? " (kept in memory after the first epoch)" : "") << ", batch " << cfg.batch_size
      << ", loss " << loss_kind_name(cfg.loss) << ", " << cfg.optimizer << " lr " << cfg.lr
      << "\n";
  out.flush();

  if (!cfg.profile.empty()) {
    Profiler::reset();
    Profiler::enable(true);
  }
  const int64_t steps = (per_rank + cfg.batch_size - 1) / cfg.batch_size;
  const int64_t epoch_samples = per_rank * N;
  for (int epoch = first_epoch; epoch <= cfg.epochs; ++epoch) {
    EpochStats st;
    st.epoch = epoch;
    if (dp)
      for (int r = 0; r < N; ++r) dp->replica(r).train();
    else
      model.train();
    std::vector<int> peak_live;
    const auto perm = epoch_permutation(train_n, cfg.seed, epoch);
    current_epoch = epoch;
    load_seconds = 0;
    // Step s of rank r: its samples [s*b, min((s+1)*b, per_rank)) of the strided shard.
    auto shard_indices = [&](int64_t s, int r) {
      std::vector<int64_t> idx;
      const int64_t hi = std::min<int64_t>((s + 1) * cfg.batch_size, per_rank);
      for (int64_t i = s * cfg.batch_size; i < hi; ++i) idx.push_back(perm[r + i * N]);
      return idx;
    };
    auto batch_indices = [&](int64_t s) { return shard_indices(s, 0); };
    Progress bar(cfg.progress, epoch, steps);
    if (on_gpu) cuda::reset_device_peak(device.index);
    const auto t0 = Clock::now();
    double loss_sum = 0;
    int64_t seen = 0;
    for (int64_t s = 0; s < steps && pipe; ++s) {
      const Batch b = host_train_batch(batch_indices(s));  // host; stages take their parts
      const double loss_value = pipe->step(b, cfg.loss);
      UNETCU_CHECK(std::isfinite(loss_value), "loss is not finite (", loss_value, ") at epoch ",
                   epoch, " step ", s + 1, "; lower --lr");
      loss_sum += loss_value * double(b.images.dim(0));
      seen += b.images.dim(0);
      bar.update(s + 1, seconds_since(t0), seen);
      const auto live = pipe->peak_live_micro_batches();
      if (peak_live.empty()) peak_live = live;
      for (size_t i = 0; i < live.size(); ++i) peak_live[i] = std::max(peak_live[i], live[i]);
    }
    // Single device: the loader's workers make the batches ahead of the step (in pinned
    // memory for a GPU), in order, so the step only waits when they fall behind.
    std::unique_ptr<BatchLoader> loader;
    if (!dp && !pipe)
      loader = std::make_unique<BatchLoader>(
          steps,
          [&, epoch](int64_t s) {
            return make_batch(*train_ds, batch_indices(s), cfg.dtype, on_gpu, augment, cfg.seed, epoch);
          },
          loader_workers, loader_workers + 1);
    for (int64_t s = 0; s < steps && dp; ++s) {
      std::vector<Batch> shards;  // host tensors; each replica uploads its own
      for (int r = 0; r < N; ++r) shards.push_back(host_train_batch(shard_indices(s, r)));
      const std::vector<double> losses = dp->step(shards, cfg.loss);
      const double loss_value = losses[0];  // reported from rank 0
      UNETCU_CHECK(std::isfinite(loss_value), "loss is not finite (", loss_value, ") at epoch ",
                   epoch, " step ", s + 1, "; lower --lr");
      const int64_t count = shards[0].images.dim(0);
      loss_sum += loss_value * double(count);
      seen += count * N;
      bar.update(s + 1, seconds_since(t0), seen);
    }
    for (int64_t s = 0; s < steps && !dp && !pipe; ++s) {
      const Batch host = loader->next();  // kept alive until its upload is done
      const Batch b = upload(host);
      const int64_t count = b.images.dim(0);
      Tape tape;
      Tensor loss;
      {
        TapeScope scope(tape);
        loss = segmentation_loss(cfg.loss, model.forward(b.images), b.masks);
        opt->zero_grad();
        tape.backward(loss);
      }
      opt->step();
      const double loss_value = loss.item();
      UNETCU_CHECK(std::isfinite(loss_value), "loss is not finite (", loss_value, ") at epoch ",
                   epoch, " step ", s + 1, "; lower --lr");
      loss_sum += loss_value * double(count);
      seen += count;
      bar.update(s + 1, seconds_since(t0), seen);
    }
    st.seconds = seconds_since(t0);
    // The loader's capacity: its workers run side by side.
    st.load_seconds = loader ? loader->busy_seconds() / loader_workers : load_seconds;
    st.wait_seconds = loader ? loader->wait_seconds() : load_seconds;
    loader.reset();
    bar.finish();
    st.train_loss = loss_sum / double(per_rank);
    st.images_per_second = double(epoch_samples) / st.seconds;

    // Validation: eval-mode BN, no tape.
    model.eval();
    SegmentationCounts counts;
    double val_loss = 0;
    for (int64_t lo = 0; lo < val_n; lo += cfg.batch_size) {
      const int64_t hi = std::min<int64_t>(lo + cfg.batch_size, val_n);
      std::vector<int64_t> idx;
      for (int64_t i = lo; i < hi; ++i) idx.push_back(i);
      const Batch host = val_batch(idx);  // alive until the loss below has been read
      Batch b = upload(host);
      if (pipe && b.masks.device() != device) b.masks = b.masks.to(device);  // the last stage's
      Tensor logits = pipe ? pipe->infer(b.images) : model.forward(b.images);
      val_loss += segmentation_loss(cfg.loss, logits, b.masks).item() * double(hi - lo);
      counts.add(logits, b.masks);
    }
    st.val_loss = val_loss / double(val_n);
    st.val_iou = counts.iou();
    st.val_dice = counts.dice();
    if (on_gpu) st.peak_device_bytes = cuda::device_memory_stats(device.index).peak_bytes;

    char line[256];
    std::snprintf(line, sizeof line,
                  "epoch %d/%d  time %.2fs  loss %.4f  val_loss %.4f  val_iou %.4f  "
                  "val_dice %.4f  %.1f img/s",
                  epoch, cfg.epochs, st.seconds, st.train_loss, st.val_loss, st.val_iou,
                  st.val_dice, st.images_per_second);
    out << line;
    if (on_gpu) out << "  peak_mem " << std::fixed << std::setprecision(0)
                    << double(st.peak_device_bytes) / (1 << 20) << " MiB" << std::defaultfloat;
    // The loader: its rate, and how much of the epoch the step waited for it (on the CPU it
    // makes batches in line; on a GPU the next batch is made while the step runs).
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
    if (!cfg.checkpoint.empty()) save_checkpoint(cfg.checkpoint, model, opt.get(), epoch);
    if (on_epoch) on_epoch(st);
  }

  if (!cfg.profile.empty()) {
    Profiler::enable(false);
    out << "\nprofile (" << Profiler::records().size() << " ranges; trace in " << cfg.profile
        << "):\n" << Profiler::summary() << "\n";
    Profiler::write_trace(cfg.profile);
  }
  double sum = 0, sq = 0;
  for (const auto& e : result.epochs) sum += e.seconds;
  result.mean_epoch_seconds = sum / result.epochs.size();
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
