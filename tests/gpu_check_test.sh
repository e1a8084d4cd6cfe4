#!/usr/bin/env bash
# tools/gpu_check.sh keeps its deadline and returns what it did when it is cut off: run with its
# steps replaced by sleeps (GPU_CHECK_FAKE_STEPS), no GPU and no build, in a few seconds.
#   1. an 8 s deadline: steps that fit run, one that needs more is "skipped: deadline", one that
#      needs a GPU is "skipped: no GPU", a step that would run past the deadline is stopped at
#      it, and the whole run ends by the deadline;
#   2. SIGTERM in the middle of a step: the rows done so far, the step marked interrupted, a last
#      line saying so, the logs packed, the step's processes gone, the steps after it not run;
#   3. SIGKILL (no trap runs): the rows and the logs of the steps finished before it are there;
#   4. the comparison with PyTorch from figures the fake steps tell: a cell with both figures
#      has their ratio, a missing figure says why (no figure, skipped, not run, the step's
#      own reason); unetcu fp32 against the TF32 peak, unetcu bf16 NHWC and unetcu bf16 NHWC
#      graphs against the bf16 peak and against PyTorch bf16;
#   5. the real step list with stand-ins on PATH (nvidia-smi shows a GPU, cmake fails, a fake
#      Python answers as PyTorch's bench would): the steps in their order (the CUDA tests, then
#      per batch, 14 first, fp32, bf16 NHWC and bf16 NHWC CUDA graphs trainings before
#      PyTorch's eager step, then the rest), the PyTorch steps' figures reach the table under
#      the right names, the compile's failure and the missing build are said; with a Python
#      whose torch has no CUDA (--compare, the same training rows), "skipped: no PyTorch with
#      CUDA"; and --quick: the fp32 and bf16 NHWC batch-14 trainings, no graphs row, nothing
#      after them;
#   6. the real steps in a copy of the script whose CMake "builds" stand-ins: unet_train gets
#      --precision bf16 --memory-format nhwc in the bf16 rows and the profile row (there with
#      --profile and UNETCU_CUDA_SYNC=1, its row naming the five largest ops), and --cuda-graphs
#      besides in the graphs rows (nowhere else), their images/s reach the unetcu bf16 NHWC and bf16 NHWC
#      graphs columns (fraction of the bf16 peak, ratios against PyTorch bf16), and a bf16 or
#      graphs row that fails says why in its cell and stops none of the steps after it;
#   7. the header-only dependencies, looked for before anything runs: in a tree without .deps
#      the rehearsal (which takes them from .deps alone) stops at once, one line on stderr that
#      names the fix (tools/gpu_deps.sh, carry .deps), a non-zero exit, nothing configured and
#      nothing under $OUT; the same with .deps incomplete, and for a GPU run that finds them
#      neither in .deps nor on the system; with .deps complete the rehearsal runs its steps,
#      CMake pointed at .deps with /usr hidden;
#   and each time at most 8 files under $OUT (the device tool brings back no more).
set -u
script="$1"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export TMPDIR="$tmp"  # the script's work folder, left behind by SIGKILL
fail=0
bad() { echo "FAIL: $*"; fail=1; }
has() { grep -qF -- "$2" "$1" || bad "$(basename "$(dirname "$1")")/table.md lacks '$2'"; }
lacks() { ! grep -qF -- "$2" "$1" || bad "$(basename "$(dirname "$1")")/table.md has '$2'"; }
few_files() {
  local n
  n=$(find "$1" -type f | wc -l)
  [ "$n" -le 8 ] || bad "$n files under $1 (at most 8 come back)"
}
in_archive() {  # dir, log file names
  local d=$1
  shift
  [ -s "$d/gpu_check_logs.tar.gz" ] || { bad "no log archive in $d"; return; }
  local list
  list=$(tar tzf "$d/gpu_check_logs.tar.gz") || { bad "unreadable archive in $d"; return; }
  for f; do grep -qx "logs/$f" <<< "$list" || bad "logs/$f not in the archive of $d"; done
}
now() { date +%s%N; }
steps_of() {  # a table.md's step names, comma-separated, in the order of their rows
  sed -n '/^| step | result | s |$/,/^$/p' "$1" | sed -n '3,$p' | grep '^| ' | cut -d'|' -f2 |
    sed 's/^ //; s/ $//' | paste -sd,
}
running() {  # a zombie is dead: one left to an init that reaps late counts as ended
  [ -r "/proc/$1/stat" ] && ! sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | grep -q '^Z'
}
# The header-only dependencies the script needs before its real steps (what tools/gpu_deps.sh
# copies into .deps/usr), as empty files under a prefix: the runs of the real steps find them
# there, whether or not this machine has the Debian packages.
DEPS_FILES="share/cmake/CLI11/CLI11Config.cmake include/CLI/CLI.hpp lib/cmake/doctest/doctestConfig.cmake
  include/doctest/doctest.h share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake include/nlohmann/json.hpp
  include/stb/stb_image.h"
