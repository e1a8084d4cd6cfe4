// Bodies of nearest-neighbour ×2 upsampling: output (oh, ow) reads input (oh/2, ow/2), so
// an input element's gradient is the sum of its 2×2 output block.
#pragma once
#include "kernels/bodies/common.h"

namespace unetcu::kernels {

HD int64_t upsample2x_source(int64_t oh, int64_t ow, int64_t in_w) {
  return (oh >> 1) * in_w + (ow >> 1);
}

}  // namespace unetcu::kernels
