// Bodies of nearest-neighbour ×2 upsampling: output (oh, ow) reads input (oh/2, ow/2), so
// an input element's gradient is the sum of its 2×2 output block.
//
// Also of the fused upsample-into-concat (SMP's DecoderBlock: torch.cat([F.interpolate(x,
// scale_factor=2, mode="nearest"), skip], dim=1)): y [N, Cx + Cs, 2H, 2W] holds x [N, Cx, H, W]
// upsampled in channels [0, Cx) and skip [N, Cs, 2H, 2W] in [Cx, Cx + Cs). Both backends walk
// y per (n, c) plane and per row, so no element index is divided: the row pointers below are
// formed once per row and the inner loop only steps along it.
//
// In NHWC the concat is per pixel: each pixel of y holds x's Cx upsampled values, then skip's
// Cs. Gradient sums are formed in the compute type (float for bfloat16) and rounded once by
// the caller's store.
#pragma once
#include "bodies/bf16.h"
#include "bodies/common.h"

namespace unetcu::kernels {

HD int64_t upsample2x_source(int64_t oh, int64_t ow, int64_t in_w) {
  return (oh >> 1) * in_w + (ow >> 1);
}

// Element ow of an upsampled output row whose input row is x_row [W].
template <class T> HD T upsample2x_row_at(const T* x_row, int64_t ow) { return x_row[ow >> 1]; }

// The 2×2 block of an output gradient whose top-left element is top[left] (bottom[left] below
// it; the right neighbours `step` elements on: 1 in NCHW, C in NHWC), summed top-left,
// top-right, bottom-left, bottom-right: one order for every launcher of both backends, so the
// fused op's gradient is the same bits as the unfused pair's and NHWC's as NCHW's.
template <class T> HD acc_t<T> upsample2x_block_sum(const T* top, const T* bottom, int64_t left,
                                                    int64_t step) {
  using A = acc_t<T>;
  return A(top[left]) + A(top[left + step]) + A(bottom[left]) + A(bottom[left + step]);
}

// Gradient of input element w of an NCHW row h, from output rows 2h (g_top) and 2h + 1
// (g_bottom), each [2W].
template <class T> HD acc_t<T> upsample2x_grad_at(const T* g_top, const T* g_bottom, int64_t w) {
  return upsample2x_block_sum(g_top, g_bottom, 2 * w, 1);
}

// Plane (n, c) of the concat output: channel c < Cx is x's plane n * Cx + c (upsampled), the
// rest skip's plane n * Cs + (c - Cx) (copied). Returns whether it comes from x.
HD bool upsample2x_concat_plane(int64_t n, int64_t c, int64_t Cx, int64_t Cs, int64_t* source) {
  if (c < Cx) {
    *source = n * Cx + c;
    return true;
  }
  *source = n * Cs + (c - Cx);
  return false;
}

}  // namespace unetcu::kernels
