#include "apps/train_config.h"

#include <algorithm>
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

#include <CLI/CLI.hpp>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "cli/cli.h"
#include "data/labels.h"
#include "engine/checkpoint.h"
#include "kernels/cpu/conv_dnnl.h"
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

void add_train_flags(CLI::App& app, TrainConfig& cfg) {
  using cli::add_enum;
  using cli::checked;
  // A file flag given an empty name would silently write or read nothing.
  const auto not_empty = [](const std::string& s) -> std::string { return s.empty() ? "is empty: name a file" : ""; };
  app.add_option("--epochs", cfg.fit.epochs, "Number of epochs")->capture_default_str();
  app.add_option("--batch-size", cfg.fit.batch_size,
                 "Images per optimizer step (with --accumulate-grad-batches N: per forward and backward, "
                 "N of them per step); with --mode dp, per replica (the global batch is --batch-size x the "
                 "number of devices, as in the article)")
      ->capture_default_str();
  app.add_option("--accumulate-grad-batches", cfg.fit.accumulate,
                 "Gradient accumulation: each optimizer step takes N batches of --batch-size (per replica), "
                 "run forward and backward one after another with their gradients added, as N loader batches "
                 "before one optimizer.step() in PyTorch (batch norm sees each batch alone); steps, "
                 "--warmup-steps and --log-every count optimizer steps. --mode mp and dp+mp: the N batches are "
                 "more micro-batches of --split-size (default --batch-size)")
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--image-size",
         checked("--image-size", [&cfg](const std::string& s) {
           cli::parse_size(s, &cfg.data.image_width, &cfg.data.image_size);
           cfg.image_size_given = true;
         }),
         "Training size S (S x S) or WxH, multiples of 32: images are resized to it; with --crop-size, "
         "the synthetic set's size (a folder's images keep their own)")
      ->default_str("64");
  app.add_option_function<int>(
      "--classes", [&cfg](int v) { cfg.classes = v; },
      "Classes the model predicts: 1 (default) is binary (sigmoid, a mask > 0 is foreground); N >= 2 is "
      "SMP's Unet(classes=N) with softmax, masks holding a class index per pixel (grayscale or indexed "
      "PNG, or RGB through --class-colors)");
  app.add_option("--ignore-index", cfg.data.labels.ignore_index,
                 "A mask value (0..255, usually 255) that counts in no loss and no metric");
  app.add_option("--class-colors", cfg.data.class_colors,
                 "RGB masks: a file of one line per class, r,g,b[,name], in class order");
  app.add_option("--crop-size", cfg.fit.crop,
                 "Train on random S x S crops (a multiple of 32) of each image at its own size, augmented "
                 "first, padding (ignored) where an image is smaller; validation runs on whole images in "
                 "overlapping S x S tiles");
  app.add_option("--lr", cfg.strategy.optimizer.lr, "Learning rate (with --lr-schedule: the base rate)")->capture_default_str();
  add_enum(app, "--lr-schedule", cfg.lr_schedule, kLrScheduleNames,
           "Learning rate over the run, set before every optimizer step as PyTorch's schedulers "
           "stepped per step: constant; cosine (from --lr down to --min-lr at the run's end, "
           "CosineAnnealingLR); poly (--lr x (1 - progress)^--lr-power, PolynomialLR); step "
           "(x --lr-gamma every --lr-step-epochs epochs, StepLR)");
  app.add_option("--warmup-steps", cfg.warmup_steps,
                 "Linear warmup over the run's first N optimizer steps: step t at (t+1)/N of the "
                 "rate (LinearLR), any --lr-schedule; cosine and poly start after it")
      ->capture_default_str();
  app.add_option_function<double>(
      "--min-lr", [&cfg](double v) { cfg.min_lr = v; },
      "--lr-schedule cosine: the rate at the end of the run (default 0)");
  app.add_option_function<double>(
      "--lr-power", [&cfg](double v) { cfg.lr_power = v; }, "--lr-schedule poly: the exponent (default 0.9)");
  app.add_option_function<int>(
      "--lr-step-epochs", [&cfg](int v) { cfg.lr_step_epochs = v; },
      "--lr-schedule step: multiply the rate by --lr-gamma every N epochs (required)");
  app.add_option_function<double>(
      "--lr-gamma", [&cfg](double v) { cfg.lr_gamma = v; }, "--lr-schedule step: the factor (default 0.1)");
  app.add_option_function<std::string>(
         "--seed", checked("--seed", [&cfg](const std::string& s) { cfg.fit.seed = cli::parse_uint64(s); }),
         "Seed of the initialisation, data and shuffling (0..2^64-1)")
      ->default_str("0");
  add_enum(app, "--loss", cfg.strategy.loss, kLossNames, "Loss");
  app.add_option_function<std::string>(
         "--device", checked("--device", [&cfg](const std::string& s) { cfg.device = cli::parse_device(s, true); }),
         "--mode single: auto (a GPU when one is visible and usable, else the CPU), cpu, cpu:N, cuda:N")
      ->default_str("auto");
  app.add_option("--train-size", cfg.data.train_size, "Number of synthetic training images")
      ->capture_default_str();
  app.add_option("--val-size", cfg.data.val_size, "Number of synthetic validation images")
      ->capture_default_str();
  add_enum(app, "--optimizer", cfg.strategy.optimizer.kind, kOptimizerNames, "Optimizer");
  app.add_option("--momentum", cfg.strategy.optimizer.momentum, "SGD momentum")->capture_default_str();
  app.add_option("--weight-decay", cfg.strategy.optimizer.weight_decay, "L2 weight decay (Adam and SGD)")
      ->capture_default_str();
  // inf is PyTorch's way of logging the norm; a number beyond float64's range (1e999) reads as
  // inf too, and would silently turn clipping off.
  const auto named_inf = [](std::string s) -> std::string {
    if (!std::isinf(std::strtod(s.c_str(), nullptr))) return "";
    if (!s.empty() && (s[0] == '+' || s[0] == '-')) s.erase(0, 1);
    for (char& ch : s) ch = char(std::tolower(static_cast<unsigned char>(ch)));
    return s == "inf" || s == "infinity" ? "" : "out of range of a number (inf: the norm measured, never clipped)";
  };
  app.add_option("--clip-grad-norm", cfg.strategy.optimizer.max_grad_norm,
                 "Before every optimizer step, scale the gradients down so that their total 2-norm (over the whole "
                 "model: every stage of a pipeline; data parallel: the averaged gradients) is at most X, as "
                 "torch.nn.utils.clip_grad_norm_; 0 never; inf: the norm measured and reported, the gradients never "
                 "scaled. Each epoch line then gives the mean and largest norm before clipping and how many of its "
                 "steps were clipped")
      ->check(named_inf)
      ->capture_default_str();
  app.add_option_function<int>(
         "--width-divisor", [&cfg](int v) { cfg.width_divisor = v; },
         "Divide every channel count by this (1 = the real model; with --resume, the checkpoint's)")
      ->default_str("1");
  app.add_option("--threads", cfg.strategy.threads,
                 "CPU threads (0 = all cores; with --mode dp or mp: per device, 0 = cores/N)")
      ->capture_default_str();
  add_enum(app, "--dtype", cfg.fit.dtype, kDTypeNames, "Element type (float64 on the CPU only)");
  app.add_flag_callback("--no-progress", [&cfg] { cfg.fit.progress = false; },
                        "Do not draw the progress bar on stderr");
  add_enum(app, "--mode", cfg.strategy.mode, kModeNames,
           "single (one device, --device), dp (data parallel: one replica per device of "
           "--devices, gradients averaged by all-reduce), mp (model parallel: the model cut "
           "by --split into stages on --devices, micro-batches of --split-size; under a launcher "
           "one stage per process), dp+mp (under a launcher: replicas of a pipeline of "
           "--pipeline-stages stages, one stage per process) or auto (in one process: the fastest "
           "plan that fits --max-memory, or a GPU's free memory, per device: one device, dp or mp over "
           "--devices, with recompute and accumulation as needed; --batch-size is then the images "
           "per optimizer step; the candidates' table is printed)");
  app.add_option("--pipeline-stages", cfg.strategy.pipeline_stages,
                 "--mode dp+mp: stages per pipeline; the launcher's process count must be a "
                 "multiple (stages x replicas; process r*S+s holds stage s of replica r)");
  app.add_option_function<std::string>(
      "--split",
      checked("--split", [&cfg](const std::string& s) {
        cfg.strategy.search_split = s == "auto";
        cfg.split_given = true;
        if (!cfg.strategy.search_split) cfg.strategy.cuts = cli::parse_cuts(s);
      }),
      "--mode mp: the blocks after which the model is cut, comma separated, one cut per extra "
      "stage: layer3 (the article's: stem..layer3 | layer4 + decoder + head), or any of stem, "
      "layer1..4, decoder.blocks.0..4, or block indices; auto: search (two stages)")
      ->default_str("layer3");
  app.add_option("--split-size", cfg.strategy.split_size,
                 "--mode mp: samples per micro-batch (0 = the whole batch; the last may be "
                 "smaller). Batch norm uses each micro-batch's statistics, as the article's run")
      ->capture_default_str();
  add_enum(app, "--schedule", cfg.strategy.schedule, kScheduleNames,
           "--mode mp: gpipe (all forwards, then all backwards) or 1f1b")
      ->each([&cfg](const std::string&) { cfg.schedule_given = true; });
  app.add_option_function<std::string>(
      "--recompute",
      checked("--recompute", [&cfg](const std::string& s) {
        cfg.recompute_auto = s == "auto";
        cfg.strategy.model.recompute = cfg.recompute_auto ? std::vector<bool>() : cli::parse_recompute(s);
        cfg.recompute_given = !cfg.recompute_auto && !cfg.strategy.model.recompute.empty();
      }),
      "Activation recomputation, any mode: none; blocks (every block keeps only its input and "
      "output for the backward, which runs its forward again first: less memory, about one "
      "more forward of time); the blocks to recompute, comma separated (names as --split); or "
      "auto (with --max-memory: the fewest blocks whose step the memory model puts under the "
      "limit on every device, measured first at batches of 1 and 2)")
      ->default_str("none");
  app.add_option_function<std::string>(
      "--devices",
      checked("--devices", [&cfg](const std::string& s) { cfg.strategy.devices = cli::parse_device_list(s); }),
      "--mode dp: the replicas' devices, e.g. cpu:0,cpu:1,cpu:2 or cuda:0,cuda:1; --mode mp: "
      "one per stage, may repeat (CPU devices share the cores: --threads each, default cores/N)");
  add_enum(app, "--allreduce", cfg.strategy.allreduce, kAllReduceNames,
           "--mode dp: ring (reduce-scatter + all-gather), ps (reduce to rank 0, broadcast back), or "
           "mpi (the transport library's own all-reduce, MPI_Allreduce or Gloo's; ranks in several processes)");
  add_enum(app, "--allreduce-precision", cfg.strategy.bf16_allreduce, kAllReducePrecisionNames,
           "--mode dp and dp+mp: full (the gradients' own dtype) or bf16 (each bucket rounded to "
           "bfloat16 for the all-reduce and widened back: half the bytes on the wire, the mean "
           "rounded to about 2-3 significant digits; ring or ps)");
  add_enum(app, "--dist", cfg.dist, kDistNames,
           "Process group: auto (from mpirun's, SLURM's or torchrun's environment when present), "
           "mpi, env (SLURM/torchrun variables), none (one process). Several processes: --mode dp "
           "one replica per process, mp/dp+mp one stage per process, over MPI (mpirun, srun --mpi) or Gloo (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); GPUs: NCCL");
  app.add_option("--collective-timeout", cfg.strategy.collective_timeout,
                 "--mode dp: seconds a collective may take before every rank stops with an "
                 "error naming the rank and the collective (instead of hanging)")
      ->capture_default_str();
  app.add_flag("--sync-bn", cfg.strategy.sync_bn,
               "--mode dp: batch-norm statistics over all replicas, so N x b trains as one batch "
               "of N*b");
  app.add_option("--profile", cfg.fit.profile,
                 "Time every op and block (forward and backward, with FLOPs and bytes), print "
                 "the per-op and per-block tables at the end and write a Chrome/Perfetto trace "
                 "(one track per device thread: compute, communication) to this JSON file. On a "
                 "GPU the times are queueing times unless UNETCU_CUDA_SYNC=1")
      ->check(not_empty);
  app.add_option("--data", cfg.data.folder,
                 "Train on images: DIR/images + DIR/masks matched by file stem (or the article's "
                 "DIR/img + DIR/masks_machine); PNG/JPEG/BMP, masks > 0 are foreground; resized "
                 "to --image-size. Without it: the synthetic set (--train-size/--val-size)");
  app.add_option("--data-list", cfg.data.list,
                 "Only the images named in this file (one per line, or a CSV's first column)");
  app.add_option("--val-data", cfg.data.val_folder,
                 "Validation images from this folder (same layout) instead of a split");
  app.add_option("--val-fraction", cfg.data.val_fraction, "Share of --data held out for validation (seeded)")
      ->capture_default_str();
  add_enum(app, "--augment", cfg.fit.augment, kAugmentNames,
           "Training augmentation, the same for image and mask: none, light (flip, "
           "brightness/contrast) or heavy (+ vertical flip, scale-crop, rotation)");
  app.add_option("--workers", cfg.fit.workers,
                 "Loader threads that decode and augment batches ahead of the step, in every mode "
                 "(0: one when training on CPU devices, four for GPUs); each epoch line gives the "
                 "loader's img/s and the time the step waited for it")
      ->capture_default_str();
  app.add_option("--max-image-pixels", cfg.data.max_image_pixels,
                 "--data: refuse an image or mask with more pixels than this, from its header, "
                 "before decoding it (a guard against decompression bombs)")
      ->capture_default_str();
  app.add_option("--log", cfg.fit.log,
                 "Metrics file: a row per epoch (epoch, time, train loss, validation loss / IoU / "
                 "Dice, img/s, learning rate, peak memory in tensors, loader wait; with --clip-grad-norm "
                 "the mean and largest gradient norm and the share of steps clipped), flushed as "
                 "written; CSV with a header, or JSON Lines when FILE ends in .jsonl; appended to "
                 "with --resume (a CSV only when its header is this run's)")
      ->check(not_empty);
  app.add_option("--log-every", cfg.fit.log_every,
                 "With --log: also a row every N training steps (step, loss, img/s, learning rate)")
      ->capture_default_str();
  app.add_option("--checkpoint", cfg.fit.checkpoint,
                 "Save a checkpoint after every epoch, in every mode: the model to FILE "
                 "(safetensors with segmentation_models_pytorch's state_dict names), optimizer "
                 "state (keyed by parameter name) and epoch to FILE.train; written to a "
                 "temporary file and renamed")
      ->check(not_empty);
  app.add_option("--resume", cfg.fit.resume,
                 "Continue from a checkpoint (model, optimizer, next epoch), written in any mode; "
                 "with the same flags and seed the losses are those of an uninterrupted run")
      ->check(not_empty);
  app.add_option("--save-best", cfg.fit.save_best,
                 "Save a checkpoint (FILE and FILE.train, as --checkpoint) after every epoch whose "
                 "--monitor value is the best of the run so far")
      ->check(not_empty);
  app.add_option("--early-stop", cfg.fit.monitor.patience,
                 "Patience: end the run after N epochs in a row without a --monitor improvement "
                 "(of more than --early-stop-delta); 0 never")
      ->capture_default_str();
  app.add_option_function<double>(
      "--early-stop-delta", [&cfg](double v) { cfg.early_stop_delta = v; },
      "--early-stop: an improvement must exceed this change (default 0)");
  app.add_option_function<std::string>(
         "--monitor",
         checked("--monitor",
                 [&cfg](const std::string& s) { cfg.monitor = parse_named(kMonitorNames, "monitor", s); }),
         "--save-best and --early-stop: the validation metric watched, higher is better for "
         "val_iou and val_dice, lower for val_loss (" + names_list(kMonitorNames) + ")")
      ->default_str("val_iou");
  app.add_option("--init-encoder", cfg.fit.init_encoder,
                 "Load only the encoder.* entries of a safetensors file, e.g. ImageNet ResNet34 "
                 "weights exported from torchvision")
      ->check(not_empty);
  app.add_flag_callback("--no-tf32", [&cfg] { cfg.tf32 = false; },
                        "CUDA: keep cuDNN convolutions in full float32 (by default they may use "
                        "TF32 tensor cores, as PyTorch does)");
  add_enum(app, "--precision", cfg.precision, kPrecisionNames,
           "Arithmetic: auto (tf32 on GPUs, fp32 on the CPU), fp32, tf32 (GPUs: cuDNN may use "
           "TF32 tensor cores), bf16 (mixed precision, as PyTorch's autocast: activations and "
           "their gradients in bfloat16, computed in float32; convolutions with bfloat16 inputs "
           "and float32 accumulation; parameters, optimizer, batch-norm statistics and the loss "
           "in float32)");
  add_enum(app, "--memory-format", cfg.memory_format, kFormatNames,
           "Memory order of the activations: nchw, nhwc (channels-last; cuDNN's tensor-core "
           "convolutions read it without transposes) or auto (nchw). The image is converted "
           "at the first layer and the logits back at the last");
  app.add_flag("--cuda-graphs", cfg.strategy.cuda_graphs,
               "GPUs, --mode single, dp or mp: after two eager steps, capture forward, loss and "
               "backward at the batch's shape (dp: each replica's, with its NCCL all-reduces; mp: "
               "every stage's forwards and backwards of every micro-batch, over the stages' "
               "streams, in one process) into one CUDA graph and replay it every step (one launch "
               "instead of hundreds; the optimizer step stays eager); a batch of another shape "
               "runs eagerly, and so does every step under --profile");
  app.add_flag("--deterministic", cfg.deterministic,
               "CUDA: only deterministic cuDNN convolution algorithms (no atomics, FFT or "
               "Winograd), so repeated runs give the same bits; usually slower");
  app.add_option_function<std::string>(
      "--max-memory",
      checked("--max-memory", [&cfg](const std::string& s) { cfg.max_memory = cli::parse_bytes(s); }),
      "The most memory each device may hold, e.g. 512M or 8G (K, M, G, T: powers of 1024): an "
      "allocation past it is an out-of-memory error, as on a device of that size (CPU devices: "
      "their tensors; GPUs: the caching allocator's blocks)");
}

