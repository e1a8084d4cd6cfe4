#!/usr/bin/env bash
# The GPU checks, for a lent GPU machine whose time is short and may be cut off at any moment.
#
#   tools/gpu_check.sh [--deadline SECONDS] [--quick | --compare] [--rehearse] [--out DIR]
#
# Steps, most valuable first; each starts only if its minimum time is left before the deadline
# (default 480 s from the start), else its row says "skipped: deadline", and each runs under a
# limit that ends by the deadline:
#    1. device facts (nvidia-smi, cores, compilers) and   2. where cuDNN, cuBLAS and NCCL are
#       (toolkit, system, or the nvidia-* Python packages) with their versions;
#    3. configure for sm_90 (no OpenBLAS, no oneDNN: the GPU machine has neither) with the
#       header-only dependencies from .deps (tools/gpu_deps.sh), and  4. build only what runs:
#       unetcu_cuda_tests, unet_train, unet_bench (the CPU suite is CI's);
#    5. the CUDA tests, once (every op against the CPU, the UNet step, NCCL with one rank, two
#       pipeline stages on one GPU);
#    6. training at 512x512, 3 short epochs: single GPU with batch 14 (the article's) and 64,
#       each followed by the same in mixed precision (--precision bf16 --memory-format nhwc:
#       bfloat16 activations and gradients, channels-last) and by that again with --cuda-graphs
#       (after two eager steps forward, loss and backward replayed as one CUDA graph; the
#       optimizer eager), each its own row whose failure stops nothing after it, the three
#       before PyTorch's eager step at that batch (batch 14's first: the most valuable figures
#       when the time runs out); data parallel through NCCL with one rank (batch 14), the same
#       as one process of a launched job (torchrun's variables, NCCL_COMM_ID), the article's MP
#       run as two stages on the one GPU (cut after layer3, batch 30, micro-batches of 6),
#       then the same with --cuda-graphs (the pipeline's step captured over both streams):
#       images/s (median of the epochs after the first, which runs cuDNN's algorithm search)
#       and peak memory; before the DP row, the bf16 NHWC step at batch 14 profiled op by op
#       (--profile, UNETCU_CUDA_SYNC=1: real GPU times; the five largest ops in the row, the
#       tables in its log);
#    7. unet_bench on cuda:0 at 256x256 (two split sizes: 20 pipelines).
#    PyTorch beside them (tools/pytorch_reference.py bench --device cuda, its own rebuild of the
#    same model, BCE+Dice, Adam 1e-3, one random batch resident on the GPU): after each batch's
#    three single-GPU trainings (fp32, bf16 NHWC, bf16 NHWC graphs; 512x512, batch 14 and 64)
#    a step timing PyTorch eager in fp32 (TF32 off), TF32 and bf16 autocast + channels_last,
#    one mode after another; after step 7, bf16 under torch.compile at batch 14 and 64 (its
#    own steps: the compilation takes minutes, and a failure or a compile past the step's limit
#    less 40 s reads "compile failed: <reason>"). The Python is GPU_CHECK_PYTHON if set, else
#    the first of python3, /opt/torch/.venv/bin/python3, /usr/bin/python3 whose torch sees a
#    CUDA device; where none does, those rows read "skipped: no PyTorch with CUDA".
#    At the end table.md gets the comparison: per batch, unetcu's images/s (the single-GPU
#    training rows: fp32, bf16 NHWC, bf16 NHWC with CUDA graphs) and each PyTorch mode's, with
#    the fraction of the dense peak each reached (the H100 SXM's and H200's, the same; unetcu
#    fp32 against the TF32 peak, both unetcu bf16 columns against the bf16 one), the ratios
#    unetcu fp32 / PyTorch (each mode), unetcu bf16 / PyTorch bf16 and unetcu bf16 graphs /
#    PyTorch bf16 (AMP and compiled); a figure that is missing says why (the step's result:
#    skipped, FAILED, interrupted, "compile failed: ...", or "not run").
# --quick: steps 1-5 and the batch-14 trainings only, fp32 then bf16 NHWC, no CUDA graphs row
# (a few minutes; a second call after a fix; on a machine still warm the build is
# incremental). No PyTorch rows, no comparison.
# --compare: steps 1-4, the six single-GPU trainings and the PyTorch steps only, then the
# comparison (each compiled step needs 90 s left to start: under a 600 s command limit, give
# it --deadline 540).
# --rehearse: steps 1-4 only, for a machine without a GPU: the cost of everything before the
# first GPU call, printed step by step.
# Before step 1 the header-only dependencies are looked for: the rehearsal needs all of them in
# .deps (it hides /usr from CMake, as the GPU machine has no Debian packages), any other run in
# .deps or under /usr or /usr/local. One missing stops the run at once, exit 1 and nothing under
# $OUT, with one line on stderr: run tools/gpu_deps.sh, then carry .deps (the device tool's carry).
# A step that needs a GPU where none is visible is reported "skipped: no GPU", never passed.
#
# What comes back (at most 2 files under $OUT; the device tool sets OUT, else ./gpu_check_out):
#   table.md              header, then one row per step appended the moment it ends, then
#                         (full and --compare runs) the comparison with PyTorch, then a
#                         last line saying how the run ended and after how long;
#   gpu_check_logs.tar.gz every step's log (bench tables included), repacked after every step
#                         and once more on exit, so a run killed even by SIGKILL returns the
#                         table and the logs of every finished step.
# A trap on EXIT (and TERM, INT, HUP) stops the running step, records it as interrupted and packs.
#
# There is no fallback to a build carried from another machine: that build was made with
# -march=native for a different CPU and linked against OpenBLAS, and could not load there.
#
# Testing: GPU_CHECK_FAKE_STEPS="name:need:seconds[:needs[:figures]] ..." replaces the steps by
# sleeps (tests/gpu_check_test.sh); needs is -, gpu or pytorch; figures, comma-separated, are
# what the step would tell the comparison: VAR=VALUE (IPS_<col>_<batch> images/s,
# FRAC_<col>_<batch> fraction of peak, WHY_<col>_<batch> why missing; col is unetcu,
# unetcu_bf16, unetcu_bf16g, fp32, tf32, bf16 or bf16_compile; VALUE without spaces) or a bare
# <col>_<batch> the step is expected to give. A spec with figures makes the run end with the
# comparison table.
# GPU_CHECK_FAKE_GPU=1 pretends a GPU is visible for them; GPU_CHECK_RESERVE (default 5) is the
# time kept after the last step for packing; GPU_CHECK_SYSTEM_PREFIXES (default "/usr /usr/local")
# are where a run other than the rehearsal looks for the dependencies missing from .deps.
set -uo pipefail
set -m  # every step is its own process group: a limit or a kill stops the whole of it

