// Single-device training of the UNet on the synthetic set: the loop behind apps/unet_train
// (and the training tests). One epoch = every training sample once, in a seeded per-epoch
// order, in batches of batch_size (a smaller last batch is kept); then a validation pass in
// eval mode.
#pragma once
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "engine/ops.h"

namespace unetcu {

struct TrainConfig {
  int epochs = 10;
  int batch_size = 8;
  int image_size = 64;
  double lr = 1e-3;
  uint64_t seed = 0;
  LossKind loss = LossKind::BCEDice;
  std::string device = "auto";
  int64_t train_size = 512;
  int64_t val_size = 128;
  int width_divisor = 1;
  std::string optimizer = "adam";  // adam | sgd
  double momentum = 0.9;           // sgd only
  double weight_decay = 0;
  int threads = 0;                 // 0: every core
  DType dtype = DType::F32;
  bool progress = true;            // progress bar on stderr (only when it is a terminal)
  bool tf32 = true;                // CUDA: cuDNN convolutions may use TF32 tensor cores
  // Parallelism. mode "single" trains on `device`; "dp" keeps one replica on each of `devices`
  // ("cpu:0,cpu:1" / "cuda:0,cuda:1"), batch_size samples per replica per step.
  std::string mode = "single";
  std::string devices;
  std::string allreduce = "ring";  // ring | ps
  bool sync_bn = false;
  // mode "mp": the model cut at `split` into stages on `devices`, micro-batches of split_size.
  std::string split = "layer3";
  int split_size = 0;              // 0: the whole batch in one micro-batch
  std::string schedule = "gpipe";  // gpipe | 1f1b
  // Non-empty: profile every op and block, print the per-op/per-block tables at the end and
  // write a Chrome/Perfetto trace to this file.
  std::string profile;
  // Checkpoints (safetensors): written after every epoch (the model with SMP's names, and
  // `<file>.train` with the optimizer state and the epoch); --resume continues a run from one
  // (bit-exactly: same losses as an uninterrupted run); --init-encoder loads only encoder.*.
  std::string checkpoint, resume, init_encoder;
  // Real images: DIR/images + DIR/masks (or the article's DIR/img + DIR/masks_machine), an
  // optional list of names, validation from a second folder or a seeded fraction.
  std::string data, data_list, val_data;
  double val_fraction = 0.1;
  std::string augment = "none";  // none | light | heavy (training samples only)
  int workers = 0;                 // loader threads (single device); 0: 1 on the CPU, 4 for a GPU
};

// Throws unetcu::Error with a clear message for a bad configuration.
void validate(const TrainConfig& cfg);

struct EpochStats {
  int epoch = 0;
  double seconds = 0;      // training part of the epoch (validation excluded)
  double train_loss = 0;   // mean over the epoch's batches, weighted by batch size
  double val_loss = 0, val_iou = 0, val_dice = 0;
  double images_per_second = 0;
  size_t peak_device_bytes = 0;    // CUDA: peak of the caching allocator during the epoch
  double load_seconds = 0;         // loader time spent decoding/augmenting training batches
  double wait_seconds = 0;         // time the training step waited for a batch
};

struct TrainResult {
  std::vector<EpochStats> epochs;
  double mean_epoch_seconds = 0, std_epoch_seconds = 0;
  int64_t parameter_count = 0;
};

// Runs the whole training; each finished epoch is printed to `out` (one line) and passed to
// `on_epoch` if given. A non-finite loss stops training with an Error.
TrainResult train_unet(const TrainConfig& cfg, std::ostream& out,
                       const std::function<void(const EpochStats&)>& on_epoch = {});

}  // namespace unetcu
