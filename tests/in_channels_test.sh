#!/usr/bin/env bash
# --in-channels N in every mode, as a user runs it: a 1-channel 16-bit PNG set with a resnet18
# encoder started from a .pth file, and a 4-channel RGBA set (unet_synthetic_dataset --channels):
#  - one device, bf16 NHWC, DP over cpu:0,cpu:1 and a pipeline over them, each one epoch;
#  - the checkpoint records the channels and the normalisation (dataset: its values), and
#    unet_predict and --resume take them from it; another --in-channels against it is refused;
#  - a file of another channel count is refused naming it.
#   tests/in_channels_test.sh UNET_TRAIN UNET_PREDICT UNET_SYNTHETIC_DATASET
set -u
train="$1" predict="$2" make_data="$3"
tests=$(cd "$(dirname "$0")" && pwd)
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail=0
"$make_data" "$d/gray16" --count 12 --image-size 64 --channels 1 --bit-depth 16 > /dev/null || { echo "FAIL: gray set"; exit 1; }
"$make_data" "$d/rgba" --count 12 --image-size 64 --channels 4 > /dev/null || { echo "FAIL: RGBA set"; exit 1; }
common=(--width-divisor 16 --batch-size 4 --threads 1 --no-progress --val-fraction 0.25)
for set in gray16 rgba; do
  if [ $set = gray16 ]; then
    args=(--data "$d/gray16" --in-channels 1 --encoder resnet18 --encoder-weights "$tests/golden/resnet18_w16.pth")
    n=1 line="1 channel normalised with the training set's mean and deviation"
  else
    args=(--data "$d/rgba" --in-channels 4 --normalize none)
    n=4 line="4 channels normalised not at all"
  fi
  for mode in single bf16 dp mp; do
    case $mode in
      single) m=(--dist none) ;;
      bf16) m=(--precision bf16 --memory-format nhwc --dist none) ;;
      dp) m=(--mode dp --devices cpu:0,cpu:1 --dist none) ;;
      mp) m=(--mode mp --devices cpu:0,cpu:1 --split layer3 --split-size 2 --dist none) ;;
    esac
    if "$train" "${args[@]}" "${common[@]}" --epochs 1 "${m[@]}" --checkpoint "$d/$set-$mode.safetensors" > "$d/log" 2>&1 \
      && grep -q "$line" "$d/log" && grep -q "^epoch 1/1 " "$d/log"; then
      echo "ok: $set $mode"
    else
      echo "FAIL: $set $mode"; cat "$d/log"; fail=1
    fi
  done
  # The checkpoint's settings, read back by --resume (no --in-channels) and unet_predict.
  if "$train" --data "$d/$set" "${common[@]}" --epochs 2 --dist none --resume "$d/$set-single.safetensors" > "$d/log" 2>&1 \
    && grep -q "$line" "$d/log" && grep -q "^epoch 2/2 " "$d/log"; then
    echo "ok: $set resumed with the checkpoint's channels and normalisation"
  else
    echo "FAIL: $set resume"; cat "$d/log"; fail=1
  fi
  if "$predict" "$d/$set/images" --checkpoint "$d/$set-single.safetensors" --masks "$d/$set/masks" --out "$d/pred-$set" \
    --device cpu > "$d/log" 2>&1 && grep -q "^all 12 images: IoU" "$d/log"; then
    echo "ok: $set predicted with the checkpoint's channels and normalisation"
  else
    echo "FAIL: $set predict"; cat "$d/log"; fail=1
  fi
  other=3
  "$train" --data "$d/$set" "${common[@]}" --epochs 2 --dist none --in-channels $other --resume "$d/$set-single.safetensors" \
    > "$d/log" 2>&1 && { echo "FAIL: $set resumed with --in-channels $other"; fail=1; }
  grep -q "error: --in-channels $other contradicts the checkpoint .* trained with $n" "$d/log" \
    && echo "ok: $set: another --in-channels refused on resume" || { echo "FAIL: $set: the refusal"; cat "$d/log"; fail=1; }
done
# A file of another channel count: refused naming it.
"$train" --data "$d/rgba" --in-channels 1 "${common[@]}" --epochs 1 --dist none > "$d/log" 2>&1 \
  && { echo "FAIL: an RGBA set read as 1 channel"; fail=1; }
grep -q "error: image '.*' has 4 channels, not the 1 of --in-channels" "$d/log" \
  && echo "ok: a 4-channel image refused for --in-channels 1" || { echo "FAIL: the refusal"; cat "$d/log"; fail=1; }
exit $fail
