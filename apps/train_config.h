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

struct TrainConfig {
  int epochs = 10;
  int batch_size = 8;              // per replica with dp
  int image_size = 64;
  double lr = 1e-3;
  // The learning rate over the run (train/lr_schedule.h); the values given only with the
  // schedule they belong to.
  LrScheduleKind lr_schedule = LrScheduleKind::Constant;
  int64_t warmup_steps = 0;
  std::optional<double> min_lr, lr_power, lr_gamma;
  std::optional<int> lr_step_epochs;
  uint64_t seed = 0;
  LossKind loss = LossKind::BCEDice;
  std::optional<Device> device;    // single mode; nullopt: a GPU when one is usable, else the CPU
  int64_t train_size = 512;
  int64_t val_size = 128;
  int width_divisor = 1;
  OptimizerKind optimizer = OptimizerKind::Adam;
  double momentum = 0.9;           // sgd only
  double weight_decay = 0;
  double clip_grad_norm = 0;       // gradient clipping by the total norm; 0 none; inf: measured, never clipped
  int accumulate_grad_batches = 1; // batches of batch_size per optimizer step
  int threads = 0;                 // 0: every core (dp/mp: cores / devices each)
  DType dtype = DType::F32;
  bool progress = true;
  bool tf32 = true;                // CUDA: cuDNN convolutions may use TF32 tensor cores
  Precision precision = Precision::Auto;
  FormatChoice memory_format = FormatChoice::Auto;
  bool deterministic = false;      // CUDA: only deterministic cuDNN convolution algorithms
  bool cuda_graphs = false;        // GPUs (single, mp): replay the training step as a CUDA graph
  Mode mode = Mode::Single;
  std::vector<Device> devices;     // dp: one per replica; mp: one per stage
  AllReduceAlgo allreduce = AllReduceAlgo::Ring;
  bool bf16_allreduce = false;     // dp, dp+mp: gradients averaged in bfloat16
  bool sync_bn = false;
  double collective_timeout = kDefaultCollectiveTimeout;  // seconds
  DistMode dist = DistMode::Auto;  // process group from the launcher's environment
  std::vector<int> cuts = {4};     // mp: first block of each later stage (4: after layer3)
  int pipeline_stages = 0;         // dp+mp: stages per pipeline (processes = stages x replicas)
  bool split_auto = false;         // mp: search the cut and split size
  int split_size = 0;              // mp: 0 = the whole batch
  Schedule schedule = Schedule::GPipe;
  std::string profile;
  std::string checkpoint, resume, init_encoder;
  // The watched validation metric (train/monitor.h): the best checkpoint and early stopping;
  // --monitor and --early-stop-delta only with what they belong to.
  std::string save_best;
  int early_stop = 0;                    // patience in epochs; 0: never
  std::optional<double> early_stop_delta;
  std::optional<MonitorKind> monitor;
  std::string log;          // metrics file: CSV, or JSON Lines for *.jsonl
  int64_t log_every = 0;    // step rows every N steps (0: epoch rows only)
  std::string data, data_list, val_data;
  double val_fraction = 0.1;
  Augment augment = Augment::None;
  int workers = 0;
  int64_t max_image_pixels = kDefaultMaxImagePixels;  // images above this are refused unread
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
