// Convolution geometry. The CPU backend lowers conv to im2col + GEMM (the CUDA backend to
// cuDNN): the column matrix of one group of g samples is [K = C*kh*kw rows] x [g*OH*OW columns]; row r = (c*kh + i)*kw + j, column
// q = s*OH*OW + oh*OW + ow. Entry = x[s][c][oh*sh - ph + i][ow*sw - pw + j], zero outside.
#pragma once
#include "kernels/common.h"

namespace unetcu::kernels {

struct ConvGeometry {
  int64_t N, C, H, W;  // input
  int64_t O, OH, OW;   // output channels and plane
  int kh, kw, sh, sw, ph, pw;
};

}  // namespace unetcu::kernels