namespace {

// Processes started by a launcher train as a group: several of them, or one when --dist names
// its launcher (a group of one runs the across-processes path, e.g. one NCCL rank).
bool as_group(DistMode mode) {
  const DistEnv d = detect_dist(mode);
  return d.multi() || ((mode == DistMode::Mpi || mode == DistMode::Env) && d.launcher != "none");
}

// The sizes the training set decides: the synthetic set's --train-size, or the count a folder
// gave (`folder` non-empty), named as the user knows them.
void check_train_count(const TrainConfig& c, int64_t train_n, const std::string& folder) {
  const std::string what = folder.empty() ? str_cat("--train-size ", train_n)
                                          : str_cat("the ", train_n, " training images of ", folder);
  // A replica's samples per optimizer step.
  const int64_t step = int64_t(c.fit.batch_size) * c.fit.accumulate;
  const std::string step_what =
      c.fit.accumulate == 1
          ? str_cat("--batch-size ", c.fit.batch_size)
          : str_cat("--batch-size ", c.fit.batch_size, " x --accumulate-grad-batches ", c.fit.accumulate, " = ", step);
  UNETCU_CHECK(step <= train_n, step_what, " is larger than the ", train_n, " training images",
               folder.empty() ? "" : " of " + folder);
  // Data parallel: one replica per device, or per process of a launched job.
  const DistEnv dist = detect_dist(c.dist);
  int64_t dp_replicas = as_group(c.dist) ? dist.world : std::max<int64_t>(1, int64_t(c.strategy.devices.size()));
  if (c.strategy.mode == Mode::DataPipeline) dp_replicas = dist.world / std::max(1, c.strategy.pipeline_stages);
  if (c.strategy.mode == Mode::DataParallel || c.strategy.mode == Mode::DataPipeline) {
    const int64_t n = dp_replicas;
    UNETCU_CHECK(train_n / n >= step, "the ", train_n, " training images give each of the ", n,
                 " replicas ", train_n / n, " samples, fewer than ", step_what);
  }
  // BN in training needs more than one value per channel: at layer4 a sample is (S/32)² values.
  const int tw = c.fit.crop ? c.fit.crop : c.data.width(), th = c.fit.crop ? c.fit.crop : c.data.height();
  const int64_t last = int64_t(tw / 32) * (th / 32);
  const int64_t replicas = c.strategy.mode == Mode::DataParallel || c.strategy.mode == Mode::DataPipeline ? dp_replicas : 1;
  // With accumulation one device and DP run a step in batches of --batch-size (the last batch's
  // rows are then n % step % batch = n % batch); a pipeline cuts the step into micro-batches
  // (checked below).
  const bool pipeline = c.strategy.mode == Mode::Pipeline || c.strategy.mode == Mode::DataPipeline;
  UNETCU_CHECK(last > 1 || (pipeline && c.fit.accumulate > 1) || (train_n / replicas) % c.fit.batch_size != 1, what,
               " leaves a last batch of one ", tw, "x", th,
               " image: one value per channel for batch norm; change the sizes or --batch-size");
  if ((c.strategy.mode == Mode::Pipeline || c.strategy.mode == Mode::DataPipeline) && last == 1 && !c.strategy.search_split) {
    // Every micro-batch, the epoch's last batch's included, needs two samples.
    const int64_t split = c.strategy.split_size ? c.strategy.split_size : c.fit.batch_size;
    const int64_t tail = (train_n / replicas) % step;
    UNETCU_CHECK(split >= 2 && step % split != 1 && (tail == 0 || tail % split != 1),
                 "--split-size ", split, " with ", step_what, " and ", train_n,
                 " training images makes a micro-batch of one ", tw, "x", th,
                 " image: one value per channel for batch norm");
  }
  // A warmup as long as the run: refused before the model is built (fit() checks it again).
  const int64_t total_steps =
      replicas >= 1 ? int64_t(c.fit.epochs) * steps_per_epoch(train_n, int(replicas), int(step)) : 0;
  UNETCU_CHECK(c.warmup_steps <= 1 || total_steps <= 0 || c.warmup_steps < total_steps, "--warmup-steps ",
               c.warmup_steps, " leaves no step at the full rate: the run has ", total_steps, " steps");
}

}  // namespace

