#!/usr/bin/env bash
# --precision bf16 --memory-format nhwc on the CPU trains as well as float32 NCHW: the same
# synthetic run (seeded, width 1/4, 512 images at 64x64, 20 epochs) in both ends within 0.02
# validation IoU of each other. bf16 stores every activation and gradient rounded to bfloat16,
# so the two runs take different paths; 20 epochs bring both near their plateau, where the
# difference measures the precision rather than where each run happens to be on its way.
set -u
train="$1"
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
args=(--width-divisor 4 --image-size 64 --train-size 512 --val-size 128 --epochs 20 --batch-size 8
      --threads 2 --no-progress)
out=$("$train" --precision bf16 --memory-format nhwc --epochs 1 --train-size 16 --val-size 8 \
        --width-divisor 16 --no-progress 2>&1) || { echo "FAIL: --precision bf16: $out"; exit 1; }
grep -q "precision: bf16 activations and gradients .*, NHWC" <<<"$out" || { echo "FAIL: no precision line: $out"; exit 1; }
"$train" "${args[@]}" --precision fp32 > "$d/fp32.log" 2>&1 || { echo "FAIL: fp32 run"; cat "$d/fp32.log"; exit 1; }
"$train" "${args[@]}" --precision bf16 --memory-format nhwc > "$d/bf16.log" 2>&1 || { echo "FAIL: bf16 run"; cat "$d/bf16.log"; exit 1; }
# The mean validation IoU of epochs 18-20: one epoch's IoU moves by up to 0.04 from the next
# near the plateau (measured here), the mean of three by much less.
iou() { grep -E '^epoch (18|19|20)/20' "$1" | sed -nE 's/.* val_iou ([0-9.]+) .*/\1/p' |
          awk '{s += $1; n++} END {if (n == 3) printf "%.4f", s / n}'; }
a=$(iou "$d/fp32.log") b=$(iou "$d/bf16.log")
[ -n "$a" ] && [ -n "$b" ] || { echo "FAIL: no final IoU"; cat "$d/fp32.log" "$d/bf16.log"; exit 1; }
if awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 0.02 && a > 0.5) }'; then
  echo "ok: validation IoU, mean of epochs 18-20: fp32 $a, bf16 $b"
else
  echo "FAIL: validation IoU, mean of epochs 18-20: fp32 $a, bf16 $b (more than 0.02 apart, or not trained)"; exit 1
fi
