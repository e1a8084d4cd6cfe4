#!/usr/bin/env bash
# unet_predict: masks (and overlays) for a folder, IoU/Dice against ground truth, batches,
# precision, memory format and test-time flips, clear errors (bad inputs refused before
# anything is written, partial output reported).
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
# Probabilities: a 16-bit grayscale PNG per image (IHDR bit depth 16, colour type 0), 64x64.
"$predict" "$d/data/images" --checkpoint "$d/model.safetensors" --width-divisor 16 --image-size 64 \
  --save-probabilities --out "$d/prob" --device cpu > /dev/null 2>&1 || { echo "FAIL: --save-probabilities"; fail=1; }
[ "$(ls "$d/prob" | grep -c '_prob.png$')" -eq 6 ] || { echo "FAIL: 6 probability maps expected"; fail=1; }
head -c 26 "$d/prob/00000_prob.png" | tail -c 10 | od -An -tx1 | tr -d ' \n' | grep -q "00000040000000401000" \
  || { echo "FAIL: probability map is not a 64x64 16-bit grayscale PNG"; fail=1; }
[ "$(ls "$d/pred" | grep -c overlay)" -eq 6 ] || { echo "FAIL: 6 overlays expected"; fail=1; }
grep -qE "^all 6 images: IoU [0-9.]+  Dice [0-9.]+$" <<<"$out" || { echo "FAIL: summary line: $out"; fail=1; }
# Batches, precision, memory format, test-time flips: each run's masks scored against the
# first run's (batch 1, fp32, NCHW) as ground truth. In evaluation mode an image's logits are
# its own, so batches of 4 (4 + 2) and channels-last give those masks (IoU 1, or within a pixel
# or two flipped by the kernels' float32 rounding where a logit sits on the threshold);
# bfloat16 and the flips move logits near the threshold, so their masks differ in part (this
# one-epoch model has many such pixels): IoU below 1 shows the flag reached the model.
# vs_first NAME SUMMARY TEST ARGS...: predict into $d/NAME with ARGS, scored against $d/pred's
# masks; the summary line must end with SUMMARY and the IoU v pass the awk condition TEST.
vs_first() {
  local name=$1 want=$2 test=$3 iou
  shift 3
  if ! "$predict" "$d/data/images" --checkpoint "$d/model.safetensors" --width-divisor 16 --image-size 64 \
      --device cpu --out "$d/$name" --masks "$d/pred" "$@" > "$d/$name.log" 2>&1; then
    echo "FAIL: $name: $(cat "$d/$name.log")"
    fail=1
    return
  fi
  grep -qE "^6 images in [0-9.]+ s \([0-9.]+ images/s; the network alone [0-9.]+ images/s\), $want$" \
    "$d/$name.log" || { echo "FAIL: $name: summary line: $(cat "$d/$name.log")"; fail=1; }
  iou=$(awk '/^all 6 images: IoU / {print $5}' "$d/$name.log")
  awk -v v="$iou" "BEGIN { exit !(v ~ /^[0-9.]+\$/ && ($test)) }" \
    || { echo "FAIL: $name: IoU '$iou' against batch 1, fp32, NCHW, not $test"; fail=1; }
}
vs_first b4 "batch 4, fp32 NCHW, tta none, cpu:0" "v >= 0.999" --batch-size 4
vs_first nhwc "batch 3, fp32 NHWC, tta none, cpu:0" "v >= 0.999" --memory-format nhwc --batch-size 3
vs_first bf16 "batch 1, bf16 NCHW, tta none, cpu:0" "v >= 0.9 && v < 1" --precision bf16
for tta in hflip flips; do
  vs_first "$tta" "batch 6, fp32 NCHW, tta $tta, cpu:0" "v > 0 && v < 1" --tta "$tta" --batch-size 6
done
# The written mask is the same size as its image and only 0/255 (checked by the engine's reader
# through a second prediction of a mask file as an image would be overkill: check the PNG header).
head -c 24 "$d/pred/00000.png" | tail -c 8 | od -An -tx1 | tr -d ' \n' | grep -q "0000004000000040" \
  || { echo "FAIL: mask is not 64x64"; fail=1; }
