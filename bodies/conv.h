// Convolution geometry. The CPU backend lowers conv to im2col + GEMM (the CUDA backend to
// cuDNN): the column matrix of one group of g samples is [K = C*kh*kw rows] x [g*OH*OW columns]; row r = (c*kh + i)*kw + j, column
// q = s*OH*OW + oh*OW + ow. Entry = x[s][c][oh*sh - ph + i][ow*sw - pw + j], zero outside.
#pragma once
#include "bodies/common.h"

namespace unetcu::kernels {

struct ConvGeometry {
  int64_t N, C, H, W;  // input
  int64_t O, OH, OW;   // output channels and plane
  int kh, kw, sh, sw, ph, pw;
};

// Floating-point operations of the forward: one multiply and one add per weight per output
// element, padding positions included (the usual count), plus one add per output for a bias.
HD double conv2d_flops(const ConvGeometry& g, bool bias) {
  const double outputs = double(g.N) * g.O * g.OH * g.OW;
  return 2.0 * outputs * double(g.C) * g.kh * g.kw + (bias ? outputs : 0.0);
}

}  // namespace unetcu::kernels
