#!/usr/bin/env bash
# Pipeline parallelism across processes (mpirun), one stage per process:
#  - 2 and 3 processes, GPipe and 1F1B, write the same checkpoint bytes (model and every
#    stage's optimizer state) as the in-process pipeline on as many CPU devices;
#  - so do 2 processes in bf16 NHWC (mixed precision, channels-last), and with a step
#    learning-rate schedule after a warmup, and 3 with gradient clipping;
#  - a run resumed from its epoch-1 checkpoint ends with the bytes of the uninterrupted run;
#  - data x pipeline (--mode dp+mp): 2 stages x 2 replicas and 3 stages x 1 equal one device
#    accumulating over the same micro-batches (dist_pipeline_check, float64; also with gradient
#    clipping), and unet_train runs it with one epoch line from process 0 (and with bfloat16
#    gradients);
#  - a stage that fails ends every process with its message.
set -u
train="$1" check="$2"
if ! command -v mpirun >/dev/null; then echo "SKIPPED: no mpirun (tools/setup.sh installs Open MPI)"; exit 77; fi
if ! ldd "$train" | grep -q libmpi; then echo "SKIPPED: built without MPI (libopenmpi-dev)"; exit 77; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# Without leak checking under the sanitizer build: see tests/dist_test.sh.
mpi=(env "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" timeout 300 mpirun --oversubscribe --bind-to none)
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail=0
common=(--width-divisor 16 --image-size 64 --train-size 12 --val-size 4 --epochs 2 --threads 1 --seed 3
        --no-progress)
same() {  # same FILE_A FILE_B WHAT
  if cmp -s "$1" "$2" && cmp -s "$1.train" "$2.train"; then echo "ok: $3"; else echo "FAIL: $3: checkpoints differ"; fail=1; fi
}
for n in 2 3; do
  devs=$(seq -s, -f "cpu:%g" 0 $((n - 1)))
  if [ $n = 2 ]; then split=(--split layer3); else split=(--split layer1,decoder.blocks.2); fi
  for sched in gpipe 1f1b; do
    args=(--mode mp "${split[@]}" --batch-size 6 --split-size 2 --schedule $sched "${common[@]}")
    "$train" "${args[@]}" --devices "$devs" --dist none --checkpoint "$d/threads.safetensors" > "$d/threads.log" 2>&1 \
      || { echo "FAIL: in-process $n stages $sched"; cat "$d/threads.log"; fail=1; continue; }
    "${mpi[@]}" -np $n "$train" "${args[@]}" --checkpoint "$d/procs.safetensors" > "$d/procs.log" 2>&1 \
      || { echo "FAIL: mpirun -np $n $sched"; cat "$d/procs.log"; fail=1; continue; }
    same "$d/threads.safetensors" "$d/procs.safetensors" "-np $n $sched equals the in-process pipeline of $n stages"
    [ "$(grep -c '^epoch ' "$d/procs.log")" -eq 2 ] || { echo "FAIL: -np $n: process 0 alone prints the 2 epoch lines"; cat "$d/procs.log"; fail=1; }
    grep -q "model parallel across processes, $n stages over MPI" "$d/procs.log" || { echo "FAIL: -np $n: strategy line"; cat "$d/procs.log"; fail=1; }
  done
done
# Mixed precision and channels-last: bf16 NHWC activations and gradients cross the cut (each
# message's header carries dtype and format) and give the in-process pipeline's bytes.
args=(--mode mp --split layer3 --batch-size 6 --split-size 2 --precision bf16 --memory-format nhwc "${common[@]}")
if "$train" "${args[@]}" --devices cpu:0,cpu:1 --dist none --checkpoint "$d/threads16.safetensors" > "$d/threads16.log" 2>&1 &&
   "${mpi[@]}" -np 2 "$train" "${args[@]}" --checkpoint "$d/procs16.safetensors" > "$d/procs16.log" 2>&1; then
  same "$d/threads16.safetensors" "$d/procs16.safetensors" "-np 2 bf16 NHWC equals the in-process pipeline"
else
  echo "FAIL: bf16 NHWC pipeline"; cat "$d/threads16.log" "$d/procs16.log"; fail=1
fi
# A learning-rate schedule: every stage's process steps at the rate its step index gives.
args=(--mode mp --split layer3 --batch-size 6 --split-size 2 --lr-schedule step --lr-step-epochs 1 --lr-gamma 0.5
      --warmup-steps 2 "${common[@]}")
if "$train" "${args[@]}" --devices cpu:0,cpu:1 --dist none --checkpoint "$d/threads_lr.safetensors" > "$d/threads_lr.log" 2>&1 &&
   "${mpi[@]}" -np 2 "$train" "${args[@]}" --checkpoint "$d/procs_lr.safetensors" > "$d/procs_lr.log" 2>&1; then
  same "$d/threads_lr.safetensors" "$d/procs_lr.safetensors" "-np 2 with a step schedule equals the in-process pipeline"
else
  echo "FAIL: step schedule pipeline"; cat "$d/threads_lr.log" "$d/procs_lr.log"; fail=1
fi
# Gradient clipping: each stage's process clips by the whole model's norm, as the in-process
# pipeline's stages do (3 stages: the norm has three parts).
args=(--mode mp --split layer1,decoder.blocks.2 --batch-size 6 --split-size 2 --clip-grad-norm 0.05 "${common[@]}")
if "$train" "${args[@]}" --devices cpu:0,cpu:1,cpu:2 --dist none --checkpoint "$d/threads_clip.safetensors" \
     > "$d/threads_clip.log" 2>&1 &&
   "${mpi[@]}" -np 3 "$train" "${args[@]}" --checkpoint "$d/procs_clip.safetensors" > "$d/procs_clip.log" 2>&1; then
  same "$d/threads_clip.safetensors" "$d/procs_clip.safetensors" "-np 3 with gradient clipping equals the in-process pipeline"
