// One libFuzzer program per target of targets.h; UNETCU_FUZZ_TARGET ("safetensors", "image" or
// "train") picks which. Built by the UNETCU_FUZZ section at the end of CMakeLists.txt and run
// by tools/fuzz.sh.
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "runtime/device.h"
#include "tests/fuzz/targets.h"

UNETCU_FUZZ_UBSAN_DEFAULTS

#ifndef UNETCU_FUZZ_TARGET
#error "UNETCU_FUZZ_TARGET names the target"
#endif

namespace {
const unetcu::fuzz::Target& target() {
  static const unetcu::fuzz::Target& t = unetcu::fuzz::targets().at(UNETCU_FUZZ_TARGET);
  return t;
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // One thread: OpenMP teams would only add noise to the coverage and the timing.
  unetcu::set_cpu_threads(1);
  target();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    target()(data, size);
  } catch (const unetcu::Error&) {
    // A refused input: the outcome the readers promise.
  } catch (const std::exception& e) {
    // Any other exception type escapes the readers' contract: a finding.
    std::fprintf(stderr, "fuzz %s: uncaught %s (not unetcu::Error)\n", UNETCU_FUZZ_TARGET, e.what());
    std::abort();
  }
  return 0;
}
