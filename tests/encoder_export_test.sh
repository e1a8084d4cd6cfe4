#!/usr/bin/env bash
# Pretrained encoder weights for --encoder-weights, written by tools/pytorch_reference.py
# export-encoder from randomly initialised torchvision ResNets (no download), float64;
#   tests/encoder_export_test.sh depths|channels SOURCE_DIR ENCODER_CHECK UNET_TRAIN
# depths:
#  - resnet18 and resnet50 as torch.save .pth files
#    (torchvision's names, fc included) and as safetensors under torchvision's names: the
#    engine loads every encoder tensor from each and its encoder's five feature maps equal
#    torchvision's on the same input (relative error < 1e-10, tests/encoder_check.cpp);
# channels:
#  - resnet34 under SMP's encoder.* names, the same;
#  - 1 and 4 input channels: the engine adapts the 3-channel first convolution of the .pth as
#    SMP's patch_first_conv does, and its features equal PyTorch's patched network's;
#  - unet_train --encoder-weights takes a float32 .pth, and --init-encoder (its older name) a
#    safetensors file.
# Skipped (77) without torchvision for /usr/bin/python3, with the reason.
set -u
what="$1" root="$2" check="$3" train="$4"
. "$(dirname "$0")/python_test_lib.sh"
need_python torchvision torchvision "Debian python3-torchvision"
export_encoder() { "$py" "$root/tools/pytorch_reference.py" export-encoder "$@" > /dev/null; }
same_features() {  # WEIGHTS GOLDEN ENCODER [IN_CHANNELS] WHAT
  local what="${*: -1}"
  out=$("$check" "${@:1:$#-1}" 2>&1) && grep -q "all five feature maps match" <<<"$out" \
    && echo "ok: $what" || { echo "FAIL: $what: $out"; fail=1; }
}
if [ "$what" = depths ]; then
for e in resnet18 resnet50; do
  export_encoder "$d/$e.pth" --random --dtype float64 --encoder $e --format pth --golden "$d/g_$e.safetensors" \
    --image-size 64 || { echo "FAIL: export $e"; fail=1; continue; }
  export_encoder "$d/${e}_tv.safetensors" --random --dtype float64 --encoder $e --format torchvision \
    || { echo "FAIL: export $e"; fail=1; continue; }
  same_features "$d/$e.pth" "$d/g_$e.safetensors" $e "$e from torch.save's .pth"
  same_features "$d/${e}_tv.safetensors" "$d/g_$e.safetensors" $e "$e from safetensors under torchvision's names"
done
exit $fail
fi
export_encoder "$d/enc64.safetensors" --random --dtype float64 --golden "$d/golden.safetensors" --image-size 64 \
  || { echo "FAIL: export (float64)"; exit 1; }
same_features "$d/enc64.safetensors" "$d/golden.safetensors" resnet34 "resnet34, SMP's names"
for n in 1 4; do
  export_encoder "$d/r18_$n.pth" --random --dtype float64 --encoder resnet18 --format pth \
    --golden "$d/g18_$n.safetensors" --image-size 64 --in-channels $n || { echo "FAIL: export, $n channels"; fail=1; }
  same_features "$d/r18_$n.pth" "$d/g18_$n.safetensors" resnet18 $n "$n input channels: the first convolution as SMP patches it"
done
export_encoder "$d/r18_32.pth" --random --seed 1 --encoder resnet18 --format pth || { echo "FAIL: export"; exit 1; }
export_encoder "$d/enc.safetensors" --random --seed 1 || { echo "FAIL: export"; exit 1; }
for run in "--encoder resnet18 --encoder-weights $d/r18_32.pth" "--init-encoder $d/enc.safetensors"; do
  file=${run##* }
  out=$("$train" $run --epochs 1 --train-size 4 --val-size 2 --batch-size 2 --image-size 64 --no-progress \
    --device cpu 2>&1) || { echo "FAIL: $run: $out"; fail=1; continue; }
  grep -q "encoder weights from $file" <<<"$out" && echo "ok: unet_train $run" \
    || { echo "FAIL: $run: the line: $out"; fail=1; }
done
exit $fail
