#!/usr/bin/env bash
# --max-memory: each CPU device's tensors stay under the limit (the loader's batches are host
# data, not counted), and a run that needs more ends with one line naming the device, what it
# needed and the limit (exit 1); --recompute blocks trains where the plain step does not fit
# (a 128x128, batch 4, width/16 step needs between 6 and 7 MiB without recomputation, under 6
# with it); --recompute auto names the blocks the memory model says fit (one device, DP, a
# pipeline), and trains, or says in one line that even every block does not; --mode auto picks
# the fastest plan it timed under the limit, or says in one line that none fits.
#
#   tests/memory_limit_test.sh unet_train
set -u
train=$1
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail=0
T=(--image-size 128 --width-divisor 16 --train-size 8 --val-size 2 --batch-size 4 --epochs 1 --no-progress)

# refused NAME PATTERN ARGS...: exit 1, and stderr is one line matching PATTERN.
refused() {
  local name=$1 pattern=$2
  shift 2
  "$train" "${T[@]}" "$@" > "$d/$name.out" 2> "$d/$name.err"
  local rc=$? lines
  lines=$(wc -l < "$d/$name.err")
  if [ "$rc" != 1 ] || [ "$lines" != 1 ] || ! grep -qE "$pattern" "$d/$name.err"; then
    echo "FAIL: $name: exit $rc, $lines stderr lines, expected exit 1 and one line matching: $pattern"
    sed 's/^/  /' "$d/$name.err" | tail -5
    fail=1
  fi
}
# fits NAME ARGS...: exit 0 and its epoch line.
fits() {
  local name=$1
  shift
  "$train" "${T[@]}" "$@" > "$d/$name.out" 2> "$d/$name.err"
  local rc=$?
  if [ "$rc" != 0 ] || ! grep -q '^epoch 1/1 ' "$d/$name.out"; then
    echo "FAIL: $name: exit $rc, expected a finished epoch"
    tail -5 "$d/$name.err" | sed 's/^/  /'
    fail=1
  fi
}

oom='^unet_train: error: out of memory on cpu:[0-9]+: allocating [0-9]+ bytes with [0-9]+ bytes in its tensors needs [0-9]+ bytes, over the limit of'
refused single "$oom 6291456 bytes \(--max-memory\)\$" --max-memory 6M
fits single_recompute --max-memory 6M --recompute blocks
fits single_roomy --max-memory 8M
fits single_auto --max-memory 6M --recompute auto
grep -qE '^recompute auto: [a-z.0-9]+(,[a-z.0-9]+)* \(predicted peak [0-9]+ MiB of the 6 MiB limit; without recomputation [0-9]+ MiB\)$' "$d/single_auto.out" &&
  grep -qE '^model: .*recomputed in the backward: ' "$d/single_auto.out" ||
  { echo "FAIL: --recompute auto named no blocks:"; sed 's/^/  /' "$d/single_auto.out" | head -8; fail=1; }
refused auto_too_small "^unet_train: error: --recompute auto: a step of 4 images needs about [0-9]+ MiB with every block recomputed, over the limit of 3 MiB \(--max-memory\) less 10 % to spare" --max-memory 3M --recompute auto
refused auto_no_limit "^unet_train: error: --recompute auto needs --max-memory" --recompute auto
fits dp_auto --max-memory 6M --recompute auto --mode dp --devices cpu:0,cpu:1
fits mp_auto --max-memory 4M --recompute auto --mode mp --devices cpu:0,cpu:1 --split-size 2
for run in dp_auto mp_auto; do
  grep -qE '^recompute auto: [a-z.0-9]+(,[a-z.0-9]+)* \(predicted peak [0-9]+ MiB of the [46] MiB limit; without recomputation [0-9]+ MiB\)$' "$d/$run.out" ||
    { echo "FAIL: $run: --recompute auto named no blocks:"; sed 's/^/  /' "$d/$run.out" | head -8; fail=1; }
