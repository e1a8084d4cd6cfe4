// Float32 CPU convolution on oneDNN (the library PyTorch's CPU path uses), beside the im2col +
// GEMM path of conv.cpp, which stays the float64 path and the reference the tests hold oneDNN
// to. oneDNN chooses its kernels by the CPU's feature bits (CPUID), not its model, and runs
// them in its blocked layouts (nChw16c on AVX-512): the engine's NCHW tensors are reordered in
// and out around each call, as PyTorch does for NCHW tensors.
//
// Environment: UNETCU_CPU_CONV=im2col turns oneDNN off (UNETCU_CPU_CONV=onednn, the default
// where the build has it, keeps it on).
#pragma once
#include <string>

#include "kernels/bodies/conv.h"

namespace unetcu::kernels::cpu {

enum class CpuConvImpl { Im2col, OneDnn };

bool onednn_built();                  // the build links oneDNN
CpuConvImpl cpu_conv_impl();          // what float32 convolutions run now
void set_cpu_conv_impl(CpuConvImpl);  // OneDnn in a build without it is an Error
std::string cpu_conv_line();          // "oneDNN 2.6.3 (avx512_core_bf16)" or "im2col + GEMM"

// Mixed precision (--precision bf16 on the CPU): float32 convolutions on oneDNN read their
// inputs — activations, weights, output gradients — rounded to bfloat16 (round to nearest even,
// in oneDNN's reorders) and accumulate and write in float32; the tensors stay float32. PyTorch's
// autocast gives convolutions the same inputs and accumulation (it also stores their outputs in
// bfloat16). Needs oneDNN (Error otherwise); a geometry oneDNN has no kernel for runs im2col in
// float32. Process-wide.
void set_cpu_conv_bf16(bool on);
bool cpu_conv_bf16();

// y = conv(x, w) + b (b may be null); false when oneDNN has no kernel for this geometry (the
// caller then runs im2col).
bool onednn_conv2d_forward(const float* x, const float* w, const float* b, float* y,
                           const ConvGeometry& g);
// gx / gw may be null; each written when its beta is 0, accumulated when it is 1.
bool onednn_conv2d_backward(const float* gy, const float* x, const float* w, float* gx,
                            float beta_x, float* gw, float beta_w, const ConvGeometry& g);

}  // namespace unetcu::kernels::cpu