// The fewest images a batch of the run may hold: batch norm needs two values per channel at
// layer4, (W/32)·(H/32) per image.
static int fewest_images(const TrainConfig& cfg) {
  const int tw = cfg.fit.crop ? cfg.fit.crop : cfg.data.width(), th = cfg.fit.crop ? cfg.fit.crop : cfg.data.height();
  return (tw / 32) * (th / 32) > 1 ? 1 : 2;
}

// --recompute auto: the memory model (planning/memory_model.h) measured on the run's first
// device at batches of 1 and 2 of the training set, then the fewest blocks whose recomputation
// it predicts puts the step under --max-memory on every device of the run (ties: the lowest peak).
static std::vector<bool> choose_recompute(const TrainConfig& cfg, const StrategyConfig& sc,
                                          const Dataset& train, std::ostream& out) {
  UNETCU_CHECK(sc.mode == Mode::Single || sc.mode == Mode::DataParallel || (sc.mode == Mode::Pipeline && !sc.across_processes),
               "--recompute auto: --mode single, dp, or mp in one process (it models every stage of the pipeline); "
               "name the blocks to recompute instead");
  UNETCU_CHECK(!sc.search_split, "--recompute auto models a given cut: with --split auto name the blocks to recompute, "
               "or give --mode auto to choose both");
  const size_t limit = memory_limit();
  UNETCU_CHECK(limit > 0, "--recompute auto needs --max-memory (the memory the step must fit in)");
  const int k = fewest_images(cfg);
  UNETCU_CHECK(train.size() >= 2 * k, "--recompute auto measures batches of ", k, " and ", 2 * k,
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
      return make_batch(train, idx, cfg.fit.dtype, false, Augment::None, 0, 0, cfg.fit.crop);
    };
    profile = profile_memory(model, *optimizer, sc.loss, batch(k), batch(2 * k));
  } catch (...) {
    set_memory_limit(limit, "--max-memory");
    throw;
  }
  set_memory_limit(limit, "--max-memory");
  const int blocks = UNet::kBlocks, n = cfg.fit.batch_size;
  // The step as the strategy runs it: a replica's shard, or every stage of the pipeline.
  MemoryPlan plan;
  plan.batch = n;
  plan.devices = sc.devices;
  if (sc.mode != Mode::Pipeline) plan.chunks = cfg.fit.accumulate;  // batch_size at a time
  if (sc.mode == Mode::DataParallel) {
    plan.kind = MemoryPlan::DataParallel;
  } else if (sc.mode == Mode::Pipeline) {
    plan.kind = MemoryPlan::Pipeline;
    plan.batch = n * cfg.fit.accumulate;  // a pipeline accumulates over more micro-batches
    plan.cuts = sc.cuts;
    plan.split_size = sc.split_size;
    plan.schedule = sc.schedule;
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
  UNETCU_CHECK(best_count <= blocks, "--recompute auto: a step of ", n, " images needs about ",
               mib(all), " with every block recomputed, over the limit of ", mib(double(limit)),
               " (--max-memory) less ", int(kMemoryHeadroom * 100), " % to spare; use a smaller batch, split the "
               "model over devices, or let --mode auto accumulate");
  std::string names;
  for (int b = 0; b < blocks; ++b)
    if (best[size_t(b)]) names += (names.empty() ? "" : ",") + cli::unet_block_names()[size_t(b)];
  out << "recompute auto: " << (names.empty() ? std::string("none") : names) << " (predicted peak "
      << mib(best_peak) << " of the " << mib(double(limit)) << " limit; without recomputation "
      << mib(peak_of({})) << ")\n";
  if (best_count == 0) best.clear();
  return best;
}

