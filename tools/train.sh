#!/usr/bin/env bash
# The main job: installs what the build needs, builds (Release), and trains the UNet-ResNet34
# on the embedded synthetic set on the best device found. Extra arguments go to unet_train.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target unet_train
exec build/unet_train --device auto "$@"