# A checkpoint written before the run's settings were recorded loads with today's defaults and
# the flags given, and predicts the same masks.
python3 "$(dirname "$0")/strip_settings.py" "$d/model.safetensors" "$d/old.safetensors"
"$predict" "$d/data/images" --checkpoint "$d/old.safetensors" --width-divisor 16 --image-size 64 --device cpu \
  --out "$d/old" > /dev/null 2>&1 || { echo "FAIL: a checkpoint without settings"; fail=1; }
cmp -s "$d/old/00003.png" "$d/pred/00003.png" || { echo "FAIL: the checkpoint without settings predicts another mask"; fail=1; }
# Without --width-divisor and --image-size: the checkpoint's (width/16, 64x64), the same masks.
"$predict" "$d/data/images" --checkpoint "$d/model.safetensors" --device cpu --out "$d/own" > /dev/null 2>&1 \
  || { echo "FAIL: predict with the checkpoint's settings"; fail=1; }
cmp -s "$d/own/00003.png" "$d/pred/00003.png" || { echo "FAIL: the checkpoint's own settings predict another mask"; fail=1; }
msg=$("$predict" "$d/data/images" --checkpoint "$d/nope.safetensors" 2>&1) && { echo "FAIL: missing checkpoint accepted"; fail=1; }
grep -q "cannot be opened" <<<"$msg" || { echo "FAIL: missing checkpoint message: $msg"; fail=1; }
msg=$("$predict" "$d/data/images" --checkpoint "$d/model.safetensors" --width-divisor 8 --device cpu 2>&1) && { echo "FAIL: wrong width accepted"; fail=1; }
grep -q "contradicts the checkpoint" <<<"$msg" || { echo "FAIL: wrong width message: $msg"; fail=1; }
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
# Bad inputs: one clear error each, nothing hangs (timeout), nothing written before the inputs
# have been checked.
common=(--checkpoint "$d/model.safetensors" --width-divisor 16 --image-size 64 --device cpu)
good="$d/data/images/00000.png"
expect_error() {  # expect_error PATTERN WHAT COMMAND...: fails unless it exits non-zero saying PATTERN
  local pattern="$1" what="$2"
  shift 2
  msg=$(timeout 120 "$@" 2>&1) && { echo "FAIL: $what accepted"; fail=1; return; }
  grep -q -- "$pattern" <<<"$msg" || { echo "FAIL: $what: $msg"; fail=1; }
}
mkfifo "$d/pipe.png"
expect_error "image '$d/pipe.png' is a FIFO (named pipe), not a regular file" "a FIFO input" \
  "$predict" "$d/pipe.png" "${common[@]}" --out "$d/bad"
expect_error "checkpoint '$d/pipe.png' is a FIFO (named pipe)" "a FIFO checkpoint" \
  "$predict" "$good" --checkpoint "$d/pipe.png" --device cpu --out "$d/bad"
expect_error "checkpoint '$d/data' is a folder, not a regular file" "a folder checkpoint" \
  "$predict" "$good" --checkpoint "$d/data" --device cpu --out "$d/bad"
# A 54-byte BMP header claiming 20000x20000 (stb would allocate 1.2 GB), refused from its header.
{ printf 'BM\x36\x00\x00\x00\x00\x00\x00\x00\x36\x00\x00\x00\x28\x00\x00\x00\x20\x4e\x00\x00\x20\x4e\x00\x00\x01\x00\x18\x00'
  head -c 24 /dev/zero; } > "$d/huge.bmp"
expect_error "image '$d/huge.bmp' is 20000x20000 (400000000 pixels), more than the limit of 67108864 pixels" \
  "a 20000x20000 BMP" "$predict" "$good" "$d/huge.bmp" "${common[@]}" --out "$d/bad"
# A JPEG whose Huffman table has 320 codes (stb_image 2.27 would write past its arrays).
{ printf '\xff\xd8\xff\xc4\x01\x53\x00'; printf '\x14%.0s' {1..16}; head -c 320 /dev/zero; printf '\xff\xd9'; } > "$d/dht.jpg"
expect_error "corrupt JPEG: Huffman table segment (DHT) at byte 2: table at byte 6 has 320 codes" "a bad Huffman table" \
  "$predict" "$d/dht.jpg" "${common[@]}" --out "$d/bad"