// The memory each device of a --mode auto run may take: --max-memory, else a GPU's free memory
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

// --mode auto (train/auto_mode.h): the plan chosen, its strategy in `sc`, its batch and
// accumulation in `cfg` (the images per optimizer step stay --batch-size).
static void choose_plan(TrainConfig& cfg, StrategyConfig& sc, const Dataset& train, std::ostream& out) {
  const int min_samples = fewest_images(cfg);
  UNETCU_CHECK(train.size() >= 2 * min_samples, "--mode auto measures batches of ", min_samples, " and ",
               2 * min_samples, " images: the training set has ", train.size());
  const auto batch_of = [&](int n) {
    std::vector<int64_t> idx;
    for (int i = 0; i < n; ++i) idx.push_back(i % train.size());
    return make_batch(train, idx, cfg.fit.dtype, false, Augment::None, 0, 0, cfg.fit.crop);
  };
  const double limit = auto_memory_limit(sc.devices);
  const AutoResult r = choose_auto_plan(sc, batch_of, cfg.fit.batch_size, limit, min_samples, out);
  sc = r.strategy;
  sc.threads = cfg.strategy.threads;
  cfg.strategy.mode = sc.mode;  // as if the flags had said it (check_train_count reads them)
  cfg.strategy.devices = sc.devices;
  cfg.strategy.cuts = sc.cuts;
  cfg.strategy.split_size = sc.split_size;
  cfg.strategy.schedule = sc.schedule;
  cfg.strategy.model.recompute = sc.model.recompute;
  cfg.fit.batch_size = r.batch_size;
  cfg.fit.accumulate = r.accumulate;
}

