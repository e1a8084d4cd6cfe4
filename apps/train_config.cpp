// unet_train's flags, by topic: each fills its field of the run's configuration (train/run.h).
#include "apps/train_config.h"

#include <CLI/CLI.hpp>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>

#include "cli/cli.h"

namespace unetcu {

namespace {

// A file flag given an empty name would silently write or read nothing.
std::string not_empty(const std::string& s) { return s.empty() ? "is empty: name a file" : ""; }

// Data flags.
void add_data_flags(CLI::App& app, TrainConfig& cfg) {
  using cli::add_enum;
  using cli::checked;
  app.option_defaults()->group("Data");
  app.add_option("--data", cfg.data.data,
                 "Train on images: DIR/images + DIR/masks matched by file stem (or the article's "
                 "DIR/img + DIR/masks_machine); PNG/JPEG/BMP, masks > 0 are foreground; resized "
                 "to --image-size. Without it: the synthetic set (--train-size/--val-size)");
  app.add_option("--data-list", cfg.data.data_list,
                 "Only the images named in this file (one per line, or a CSV's first column)");
  app.add_option("--val-data", cfg.data.val_data,
                 "Validation images from this folder (same layout) instead of a split");
  app.add_option("--val-fraction", cfg.data.val_fraction, "Share of --data held out for validation (seeded)")
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
  app.add_option("--crop-size", cfg.fit.crop_size,
                 "Train on random S x S crops (a multiple of 32) of each image at its own size, augmented "
                 "first, padding (ignored) where an image is smaller; validation runs on whole images in "
                 "overlapping S x S tiles");
  cli::add_optional(app, "--classes", cfg.classes,
                    "Classes the model predicts: 1 (default) is binary (sigmoid, a mask > 0 is foreground); N >= 2 is "
                    "SMP's Unet(classes=N) with softmax, masks holding a class index per pixel (grayscale or indexed "
                    "PNG, or RGB through --class-colors)");
  app.add_option("--ignore-index", cfg.data.labels.ignore_index,
                 "A mask value (0..255, usually 255) that counts in no loss and no metric");
  app.add_option("--class-colors", cfg.data.class_colors,
                 "RGB masks: a file of one line per class, r,g,b[,name], in class order");
  app.add_option("--train-size", cfg.data.train_size, "Number of synthetic training images")
      ->capture_default_str();
  app.add_option("--val-size", cfg.data.val_size, "Number of synthetic validation images")
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
}

// Model and precision flags.
void add_model_flags(CLI::App& app, TrainConfig& cfg) {
  using cli::add_enum;
  using cli::checked;
  app.option_defaults()->group("Model and precision");
  cli::add_optional(app, "--width-divisor", cfg.width_divisor,
                    "Divide every channel count by this (1 = the real model; with --resume, the checkpoint's)")
      ->default_str("1");
  cli::add_optional(app, "--in-channels", cfg.in_channels,
                    "Channels of the input images: 1 (gray), 3 (RGB), 4 (RGBA, RGB+NIR) or any N from .npy arrays "
                    "(H x W x N); a file of another count is refused, never converted; 16-bit PNGs scaled from "
                    "65535; with --resume, the checkpoint's")
      ->default_str("3");
  app.add_option_function<std::string>(
         "--normalize", cli::checked("--normalize", [&cfg](const std::string& s) {
           cfg.normalize = parse_named(kNormalizationNames, "normalization", s);
         }),
         "Input normalisation: imagenet (ImageNet's mean and deviation, 3 channels), dataset (each channel's "
         "over the training set, computed once and recorded in the checkpoint) or none; default imagenet "
         "for 3 channels, dataset otherwise; with --resume, the checkpoint's");
  app.add_option_function<std::string>(
         "--encoder", cli::checked("--encoder", [&cfg](const std::string& s) {
           cfg.encoder = parse_named(kEncoderNames, "encoder", s);
         }),
         "The encoder, as SMP's Unet(name): " + names_list(kEncoderNames) +
             " (resnet50 and deeper: Bottleneck blocks; with --resume, the checkpoint's)")
      ->default_str("resnet34");
  add_enum(app, "--loss", cfg.strategy.loss, kLossNames, "Loss");
  add_enum(app, "--dtype", cfg.fit.dtype, kDTypeNames, "Element type (float64 on the CPU only)");
  add_enum(app, "--precision", cfg.precision, kPrecisionNames,
           "Arithmetic: auto (tf32 on GPUs, fp32 on the CPU), fp32, tf32 (GPUs: cuDNN may use "
           "TF32 tensor cores), bf16 (mixed precision, as PyTorch's autocast: activations and "
           "their gradients in bfloat16, computed in float32; convolutions with bfloat16 inputs "
           "and float32 accumulation; parameters, optimizer, batch-norm statistics and the loss "
           "in float32)");
  app.add_flag_callback("--no-tf32", [&cfg] { cfg.tf32 = false; },
                        "CUDA: keep cuDNN convolutions in full float32 (by default they may use "
                        "TF32 tensor cores, as PyTorch does)");
  add_enum(app, "--memory-format", cfg.memory_format, kFormatNames,
           "Memory order of the activations: nchw, nhwc (channels-last; cuDNN's tensor-core "
           "convolutions read it without transposes) or auto (nchw). The image is converted "
           "at the first layer and the logits back at the last");
  app.add_flag("--deterministic", cfg.deterministic,
               "CUDA: only deterministic cuDNN convolution algorithms (no atomics, FFT or "
               "Winograd), so repeated runs give the same bits; usually slower");
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
      "--max-memory",
      checked("--max-memory", [&cfg](const std::string& s) { cfg.max_memory = cli::parse_bytes(s); }),
      "The most memory each device may hold, e.g. 512M or 8G (K, M, G, T: powers of 1024): an "
      "allocation past it is an out-of-memory error, as on a device of that size (CPU devices: "
      "their tensors; GPUs: the caching allocator's blocks)");

}

// Optimisation flags.
void add_optimisation_flags(CLI::App& app, TrainConfig& cfg) {
  using cli::add_enum;
  using cli::checked;
  app.option_defaults()->group("Optimisation");
  app.add_option("--epochs", cfg.fit.epochs, "Number of epochs")->capture_default_str();
  app.add_option("--batch-size", cfg.fit.batch_size,
                 "Images per optimizer step (with --accumulate-grad-batches N: per forward and backward, "
                 "N of them per step); with --mode dp, per replica (the global batch is --batch-size x the "
                 "number of devices, as in the article)")
      ->capture_default_str();
  app.add_option("--accumulate-grad-batches", cfg.fit.accumulate_grad_batches,
                 "Gradient accumulation: each optimizer step takes N batches of --batch-size (per replica), "
                 "run forward and backward one after another with their gradients added, as N loader batches "
                 "before one optimizer.step() in PyTorch (batch norm sees each batch alone); steps, "
                 "--warmup-steps and --log-every count optimizer steps. --mode mp and dp+mp: the N batches are "
                 "more micro-batches of --split-size (default --batch-size)")
      ->capture_default_str();
  add_enum(app, "--optimizer", cfg.strategy.optimizer.kind, kOptimizerNames, "Optimizer");
  app.add_option("--lr", cfg.strategy.optimizer.lr, "Learning rate (with --lr-schedule: the base rate)")
      ->capture_default_str();
  add_enum(app, "--lr-schedule", cfg.lr_schedule, kLrScheduleNames,
           "Learning rate over the run, set before every optimizer step as PyTorch's schedulers "
           "stepped per step: constant; cosine (from --lr down to --min-lr at the run's end, "
           "CosineAnnealingLR); poly (--lr x (1 - progress)^--lr-power, PolynomialLR); step "
           "(x --lr-gamma every --lr-step-epochs epochs, StepLR)");
  app.add_option("--warmup-steps", cfg.warmup_steps,
                 "Linear warmup over the run's first N optimizer steps: step t at (t+1)/N of the "
                 "rate (LinearLR), any --lr-schedule; cosine and poly start after it")
      ->capture_default_str();
  cli::add_optional(app, "--min-lr", cfg.min_lr, "--lr-schedule cosine: the rate at the end of the run (default 0)");
  cli::add_optional(app, "--lr-power", cfg.lr_power, "--lr-schedule poly: the exponent (default 0.9)");
  cli::add_optional(app, "--lr-step-epochs", cfg.lr_step_epochs,
                    "--lr-schedule step: multiply the rate by --lr-gamma every N epochs (required)");
  cli::add_optional(app, "--lr-gamma", cfg.lr_gamma, "--lr-schedule step: the factor (default 0.1)");
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
  app.add_option("--clip-grad-norm", cfg.strategy.optimizer.clip_grad_norm,
                 "Before every optimizer step, scale the gradients down so that their total 2-norm (over the whole "
                 "model: every stage of a pipeline; data parallel: the averaged gradients) is at most X, as "
                 "torch.nn.utils.clip_grad_norm_; 0 never; inf: the norm measured and reported, the gradients never "
                 "scaled. Each epoch line then gives the mean and largest norm before clipping and how many of its "
                 "steps were clipped")
      ->check(named_inf)
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--seed", checked("--seed", [&cfg](const std::string& s) { cfg.fit.seed = cli::parse_uint64(s); }),
         "Seed of the initialisation, data and shuffling (0..2^64-1)")
      ->default_str("0");
}

