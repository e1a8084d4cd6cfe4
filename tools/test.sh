#!/usr/bin/env bash
# Installs what the build needs, builds everything (CUDA parts for sm_90 only, to keep the
# build short; override with CUDA_ARCHS) and runs the whole test suite through ctest, then the
# CUDA suite on the CUDA emulator (tools/test_cuda_emu.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# matplotlib and torchvision too: tests/plot_test.sh renders every plot, and
# tests/encoder_export_test.sh checks the engine's encoder against torchvision's.
tools/setup.sh --plots --pytorch
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" >/dev/null
cmake --build build -j"$(nproc)"
# Serial: every test already uses all cores through OpenMP, and two spinning OpenMP teams on
# two cores slow each other down many times over.
ctest --test-dir build --output-on-failure
# The CUDA suite on the CUDA emulator (runtime/cuda/emu/README.md): no GPU needed.
tools/test_cuda_emu.sh
