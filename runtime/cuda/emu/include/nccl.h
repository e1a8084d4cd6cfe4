// The CUDA emulator's <nccl.h>: the version query only. NCCL is not emulated: ncclGetVersion
// fails, and data parallelism over GPUs reports that the build lacks it (parallel/nccl_stub.cpp).
#pragma once
#include <cuda_runtime.h>

enum ncclResult_t { ncclSuccess = 0, ncclInvalidUsage = 5 };
ncclResult_t ncclGetVersion(int* version);
const char* ncclGetErrorString(ncclResult_t result);