usage() { sed -n '4p' "$0" | sed 's/^# *//'; exit "${1:-2}"; }
DEADLINE=480 QUICK=0 COMPARE_ONLY=0 REHEARSE=0 OUTROOT="${OUT:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --deadline) [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "--deadline needs whole seconds" >&2; usage; }
                DEADLINE=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --compare) COMPARE_ONLY=1; shift ;;
    --rehearse) REHEARSE=1; shift ;;
    --out) [ -n "${2:-}" ] || usage; OUTROOT=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done
[ "$QUICK$COMPARE_ONLY" = 11 ] && { echo "--quick and --compare: choose one" >&2; usage; }
[ -n "$OUTROOT" ] || OUTROOT="$PWD/gpu_check_out"
case "$OUTROOT" in /*) ;; *) OUTROOT="$PWD/$OUTROOT" ;; esac
cd "$(dirname "$0")/.." || exit 1

# What the configure step needs of the header-only dependencies, relative to a prefix: each
# package's CMake file and header, as tools/gpu_deps.sh copies them into .deps/usr from the
# Debian packages (find_package(CLI11, doctest, nlohmann_json), find_path(stb_image.h)).
DEPS_NEEDED="share/cmake/CLI11/CLI11Config.cmake include/CLI/CLI.hpp
  lib/cmake/doctest/doctestConfig.cmake include/doctest/doctest.h
  share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake include/nlohmann/json.hpp include/stb/stb_image.h"
deps_missing() {  # prefixes: the needed files under none of them
  local f p missing=""
  for f in $DEPS_NEEDED; do
    for p; do [ -f "$p/$f" ] && continue 2; done
    missing="$missing $f"
  done
  echo "${missing# }"
}
# Checked before anything runs: without them the configure fails after the machine's start and
# the first steps have spent the loan. The fake steps configure nothing.
if [ -z "${GPU_CHECK_FAKE_STEPS:-}" ]; then
  DEPS_SYSTEM=""
  [ "$REHEARSE" = 1 ] || DEPS_SYSTEM=${GPU_CHECK_SYSTEM_PREFIXES:-/usr /usr/local}
  # shellcheck disable=SC2086
  DEPS_MISSING=$(deps_missing .deps/usr $DEPS_SYSTEM)
  if [ -n "$DEPS_MISSING" ]; then
    if [ -d .deps/usr ]; then DEPS_WHY="incomplete (.deps/usr lacks ${DEPS_MISSING// /, }"
    else DEPS_WHY="missing (no .deps"; fi
    echo "gpu_check: the header-only dependencies are $DEPS_WHY${DEPS_SYSTEM:+; not under $DEPS_SYSTEM either}):" \
      "run tools/gpu_deps.sh on a machine with the Debian packages, then carry .deps (the device tool's carry: [\".deps\"])" >&2
    exit 1
  fi
fi

mkdir -p "$OUTROOT" || exit 1
TABLE="$OUTROOT/table.md"
ARCHIVE="$OUTROOT/gpu_check_logs.tar.gz"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 1
LOGS="$WORK/logs"
RESULT="$WORK/result"   # a step's one-line result
STATE="$WORK/state.sh"  # what a step tells the steps after it (it runs in a subshell)
mkdir -p "$LOGS"
RESERVE=${GPU_CHECK_RESERVE:-5}
B=build-gpu

now_ms() {
  local t=${EPOCHREALTIME:-}
  if [ -n "$t" ]; then t=${t//[.,]/}; echo $((10#$t / 1000)); else echo $(($(date +%s%N) / 1000000)); fi
}
START_MS=$(now_ms)
elapsed_ms() { echo $(($(now_ms) - START_MS)); }
secs() { printf '%d.%d' $(($1 / 1000)) $(($1 % 1000 / 100)); }  # milliseconds -> "12.3"

HAVE_GPU=0 CONFIGURED=0 BUILD_OK=0
STEP_N=0 STEP_PID="" WATCH_PID="" STEP_NAME="" STEP_T0=0 STEP_LIMIT_S=0
STEP_FEEDS=""  # the comparison's figures the running step should give (<col>_<batch> ...)
COMPARE=0      # 1: the run ends with the comparison table (unetcu against PyTorch)
N_FAILED=0 N_DEADLINE=0 ENDED=""
PRE_GPU_MS=""  # when the last step before the first GPU step ended (the rehearsal's figure)

row() {  # step, result, seconds: appended at once, '|' inside a cell made '/'
  local line
  line=$(printf '| %s | %s | %s |' "${1//|//}" "${2//|//}" "$3")
  echo "$line" >> "$TABLE"
  echo "$line"
  local key text=$2
  case "$text" in ok*) text="no figure in the step's output" ;; esac
  for key in $STEP_FEEDS; do  # why the figures this step should give are missing, if they are
    local why=WHY_$key
    [ -n "${!why:-}" ] || printf -v "$why" '%s' "${text:0:80}"
  done
}
pack() {
  tar czf "$ARCHIVE.tmp" -C "$WORK" logs 2>/dev/null && mv -f "$ARCHIVE.tmp" "$ARCHIVE"
}
stop_step() {  # the running step and its watchdog, whole process groups
  [ -n "$WATCH_PID" ] && kill -KILL -- -"$WATCH_PID" 2>/dev/null
  if [ -n "$STEP_PID" ]; then
    kill -TERM -- -"$STEP_PID" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$STEP_PID" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- -"$STEP_PID" 2>/dev/null
    wait "$STEP_PID" 2>/dev/null
  fi
  [ -n "$WATCH_PID" ] && wait "$WATCH_PID" 2>/dev/null
}
on_exit() {
  local rc=$?
  trap - EXIT TERM INT HUP
  if [ -n "$STEP_NAME" ]; then
    stop_step
    # shellcheck disable=SC1090
    [ -f "$STATE" ] && . "$STATE"  # what the step told before it was stopped (its own trap)
    row "$STEP_NAME" "interrupted (${ENDED:-exit $rc}) after $(secs $(($(now_ms) - STEP_T0))) s" \
      "$(secs $(($(now_ms) - STEP_T0)))"
  fi
  [ -n "$ENDED" ] || ENDED="exit $rc"
  [ "$COMPARE" = 1 ] && compare_table >> "$TABLE"
  local extra=""
  [ "$N_DEADLINE" -gt 0 ] && extra=", $N_DEADLINE step(s) skipped by the deadline"
  [ "$N_FAILED" -gt 0 ] && extra="$extra, $N_FAILED FAILED"
  { echo; echo "ended: $ENDED after $(secs "$(elapsed_ms)") s (deadline $DEADLINE s)$extra"; } >> "$TABLE"
  if [ "$REHEARSE" = 1 ] && [ -n "$PRE_GPU_MS" ]; then
    echo "rehearsal: everything before the first GPU step took $(secs "$PRE_GPU_MS") s" | tee -a "$TABLE"
  fi
  pack
  rm -rf "$WORK"
  echo
  cat "$TABLE"
  echo "logs: $ARCHIVE"
}
on_signal() { ENDED="killed by $1"; exit "$2"; }
trap on_exit EXIT
trap 'on_signal TERM 143' TERM
trap 'on_signal INT 130' INT
trap 'on_signal HUP 129' HUP

# [FEEDS="<col>_<batch> ..."] step NAME NEED CAP NEEDS FUNCTION [ARGS...]: runs FUNCTION (stdout
# and stderr into its log, $LOG) if NEEDS holds (- nothing, configured, build, gpu: a GPU and
# the build, pytorch: a GPU and no sign yet that PyTorch lacks CUDA) and NEED seconds are
# left, for at most CAP seconds ($STEP_LIMIT_S, the limit it got) and never past the deadline.
# FUNCTION writes a one-line result to $RESULT and returns 0 (ok), 77 (skipped: the result
# says why) or anything else (FAILED). FEEDS: the comparison's figures it should give; where
# it gives none, the cell says why (the step's result).
step() {
  local name=$1 need=$2 cap=$3 needs=$4 why=""
  shift 4
  STEP_N=$((STEP_N + 1))
  STEP_FEEDS=${FEEDS:-}
  case "$needs" in
    gpu) if [ "$HAVE_GPU" != 1 ]; then why="skipped: no GPU"
         elif [ "$REHEARSE" = 1 ]; then why="skipped: rehearsal (no GPU call)"
         elif [ "$BUILD_OK" != 1 ]; then why="skipped: no build"; fi ;;
    pytorch) if [ "$HAVE_GPU" != 1 ]; then why="skipped: no GPU"
             elif [ "$REHEARSE" = 1 ]; then why="skipped: rehearsal (no GPU call)"
             elif [ "${TORCH_PY:-}" = none ]; then why="skipped: no PyTorch with CUDA"; fi ;;
    build) [ "$BUILD_OK" = 1 ] || why="skipped: no build" ;;
    configured) [ "$CONFIGURED" = 1 ] || why="skipped: not configured" ;;
  esac
  case "$needs" in gpu|pytorch) [ -n "$PRE_GPU_MS" ] || PRE_GPU_MS=$(elapsed_ms) ;; esac
  if [ -n "$why" ]; then row "$name" "$why" "-"; STEP_FEEDS=""; return; fi
  local left_ms=$((DEADLINE * 1000 - $(elapsed_ms) - RESERVE * 1000))
  if [ "$left_ms" -lt $((need * 1000)) ]; then
    row "$name" "skipped: deadline ($(secs $((left_ms > 0 ? left_ms : 0))) s left, needs $need s)" "-"
    N_DEADLINE=$((N_DEADLINE + 1))
    STEP_FEEDS=""
    return
  fi
  local limit_ms=$((cap * 1000 < left_ms ? cap * 1000 : left_ms))
  STEP_LIMIT_S=$((limit_ms / 1000))
  LOG="$LOGS/$(printf '%02d' "$STEP_N")-$(echo "$name" | tr -cs 'A-Za-z0-9' '-' | sed 's/-$//').log"
  : > "$RESULT"
  rm -f "$WORK/timed_out"
  echo "-> $name (limit $(secs "$limit_ms") s)"
  STEP_NAME=$name
  STEP_T0=$(now_ms)
  (trap 'exit 143' TERM; "$@") > "$LOG" 2>&1 &
  STEP_PID=$!
  (  # the step's watchdog; it ends with the script, even one killed by SIGKILL
    end=$(($(now_ms) + limit_ms))
    while [ "$(now_ms)" -lt "$end" ]; do
      kill -0 $$ 2>/dev/null || exit 0
      sleep 0.2
    done
    : > "$WORK/timed_out"
    kill -TERM -- -"$STEP_PID" 2>/dev/null
    sleep 3
    kill -KILL -- -"$STEP_PID" 2>/dev/null
  ) > /dev/null 2>&1 &
  WATCH_PID=$!
  wait "$STEP_PID"
  local rc=$?
  kill -KILL -- -"$WATCH_PID" 2>/dev/null
  wait "$WATCH_PID" 2>/dev/null
  local took result
  took=$(secs $(($(now_ms) - STEP_T0)))
  STEP_PID="" WATCH_PID="" STEP_NAME=""
  # shellcheck disable=SC1090
  [ -f "$STATE" ] && . "$STATE"  # before the row: the figures it told are known there
  result=$(head -c 600 "$RESULT" | tr '\n' ' ' | sed 's/ *$//')
  if [ -e "$WORK/timed_out" ]; then
    row "$name" "FAILED: stopped at its limit of $(secs "$limit_ms") s${result:+; $result}" "$took"
    N_FAILED=$((N_FAILED + 1))
  elif [ "$rc" = 0 ]; then
    row "$name" "ok${result:+: $result}" "$took"
  elif [ "$rc" = 77 ]; then
    row "$name" "${result:-skipped}" "$took"
  else
    row "$name" "FAILED (exit $rc)${result:+: $result}" "$took"
    N_FAILED=$((N_FAILED + 1))
  fi
  STEP_FEEDS=""
  pack
}
say() { echo "$*" > "$RESULT"; }       # a step's result
tell() { echo "$*" >> "$STATE"; }      # a variable for the steps after it

# ---- the steps ------------------------------------------------------------------------------
step_machine() {
  local gpu=""
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi
    gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -1)
  fi
  echo "cores: $(nproc); memory: $(free -g 2>/dev/null | awk '/^Mem/ {print $2 " GiB"}'); kernel $(uname -r)"
  for tool in nvcc cmake ninja g++ python3; do
    echo "== $tool: $(command -v "$tool" || echo missing)"
    "$tool" --version 2>&1 | head -4
  done
  local nvcc_v
  nvcc_v=$(nvcc --version 2>/dev/null | sed -nE 's/.*release ([0-9.]+).*/\1/p')
  if [ -n "$gpu" ]; then
    tell HAVE_GPU=1
    tell "GPU_NAME=$(printf %q "${gpu%%,*}")"
    say "$gpu; $(nproc) cores; nvcc ${nvcc_v:-missing}"
  else
    say "no GPU (nvidia-smi: ${gpu:-$(command -v nvidia-smi > /dev/null && echo 'none listed' || echo 'not found')}); $(nproc) cores; nvcc ${nvcc_v:-missing}"
  fi
}

