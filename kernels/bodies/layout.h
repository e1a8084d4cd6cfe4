// Where element (n, c, h, w) of a [N, C, H, W] tensor lies in memory, for either memory format
// (NCHW or NHWC), and the walk from a flat memory index back to its coordinates. Both
// backends' layout-aware bodies use these, so the index math is written once.
#pragma once
#include <cstdint>

#include "kernels/bodies/common.h"

namespace unetcu::kernels {

struct Dims4 {
  int64_t N, C, H, W;
  bool nhwc;  // memory order NHWC (channels last), else NCHW
};

HD int64_t offset_of(const Dims4& d, int64_t n, int64_t c, int64_t h, int64_t w) {
  return d.nhwc ? ((n * d.H + h) * d.W + w) * d.C + c : ((n * d.C + c) * d.H + h) * d.W + w;
}

// The channel of the element at memory index i.
HD int64_t channel_of(const Dims4& d, int64_t i) {
  return d.nhwc ? i % d.C : (i / (d.H * d.W)) % d.C;
}

// Coordinates of the element at memory index i.
HD void coords_of(const Dims4& d, int64_t i, int64_t* n, int64_t* c, int64_t* h, int64_t* w) {
  if (d.nhwc) {
    *c = i % d.C;
    i /= d.C;
    *w = i % d.W;
    i /= d.W;
    *h = i % d.H;
    *n = i / d.H;
  } else {
    *w = i % d.W;
    i /= d.W;
    *h = i % d.H;
    i /= d.H;
    *c = i % d.C;
    *n = i / d.C;
  }
}

}  // namespace unetcu::kernels
