#!/usr/bin/env bash
# A checkpoint of a 3-class run loads into PyTorch's Unet('resnet34', classes=3) with
# strict=True (tools/pytorch_reference.py check: every name and shape; the classes and the
# encoder read from the checkpoint's settings), and so do one-class ones of each encoder depth
# (resnet18, 34, 50, 101, 152). Skipped (77) without PyTorch for /usr/bin/python3, with the
# reason.
set -u
train="$1" root="$2"
. "$(dirname "$0")/python_test_lib.sh"
need_python torch PyTorch "Debian python3-torch; tools/setup.sh --pytorch"
for run in 3:resnet34 1:resnet18 1:resnet34 1:resnet50 1:resnet101 1:resnet152; do
  classes=${run%%:*} encoder=${run#*:}
  file="$d/c$classes-$encoder.safetensors"
  "$train" --classes "$classes" --encoder "$encoder" --image-size 64 --train-size 4 --val-size 2 --batch-size 2 \
    --epochs 1 --width-divisor 16 --no-progress --device cpu --checkpoint "$file" > /dev/null \
    || { echo "FAIL: training with --classes $classes --encoder $encoder"; fail=1; continue; }
  out=$("$py" "$root/tools/pytorch_reference.py" check "$file" --width-divisor 16 2>&1) \
    || { echo "FAIL: PyTorch did not load the $classes-class $encoder checkpoint strictly: $out"; fail=1; continue; }
  grep -q "loaded .* strictly.*(classes $classes, $encoder)" <<<"$out" || { echo "FAIL: check said: $out"; fail=1; }
done
[ $fail -eq 0 ] && echo "ok: 3-class and 1-class checkpoints of every encoder depth load strictly in PyTorch"
exit $fail
