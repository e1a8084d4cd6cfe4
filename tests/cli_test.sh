#!/usr/bin/env bash
# Bad input to unet_train ends with one clear message and a non-zero exit; --help succeeds;
# early stopping, the best checkpoint and gradient clipping do what they say (gradient
# accumulation: tests/test_strategies.cpp).
set -u
bin="$1"
fail=0
expect_error() {  # expect_error "<text the message must contain>" args...
  local want="$1"; shift
  local out rc
  out=$("$bin" --no-progress "$@" 2>&1 >/dev/null); rc=$?
  if [ $rc -eq 0 ]; then
    echo "FAIL: '$*' exited 0"; fail=1
  elif ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL: '$*' said: $out (expected '$want')"; fail=1
  elif [ "$(wc -l <<<"$out")" -gt 3 ]; then
    echo "FAIL: '$*' printed more than a short message: $out"; fail=1
  else
    echo "ok: '$*' -> rc $rc: $out"
  fi
}
expect_error "--batch-size must be in 1..4096, got 0" --batch-size 0
expect_error "multiple of 32" --image-size 100
expect_error "bad device" --device tpu:0
expect_error "device cuda:99 requested, but" --device cuda:99
expect_error "The following argument was not expected: --bogus" --bogus
expect_error "--loss" --loss focal
expect_error "--epochs must be in 1..100000, got 0" --epochs 0
expect_error "is larger than the 8 training images" --batch-size 64 --train-size 8
expect_error "not finite" --lr 1e300 --optimizer sgd --epochs 2 --image-size 32 \
  --train-size 16 --val-size 8 --width-divisor 16
expect_error "Could not convert" --lr abc
expect_error "unknown lr-schedule 'linear' (expected constant, cosine, poly or step)" --lr-schedule linear
expect_error "--min-lr belongs to --lr-schedule cosine" --min-lr 1e-5
expect_error "--lr-power belongs to --lr-schedule poly" --lr-schedule cosine --lr-power 2
expect_error "--lr-step-epochs and --lr-gamma belong to --lr-schedule step" --lr-gamma 0.5
expect_error "--lr-schedule step needs --lr-step-epochs N" --lr-schedule step
expect_error "--lr-gamma must be in (0, 1], got 2" --lr-schedule step --lr-step-epochs 1 --lr-gamma 2
expect_error "--lr-step-epochs must be at least 1, got 0" --lr-schedule step --lr-step-epochs 0
expect_error "--min-lr must be in 0..--lr (0.001), got 0.01" --lr-schedule cosine --min-lr 0.01
expect_error "--lr-power must be in (0, 100], got -1" --lr-schedule poly --lr-power -1
expect_error "--warmup-steps must be in 0..1000000000, got -3" --warmup-steps -3
expect_error "Could not convert" --warmup-steps 1.5
expect_error "--warmup-steps 8 leaves no step at the full rate: the run has 8 steps" --warmup-steps 8 --epochs 2 \
  --image-size 32 --train-size 16 --val-size 4 --batch-size 4 --width-divisor 16
expect_error "--early-stop must be in 0..100000 epochs, got -1" --early-stop -1
expect_error "--early-stop-delta belongs to --early-stop N" --early-stop-delta 0.01
expect_error "--early-stop-delta must be a finite number >= 0, got -0.1" --early-stop 2 --early-stop-delta -0.1
expect_error "--monitor belongs to --save-best or --early-stop" --monitor val_loss
expect_error "--monitor: unknown monitor 'iou' (expected val_iou, val_dice, val_loss or val_miou)" --monitor iou --early-stop 1
expect_error "--save-best and --checkpoint name the same file" --save-best m.safetensors --checkpoint m.safetensors
expect_error "--save-best and --checkpoint name the same file" --save-best ./m.safetensors --checkpoint m.safetensors
expect_error "--clip-grad-norm must be a number >= 0 (0: no clipping) or inf (the norm measured, never clipped), got -1" \
  --clip-grad-norm -1
expect_error "--clip-grad-norm must be a number >= 0 (0: no clipping) or inf (the norm measured, never clipped), got nan" \
  --clip-grad-norm nan
expect_error "Could not convert" --clip-grad-norm big
expect_error "--clip-grad-norm: out of range of a number (inf: the norm measured, never clipped)" --clip-grad-norm 1e999
expect_error "--accumulate-grad-batches must be in 1..1024, got 0" --accumulate-grad-batches 0
expect_error "--batch-size 8 x --accumulate-grad-batches 4 = 32 is larger than the 16 training images" \
  --accumulate-grad-batches 4 --batch-size 8 --train-size 16
expect_error "fewer than --batch-size 8 x --accumulate-grad-batches 2 = 16" --accumulate-grad-batches 2 \
  --mode dp --devices cpu:0,cpu:1 --batch-size 8 --train-size 24
