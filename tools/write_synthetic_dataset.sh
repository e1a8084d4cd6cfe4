#!/usr/bin/env bash
# Writes the synthetic set as an image folder: tools/write_synthetic_dataset.sh DIR [--count N]
# [--size S or WxH] [--classes N] [--channels 1|3|4] [--bit-depth 8|16] [--seed K]. Then:
# build/unet_train --data DIR [--classes N] [--in-channels N].
# DIR is taken where the caller stands; the program is built in the repository's build/.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
(
  cd "$repo"
  tools/setup.sh >/dev/null
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build -j"$(nproc)" --target unet_synthetic_dataset >/dev/null
)
exec "$repo/build/unet_synthetic_dataset" "$@"