# The first directory holding a file matching $1: the toolkit, the system, then the nvidia/
# trees of the Python packages (where the GPU machine keeps cuDNN, cuBLAS and NCCL).
find_dir() {
  local pattern=$1 d f s
  for d in "$CUDA_HOME/lib64" "$CUDA_HOME/include" /usr/lib/x86_64-linux-gnu /usr/include; do
    f=$(find "$d/" -maxdepth 1 -name "$pattern" 2>/dev/null | head -1)
    [ -n "$f" ] && { echo "$d"; return; }
  done
  for s in $SITES; do
    f=$(find "$s/nvidia" -maxdepth 4 -name "$pattern" 2>/dev/null | head -1)
    [ -n "$f" ] && { dirname "$f"; return; }
  done
}
header_version() {  # file, then the macros of the version's parts
  local file=$1 m v=""
  shift
  [ -f "$file" ] || { echo "?"; return; }
  for m; do v="$v${v:+.}$(sed -nE "s/^#define $m +([0-9]+).*/\1/p" "$file" | head -1)"; done
  echo "$v"
}
step_libraries() {
  CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc 2> /dev/null || echo /usr/local/cuda/bin/nvcc)")")}"
  SITES=$(python3 -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2> /dev/null)
  local missing="" v
  for v in CUDNN_LIB_DIR:'libcudnn.so*' CUDNN_INCLUDE_DIR:cudnn.h CUBLAS_LIB_DIR:'libcublas.so*' \
           CUBLAS_INCLUDE_DIR:cublas_v2.h NCCL_LIB_DIR:'libnccl.so*' NCCL_INCLUDE_DIR:nccl.h; do
    local var=${v%%:*} dir
    dir=$(find_dir "${v#*:}")
    echo "$var=$dir"
    if [ -n "$dir" ]; then tell "export $var='$dir'"; printf -v "$var" '%s' "$dir"; else missing="$missing ${v#*:}"; fi
  done
  tell "export LD_LIBRARY_PATH='${CUDNN_LIB_DIR:-}:${CUBLAS_LIB_DIR:-}:${NCCL_LIB_DIR:-}:${LD_LIBRARY_PATH:-}'"
  local cudnn cublas nccl cudart
  cudnn=$(header_version "${CUDNN_INCLUDE_DIR:-/nonexistent}/cudnn_version.h" CUDNN_MAJOR CUDNN_MINOR CUDNN_PATCHLEVEL)
  cublas=$(header_version "${CUBLAS_INCLUDE_DIR:-/nonexistent}/cublas_api.h" CUBLAS_VER_MAJOR CUBLAS_VER_MINOR CUBLAS_VER_PATCH)
  nccl=$(header_version "${NCCL_INCLUDE_DIR:-/nonexistent}/nccl.h" NCCL_MAJOR NCCL_MINOR NCCL_PATCH)
  cudart=$(header_version "$CUDA_HOME/include/cuda_runtime_api.h" CUDART_VERSION)
  [[ "$cudart" =~ ^[0-9]+$ ]] && cudart="$((cudart / 1000)).$((cudart % 1000 / 10))"  # 13000 -> 13.0
  echo "cuDNN $cudnn, cuBLAS $cublas, NCCL $nccl, CUDA runtime $cudart (CUDA_HOME $CUDA_HOME)"
  echo "== Python packages"
  python3 -c 'import importlib.metadata as m
