// CPU convolution with few output channels (the segmentation head: 16 -> 1 channel, 3x3),
// computed directly. oneDNN and im2col + GEMM both spend about as long on a C -> 1 convolution
// as on a C -> C one (their kernels block over output channels; the GEMM is a matrix-vector
// product), so here each output row is built from shifted input rows, one vector loop per
// tap, in either memory format and every dtype (float32, float64, bfloat16 stored and
// computed in float32). conv.cpp sends NCHW convolutions here, and NHWC ones only where oneDNN
// does not take them (its channels-last kernels are as fast, and faster in bfloat16).
//
// Arithmetic: outputs and data gradients sum in the compute type (float, double for float64)
// in the order c, kh, kw; weight and bias gradients sum each output row in the compute type,
// then the rows in double, per thread, the threads' partials added in thread order (the same
// bits for a given thread count). A gradient with beta 1 is added to its tensor in the compute
// type and rounded once.
#pragma once
#include "bodies/conv.h"
#include "runtime/tensor_ref.h"

namespace unetcu::kernels::cpu {

constexpr int64_t kNarrowConvMaxOutputs = 4;

// Whether the direct path takes this geometry (stride 1, at most kNarrowConvMaxOutputs output
// channels) and it is allowed.
bool narrow_conv_takes(const ConvGeometry& g);
// Tests: false sends every convolution to oneDNN or im2col + GEMM. Process-wide; true by default.
void set_narrow_conv_allowed(bool allowed);

// As conv2d_forward / conv2d_backward (kernels/launchers.h), for the geometries
// narrow_conv_takes accepts.
void narrow_conv2d_forward(const TensorRef& x, const TensorRef& w, const TensorRef& b,
                           const TensorRef& y, const ConvGeometry& g);
void narrow_conv2d_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& w,
                            const TensorRef& grad_x, double beta_x, const TensorRef& grad_w,
                            double beta_w, const TensorRef& grad_b, double beta_b,
                            const ConvGeometry& g);

}  // namespace unetcu::kernels::cpu
