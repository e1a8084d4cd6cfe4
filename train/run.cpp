// A training run assembled from its configuration (train/run.h): the process group, the devices,
// the data, the strategy, what is printed, then fit().
#include "train/run.h"

#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "data/labels.h"
#include "engine/checkpoint.h"
#include "kernels/cpu/cpu_select.h"
#include "parallel/nccl_communicator.h"
#include "planning/memory_model.h"
#include "runtime/allocator.h"
#include "runtime/cuda_api.h"
#include "train/auto_mode.h"

namespace unetcu {

namespace {
// Rendered synthetic samples are kept in memory when they fit in this much.
constexpr double kDataCacheBytes = 4.0 * (1 << 30);
}  // namespace
namespace {

// Processes started by a launcher train as a group: several of them, or one when dist names
// its launcher (a group of one runs the across-processes path, e.g. one NCCL rank).
bool as_group(DistMode mode) {
  const DistEnv d = detect_dist(mode);
  return d.multi() || ((mode == DistMode::Mpi || mode == DistMode::Env) && d.launcher != "none");
}

// The sizes the training set decides: the synthetic set's train_size, or the count a folder
// gave (`folder` non-empty), named as the user knows them.
void check_train_count(const TrainConfig& c, int64_t train_n, const std::string& folder) {
  const std::string what = folder.empty() ? str_cat(setting("train_size"), " ", train_n)
                                          : str_cat("the ", train_n, " training images of ", folder);
  // A replica's samples per optimizer step.
  const int64_t step = int64_t(c.fit.batch_size) * c.fit.accumulate_grad_batches;
  const std::string step_what =
      c.fit.accumulate_grad_batches == 1
          ? str_cat(setting("batch_size"), " ", c.fit.batch_size)
          : str_cat(setting("batch_size"), " ", c.fit.batch_size, " x ", setting("accumulate_grad_batches"), " ",
                    c.fit.accumulate_grad_batches, " = ", step);
  UNETCU_CHECK(step <= train_n, step_what, " is larger than the ", train_n, " training images",
               folder.empty() ? "" : " of " + folder);
  // Data parallel: one replica per device, or per process of a launched job.
  const DistEnv dist = detect_dist(c.dist);
  int64_t dp_replicas = as_group(c.dist) ? dist.world : std::max<int64_t>(1, int64_t(c.strategy.devices.size()));
  if (c.strategy.mode == Mode::DPMP) dp_replicas = dist.world / std::max(1, c.strategy.mp.pipeline_stages);
  if (c.strategy.mode == Mode::DP || c.strategy.mode == Mode::DPMP) {
    const int64_t n = dp_replicas;
    UNETCU_CHECK(train_n / n >= step, "the ", train_n, " training images give each of the ", n,
                 " replicas ", train_n / n, " samples, fewer than ", step_what);
  }
  // BN in training needs more than one value per channel: at layer4 a sample is (S/32)² values.
  const int tw = c.fit.crop_size ? c.fit.crop_size : c.data.width(),
            th = c.fit.crop_size ? c.fit.crop_size : c.data.height();
  const int64_t last = int64_t(tw / 32) * (th / 32);
  const int64_t replicas =
      c.strategy.mode == Mode::DP || c.strategy.mode == Mode::DPMP ? dp_replicas : 1;
  // With accumulation one device and DP run a step in batches of batch_size (the last batch's
  // rows are then n % step % batch = n % batch); a pipeline cuts the step into micro-batches
  // (checked below).
  const bool pipeline = c.strategy.mode == Mode::MP || c.strategy.mode == Mode::DPMP;
  UNETCU_CHECK(
      last > 1 || (pipeline && c.fit.accumulate_grad_batches > 1) || (train_n / replicas) % c.fit.batch_size != 1, what,
      " leaves a last batch of one ", tw, "x", th, " image: one value per channel for batch norm; change the sizes or ",
      setting("batch_size"));
  if ((c.strategy.mode == Mode::MP || c.strategy.mode == Mode::DPMP) && last == 1 &&
      !c.strategy.mp.search_split) {
    // Every micro-batch, the epoch's last batch's included, needs two samples.
    const int64_t split = c.strategy.mp.split_size ? c.strategy.mp.split_size : c.fit.batch_size;
    const int64_t tail = (train_n / replicas) % step;
    UNETCU_CHECK(split >= 2 && step % split != 1 && (tail == 0 || tail % split != 1),
                 setting("split_size"), " ", split, " with ", step_what, " and ", train_n,
                 " training images makes a micro-batch of one ", tw, "x", th,
                 " image: one value per channel for batch norm");
  }
  // A warmup as long as the run: refused before the model is built (fit() checks it again).
  const int64_t total_steps =
      replicas >= 1 ? int64_t(c.fit.epochs) * steps_per_epoch(train_n, int(replicas), int(step)) : 0;
  UNETCU_CHECK(c.warmup_steps <= 1 || total_steps <= 0 || c.warmup_steps < total_steps, setting("warmup_steps"), " ",
               c.warmup_steps, " leaves no step at the full rate: the run has ", total_steps, " steps");
}

}  // namespace

// The fewest images a batch of the run may hold: batch norm needs two values per channel at
// layer4, (W/32)·(H/32) per image.
static int fewest_images(const TrainConfig& cfg) {
  const int tw = cfg.fit.crop_size ? cfg.fit.crop_size : cfg.data.width(),
            th = cfg.fit.crop_size ? cfg.fit.crop_size : cfg.data.height();
  return (tw / 32) * (th / 32) > 1 ? 1 : 2;
}

// recompute auto: the memory model (planning/memory_model.h) measured on the run's first
// device at batches of 1 and 2 of the training set, then the fewest blocks whose recomputation
// it predicts puts the step under max_memory on every device of the run (ties: the lowest peak).
static std::vector<bool> choose_recompute(const TrainConfig& cfg, const StrategyConfig& sc,
                                          const Dataset& train, std::ostream& out) {
  UNETCU_CHECK(
      sc.mode == Mode::Single || sc.mode == Mode::DP || (sc.mode == Mode::MP && !sc.across_processes),
      setting("recompute"), " auto: ", setting("mode"),
      " single, dp, or mp in one process (it models every stage of the pipeline); name the blocks to recompute "
      "instead");
  UNETCU_CHECK(!sc.mp.search_split, setting("recompute"), " auto models a given cut: with ", setting("split"),
               " auto name the blocks to recompute, or give ", setting("mode"), " auto to choose both");
  const size_t limit = memory_limit();
  UNETCU_CHECK(limit > 0, setting("recompute"), " auto needs ", setting("max_memory"),
               " (the memory the step must fit in)");
  const int k = fewest_images(cfg);
  UNETCU_CHECK(train.size() >= 2 * k, setting("recompute"), " auto measures batches of ", k, " and ", 2 * k,
               " images: the training set has ", train.size());
  UNetConfig mc = sc.model;
  mc.device = sc.devices.at(0);
  mc.recompute.clear();
  MemoryProfile profile;
  set_memory_limit(0);  // the measurement is not the run
  try {
    UNet model(mc);
    auto optimizer = optimizer_factory(sc.optimizer)(model.parameters());
    const auto batch = [&](int n) {
      std::vector<int64_t> idx;
      for (int i = 0; i < n; ++i) idx.push_back(i);
      return make_batch(train, idx, cfg.fit.dtype, false, Augment::None, 0, 0, cfg.fit.crop_size);
    };
    profile = profile_memory(model, *optimizer, sc.loss, batch(k), batch(2 * k));
  } catch (...) {
    set_memory_limit(limit, setting("max_memory"));
    throw;
  }
  set_memory_limit(limit, setting("max_memory"));
  const int blocks = UNet::kBlocks, n = cfg.fit.batch_size;
  // The step as the strategy runs it: a replica's shard, or every stage of the pipeline.
  MemoryPlan plan;
  plan.batch = n;
  plan.devices = sc.devices;
  if (sc.mode != Mode::MP) plan.chunks = cfg.fit.accumulate_grad_batches;  // batch_size at a time
  if (sc.mode == Mode::DP) {
    plan.kind = MemoryPlan::DataParallel;
  } else if (sc.mode == Mode::MP) {
    plan.kind = MemoryPlan::Pipeline;
    plan.batch = n * cfg.fit.accumulate_grad_batches;  // a pipeline accumulates over more micro-batches
    plan.cuts = sc.mp.cuts;
    plan.split_size = sc.mp.split_size;
    plan.schedule = sc.mp.schedule;
  }
  const auto peak_of = [&](const std::vector<bool>& set) {
    plan.recompute = set;
    return most_on_a_device(profile, plan);
  };
  std::vector<bool> best, set(static_cast<size_t>(blocks), false);
  int best_count = blocks + 1;
  double best_peak = 0;
  for (unsigned mask = 0; mask < (1u << blocks); ++mask) {
    int count = 0;
    for (int b = 0; b < blocks; ++b) count += (set[size_t(b)] = (mask >> b) & 1u);
    if (count > best_count) continue;
    const double peak = peak_of(set);
    if (peak > double(limit) * (1 - kMemoryHeadroom)) continue;
    if (count < best_count || peak < best_peak) best = set, best_count = count, best_peak = peak;
  }
  const auto mib = [](double b) { return str_cat(int64_t(b / (1 << 20) + 0.5), " MiB"); };
  const double all = peak_of(std::vector<bool>(size_t(blocks), true));
  UNETCU_CHECK(best_count <= blocks, setting("recompute"), " auto: a step of ", n, " images needs about ", mib(all),
               " with every block recomputed, over the limit of ", mib(double(limit)), " (", setting("max_memory"),
               ") less ", int(kMemoryHeadroom * 100),
               " % to spare; use a smaller batch, split the model over devices, or let ", setting("mode"),
               " auto accumulate");
  std::string names;
  for (int b = 0; b < blocks; ++b)
    if (best[size_t(b)]) names += (names.empty() ? "" : ",") + UNet::block_names()[size_t(b)];
  out << "recompute auto: " << (names.empty() ? std::string("none") : names) << " (predicted peak "
      << mib(best_peak) << " of the " << mib(double(limit)) << " limit; without recomputation "
      << mib(peak_of({})) << ")\n";
  if (best_count == 0) best.clear();
  return best;
}

// The memory each device of a mode auto run may take: max_memory, else a GPU's free memory
// less a tenth (the CUDA context's and cuDNN's own, fragmentation), else the host's available
// memory shared out over the CPU devices.
static double auto_memory_limit(const std::vector<Device>& devices) {
  if (memory_limit() > 0) return double(memory_limit());
  if (devices.at(0).is_cuda()) {
    double least = 0;
    for (size_t i = 0; i < devices.size(); ++i) {
      const double free_b = 0.9 * double(cuda::device_free_memory(devices[i].index));
      least = i ? std::min(least, free_b) : free_b;
    }
    return least;
  }
  const double available = double(sysconf(_SC_AVPHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  return available / double(devices.size());
}

// mode auto (train/auto_mode.h): the plan chosen, its strategy in `sc`, its batch and
// accumulation in `cfg` (the images per optimizer step stay batch_size).
static void choose_plan(TrainConfig& cfg, const Dataset& train, std::ostream& out) {
  const int min_samples = fewest_images(cfg);
  UNETCU_CHECK(train.size() >= 2 * min_samples, setting("mode"), " auto measures batches of ", min_samples, " and ",
               2 * min_samples, " images: the training set has ", train.size());
  const auto batch_of = [&](int n) {
    std::vector<int64_t> idx;
    for (int i = 0; i < n; ++i) idx.push_back(i % train.size());
    return make_batch(train, idx, cfg.fit.dtype, false, Augment::None, 0, 0, cfg.fit.crop_size);
  };
  const double limit = auto_memory_limit(cfg.strategy.devices);
  const AutoResult r = choose_auto_plan(cfg.strategy, batch_of, cfg.fit.batch_size, limit, min_samples, out);
  const int threads = cfg.strategy.threads;
  cfg.strategy = r.strategy;  // as if the flags had said it (check_train_count reads them)
  cfg.strategy.threads = threads;
  cfg.fit.batch_size = r.batch_size;
  cfg.fit.accumulate_grad_batches = r.accumulate;
}

// ", recompute N blocks" (all: "every block"), or nothing.
static std::string recompute_text(const std::vector<bool>& on) {
  const long n = std::count(on.begin(), on.end(), true);
  if (n == 0) return "";
  if (n == long(on.size())) return ", every block recomputed in the backward";
  std::string names;
  for (size_t b = 0; b < on.size(); ++b)
    if (on[b]) names += (names.empty() ? "" : ",") + UNet::block_names()[b];
  return ", recomputed in the backward: " + names;
}

LrSchedule lr_schedule_of(const TrainConfig& c) {
  LrSchedule s;
  s.kind = c.lr_schedule;
  s.lr = c.strategy.optimizer.lr;
  s.warmup_steps = c.warmup_steps;
  if (c.min_lr) s.min_lr = *c.min_lr;
  if (c.lr_power) s.power = *c.lr_power;
  if (c.lr_step_epochs) s.step_epochs = *c.lr_step_epochs;
  if (c.lr_gamma) s.gamma = *c.lr_gamma;
  return s;
}

// Throws unetcu::Error naming the setting (setting()) for a configuration that cannot train,
// after with_settings (it reads what that derives); with a folder (data.data) its sizes are
// checked once it has been read.
static void validate(const TrainConfig& c) {
  c.fit.check();
  c.data.check();
  const int channels = c.strategy.model.in_channels;
  UNETCU_CHECK(channels >= 1 && channels <= 64, setting("in_channels"), " must be in 1..64, got ", channels);
  UNETCU_CHECK(c.normalize != Normalization::ImageNet || channels == 3, setting("normalize"),
               " imagenet holds the mean and deviation of 3 channels, not ", channels, " (", setting("normalize"),
               " dataset or none)");
  const Mode mode = c.strategy.mode;
  UNETCU_CHECK(mode == Mode::Single || mode == Mode::Auto || !c.device || c.strategy.across_processes,
               setting("device"), " belongs to ", setting("mode"),
               " single (or, under a launcher, names each process's device kind); ", setting("mode"),
               " dp and mp take ", setting("devices"));
  c.strategy.check(c.fit.batch_size, detect_dist(c.dist));
  // What crosses the parts: the data's sizes and the crops, the schedule's values given with
  // it, the precision's settings, what the automatic mode chooses itself.
  UNETCU_CHECK(c.fit.crop_size == 0 || c.data.data.empty() || !c.image_size_given, setting("image_size"),
               " resizes every image; ", setting("crop_size"),
               " trains on crops of images at their own size: give one of them");
  const double lr = c.strategy.optimizer.lr;
  UNETCU_CHECK(!c.min_lr || c.lr_schedule == LrScheduleKind::Cosine, setting("min_lr"), " belongs to ",
               setting("lr_schedule"), " cosine");
  UNETCU_CHECK(!c.lr_power || c.lr_schedule == LrScheduleKind::Poly, setting("lr_power"), " belongs to ",
               setting("lr_schedule"), " poly");
  UNETCU_CHECK((!c.lr_step_epochs && !c.lr_gamma) || c.lr_schedule == LrScheduleKind::Step,
               setting("lr_step_epochs"), " and ", setting("lr_gamma"), " belong to ", setting("lr_schedule"), " step");
  UNETCU_CHECK(c.lr_schedule != LrScheduleKind::Step || c.lr_step_epochs, setting("lr_schedule"), " step needs ",
               setting("lr_step_epochs"), " N (the epochs between two decays)");
  UNETCU_CHECK(c.warmup_steps >= 0 && c.warmup_steps <= kMaxWarmupSteps, setting("warmup_steps"), " must be in 0..",
               kMaxWarmupSteps, ", got ", c.warmup_steps);
  UNETCU_CHECK(!c.min_lr || (*c.min_lr >= 0 && *c.min_lr <= lr), setting("min_lr"), " must be in 0..", setting("lr"),
               " (", lr, "), got ", c.min_lr.value_or(0));
  UNETCU_CHECK(!c.lr_power || (*c.lr_power > 0 && *c.lr_power <= kMaxLrPower), setting("lr_power"),
               " must be in (0, ", kMaxLrPower, "], got ", c.lr_power.value_or(0));
  UNETCU_CHECK(!c.lr_step_epochs || *c.lr_step_epochs >= 1, setting("lr_step_epochs"), " must be at least 1, got ",
               c.lr_step_epochs.value_or(0));
  UNETCU_CHECK(!c.lr_gamma || (*c.lr_gamma > 0 && *c.lr_gamma <= 1), setting("lr_gamma"), " must be in (0, 1], got ",
               c.lr_gamma.value_or(0));
  UNETCU_CHECK(!c.early_stop_delta || c.fit.monitor.patience > 0, setting("early_stop_delta"), " belongs to ",
               setting("early_stop"), " N");
  UNETCU_CHECK(!c.early_stop_delta || (*c.early_stop_delta >= 0 && std::isfinite(*c.early_stop_delta)),
               setting("early_stop_delta"), " must be a finite number >= 0, got ", c.early_stop_delta.value_or(0));
  UNETCU_CHECK(!c.monitor || c.fit.monitor.patience > 0 || !c.fit.save_best.empty(), setting("monitor"),
               " belongs to ", setting("save_best"), " or ", setting("early_stop"));
  if (mode == Mode::Auto) {
    UNETCU_CHECK(!c.split_given && c.strategy.mp.split_size == 0, setting("mode"),
                 " auto chooses the cut and the split size: drop ", setting("split"), " and ", setting("split_size"));
    UNETCU_CHECK(!c.recompute_given && !c.recompute_auto, setting("mode"), " auto chooses what to recompute: drop ",
                 setting("recompute"));
    UNETCU_CHECK(!c.schedule_given, setting("mode"), " auto chooses the schedule: drop ", setting("schedule"));
    UNETCU_CHECK(!c.strategy.cuda_graphs, setting("mode"), " auto times and models eager steps: drop ",
                 setting("cuda_graphs"), " (or give the plan it chose, with ", setting("cuda_graphs"), ", as flags)");
    UNETCU_CHECK(c.fit.accumulate_grad_batches == 1, setting("mode"), " auto chooses the accumulation (",
                 setting("batch_size"), " is then the images per optimizer step): drop ",
                 setting("accumulate_grad_batches"));
    UNETCU_CHECK(!c.device || c.strategy.devices.empty(), setting("mode"), " auto: give ", setting("devices"),
                 " (the devices it may use) or ", setting("device"), " (one), not both");
  }
  UNETCU_CHECK(c.fit.accumulate_grad_batches == 1 || !c.strategy.mp.search_split, setting("split"),
               " auto times one batch of ", setting("batch_size"), "; with ", setting("accumulate_grad_batches"), " ",
               c.fit.accumulate_grad_batches, " give the cuts and ", setting("split_size"));
  UNETCU_CHECK(c.precision != Precision::TF32 || c.tf32, setting("no_tf32"), " and ", setting("precision"),
               " tf32 contradict each other");
  UNETCU_CHECK(c.precision != Precision::BF16 || c.fit.dtype == DType::F32, setting("precision"),
               " bf16 keeps float32 parameters; it does not go with ", setting("dtype"), " ", dtype_name(c.fit.dtype));
  // BN in training mode needs more than one value per channel: at layer4 a sample is
  // (S/32)² values, so a batch of one 32×32 image cannot train.
  const int tw = c.fit.crop_size ? c.fit.crop_size : c.data.width(),
            th = c.fit.crop_size ? c.fit.crop_size : c.data.height();
  const int64_t last = int64_t(tw / 32) * (th / 32);
  UNETCU_CHECK(int64_t(c.fit.batch_size) * last > 1, setting("batch_size"), " 1 with ", tw, "x", th,
               " images leaves one value per channel for batch norm; use a larger batch or image");
  // With data the folder decides the sizes; they are checked once it has been read.
  if (c.data.data.empty()) check_train_count(c, c.data.train_size, "");
}

void apply_precision(Precision precision, bool tf32, const Device& d) {
  if (d.is_cuda())
    cuda::set_allow_tf32(tf32 && precision != Precision::FP32);
  else
    UNETCU_CHECK(precision != Precision::TF32, setting("precision"), " tf32 is the GPUs' tensor-core format; on ",
                 d.str(), " use fp32 or bf16");
}

namespace {

// The settings a checkpoint records (engine/checkpoint.h) and how they are read back.
std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

int setting_int(const CheckpointSettings& s, const std::string& key, const std::string& file, int lo, int hi) {
  const std::string& v = s.at(key);
  int x = 0;
  try {
    size_t used = 0;
    x = std::stoi(v, &used);
    if (used != v.size()) throw 0;
  } catch (...) {
    throw Error(str_cat("checkpoint '", file, "' records ", key, " '", v, "', not a number"));
  }
  UNETCU_CHECK(x >= lo && x <= hi, "checkpoint '", file, "' records ", key, " ", x, ", outside ", lo, "..", hi);
  return x;
}

// The configuration with what other flags, the colour table or the checkpoint resumed decide:
// the classes, the width divisor, the class colours, and the settings to record.
TrainConfig with_settings(const TrainConfig& in) {
  TrainConfig c = in;
  if (!c.data.class_colors.empty())
    c.data.labels.colors = read_class_colors(c.data.class_colors, &c.data.labels.ignored);
  CheckpointSettings resumed;
  // Read only from a regular file (a FIFO would block); what is wrong with another is said when
  // the checkpoint itself is loaded.
  struct stat info {};
  if (!c.fit.resume.empty() && ::stat(c.fit.resume.c_str(), &info) == 0 && S_ISREG(info.st_mode))
    resumed = read_checkpoint_settings(c.fit.resume);
  const std::string& file = c.fit.resume;
  if (resumed.count("classes")) {
    const int k = setting_int(resumed, "classes", file, 1, 256);
    UNETCU_CHECK(!c.classes || *c.classes == k, setting("classes"), " ", *c.classes, " contradicts the checkpoint '",
                 file, "' to resume, trained with ", k, " classes");
    c.classes = k;
  }
  if (!resumed.empty()) {  // the encoder: recorded, or resnet34 where the entry is absent
    const EncoderKind k = recorded_encoder(resumed, file);
    UNETCU_CHECK(!c.encoder || *c.encoder == k, setting("encoder"), " ", encoder_name(*c.encoder),
                 " contradicts the checkpoint '", file, "' to resume, trained with ", encoder_name(k));
    c.encoder = k;
  }
  if (!resumed.empty()) {  // the input channels: recorded, or 3 where the entry is absent
    const int n = resumed.count("in_channels") ? setting_int(resumed, "in_channels", file, 1, 64) : 3;
    UNETCU_CHECK(!c.in_channels || *c.in_channels == n, setting("in_channels"), " ", *c.in_channels,
                 " contradicts the checkpoint '", file, "' to resume, trained with ", n);
    c.in_channels = n;
    if (resumed.count("normalization")) {
      const Normalization::Kind k = parse_named(kNormalizationNames, "normalization", resumed.at("normalization"));
      UNETCU_CHECK(!c.normalize || *c.normalize == k, setting("normalize"), " ", name_of(kNormalizationNames, *c.normalize),
                   " contradicts the checkpoint '", file, "' to resume, trained with ", resumed.at("normalization"));
      c.normalize = k;
      if (k == Normalization::Dataset) {
        UNETCU_CHECK(resumed.count("normalization_values"), "checkpoint '", file,
                     "' records normalization dataset without its values");
        c.normalization_values = resumed.at("normalization_values");
      }
    }
  }
  if (resumed.count("width_divisor")) {
    const int d = setting_int(resumed, "width_divisor", file, 1, 64);
    UNETCU_CHECK(!c.width_divisor || *c.width_divisor == d, setting("width_divisor"), " ", *c.width_divisor,
                 " contradicts the checkpoint '", file, "' to resume, trained with ", d);
    c.width_divisor = d;
  }
  // What the flags leave unsaid, a resumed run takes from its checkpoint: how the data was seen
  // (crops or the training size), the ignore index and the class colours.
  // (A folder's crops keep images at their own size: an image_size given then asks for
  // resizing instead. The synthetic set's crops are cut from images of image_size.)
  if (resumed.count("crop_size") && c.fit.crop_size == 0 && (!c.image_size_given || c.data.data.empty()))
    c.fit.crop_size = setting_int(resumed, "crop_size", file, 32, kMaxImageSize);
  if (resumed.count("image_size") && !c.image_size_given) {
    int w = 0, h = 0;
    parse_image_size(resumed.at("image_size"), &w, &h);
    c.data.image_width = w, c.data.image_size = h;
  }
  if (resumed.count("ignore_index") && c.data.labels.ignore_index < 0 && resumed.at("ignore_index") != "none")
    c.data.labels.ignore_index = setting_int(resumed, "ignore_index", file, 0, 255);
  if (resumed.count("class_colors") && c.data.labels.colors.empty()) {
    const std::string what = "checkpoint '" + file + "'";
    c.data.labels.colors = colors_from_text(resumed.at("class_colors"), what);
    if (resumed.count("ignore_colors")) c.data.labels.ignored = colors_from_text(resumed.at("ignore_colors"), what);
    if (resumed.count("class_names")) {
      std::stringstream names(resumed.at("class_names"));
      size_t k = 0;
      for (std::string n; std::getline(names, n, ',') && k < c.data.labels.colors.size(); ++k)
        c.data.labels.colors[k].name = n == std::to_string(k) ? "" : n;
    }
  }
  if (c.width_divisor) c.strategy.model.width_divisor = *c.width_divisor;
  if (c.encoder) c.strategy.model.encoder = *c.encoder;
  c.strategy.model.in_channels = c.in_channels.value_or(3);
  if (!c.normalize) c.normalize = c.strategy.model.in_channels == 3 ? Normalization::ImageNet : Normalization::Dataset;
  if (c.classes)
    c.strategy.model.classes = *c.classes;
  else if (!c.data.labels.colors.empty())
    c.strategy.model.classes = int(c.data.labels.colors.size());
  c.data.labels.classes = c.strategy.model.classes;
  c.fit.class_names = class_names(c.data.labels);
  CheckpointSettings& st = c.fit.settings;
  st["classes"] = std::to_string(c.strategy.model.classes);
  st["class_names"] = join(c.fit.class_names, ",");
  if (!c.data.labels.colors.empty()) st["class_colors"] = colors_to_text(c.data.labels.colors);
  if (!c.data.labels.ignored.empty()) st["ignore_colors"] = colors_to_text(c.data.labels.ignored);
  st["width_divisor"] = std::to_string(c.strategy.model.width_divisor);
  // Recorded where it is not resnet34, what a file without the entry holds (so a resnet34 run
  // writes the same bytes as before the setting existed).
  if (c.strategy.model.encoder != EncoderKind::ResNet34) st["encoder"] = encoder_name(c.strategy.model.encoder);
  if (c.fit.crop_size) st["crop_size"] = std::to_string(c.fit.crop_size);
  // The training size, or with crops the synthetic set's rendered size (a folder's crops come
  // from images at their own size).
  if (!c.fit.crop_size || c.data.data.empty()) st["image_size"] = str_cat(c.data.width(), "x", c.data.height());
  // The input channels where they are not 3; the normalisation (its values: make_data).
  if (c.strategy.model.in_channels != 3) st["in_channels"] = std::to_string(c.strategy.model.in_channels);
  st["normalization"] = name_of(kNormalizationNames, *c.normalize);
  st["ignore_index"] = c.data.labels.ignore_index >= 0 ? std::to_string(c.data.labels.ignore_index) : "none";
  st["loss"] = loss_kind_name(c.strategy.loss, c.strategy.model.classes);
  // Derived from several settings: the model's element type, activations, layout and seed;
  // gradient accumulation's chunks; the processes of a launched job; the learning rate over
  // the run; the watched metric.
  StrategyConfig& sc = c.strategy;
  sc.model.dtype = c.fit.dtype;
  sc.model.bf16_activations = c.precision == Precision::BF16;
  sc.model.format = memory_format_of(c.memory_format);
  sc.model.seed = c.fit.seed;
  sc.accumulate_rows = c.fit.accumulate_grad_batches > 1 ? c.fit.batch_size : 0;
  const DistEnv dist = detect_dist(c.dist);
  sc.across_processes = as_group(c.dist);
  sc.process_rank = dist.rank;
  sc.process_count = dist.world;
  c.fit.lr_schedule = lr_schedule_of(c);
  c.fit.monitor.min_delta = c.early_stop_delta.value_or(0.0);
  c.fit.monitor.metric = c.monitor.value_or(MonitorKind::ValIou);
  return c;
}

// Under a launcher: checks the job, joins its process group and says who this process is;
// returns its device, GPU local_rank (or the CPU). Otherwise nothing.
std::optional<Device> join_process_group(const TrainConfig& cfg, const DistEnv& dist) {
  if (!cfg.strategy.across_processes) return std::nullopt;
  UNETCU_CHECK(cfg.strategy.mode != Mode::Single, "started as rank ", dist.rank, " of ", dist.world, " by ",
               dist.launcher, ": several processes train with ", setting("mode"),
               " dp (one replica each), mp (one stage each) or dp+mp; use ", setting("dist"),
               " none to ignore the launcher");
  UNETCU_CHECK(
      cfg.strategy.devices.empty(), setting("devices"),
      ": under a launcher each process trains on one device: GPU local_rank when GPUs are visible, else the CPU (",
      setting("device"), " cpu or cuda chooses)");
  const std::string spec = cfg.device ? cfg.device->str() : cfg.fit.dtype != DType::F32 ? "cpu" : "auto";
  const Device kind = resolve_device(spec, nullptr);
  // local_rank modulo the GPUs it sees: a launcher that gives each task its own GPU
  // (srun gpus_per_task, CUDA_VISIBLE_DEVICES per rank) leaves one visible.
  const Device device =
      kind.is_cuda() ? Device::cuda(dist.local_rank % std::max(1, cuda_device_count())) : Device::cpu(0);
  // GPU data parallelism with NCCL_COMM_ID: NCCL bootstraps itself, no CPU group is needed.
  if (!(device.is_cuda() && cfg.strategy.mode == Mode::DP && nccl_rendezvous_from_environment()))
    init_process_group(dist);
  // One line per rank: who it is (the rest of the log is rank 0's).
  const std::string line = str_cat("dist: ", dist.launcher, ", world ", dist.world, ", rank ", dist.rank, " (local ",
                                   dist.local_rank, " of ", dist.local_size, ") on ", hostname(), ", ", device.str(),
                                   process_group_transport().empty() ? "" : ", " + process_group_transport(), "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write: ranks' lines do not mix
  return device;
}

// The devices the run computes on: the one device (said in a line), this process's under a
// launcher, or the devices given (each checked to exist); then each set up for the precision,
// the determinism and the memory limit asked.
std::vector<Device> run_devices(const TrainConfig& cfg, const std::optional<Device>& process_device,
                                std::ostream& out) {
  std::vector<Device> devices;
  if (cfg.strategy.mode == Mode::Single || (cfg.strategy.mode == Mode::Auto && cfg.strategy.devices.empty())) {
    // float64 is a CPU-only type: "auto" then means the CPU.
    const std::string spec = cfg.device ? cfg.device->str() : cfg.fit.dtype != DType::F32 ? "cpu" : "auto";
    std::string note;
    devices = {resolve_device(spec, &note)};
    out << "device: " << devices[0].str() << " (" << note << ")\n";
  } else if (process_device) {
    devices = {*process_device};  // this process's replica or stage
  } else {
    for (const Device& d : cfg.strategy.devices) resolve_device(d.str(), nullptr);  // exists?
    devices = cfg.strategy.devices;
  }
  UNETCU_CHECK(!cfg.strategy.cuda_graphs || devices.at(0).is_cuda(), setting("cuda_graphs"), " needs a GPU; ",
               devices.at(0).str(), " runs each step eagerly");
  for (const Device& d : devices) {
    UNETCU_CHECK(d.is_cpu() || cfg.fit.dtype == DType::F32, setting("dtype"), " ", dtype_name(cfg.fit.dtype),
                 " is CPU only; ", d.str(), " trains in float32");
    apply_precision(cfg.precision, cfg.tf32, d);
    if (d.is_cuda()) cuda::set_deterministic(cfg.deterministic);
  }
  set_memory_limit(size_t(cfg.max_memory), setting("max_memory"));
  const MemoryFormat format = memory_format_of(cfg.memory_format);
  if (cfg.precision == Precision::BF16 || format == MemoryFormat::NHWC)
    out << "precision: "
        << (cfg.precision == Precision::BF16 ? "bf16 activations and gradients (float32 math; parameters, optimizer, "
                                               "batch-norm statistics and loss in float32)"
                                             : dtype_name(cfg.fit.dtype))
        << ", " << format_name(format) << "\n";
  return devices;
}

// The run's data: the embedded synthetic set, or an image folder (whose size is then checked).
struct RunData {
  Normalization normalization;  // of both sets
  std::unique_ptr<SyntheticSegmentation> synthetic;
  std::unique_ptr<Dataset> train, val;
  bool cached = false;  // synthetic samples kept in memory after the first epoch
};

// Both sets' channels and normalisation: ImageNet's, none, or each channel's mean and deviation
// over the training set (computed once; a resumed run takes the checkpoint's).
void set_normalization(const TrainConfig& cfg, RunData& d) {
  const int C = cfg.strategy.model.in_channels;
  const Normalization::Kind kind = cfg.normalize.value_or(Normalization::ImageNet);
  if (kind == Normalization::ImageNet) d.normalization = Normalization{};
  else if (kind == Normalization::None) d.normalization = Normalization::none(C);
  else if (!cfg.normalization_values.empty())
    d.normalization = normalization_from_values(kind, cfg.normalization_values, "checkpoint '" + cfg.fit.resume + "'");
  else {
    d.train->set_normalization(Normalization::none(C));  // the raw values, to measure them
    d.normalization = dataset_normalization(*d.train);
  }
  UNETCU_CHECK(d.normalization.channels() == C, "the checkpoint's normalization has ", d.normalization.channels(),
               " channels, the model ", C);
  d.train->set_normalization(d.normalization);
  d.val->set_normalization(d.normalization);
}

RunData make_data(const TrainConfig& cfg) {
  RunData d;
  const DataConfig& c = cfg.data;
  if (c.data.empty()) {
    d.synthetic = std::make_unique<SyntheticSegmentation>(c.width(), c.height(), cfg.fit.seed, c.labels.classes);
    const int64_t total = c.train_size + c.val_size;
    d.cached = double(total) * SyntheticSegmentation::sample_bytes(c.width(), c.height()) <= kDataCacheBytes;
    if (d.cached) d.synthetic->enable_cache(total);
    d.train = std::make_unique<SyntheticDataset>(*d.synthetic, 0, c.train_size);
    d.val = std::make_unique<SyntheticDataset>(*d.synthetic, c.train_size, c.val_size);
    set_normalization(cfg, d);
    return d;
  }
  set_max_image_pixels(c.max_image_pixels);
  auto pairs = FolderDataset::scan(c.data, c.data_list);
  std::vector<FolderDataset::Pair> train_pairs, val_pairs;
  if (!c.val_data.empty()) {
    train_pairs = std::move(pairs);
    val_pairs = FolderDataset::scan(c.val_data);
  } else {
    split_pairs(pairs, c.val_fraction, cfg.fit.seed, &train_pairs, &val_pairs);
  }
  // With crops, images at their own size; else resized to the training size.
  const int w = cfg.fit.crop_size ? 0 : c.width(), h = cfg.fit.crop_size ? 0 : c.height();
  d.train = std::make_unique<FolderDataset>(std::move(train_pairs), w, h, c.labels);
  d.val = std::make_unique<FolderDataset>(std::move(val_pairs), w, h, c.labels);
  check_train_count(cfg, d.train->size(), c.data);  // the folder decides the sizes
  set_normalization(cfg, d);
  return d;
}

// What the run is: the strategy, the model, the data and the optimisation, in three lines.
void print_run(const TrainConfig& cfg, TrainingStrategy& strategy, const RunData& data, std::ostream& out) {
  const int N = strategy.layout().replicas, classes = cfg.strategy.model.classes;
  const DataConfig& d = cfg.data;
  const FitOptions& fit = cfg.fit;
  out << "strategy: " << strategy.describe() << "\n"
      << "model: Unet(" << encoder_name(cfg.strategy.model.encoder) << "), " << strategy.model().parameter_count() << " parameters, width divisor "
      << cfg.strategy.model.width_divisor << ", " << dtype_name(fit.dtype)
      << recompute_text(cfg.strategy.model.recompute) << "\n"
      << "data: " << (d.data.empty() ? "synthetic" : d.data);
  if (fit.crop_size)
    out << (d.data.empty() ? str_cat(" at ", d.width(), "x", d.height()) : std::string(" at their own sizes"))
        << ", random " << fit.crop_size << "x" << fit.crop_size << " crops (validation: whole images in tiles)";
  else
    out << " at " << d.width() << "x" << d.height();
  const Normalization& norm = data.normalization;
  if (norm.channels() != 3 || norm.kind != Normalization::ImageNet)
    out << ", " << norm.channels() << (norm.channels() == 1 ? " channel" : " channels") << " normalised "
        << (norm.kind == Normalization::ImageNet ? "with ImageNet's statistics"
            : norm.kind == Normalization::None   ? "not at all"
                                                 : "with the training set's mean and deviation");
  if (classes > 1) out << ", " << classes << " classes (" << join(fit.class_names, ", ") << ")";
  if (d.labels.ignore_index >= 0) out << ", mask value " << d.labels.ignore_index << " ignored";
  out << ", " << data.train->size() << " train / " << data.val->size() << " validation"
      << (fit.augment == Augment::None ? "" : std::string(", augment ") + name_of(kAugmentNames, fit.augment))
      << (data.cached ? " (kept in memory after the first epoch)" : "") << ", batch " << fit.batch_size;
  if (N > 1) out << " per replica (global " << fit.batch_size * N << ")";
  if (fit.accumulate_grad_batches > 1)
    out << ", " << fit.accumulate_grad_batches << " batches accumulated per optimizer step ("
        << int64_t(fit.batch_size) * fit.accumulate_grad_batches * N << " images)";
  if (cfg.strategy.across_processes && strategy.layout().shard_count > 1)
    out << ", each replica's processes reading only its shard";
  const OptimizerConfig& o = cfg.strategy.optimizer;
  out << ", loss " << loss_kind_name(cfg.strategy.loss, classes) << ", " << name_of(kOptimizerNames, o.kind) << " lr "
      << o.lr << (fit.lr_schedule.varies() ? ", " + fit.lr_schedule.describe() : "");
  if (std::isinf(o.clip_grad_norm))
    out << ", gradient norm measured (never clipped)";
  else if (o.clip_grad_norm > 0)
    out << ", gradients clipped to norm " << o.clip_grad_norm;
  out << "\n";
  out.flush();
}

}  // namespace

TrainResult train_unet(const TrainConfig& given, std::ostream& rank0_out,
                       const std::function<void(const EpochStats&)>& on_epoch) {
  TrainConfig cfg = with_settings(given);  // mode auto sets the plan it chose
  validate(cfg);
  const DistEnv dist = detect_dist(cfg.dist);
  std::ostream null_out(nullptr);
  std::ostream& out = dist.rank == 0 ? rank0_out : null_out;  // the log is rank 0's
  const std::optional<Device> process_device = join_process_group(cfg, dist);
  out << kernels::cpu::cpu_gemm_line() << "\n";
  StrategyConfig& sc = cfg.strategy;
  sc.devices = run_devices(cfg, process_device, out);
  const RunData data = make_data(cfg);
  if (data.normalization.kind == Normalization::Dataset)
    cfg.fit.settings["normalization_values"] = normalization_values(data.normalization);
  // Processes on one machine share its cores: by default each takes its share.
  if (sc.across_processes && sc.threads == 0)
    sc.threads = std::max(1, omp_get_num_procs() / std::max(1, dist.local_size));
  if (!sc.mp.split_size && !sc.mp.search_split) sc.mp.split_size = cfg.fit.batch_size;
  if (cfg.recompute_auto) sc.model.recompute = choose_recompute(cfg, sc, *data.train, out);
  if (sc.mode == Mode::Auto) {
    choose_plan(cfg, *data.train, out);
    check_train_count(cfg, data.train->size(), cfg.data.data);
  }
  std::unique_ptr<Batch> probe;
  if (sc.mp.search_split) {
    std::vector<int64_t> idx;
    for (int i = 0; i < cfg.fit.batch_size; ++i) idx.push_back(i);
    probe = std::make_unique<Batch>(
        make_batch(*data.train, idx, cfg.fit.dtype, false, Augment::None, 0, 0, cfg.fit.crop_size));
  }
  const auto strategy = make_strategy(sc, probe.get(), out);
  probe.reset();
  print_run(cfg, *strategy, data, out);
  return fit(*strategy, *data.train, *data.val, cfg.fit, out, on_epoch);
}

}  // namespace unetcu