for d in sorted(m.distributions(), key=lambda d: d.metadata["Name"].lower()):
    n = d.metadata["Name"]
    if n.lower().startswith(("nvidia-", "torch")): print(n, d.version)' 2>&1
  if [ -n "$missing" ]; then
    say "cuDNN $cudnn, cuBLAS $cublas, NCCL $nccl; not found:$missing"
    return 1
  fi
  say "cuDNN $cudnn, cuBLAS $cublas, NCCL $nccl, CUDA runtime $cudart"
}

step_configure() {
  local gen=() prefix=() ignore=-DCMAKE_IGNORE_PREFIX_PATH= note=""
  command -v ninja > /dev/null && gen=(-G Ninja)
  [ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr") note=", .deps used"
  # The rehearsal hides this machine's /usr from find_package and find_path: the header-only
  # dependencies must then come from .deps alone (checked complete at the start), as on the
  # GPU machine (no Debian packages).
  if [ "$REHEARSE" = 1 ]; then
    ignore=-DCMAKE_IGNORE_PREFIX_PATH=/usr note=", .deps used, /usr ignored"
  fi
  # Release adds -march=native: right here, since the binaries run where they are built.
  cmake -S . -B "$B" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DUNETCU_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DUNETCU_BUILD_TESTS=ON -DUNETCU_OPENBLAS=OFF -DUNETCU_DNNL=OFF -DUNETCU_MPI=OFF -DUNETCU_GLOO=OFF \
    "${prefix[@]}" "$ignore" || { say "$(grep -m1 -E 'Error|error' "$LOG")"; return 1; }
  tell CONFIGURED=1
  say "$(grep -oE 'unetcu: (CUDA parts|OpenBLAS|oneDNN|MPI) [A-Z]+' "$LOG" | sed 's/unetcu: //' | paste -sd, | sed 's/,/, /g')$note"
}

step_build() {
  cmake --build "$B" -j"$(nproc)" --target unetcu_cuda_tests unet_train unet_bench \
    || { say "$(grep -m1 -E 'error|Error' "$LOG")"; return 1; }
  tell BUILD_OK=1
  say "unetcu_cuda_tests, unet_train, unet_bench"
}

step_cuda_tests() {
  "$B/tests/unetcu_cuda_tests" --duration=true
  local rc=$?
  if [ "$rc" = 77 ]; then
    tell HAVE_GPU=0
    say "skipped: no GPU ($(grep -m1 SKIPPED "$LOG"))"
    return 77
  fi
  local summary failed
  summary=$(grep -E 'test cases:' "$LOG" | tail -1 | sed 's/^\[doctest\] *//' | tr -s ' ')
  failed=$(grep -E '^TEST CASE:' "$LOG" | sed -E 's/^TEST CASE: +//' | sort -u | paste -sd ';' | sed 's/;/; /g')
  say "${summary:-no summary}${failed:+; failed: $failed}"
  return "$rc"
}

# 3 short epochs at 512x512: images/s is the median of the epochs after the first (which finds
# the cuDNN algorithms), peak memory the largest of the epoch lines' peak_mem.
# The epoch line: "epoch 2/3  time ...  val_dice D  R img/s  peak_mem M MiB  loader L img/s, ...".
step_train() {
  local bs=$1
  shift
  trap 'train_result 143; exit 143' TERM  # stopped at its limit: what the finished epochs gave
  "$B/unet_train" --image-size 512 --batch-size "$bs" --train-size $((bs * 8)) --val-size "$bs" \
    --epochs 3 --no-progress "$@"
  train_result $?
}
train_result() {  # unet_train's exit status
  local rc=$1 ips peak
  ips=$(grep -E '^epoch ([2-9]|[1-9][0-9]+)/' "$LOG" | sed -nE 's/.* val_dice [0-9.]+ +([0-9.]+) img\/s.*/\1/p' |
    sort -n | awk '{a[NR] = $1} END {if (NR % 2) print a[(NR + 1) / 2]; else if (NR) printf "%.1f\n", (a[NR / 2] + a[NR / 2 + 1]) / 2}')
  peak=$(grep -E '^epoch ' "$LOG" | sed -nE 's/.* peak_mem ([0-9]+) MiB.*/\1/p' | sort -n | tail -1)
  if [ -n "$ips" ]; then
    say "$ips img/s, peak ${peak:-?} MiB$([ "$rc" = 0 ] || echo " (epochs finished: $(grep -c '^epoch ' "$LOG"))")"
    [ -n "${TRAIN_FIGURE:-}" ] && tell "IPS_$TRAIN_FIGURE=$ips"
  else
    say "$(grep -vE '^(epoch|$)' "$LOG" | tail -1)"
  fi
  [ "$rc" = 0 ] && [ -n "$ips" ]
}

# The single-GPU rows: their images/s is unetcu's figure in the comparison with PyTorch.
step_train_single() {
  TRAIN_FIGURE=unetcu_$1  # the step runs in a subshell: this stays in it
  step_train "$1" --device cuda:0
}
# The same in mixed precision and channels-last: the comparison's unetcu bf16 NHWC column.
step_train_single_bf16() {
  TRAIN_FIGURE=unetcu_bf16_$1
  step_train "$1" --device cuda:0 --precision bf16 --memory-format nhwc
}
# And that step replayed as a CUDA graph: the comparison's unetcu bf16 NHWC graphs column.
step_train_single_bf16g() {
  TRAIN_FIGURE=unetcu_bf16g_$1
  step_train "$1" --device cuda:0 --precision bf16 --memory-format nhwc --cuda-graphs
}

# Where the bf16 NHWC step's time goes, op by op: unet_train --profile with UNETCU_CUDA_SYNC=1
# (each op waits for its kernels, so its time is the GPU's, not the queueing), 8 steps and one
# validation batch at the batch size of a training row that ran before, whose shapes filled
# the on-disk algorithm cache (so no cuDNN search inside; the first step's cold allocations
# and kernel loads are, an eighth of the sample). The per-op and per-block tables are in the
# step's log (the trace file is not kept); the row names the five largest ops and their shares.
step_profile_bf16() {
  UNETCU_CUDA_SYNC=1 "$B/unet_train" --image-size 512 --batch-size "$1" --train-size $(($1 * 8)) --val-size "$1" \
    --epochs 1 --no-progress --device cuda:0 --precision bf16 --memory-format nhwc --profile "$WORK/profile.json" ||
    { say "$(grep -vE '^(epoch|$)' "$LOG" | tail -1)"; return 1; }
  local top
  top=$(sed -n '/^| op | calls/,/^$/p' "$LOG" | sed -n '3,7p' |
    awk -F'|' '{gsub(/^ +| +$/, "", $2); gsub(/ /, "", $6); printf "%s%s %s", (NR > 1 ? ", " : ""), $2, $6}')
  [ -n "$top" ] || { say "no per-op table in the output"; return 1; }
  say "$top"
}

# One process of a launched job (torchrun's variables, world 1) on cuda:0: the NCCL rank made
# across processes (NCCL_COMM_ID: NCCL's own rendezvous; no MPI or Gloo on this machine).
step_train_launched() {
  RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 \
    NCCL_COMM_ID=127.0.0.1:29562 step_train "$1" --mode dp --dist env
}

step_bench() {
  "$B/unet_bench" --devices cuda:0 --image-size 256 --batch-size 8 --mp-batch 16 \
    --split-sizes 2,8 --epochs 2 --out "$LOGS/bench" || { say "$(tail -1 "$LOG")"; return 1; }
  # Table 2's rows: method | mean epoch (s) | std | speedup | model speedup
  say "$(grep -E '^\| (single|DP ring|MP best)' "$LOG" |
    awk -F'|' '{gsub(/^ +| +$/, "", $2); gsub(/ /, "", $3); gsub(/ /, "", $5); printf "%s%s %s s x%s", (NR > 1 ? "; " : ""), $2, $3, $5}')"
}

