#!/usr/bin/env bash
# Data parallelism across processes (mpirun): 2 and 3 processes, ring and ps (and 3 with
# bfloat16 gradients, 2 with a learning-rate schedule and gradient clipping, 2 stopping early),
# write the same checkpoint bytes (model and optimizer state) as the same run with the replicas
# as threads of one process; a rank that fails ends every rank, with its message, in bounded
# time.
set -u
train="$1"
if ! command -v mpirun >/dev/null; then echo "SKIPPED: no mpirun (tools/setup.sh installs Open MPI)"; exit 77; fi
if ! ldd "$train" | grep -q libmpi; then echo "SKIPPED: built without MPI (libopenmpi-dev)"; exit 77; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# Under the sanitizer build (tools/test_sanitize.sh) the MPI processes run without leak
# checking: Open MPI's plugins allocate at MPI_Init and are unloaded before exit, so their
# reports name no module a suppression could match. Address and UB checks stay on, and the
# in-process runs below keep leak checking.
mpi=(env "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" mpirun --oversubscribe --bind-to none)
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail=0
common=(--width-divisor 16 --image-size 64 --train-size 12 --val-size 4 --batch-size 2 --epochs 2
        --threads 1 --seed 3 --no-progress)
for n in 2 3; do
  devs=$(seq -s, -f "cpu:%g" 0 $((n - 1)))
  for algo in ring ps; do
    "$train" --mode dp --devices "$devs" --allreduce $algo "${common[@]}" --dist none \
      --checkpoint "$d/threads.safetensors" > "$d/threads.log" 2>&1 || { echo "FAIL: in-process $n $algo"; cat "$d/threads.log"; exit 1; }
    timeout 300 "${mpi[@]}" -np $n "$train" --mode dp --allreduce $algo "${common[@]}" \
      --checkpoint "$d/procs.safetensors" > "$d/procs.log" 2>&1 || { echo "FAIL: mpirun -np $n $algo"; cat "$d/procs.log"; fail=1; continue; }
    cmp -s "$d/threads.safetensors" "$d/procs.safetensors" || { echo "FAIL: -np $n $algo: model differs"; fail=1; }
    cmp -s "$d/threads.safetensors.train" "$d/procs.safetensors.train" || { echo "FAIL: -np $n $algo: optimizer state differs"; fail=1; }
    [ "$(grep -c '^epoch ' "$d/procs.log")" -eq 2 ] || { echo "FAIL: -np $n: rank 0 alone prints the 2 epoch lines"; cat "$d/procs.log"; fail=1; }
    [ "$(grep -c '^dist: mpi, world '$n', rank' "$d/procs.log")" -eq $n ] || { echo "FAIL: -np $n: one dist line per rank"; fail=1; }
    echo "ok: -np $n $algo equals $n replicas in one process"
  done
done
# Three classes on crops with tiled validation: the processes train what the threads train.
cls=(--classes 3 --image-size 160x96 --crop-size 64 --width-divisor 16 --train-size 8 --val-size 2 --batch-size 2
     --epochs 1 --threads 1 --seed 3 --no-progress)
if "$train" --mode dp --devices cpu:0,cpu:1 "${cls[@]}" --dist none --checkpoint "$d/cls_threads.safetensors" \
     > "$d/cls_threads.log" 2>&1 &&
   timeout 300 "${mpi[@]}" -np 2 "$train" --mode dp "${cls[@]}" --checkpoint "$d/cls_procs.safetensors" \
     > "$d/cls_procs.log" 2>&1; then
  if cmp -s "$d/cls_threads.safetensors" "$d/cls_procs.safetensors" && grep -q "val_miou" "$d/cls_procs.log"; then
    echo "ok: -np 2 with three classes on crops equals 2 replicas in one process"
  else
    echo "FAIL: -np 2 with three classes: checkpoints differ"; fail=1
  fi
else
  echo "FAIL: three classes across processes"; cat "$d/cls_threads.log" "$d/cls_procs.log"; fail=1
