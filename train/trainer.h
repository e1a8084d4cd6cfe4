// The epoch loop, written once over every training strategy (train/strategy.h): the loader
// (worker threads make each global batch ahead of the step, pinned for GPUs, and the next
// batch is placed on the devices before the current step runs), the steps and validation.
// What happens around them (progress and the epoch line, the metrics file, checkpoints and
// resume, early stopping, the clip record, interrupts, profiling) is the callbacks' of
// train/callbacks/, called at fixed points (train/callback.h).
//
// One epoch = every training sample once, in a seeded per-epoch order, in steps of
// batch_size samples per replica (a smaller last step is kept). With N replicas each epoch's
// permutation is cut to a multiple of N and replica r takes every N-th sample from position r
// (DistributedSampler semantics): disjoint, equal shards.
#pragma once
#include <cmath>
#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "train/lr_schedule.h"
#include "train/monitor.h"
#include "train/strategy.h"

namespace unetcu {

// Upper bounds of the sizes a user gives: far from any overflow of what is computed from them.
constexpr int kMaxEpochs = 100000;
constexpr int kMaxBatch = 4096;
constexpr int kMaxAccumulate = 1024;
constexpr int kMaxWorkers = 256;

struct FitOptions {
  int epochs = 10;
  int batch_size = 8;          // per replica, per forward and backward (and validation batch)
  // Gradient accumulation: each optimizer step takes batch_size × accumulate samples per
  // replica, which the strategy runs batch_size at a time (StrategyConfig::accumulate_rows;
  // a pipeline as that many more micro-batches). Steps, schedules and checkpoints count
  // optimizer steps.
  int accumulate_grad_batches = 1;
  uint64_t seed = 0;           // shuffling and augmentation
  DType dtype = DType::F32;
  Augment augment = Augment::None;
  int workers = 0;             // loader threads; 0: one when every device is a CPU, four for GPUs
  bool progress = true;        // progress bar on stderr (only when it is a terminal)
  // Non-empty: profile every op and block, print the tables at the end, write a trace here.
  std::string profile;
  // Checkpoints: written after every epoch (the model with SMP's names and `<file>.train` with
  // the optimizer state and the epoch); resume continues a run from one (bit-exactly: the
  // same losses and files as an uninterrupted run); encoder_weights loads only encoder.*.
  std::string checkpoint, resume, encoder_weights;
  // Metrics file (train/metrics_log.h): a row per epoch, and a step row every log_every steps
  // (0: none). Appended to when resuming.
  std::string log;
  int64_t log_every = 0;
  // The learning rate of every step (train/lr_schedule.h). One that does not vary leaves the
  // optimizers' rates as they were made.
  LrSchedule lr_schedule;
  // The validation metric watched after every epoch (train/monitor.h): save_best (non-empty)
  // is a checkpoint written after each epoch that is the best of the run so far, and
  // monitor.patience > 0 ends the run after that many epochs without an improvement. The
  // monitor's record goes into every checkpoint, so a resumed run keeps counting.
  MonitorOptions monitor;
  std::string save_best;
  // Training on random crop x crop windows of samples at their own size (0: the samples'
  // size); validation then runs on whole images, in overlapping crop x crop tiles
  // (train/inference.h predict_tiled).
  int crop_size = 0;
  // The classes' names (C >= 2: the epoch line gives mIoU, --log a column per class).
  std::vector<std::string> class_names;
  // The run's settings, written into every checkpoint's metadata (engine/checkpoint.h).
  std::map<std::string, std::string> settings;
  // Called after every training step (epoch, steps done in it): tests and progress hooks.
  std::function<void(int, int64_t)> on_step;
  // A bad value, or settings that do not go together: one line naming the setting
  // (runtime/common.h setting()).
  void check() const;
};

struct EpochStats {
  int epoch = 0;
  double seconds = 0;      // training part of the epoch (validation excluded)
  double train_loss = 0;   // mean over the epoch's steps, weighted by their sizes
  // One class: the foreground's IoU and Dice; C >= 2: val_iou is the mIoU and val_dice the
  // mean Dice over classes present (data/metrics.h). val_miou is the mean IoU over classes
  // present (background and foreground for one class); val_class_iou each class's IoU.
  double val_loss = 0, val_iou = 0, val_dice = 0, val_miou = 0;
  std::vector<double> val_class_iou;
  double images_per_second = 0;
  int64_t images = 0;      // the samples this process trained on in the epoch
  double lr = 0;           // the learning rate of the epoch's last step
  size_t peak_device_bytes = 0;    // the most held in tensors at once over the epoch: GPUs, the
                                   // largest peak of their caching allocators; CPU devices,
                                   // the host allocator's (all of them and the loader together)
  double load_seconds = 0;         // the loader's time per worker making training batches
  double wait_seconds = 0;         // time the step waited for a batch
  // Gradient clipping (the optimizers' max_grad_norm): the epoch's mean and largest gradient
  // norm before clipping and the share of its steps the clip scaled down; NaN without it.
  double grad_norm = NAN, grad_norm_max = NAN, clipped_fraction = NAN;
  int64_t clip_steps = 0, clip_clipped = 0;  // the steps clipping saw, and those it scaled down
};

struct TrainResult {
  std::vector<EpochStats> epochs;
  double mean_epoch_seconds = 0, std_epoch_seconds = 0;
  int64_t parameter_count = 0;
  bool stopped_early = false;  // the monitor's patience ran out before the last epoch
  int best_epoch = 0;          // the monitored metric's best epoch of the run (resumed: of
  double best_value = 0;       // the whole run), 0 before any
};

// Trains `strategy` on `train`, validating on `val` after each epoch; each finished epoch is
// printed to `out` (one line) and passed to `on_epoch` if given.
//  - A non-finite training or validation loss, or a non-finite parameter, stops training with
//    an Error before the checkpoint is written: the last good one stays.
//  - The output files' folders are checked before training starts.
//  - With a patience, the run ends (normally) after the epoch that exhausts it, in every
//    process at once.
//  - interrupt_requested() (train/interrupt.h) stops after the step in progress: the checkpoint
//    (if configured) is written with the steps done so far and Interrupted is thrown; resuming
//    from it continues mid-epoch exactly where it stopped.
TrainResult fit(TrainingStrategy& strategy, const Dataset& train, const Dataset& val,
                const FitOptions& options, std::ostream& out,
                const std::function<void(const EpochStats&)>& on_epoch = {});

// Step s of an epoch: the dataset indices of its global batch, replica after replica (replica
// r's rows are [r·b, (r+1)·b) of the batch).
std::vector<int64_t> global_batch_indices(const std::vector<int64_t>& permutation, int replicas,
                                          int batch_size, int64_t step);
int64_t steps_per_epoch(int64_t train_size, int replicas, int batch_size);

// Whether two paths name the same file, also through ".", "..", another spelling or a symbolic
// link (neither needs to exist).
bool same_file(const std::string& a, const std::string& b);

}  // namespace unetcu