// Parallelism flags.
void add_parallelism_flags(CLI::App& app, TrainConfig& cfg) {
  using cli::add_enum;
  using cli::checked;
  app.option_defaults()->group("Parallelism");
  app.add_option_function<std::string>(
         "--device", checked("--device", [&cfg](const std::string& s) { cfg.device = cli::parse_device(s, true); }),
         "--mode single: auto (a GPU when one is visible and usable, else the CPU), cpu, cpu:N, cuda:N")
      ->default_str("auto");
  add_enum(app, "--mode", cfg.strategy.mode, kModeNames,
           "single (one device, --device), dp (data parallel: one replica per device of "
           "--devices, gradients averaged by all-reduce), mp (model parallel: the model cut "
           "by --split into stages on --devices, micro-batches of --split-size; under a launcher "
           "one stage per process), dp+mp (under a launcher: replicas of a pipeline of "
           "--pipeline-stages stages, one stage per process) or auto (in one process: the fastest "
           "plan that fits --max-memory, or a GPU's free memory, per device: one device, dp or mp over "
           "--devices, with recompute and accumulation as needed; --batch-size is then the images "
           "per optimizer step; the candidates' table is printed)");
  app.add_option_function<std::string>(
      "--devices",
      checked("--devices", [&cfg](const std::string& s) { cfg.strategy.devices = cli::parse_device_list(s); }),
      "--mode dp: the replicas' devices, e.g. cpu:0,cpu:1,cpu:2 or cuda:0,cuda:1; --mode mp: "
      "one per stage, may repeat (CPU devices share the cores: --threads each, default cores/N)");
  app.add_option("--threads", cfg.strategy.threads,
                 "CPU threads (0 = all cores; with --mode dp or mp: per device, 0 = cores/N)")
      ->capture_default_str();
  app.add_option_function<std::string>(
      "--split",
      checked("--split", [&cfg](const std::string& s) {
        cfg.strategy.mp.search_split = s == "auto";
        cfg.split_given = true;
        if (!cfg.strategy.mp.search_split) cfg.strategy.mp.cuts = cli::parse_cuts(s);
      }),
      "--mode mp: the blocks after which the model is cut, comma separated, one cut per extra "
      "stage: layer3 (the article's: stem..layer3 | layer4 + decoder + head), or any of stem, "
      "layer1..4, decoder.blocks.0..4, or block indices; auto: search (two stages)")
      ->default_str("layer3");
  app.add_option("--split-size", cfg.strategy.mp.split_size,
                 "--mode mp: samples per micro-batch (0 = the whole batch; the last may be "
                 "smaller). Batch norm uses each micro-batch's statistics, as the article's run")
      ->capture_default_str();
  add_enum(app, "--schedule", cfg.strategy.mp.schedule, kScheduleNames,
           "--mode mp: gpipe (all forwards, then all backwards) or 1f1b")
      ->each([&cfg](const std::string&) { cfg.schedule_given = true; });
  app.add_option("--pipeline-stages", cfg.strategy.mp.pipeline_stages,
                 "--mode dp+mp: stages per pipeline; the launcher's process count must be a "
                 "multiple (stages x replicas; process r*S+s holds stage s of replica r)");
  add_enum(app, "--allreduce", cfg.strategy.dp.allreduce, kAllReduceNames,
           "--mode dp: ring (reduce-scatter + all-gather), ps (reduce to rank 0, broadcast back), or "
           "mpi (the transport library's own all-reduce, MPI_Allreduce or Gloo's; ranks in several processes)");
  add_enum(app, "--allreduce-precision", cfg.strategy.dp.bf16_allreduce, kAllReducePrecisionNames,
           "--mode dp and dp+mp: full (the gradients' own dtype) or bf16 (each bucket rounded to "
           "bfloat16 for the all-reduce and widened back: half the bytes on the wire, the mean "
           "rounded to about 2-3 significant digits; ring or ps)");
  app.add_flag("--sync-bn", cfg.strategy.dp.sync_bn,
               "--mode dp: batch-norm statistics over all replicas, so N x b trains as one batch "
               "of N*b");
  app.add_flag("--cuda-graphs", cfg.strategy.cuda_graphs,
               "GPUs, --mode single, dp or mp: after two eager steps, capture forward, loss and "
               "backward at the batch's shape (dp: each replica's, with its NCCL all-reduces; mp: "
               "every stage's forwards and backwards of every micro-batch, over the stages' "
               "streams, in one process) into one CUDA graph and replay it every step (one launch "
               "instead of hundreds; the optimizer step stays eager); a batch of another shape "
               "runs eagerly, and so does every step under --profile");
  add_enum(app, "--dist", cfg.dist, kDistNames,
           "Process group: auto (from mpirun's, SLURM's or torchrun's environment when present), "
           "mpi, env (SLURM/torchrun variables), none (one process). Several processes: --mode dp "
           "one replica per process, mp/dp+mp one stage per process, over MPI (mpirun, srun --mpi) or Gloo (torchrun's "
           "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); GPUs: NCCL");
  app.add_option("--collective-timeout", cfg.strategy.dp.collective_timeout,
                 "--mode dp: seconds a collective may take before every rank stops with an "
                 "error naming the rank and the collective (instead of hanging)")
      ->capture_default_str();
}