fi
# A learning-rate schedule: every process steps at the rate its step index gives, as the threads
# do; with gradient clipping, each process clips the averaged gradients, as each thread does.
lr=(--lr-schedule cosine --warmup-steps 2 --min-lr 1e-5 --clip-grad-norm 0.05)
if "$train" --mode dp --devices cpu:0,cpu:1 "${common[@]}" "${lr[@]}" --dist none --checkpoint "$d/lr_threads.safetensors" \
     > "$d/lr_threads.log" 2>&1 &&
   timeout 300 "${mpi[@]}" -np 2 "$train" --mode dp "${common[@]}" "${lr[@]}" --checkpoint "$d/lr_procs.safetensors" \
     > "$d/lr_procs.log" 2>&1; then
  if cmp -s "$d/lr_threads.safetensors" "$d/lr_procs.safetensors" &&
     cmp -s "$d/lr_threads.safetensors.train" "$d/lr_procs.safetensors.train"; then
    echo "ok: -np 2 with a cosine schedule and gradient clipping equals 2 replicas in one process"
  else
    echo "FAIL: -np 2 with a cosine schedule and gradient clipping: checkpoints differ"; fail=1
  fi
else
  echo "FAIL: the cosine schedule runs"; cat "$d/lr_threads.log" "$d/lr_procs.log"; fail=1
fi
# Early stopping and the best checkpoint: every process ends after the same epoch, normally,
# and rank 0's best file is the one the threads write.
es=(--width-divisor 16 --image-size 64 --train-size 12 --val-size 4 --batch-size 2 --epochs 5
    --threads 1 --seed 3 --no-progress --early-stop 1 --early-stop-delta 1)
if "$train" --mode dp --devices cpu:0,cpu:1 "${es[@]}" --dist none \
     --save-best "$d/best_threads.safetensors" > "$d/es_threads.log" 2>&1 &&
   timeout 300 "${mpi[@]}" -np 2 "$train" --mode dp "${es[@]}" \
     --save-best "$d/best_procs.safetensors" > "$d/es_procs.log" 2>&1; then
  if grep -q '^early stop after epoch 2 of 5' "$d/es_procs.log" && [ "$(grep -c '^epoch ' "$d/es_procs.log")" -eq 2 ] &&
     cmp -s "$d/best_threads.safetensors" "$d/best_procs.safetensors" &&
     cmp -s "$d/best_threads.safetensors.train" "$d/best_procs.safetensors.train"; then
    echo "ok: -np 2 stops early after the epoch the threads stop after, with the same best checkpoint"
  else
    echo "FAIL: -np 2 early stopping:"; cat "$d/es_threads.log" "$d/es_procs.log"; fail=1
  fi
else
  echo "FAIL: early stopping runs"; cat "$d/es_threads.log" "$d/es_procs.log"; fail=1
fi
# --allreduce mpi: the MPI library's MPI_Allreduce; its additions need not be ours in order,
# so the run is held to the ring's printed losses and validation scores (4 decimals).
"$train" --mode dp --devices cpu:0,cpu:1 --allreduce ring "${common[@]}" --dist none > "$d/ring.log" 2>&1 \
  || { echo "FAIL: ring run"; fail=1; }
timeout 300 "${mpi[@]}" -np 2 "$train" --mode dp --allreduce mpi "${common[@]}" > "$d/native.log" 2>&1 \
  || { echo "FAIL: mpirun --allreduce mpi"; cat "$d/native.log"; fail=1; }
epochs() { grep '^epoch' "$1" | sed -E 's/time [0-9.]+s//; s/[0-9.]+ img\/s.*//'; }
if [ -n "$(epochs "$d/native.log")" ] && [ "$(epochs "$d/ring.log")" = "$(epochs "$d/native.log")" ]; then
  echo "ok: --allreduce mpi gives the ring's losses and scores"
else
  echo "FAIL: --allreduce mpi differs from the ring:"; epochs "$d/ring.log"; epochs "$d/native.log"; fail=1
fi
msg=$("$train" --mode dp --devices cpu:0,cpu:1 --allreduce mpi "${common[@]}" --dist none 2>&1) \
  && { echo "FAIL: --allreduce mpi in one process accepted"; fail=1; }