deps_in() {  # prefix: the files in it
  local f
  for f in $DEPS_FILES; do mkdir -p "$1/$(dirname "$f")" && : > "$1/$f"; done
}
deps_in "$tmp/prefix"
export GPU_CHECK_SYSTEM_PREFIXES="$tmp/prefix"

# ---- 1. the deadline ------------------------------------------------------------------------
# 8 s: on a loaded machine the script has taken 1.5 s to reach its first step, which left a
# 3 s deadline too little for "long" (needs 1 s) to start at all. The end is checked against
# the deadline with room for such a machine (the step's stop, the last row, the logs packed).
deadline=8
d="$tmp/deadline"
t0=$(now)
GPU_CHECK_RESERVE=0 GPU_CHECK_FAKE_STEPS="first:0:0.2 second:0:0.2 big:30:0 needs-gpu:0:0:gpu last:0:0.1 long:1:30 after:1:0" \
  "$script" --deadline "$deadline" --out "$d" > "$tmp/deadline.out" 2>&1
rc=$?
ms=$((($(now) - t0) / 1000000))
t="$d/table.md"
if [ -f "$t" ]; then
  has "$t" "| first | ok: slept 0.2 s |"
  has "$t" "| second | ok: slept 0.2 s |"
  has "$t" "| big | skipped: deadline"
  has "$t" "| needs-gpu | skipped: no GPU |"
  has "$t" "| last | ok: slept 0.1 s |"
  has "$t" "| long | FAILED: stopped at its limit"
  has "$t" "| after | skipped: deadline"
  has "$t" "ended: finished"
  lacks "$t" "needs-gpu | ok"
  # The rows are in the order of the steps.
  [ "$(grep -oE '^\| [a-z-]+ \|' "$t" | tr -d '| ' | paste -sd,)" = "step,first,second,big,needs-gpu,last,long,after" ] ||
    bad "rows out of order: $(grep -oE '^\| [a-z-]+ \|' "$t" | tr -d '| ' | paste -sd,)"
else
  bad "no table.md after the deadline run"
fi
[ "$rc" -ne 0 ] || bad "a run with a FAILED step exited 0"
# Well short of "long"'s 30 s: it was stopped at the deadline (slack for a loaded machine).
[ "$ms" -lt $((deadline * 1000 + 10000)) ] || bad "a $deadline s deadline took $ms ms"
in_archive "$d" 01-first.log 02-second.log 05-last.log 06-long.log
few_files "$d"

# ---- 2. SIGTERM mid-step --------------------------------------------------------------------
d="$tmp/term"
GPU_CHECK_FAKE_STEPS="a:0:0.1 b:0:0.1 slow:0:30 after:0:0.1" "$script" --deadline 60 --out "$d" > "$tmp/term.out" 2>&1 &
pid=$!
# The step runs once its log names its sleep (waits on the success path only: generous).
for _ in $(seq 300); do grep -qs '^sleep pid' "$tmp"/gpu_check.*/logs/03-slow.log && break; sleep 0.1; done
t0=$(now)
kill -TERM "$pid"
wait "$pid"
rc=$?
ms=$((($(now) - t0) / 1000000))
t="$d/table.md"
if [ -f "$t" ]; then
  has "$t" "| a | ok: slept 0.1 s |"
  has "$t" "| b | ok: slept 0.1 s |"
  has "$t" "| slow | interrupted (killed by TERM)"
  has "$t" "ended: killed by TERM"
  lacks "$t" "| after |"
else
  bad "no table.md after SIGTERM"