else
  echo "FAIL: gradient clipping pipeline"; cat "$d/threads_clip.log" "$d/procs_clip.log"; fail=1
fi
# --resume: epoch 1, then epoch 2 from its checkpoint, ends where the 2-epoch run ended.
args=(--mode mp --split layer3 --batch-size 6 --split-size 3 --width-divisor 16 --image-size 64 --train-size 12
      --val-size 4 --threads 1 --seed 3 --no-progress)
"${mpi[@]}" -np 2 "$train" "${args[@]}" --epochs 2 --checkpoint "$d/straight.safetensors" > "$d/straight.log" 2>&1 \
  || { echo "FAIL: straight run"; cat "$d/straight.log"; fail=1; }
"${mpi[@]}" -np 2 "$train" "${args[@]}" --epochs 1 --checkpoint "$d/resumed.safetensors" > "$d/first.log" 2>&1 \
  && "${mpi[@]}" -np 2 "$train" "${args[@]}" --epochs 2 --resume "$d/resumed.safetensors" \
       --checkpoint "$d/resumed.safetensors" > "$d/second.log" 2>&1 \
  || { echo "FAIL: resumed run"; cat "$d/first.log" "$d/second.log"; fail=1; }
same "$d/straight.safetensors" "$d/resumed.safetensors" "-np 2 resumed after epoch 1 equals the run without a stop"
# Data x pipeline against one device accumulating (float64).
for spec in "4 2 4 2 4" "4 2 4 2 4 1f1b" "3 3 2,7 2 4 1f1b" "4 2 4 2 4 clip=0.05" "3 3 2,7 2 4 clip=0.05"; do
  set -- $spec
  np=$1; shift
  out=$("${mpi[@]}" -np $np "$check" "$@" 2>&1)
  if grep -q '^ok:' <<<"$out"; then echo "ok: -np $np dist_pipeline_check $*: $(grep stages <<<"$out")"; else echo "FAIL: -np $np dist_pipeline_check $*"; echo "$out"; fail=1; fi
done
"${mpi[@]}" -np 4 "$train" --mode dp+mp --pipeline-stages 2 --batch-size 3 --split-size 2 \
  "${common[@]}" > "$d/dpmp.log" 2>&1 || { echo "FAIL: unet_train --mode dp+mp"; cat "$d/dpmp.log"; fail=1; }
if [ "$(grep -c '^epoch ' "$d/dpmp.log")" -eq 2 ] && grep -q "2 stages x 2 data-parallel replicas over MPI" "$d/dpmp.log"; then
  echo "ok: unet_train --mode dp+mp on 2 x 2 processes"
else
  echo "FAIL: dp+mp log"; cat "$d/dpmp.log"; fail=1
fi
# The same with bfloat16 gradients between the replicas: it runs, says so, and ends elsewhere.
"${mpi[@]}" -np 4 "$train" --mode dp+mp --pipeline-stages 2 --batch-size 3 --split-size 2 "${common[@]}" \
  --checkpoint "$d/dpmp_full.safetensors" > "$d/dpmp_full.log" 2>&1 &&
"${mpi[@]}" -np 4 "$train" --mode dp+mp --pipeline-stages 2 --batch-size 3 --split-size 2 "${common[@]}" \
  --allreduce-precision bf16 --checkpoint "$d/dpmp16.safetensors" > "$d/dpmp16.log" 2>&1 \
  || { echo "FAIL: unet_train --mode dp+mp --allreduce-precision bf16"; cat "$d/dpmp_full.log" "$d/dpmp16.log"; fail=1; }
if grep -q "ring bf16 all-reduce" "$d/dpmp16.log" && [ "$(grep -c '^epoch ' "$d/dpmp16.log")" -eq 2 ] &&
   ! cmp -s "$d/dpmp_full.safetensors" "$d/dpmp16.safetensors"; then
  echo "ok: unet_train --mode dp+mp --allreduce-precision bf16"
else
  echo "FAIL: dp+mp with bf16 gradients"; cat "$d/dpmp16.log"; fail=1
fi
msg=$("${mpi[@]}" -np 3 "$train" --mode dp+mp --pipeline-stages 2 "${common[@]}" 2>&1) && { echo "FAIL: 3 processes in 2-stage pipelines accepted"; fail=1; }
grep -q "does not divide the 3 processes" <<<"$msg" || { echo "FAIL: message for 3 processes of 2 stages: $msg"; fail=1; }
# The last stage alone resumes from a file that does not exist: its error ends every stage.
"${mpi[@]}" -np 2 bash -c 'extra=(); [ "$OMPI_COMM_WORLD_RANK" = 1 ] && extra=(--resume '"$d"'/nope.safetensors);
  exec "$0" --mode mp --batch-size 4 --split-size 2 "$@" "${extra[@]}"' "$train" "${common[@]}" > "$d/fail.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { echo "FAIL: a failing stage gave rc $rc"; cat "$d/fail.log"; fail=1; }
grep -q "nope.safetensors" "$d/fail.log" && echo "ok: a failing stage ends every process (rc $rc)" \
  || { echo "FAIL: the failing stage's message is missing"; cat "$d/fail.log"; fail=1; }
exit $fail
