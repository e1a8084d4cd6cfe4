// CPU convolution on oneDNN (the library PyTorch's CPU path uses), for float32 and bfloat16
// tensors in either memory format, beside the im2col + GEMM path of conv.cpp, which stays the
// float64 path and the reference the tests hold oneDNN to. oneDNN chooses its kernels by the
// CPU's feature bits (CPUID), not its model. NCHW tensors are reordered in and out of the
// blocked layouts its kernels prefer (nChw16c on AVX-512), as PyTorch does for NCHW tensors;
// NHWC activations are handed to kernels that read and write nhwc directly (PyTorch's
// channels-last path), so only the small weight tensor is reordered. Weights are taken as
// OIHW or OHWI, whichever the tensor holds.
//
// bfloat16 tensors: the primitives read bfloat16, accumulate in float32 and round once when
// they store (a gradient accumulated with beta 1 is computed in float32, added to the
// destination in float32 and rounded once).
//
// Environment: UNETCU_CPU_CONV=im2col turns oneDNN off (UNETCU_CPU_CONV=onednn, the default
// where the build has it, keeps it on). It is read once, at the first convolution;
// set_cpu_conv_impl changes the choice afterwards.
#pragma once
#include <string>

#include "bodies/conv.h"
#include "runtime/tensor_ref.h"

namespace unetcu::kernels::cpu {

enum class CpuConvImpl { Im2col, OneDnn };

bool onednn_built();                  // the build links oneDNN
CpuConvImpl cpu_conv_impl();          // what float32 and bfloat16 convolutions run now
void set_cpu_conv_impl(CpuConvImpl);  // OneDnn in a build without it is an Error
std::string cpu_conv_line();          // "oneDNN 2.6.3 (avx512_core_bf16)" or "im2col + GEMM"

// Whether oneDNN has bfloat16 convolutions on this CPU (they need AVX-512). Where it has not,
// bfloat16 tensors are converted to float32 NCHW and back around the float32 path, by the
// engine's convert kernels: oneDNN 2.6's own bfloat16 <-> float32 reorders run reference code
// on AVX2, 7x slower per convolution (docs/benchmarks.md, the Zen 3 machine).
bool onednn_bf16_supported();
// Tests: false makes bfloat16 tensors take that float32 fallback even where oneDNN has
// bfloat16 kernels (as on a CPU without them). Process-wide; true by default.
void set_onednn_bf16_allowed(bool allowed);
bool onednn_bf16_usable();  // built, switched on, supported and allowed

// y = conv(x, w) + b (b may be absent): x, w, y (and b) float32, or all bfloat16; x and y in
// one memory format, w OIHW (NCHW) or OHWI (NHWC). False when oneDNN has no kernel for this
// case (the caller then runs another path); nothing is written then.
bool onednn_conv2d_forward(const TensorRef& x, const TensorRef& w, const TensorRef& b,
                           const TensorRef& y, const ConvGeometry& g);
// grad_x / grad_w may be absent; each written when its beta is 0, accumulated when it is 1;
// grad_x has x's format and dtype, grad_w w's. False (nothing written) when oneDNN has no
// kernel for one of the needed directions.
bool onednn_conv2d_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& w,
                            const TensorRef& grad_x, double beta_x, const TensorRef& grad_w,
                            double beta_w, const ConvGeometry& g);

}  // namespace unetcu::kernels::cpu