fi
[ "$rc" -ne 0 ] || bad "a run killed by TERM exited 0"
[ "$ms" -lt 15000 ] || bad "the run took $ms ms to end after TERM"  # not the step's 30 s
in_archive "$d" 01-a.log 02-b.log 03-slow.log
sleeper=$(tar xzOf "$d/gpu_check_logs.tar.gz" logs/03-slow.log 2>/dev/null | sed -n 's/^sleep pid //p')
if [ -z "$sleeper" ]; then bad "the interrupted step's log is empty"
elif running "$sleeper"; then bad "the interrupted step's sleep ($sleeper) still runs"; kill "$sleeper"; fi
few_files "$d"

# ---- 3. SIGKILL mid-step: no trap, but every finished step was already recorded --------------
d="$tmp/kill"
GPU_CHECK_FAKE_STEPS="a:0:0.1 b:0:0.1 slow:0:30 after:0:0.1" "$script" --deadline 60 --out "$d" > "$tmp/kill.out" 2>&1 &
pid=$!
for _ in $(seq 300); do grep -q '^-> slow' "$tmp/kill.out" 2>/dev/null && break; sleep 0.1; done
kill -KILL "$pid"
wait "$pid" 2>/dev/null
# No trap ran: the step's sleep is left behind; end it once it has named itself.
for _ in $(seq 300); do grep -qs '^sleep pid' "$tmp"/gpu_check.*/logs/03-slow.log && break; sleep 0.1; done
orphan=$(sed -n 's/^sleep pid //p' "$tmp"/gpu_check.*/logs/03-slow.log 2>/dev/null | head -1)
[ -n "$orphan" ] && kill "$orphan" 2>/dev/null
t="$d/table.md"
if [ -f "$t" ]; then
  has "$t" "| a | ok: slept 0.1 s |"
  has "$t" "| b | ok: slept 0.1 s |"
  lacks "$t" "| after |"
else
  bad "no table.md after SIGKILL"
fi
in_archive "$d" 01-a.log 02-b.log
few_files "$d"

# ---- 4. the comparison table from faked figures ---------------------------------------------
d="$tmp/compare"
GPU_CHECK_RESERVE=0 GPU_CHECK_FAKE_STEPS="train14:0:0:-:IPS_unetcu_14=150 train14bf:0:0:-:IPS_unetcu_bf16_14=900 \
train14bfg:0:0:-:IPS_unetcu_bf16g_14=1200 \
pt14:0:0:-:IPS_fp32_14=100,FRAC_fp32_14=0.2,IPS_tf32_14=300,IPS_bf16_14=600,FRAC_bf16_14=0.05 \
ptc14:0:0:-:WHY_bf16_compile_14=compile-failed train64:0:0:-:unetcu_64 train64bf:0:0:gpu:unetcu_bf16_64 \
train64bfg:0:0:-:WHY_unetcu_bf16g_64=capture-refused \
pt64:99:0:-:IPS_fp32_64=50,tf32_64 ptc64:0:0:-:IPS_bf16_compile_64=500" \
  "$script" --deadline 30 --out "$d" > "$tmp/compare.out" 2>&1
t="$d/table.md"
if [ -f "$t" ]; then
  has "$t" "## unetcu against PyTorch"
  has "$t" "| batch | unetcu fp32 | unetcu bf16 NHWC | unetcu bf16 NHWC graphs | PyTorch fp32 | PyTorch TF32 | PyTorch bf16 AMP | PyTorch bf16 compiled | unetcu / fp32 | unetcu / TF32 | unetcu / bf16 AMP | unetcu / bf16 compiled | unetcu bf16 / bf16 AMP | unetcu bf16 / bf16 compiled | unetcu bf16 graphs / bf16 AMP | unetcu bf16 graphs / bf16 compiled |"
  has "$t" "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  has "$t" "unetcu bf16 NHWC graphs: the same with --cuda-graphs"
  # 150 img/s x 188 GFLOP = 28.2 TFLOP/s: 5.7% of the TF32 peak (494); 900 x 188 = 169.2 TFLOP/s:
  # 17.1% of the bf16 peak (989); 1200 x 188 = 225.6 TFLOP/s: 22.8% of it; the ratios
  # 150 / PyTorch, then 900 / PyTorch bf16 (600), then 1200 / PyTorch bf16.
  has "$t" "| 14 | 150 (5.7%) | 900 (17.1%) | 1200 (22.8%) | 100 (20.0%) | 300 | 600 (5.0%) | — (compile-failed) | 1.50 | 0.50 | 0.25 | — (no PyTorch figure) | 1.50 | — (no PyTorch figure) | 2.00 | — (no PyTorch figure) |"
  has "$t" "| 64 | — (no figure in the step's output) | — (skipped: no GPU) | — (capture-refused) | — (skipped: deadline ("
  has "$t" "| — (not run) | 500 | — (neither figure) | — (neither figure) | — (neither figure) | — (no unetcu figure) | — (neither figure) | — (no unetcu bf16 figure) | — (neither figure) | — (no unetcu bf16 graphs figure) |"
  lacks "$t" "| 64 | 50"
  has "$t" "ended: finished"
