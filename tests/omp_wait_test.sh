#!/usr/bin/env bash
# OpenMP threads wait with 1,000 spins unless the user says otherwise: the running program's
# environment, as libgomp read it when it loaded (/proc/PID/environ is the environment the
# process was last executed with), holds GOMP_SPINCOUNT=1000, and the log line says so; a
# user's GOMP_SPINCOUNT or OMP_WAIT_POLICY is kept. The first run is killed once read, so it
# asks for more epochs than it can finish (a finished process has no environ left to read).
set -u
bin="$1"
args=(--epochs 100000 --image-size 64 --train-size 8 --val-size 4 --width-divisor 16 --batch-size 4 --no-progress)
out=$(mktemp)
trap 'rm -f "$out"; kill "$pid" 2>/dev/null' EXIT
fail=0
env -u GOMP_SPINCOUNT -u OMP_WAIT_POLICY "$bin" "${args[@]}" >"$out" 2>&1 &
pid=$!
for _ in $(seq 100); do grep -q '^epoch 1/' "$out" && break; sleep 0.2; done
if ! grep -q '^epoch 1/' "$out"; then echo "FAIL: no epoch line"; cat "$out"; exit 1; fi
tr '\0' '\n' <"/proc/$pid/environ" | grep -qx 'GOMP_SPINCOUNT=1000' \
  || { echo "FAIL: the running process has no GOMP_SPINCOUNT=1000"; fail=1; }
kill "$pid"; wait "$pid" 2>/dev/null
grep '^cpu: ' "$out"
grep -q '^cpu: .*, OpenMP spin 1000$' "$out" || { echo "FAIL: log line"; fail=1; }
line=$(GOMP_SPINCOUNT=20000 "$bin" --epochs 1 "${args[@]:2}" | grep '^cpu: ')
echo "$line"
grep -q 'OpenMP spin 20000 (GOMP_SPINCOUNT)$' <<<"$line" || { echo "FAIL: GOMP_SPINCOUNT not kept"; fail=1; }
line=$(env -u GOMP_SPINCOUNT OMP_WAIT_POLICY=passive "$bin" --epochs 1 "${args[@]:2}" | grep '^cpu: ')
echo "$line"
grep -q 'OMP_WAIT_POLICY=passive$' <<<"$line" || { echo "FAIL: OMP_WAIT_POLICY not kept"; fail=1; }
exit $fail
