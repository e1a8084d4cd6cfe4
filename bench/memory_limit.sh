#!/usr/bin/env bash
# The article's claim under a memory limit: a step that does not fit one device trains split
# over two devices, on one device with recompute, and as --mode auto chose. Each plan trains the
# full-width UNet at SIZE, batch 8, for two epochs under --max-memory LIMIT on CPU devices
# (or GPUs: DEVICES=cuda:0,cuda:1), ROUNDS rounds with the plans alternated; prints a Markdown
# table (mean epoch time per round, the last epoch's peak_mem) and each auto run's choice.
#
#   bench/memory_limit.sh [build/unet_train]     # SIZE=256 LIMIT=800M ROUNDS=2 DEVICES=cpu:0,cpu:1
set -u
train=${1:-build/unet_train}
size=${SIZE:-256}
limit=${LIMIT:-800M}
rounds=${ROUNDS:-2}
devices=${DEVICES:-cpu:0,cpu:1}
one=${devices%%,*}
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
common=(--image-size "$size" --batch-size 8 --train-size 16 --val-size 8 --epochs 2 --no-progress --seed 1
        --max-memory "$limit")
names=("one device" "one device, --recompute blocks" "one device, --recompute auto"
       "--mode mp --devices $devices --split-size 4" "--mode auto --devices $devices")
args=("--device $one" "--device $one --recompute blocks" "--device $one --recompute auto"
      "--mode mp --devices $devices --split-size 4" "--mode auto --devices $devices")
declare -A times peaks results
for ((r = 1; r <= rounds; r++)); do
  for i in "${!names[@]}"; do
    out=$d/run$i.$r
    # shellcheck disable=SC2086
    /usr/bin/time -f "%e" -o "$out.wall" "$train" "${common[@]}" ${args[$i]} > "$out" 2> "$out.err"
    if grep -q '^mean epoch time' "$out"; then
      times[$i]+="$(sed -n 's/^mean epoch time \([0-9.]*\)s.*/\1 s/p' "$out"), "
      peaks[$i]=$(grep '^epoch 2/2' "$out" | sed -n 's/.*peak_mem \([0-9]* MiB\).*/\1/p')
      result="trains (run $(cat "$out.wall") s in all)"
      chosen=$(sed -n 's/^chosen: //p; s/^recompute auto: //p' "$out")
      [ -n "$chosen" ] && result="trains; chose \`$chosen\` (run $(cat "$out.wall") s in all)"
      results[$i]=$result
    else
      results[$i]="refused: \`$(tail -1 "$out.err" | sed 's/^unet_train: error: //')\`"
    fi
    [ "$i" = 4 ] && cp "$out" "$d/auto_table.$r"
  done
done
echo "| plan | result | mean epoch (round 1, 2, ...) | peak_mem (all devices) |"
echo "|---|---|---|---|"
for i in "${!names[@]}"; do
  echo "| ${names[$i]} | ${results[$i]} | ${times[$i]:-}| ${peaks[$i]:-} |"
done
echo
echo "--mode auto's table (last round):"
sed -n '/^mode auto:/,/^chosen:/p' "$d/auto_table.$rounds"
