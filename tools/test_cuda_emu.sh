#!/usr/bin/env bash
# The CUDA suite without a GPU: builds the CUDA parts with the host compiler against the CUDA
# emulator (-DUNETCU_CUDA=EMU, runtime/cuda/emu/README.md; their kernels run on the CPU) in
# build-emu/, and runs the suite's cases through ctest, each in its own process. The cases that
# need cuDNN's algorithm search or NCCL report themselves skipped, with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
cmake -S . -B build-emu -DCMAKE_BUILD_TYPE=Release -DUNETCU_CUDA=EMU >/dev/null
cmake --build build-emu -j"$(nproc)" --target unetcu_cuda_tests
ctest --test-dir build-emu -R '^cuda-emu:' --output-on-failure
