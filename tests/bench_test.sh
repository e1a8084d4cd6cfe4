#!/usr/bin/env bash
# unet_bench on 2 CPU devices at a tiny size writes both tables and the files, every cell filled.
set -u
bin="$1"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail=0
if ! "$bin" --devices cpu:0,cpu:1 --image-size 64 --width-divisor 16 --batch-size 2 --epochs 2 --plot \
     --split-sizes 1,2,4 --out "$out" > "$out/stdout.txt" 2>&1; then
  echo "FAIL: unet_bench exited non-zero"; cat "$out/stdout.txt"; exit 1
fi
for f in table1.md table1.csv table2.md table2.csv bench.json; do
  [ -s "$out/$f" ] || { echo "FAIL: $f missing or empty"; fail=1; }
done
# Table 1: 10 cuts x 3 split sizes, a number in every cell, one bold best.
rows=$(grep -c '^| encoder\|^| decoder' "$out/table1.md")
[ "$rows" -eq 10 ] || { echo "FAIL: table1 has $rows cut rows"; fail=1; }
if grep -E '^\| (encoder|decoder)' "$out/table1.md" | grep -qE '\|\s*\|'; then echo "FAIL: empty cell in table1"; fail=1; fi
[ "$(grep -o '\*\*' "$out/table1.md" | wc -l)" -eq 2 ] || { echo "FAIL: table1 needs exactly one bold cell"; fail=1; }
# Each cell measured and predicted (model_step_s).
[ "$(tail -n +2 "$out/table1.csv" | grep -cE '^[a-z.0-9]+,[0-9]+,[0-9.e-]+,[0-9.e-]+$')" -eq 30 ] || { echo "FAIL: table1.csv rows"; fail=1; }
# Table 2: single, DP ring, DP ps, MP best, each with mean, std, speedup, the model's epoch and
# speedup, and either "within 15 %" or how far off the model is and what it does not see.
for m in "single" "DP ring" "DP ps" "MP best"; do
  grep -qE "^\| $m.*\| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| (within 15 %|model [+-][0-9]+ %: [a-z].*) \|$" "$out/table2.md" ||
    { echo "FAIL: table2 row '$m'"; fail=1; }
done
# The model's inputs are printed, each measured: the profile's micro-batch sizes, the shared
# slowdown, the optimizer, the DP per-step costs and the links.
for w in "blocks at micro-batch 1, 2" "shared slowdown with 2 devices" "optimizer step" "BN buffers broadcast" "ring all-reduce" "loader:"; do
  grep -q "$w" "$out/stdout.txt" || { echo "FAIL: model input '$w' not printed"; fail=1; }
done
grep -q "The model's best plan: after" "$out/stdout.txt" || { echo "FAIL: the model's best plan not printed"; fail=1; }
[ "$(tail -n +2 "$out/table2.csv" | wc -l)" -eq 4 ] || { echo "FAIL: table2.csv rows"; fail=1; }
grep -q '"machine"' "$out/bench.json" && grep -q '"image_size": 64' "$out/bench.json" || { echo "FAIL: bench.json header"; fail=1; }
if command -v python3 >/dev/null; then
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert len(d['table1'])==30 and len(d['table2'])==4; assert all(r['model_epoch_s']>0 and 'model_note' in r for r in d['table2']); assert all(c['model_step_s']>0 for c in d['table1'])" \
    "$out/bench.json" || { echo "FAIL: bench.json"; fail=1; }
fi
# --plot: the PNGs when matplotlib is there, else a line saying why not (the run succeeds).
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  for f in table1.png table2.png; do [ -s "$out/$f" ] || { echo "FAIL: --plot did not draw $f"; fail=1; }; done
else
  grep -q "plots not drawn" "$out/stdout.txt" || { echo "FAIL: --plot without matplotlib said nothing"; fail=1; }
fi
[ $fail -eq 0 ] && echo "ok: both tables and the files, every cell filled"
# Under mpirun: the same across 2 processes (DP ring, ps and the transport's own; MP one stage
# per process), each row with the model's prediction, from process 0 alone.
if command -v mpirun >/dev/null && ldd "$bin" | grep -q libmpi; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  env "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" timeout 300 mpirun --oversubscribe --bind-to none -np 2 \
    "$bin" --width-divisor 16 --image-size 64 --batch-size 2 --epochs 1 --warmup 1 --split-sizes 2 \
    --out "$out/procs" > "$out/procs.txt" 2>&1 || { echo "FAIL: unet_bench under mpirun"; cat "$out/procs.txt"; fail=1; }
  for m in "single \(process 0 alone\)" "DP ring \(2 processes" "DP ps \(2 processes" "DP MPI's own" "MP 2 processes \(after"; do
    [ "$(grep -cE "^\| $m.*\| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| (within 15 %|model [+-][0-9]+ %: [a-z].*) \|$" "$out/procs.txt")" -eq 1 ] ||
      { echo "FAIL: across processes, row '$m' (once, from process 0)"; cat "$out/procs.txt"; fail=1; }
  done
  [ "$(tail -n +2 "$out/procs/processes.csv" | wc -l)" -eq 5 ] || { echo "FAIL: processes.csv rows"; fail=1; }
  [ $fail -eq 0 ] && echo "ok: unet_bench across 2 processes"
else
  echo "note: unet_bench across processes not checked (no mpirun or no MPI build)"
fi
exit $fail
