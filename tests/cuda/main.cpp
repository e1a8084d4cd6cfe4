// Main of the CUDA test suite. Without a visible GPU every test case exits with code 77,
// which ctest reports as skipped (SKIP_RETURN_CODE), printing the reason; listing the cases
// (ctest's test discovery) works everywhere.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>

#include "runtime/cuda_api.h"
#include "runtime/device.h"

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--list", 6) == 0 || std::strncmp(argv[i], "-l", 2) == 0) listing = true;
  if (!listing) {
    if (!unetcu::cuda::built()) {
      std::printf("SKIPPED: this build has no CUDA backend\n");
      return 77;
    }
    if (unetcu::cuda_device_count() == 0) {
      std::printf("SKIPPED: no GPU visible (cudaGetDeviceCount reports none or fails); the "
                  "CUDA-vs-CPU checks need one\n");
      return 77;
    }
  }
  doctest::Context context(argc, argv);
  return context.run();
}
