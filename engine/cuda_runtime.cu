// The one piece of the CUDA runtime the engine needs before the CUDA op backend exists:
// how many GPUs are visible. Any error (no driver, no device, driver too old) means zero.
#include <cuda_runtime.h>

#include "engine/device.h"

namespace unetcu {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  return n;
}

}  // namespace unetcu