done
refused auto_split "^unet_train: error: --recompute auto models a given cut" --max-memory 6M --recompute auto --mode mp --devices cpu:0,cpu:1 --split auto
refused dp "$oom 4194304 bytes" --max-memory 4M --mode dp --devices cpu:0,cpu:1
refused mp "$oom 4194304 bytes" --max-memory 4M --mode mp --devices cpu:0,cpu:1 --split-size 2
# --mode auto: a table of the plans that fit, the fastest prediction of each kind timed; the
# chosen plan is the fastest of those measured, its measured peak under the limit, and it trains.
# check_auto NAME LIMIT_MIB
check_auto() {
  local f=$d/$1.out
  local chosen
  chosen=$(sed -n 's/^chosen: //p' "$f")
  if [ -z "$chosen" ] || ! awk -F'|' -v chosen="$chosen" -v limit="$2" '
      /^\| (single|dp|mp)/ {
        name = $2; gsub(/^ +| +$/, "", name); t = $4; gsub(/ /, "", t); p = $6; gsub(/ /, "", p)
        if (t !~ /^[0-9.]+$/) next
        timed++
        if (best == "" || t + 0 < best + 0) best = t
        if (name == chosen) { mine = t; peak = p }
      }
      END { exit !(timed >= 1 && mine != "" && mine + 0 == best + 0 && peak + 0 <= limit) }' "$f"; then
    echo "FAIL: $1: the chosen plan is not the fastest measured one under $2 MiB:"
    sed 's/^/  /' "$f" | head -16
    fail=1
  fi
}
fits mode_auto --mode auto --devices cpu:0,cpu:1 --max-memory 6M
check_auto mode_auto 6
fits mode_auto_one --mode auto --max-memory 5M
check_auto mode_auto_one 5
grep -qE '^chosen: single \(cpu:0\), recompute ' "$d/mode_auto_one.out" ||
  { echo "FAIL: mode_auto_one: one device at 5 MiB should recompute:"; sed 's/^/  /' "$d/mode_auto_one.out" | head -8; fail=1; }
# At 32x32 batch norm needs two images a batch: the searches measure batches of 2 and 4.
"$train" --image-size 32 --width-divisor 16 --train-size 8 --val-size 2 --batch-size 4 --epochs 1 --no-progress \
  --mode auto --devices cpu:0,cpu:1 --max-memory 6M > "$d/auto32.out" 2> "$d/auto32.err" &&
  grep -q '^chosen: ' "$d/auto32.out" && grep -q '^epoch 1/1 ' "$d/auto32.out" &&
  "$train" --image-size 32 --width-divisor 16 --train-size 8 --val-size 2 --batch-size 4 --epochs 1 --no-progress \
    --recompute auto --max-memory 6M > "$d/recompute32.out" 2> "$d/recompute32.err" ||
  { echo "FAIL: the automatic searches at 32x32:"; tail -3 "$d/auto32.err" "$d/recompute32.err" | sed 's/^/  /'; fail=1; }
refused mode_auto_tiny "^unet_train: error: no plan over cpu:0,cpu:1 fits a step of 4 images in 1 MiB per device" \
  --mode auto --devices cpu:0,cpu:1 --max-memory 1M
refused mode_auto_split "^unet_train: error: --mode auto chooses the cut" --mode auto --split layer3
refused mode_auto_recompute "^unet_train: error: --mode auto chooses what to recompute" --mode auto --recompute blocks
refused mode_auto_accumulate "^unet_train: error: --mode auto chooses the accumulation" --mode auto --accumulate-grad-batches 2
refused mode_auto_schedule "^unet_train: error: --mode auto chooses the schedule" --mode auto --schedule 1f1b
refused mode_auto_graphs "^unet_train: error: --mode auto times and models eager steps" --mode auto --cuda-graphs
# bad_flag NAME PATTERN ARGS...: a non-zero exit whose first stderr line matches PATTERN (the
# command line's own errors, as every flag's).
bad_flag() {
  local name=$1 pattern=$2
  shift 2
  "$train" "${T[@]}" "$@" > "$d/$name.out" 2> "$d/$name.err"
  local rc=$?
  if [ "$rc" = 0 ] || ! head -1 "$d/$name.err" | grep -qE "$pattern"; then
    echo "FAIL: $name: exit $rc, expected a refusal matching: $pattern"
    sed 's/^/  /' "$d/$name.err" | tail -5
    fail=1
  fi
}
bad_flag unit "^--max-memory: '8X' is not a size in bytes" --max-memory 8X
bad_flag zero "^--max-memory: '0' is not a size in bytes: 0" --max-memory 0
[ "$fail" = 0 ] && echo "memory limit: runs past --max-memory end with one line; --recompute blocks and auto fit under 6 MiB where the plain step does not; --mode auto trains the fastest plan it timed under the limit"
exit "$fail"
