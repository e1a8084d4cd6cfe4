#!/usr/bin/env bash
# ImageNet encoder weights for --init-encoder: tools/pytorch_reference.py export-encoder on a
# randomly initialised torchvision ResNet-34 (no download) writes SMP's encoder.* names; the
# engine loads every encoder tensor from it and its encoder's five feature maps equal
# torchvision's on the same input (float64); unet_train --init-encoder takes the float32 export.
# Skipped (77) without torchvision for /usr/bin/python3, with the reason.
set -u
root="$1" check="$2" train="$3"
. "$(dirname "$0")/python_test_lib.sh"
need_python torchvision torchvision "Debian python3-torchvision"
"$py" "$root/tools/pytorch_reference.py" export-encoder "$d/enc64.safetensors" --random --dtype float64 \
  --golden "$d/golden.safetensors" --image-size 64 || { echo "FAIL: export (float64)"; exit 1; }
"$check" "$d/enc64.safetensors" "$d/golden.safetensors" || { echo "FAIL: the engine's encoder differs from torchvision's"; fail=1; }
"$py" "$root/tools/pytorch_reference.py" export-encoder "$d/enc.safetensors" --random --seed 1 || { echo "FAIL: export"; exit 1; }
out=$("$train" --init-encoder "$d/enc.safetensors" --epochs 1 --train-size 4 --val-size 2 --batch-size 2 \
  --image-size 64 --no-progress --device cpu 2>&1) || { echo "FAIL: --init-encoder: $out"; fail=1; }
grep -q "encoder weights from $d/enc.safetensors" <<<"$out" || { echo "FAIL: --init-encoder line: $out"; fail=1; }
exit $fail
