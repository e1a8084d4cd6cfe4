// RAII cuDNN descriptors used by the conv and batch-norm launchers, and the mapping of the
// engine's dtypes and memory formats to cuDNN's.
#pragma once
#include <cudnn.h>

#include "runtime/cuda/runtime.cuh"
#include "runtime/dtype.h"

namespace unetcu::kernels::cuda {

inline cudnnDataType_t cudnn_data_type(DType t) {
  switch (t) {
    case DType::F32: return CUDNN_DATA_FLOAT;
    case DType::F64: return CUDNN_DATA_DOUBLE;
    case DType::BF16: return CUDNN_DATA_BFLOAT16;
  }
  return CUDNN_DATA_FLOAT;
}

// NCHW, or NHWC (channels last). For a filter [O, I, kh, kw], CUDNN_TENSOR_NHWC is OHWI (KRSC).
inline cudnnTensorFormat_t cudnn_format(MemoryFormat f) {
  return f == MemoryFormat::NHWC ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
}

struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  TensorDesc() { CUDNN_CHECK(cudnnCreateTensorDescriptor(&d)); }
  TensorDesc(int64_t n, int64_t c, int64_t h, int64_t w) : TensorDesc() { set(n, c, h, w); }
  TensorDesc(int64_t n, int64_t c, int64_t h, int64_t w, DType type, MemoryFormat format)
      : TensorDesc() {
    set(n, c, h, w, type, format);
  }
  // float32 NCHW
  void set(int64_t n, int64_t c, int64_t h, int64_t w) {
    set(n, c, h, w, DType::F32, MemoryFormat::NCHW);
  }
  void set(int64_t n, int64_t c, int64_t h, int64_t w, DType type, MemoryFormat format) {
    // cuDNN's 4-d descriptors index with 32-bit integers.
    UNETCU_CHECK(n * c * h * w < (int64_t(1) << 31), "a tensor of [", n, ", ", c, ", ", h, ", ", w,
                 "] has 2^31 or more elements, more than cuDNN's convolutions take; use a "
                 "smaller batch or image");
    CUDNN_CHECK(cudnnSetTensor4dDescriptor(d, cudnn_format(format), cudnn_data_type(type), int(n),
                                           int(c), int(h), int(w)));
  }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(d); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
};

struct FilterDesc {
  cudnnFilterDescriptor_t d = nullptr;
  // float32 OIHW
  FilterDesc(int64_t o, int64_t c, int64_t kh, int64_t kw)
      : FilterDesc(o, c, kh, kw, DType::F32, MemoryFormat::NCHW) {}
  // OIHW (NCHW) or OHWI (NHWC)
  FilterDesc(int64_t o, int64_t c, int64_t kh, int64_t kw, DType type, MemoryFormat format) {
    CUDNN_CHECK(cudnnCreateFilterDescriptor(&d));
    CUDNN_CHECK(cudnnSetFilter4dDescriptor(d, cudnn_data_type(type), cudnn_format(format), int(o),
                                           int(c), int(kh), int(kw)));
  }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(d); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
};

// Cross-correlation with float32 compute (what float32 and bfloat16 data both use: bfloat16
// products and sums are formed in float32).
struct ConvDesc {
  cudnnConvolutionDescriptor_t d = nullptr;
  ConvDesc(int ph, int pw, int sh, int sw) {
    CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&d));
    CUDNN_CHECK(cudnnSetConvolution2dDescriptor(d, ph, pw, sh, sw, 1, 1, CUDNN_CROSS_CORRELATION,
                                                CUDNN_DATA_FLOAT));
  }
  ~ConvDesc() { cudnnDestroyConvolutionDescriptor(d); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
};

}  // namespace unetcu::kernels::cuda
