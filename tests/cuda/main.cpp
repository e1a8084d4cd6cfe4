// Main of the CUDA test suite. Without a visible GPU every test case exits with code 77,
// which ctest reports as skipped (SKIP_RETURN_CODE), printing the reason; listing the cases
// (ctest's test discovery) works everywhere. In the CUDA emulator build the suite runs on the
// CPU, cuDNN and NCCL included (the emulator's). Where one GPU is visible, the cases that need
// two are left out (reported skipped, with the reason).
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
#include <iterator>
#include <string>
#include <vector>

#include "runtime/cuda_api.h"
#include "runtime/device.h"
#include "../scratch_dir.h"

namespace {

// Cases left out of a run, each with its reason: run alone (as ctest does) each reports itself
// skipped, with the reason; in a whole run they are left out, named on stdout.
struct LeftOut {
  const char* name;
  const char* reason;
};

// The cases that need two GPUs (tests/cuda/test_cuda_dp.cpp), where fewer are visible.
constexpr const char* kOneGpu = "needs two GPUs; fewer are visible";
const char* const kTwoGpus[] = {
    "NCCL collectives over two GPUs: sums, averages, bfloat16, broadcast and reduce",
    "contract 4 on two GPUs: data parallelism equals one GPU accumulating over the two shards",
    "synchronized batch norm on two GPUs: data parallelism over 2 x 2 equals one GPU on the batch of 4",
    "bfloat16 all-reduce on two GPUs: gradients within two roundings of the exact mean, replicas identical",
    "data parallelism on two GPUs: a failing rank ends the step with its own error, no rank hangs",
    "NCCL watchdog on two GPUs: a rank that never arrives times the group out, naming rank and collective",
    "data parallelism on two GPUs replayed as a CUDA graph equals the eager step, bit for bit",
    "a data-parallel step on two GPUs replayed as a CUDA graph takes no GPU memory from the system",
    "a data-parallel capture refused on one GPU: both replicas go on eagerly, with the eager bits",
    "a data-parallel step on two GPUs returns before its work has run, its loss read late the waited step's",
    "a data-parallel loss read late on two GPUs after the group was aborted throws the reason, not a number",
    "the memory model predicts each GPU's peak within 10 %: data parallelism and a pipeline over two GPUs",
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

}  // namespace

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--list", 6) == 0 || std::strncmp(argv[i], "-l", 2) == 0) listing = true;
  std::vector<LeftOut> left_out;
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
    if (unetcu::cuda_device_count() < 2)
      for (const char* name : kTwoGpus) left_out.push_back({name, kOneGpu});
    for (int i = 1; i < argc; ++i)
      for (const LeftOut& u : left_out)
        if (std::string(argv[i]) == "--test-case=" + escaped(u.name)) {
          std::printf("SKIPPED: %s\n", u.reason);
          return 77;
        }
    for (const LeftOut& u : left_out) std::printf("left out: \"%s\" (%s)\n", u.name, u.reason);
  }
  unetcu::cuda::set_deterministic(true);
  const unetcu::testing::ScratchDir scratch;  // cases run in parallel (ctest -j) write apart
  if (!listing && !std::getenv("UNETCU_CACHE_DIR") && !scratch.path().empty()) {
    const std::string dir = scratch.path() + "/algo_cache";  // removed with the scratch folder
    std::error_code ec;
    if (std::filesystem::create_directory(dir, ec)) setenv("UNETCU_CACHE_DIR", dir.c_str(), 1);
  }
  doctest::Context context(argc, argv);
  if (!listing)  // listed, so that ctest reports them skipped
    for (const LeftOut& u : left_out) context.addFilter("test-case-exclude", escaped(u.name).c_str());
  return context.run();
}
