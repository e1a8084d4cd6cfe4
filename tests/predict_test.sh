#!/usr/bin/env bash
# unet_predict: masks (and overlays) for a folder, IoU/Dice against ground truth, clear errors.
set -u
train="$1" predict="$2" make_data="$3"
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail=0
"$make_data" "$d/data" --count 6 --image-size 64 > /dev/null || { echo "FAIL: dataset"; exit 1; }
"$train" --data "$d/data" --epochs 1 --width-divisor 16 --batch-size 2 --val-fraction 0.34 --no-progress \
  --device cpu --checkpoint "$d/model.safetensors" > /dev/null || { echo "FAIL: training"; exit 1; }
out=$("$predict" "$d/data/images" --checkpoint "$d/model.safetensors" --width-divisor 16 --image-size 64 \
  --masks "$d/data/masks" --overlay --out "$d/pred" --device cpu 2>&1) || { echo "FAIL: predict: $out"; exit 1; }
[ "$(ls "$d/pred" | grep -vc overlay)" -eq 6 ] || { echo "FAIL: 6 masks expected"; fail=1; }
[ "$(ls "$d/pred" | grep -c overlay)" -eq 6 ] || { echo "FAIL: 6 overlays expected"; fail=1; }
grep -qE "^all 6 images: IoU [0-9.]+  Dice [0-9.]+$" <<<"$out" || { echo "FAIL: summary line: $out"; fail=1; }
# The written mask is the same size as its image and only 0/255 (checked by the engine's reader
# through a second prediction of a mask file as an image would be overkill: check the PNG header).
head -c 24 "$d/pred/00000.png" | tail -c 8 | od -An -tx1 | tr -d ' \n' | grep -q "0000004000000040" \
  || { echo "FAIL: mask is not 64x64"; fail=1; }
msg=$("$predict" "$d/data/images" --checkpoint "$d/nope.safetensors" 2>&1) && { echo "FAIL: missing checkpoint accepted"; fail=1; }
grep -q "cannot be opened" <<<"$msg" || { echo "FAIL: missing checkpoint message: $msg"; fail=1; }
msg=$("$predict" "$d/data/images" --checkpoint "$d/model.safetensors" --width-divisor 8 --device cpu 2>&1) && { echo "FAIL: wrong width accepted"; fail=1; }
grep -q "has shape" <<<"$msg" || { echo "FAIL: wrong width message: $msg"; fail=1; }
cp "$d/data/images/00001.png" "$d/dup.png"; cp "$d/data/images/00002.png" "$d/00001.jpg"
msg=$("$predict" "$d/dup.png" "$d/00001.jpg" "$d/data/images/00001.png" --checkpoint "$d/model.safetensors" --width-divisor 16 --device cpu --out "$d/p2" 2>&1) && { echo "FAIL: duplicate stems accepted"; fail=1; }
grep -q "share the name" <<<"$msg" || { echo "FAIL: duplicate stem message: $msg"; fail=1; }
msg=$("$predict" "$d/data/images" --checkpoint "$d/model.safetensors" --width-divisor 16 --device cpu --out "$d/data/images" 2>&1) && { echo "FAIL: --out over the inputs accepted"; fail=1; }
grep -q "would overwrite them" <<<"$msg" || { echo "FAIL: --out message: $msg"; fail=1; }
# Training from a folder with a validation folder and a name list; resuming needs the .train file.
mkdir -p "$d/val/images" "$d/val/masks"; cp "$d/data/images/00000.png" "$d/val/images/"; cp "$d/data/masks/00000.png" "$d/val/masks/"
printf '00001.png\n00002.png\n00003\n' > "$d/list.txt"
out=$("$train" --data "$d/data" --data-list "$d/list.txt" --val-data "$d/val" --epochs 1 --width-divisor 16 \
  --batch-size 3 --augment heavy --no-progress --device cpu 2>&1) || { echo "FAIL: --val-data/--data-list: $out"; fail=1; }
grep -q "3 train / 1 validation, augment heavy" <<<"$out" || { echo "FAIL: folder sizes: $out"; fail=1; }
rm "$d/model.safetensors.train"
msg=$("$train" --data "$d/data" --epochs 2 --width-divisor 16 --batch-size 2 --val-fraction 0.34 --no-progress --device cpu --resume "$d/model.safetensors" 2>&1) && { echo "FAIL: resume without .train accepted"; fail=1; }
grep -q "no .*\.train beside it" <<<"$msg" || { echo "FAIL: resume message: $msg"; fail=1; }
# A CPU device other than cpu:0 trains and predicts (batches and images are moved to it), and
# predicts what cpu:0 predicts from the same checkpoint.
"$train" --data "$d/data" --epochs 1 --width-divisor 16 --batch-size 2 --val-fraction 0.34 --no-progress \
  --device cpu:1 --checkpoint "$d/cpu1.safetensors" > /dev/null 2> "$d/err" || { echo "FAIL: --device cpu:1 training: $(cat "$d/err")"; fail=1; }
"$predict" "$d/data/images" --checkpoint "$d/cpu1.safetensors" --width-divisor 16 --image-size 64 \
  --device cpu:1 --out "$d/pred1" > /dev/null 2> "$d/err" || { echo "FAIL: --device cpu:1 prediction: $(cat "$d/err")"; fail=1; }
"$predict" "$d/data/images" --checkpoint "$d/cpu1.safetensors" --width-divisor 16 --image-size 64 \
  --device cpu:0 --out "$d/pred0" > /dev/null 2> "$d/err" || { echo "FAIL: cpu:0 prediction: $(cat "$d/err")"; fail=1; }
[ "$(ls "$d/pred1" | wc -l)" -eq 6 ] || { echo "FAIL: 6 masks expected from cpu:1"; fail=1; }
diff -r "$d/pred0" "$d/pred1" > /dev/null || { echo "FAIL: cpu:1 and cpu:0 masks differ"; fail=1; }
[ $fail -eq 0 ] && echo "ok: masks, overlays, IoU/Dice, folders, errors"
exit $fail
