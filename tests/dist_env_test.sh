#!/usr/bin/env bash
# Data parallelism across processes started with torchrun's variables alone (RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), no MPI launcher: the Gloo transport,
# the ranks meeting at MASTER_ADDR:MASTER_PORT. Two processes, ring and ps, write the same
# checkpoint bytes as the same run with the replicas as threads of one process; Gloo's own
# all-reduce gives the ring's losses; a rank that fails ends both ranks, with its message; a
# rank that never arrives ends the other at the rendezvous; a rank stopped mid-training ends the
# other at the collective timeout. The pipeline with one stage per process over Gloo writes the
# in-process pipeline's bytes too. Every run is bounded (timeout).
set -u
train="$1"
if ! ldd "$train" | grep -q libgloo; then echo "SKIPPED: built without Gloo (libgloo-dev)"; exit 77; fi
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail=0
common=(--width-divisor 16 --image-size 64 --train-size 12 --val-size 4 --batch-size 2 --epochs 2
        --threads 1 --seed 3 --no-progress)

# A TCP port nobody listens on now (the kernel's pick; a loop over a range without python3).
free_port() {
  if command -v python3 >/dev/null; then
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
  else
    for p in $(shuf -i 20000-60000 -n 50); do
      (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
    done
  fi
}
# start_rank RANK WORLD PORT LOG ARGS...: one rank in the background with torchrun's variables
# and no other launcher's (a test run inside an mpirun or SLURM job would otherwise take those).
start_rank() {
  local rank=$1 world=$2 port=$3 log=$4
  shift 4
  env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u SLURM_PROCID -u SLURM_NTASKS \
    RANK="$rank" WORLD_SIZE="$world" LOCAL_RANK="$rank" LOCAL_WORLD_SIZE="$world" \
    MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    timeout 300 "$train" --mode "${MODE:-dp}" "$@" > "$log" 2>&1 &
}
# run_pair NAME ARGS... (rank 1's extra arguments after --rank1): both ranks; their exit codes
# in rc0 and rc1, their output in $d/NAME.0.log and $d/NAME.1.log.
run_pair() {
  local name=$1
  shift
  local args=() extra=()
  while [ $# -gt 0 ] && [ "$1" != --rank1 ]; do args+=("$1"); shift; done
  [ $# -gt 0 ] && { shift; extra=("$@"); }
  local port
  port=$(free_port)
  start_rank 0 2 "$port" "$d/$name.0.log" "${args[@]}"
  local p0=$!
  start_rank 1 2 "$port" "$d/$name.1.log" "${args[@]}" "${extra[@]}"
  local p1=$!
  wait $p0; rc0=$?
  wait $p1; rc1=$?
}
epochs() { grep '^epoch' "$1" | sed -E 's/time [0-9.]+s//; s/[0-9.]+ img\/s.*//'; }

for algo in ring ps; do
  "$train" --mode dp --devices cpu:0,cpu:1 --allreduce $algo "${common[@]}" --dist none \
    --checkpoint "$d/threads.safetensors" > "$d/threads.$algo.log" 2>&1 \
    || { echo "FAIL: in-process $algo"; cat "$d/threads.$algo.log"; exit 1; }
  run_pair $algo --allreduce $algo "${common[@]}" --checkpoint "$d/procs.safetensors"
  if [ $rc0 -ne 0 ] || [ $rc1 -ne 0 ]; then
    echo "FAIL: torchrun-style $algo: rank 0 rc $rc0, rank 1 rc $rc1"; cat "$d/$algo.0.log" "$d/$algo.1.log"; fail=1; continue
  fi
  bad=0
  cmp -s "$d/threads.safetensors" "$d/procs.safetensors" || { echo "FAIL: $algo: model differs"; bad=1; }
  cmp -s "$d/threads.safetensors.train" "$d/procs.safetensors.train" || { echo "FAIL: $algo: optimizer state differs"; bad=1; }
  [ "$(grep -c '^epoch ' "$d/$algo.0.log")" -eq 2 ] && [ "$(grep -c '^epoch ' "$d/$algo.1.log")" -eq 0 ] \
    || { echo "FAIL: $algo: rank 0 alone prints the 2 epoch lines"; bad=1; }
  for r in 0 1; do
    [ "$(grep -c "^dist: torchrun, world 2, rank $r " "$d/$algo.$r.log")" -eq 1 ] \
      || { echo "FAIL: $algo: rank $r's one dist line"; cat "$d/$algo.$r.log"; bad=1; }
  done
  [ $bad -eq 0 ] && echo "ok: two torchrun-style processes ($algo) equal 2 replicas in one process"
  fail=$((fail | bad))
done

# --allreduce mpi is the transport's own all-reduce, here gloo::allreduce; its additions need
# not be ours in order, so the run is held to the ring's printed losses and validation scores
# (4 decimals), as the MPI test holds MPI_Allreduce.
run_pair native --allreduce mpi "${common[@]}"
if [ $rc0 -ne 0 ] || [ $rc1 -ne 0 ]; then
  echo "FAIL: --allreduce mpi: rank 0 rc $rc0, rank 1 rc $rc1"; cat "$d/native.0.log" "$d/native.1.log"; fail=1
elif [ -n "$(epochs "$d/native.0.log")" ] && [ "$(epochs "$d/threads.ring.log")" = "$(epochs "$d/native.0.log")" ]; then
  echo "ok: --allreduce mpi (Gloo's all-reduce) gives the ring's losses and scores"
else
  echo "FAIL: --allreduce mpi differs from the ring:"; epochs "$d/threads.ring.log"; epochs "$d/native.0.log"; fail=1
fi

# Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True) MASTER_PORT is torchrun's
# own: a listener holds it here, and the ranks meet at the next port.
if command -v python3 >/dev/null; then
  port=$(free_port)
  python3 -c 'import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); time.sleep(300)' "$port" &
  holder=$!
  # Until the holder listens (else the ranks would meet at the next port without it held).
  for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
  for r in 0 1; do
    TORCHELASTIC_USE_AGENT_STORE=True start_rank $r 2 "$port" "$d/agent.$r.log" "${common[@]}"
    pids[$r]=$!
  done
  wait ${pids[0]}; rc0=$?
  wait ${pids[1]}; rc1=$?
  kill $holder 2>/dev/null; wait $holder 2>/dev/null
  if [ $rc0 -ne 0 ] || [ $rc1 -ne 0 ]; then
    echo "FAIL: with torchrun's agent store: rank 0 rc $rc0, rank 1 rc $rc1"; cat "$d/agent.0.log" "$d/agent.1.log"; fail=1
  else
    echo "ok: with torchrun's agent store at MASTER_PORT the ranks meet at the next port"
  fi
fi

# Rank 1 alone resumes from a file that does not exist: its error ends both ranks, non-zero and
# before the timeout (124).
run_pair resume "${common[@]}" --rank1 --resume "$d/nonexistent.safetensors"
if [ $rc0 -eq 0 ] || [ $rc0 -eq 124 ] || [ $rc1 -eq 0 ] || [ $rc1 -eq 124 ]; then
  echo "FAIL: a failing rank gave rank 0 rc $rc0, rank 1 rc $rc1"; cat "$d/resume.0.log" "$d/resume.1.log"; fail=1
elif ! grep -q "nonexistent.safetensors" "$d/resume.1.log"; then
  echo "FAIL: the failing rank's message is missing"; cat "$d/resume.1.log"; fail=1
else
  echo "ok: a failing rank ends both: $(grep -m1 'error' "$d/resume.0.log")"
fi

# Rank 0 alone in a world of 2: the rendezvous waits --collective-timeout (3 s) for rank 1,
# then ends rank 0 with how many ranks arrived.
port=$(free_port)
start_rank 0 2 "$port" "$d/alone.log" "${common[@]}" --collective-timeout 3
wait $!; rc=$?
if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then
  echo "FAIL: a rank alone gave rc $rc"; cat "$d/alone.log"; fail=1
elif ! grep -q "rendezvous at 127.0.0.1:$port: only 1 of 2 ranks arrived within 3 s" "$d/alone.log"; then
  echo "FAIL: no rendezvous message"; cat "$d/alone.log"; fail=1
else
  echo "ok: a rank that never arrives: $(grep -m1 'rendezvous at' "$d/alone.log")"
fi

# Rank 1 stops (SIGSTOP) in the middle of training: rank 0's call times out after 10 s and ends
# it with a message naming rank 0 and the call; rank 1, let go, finds rank 0 gone and ends too.
# (The timeout holds from the start, rendezvous included: 10 s, so that a loaded machine's
# start-up skew between the two ranks cannot fire it early.)
long=(--width-divisor 16 --image-size 64 --train-size 12 --val-size 4 --batch-size 2 --epochs 500
      --threads 1 --no-progress --collective-timeout 10)
port=$(free_port)
start_rank 0 2 "$port" "$d/stop.0.log" "${long[@]}"
p0=$!
start_rank 1 2 "$port" "$d/stop.1.log" "${long[@]}"
p1=$!
for _ in $(seq 600); do grep -q '^epoch 1/' "$d/stop.0.log" && break; sleep 0.1; done
victim=$(pgrep -P $p1)  # unet_train, under timeout
if [ -z "$victim" ] || ! grep -q '^epoch 1/' "$d/stop.0.log"; then
  echo "FAIL: the long run did not start"; cat "$d/stop.0.log" "$d/stop.1.log"; kill $p0 $p1; fail=1
else
  kill -STOP "$victim"
  wait $p0; rc0=$?
  kill -CONT "$victim"
  wait $p1; rc1=$?
  if [ $rc0 -eq 0 ] || [ $rc0 -eq 124 ] || [ $rc1 -eq 0 ] || [ $rc1 -eq 124 ]; then
    echo "FAIL: a stopped rank gave rank 0 rc $rc0, rank 1 rc $rc1"; cat "$d/stop.0.log" "$d/stop.1.log"; fail=1
  elif ! grep -q "collective timed out: rank 0 waited 10 s in" "$d/stop.0.log"; then
    echo "FAIL: no timeout message"; cat "$d/stop.0.log"; fail=1
  else
    echo "ok: a stopped rank ends the job: $(grep -m1 'timed out' "$d/stop.0.log")"
  fi
fi

# No MASTER_PORT: one clear line, before any waiting.
msg=$(env -u OMPI_COMM_WORLD_RANK -u SLURM_PROCID -u MASTER_ADDR -u MASTER_PORT RANK=0 WORLD_SIZE=2 \
      timeout 60 "$train" --mode dp "${common[@]}" 2>&1) && { echo "FAIL: a start without MASTER_ADDR/MASTER_PORT accepted"; fail=1; }
grep -q "MASTER_ADDR:MASTER_PORT" <<<"$msg" || { echo "FAIL: missing MASTER_ADDR message: $msg"; fail=1; }
# The pipeline, one stage per process, over Gloo: the in-process pipeline's bytes.
mp=(--mode mp --split layer3 --batch-size 4 --split-size 2 --width-divisor 16 --image-size 64 --train-size 12
    --val-size 4 --epochs 2 --threads 1 --seed 3 --no-progress)
"$train" "${mp[@]}" --devices cpu:0,cpu:1 --dist none --checkpoint "$d/mp_threads.safetensors" > "$d/mp_threads.log" 2>&1 \
  || { echo "FAIL: in-process pipeline"; cat "$d/mp_threads.log"; fail=1; }
MODE=mp run_pair mp "${mp[@]:2}" --checkpoint "$d/mp_procs.safetensors"
if [ $rc0 = 0 ] && [ $rc1 = 0 ] && cmp -s "$d/mp_threads.safetensors" "$d/mp_procs.safetensors" \
   && cmp -s "$d/mp_threads.safetensors.train" "$d/mp_procs.safetensors.train" \
   && grep -q "model parallel across processes, 2 stages over Gloo" "$d/mp.0.log"; then
  echo "ok: the pipeline across 2 torchrun-style processes equals the in-process pipeline"
else
  echo "FAIL: pipeline over Gloo (rc $rc0/$rc1)"; cat "$d/mp.0.log" "$d/mp.1.log"; fail=1
fi
exit $fail
