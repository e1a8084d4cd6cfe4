// RAII cuDNN descriptors used by the conv and batch-norm launchers.
#pragma once
#include <cudnn.h>

#include "runtime/cuda/runtime.cuh"

namespace unetcu::kernels::cuda {

struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  TensorDesc() { CUDNN_CHECK(cudnnCreateTensorDescriptor(&d)); }
  TensorDesc(int64_t n, int64_t c, int64_t h, int64_t w) : TensorDesc() { set(n, c, h, w); }
  void set(int64_t n, int64_t c, int64_t h, int64_t w) {
    CUDNN_CHECK(cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, int(n), int(c),
                                           int(h), int(w)));
  }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(d); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
};

struct FilterDesc {
  cudnnFilterDescriptor_t d = nullptr;
  FilterDesc(int64_t o, int64_t c, int64_t kh, int64_t kw) {
    CUDNN_CHECK(cudnnCreateFilterDescriptor(&d));
    CUDNN_CHECK(cudnnSetFilter4dDescriptor(d, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, int(o), int(c),
                                           int(kh), int(kw)));
  }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(d); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
};

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