# PyTorch's own training step of the same model on cuda (tools/pytorch_reference.py bench):
# batch, modes (fp32,tf32,bf16,bf16-compile). Each mode's JSON line gives its figures.
step_torch() {
  local bs=$1 modes=$2
  if [ -z "${TORCH_PY:-}" ]; then
    TORCH_PY=$(find_torch_python) || {
      tell TORCH_PY=none
      say "skipped: no PyTorch with CUDA (tried: ${GPU_CHECK_PYTHON:-$TORCH_CANDIDATES})"
      return 77
    }
    tell "TORCH_PY='$TORCH_PY'"
  fi
  echo "== $TORCH_PY"
  trap 'torch_result 143; exit 143' TERM  # stopped at its limit: the modes that finished
  # The compile gets the step's limit less the time to start, warm up, time and report.
  PYTHONUNBUFFERED=1 "$TORCH_PY" tools/pytorch_reference.py bench --device cuda --batch "$bs" --size 512 \
    --modes "$modes" --warmup 5 --steps 15 --compile-timeout $((STEP_LIMIT_S > 70 ? STEP_LIMIT_S - 40 : 30))
  torch_result $?
}
TORCH_CANDIDATES="python3 /opt/torch/.venv/bin/python3 /usr/bin/python3"
find_torch_python() {  # the first Python whose torch sees a CUDA device
  local py
  for py in ${GPU_CHECK_PYTHON:-$TORCH_CANDIDATES}; do
    command -v "$py" > /dev/null || continue
    echo "== is there torch with CUDA in $py?" >&2
    timeout 120 "$py" -c 'import sys, torch
print(torch.__version__, "CUDA" if torch.cuda.is_available() else "no CUDA", file=sys.stderr)
sys.exit(0 if torch.cuda.is_available() else 1)' && { command -v "$py"; return 0; }
  done
  return 1
}
# Each JSON line of the bench with a mode: shell assignments of its figures (or why it has
# none) for $STATE, then one line "say <summary>".
TORCH_FIGURES='import json, shlex, sys
say = []
for line in open(sys.argv[1], errors="replace"):
    try:
        r = json.loads(line) if line.startswith("{") else {}
    except ValueError:
        r = {}
    if "mode" not in r or "batch" not in r:
        continue
    key = "%s_%s" % (r["mode"].replace("-", "_"), r["batch"])
    print("TORCH_VERSION=" + shlex.quote(str(r.get("torch"))))
    if r.get("status") == "ok":
        print("IPS_%s=%.1f" % (key, r["images_per_s"]))
        print("FRAC_%s=%.4f" % (key, r["fraction_of_peak"]))
        say.append("%s %.1f img/s (%.1f%% of peak), peak %.0f MiB"
                   % (r["mode"], r["images_per_s"], 100 * r["fraction_of_peak"], r["peak_mem_mib"]))
    else:
        print("WHY_%s=%s" % (key, shlex.quote(str(r.get("status"))[:80])))
        say.append("%s %s" % (r["mode"], r.get("status")))
