// Main of the CUDA test suite. Without a visible GPU every test case exits with code 77,
// which ctest reports as skipped (SKIP_RETURN_CODE), printing the reason; listing the cases
// (ctest's test discovery) works everywhere.
//
// The suite runs with deterministic convolution algorithms (the CUDA-vs-CPU checks hold
// float32 to 1e-5 and the data/model-parallel checks compare runs), and keeps its algorithm
// choices in a folder of its own unless UNETCU_CACHE_DIR names one, so a user's cache neither
// changes the tests nor is changed by them.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <stdlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

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
  unetcu::cuda::set_deterministic(true);
  std::string own_cache_dir;
  if (!listing && !std::getenv("UNETCU_CACHE_DIR")) {
    char dir[] = "/tmp/unetcu_cuda_tests_XXXXXX";
    if (mkdtemp(dir)) {
      own_cache_dir = dir;
      setenv("UNETCU_CACHE_DIR", dir, 1);
    }
  }
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (!own_cache_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(own_cache_dir, ec);
  }
  return rc;
}