# --max-image-pixels: the 64x64 images are refused below 4096 pixels.
expect_error "is 64x64 (4096 pixels), more than the limit of 4095 pixels" "--max-image-pixels 4095" \
  "$predict" "$good" "${common[@]}" --out "$d/bad" --max-image-pixels 4095
expect_error "max-image-pixels must be at least 1" "--max-image-pixels 0" \
  "$predict" "$good" "${common[@]}" --out "$d/bad" --max-image-pixels 0
"$predict" --help | grep -q -- "--max-image-pixels" || { echo "FAIL: --max-image-pixels not in --help"; fail=1; }
expect_error "batch-size must be in 1..4096, got 0" "--batch-size 0" \
  "$predict" "$good" "${common[@]}" --out "$d/bad" --batch-size 0
expect_error "precision tf32 is the GPUs' tensor-core format; on cpu:0 use fp32 or bf16" "--precision tf32 on the CPU" \
  "$predict" "$good" "${common[@]}" --out "$d/bad" --precision tf32
expect_error "unknown tta 'rotate' (expected none, hflip or flips)" "--tta rotate" \
  "$predict" "$good" "${common[@]}" --out "$d/bad" --tta rotate
# A ground-truth mask of another size: found from the headers, before anything is written.
"$make_data" "$d/small" --count 1 --image-size 32 > /dev/null || { echo "FAIL: small dataset"; exit 1; }
mkdir -p "$d/gt" && cp "$d/small/masks/00000.png" "$d/gt/"
expect_error "mask '$d/gt/00000.png' is 32x32 but its image '$good' is 64x64" "a ground-truth mask of another size" \
  "$predict" "$good" "${common[@]}" --masks "$d/gt" --out "$d/bad"
[ -e "$d/bad" ] && { echo "FAIL: outputs written for bad inputs: $(ls "$d/bad")"; fail=1; }
# Decoding fails part way (c.png's header is whole, its pixels cut off): the masks written
# before it are whole, no temporary file is left, and the error says which were written.
mkdir -p "$d/mixed" && cp "$d/data/images/00001.png" "$d/mixed/a.png" && cp "$d/data/images/00002.png" "$d/mixed/b.png"
head -c 60 "$d/data/images/00003.png" > "$d/mixed/c.png"
expect_error "cannot read image '$d/mixed/c.png'" "a damaged image" "$predict" "$d/mixed" "${common[@]}" --out "$d/part"
grep -qx "unet_predict: 2 of 3 masks were written to $d/part before the error: a.png, b.png" <<<"$msg" \
  || { echo "FAIL: written masks not reported: $msg"; fail=1; }
[ "$(ls -A "$d/part" | tr '\n' ' ')" = "a.png b.png " ] || { echo "FAIL: outputs after a failure: $(ls -A "$d/part")"; fail=1; }
# In batches: those of the batches before the failing one. Of 2 (a, b | c): a and b; of 3
# (a, b, c): none, and no line naming written masks.
expect_error "cannot read image '$d/mixed/c.png'" "a damaged image, batches of 2" \
  "$predict" "$d/mixed" "${common[@]}" --out "$d/part2" --batch-size 2
grep -qx "unet_predict: 2 of 3 masks were written to $d/part2 before the error: a.png, b.png" <<<"$msg" \
  || { echo "FAIL: batches of 2: written masks not reported: $msg"; fail=1; }
expect_error "cannot read image '$d/mixed/c.png'" "a damaged image, one batch of 3" \
  "$predict" "$d/mixed" "${common[@]}" --out "$d/part3" --batch-size 3
grep -q "were written" <<<"$msg" && { echo "FAIL: one batch of 3: masks reported written: $msg"; fail=1; }
[ -z "$(ls -A "$d/part3")" ] || { echo "FAIL: one batch of 3: outputs after a failure: $(ls -A "$d/part3")"; fail=1; }
# unet_train's --data-list goes through the same checks: a folder or a FIFO is refused.
mkfifo "$d/list.fifo"
for list in "$d/data/images" "$d/list.fifo"; do
  expect_error "the name list '$list' is a" "--data-list $list" "$train" --data "$d/data" --data-list "$list" \
    --epochs 1 --width-divisor 16 --batch-size 2 --val-fraction 0.34 --no-progress --device cpu
done
[ $fail -eq 0 ] && echo "ok: masks, overlays, IoU/Dice, batches, precision, layout, flips, folders, errors"
exit $fail
