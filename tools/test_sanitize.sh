#!/usr/bin/env bash
# The CPU test suite again, built with AddressSanitizer and UndefinedBehaviorSanitizer
# (g++, CUDA off, RelWithDebInfo) in build-sanitize/: any out-of-bounds access, use after free
# or undefined behaviour in a test — the corpus replay of tests/corpus/ included — fails it.
# CI runs it after tools/test.sh. Builds only what ctest runs (unetcu_tests and the programs
# the shell tests drive), not the benchmarks or the link checks (the ordinary build has them).
# Every test runs, with one shortened: precision_bf16_trains (-DUNETCU_ACCURACY_TESTS=OFF) runs
# its fp32 and bf16 NHWC trainings for two epochs of 20 images instead of its 12-epoch
# comparison, which touches no code the short runs do not; the ordinary build (tools/test.sh)
# keeps the accuracy comparison. Debug information is line tables only (-g1): enough for the
# sanitizers' stack traces, at less compile time than full -g. The cases run side by side, as
# in tools/test.sh. Leak checking stays on (no leak was reported, OpenMP and OpenBLAS included).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=build-sanitize
tools/setup.sh

# UBSan aborts on its first report (-fno-sanitize-recover), except shift-base, which stays
# recoverable only so that tests/fuzz/ubsan_suppressions.txt can name the one known report in
# third-party code (stb_image_write's JPEG writer shifts a negative int: UB in C++17); with
# halt_on_error=1 every other shift-base report still ends the test.
sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fsanitize-recover=shift-base -fno-omit-frame-pointer"
t=$SECONDS
cmake -S . -B "$build" -DUNETCU_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DUNETCU_ACCURACY_TESTS=OFF \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
  -DCMAKE_CXX_FLAGS="$sanitize" -DCMAKE_EXE_LINKER_FLAGS="$sanitize" >/dev/null
cmake --build "$build" -j"$(nproc)" \
  --target unetcu_tests unet_train unet_predict unet_synthetic_dataset unet_bench unet_perfmodel encoder_check \
  dist_pipeline_check
echo "sanitizer build: $((SECONDS - t)) s"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:check_initialization_order=1}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$root/tests/fuzz/ubsan_suppressions.txt"
t=$SECONDS
ctest --test-dir "$build" --output-on-failure -j"$(nproc)"
echo "sanitizer suite: $((SECONDS - t)) s"