else
  bad "no table.md after the comparison run"
fi
few_files "$d"

# ---- 5. the real steps, with stand-ins for the GPU, CMake and PyTorch ------------------------
bin="$tmp/bin"
mkdir -p "$bin"
printf '#!/bin/sh\necho "NVIDIA H100 80GB HBM3, 81559 MiB, 580.0, 9.0"\n' > "$bin/nvidia-smi"
printf '#!/bin/sh\necho "fake cmake: no build here"\nexit 1\n' > "$bin/cmake"
# As tools/pytorch_reference.py bench --device cuda prints: per mode a JSON line and one for people.
cat > "$bin/torch-python" <<'EOF'
#!/usr/bin/env bash
if [ "$1" = -c ]; then
  case "$2" in *cuda.is_available*) echo "fake torch, CUDA" >&2; exit 0 ;; esac
  exec python3 "$@"
fi
batch=0 modes=""
while [ $# -gt 0 ]; do
  case "$1" in --batch) batch=$2; shift ;; --modes) modes=$2; shift ;; esac
  shift
done
for m in ${modes//,/ }; do
  case "$m" in
    fp32) ips=70 ;; tf32) ips=140 ;; bf16) ips=280 ;;
    *) echo "{\"device\": \"cuda\", \"mode\": \"$m\", \"batch\": $batch, \"torch\": \"fake\", \"status\": \"compile failed: fake compiler\"}"
       continue ;;
  esac
  echo "{\"device\": \"cuda\", \"mode\": \"$m\", \"batch\": $batch, \"torch\": \"fake\", \"status\": \"ok\", \"images_per_s\": $ips, \"fraction_of_peak\": 0.25, \"peak_mem_mib\": 1000.4}"
  echo "$m: $ips img/s"
