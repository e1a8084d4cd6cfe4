// Small training runs for the tests that call train_unet: a CPU configuration to vary from,
// a file's bytes, and the resume contract (a run resumed from its epoch-1 checkpoint ends as
// the uninterrupted run did, to the byte).
#pragma once
#include <doctest/doctest.h>

#include <cstdio>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include "train/run.h"

namespace unetcu::testing {

// One device, the CPU, synthetic images, no progress bar.
inline TrainConfig cpu_run(int epochs, int image_size, int64_t train_size, int64_t val_size, int width_divisor) {
  TrainConfig cfg;
  cfg.fit.epochs = epochs;
  cfg.data.image_size = image_size;
  cfg.data.train_size = train_size;
  cfg.data.val_size = val_size;
  cfg.strategy.model.width_divisor = width_divisor;
  cfg.device = Device::cpu();
  cfg.fit.progress = false;
  return cfg;
}

inline std::vector<char> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE_MESSAGE(f.good(), "cannot read ", path);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

inline void remove_checkpoint(const std::string& p) {
  std::remove(p.c_str());
  std::remove((p + ".train").c_str());
}

// Runs `cfg` (two epochs) whole into `tag`_whole, then its first epoch into `tag`_first and
// the rest resumed from it into `tag`_rest: the resumed epoch has the uninterrupted run's
// losses, and both checkpoints are the same bytes. The files are removed.
inline void check_resume_equals_whole(TrainConfig cfg, const std::string& tag) {
  std::ostringstream log;
  cfg.fit.checkpoint = tag + "_whole.safetensors";
  const TrainResult whole = train_unet(cfg, log);
  TrainConfig first = cfg;
  first.fit.epochs = 1;
  first.fit.checkpoint = tag + "_first.safetensors";
  train_unet(first, log);
  TrainConfig rest = cfg;
  rest.fit.resume = first.fit.checkpoint;
  rest.fit.checkpoint = tag + "_rest.safetensors";
  const TrainResult resumed = train_unet(rest, log);
  INFO(log.str());
  REQUIRE(resumed.epochs.size() == 1);
  CHECK(resumed.epochs[0].epoch == 2);
  CHECK(resumed.epochs[0].train_loss == whole.epochs[1].train_loss);
  CHECK(resumed.epochs[0].val_loss == whole.epochs[1].val_loss);
  CHECK(slurp(cfg.fit.checkpoint) == slurp(rest.fit.checkpoint));
  CHECK(slurp(cfg.fit.checkpoint + ".train") == slurp(rest.fit.checkpoint + ".train"));
  // The run changed the model between the epochs: the comparison above is not of two copies
  // of the initial state.
  CHECK(slurp(first.fit.checkpoint) != slurp(cfg.fit.checkpoint));
  for (const auto& p : {cfg.fit.checkpoint, first.fit.checkpoint, rest.fit.checkpoint}) remove_checkpoint(p);
}

}  // namespace unetcu::testing
