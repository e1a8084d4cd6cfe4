#!/usr/bin/env bash
# The 20-epoch quality run of --precision bf16 --memory-format nhwc against float32 NCHW on the
# CPU, near both runs' plateau: tests/precision_test.sh's comparison at width 1/4, 64x64 and
# the default lr, over epochs 16-20, held to 0.02 (that script says why). About 2 min on the
# 2-core Xeon; figures in docs/benchmarks.md.
#
#   bench/precision_bf16.sh [build/unet_train]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
exec "$root/tests/precision_test.sh" "${1:-build/unet_train}" plateau
