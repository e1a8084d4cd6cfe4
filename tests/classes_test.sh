#!/usr/bin/env bash
# Several classes end to end: a 3-class synthetic folder at 160x96 (class indices in 8-bit
# gray PNGs), training on 64x64 crops in single, dp (two CPU devices) and mp modes, each
# checkpoint resumed in single mode; unet_predict takes classes, width divisor and tiles from the
# checkpoint: class-index masks at each image's own size (a 1000x600 BMP in tiles), per-class
# probabilities, overlays, mIoU against ground truth; contradicting flags and old checkpoints.
set -u
train="$1" predict="$2" make_data="$3" root="$4"
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail=0
"$make_data" "$d/data" --count 10 --size 160x96 --classes 3 > /dev/null || { echo "FAIL: dataset"; exit 1; }
# PNG header: width and height, bit depth 8, colour type 0 (gray).
png_size() { head -c 26 "$1" | tail -c 10 | od -An -tx1 | tr -d ' \n'; }
[ "$(png_size "$d/data/masks/00000.png")" = "000000a0000000600800" ] || { echo "FAIL: mask not 160x96 gray"; fail=1; }
common=(--data "$d/data" --crop-size 64 --width-divisor 16 --batch-size 4 --val-fraction 0.2 --no-progress)
out=$("$train" "${common[@]}" --classes 3 --device cpu --epochs 1 --checkpoint "$d/single.safetensors" --log "$d/m.csv" 2>&1) \
  || { echo "FAIL: single: $out"; exit 1; }
grep -q "random 64x64 crops (validation: whole images in tiles), 3 classes (0, 1, 2)" <<<"$out" \
  || { echo "FAIL: data line: $out"; fail=1; }
grep -qE "^epoch 1/1 .* val_miou [0-9.]+  val_mdice [0-9.]+ " <<<"$out" || { echo "FAIL: epoch line: $out"; fail=1; }
head -1 "$d/m.csv" | grep -q ",val_iou_0,val_iou_1,val_iou_2$" || { echo "FAIL: per-class columns: $(head -1 "$d/m.csv")"; fail=1; }
[ "$(tail -1 "$d/m.csv" | tr ',' '\n' | wc -l)" -eq "$(head -1 "$d/m.csv" | tr ',' '\n' | wc -l)" ] \
  || { echo "FAIL: epoch row has another column count than the header"; fail=1; }
# dp and mp write checkpoints that resume in single mode (classes, width and crops from the
# checkpoint).
for m in dp mp; do
  extra=(--mode "$m" --devices cpu:0,cpu:1)
  [ "$m" = mp ] && extra+=(--split layer3)
  o=$("$train" "${common[@]}" --classes 3 "${extra[@]}" --epochs 1 --checkpoint "$d/$m.safetensors" 2>&1) \
    || { echo "FAIL: $m: $o"; fail=1; continue; }
  o=$("$train" --data "$d/data" --batch-size 4 --val-fraction 0.2 --no-progress --device cpu \
      --epochs 2 --resume "$d/$m.safetensors" 2>&1) || { echo "FAIL: $m resumed in single mode: $o"; fail=1; continue; }
  grep -qE "^epoch 2/2 .* val_miou" <<<"$o" || { echo "FAIL: $m resumed: $o"; fail=1; }
  # Classes, width and crops from the checkpoint.
  grep -q "random 64x64 crops (validation: whole images in tiles), 3 classes" <<<"$o" \
    || { echo "FAIL: $m resumed without the checkpoint's crops or classes: $o"; fail=1; }
done
# The synthetic set on crops: the resumed run renders at the checkpoint's size and crops as it did.
syn=(--width-divisor 16 --train-size 8 --val-size 2 --batch-size 4 --no-progress --device cpu)
"$train" "${syn[@]}" --classes 3 --image-size 128x96 --crop-size 64 --epochs 1 --checkpoint "$d/syn.safetensors" \
  > /dev/null 2>&1 || { echo "FAIL: synthetic 3-class run"; fail=1; }
o=$("$train" "${syn[@]}" --epochs 2 --resume "$d/syn.safetensors" 2>&1) || { echo "FAIL: synthetic resume: $o"; fail=1; }
grep -q "data: synthetic at 128x96, random 64x64 crops (validation: whole images in tiles), 3 classes" <<<"$o" \
  || { echo "FAIL: the synthetic resume lost the size or crops: $o"; fail=1; }