print("say " + "; ".join(say))'
torch_result() {  # the bench's exit status: tells each mode's figures, says a summary
  local rc=$1 out summary
  out=$("$TORCH_PY" -c "$TORCH_FIGURES" "$LOG")
  grep -v '^say ' <<< "$out" >> "$STATE"
  summary=$(sed -n 's/^say //p' <<< "$out")
  [ "$rc" = 77 ] && tell TORCH_PY=none  # its torch sees no CUDA device after all
  say "${summary:-$(tail -1 "$LOG")}"
  return "$rc"
}

fake_step() {  # tests: a step that sleeps, then tells its figures (comma-separated VAR=VALUE)
  sleep "$1" &
  echo "sleep pid $!"
  wait $!
  local a
  for a in ${2//,/ }; do [[ "$a" == *=* ]] && tell "$a"; done
  say "slept $1 s"
}

# The comparison: unetcu's images/s against each PyTorch mode's, per batch, at 512x512.
COMPARE_BATCHES="14 64"
COMPARE_MODES="fp32 tf32 bf16 bf16_compile"
GFLOP_PER_IMAGE=188  # one training step at 512x512 (tools/pytorch_reference.py says how)
TF32_PEAK=494        # TFLOP/s, H100 SXM and H200 dense (NVIDIA's datasheets, the same figures for
BF16_PEAK=989        # both): unetcu fp32's convolutions may use TF32; its bf16 NHWC rows bfloat16
figure() { local v=$1; echo "${!v:-}"; }
col_label() {  # unetcu's column as a missing cell names it
  case "$1" in unetcu_bf16g) echo "unetcu bf16 graphs" ;; *) echo "${1//_/ }" ;; esac
}
ips_cell() {  # <col>_<batch>: "images/s (percent of peak)", or why it is missing
  local ips frac why peak=""
  ips=$(figure "IPS_$1") frac=$(figure "FRAC_$1") why=$(figure "WHY_$1")
  if [ -z "$ips" ]; then echo "— (${why:-not run})"; return; fi
  case "${1%_*}" in unetcu) peak=$TF32_PEAK ;; unetcu_bf16|unetcu_bf16g) peak=$BF16_PEAK ;; esac
  if [ -z "$frac" ] && [ -n "$peak" ]; then
    frac=$(awk -v i="$ips" -v g="$GFLOP_PER_IMAGE" -v p="$peak" 'BEGIN { printf "%.4f", i * g / 1e3 / p }')
  fi
  echo "$ips${frac:+ ($(awk -v f="$frac" 'BEGIN { printf "%.1f", 100 * f }')%)}"
}
ratio_cell() {  # unetcu's column (unetcu, unetcu_bf16, unetcu_bf16g), batch, PyTorch mode
  local u p
  u=$(figure "IPS_$1_$2") p=$(figure "IPS_$3_$2")
  if [ -n "$u" ] && [ -n "$p" ]; then awk -v u="$u" -v p="$p" 'BEGIN { printf "%.2f", u / p }'
  elif [ -n "$p" ]; then echo "— (no $(col_label "$1") figure)"
  elif [ -n "$u" ]; then echo "— (no PyTorch figure)"
  else echo "— (neither figure)"; fi
}
compare_table() {
  local bs m c line
  echo
  echo "## unetcu against PyTorch: training step at 512x512"
  echo
  echo "GPU: ${GPU_NAME:-not known}. images/s, and in brackets the fraction of the dense peak reached,"
  echo "counting $GFLOP_PER_IMAGE GFLOP per image per step (fp32 67, TF32 $TF32_PEAK, bf16 $BF16_PEAK TFLOP/s:"
  echo "NVIDIA's datasheets give these for both the H100 SXM and the H200; another GPU's fractions are"
  echo "against them all the same)."
  echo "unetcu fp32: the single-GPU training rows above (float32; cuDNN may use TF32: against the TF32 peak)."
  echo "unetcu bf16 NHWC: the rows with --precision bf16 --memory-format nhwc (bfloat16 activations and gradients,"
  echo "float32 math and parameters, channels-last: against the bf16 peak)."
  echo "unetcu bf16 NHWC graphs: the same with --cuda-graphs (after two eager steps, forward, loss and backward"
  echo "replayed as one CUDA graph, the optimizer eager: against the bf16 peak)."
  echo "PyTorch ${TORCH_VERSION:-(version not known)}: tools/pytorch_reference.py bench --device cuda, median step, one resident batch."
  echo "unetcu / <mode>: unetcu fp32's images/s over PyTorch's in that mode; unetcu bf16 / <mode>: unetcu bf16 NHWC's"
  echo "over PyTorch bf16's (autocast + channels_last, eager or compiled); unetcu bf16 graphs / <mode>: unetcu bf16"
  echo "NHWC graphs' over the same. Above 1, unetcu is faster."
  echo "The bf16 path's goal: unetcu bf16 / bf16 AMP (eager or graphs) at 1.3 or more."
  echo
  echo "| batch | unetcu fp32 | unetcu bf16 NHWC | unetcu bf16 NHWC graphs | PyTorch fp32 | PyTorch TF32 | PyTorch bf16 AMP | PyTorch bf16 compiled | unetcu / fp32 | unetcu / TF32 | unetcu / bf16 AMP | unetcu / bf16 compiled | unetcu bf16 / bf16 AMP | unetcu bf16 / bf16 compiled | unetcu bf16 graphs / bf16 AMP | unetcu bf16 graphs / bf16 compiled |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  for bs in $COMPARE_BATCHES; do
    line="| $bs"
    for m in unetcu unetcu_bf16 unetcu_bf16g $COMPARE_MODES; do c=$(ips_cell "${m}_$bs"); line="$line | ${c//|//}"; done
    for m in $COMPARE_MODES; do line="$line | $(ratio_cell unetcu "$bs" "$m")"; done
    for m in bf16 bf16_compile; do line="$line | $(ratio_cell unetcu_bf16 "$bs" "$m")"; done
    for m in bf16 bf16_compile; do line="$line | $(ratio_cell unetcu_bf16g "$bs" "$m")"; done
    echo "$line |"
  done
}

