// Where element (n, c, h, w) of a [N, C, H, W] tensor lies in memory, for either memory format
// (NCHW or NHWC), and the walk from a flat memory index back to its coordinates. Both
// backends' layout-aware bodies use these, so the index math is written once.
#pragma once
#include <cstdint>

#include "bodies/common.h"
#include "bodies/divide.h"

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

// Dims4 with a divider per dimension, for the walk from memory index to coordinates in index
// type I without a divide instruction (bodies/divide.h). Every index of the tensor must
// fit I.
template <class I> struct Dims4Div {
  Divider<I> C, H, W;
  bool nhwc;
  Dims4Div() = default;
  explicit Dims4Div(const Dims4& d) : C(d.C), H(d.H), W(d.W), nhwc(d.nhwc) {}
};

template <class I> HD I offset_of(const Dims4Div<I>& d, I n, I c, I h, I w) {
  const I C = I(d.C.d), H = I(d.H.d), W = I(d.W.d);
  return d.nhwc ? ((n * H + h) * W + w) * C + c : ((n * C + c) * H + h) * W + w;
}

template <class I> HD I channel_of(const Dims4Div<I>& d, I i) {
  return d.nhwc ? d.C.mod(i) : d.C.mod(d.W.div(d.H.div(i)));
}

template <class I> HD void coords_of(const Dims4Div<I>& d, I i, I* n, I* c, I* h, I* w) {
  if (d.nhwc) {
    I q = d.C.div(i);
    *c = i - q * I(d.C.d);
    i = q;
    q = d.W.div(i);
    *w = i - q * I(d.W.d);
    i = q;
    q = d.H.div(i);
    *h = i - q * I(d.H.d);
    *n = q;
  } else {
    I q = d.W.div(i);
    *w = i - q * I(d.W.d);
    i = q;
    q = d.H.div(i);
    *h = i - q * I(d.H.d);
    i = q;
    q = d.C.div(i);
    *c = i - q * I(d.C.d);
    *n = q;
  }
}

}  // namespace unetcu::kernels
