// unet_predict: segments images with a trained checkpoint (train/predict_files.h does the work).
#include <CLI/CLI.hpp>

#include <iostream>

#include "cli/cli.h"
#include "kernels/cpu/cpu_select.h"
#include "train/predict_files.h"

using namespace unetcu;

namespace {

// Every flag, filling its field of `c`.
void add_predict_flags(CLI::App& app, PredictConfig& c) {
  app.add_option("inputs", c.inputs, "Image files or folders (PNG/JPEG/BMP)")->required();
  app.add_option("--checkpoint", c.checkpoint, "Model file written by unet_train --checkpoint (safetensors)")
      ->required();
  app.add_option("--out", c.out, "Folder for <stem>.png masks (0/255), overlays and probabilities")
      ->capture_default_str();
  cli::add_optional(app, "--image-size", c.image_size,
                    "Size the model sees (multiple of 32; default: the checkpoint's training size, "
                    "else 512; S or WxH); masks come back at each image's size");
  cli::add_optional(app, "--width-divisor", c.width_divisor,
                    "The model width divisor (default: the checkpoint's; another is an error)");
  cli::add_optional(app, "--tile", c.tile,
                    "Predict each image at its own size in overlapping S x S tiles (a multiple of 32; "
                    "default: the checkpoint's --crop-size when it was trained on crops, else off), "
                    "their probabilities added with a Gaussian weight as nnU-Net does; --batch-size "
                    "tiles at a time bound the memory");
  app.add_option("--overlap", c.overlap, "--tile: the share of a tile its neighbours overlap (0..0.95)")
      ->capture_default_str();
  app.add_option("--threshold", c.threshold,
                 "Foreground where the probability sigmoid(logit) > this (0 < T < 1); a lower T "
                 "marks more pixels, a higher fewer")
      ->capture_default_str();
  app.add_flag("--save-probabilities", c.save_probabilities,
               "Also write <stem>_prob.png: the foreground probability of every pixel as a 16-bit "
               "grayscale PNG (0..65535 for 0..1), at the image's own size, for choosing "
               "thresholds or averaging models without running them again (several classes: "
               "<stem>_prob_<class>.png, one per class)");
  app.add_flag("--overlay", c.overlay,
               "Also write <stem>_overlay.png: the mask in red over the image (several classes: each class "
               "but 0 in its colour, the checkpoint's class colours or a fixed palette)");
  app.add_option("--masks", c.masks,
                 "Ground-truth masks (matched by file stem, read as the training read them): report IoU and "
                 "Dice (several classes: mIoU and each class's IoU)");
  app.add_option("--device", c.device, "auto, cpu, cpu:N or cuda:N")->capture_default_str();
  app.add_option("--batch-size", c.batch_size,
                 "Images per forward pass (1..4096): more is faster on a GPU and takes more memory; "
                 "the masks do not depend on it (up to float rounding at the threshold)")
      ->capture_default_str();
  cli::add_enum(app, "--precision", c.precision, kPrecisionNames,
                "Arithmetic, as unet_train's: auto (tf32 on GPUs, fp32 on the CPU), fp32, tf32 (GPUs), "
                "bf16 (activations in bfloat16, computed in float32; faster on GPUs and AVX-512 "
                "bf16 CPUs, logits close to fp32's)");
  cli::add_enum(app, "--memory-format", c.memory_format, kFormatNames,
                "Memory order of the activations, as unet_train's: nchw, nhwc (channels-last) or auto (nchw)");
  cli::add_enum(app, "--tta", c.tta, kTtaNames,
                "Test-time augmentation: none, hflip (the mean of the logits of the image and of its "
                "left-right mirror, mirrored back: 2 passes) or flips (left-right, top-bottom and both "
                "as well: 4 passes)");
  app.add_option("--max-image-pixels", c.max_image_pixels,
                 "Refuse images (and masks) of more pixels than this, from their header, before decoding")
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  cli::name_settings_as_flags();  // errors name the flags
  kernels::cpu::select_gemm_kernels(argv);  // first: it may run the program again
  PredictConfig c;
  CLI::App app{"unet_predict: segment images with a trained UNet-ResNet34 checkpoint"};
  add_predict_flags(app, c);
  CLI11_PARSE(app, argc, argv);
  PredictProgress progress;
  try {
    predict_files(c, std::cout, &progress);
  } catch (const std::exception& e) {
    std::cerr << "unet_predict: error: " << e.what() << "\n";
    const std::vector<std::string>& written = progress.written;
    if (!written.empty()) {  // one line: how many, where, and the first few names
      std::string names;
      for (size_t i = 0; i < written.size() && i < 5; ++i) names += (i ? ", " : "") + written[i];
      if (written.size() > 5) names += ", ... (" + std::to_string(written.size() - 5) + " more)";
      std::cerr << "unet_predict: " << written.size() << " of " << progress.total << " masks"
                << (progress.overlays ? " (and " + std::to_string(progress.overlays) + " overlays)" : "")
                << " were written to " << c.out << " before the error: " << names << "\n";
    }
    return 1;
  }
  return 0;
}
