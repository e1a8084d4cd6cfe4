// A training run, assembled in one place from one typed configuration. Each part of
// TrainConfig is the option struct of the layer that uses it (fit()'s FitOptions, the
// strategy's StrategyConfig, the data's DataConfig), filled directly by a program's flags
// (apps/train_config.h) or by a test; train_unet() checks it, sets up the process group and
// the devices, builds the data and the strategy, prints what was chosen and trains.
// Errors name settings with setting() (runtime/common.h), which the program maps to its flags.
#pragma once
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "data/data_config.h"
#include "data/dataset.h"
#include "data/image_io.h"
#include "parallel/dist.h"
#include "train/precision.h"
#include "train/strategy.h"
#include "train/trainer.h"

namespace unetcu {

// A run's configuration, as a program's flags (or a test) fill it: each part is the options of
// the layer that takes it, handed down whole. What depends on several settings at once (the
// model's dtype, format and seed, gradient accumulation's chunks, the processes of a launched
// job, the learning rate over the run, the watched metric) is derived once, in train_unet;
// the devices found, the data and an automatic plan follow.
struct TrainConfig {
  FitOptions fit;  // the epoch loop's (train/trainer.h)
  // The strategy's (train/strategy.h): mode, the placement (devices, threads, CUDA graphs), the
  // model, optimizer and loss, and the options of data parallelism (dp) and the pipeline (mp).
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
  bool recompute_auto = false;     // recompute "auto": the fewest blocks that fit max_memory
  bool split_given = false;        // the split was given (cuts or auto)
  bool recompute_given = false;    // recompute named blocks (not none or auto)
  bool schedule_given = false;     // the schedule was given
  DistMode dist = DistMode::Auto;  // process group from the launcher's environment
  // The watched validation metric (train/monitor.h) for the best checkpoint and early stopping;
  // given only with what they belong to.
  std::optional<double> early_stop_delta;
  std::optional<MonitorKind> monitor;
  // Given by the user (else from the class colours, or a resumed checkpoint, or 1 / 1).
  std::optional<int> classes, width_divisor;
  std::optional<EncoderKind> encoder;
  std::optional<int> in_channels;                   // else the checkpoint's, or 3
  std::optional<Normalization::Kind> normalize;     // else the checkpoint's, or by the channels
  std::string normalization_values;                 // a resumed checkpoint's (kind dataset)
  bool image_size_given = false;

  // unet_train's defaults where they are not make_strategy's: cut after layer3.
  static StrategyConfig default_strategy() {
    StrategyConfig s;
    s.mp.cuts = {4};
    return s;
  }
};

// The learning-rate schedule the settings make (lr_schedule.h).
LrSchedule lr_schedule_of(const TrainConfig& cfg);

// Validates, builds the data and the strategy, prints what was chosen and trains.
TrainResult train_unet(const TrainConfig& cfg, std::ostream& out,
                       const std::function<void(const EpochStats&)>& on_epoch = {});

}  // namespace unetcu