# Accumulation and CUDA graphs go together: on the CPU only the graphs are refused.
expect_error "--cuda-graphs needs a GPU; cpu" --device cpu --batch-size 2 --accumulate-grad-batches 2 --cuda-graphs \
  --epochs 1 --train-size 8 --val-size 4 --width-divisor 16
expect_error "--split auto times one batch of --batch-size; with --accumulate-grad-batches 2 give the cuts" \
  --mode mp --devices cpu:0,cpu:1 --split auto --accumulate-grad-batches 2
expect_error "--mode dp needs --devices" --mode dp
expect_error "belongs to --mode dp" --sync-bn
expect_error "twice" --mode dp --devices cpu:0,cpu:0
expect_error "fewer than --batch-size" --mode dp --devices cpu:0,cpu:1 --train-size 8 --batch-size 8
expect_error "--mode mp needs --devices" --mode mp
expect_error "larger than --batch-size" --mode mp --devices cpu:0,cpu:1 --split-size 9
expect_error "makes 2 stages but --devices lists 3" --mode mp --devices cpu:0,cpu:1,cpu:2
expect_error "not a block" --mode mp --devices cpu:0,cpu:1 --split layer7
expect_error "--sync-bn belongs to --mode dp" --mode mp --devices cpu:0,cpu:1 --sync-bn
expect_error "--cuda-graphs needs a GPU; cpu:0" --mode dp --devices cpu:0,cpu:1 --cuda-graphs --epochs 1 --train-size 16 --val-size 4 --width-divisor 16
expect_error "--cuda-graphs belongs to --mode single, dp or mp" --mode dp+mp --cuda-graphs
expect_error "--cuda-graphs needs a GPU; cpu:0" --mode mp --devices cpu:0,cpu:1 --cuda-graphs --epochs 1 --train-size 8 --val-size 4 --width-divisor 16
RANK=0 WORLD_SIZE=1 expect_error "--mode mp with graphs runs in one process" --mode mp --dist env --cuda-graphs
expect_error "--allreduce-precision belongs to --mode dp and dp+mp" --mode mp --devices cpu:0,cpu:1 --allreduce-precision bf16
expect_error "has no bfloat16 sum" --mode dp --devices cpu:0,cpu:1 --allreduce mpi --allreduce-precision bf16
expect_error "allreduce-precision" --mode dp --devices cpu:0,cpu:1 --allreduce-precision fp16
expect_error "--cuda-graphs needs a GPU" --device cpu --cuda-graphs --epochs 1 --train-size 8 --val-size 4 --width-divisor 16
expect_error "--memory-format" --memory-format nhcw
expect_error "two --devices" --mode mp --devices cpu:0,cpu:1,cpu:0 --split auto
expect_error "--device belongs to --mode single" --mode dp --devices cpu:0,cpu:1 --device cpu:1
expect_error "--schedule: unknown schedule 'foo' (expected gpipe or 1f1b)" --schedule foo
expect_error "--mode: unknown mode 'pp' (expected single, dp, mp, dp+mp or auto)" --mode pp
expect_error "bad device 'gpu:1'" --mode dp --devices cpu:0,gpu:1
expect_error "--mode dp+mp runs one stage per process" --mode dp+mp --pipeline-stages 2
expect_error "--pipeline-stages belongs to --mode dp+mp" --mode mp --devices cpu:0,cpu:1 --pipeline-stages 2
# Sizes past their documented bounds, and values that used to wrap around.
expect_error "--image-size must be a multiple of 32 in 32..8192" --image-size 536870912
expect_error "--image-size must be a multiple of 32 in 32..8192" --image-size 2147483616
expect_error "--threads must be in 0..1024" --threads 100000
expect_error "--train-size must be in 1..100000000" --train-size 9223372036854775807
expect_error "--seed: '-1' is not a whole number" --seed -1
expect_error "not a block" --mode mp --devices cpu:0,cpu:1 --split 99999999999
# Output paths are checked before training, not after it.
expect_error "cannot write the profile trace '/nonexistent/t.json': folder '/nonexistent' does not exist" \
  --profile /nonexistent/t.json --epochs 50
expect_error "cannot write the checkpoint" --checkpoint /nonexistent/m.safetensors --epochs 50
expect_error "cannot write the best checkpoint '/nonexistent/b.safetensors'" --save-best /nonexistent/b.safetensors \
  --epochs 50
# A non-finite validation loss is an error too.
expect_error "validation loss is not finite" --lr 16 --epochs 3 --image-size 32 --train-size 16 \
  --val-size 8 --width-divisor 16