// ", recompute N blocks" (all: "every block"), or nothing.
static std::string recompute_text(const std::vector<bool>& on) {
  const long n = std::count(on.begin(), on.end(), true);
  if (n == 0) return "";
  if (n == long(on.size())) return ", every block recomputed in the backward";
  std::string names;
  for (size_t b = 0; b < on.size(); ++b)
    if (on[b]) names += (names.empty() ? "" : ",") + cli::unet_block_names()[b];
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

void validate(const TrainConfig& c) {
  // Upper bounds keep every size computed from them far from overflow (and from libgomp's
  // limits); they are documented in docs/cli.md.
  UNETCU_CHECK(c.fit.epochs >= 1 && c.fit.epochs <= kMaxEpochs, "--epochs must be in 1..", kMaxEpochs,
               ", got ", c.fit.epochs);
  UNETCU_CHECK(c.fit.batch_size >= 1 && c.fit.batch_size <= kMaxBatch, "--batch-size must be in 1..",
               kMaxBatch, ", got ", c.fit.batch_size);
  UNETCU_CHECK(c.fit.accumulate >= 1 && c.fit.accumulate <= kMaxAccumulate,
               "--accumulate-grad-batches must be in 1..", kMaxAccumulate, ", got ", c.fit.accumulate);
  for (int side : {c.data.width(), c.data.height()})
    UNETCU_CHECK(side >= 32 && side % 32 == 0 && side <= kMaxImageSize,
                 "--image-size must be a multiple of 32 in 32..", kMaxImageSize, " on each side, got ", c.data.width(), "x",
                 c.data.height());
  UNETCU_CHECK(c.fit.crop == 0 || (c.fit.crop >= 32 && c.fit.crop % 32 == 0 && c.fit.crop <= kMaxImageSize),
               "--crop-size must be a multiple of 32 in 32..", kMaxImageSize, ", got ", c.fit.crop);
  UNETCU_CHECK(c.fit.crop == 0 || c.data.folder.empty() || !c.image_size_given,
               "--image-size resizes every image; --crop-size trains on crops of images at their own size: "
               "give one of them");
  const int classes = c.strategy.model.classes;
  UNETCU_CHECK(classes >= 1 && classes <= 256, "--classes must be in 1..256, got ", classes);
  UNETCU_CHECK(!c.data.folder.empty() || classes <= 4, "the synthetic set has 1 to 4 classes (background and up "
               "to three kinds of shapes), got --classes ", classes, "; train on a folder (--data) for more");
  UNETCU_CHECK(c.data.labels.ignore_index >= -1 && c.data.labels.ignore_index <= 255,
               "--ignore-index must be a mask value in 0..255, got ", c.data.labels.ignore_index);
  UNETCU_CHECK(c.data.labels.ignore_index < 0 || c.data.labels.ignore_index >= classes || classes == 1,
               "--ignore-index ", c.data.labels.ignore_index, " is one of the ", classes, " classes (0..", classes - 1, ")");
  UNETCU_CHECK(c.data.labels.colors.empty() || int(c.data.labels.colors.size()) == classes, "--class-colors lists ",
               c.data.labels.colors.size(), " colours for --classes ", classes);
  UNETCU_CHECK(c.data.class_colors.empty() || !c.data.folder.empty(), "--class-colors reads RGB masks of --data");
  UNETCU_CHECK(c.strategy.optimizer.lr > 0 && std::isfinite(c.strategy.optimizer.lr), "--lr must be a positive number, got ", c.strategy.optimizer.lr);
  UNETCU_CHECK(!c.min_lr || c.lr_schedule == LrScheduleKind::Cosine, "--min-lr belongs to --lr-schedule cosine");
  UNETCU_CHECK(!c.lr_power || c.lr_schedule == LrScheduleKind::Poly, "--lr-power belongs to --lr-schedule poly");
  UNETCU_CHECK((!c.lr_step_epochs && !c.lr_gamma) || c.lr_schedule == LrScheduleKind::Step,
               "--lr-step-epochs and --lr-gamma belong to --lr-schedule step");
  UNETCU_CHECK(c.lr_schedule != LrScheduleKind::Step || c.lr_step_epochs,
               "--lr-schedule step needs --lr-step-epochs N (the epochs between two decays)");
  UNETCU_CHECK(c.warmup_steps >= 0 && c.warmup_steps <= kMaxWarmupSteps, "--warmup-steps must be in 0..",
               kMaxWarmupSteps, ", got ", c.warmup_steps);
  UNETCU_CHECK(!c.min_lr || (*c.min_lr >= 0 && *c.min_lr <= c.strategy.optimizer.lr), "--min-lr must be in 0..--lr (", c.strategy.optimizer.lr, "), got ",
               c.min_lr.value_or(0));
  UNETCU_CHECK(!c.lr_power || (*c.lr_power > 0 && *c.lr_power <= kMaxLrPower), "--lr-power must be in (0, ",
               kMaxLrPower, "], got ", c.lr_power.value_or(0));
  UNETCU_CHECK(!c.lr_step_epochs || *c.lr_step_epochs >= 1, "--lr-step-epochs must be at least 1, got ",
               c.lr_step_epochs.value_or(0));
  UNETCU_CHECK(!c.lr_gamma || (*c.lr_gamma > 0 && *c.lr_gamma <= 1), "--lr-gamma must be in (0, 1], got ",
               c.lr_gamma.value_or(0));
  // With --data the folder decides the sizes; they are checked once it has been read.
  const bool sized = c.data.folder.empty();
  UNETCU_CHECK(c.fit.monitor.patience >= 0 && c.fit.monitor.patience <= kMaxPatience, "--early-stop must be in 0..", kMaxPatience,
               " epochs, got ", c.fit.monitor.patience);
  UNETCU_CHECK(!c.early_stop_delta || c.fit.monitor.patience > 0, "--early-stop-delta belongs to --early-stop N");
  UNETCU_CHECK(!c.early_stop_delta || (*c.early_stop_delta >= 0 && std::isfinite(*c.early_stop_delta)),
               "--early-stop-delta must be a finite number >= 0, got ", c.early_stop_delta.value_or(0));
  UNETCU_CHECK(!c.monitor || c.fit.monitor.patience > 0 || !c.fit.save_best.empty(),
               "--monitor belongs to --save-best or --early-stop");
  UNETCU_CHECK(c.fit.save_best.empty() || c.fit.checkpoint.empty() || !same_file(c.fit.save_best, c.fit.checkpoint),
               "--save-best and --checkpoint name the same file: the best epoch's would be overwritten");
  UNETCU_CHECK(c.data.train_size >= 1 && c.data.train_size <= kMaxSamples, "--train-size must be in 1..",
               kMaxSamples, ", got ", c.data.train_size);
  UNETCU_CHECK(c.data.val_size >= 1 && c.data.val_size <= kMaxSamples, "--val-size must be in 1..",
               kMaxSamples, ", got ", c.data.val_size);
  UNETCU_CHECK(c.strategy.model.width_divisor >= 1 && c.strategy.model.width_divisor <= 64, "--width-divisor must be in 1..64, got ",
               c.strategy.model.width_divisor);
  UNETCU_CHECK(c.strategy.optimizer.weight_decay >= 0 && std::isfinite(c.strategy.optimizer.weight_decay), "--weight-decay must be >= 0");
  UNETCU_CHECK(c.strategy.optimizer.max_grad_norm >= 0 && !std::isnan(c.strategy.optimizer.max_grad_norm),
               "--clip-grad-norm must be a number >= 0 (0: no clipping) or inf (the norm measured, never "
               "clipped), got ", c.strategy.optimizer.max_grad_norm);
  UNETCU_CHECK(c.strategy.optimizer.momentum >= 0 && c.strategy.optimizer.momentum < 1, "--momentum must be in [0, 1)");
  UNETCU_CHECK(c.strategy.threads >= 0 && c.strategy.threads <= kMaxThreads, "--threads must be in 0..", kMaxThreads,
               ", got ", c.strategy.threads);
  UNETCU_CHECK(c.fit.workers >= 0 && c.fit.workers <= kMaxWorkers, "--workers must be in 0..", kMaxWorkers,
               ", got ", c.fit.workers);
  UNETCU_CHECK(c.data.max_image_pixels >= 1, "--max-image-pixels must be at least 1, got ", c.data.max_image_pixels);
  UNETCU_CHECK(c.strategy.devices.size() <= 64, "--devices lists ", c.strategy.devices.size(), " devices; at most 64");
  UNETCU_CHECK(c.data.folder.empty() || (c.data.val_fraction > 0 && c.data.val_fraction < 1) || !c.data.val_folder.empty(),
               "--val-fraction must be between 0 and 1");
  UNETCU_CHECK(!c.data.folder.empty() || (c.data.val_folder.empty() && c.data.list.empty()),
               "--val-data and --data-list need --data");
  UNETCU_CHECK(c.strategy.mode != Mode::Single || c.strategy.devices.empty(), "--devices belongs to --mode dp or mp");
  UNETCU_CHECK(c.strategy.mode == Mode::Single || c.strategy.mode == Mode::Auto || !c.device || as_group(c.dist),
               "--device belongs to --mode single (or, under a launcher, names each process's "
               "device kind); --mode dp and mp take --devices");
  UNETCU_CHECK(c.strategy.mode == Mode::DataParallel || !c.strategy.sync_bn, "--sync-bn belongs to --mode dp");
  if (c.strategy.mode == Mode::Auto) {
    UNETCU_CHECK(!as_group(c.dist), "--mode auto chooses its plan in one process; under a launcher give --mode dp, "
                 "mp or dp+mp (or --dist none to ignore the launcher)");
    UNETCU_CHECK(!c.split_given && c.strategy.split_size == 0,
                 "--mode auto chooses the cut and the split size: drop --split and --split-size");
    UNETCU_CHECK(!c.recompute_given && !c.recompute_auto, "--mode auto chooses what to recompute: drop --recompute");
    UNETCU_CHECK(!c.schedule_given, "--mode auto chooses the schedule: drop --schedule");
    UNETCU_CHECK(!c.strategy.cuda_graphs, "--mode auto times and models eager steps: drop --cuda-graphs (or give "
                 "the plan it chose, with --cuda-graphs, as flags)");
    UNETCU_CHECK(c.fit.accumulate == 1, "--mode auto chooses the accumulation (--batch-size is then the images per "
                 "optimizer step): drop --accumulate-grad-batches");
    UNETCU_CHECK(!c.device || c.strategy.devices.empty(),
                 "--mode auto: give --devices (the devices it may use) or --device (one), not both");
    for (size_t i = 0; i < c.strategy.devices.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        UNETCU_CHECK(c.strategy.devices[i] != c.strategy.devices[j], "--devices lists ", c.strategy.devices[i].str(), " twice");
  }
  UNETCU_CHECK(c.strategy.mode != Mode::DataPipeline || !c.strategy.cuda_graphs,
               "--cuda-graphs belongs to --mode single, dp or mp (GPUs)");
  UNETCU_CHECK(!c.strategy.cuda_graphs || !as_group(c.dist) || c.strategy.mode == Mode::DataParallel,
               "--cuda-graphs under a launcher belongs to --mode dp (one GPU replica per process); "
               "--mode ", name_of(kModeNames, c.strategy.mode), " with graphs runs in one process: drop it, "
               "or give --dist none");
  UNETCU_CHECK(c.fit.accumulate == 1 || !c.strategy.search_split,
               "--split auto times one batch of --batch-size; with --accumulate-grad-batches ",
               c.fit.accumulate, " give the cuts and --split-size");
  UNETCU_CHECK(!c.strategy.bf16_allreduce || c.strategy.mode == Mode::DataParallel || c.strategy.mode == Mode::DataPipeline,
               "--allreduce-precision belongs to --mode dp and dp+mp");
  UNETCU_CHECK(!c.strategy.bf16_allreduce || c.strategy.allreduce != AllReduceAlgo::Mpi,
               "--allreduce-precision bf16 needs --allreduce ring or ps: the transport library's own "
               "all-reduce has no bfloat16 sum");
  UNETCU_CHECK(c.strategy.allreduce != AllReduceAlgo::Mpi || as_group(c.dist),
               "--allreduce mpi is the transport library's own all-reduce, for ranks in several processes: "
               "start them with mpirun, srun or torchrun (in one process use ring or ps)");
  UNETCU_CHECK(c.precision != Precision::TF32 || c.tf32, "--no-tf32 and --precision tf32 contradict each other");
  UNETCU_CHECK(c.precision != Precision::BF16 || c.fit.dtype == DType::F32, "--precision bf16 keeps float32 "
               "parameters; it does not go with --dtype ", dtype_name(c.fit.dtype));
  UNETCU_CHECK(c.fit.log_every >= 0 && c.fit.log_every <= kMaxSamples, "--log-every must be between 0 and ",
               kMaxSamples, ", got ", c.fit.log_every);
  UNETCU_CHECK(c.fit.log_every == 0 || !c.fit.log.empty(), "--log-every needs --log FILE");
  UNETCU_CHECK(c.strategy.collective_timeout > 0 && c.strategy.collective_timeout <= 7 * 24 * 3600.0,
               "--collective-timeout must be between 0 and 604800 seconds, got ",
               c.strategy.collective_timeout);
  for (const Device& d : c.strategy.devices)
    UNETCU_CHECK(d.kind == c.strategy.devices[0].kind, "--devices must be all CPU devices or all GPUs, got ",
                 device_list_str(c.strategy.devices));
  const DistEnv dist = detect_dist(c.dist);
  UNETCU_CHECK(c.strategy.mode == Mode::DataPipeline || c.strategy.pipeline_stages == 0, "--pipeline-stages belongs to --mode dp+mp");
  if (c.strategy.mode == Mode::DataPipeline) {
    UNETCU_CHECK(as_group(c.dist), "--mode dp+mp runs one stage per process: start stages x replicas "
                 "processes with a launcher (mpirun, srun, torchrun)");
    UNETCU_CHECK(c.strategy.pipeline_stages >= 2, "--mode dp+mp needs --pipeline-stages (at least 2), got ",
                 c.strategy.pipeline_stages);
    UNETCU_CHECK(dist.world % c.strategy.pipeline_stages == 0, "--pipeline-stages ", c.strategy.pipeline_stages, " does not divide the ",
                 dist.world, " processes into replicas");
  }
  if ((c.strategy.mode == Mode::Pipeline || c.strategy.mode == Mode::DataPipeline) && as_group(c.dist)) {
    const int stages = c.strategy.mode == Mode::Pipeline ? dist.world : c.strategy.pipeline_stages;
    UNETCU_CHECK(!c.strategy.search_split, "--split auto searches in one process; across processes give the cuts "
                 "(e.g. --split layer3)");
    UNETCU_CHECK(int(c.strategy.cuts.size()) + 1 == stages, "--split makes ", c.strategy.cuts.size() + 1, " stages but there are ",
                 stages, c.strategy.mode == Mode::Pipeline ? " processes (one stage each)" : " --pipeline-stages");
    UNETCU_CHECK(c.strategy.devices.empty(), "--devices: across processes each stage is this process's device (GPU local_rank, or the CPU)");
    UNETCU_CHECK(c.strategy.split_size >= 0 && c.strategy.split_size <= c.fit.batch_size, "--split-size must be in 0..--batch-size ",
                 c.fit.batch_size, ", got ", c.strategy.split_size);
  } else if (c.strategy.mode == Mode::Pipeline) {
    UNETCU_CHECK(!c.strategy.devices.empty(), "--mode mp needs --devices (one per stage, e.g. cpu:0,cpu:1)");
    UNETCU_CHECK(c.strategy.devices.size() >= 2, "--mode mp needs at least two stage devices, got ",
                 device_list_str(c.strategy.devices));
    UNETCU_CHECK(c.strategy.split_size >= 0, "--split-size must be at least 1, got ", c.strategy.split_size);
    UNETCU_CHECK(c.strategy.split_size <= c.fit.batch_size, "--split-size ", c.strategy.split_size,
                 " is larger than --batch-size ", c.fit.batch_size);
    if (c.strategy.search_split)
      UNETCU_CHECK(c.strategy.devices.size() == 2, "--split auto searches two-stage cuts: give two --devices");
    else
      UNETCU_CHECK(c.strategy.cuts.size() + 1 == c.strategy.devices.size(), "--split makes ", c.strategy.cuts.size() + 1,
                   " stages but --devices lists ", c.strategy.devices.size());
  }
  if (c.strategy.mode == Mode::DataParallel) {
    UNETCU_CHECK(!c.strategy.devices.empty() || as_group(c.dist),
                 "--mode dp needs --devices (e.g. cpu:0,cpu:1), or a launcher (mpirun -np N, torchrun)");
    for (size_t i = 0; i < c.strategy.devices.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        UNETCU_CHECK(c.strategy.devices[i] != c.strategy.devices[j], "--devices lists ", c.strategy.devices[i].str(), " twice");
  }
  // BN in training mode needs more than one value per channel: at layer4 a sample is
  // (S/32)² values, so a batch of one 32×32 image cannot train.
  const int tw = c.fit.crop ? c.fit.crop : c.data.width(), th = c.fit.crop ? c.fit.crop : c.data.height();
  const int64_t last = int64_t(tw / 32) * (th / 32);
  UNETCU_CHECK(int64_t(c.fit.batch_size) * last > 1, "--batch-size 1 with ", tw, "x", th,
               " images leaves one value per channel for batch norm; use a larger batch or image");
  if (sized) check_train_count(c, c.data.train_size, "");
}

void apply_precision(Precision precision, bool tf32, const Device& d) {
  if (d.is_cuda())
    cuda::set_allow_tf32(tf32 && precision != Precision::FP32);
  else
    UNETCU_CHECK(precision != Precision::TF32, "--precision tf32 is the GPUs' tensor-core format; on ", d.str(),
                 " use fp32 or bf16");
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
    UNETCU_CHECK(!c.classes || *c.classes == k, "--classes ", *c.classes, " contradicts the checkpoint '", file,
                 "' to resume, trained with ", k, " classes");
    c.classes = k;
  }
  if (resumed.count("width_divisor")) {
    const int d = setting_int(resumed, "width_divisor", file, 1, 64);
    UNETCU_CHECK(!c.width_divisor || *c.width_divisor == d, "--width-divisor ", *c.width_divisor,
                 " contradicts the checkpoint '", file, "' to resume, trained with ", d);
    c.width_divisor = d;
  }
  // What the flags leave unsaid, a resumed run takes from its checkpoint: how the data was seen
  // (crops or the training size), the ignore index and the class colours.
  // (A folder's crops keep images at their own size: an --image-size given then asks for
  // resizing instead. The synthetic set's crops are cut from images of --image-size.)
  if (resumed.count("crop_size") && c.fit.crop == 0 && (!c.image_size_given || c.data.folder.empty()))
    c.fit.crop = setting_int(resumed, "crop_size", file, 32, kMaxImageSize);
  if (resumed.count("image_size") && !c.image_size_given) {
    int w = 0, h = 0;
    cli::parse_size(resumed.at("image_size"), &w, &h);
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
  if (c.fit.crop) st["crop_size"] = std::to_string(c.fit.crop);
  // The training size, or with crops the synthetic set's rendered size (a folder's crops come
  // from images at their own size).
  if (!c.fit.crop || c.data.folder.empty()) st["image_size"] = str_cat(c.data.width(), "x", c.data.height());
  st["normalization"] = "imagenet";
  st["ignore_index"] = c.data.labels.ignore_index >= 0 ? std::to_string(c.data.labels.ignore_index) : "none";
  st["loss"] = loss_kind_name(c.strategy.loss, c.strategy.model.classes);
  return c;
}

}  // namespace

TrainResult train_unet(const TrainConfig& given, std::ostream& rank0_out,
                       const std::function<void(const EpochStats&)>& on_epoch) {
  TrainConfig cfg = with_settings(given);  // --mode auto sets the plan it chose
  validate(cfg);
  const DistEnv dist = detect_dist(cfg.dist);
  std::ostream null_out(nullptr);
  std::ostream& out = dist.rank == 0 ? rank0_out : null_out;  // the log is rank 0's
  const bool group = as_group(cfg.dist);
  if (group) {
    UNETCU_CHECK(cfg.strategy.mode != Mode::Single,
                 "started as rank ", dist.rank, " of ", dist.world, " by ", dist.launcher,
                 ": several processes train with --mode dp (one replica each), mp (one stage each) "
                 "or dp+mp; use --dist none to ignore the launcher");
    UNETCU_CHECK(cfg.strategy.devices.empty(), "--devices: under a launcher each process trains on one device: "
                 "GPU local_rank when GPUs are visible, else the CPU (--device cpu or cuda chooses)");
  }
  // Under a launcher: this process's device, GPU local_rank (or the CPU).
  std::optional<Device> process_device;
  if (group) {
    const std::string spec = cfg.device ? cfg.device->str() : cfg.fit.dtype != DType::F32 ? "cpu" : "auto";
    const Device kind = resolve_device(spec, nullptr);
    // local_rank modulo the GPUs it sees: a launcher that gives each task its own GPU
    // (srun --gpus-per-task, CUDA_VISIBLE_DEVICES per rank) leaves one visible.
    process_device = kind.is_cuda()
                         ? Device::cuda(dist.local_rank % std::max(1, cuda_device_count()))
                         : Device::cpu(0);
    // GPU data parallelism with NCCL_COMM_ID: NCCL bootstraps itself, no CPU group is needed.
    if (!(process_device->is_cuda() && cfg.strategy.mode == Mode::DataParallel && nccl_rendezvous_from_environment()))
      init_process_group(dist);
    // One line per rank: who it is (the rest of the log is rank 0's).
    const std::string line = str_cat("dist: ", dist.launcher, ", world ", dist.world, ", rank ",
                                     dist.rank, " (local ", dist.local_rank, " of ",
                                     dist.local_size, ") on ", hostname(), ", ", process_device->str(),
                                     process_group_transport().empty() ? "" : ", " + process_group_transport(), "\n");
    std::fwrite(line.data(), 1, line.size(), stderr);  // one write: ranks' lines do not mix
  }
  out << kernels::cpu::cpu_gemm_line() << "\n";
  std::vector<Device> devices;
  if (cfg.strategy.mode == Mode::Single || (cfg.strategy.mode == Mode::Auto && cfg.strategy.devices.empty())) {
    // float64 is a CPU-only type: "auto" then means the CPU.
    const std::string spec = cfg.device ? cfg.device->str() : cfg.fit.dtype != DType::F32 ? "cpu" : "auto";
    std::string note;
    devices = {resolve_device(spec, &note)};
    out << "device: " << devices[0].str() << " (" << note << ")\n";
  } else if (group) {
    devices = {*process_device};  // this process's replica or stage
  } else {
    for (const Device& d : cfg.strategy.devices) resolve_device(d.str(), nullptr);  // exists?
    devices = cfg.strategy.devices;
  }
  UNETCU_CHECK(!cfg.strategy.cuda_graphs || devices.at(0).is_cuda(), "--cuda-graphs needs a GPU; ",
               devices.at(0).str(), " runs each step eagerly");
  for (const Device& d : devices) {
    UNETCU_CHECK(d.is_cpu() || cfg.fit.dtype == DType::F32, "--dtype ", dtype_name(cfg.fit.dtype),
                 " is CPU only; ", d.str(), " trains in float32");
    apply_precision(cfg.precision, cfg.tf32, d);
    if (d.is_cuda()) cuda::set_deterministic(cfg.deterministic);
  }
  set_memory_limit(size_t(cfg.max_memory), "--max-memory");
  const MemoryFormat format = memory_format_of(cfg.memory_format);
  if (cfg.precision == Precision::BF16 || format == MemoryFormat::NHWC)
    out << "precision: " << (cfg.precision == Precision::BF16 ? "bf16 activations and gradients (float32 "
                                                               "math; parameters, optimizer, batch-norm "
                                                               "statistics and loss in float32)"
                                                             : dtype_name(cfg.fit.dtype))
        << ", " << format_name(format) << "\n";

  // The data: the embedded synthetic set, or an image folder.
  std::unique_ptr<SyntheticSegmentation> synthetic;
  std::unique_ptr<Dataset> train_ds, val_ds;
  bool cached = false;
  const int classes = cfg.strategy.model.classes;
  if (cfg.data.folder.empty()) {
    synthetic = std::make_unique<SyntheticSegmentation>(cfg.data.width(), cfg.data.height(), cfg.fit.seed, classes);
    const int64_t total = cfg.data.train_size + cfg.data.val_size;
    cached = double(total) * SyntheticSegmentation::sample_bytes(cfg.data.width(), cfg.data.height()) <= kDataCacheBytes;
    if (cached) synthetic->enable_cache(total);
    train_ds = std::make_unique<SyntheticDataset>(*synthetic, 0, cfg.data.train_size);
    val_ds = std::make_unique<SyntheticDataset>(*synthetic, cfg.data.train_size, cfg.data.val_size);
  } else {
    set_max_image_pixels(cfg.data.max_image_pixels);
    auto pairs = FolderDataset::scan(cfg.data.folder, cfg.data.list);
    std::vector<FolderDataset::Pair> train_pairs, val_pairs;
    if (!cfg.data.val_folder.empty()) {
      train_pairs = std::move(pairs);
      val_pairs = FolderDataset::scan(cfg.data.val_folder);
    } else {
      split_pairs(pairs, cfg.data.val_fraction, cfg.fit.seed, &train_pairs, &val_pairs);
    }
    // With crops, images at their own size; else resized to the training size.
    const int w = cfg.fit.crop ? 0 : cfg.data.width(), h = cfg.fit.crop ? 0 : cfg.data.height();
    train_ds = std::make_unique<FolderDataset>(std::move(train_pairs), w, h, cfg.data.labels);
    val_ds = std::make_unique<FolderDataset>(std::move(val_pairs), w, h, cfg.data.labels);
    check_train_count(cfg, train_ds->size(), cfg.data.folder);  // the folder decides the sizes
  }

  // The strategy's configuration as the flags gave it, with what depends on other flags.
  StrategyConfig sc = cfg.strategy;
  sc.devices = devices;
  sc.model.dtype = cfg.fit.dtype;
  sc.model.bf16_activations = cfg.precision == Precision::BF16;
  sc.model.format = format;
  sc.model.seed = cfg.fit.seed;
  sc.accumulate_rows = cfg.fit.accumulate > 1 ? cfg.fit.batch_size : 0;
  sc.across_processes = group;
  sc.process_rank = dist.rank;
  sc.process_count = dist.world;
  // Processes on one machine share its cores: by default each takes its share.
  if (group && sc.threads == 0) sc.threads = std::max(1, omp_get_num_procs() / std::max(1, dist.local_size));
  if (!sc.split_size && !sc.search_split) sc.split_size = cfg.fit.batch_size;
  if (cfg.recompute_auto) sc.model.recompute = choose_recompute(cfg, sc, *train_ds, out);
  if (sc.mode == Mode::Auto) {
    choose_plan(cfg, sc, *train_ds, out);
    check_train_count(cfg, train_ds->size(), cfg.data.folder);
  }
  std::unique_ptr<Batch> probe;
  if (cfg.strategy.search_split) {
    std::vector<int64_t> idx;
    for (int i = 0; i < cfg.fit.batch_size; ++i) idx.push_back(i);
    probe = std::make_unique<Batch>(make_batch(*train_ds, idx, cfg.fit.dtype, false, Augment::None, 0, 0, cfg.fit.crop));
  }
  const auto strategy = make_strategy(sc, probe.get(), out);
  probe.reset();
  const int N = strategy->replicas();
  out << "strategy: " << strategy->describe() << "\n"
      << "model: Unet(resnet34), " << strategy->model().parameter_count() << " parameters, width divisor "
      << cfg.strategy.model.width_divisor << ", " << dtype_name(cfg.fit.dtype)
      << recompute_text(sc.model.recompute) << "\n"
      << "data: " << (cfg.data.folder.empty() ? "synthetic" : cfg.data.folder);
  if (cfg.fit.crop)
    out << (cfg.data.folder.empty() ? str_cat(" at ", cfg.data.width(), "x", cfg.data.height()) : std::string(" at their own sizes"))
        << ", random " << cfg.fit.crop << "x" << cfg.fit.crop << " crops (validation: whole images in tiles)";
  else
    out << " at " << cfg.data.width() << "x" << cfg.data.height();
  if (classes > 1) out << ", " << classes << " classes (" << join(cfg.fit.class_names, ", ") << ")";
  if (cfg.data.labels.ignore_index >= 0) out << ", mask value " << cfg.data.labels.ignore_index << " ignored";
  out << ", " << train_ds->size() << " train / " << val_ds->size() << " validation"
      << (cfg.fit.augment == Augment::None ? "" : std::string(", augment ") + name_of(kAugmentNames, cfg.fit.augment))
      << (cached ? " (kept in memory after the first epoch)" : "") << ", batch " << cfg.fit.batch_size;
  if (N > 1) out << " per replica (global " << cfg.fit.batch_size * N << ")";
  if (cfg.fit.accumulate > 1)
    out << ", " << cfg.fit.accumulate << " batches accumulated per optimizer step ("
        << int64_t(cfg.fit.batch_size) * cfg.fit.accumulate * N << " images)";
  if (group && strategy->shard_count() > 1) out << ", each replica's processes reading only its shard";
  const LrSchedule schedule = lr_schedule_of(cfg);
  out << ", loss " << loss_kind_name(cfg.strategy.loss, classes) << ", " << name_of(kOptimizerNames, cfg.strategy.optimizer.kind)
      << " lr " << cfg.strategy.optimizer.lr << (schedule.varies() ? ", " + schedule.describe() : "");
  if (std::isinf(cfg.strategy.optimizer.max_grad_norm))
    out << ", gradient norm measured (never clipped)";
  else if (cfg.strategy.optimizer.max_grad_norm > 0)
    out << ", gradients clipped to norm " << cfg.strategy.optimizer.max_grad_norm;
  out << "\n";
  out.flush();

  // fit()'s options as the flags gave them, with the schedule and the watched metric.
  FitOptions fo = cfg.fit;
  fo.lr_schedule = schedule;
  fo.monitor.min_delta = cfg.early_stop_delta.value_or(0.0);
  fo.monitor.metric = cfg.monitor.value_or(MonitorKind::ValIou);
  return fit(*strategy, *train_ds, *val_ds, fo, out, on_epoch);
}

}  // namespace unetcu
