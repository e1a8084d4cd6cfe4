#!/usr/bin/env bash
# The CUDA suite without a GPU: builds the CUDA parts with the host compiler against the CUDA
# emulator (-DUNETCU_CUDA=EMU, emulator/README.md; their kernels run on the CPU) in
# build-emu/, and runs the suite's cases through ctest, each in its own process, side by side, then
# tools/gpu_check.sh's commands (unet_train, unet_predict, unet_bench) on the emulated GPUs at
# tiny sizes (tests/cuda_train_test.sh). cuDNN (its legacy convolution API) and NCCL (for the
# ranks of one process) are the emulator's own.
#
#   tools/test_cuda_emu.sh [--asan]
#
# --asan: the same under AddressSanitizer, in build-emu-asan/: every device allocation's bytes
# past its tensor (inside the caching allocator's rounding, and past each emulated cudaMalloc)
# are unaddressable, so a kernel that reads or writes past its tensor's end is reported, as is
# any out-of-bounds access, use after free or leak in the runtime. About 5 min of build and
# 25 min of tests on 2 cores; not part of CI (tools/test.sh), whose time it would strain: run it
# when kernels or the runtime change.
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-emu
flags=()
if [ "${1:-}" = --asan ]; then
  build=build-emu-asan
  # ASan alone: GCC 12's UBSan reports a null object for the emulator's thread-coordinate
  # variable read inside some kernels (its address is valid; seen in a debugger).
  san="-fsanitize=address -fno-omit-frame-pointer"
  flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS=$san" "-DCMAKE_EXE_LINKER_FLAGS=$san")
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
elif [ -n "${1:-}" ]; then
  echo "usage: tools/test_cuda_emu.sh [--asan]" >&2
  exit 2
else
  flags=(-DCMAKE_BUILD_TYPE=Release)
fi
tools/setup.sh
t=$SECONDS
cmake -S . -B "$build" -DUNETCU_CUDA=EMU "${flags[@]}" >/dev/null
cmake --build "$build" -j"$(nproc)" --target unetcu_cuda_tests unet_train unet_predict unet_bench \
  unet_synthetic_dataset
build_s=$((SECONDS - t))
t=$SECONDS
# Side by side, one case per core: the emulator runs each on one host thread (and its CPU
# references on one OpenMP thread: the cases' ENVIRONMENT).
status=0
ctest --test-dir "$build" -R '^cuda-emu:' --output-on-failure -j"$(nproc)" 2>&1 | tee "$build/ctest.log" || status=$?
printf 'emulator build: %s s\nemulator suite: %s s\n' "$build_s" "$((SECONDS - t))" > "$build/times.txt"
exit "$status"
