// unet_train's configuration: every flag parsed once into typed values (cli/cli.h), checked
// together by validate(), then turned into a dataset, a training strategy (train/strategy.h)
// and the epoch loop's options (train/trainer.h).
#pragma once
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/image_io.h"
#include "parallel/dist.h"
#include "train/strategy.h"
#include "train/trainer.h"

namespace CLI {
class App;
}

namespace unetcu {

// Upper bounds of the sizes a user gives: far from any overflow of what is computed from them.
constexpr int kMaxEpochs = 100000;
constexpr int kMaxBatch = 4096;
constexpr int kMaxAccumulate = 1024;  // --accumulate-grad-batches
constexpr int kMaxImageSize = 8192;
constexpr int64_t kMaxSamples = 100000000;
constexpr int kMaxThreads = 1024;
constexpr int kMaxWorkers = 256;

// Arithmetic: fp32; tf32 (GPUs: cuDNN may use TF32 tensor cores); bf16 (mixed precision on
// both backends: activations and their gradients stored in bfloat16 and computed in float32,
// convolutions with bfloat16 inputs and float32 accumulation; parameters, optimizer, batch-norm
// statistics and the loss in float32); auto: tf32 on GPUs, fp32 on the CPU.
enum class Precision { Auto, FP32, TF32, BF16 };
inline constexpr NamedValue<Precision> kPrecisionNames[] = {
    {"auto", Precision::Auto}, {"fp32", Precision::FP32}, {"tf32", Precision::TF32}, {"bf16", Precision::BF16}};

// Memory order of the activations: nchw, nhwc (channels-last) or auto (nchw).
enum class FormatChoice { Auto, NCHW, NHWC };
inline constexpr NamedValue<FormatChoice> kFormatNames[] = {
    {"auto", FormatChoice::Auto}, {"nchw", FormatChoice::NCHW}, {"nhwc", FormatChoice::NHWC}};
inline MemoryFormat memory_format_of(FormatChoice f) {
  return f == FormatChoice::NHWC ? MemoryFormat::NHWC : MemoryFormat::NCHW;
}

// The precision on device d, for unet_train and unet_predict alike: on a GPU cuDNN's TF32
// switch (on where `tf32` allows it, unless fp32), on the CPU tf32 refused.
void apply_precision(Precision precision, bool tf32, const Device& d);

// The data unet_train reads: the built-in synthetic set, or an image folder.
struct DataConfig {
  int image_size = 64;             // the height (--image-size S or WxH)
  int image_width = 0;             // 0: image_size (square)
  int width() const { return image_width ? image_width : image_size; }
  int height() const { return image_size; }
  LabelRule labels;                // how masks become targets (classes, ignore index, colours)
  std::string class_colors;        // --class-colors
  int64_t train_size = 512;        // synthetic
  int64_t val_size = 128;          // synthetic
  std::string folder, list, val_folder;  // --data, --data-list, --val-data
  double val_fraction = 0.1;       // held out of --data without --val-data
  int64_t max_image_pixels = kDefaultMaxImagePixels;  // images above this are refused unread
};

// unet_train's configuration, as the flags fill it: each part is handed down whole to what
// takes it. What depends on several flags at once (the devices found, the model's dtype,
// format and seed, gradient accumulation's chunks, the processes of a launched job, the
// learning-rate schedule, the watched metric) is set from the last group by train_unet.
struct TrainConfig {
  // fit()'s options (train/trainer.h): epochs, batch_size (per replica with dp), accumulate
  // (--accumulate-grad-batches), seed, dtype, augment, workers, progress, profile, checkpoint,
  // resume, init_encoder, save_best, log, log_every, monitor.patience (--early-stop).
  FitOptions fit;
  // make_strategy's configuration (train/strategy.h): mode, devices (dp: one per replica; mp:
  // one per stage), model.width_divisor, optimizer (--optimizer, --lr, --momentum,
  // --weight-decay, --clip-grad-norm: 0 none, inf measured and never clipped), loss, threads
  // (0: every core; dp/mp: cores / devices each), allreduce, bf16_allreduce, sync_bn,
  // collective_timeout (seconds), pipeline_stages (dp+mp: stages per pipeline), cuts (mp: first
  // block of each later stage), search_split (--split auto), split_size (mp: 0 = the whole
  // batch), schedule, cuda_graphs.
  StrategyConfig strategy{default_strategy()};
  DataConfig data;

  // The learning rate over the run (train/lr_schedule.h); the values given only with the
  // schedule they belong to.
  LrScheduleKind lr_schedule = LrScheduleKind::Constant;
  int64_t warmup_steps = 0;
  std::optional<double> min_lr, lr_power, lr_gamma;
  std::optional<int> lr_step_epochs;
  std::optional<Device> device;    // single mode; nullopt: a GPU when one is usable, else the CPU
  bool tf32 = true;                // CUDA: cuDNN convolutions may use TF32 tensor cores
  Precision precision = Precision::Auto;
  FormatChoice memory_format = FormatChoice::Auto;
  bool deterministic = false;      // CUDA: only deterministic cuDNN convolution algorithms
  uint64_t max_memory = 0;         // per device, bytes (runtime/allocator.h); 0: no limit
  bool recompute_auto = false;     // --recompute auto: the fewest blocks that fit max_memory
  bool split_given = false;        // --split named the cuts (or auto)
  bool recompute_given = false;    // --recompute named blocks (not none or auto)
  bool schedule_given = false;     // --schedule was given
  DistMode dist = DistMode::Auto;  // process group from the launcher's environment
  // The watched validation metric (train/monitor.h) for the best checkpoint and early stopping;
  // given only with what they belong to.
  std::optional<double> early_stop_delta;
  std::optional<MonitorKind> monitor;
  // Given on the command line (else from --class-colors, or a resumed checkpoint, or 1 / 1).
  std::optional<int> classes, width_divisor;
  bool image_size_given = false;

  // unet_train's defaults where they are not make_strategy's: cut after layer3.
  static StrategyConfig default_strategy() {
    StrategyConfig s;
    s.cuts = {4};
    return s;
  }
};

// Declares every unet_train flag, bound to `cfg`.
void add_train_flags(CLI::App& app, TrainConfig& cfg);

// The schedule the flags make (lr_schedule.h).
LrSchedule lr_schedule_of(const TrainConfig& cfg);

// Throws unetcu::Error naming the flag for a configuration that cannot train. With --data the
// dataset's sizes are checked once the folder has been read.
void validate(const TrainConfig& cfg);

// Validates, builds the data and the strategy, prints what was chosen and trains.
TrainResult train_unet(const TrainConfig& cfg, std::ostream& out,
                       const std::function<void(const EpochStats&)>& on_epoch = {});

}  // namespace unetcu