if ! "$bin" --help | grep -q -- "--batch-size"; then echo "FAIL: --help"; fail=1; fi
# Early stopping ends a run normally, and the best checkpoint resumes like any other: with a
# smallest improvement of 1 no epoch after the first improves, so one epoch of patience stops
# the run after epoch 2; the best file is that of the epoch the run names.
tmp=$(mktemp -d)
small=(--no-progress --image-size 32 --train-size 16 --val-size 8 --width-divisor 16 --batch-size 4)
out=$("$bin" "${small[@]}" --epochs 5 --early-stop 1 --early-stop-delta 1 --save-best "$tmp/best.safetensors" 2>&1)
rc=$?
if [ $rc -ne 0 ] || ! grep -q "^early stop after epoch 2 of 5: val_iou has not improved on epoch 1's" <<<"$out" \
   || [ "$(grep -c '^epoch ' <<<"$out")" -ne 2 ] || [ ! -f "$tmp/best.safetensors.train" ]; then
  echo "FAIL: --early-stop 1 --early-stop-delta 1 (rc $rc): $out"; fail=1
else
  echo "ok: --early-stop stopped after epoch 2 with rc 0"
fi
best=$(sed -n "s|^best val_iou [0-9.]* at epoch \([12]\) ($tmp/best.safetensors)\$|\1|p" <<<"$out")
out=$("$bin" "${small[@]}" --epochs 3 --resume "$tmp/best.safetensors" 2>&1)
rc=$?
if [ -z "$best" ] || [ $rc -ne 0 ] || ! grep -q "^resumed from $tmp/best.safetensors after epoch $best$" <<<"$out"; then
  echo "FAIL: resuming from the best checkpoint (epoch '$best'): $out"; fail=1
else
  echo "ok: the best checkpoint (epoch $best) resumes"
fi
# Gradient clipping reaches the optimizer: clipped to a norm of 1e-9, SGD moves no weight by
# more than 1e-10 a step, so the one batch of every epoch (the whole training set) has epoch
# 1's loss again, while the unclipped run's loss falls.
clip=(--no-progress --image-size 32 --train-size 8 --val-size 4 --width-divisor 16 --batch-size 8 --epochs 3
      --optimizer sgd --lr 0.1)
losses() { sed -n 's/^epoch [0-9]*\/3 .*  loss \([0-9.]*\)  .*/\1/p' <<<"$1" | tr '\n' ' '; }
held=$("$bin" "${clip[@]}" --clip-grad-norm 1e-9 2>&1) && free=$("$bin" "${clip[@]}" 2>&1)
rc=$?
read -r h1 h2 h3 <<<"$(losses "$held")"
read -r f1 f2 f3 <<<"$(losses "$free")"
if [ $rc -ne 0 ] || ! grep -q "sgd lr 0.1, gradients clipped to norm 1e-09$" <<<"$held" || [ -z "${h3:-}" ] ||
   [ "$h1" != "$h2" ] || [ "$h1" != "$h3" ] || [ -z "${f3:-}" ] || [ "$f1" != "$h1" ] || [ "$f3" = "$f1" ]; then
  echo "FAIL: --clip-grad-norm 1e-9 (rc $rc): clipped losses '$h1 $h2 $h3', unclipped '$f1 ${f2:-} ${f3:-}'"
  echo "$held"; fail=1
else
  echo "ok: --clip-grad-norm 1e-9 holds the loss at $h1 for 3 epochs; unclipped it goes $f1 -> $f3"
fi
# --clip-grad-norm inf measures and reports the norm and never scales: the unclipped losses.
measured=$("$bin" "${clip[@]}" --clip-grad-norm inf 2>&1)
rc=$?
if [ $rc -ne 0 ] || [ -z "$(losses "$measured")" ] || [ "$(losses "$measured")" != "$(losses "$free")" ] ||
   ! grep -q "sgd lr 0.1, gradient norm measured (never clipped)$" <<<"$measured" ||
   [ "$(grep -cE '^epoch [1-3]/3 .*  grad_norm [0-9.e+-]+ \(max [0-9.e+-]+, 0/1 clipped\)' <<<"$measured")" != 3 ]; then
  echo "FAIL: --clip-grad-norm inf (rc $rc): losses '$(losses "$measured")', unclipped '$(losses "$free")'"
  echo "$measured"; fail=1
else
  echo "ok: --clip-grad-norm inf reports the norm, with the unclipped losses $(losses "$free")"
fi
# Accumulating batches of 3 at 32x32 over 10 images leaves a last batch of one image, but a
# pipeline runs the step's images as micro-batches of 2 (2,2,2 and 2,2): accepted.
if out=$("$bin" --no-progress --mode mp --devices cpu:0,cpu:1 --image-size 32 --batch-size 3 --accumulate-grad-batches 2 \
           --split-size 2 --train-size 10 --val-size 4 --width-divisor 16 --epochs 1 2>&1) &&
   grep -q "^epoch 1/1 .*live_micro_batches 3 3$" <<<"$out"; then
  echo "ok: --mode mp accumulates batches of 3 as micro-batches of 2"
else
  echo "FAIL: --mode mp with --accumulate-grad-batches 2, batches of 3, micro-batches of 2: $out"; fail=1
fi
rm -rf "$tmp"
exit $fail
