// unet_train: trains segmentation_models_pytorch's Unet('resnet34') on the embedded synthetic
// segmentation set and reports per-epoch time, loss, validation IoU/Dice and images/s.
#include <CLI/CLI.hpp>
#include <iostream>

#include "apps/trainer.h"

int main(int argc, char** argv) {
  using namespace unetcu;
  TrainConfig cfg;
  std::string loss = "bce+dice", dtype = "float32";
  bool no_progress = false, no_tf32 = false;

  CLI::App app{"unet_train: train a UNet-ResNet34 (segmentation_models_pytorch Unet('resnet34'), "
               "1 class) on the synthetic segmentation set"};
  app.add_option("--epochs", cfg.epochs, "Number of epochs")->capture_default_str();
  app.add_option("--batch-size", cfg.batch_size,
                 "Images per optimizer step; with --mode dp, per replica (the global batch is "
                 "--batch-size x the number of devices, as in the article)")
      ->capture_default_str();
  app.add_option("--image-size", cfg.image_size, "Image height and width (multiple of 32)")
      ->capture_default_str();
  app.add_option("--lr", cfg.lr, "Learning rate")->capture_default_str();
  app.add_option("--seed", cfg.seed, "Seed of the initialisation, data and shuffling")
      ->capture_default_str();
  app.add_option("--loss", loss, "Loss: bce, dice or bce+dice")
      ->check(CLI::IsMember({"bce", "dice", "bce+dice"}))
      ->capture_default_str();
  app.add_option("--device", cfg.device,
                 "auto (a GPU when one is visible and usable, else the CPU), cpu, cpu:N, cuda:N")
      ->capture_default_str();
  app.add_option("--train-size", cfg.train_size, "Number of synthetic training images")
      ->capture_default_str();
  app.add_option("--val-size", cfg.val_size, "Number of synthetic validation images")
      ->capture_default_str();
  app.add_option("--optimizer", cfg.optimizer, "adam or sgd")
      ->check(CLI::IsMember({"adam", "sgd"}))
      ->capture_default_str();
  app.add_option("--momentum", cfg.momentum, "SGD momentum")->capture_default_str();
  app.add_option("--weight-decay", cfg.weight_decay, "L2 weight decay (Adam and SGD)")
      ->capture_default_str();
  app.add_option("--width-divisor", cfg.width_divisor,
                 "Divide every channel count by this (1 = the real model)")
      ->capture_default_str();
  app.add_option("--threads", cfg.threads,
                 "CPU threads (0 = all cores; with --mode dp: per replica, 0 = cores/N)")
      ->capture_default_str();
  app.add_option("--dtype", dtype, "float32 or float64 (float64 on the CPU only)")
      ->check(CLI::IsMember({"float32", "float64"}))
      ->capture_default_str();
  app.add_flag("--no-progress", no_progress, "Do not draw the progress bar on stderr");
  app.add_option("--mode", cfg.mode,
                 "single (one device, --device), dp (data parallel: one replica per device "
                 "of --devices, gradients averaged by all-reduce) or mp (model parallel: the "
                 "model cut by --split into stages on --devices, micro-batches of --split-size)")
      ->check(CLI::IsMember({"single", "dp", "mp"}))
      ->capture_default_str();
  app.add_option("--split", cfg.split,
                 "--mode mp: the blocks after which the model is cut, comma separated, one cut "
                 "per extra stage: layer3 (the article's: stem..layer3 | layer4 + decoder + "
                 "head), or any of stem, layer1..4, decoder.blocks.0..4, or block indices")
      ->capture_default_str();
  app.add_option("--split-size", cfg.split_size,
                 "--mode mp: samples per micro-batch (0 = the whole batch; the last may be "
                 "smaller). Batch norm uses each micro-batch's statistics, as the article's run")
      ->capture_default_str();
  app.add_option("--schedule", cfg.schedule,
                 "--mode mp: gpipe (all forwards, then all backwards) or 1f1b")
      ->check(CLI::IsMember({"gpipe", "1f1b"}))
      ->capture_default_str();
  app.add_option("--devices", cfg.devices,
                 "--mode dp: the replicas' devices, e.g. cpu:0,cpu:1,cpu:2 or cuda:0,cuda:1; "
                 "--mode mp: one per stage, may repeat (CPU devices share the cores: --threads "
                 "each, default cores/N)");
  app.add_option("--allreduce", cfg.allreduce,
                 "--mode dp: ring (reduce-scatter + all-gather) or ps (reduce to rank 0, "
                 "broadcast back)")
      ->check(CLI::IsMember({"ring", "ps"}))
      ->capture_default_str();
  app.add_flag("--sync-bn", cfg.sync_bn,
               "--mode dp: batch-norm statistics over all replicas, so N x b "
               "trains as one batch of N*b");
  app.add_option("--profile", cfg.profile,
                 "Time every op and block (forward and backward, with FLOPs and bytes), print "
                 "the per-op and per-block tables at the end and write a Chrome/Perfetto trace "
                 "(one track per device thread: compute, communication) to this JSON file. On a "
                 "GPU the times are queueing times unless UNETCU_CUDA_SYNC=1");
  app.add_option("--data", cfg.data,
                 "Train on images: DIR/images + DIR/masks matched by file stem (or the article's "
                 "DIR/img + DIR/masks_machine); PNG/JPEG/BMP, masks > 0 are foreground; resized "
                 "to --image-size. Without it: the synthetic set (--train-size/--val-size)");
  app.add_option("--data-list", cfg.data_list, "Only the images named in this file (one per line, or a CSV's first column)");
  app.add_option("--val-data", cfg.val_data, "Validation images from this folder (same layout) instead of a split");
  app.add_option("--val-fraction", cfg.val_fraction, "Share of --data held out for validation (seeded)")
      ->capture_default_str();
  app.add_option("--augment", cfg.augment,
                 "Training augmentation, the same for image and mask: none, light (flip, "
                 "brightness/contrast) or heavy (+ vertical flip, scale-crop, rotation)")
      ->check(CLI::IsMember({"none", "light", "heavy"}))
      ->capture_default_str();
  app.add_option("--workers", cfg.workers,
                 "Loader threads that decode and augment batches ahead of the step (0: one when "
                 "training on the CPU, four for a GPU); each epoch line gives the loader's img/s "
                 "and the time the step waited for it")
      ->capture_default_str();
  app.add_option("--checkpoint", cfg.checkpoint,
                 "Save a checkpoint after every epoch: the model to FILE (safetensors with "
                 "segmentation_models_pytorch's state_dict names), optimizer state and epoch to "
                 "FILE.train; written to a temporary file and renamed");
  app.add_option("--resume", cfg.resume,
                 "Continue from a checkpoint (model, optimizer, next epoch); with the same flags "
                 "and seed the losses are those of an uninterrupted run (--mode single)");
  app.add_option("--init-encoder", cfg.init_encoder,
                 "Load only the encoder.* entries of a safetensors file, e.g. ImageNet ResNet34 "
                 "weights exported from torchvision (--mode single)");
  app.add_flag("--no-tf32", no_tf32,
               "CUDA: keep cuDNN convolutions in full float32 (by default they may use TF32 "
               "tensor cores, as PyTorch does)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    cfg.loss = parse_loss_kind(loss);
    cfg.dtype = parse_dtype(dtype);
    cfg.progress = !no_progress;
    cfg.tf32 = !no_tf32;
    train_unet(cfg, std::cout);
  } catch (const std::exception& e) {
    std::cerr << "unet_train: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
