// unet_train's flags: each fills its field of the run's configuration (train/run.h) directly,
// grouped by topic in --help.
#pragma once
#include "train/run.h"

namespace CLI {
class App;
}

namespace unetcu {

// Declares every unet_train flag, bound to `cfg`.
void add_train_flags(CLI::App& app, TrainConfig& cfg);

}  // namespace unetcu