msg=$("$train" "${common[@]}" --classes 2 --device cpu --epochs 2 --resume "$d/single.safetensors" 2>&1) && { echo "FAIL: --classes 2 resumed a 3-class run"; fail=1; }
grep -q "contradicts the checkpoint" <<<"$msg" || { echo "FAIL: classes contradiction: $msg"; fail=1; }
# Prediction with no --classes, --width-divisor or --image-size: from the checkpoint, in tiles.
out=$("$predict" "$d/data/images" --checkpoint "$d/single.safetensors" --masks "$d/data/masks" --overlay \
      --save-probabilities --out "$d/pred" --device cpu --batch-size 3 2>&1) || { echo "FAIL: predict: $out"; exit 1; }
grep -q "^tiles of 64x64, overlap 0.50" <<<"$out" || { echo "FAIL: not tiled: $out"; fail=1; }
grep -qE "^all 10 images: mIoU [0-9.]+ \(over the classes present\); IoU per class: 0 [0-9.]+, 1 " <<<"$out" \
  || { echo "FAIL: summary: $out"; fail=1; }
[ "$(png_size "$d/pred/00003.png")" = "000000a0000000600800" ] || { echo "FAIL: predicted mask not 160x96 gray"; fail=1; }
[ "$(ls "$d/pred" | grep -c '_prob_[012].png$')" -eq 30 ] || { echo "FAIL: 3 probability maps per image expected"; fail=1; }
[ "$(ls "$d/pred" | grep -c '_overlay.png$')" -eq 10 ] || { echo "FAIL: 10 overlays expected"; fail=1; }
# A 1000x600 image (a 24-bit BMP of random pixels) comes back at 1000x600.
{ printf 'BM\x76\x77\x1b\x00\x00\x00\x00\x00\x36\x00\x00\x00\x28\x00\x00\x00\xe8\x03\x00\x00\x58\x02\x00\x00'
  printf '\x01\x00\x18\x00\x00\x00\x00\x00\x40\x77\x1b\x00\x13\x0b\x00\x00\x13\x0b\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00'
  head -c 1800000 /dev/urandom; } > "$d/big.bmp"
out=$("$predict" "$d/big.bmp" --checkpoint "$d/single.safetensors" --out "$d/big" --device cpu --batch-size 8 2>&1) \
  || { echo "FAIL: 1000x600: $out"; fail=1; }
[ "$(png_size "$d/big/big.png")" = "000003e8000002580800" ] || { echo "FAIL: the 1000x600 image's mask is $(png_size "$d/big/big.png")"; fail=1; }
# Whole images at the checkpoint's size instead of tiles: --tile 0 (the width still from the checkpoint).
"$predict" "$d/data/images/00001.png" --checkpoint "$d/single.safetensors" --tile 0 --image-size 160x96 --out "$d/whole" \
  --device cpu > /dev/null 2>&1 || { echo "FAIL: --tile 0"; fail=1; }
msg=$("$predict" "$d/data/images" --checkpoint "$d/single.safetensors" --width-divisor 8 --device cpu --out "$d/p8" 2>&1) \
  && { echo "FAIL: --width-divisor 8 accepted for a width/16 checkpoint"; fail=1; }
grep -q "contradicts the checkpoint" <<<"$msg" || { echo "FAIL: width contradiction: $msg"; fail=1; }
[ ! -e "$d/p8" ] || { echo "FAIL: outputs written before the contradiction was refused"; fail=1; }
# A checkpoint written before the settings were recorded (the same file without them) loads
# with today's defaults (one class, width 1, 512) and the flags given.
python3 "$root/tests/strip_settings.py" "$d/single.safetensors" "$d/old.safetensors"
msg=$("$predict" "$d/data/images/00001.png" --checkpoint "$d/old.safetensors" --width-divisor 16 --out "$d/old0" \
      --device cpu 2>&1) && { echo "FAIL: a 3-class checkpoint without settings loaded as one class"; fail=1; }
grep -q "segmentation_head.0.weight" <<<"$msg" || { echo "FAIL: old checkpoint message: $msg"; fail=1; }
exit $fail