# ---- the run --------------------------------------------------------------------------------
MODE=full
[ "$QUICK" = 1 ] && MODE=quick
[ "$COMPARE_ONLY" = 1 ] && MODE=compare
[ "$REHEARSE" = 1 ] && MODE=rehearse$([ "$COMPARE_ONLY" = 1 ] && echo ", compare")
{
  echo "# tools/gpu_check.sh: commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $MODE, deadline $DEADLINE s, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "| step | result | s |"
  echo "|---|---|---|"
} > "$TABLE"
cat "$TABLE"
rm -f "$ARCHIVE"

torch_eager() {  # batch: PyTorch's eager modes beside unetcu's single-GPU row
  FEEDS="fp32_$1 tf32_$1 bf16_$1" step "PyTorch eager 512² batch $1 (fp32, TF32, bf16 AMP)" \
    $(($1 > 14 ? 45 : 30)) $(($1 > 14 ? 180 : 150)) pytorch step_torch "$1" fp32,tf32,bf16
}
train_single() {  # batch: unetcu's single-GPU rows, fp32, bf16 NHWC, then (not --quick) bf16
  # NHWC with CUDA graphs; each its own step, failing alone, all with the same time budget
  local need=$(($1 > 14 ? 45 : 40)) cap=$(($1 > 14 ? 180 : 150))
  FEEDS=unetcu_$1 step "train single 512² batch $1" "$need" "$cap" gpu step_train_single "$1"
  FEEDS=unetcu_bf16_$1 step "train single bf16 NHWC 512² batch $1" "$need" "$cap" gpu step_train_single_bf16 "$1"
  [ "$QUICK" = 1 ] ||
    FEEDS=unetcu_bf16g_$1 step "train single bf16 NHWC CUDA graphs 512² batch $1" "$need" "$cap" gpu step_train_single_bf16g "$1"
}
torch_compiled() {  # batch: PyTorch's bf16 under torch.compile (minutes of compilation)
  FEEDS="bf16_compile_$1" step "PyTorch bf16 compiled 512² batch $1" 90 300 pytorch step_torch "$1" bf16-compile
}

