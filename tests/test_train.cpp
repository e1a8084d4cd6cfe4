// A short training run on the synthetic set: the loss must fall.
#include <sstream>

#include "train/run.h"
#include "cli/parse.h"
#include "data/synthetic.h"
#include "testing.h"
#include "train_runs.h"

using namespace unetcu;

TEST_CASE("a short training run lowers the loss") {
  TrainConfig cfg = testing::cpu_run(5, 32, 64, 16, 8);
  cfg.fit.batch_size = 8;
  cfg.strategy.optimizer.lr = 1e-2;
  std::ostringstream log;
  TrainResult r = train_unet(cfg, log);
  REQUIRE(r.epochs.size() == 5);
  INFO(log.str());
  CHECK(r.epochs.back().train_loss < 0.8 * r.epochs.front().train_loss);
  CHECK(log.str().find("mean epoch time") != std::string::npos);
}

TEST_CASE("the epoch line gives the CPU's peak memory in tensors, which grows with the batch") {
  auto peak = [](int batch, std::string* log_text) {
    TrainConfig cfg = testing::cpu_run(1, 64, batch, 2, 8);
    cfg.fit.batch_size = batch;
    std::ostringstream log;
    TrainResult r = train_unet(cfg, log);
    REQUIRE(r.epochs.size() == 1);
    *log_text = log.str();
    // Adam in float32 holds each parameter four times at least: the weight, its gradient and
    // the two moments.
    CHECK(r.epochs[0].peak_device_bytes >= size_t(r.parameter_count) * 4 * sizeof(float));
    return r.epochs[0].peak_device_bytes;
  };
  std::string log2, log8;
  const size_t p2 = peak(2, &log2), p8 = peak(8, &log8);
  INFO(log2 << log8);
  CHECK(log2.find(" peak_mem ") != std::string::npos);
  // Six more images in the step: at least their float32 pixels and masks (3 + 1 channels)
  // more, besides every activation they bring.
  CHECK(p8 >= p2 + size_t(6 * 4 * 64 * 64) * sizeof(float));
}

TEST_CASE("bad training configurations are refused with a clear message") {
  std::ostringstream log;
  TrainConfig cfg;
  cfg.fit.batch_size = 0;
  // The library names the setting; a program says how its users spell it (unet_train: flags).
  set_setting_names(nullptr);
  CHECK_THROWS_WITH(train_unet(cfg, log), doctest::Contains("batch_size must be in 1..4096, got 0"));
  cli::name_settings_as_flags();
  CHECK_THROWS_WITH(train_unet(cfg, log), doctest::Contains("--batch-size must be in 1..4096, got 0"));
  cfg = TrainConfig{};
  cfg.data.image_size = 100;
  CHECK_THROWS_WITH(train_unet(cfg, log), doctest::Contains("multiple of 32 in 32..8192"));
  cfg = TrainConfig{};
  cfg.strategy.optimizer.lr = 1e300;  // diverges: the NaN loss must stop training with a message
  cfg.fit.epochs = 3;
  cfg.data.image_size = 32;
  cfg.data.train_size = 16;
  cfg.data.val_size = 8;
  cfg.strategy.model.width_divisor = 16;
  cfg.fit.progress = false;
  cfg.strategy.optimizer.kind = OptimizerKind::SGD;
  CHECK_THROWS_WITH(train_unet(cfg, log), doctest::Contains("not finite"));
}

TEST_CASE("synthetic data: deterministic, masks binary and aligned with the shapes") {
  SyntheticSegmentation a(64, 3), b(64, 3), c(64, 4);
  Batch x = a.batch({0, 5}), y = b.batch({0, 5}), z = c.batch({0, 5});
  CHECK(x.images.to_vector() == y.images.to_vector());
  CHECK(x.masks.to_vector() == y.masks.to_vector());
  CHECK(x.images.to_vector() != z.images.to_vector());
  double fg = 0;
  for (double m : x.masks.to_vector()) {
    CHECK((m == 0.0 || m == 1.0));
    fg += m;
  }
  CHECK(fg > 0);
  CHECK(fg < x.masks.numel());
  const auto p0 = epoch_permutation(10, 1, 0), p1 = epoch_permutation(10, 1, 1);
  CHECK(p0 != p1);
  CHECK(p0 == epoch_permutation(10, 1, 0));
  CHECK_THROWS_WITH(SyntheticSegmentation(48, 0), doctest::Contains("multiple of 32"));
}
