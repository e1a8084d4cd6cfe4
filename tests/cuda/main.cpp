// Main of the CUDA test suite. Without a visible GPU every test case exits with code 77,
// which ctest reports as skipped (SKIP_RETURN_CODE), printing the reason; listing the cases
// (ctest's test discovery) works everywhere. In the CUDA emulator build the suite runs on the
// CPU, less the cases that need cuDNN's algorithm search or NCCL.
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

namespace {

#ifdef UNETCU_CUDA_EMU
// The cases that need what the CUDA emulator has not (runtime/cuda/emu/README.md): cuDNN's
// algorithm search and NCCL. Run alone (as ctest does) each reports itself skipped, with the
// reason; in a whole run they are left out, named on stdout.
struct Unemulated {
  const char* name;
  const char* reason;
};
constexpr const char* kNoCudnn = "needs cuDNN's algorithm search (the CUDA emulator's convolutions are the CPU backend's)";
constexpr const char* kNoNccl = "needs NCCL, which the CUDA emulator does not have";
const Unemulated kUnemulated[] = {
    {"CUDA conv2d keeps its algorithm choices per dtype and format", kNoCudnn},
    {"deterministic convolutions give the same bits twice, and their choices are kept on disk", kNoCudnn},
    {"data parallelism through NCCL with one GPU rank equals the single-GPU step", kNoNccl},
    {"bfloat16 all-reduce through NCCL with one GPU rank: the single-GPU gradients rounded once", kNoNccl},
    {"data parallelism as one launched process (NCCL_COMM_ID, a group of one) equals one GPU", kNoNccl},
};

// A doctest filter names the case with its commas escaped.
std::string escaped(const char* name) {
  std::string out;
  for (const char* c = name; *c; ++c) {
    if (*c == ',') out += '\\';
    out += *c;
  }
  return out;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--list", 6) == 0 || std::strncmp(argv[i], "-l", 2) == 0) listing = true;
#ifdef UNETCU_CUDA_EMU
  if (!listing) {
    for (int i = 1; i < argc; ++i)
      for (const Unemulated& u : kUnemulated)
        if (std::string(argv[i]) == "--test-case=" + escaped(u.name)) {
          std::printf("SKIPPED: %s\n", u.reason);
          return 77;
        }
    for (const Unemulated& u : kUnemulated)
      std::printf("left out in the CUDA emulator: \"%s\" (%s)\n", u.name, u.reason);
  }
#endif
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
#ifdef UNETCU_CUDA_EMU
  if (!listing)  // listed, so that ctest reports them skipped
    for (const Unemulated& u : kUnemulated) context.addFilter("test-case-exclude", escaped(u.name).c_str());
#endif
  const int rc = context.run();
  if (!own_cache_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(own_cache_dir, ec);
  }
  return rc;
}
