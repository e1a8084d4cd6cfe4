// Writes the valid seed inputs of every fuzz target (targets.h: seed_files) as
// OUTDIR/<target>/<name>. tools/fuzz.sh starts each fuzzer from them, fresh for the current
// model, and `tools/fuzz.sh --update-seeds` refreshes the committed ones in tests/corpus/.
#include <cstdio>
#include <exception>
#include <filesystem>

#include "tests/fuzz/targets.h"

UNETCU_FUZZ_UBSAN_DEFAULTS

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
    return 2;
  }
  try {
    for (const auto& [target, run] : unetcu::fuzz::targets()) {
      const std::string dir = std::string(argv[1]) + "/" + target;
      std::filesystem::create_directories(dir);
      for (const auto& [name, bytes] : unetcu::fuzz::seed_files(target)) {
        unetcu::fuzz::write_bytes(dir + "/" + name, bytes.data(), bytes.size());
        run(bytes.data(), bytes.size());  // a seed must load: it is there to lead the fuzzer in
        std::printf("%s/%s (%zu bytes)\n", target.c_str(), name.c_str(), bytes.size());
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
