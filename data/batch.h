// A batch of segmentation samples, as the datasets make it and the training strategies take it.
#pragma once
#include "engine/tensor.h"

namespace unetcu {

struct Batch {
  Tensor images;  // [B, 3, S, S], normalised with the ImageNet mean/std
  Tensor masks;   // [B, 1, S, S], 0 or 1
  int64_t size() const { return images.defined() ? images.dim(0) : 0; }
};

}  // namespace unetcu