grep -q "several processes" <<<"$msg" || { echo "FAIL: --allreduce mpi message: $msg"; fail=1; }
# Gradients in bfloat16 (--allreduce-precision bf16): the processes' ring rounds each partial
# sum at the same places as the threads' ring, so the bytes still agree.
for algo in ring ps; do
  "$train" --mode dp --devices cpu:0,cpu:1,cpu:2 --allreduce $algo --allreduce-precision bf16 "${common[@]}" \
    --dist none --checkpoint "$d/threads.safetensors" > "$d/threads.log" 2>&1 || { echo "FAIL: in-process bf16 $algo"; cat "$d/threads.log"; exit 1; }
  grep -q "$algo bf16 all-reduce" "$d/threads.log" || { echo "FAIL: bf16 $algo: the strategy line does not say bf16"; cat "$d/threads.log"; fail=1; }
  timeout 300 "${mpi[@]}" -np 3 "$train" --mode dp --allreduce $algo --allreduce-precision bf16 "${common[@]}" \
    --checkpoint "$d/procs.safetensors" > "$d/procs.log" 2>&1 || { echo "FAIL: mpirun -np 3 bf16 $algo"; cat "$d/procs.log"; fail=1; continue; }
  cmp -s "$d/threads.safetensors" "$d/procs.safetensors" || { echo "FAIL: -np 3 bf16 $algo: model differs"; fail=1; }
  cmp -s "$d/threads.safetensors.train" "$d/procs.safetensors.train" || { echo "FAIL: -np 3 bf16 $algo: optimizer state differs"; fail=1; }
  echo "ok: -np 3 $algo with bf16 gradients equals 3 replicas in one process"
done
# ... and differ from the full-precision run: the flag is not ignored.
"$train" --mode dp --devices cpu:0,cpu:1,cpu:2 --allreduce ps "${common[@]}" --dist none \
  --checkpoint "$d/full.safetensors" > "$d/full.log" 2>&1 || { echo "FAIL: in-process full ps"; cat "$d/full.log"; exit 1; }
cmp -s "$d/threads.safetensors" "$d/full.safetensors" && { echo "FAIL: bf16 gradients changed nothing"; fail=1; }
# Rank 1 alone resumes from a file that does not exist: its error ends both ranks.
timeout 120 "${mpi[@]}" -np 2 bash -c 'extra=(); [ "$OMPI_COMM_WORLD_RANK" = 1 ] && extra=(--resume '"$d"'/nope.safetensors);
  exec "$0" --mode dp "$@" "${extra[@]}"' "$train" "${common[@]}" > "$d/fail.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { echo "FAIL: a failing rank gave rc $rc"; cat "$d/fail.log"; fail=1; }
grep -q "nope.safetensors" "$d/fail.log" || { echo "FAIL: the failing rank's message is missing"; cat "$d/fail.log"; fail=1; }
# Rank 1 stops (SIGSTOP) in the middle of training: rank 0's collective times out after 10 s
# and ends the job with a message naming rank 0 and the collective, instead of hanging (10 s:
# the timeout holds for every call before epoch 1 too, where a loaded machine may be slow).
long=(--width-divisor 16 --image-size 64 --train-size 12 --val-size 4 --batch-size 2 --epochs 500
      --threads 1 --no-progress)
"${mpi[@]}" -np 2 "$train" --mode dp "${long[@]}" --collective-timeout 10 --seed 77 \
  > "$d/stop.log" 2>&1 &
job=$!
for _ in $(seq 300); do grep -q '^epoch 1/' "$d/stop.log" && break; sleep 0.1; done
victim=""
for p in $(pgrep -f -- "--seed 77"); do
  tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1' && victim=$p
done
if [ -z "$victim" ]; then
  echo "FAIL: rank 1 not found"; cat "$d/stop.log"; kill $job; fail=1
else
  kill -STOP "$victim"
  for _ in $(seq 600); do kill -0 $job 2>/dev/null || break; sleep 0.1; done
  if kill -0 $job 2>/dev/null; then
    echo "FAIL: the job still runs 60 s after rank 1 stopped"; kill -KILL "$victim" $job; fail=1
  else
    wait $job; rc=$?
    [ $rc -ne 0 ] || { echo "FAIL: a timed-out job exited 0"; fail=1; }
    if grep -q "collective timed out: rank 0 waited 10 s in" "$d/stop.log"; then
      echo "ok: a stopped rank ends the job: $(grep -m1 'timed out' "$d/stop.log")"
    else
      echo "FAIL: no timeout message"; cat "$d/stop.log"; fail=1
    fi
  fi
  kill -KILL "$victim" 2>/dev/null
fi
exit $fail