done
EOF
printf '#!/bin/sh\nexit 1\n' > "$bin/no-cuda-python"
chmod +x "$bin"/*
d="$tmp/real"
PATH="$bin:$PATH" GPU_CHECK_PYTHON="$bin/torch-python" GPU_CHECK_RESERVE=0 \
  "$script" --deadline 200 --out "$d" > "$tmp/real.out" 2>&1
t="$d/table.md"
if [ -f "$t" ]; then
  has "$t" "| device facts | ok: NVIDIA H100 80GB HBM3, 81559 MiB"
  has "$t" "GPU: NVIDIA H100 80GB HBM3. images/s"
  has "$t" "| train single 512² batch 14 | skipped: no build |"
  has "$t" "| train single bf16 NHWC 512² batch 14 | skipped: no build |"
  has "$t" "| train single bf16 NHWC 512² batch 64 | skipped: no build |"
  has "$t" "| train single bf16 NHWC CUDA graphs 512² batch 14 | skipped: no build |"
  has "$t" "| train single bf16 NHWC CUDA graphs 512² batch 64 | skipped: no build |"
  has "$t" "| PyTorch eager 512² batch 14 (fp32, TF32, bf16 AMP) | ok: fp32 70.0 img/s (25.0% of peak), peak 1000 MiB; tf32 140.0"
  has "$t" "| PyTorch bf16 compiled 512² batch 64 | ok: bf16-compile compile failed: fake compiler |"
  has "$t" "PyTorch fake: tools/pytorch_reference.py"
  has "$t" "| 14 | — (skipped: no build) | — (skipped: no build) | — (skipped: no build) | 70.0 (25.0%) | 140.0 (25.0%) | 280.0 (25.0%) | — (compile failed: fake compiler) | — (no unetcu figure) | — (no unetcu figure) | — (no unetcu figure) | — (neither figure) | — (no unetcu bf16 figure) | — (neither figure) | — (no unetcu bf16 graphs figure) | — (neither figure) |"
  has "$t" "| 64 | — (skipped: no build) | — (skipped: no build) | — (skipped: no build) | 70.0 (25.0%) |"
  order=$(steps_of "$t")
  want="device facts,libraries,configure (sm_90, no OpenBLAS/oneDNN),build,CUDA tests (doctest),\
train single 512² batch 14,train single bf16 NHWC 512² batch 14,train single bf16 NHWC CUDA graphs 512² batch 14,\
PyTorch eager 512² batch 14 (fp32, TF32, bf16 AMP),\
train single 512² batch 64,train single bf16 NHWC 512² batch 64,train single bf16 NHWC CUDA graphs 512² batch 64,\
PyTorch eager 512² batch 64 (fp32, TF32, bf16 AMP),\
profile bf16 NHWC 512² batch 14 (UNETCU_CUDA_SYNC=1),\
train DP NCCL 1 rank 512² batch 14,train DP as 1 launched process (NCCL_COMM_ID) 512² batch 14,\
train MP 2 stages 1 GPU 512² batch 30 split 6,train MP 2 stages 1 GPU CUDA graphs 512² batch 30 split 6,\
train auto 1 GPU 512² batch 14 under 6G,\
unet_bench cuda:0 256² (20 pipelines),\
PyTorch bf16 compiled 512² batch 14,PyTorch bf16 compiled 512² batch 64"
  [ "$order" = "$want" ] || bad "full run's steps: $order"
else
  bad "no table.md after the run with stand-ins"
fi
few_files "$d"
d="$tmp/nocuda"
PATH="$bin:$PATH" GPU_CHECK_PYTHON="$bin/no-cuda-python" GPU_CHECK_RESERVE=0 \
  "$script" --compare --deadline 200 --out "$d" > "$tmp/nocuda.out" 2>&1
t="$d/table.md"
if [ -f "$t" ]; then
  has "$t" "| PyTorch eager 512² batch 14 (fp32, TF32, bf16 AMP) | skipped: no PyTorch with CUDA (tried: $bin/no-cuda-python) |"
  has "$t" "| PyTorch bf16 compiled 512² batch 64 | skipped: no PyTorch with CUDA |"
  has "$t" "| 64 | — (skipped: no build) | — (skipped: no build) | — (skipped: no build) | — (skipped: no PyTorch with CUDA) |"
  lacks "$t" "CUDA tests"
  order=$(steps_of "$t")
  want="device facts,libraries,configure (sm_90, no OpenBLAS/oneDNN),build,\
train single 512² batch 14,train single bf16 NHWC 512² batch 14,train single bf16 NHWC CUDA graphs 512² batch 14,\
PyTorch eager 512² batch 14 (fp32, TF32, bf16 AMP),\
train single 512² batch 64,train single bf16 NHWC 512² batch 64,train single bf16 NHWC CUDA graphs 512² batch 64,\
PyTorch eager 512² batch 64 (fp32, TF32, bf16 AMP),\
PyTorch bf16 compiled 512² batch 14,PyTorch bf16 compiled 512² batch 64"
  [ "$order" = "$want" ] || bad "--compare run's steps: $order"
else
  bad "no table.md after the run without PyTorch"
fi
d="$tmp/quick"
PATH="$bin:$PATH" GPU_CHECK_PYTHON="$bin/torch-python" GPU_CHECK_RESERVE=0 \
  "$script" --quick --deadline 200 --out "$d" > "$tmp/quick.out" 2>&1
t="$d/table.md"
if [ -f "$t" ]; then
  order=$(steps_of "$t")
  want="device facts,libraries,configure (sm_90, no OpenBLAS/oneDNN),build,CUDA tests (doctest),\
train single 512² batch 14,train single bf16 NHWC 512² batch 14"
  [ "$order" = "$want" ] || bad "--quick run's steps: $order"
  lacks "$t" "## unetcu against PyTorch"
  lacks "$t" "CUDA graphs"
else
  bad "no table.md after the --quick run"
fi
few_files "$d"

# ---- 6. the training steps with a stand-in build -------------------------------------------
tree="$tmp/tree"
mkdir -p "$tree/tools" "$tmp/bin2"
cp "$script" "$tree/tools/gpu_check.sh"
# CMake configures, and "builds" stand-ins for the three binaries into build-gpu/.
cat > "$tmp/bin2/cmake" <<'EOF2'
#!/usr/bin/env bash
[ "$1" = --build ] || { echo "-- unetcu: CUDA parts ON"; exit 0; }
mkdir -p "$2/tests"
printf '#!/bin/sh\necho "[doctest] test cases: 1 | 1 passed | 0 failed"\n' > "$2/tests/unetcu_cuda_tests"
printf '#!/bin/sh\necho "bench stand-in"\n' > "$2/unet_bench"
cat > "$2/unet_train" <<'EOF3'
#!/usr/bin/env bash
echo "$*" >> "$FAKE_TRAIN_ARGS"
bs=0 bf16=0 nhwc=0 graphs=0
while [ $# -gt 0 ]; do
  case "$1" in
    --profile)
      echo "profiled with UNETCU_CUDA_SYNC=${UNETCU_CUDA_SYNC:-unset}" >> "$FAKE_TRAIN_ARGS"
      printf 'epoch 1/1  time 1.0 s  val_dice 0.50  50 img/s\n\nprofile (9 ranges; trace in %s):\n' "$2"
      echo "| op | calls | total ms | mean ms | share | GFLOP/s | GB/s |"
      echo "|---|---|---|---|---|---|---|"
      for r in "conv2d.backward 50.0%" "conv2d 30.0%" "batch_norm_relu 10.0%" "adam 5.0%" "convert 3.0%" "add 2.0%"; do
        echo "| ${r% *} | 4 | 1.0 | 0.25 | ${r#* } | 1.00 | 1.00 |"
      done
      printf '\n| block (its ops) | calls | total ms | mean ms | share | GFLOP/s | GB/s |\n'
      exit 0 ;;
    --batch-size) bs=$2; shift ;;
    --precision) [ "$2" = bf16 ] && bf16=1; shift ;;
    --memory-format) [ "$2" = nhwc ] && nhwc=1; shift ;;
    --cuda-graphs) graphs=1 ;;
  esac
  shift
done
if [ "$bf16$nhwc$graphs" = 111 ]; then
  [ "$bs" = 64 ] && { echo "epoch 1/3  time 9.0 s  val_dice 0.10  90.0 img/s  peak_mem 60 MiB"; echo "CUDA graphs: capture failed"; exit 1; }
  r="380 390 410" m=40
elif [ "$bf16$nhwc" = 11 ]; then
  [ "$bs" = 64 ] && { echo "epoch 1/3  time 9.0 s  val_dice 0.10  90.0 img/s  peak_mem 60 MiB"; echo "CUDA error: out of memory"; exit 1; }
  r="250 300 300" m=50
else
  r="80 120 110" m=100
fi
e=0
for i in $r; do e=$((e + 1)); echo "epoch $e/3  time 1.0 s  val_dice 0.50  $i img/s  peak_mem $m MiB  loader 900 img/s"; done
EOF3
chmod +x "$2/tests/unetcu_cuda_tests" "$2/unet_bench" "$2/unet_train"
EOF2
chmod +x "$tmp/bin2/cmake"
d="$tmp/built"
PATH="$tmp/bin2:$bin:$PATH" GPU_CHECK_PYTHON="$bin/torch-python" GPU_CHECK_RESERVE=0 FAKE_TRAIN_ARGS="$tmp/train_args" \
  "$tree/tools/gpu_check.sh" --deadline 200 --out "$d" > "$tmp/built.out" 2>&1
t="$d/table.md"
if [ -f "$t" ]; then
  has "$t" "| build | ok: unetcu_cuda_tests, unet_train, unet_bench |"
  has "$t" "| train single 512² batch 14 | ok: 115.0 img/s, peak 100 MiB |"
  has "$t" "| train single bf16 NHWC 512² batch 14 | ok: 300.0 img/s, peak 50 MiB |"
  has "$t" "| train single bf16 NHWC 512² batch 64 | FAILED (exit 1): CUDA error: out of memory |"
  has "$t" "| train single bf16 NHWC CUDA graphs 512² batch 14 | ok: 400.0 img/s, peak 40 MiB |"
  has "$t" "| train single bf16 NHWC CUDA graphs 512² batch 64 | FAILED (exit 1): CUDA graphs: capture failed |"
  has "$t" "| PyTorch eager 512² batch 64 (fp32, TF32, bf16 AMP) | ok: fp32 70.0"
  has "$t" "| train MP 2 stages 1 GPU 512² batch 30 split 6 | ok: 115.0 img/s"
  has "$t" "| train MP 2 stages 1 GPU CUDA graphs 512² batch 30 split 6 | ok: 115.0 img/s"
  has "$t" "| profile bf16 NHWC 512² batch 14 (UNETCU_CUDA_SYNC=1) | ok: conv2d.backward 50.0%, conv2d 30.0%, batch_norm_relu 10.0%, adam 5.0%, convert 3.0% |"
  has "$t" "| PyTorch bf16 compiled 512² batch 64 | ok: bf16-compile compile failed: fake compiler |"
  # 115 x 188 / 494: 4.4%; 300 x 188 / 989: 5.7%; 400 (the median of 390 and 410) x 188 / 989:
  # 7.6%; 115 / 70, 140, 280; 300 / 280; 400 / 280.
  has "$t" "| 14 | 115.0 (4.4%) | 300.0 (5.7%) | 400.0 (7.6%) | 70.0 (25.0%) | 140.0 (25.0%) | 280.0 (25.0%) | — (compile failed: fake compiler) | 1.64 | 0.82 | 0.41 | — (no PyTorch figure) | 1.07 | — (no PyTorch figure) | 1.43 | — (no PyTorch figure) |"
  has "$t" "| 64 | 115.0 (4.4%) | — (FAILED (exit 1): CUDA error: out of memory) | — (FAILED (exit 1): CUDA graphs: capture failed) | 70.0 (25.0%) |"
  has "$t" "| 0.41 | — (no PyTorch figure) | — (no unetcu bf16 figure) | — (neither figure) | — (no unetcu bf16 graphs figure) | — (neither figure) |"
  has "$t" "ended: finished"
else
  bad "no table.md after the run with a stand-in build"
fi
for bs in 14 64; do
  grep -qx -- "--image-size 512 --batch-size $bs --train-size $((bs * 8)) --val-size $bs --epochs 3 --no-progress --device cuda:0 --precision bf16 --memory-format nhwc --cuda-graphs" \
    "$tmp/train_args" 2>/dev/null || bad "unet_train never ran the bf16 NHWC CUDA graphs row at batch $bs"
  grep -qx -- "--image-size 512 --batch-size $bs --train-size $((bs * 8)) --val-size $bs --epochs 3 --no-progress --device cuda:0 --precision bf16 --memory-format nhwc" \
    "$tmp/train_args" 2>/dev/null || bad "unet_train never ran the bf16 NHWC row at batch $bs"
  grep -qx -- "--image-size 512 --batch-size $bs --train-size $((bs * 8)) --val-size $bs --epochs 3 --no-progress --device cuda:0" \
    "$tmp/train_args" 2>/dev/null || bad "unet_train never ran the fp32 row at batch $bs"
done
grep -qE -- "^--image-size 512 --batch-size 14 --train-size 112 --val-size 14 --epochs 1 --no-progress --device cuda:0 --precision bf16 --memory-format nhwc --profile [^ ]+/profile.json$" \
  "$tmp/train_args" 2>/dev/null || bad "unet_train never ran the profile row"
grep -qx "profiled with UNETCU_CUDA_SYNC=1" "$tmp/train_args" 2>/dev/null || bad "the profile row ran without UNETCU_CUDA_SYNC=1"
[ "$(grep -c -- '--precision' "$tmp/train_args" 2>/dev/null)" = 5 ] || bad "--precision outside the four bf16 rows and the profile: $(cat "$tmp/train_args")"
grep -qx -- "--image-size 512 --batch-size 30 --train-size 240 --val-size 30 --epochs 3 --no-progress --mode mp --devices cuda:0,cuda:0 --split layer3 --split-size 6 --cuda-graphs" \
  "$tmp/train_args" 2>/dev/null || bad "unet_train never ran the MP CUDA graphs row"
[ "$(grep -c -- '--cuda-graphs' "$tmp/train_args" 2>/dev/null)" = 3 ] || bad "--cuda-graphs outside the three graphs rows: $(cat "$tmp/train_args")"
in_archive "$d" 07-train-single-bf16-NHWC-512-batch-14.log 08-train-single-bf16-NHWC-CUDA-graphs-512-batch-14.log \
  11-train-single-bf16-NHWC-512-batch-64.log 12-train-single-bf16-NHWC-CUDA-graphs-512-batch-64.log
few_files "$d"

# ---- 7. the header-only dependencies, before anything runs ------------------------------------
tree="$tmp/deps_tree"
mkdir -p "$tree/tools" "$tmp/bin3" "$tmp/empty_prefix"
cp "$script" "$tree/tools/gpu_check.sh"
# CMake that records its arguments and configures nothing (--version: the device facts).
# shellcheck disable=SC2016  # $1 and $* are the stand-in's
printf '#!/bin/sh\n[ "$1" = --version ] && { echo "cmake stand-in"; exit 0; }\necho "$*" >> "%s"\nexit 1\n' \
  "$tmp/deps_cmake_args" > "$tmp/bin3/cmake"
chmod +x "$tmp/bin3/cmake"
deps_stop() {  # name, what the one line on stderr says first, then the script's arguments
  local name=$1 says=$2 rc ms t0
  shift 2
  t0=$(now)
  PATH="$tmp/bin3:$PATH" "$tree/tools/gpu_check.sh" "$@" --out "$tmp/$name" > "$tmp/$name.out" 2> "$tmp/$name.err"
  rc=$?
  ms=$((($(now) - t0) / 1000000))
  [ "$rc" -ne 0 ] || bad "$name: exited 0"
  [ "$(wc -l < "$tmp/$name.err")" = 1 ] || bad "$name: not one line on stderr"
  grep -qF -- "gpu_check: the header-only dependencies are $says" "$tmp/$name.err" || bad "$name: stderr lacks '$says'"
  grep -qF -- 'run tools/gpu_deps.sh' "$tmp/$name.err" || bad "$name: stderr does not say to run tools/gpu_deps.sh"
  grep -qF -- 'carry .deps' "$tmp/$name.err" || bad "$name: stderr does not say to carry .deps"
  [ -s "$tmp/$name.out" ] && bad "$name: wrote to stdout: $(head -3 "$tmp/$name.out")"
  [ -e "$tmp/$name" ] && bad "$name: wrote under its --out"
  [ "$ms" -lt 5000 ] || bad "$name: took $ms ms to stop"
}
deps_stop deps_none "missing (no .deps): run" --rehearse
mkdir -p "$tree/.deps/usr/include/doctest" "$tree/.deps/usr/lib/cmake/doctest"
: > "$tree/.deps/usr/include/doctest/doctest.h"
: > "$tree/.deps/usr/lib/cmake/doctest/doctestConfig.cmake"
deps_stop deps_part "incomplete (.deps/usr lacks share/cmake/CLI11/CLI11Config.cmake, include/CLI/CLI.hpp, share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake, include/nlohmann/json.hpp, include/stb/stb_image.h): run" --rehearse
rm -rf "$tree/.deps"
GPU_CHECK_SYSTEM_PREFIXES="$tmp/empty_prefix" \
  deps_stop deps_gpu "missing (no .deps; not under $tmp/empty_prefix either): run" --deadline 540
[ -e "$tmp/deps_cmake_args" ] && bad "CMake ran without the dependencies: $(cat "$tmp/deps_cmake_args")"
deps_in "$tree/.deps/usr"
d="$tmp/deps_full"
PATH="$tmp/bin3:$PATH" GPU_CHECK_RESERVE=0 "$tree/tools/gpu_check.sh" --rehearse --out "$d" > "$d.out" 2> "$d.err"
grep -q '^gpu_check:' "$d.err" && bad "a complete .deps was refused: $(cat "$d.err")"
t="$d/table.md"
if [ -f "$t" ]; then
  has "$t" "| device facts | ok"
  has "$t" "| configure (sm_90, no OpenBLAS/oneDNN) | FAILED"
else
  bad "no table.md after the rehearsal with a complete .deps"
fi
grep -qF -- "-DCMAKE_PREFIX_PATH=$tree/.deps/usr -DCMAKE_IGNORE_PREFIX_PATH=/usr" "$tmp/deps_cmake_args" 2>/dev/null ||
  bad "the rehearsal's CMake was not given .deps with /usr hidden: $(cat "$tmp/deps_cmake_args" 2>/dev/null)"

if [ "$fail" -ne 0 ]; then
  for f in deadline term kill compare real nocuda quick built deps_none deps_part deps_gpu deps_full; do
    echo "== $f"; cat "$tmp/$f.out"; [ -f "$tmp/$f.err" ] && cat "$tmp/$f.err"
  done
  exit 1
fi
echo "gpu_check: deadline, SIGTERM and SIGKILL behave; the comparison with PyTorch is tabled;" \
  "a run without the header-only dependencies stops at once, saying so"
