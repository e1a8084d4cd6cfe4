// The CUDA emulator's <cudnn.h>: handles only. The runtime keeps a cuDNN handle per stream;
// convolutions, the only cuDNN calls, run on the CPU backend's kernels in the emulator build
// (kernels/cuda/emu_conv.cpp), so no other part of cuDNN is declared.
#pragma once
#include <cuda_runtime.h>

struct cudnnContext;
typedef cudnnContext* cudnnHandle_t;
enum cudnnStatus_t { CUDNN_STATUS_SUCCESS = 0, CUDNN_STATUS_BAD_PARAM = 3 };
cudnnStatus_t cudnnCreate(cudnnHandle_t* handle);
cudnnStatus_t cudnnDestroy(cudnnHandle_t handle);
cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t stream);
const char* cudnnGetErrorString(cudnnStatus_t status);
