// unet_train: trains segmentation_models_pytorch's Unet('resnet34') on the embedded synthetic
// segmentation set or an image folder, on one device, data parallel or model parallel, and
// reports per-epoch time, loss, validation IoU/Dice and images/s.
#include <CLI/CLI.hpp>
#include <iostream>

#include "apps/train_config.h"
#include "cli/parse.h"
#include "kernels/cpu/cpu_select.h"
#include "parallel/dist.h"
#include "train/interrupt.h"

int main(int argc, char** argv) {
  using namespace unetcu;
  cli::name_settings_as_flags();  // errors name the flags
  kernels::cpu::select_gemm_kernels(argv);  // before anything else: it may run us again
  TrainConfig cfg;
  CLI::App app{"unet_train: train a UNet-ResNet34 (segmentation_models_pytorch Unet('resnet34'), "
               "1 class) on the synthetic segmentation set or an image folder"};
  add_train_flags(app, cfg);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  install_interrupt_handler();  // Ctrl-C: finish the step, save, exit 130
  try {
    train_unet(cfg, std::cout);
  } catch (const Interrupted& e) {
    std::cout.flush();
    std::cerr << "unet_train: " << e.what() << "\n";
    return 130;
  } catch (const std::exception& e) {
    std::cerr << "unet_train: error: " << e.what() << "\n";
    std::cerr.flush();
    abort_process_group(1);  // one rank's failure ends every rank of the job
    return 1;
  }
  return 0;
}