if [ -n "${GPU_CHECK_FAKE_STEPS:-}" ]; then
  HAVE_GPU=${GPU_CHECK_FAKE_GPU:-0} BUILD_OK=1
  for spec in $GPU_CHECK_FAKE_STEPS; do
    IFS=: read -r name need seconds needs figures <<< "$spec"
    feeds=""
    for f in ${figures//,/ }; do f=${f%%=*}; f=${f#IPS_}; f=${f#FRAC_}; feeds="$feeds ${f#WHY_}"; done
    [ -n "$figures" ] && COMPARE=1
    FEEDS=$feeds step "$name" "$need" 600 "${needs:--}" fake_step "$seconds" "$figures"
  done
else
  [ "$QUICK" = 0 ] && [ "$REHEARSE" = 0 ] && COMPARE=1
  step "device facts" 0 30 - step_machine
  step "libraries" 0 60 - step_libraries
  step "configure (sm_90, no OpenBLAS/oneDNN)" 10 120 - step_configure
  step "build" 30 600 configured step_build
  [ "$COMPARE_ONLY" = 1 ] || step "CUDA tests (doctest)" 20 180 gpu step_cuda_tests
  train_single 14
  if [ "$QUICK" = 0 ]; then
    torch_eager 14
    train_single 64
    torch_eager 64
    if [ "$COMPARE_ONLY" = 0 ]; then
      step "profile bf16 NHWC 512² batch 14 (UNETCU_CUDA_SYNC=1)" 30 120 gpu step_profile_bf16 14
      step "train DP NCCL 1 rank 512² batch 14" 40 150 gpu step_train 14 --mode dp --devices cuda:0
      step "train DP as 1 launched process (NCCL_COMM_ID) 512² batch 14" 40 150 gpu step_train_launched 14
      step "train MP 2 stages 1 GPU 512² batch 30 split 6" 40 150 gpu \
        step_train 30 --mode mp --devices cuda:0,cuda:0 --split layer3 --split-size 6
      step "train MP 2 stages 1 GPU CUDA graphs 512² batch 30 split 6" 40 150 gpu \
        step_train 30 --mode mp --devices cuda:0,cuda:0 --split layer3 --split-size 6 --cuda-graphs
      # --mode auto on one GPU under 6 GiB (about the plain step at 14): the memory model on the
      # GPU's allocator, its table of predicted and measured peaks, and the plan it chose.
      step "train auto 1 GPU 512² batch 14 under 6G" 60 240 gpu step_train 14 --mode auto --devices cuda:0 --max-memory 6G
      step "unet_bench cuda:0 256² (20 pipelines)" 60 600 gpu step_bench
    fi
    torch_compiled 14
    torch_compiled 64
  fi
fi
ENDED=finished
[ "$N_FAILED" = 0 ]