// Checkpoints and early stopping flags.
void add_checkpoints_flags(CLI::App& app, TrainConfig& cfg) {
  using cli::checked;
  app.option_defaults()->group("Checkpoints and early stopping");
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
  app.add_option("--encoder-weights,--init-encoder", cfg.fit.encoder_weights,
                 "Start the encoder from pretrained weights (ImageNet): a torch.save .pth/.pt file (torchvision's "
                 "resnet34-b627a593.pth) or a safetensors file under torchvision's names (SMP's hosted "
                 "model.safetensors) or SMP's encoder.* names; fc.* is left out, and the first convolution "
                 "adapted to --in-channels as SMP does")
      ->check(not_empty);
  app.add_option("--early-stop", cfg.fit.monitor.patience,
                 "Patience: end the run after N epochs in a row without a --monitor improvement "
                 "(of more than --early-stop-delta); 0 never")
      ->capture_default_str();
  cli::add_optional(app, "--early-stop-delta", cfg.early_stop_delta,
                    "--early-stop: an improvement must exceed this change (default 0)");
  app.add_option_function<std::string>(
         "--monitor",
         checked("--monitor",
                 [&cfg](const std::string& s) { cfg.monitor = parse_named(kMonitorNames, "monitor", s); }),
         "--save-best and --early-stop: the validation metric watched, higher is better for "
         "val_iou and val_dice, lower for val_loss (" + names_list(kMonitorNames) + ")")
      ->default_str("val_iou");
}

// Output and profiling flags.
void add_output_flags(CLI::App& app, TrainConfig& cfg) {
  app.option_defaults()->group("Output and profiling");
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
  app.add_flag_callback("--no-progress", [&cfg] { cfg.fit.progress = false; },
                        "Do not draw the progress bar on stderr");
  app.add_option("--profile", cfg.fit.profile,
                 "Time every op and block (forward and backward, with FLOPs and bytes), print "
                 "the per-op and per-block tables at the end and write a Chrome/Perfetto trace "
                 "(one track per device thread: compute, communication) to this JSON file. On a "
                 "GPU the times are queueing times unless UNETCU_CUDA_SYNC=1")
      ->check(not_empty);
}

}  // namespace

void add_train_flags(CLI::App& app, TrainConfig& cfg) {
  add_data_flags(app, cfg);
  add_model_flags(app, cfg);
  add_optimisation_flags(app, cfg);
  add_parallelism_flags(app, cfg);
  add_checkpoints_flags(app, cfg);
  add_output_flags(app, cfg);
  app.option_defaults()->group("Options");
}

}  // namespace unetcu
