// The small models and optimizer the parallelism, pipeline, memory and GPU tests train: one
// place for the width, seed, element type and precision they vary.
#pragma once
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "engine/optim.h"
#include "models/unet.h"

namespace unetcu::testing {

// UNet at width/16 from `seed` on `device`, in `dtype`; mixed: bf16 activations, NHWC.
inline UNetConfig small_unet(uint64_t seed, Device device = Device::cpu(), DType dtype = DType::F32,
                             bool mixed = false) {
  UNetConfig c;
  c.width_divisor = 16;
  c.seed = seed;
  c.device = device;
  c.dtype = dtype;
  c.bf16_activations = mixed;
  c.format = mixed ? MemoryFormat::NHWC : MemoryFormat::NCHW;
  return c;
}

// Adam at a learning rate of 0.01.
inline std::unique_ptr<Optimizer> adam_lr_0_01(std::vector<Tensor> p) {
  AdamOptions o;
  o.lr = 1e-2;
  return std::make_unique<Adam>(std::move(p), o);
}

// The largest difference between two models' parameters, relative to the second's (at least
// 1e-3).
inline double max_rel_param_diff(UNet& a, UNet& b) {
  const auto pa = a.parameters(), pb = b.parameters();
  double worst = 0;
  for (size_t i = 0; i < pa.size(); ++i)
    for (int64_t k = 0; k < pa[i].numel(); ++k) {
      const double x = pa[i].at(k), y = pb[i].at(k);
      worst = std::max(worst, std::fabs(x - y) / std::max(1e-3, std::fabs(y)));
    }
  return worst;
}

}  // namespace unetcu::testing
