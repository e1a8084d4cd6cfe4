#!/usr/bin/env bash
# Every GPU check in one run on the GPU machine, in well under 8 minutes:
#   1. the GPU, and where cuDNN, cuBLAS and NCCL are (CUDA toolkit, system, or the nvidia-*
#      Python packages, headers included);
#   2. a build for sm_90 there (if it fails, a carried build/ is tried instead);
#   3. the whole test suite with the CUDA tests active;
#   4. single-GPU training at 512x512, batch 14 (the article's) and 64, 3 short epochs: images/s (median of
#      the epochs after the first, which finds cuDNN algorithms and draws the data) and peak
#      device memory; then data parallelism through NCCL with one rank (batch 14), and the
#      article's MP run: two stages on the one GPU (two streams), cut after layer3, batch 30
#      in micro-batches of 6, against the single-GPU run on the same batch;
#   5. unet_bench on cuda:0 (Tables 1 and 2 into $OUT/bench), 6. a profiled step with a trace.
# Logs go to $OUT/gpu_check_logs.tar.gz (the device tool sets OUT; else ./gpu_check_out) and the table to $OUT/table.md;
# the table is also printed last. Run from the repository root with `.deps` carried (tools/gpu_deps.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
# The device tool brings back at most 8 files: the logs are written to $OUT/work and packed
# into one archive at the end, beside the table.
OUTROOT="${OUT:-$PWD/gpu_check_out}"
OUT="$OUTROOT/work"
mkdir -p "$OUT"
START=$SECONDS
declare -a ROWS
row() { ROWS+=("$(printf '| %-34s | %s |' "$1" "$2")"); }
elapsed() { echo "$((SECONDS - START))s"; }

# ---- 1. machine and libraries --------------------------------------------------------
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  command -v nvcc && nvcc --version | tail -2
  cmake --version | head -1
  python3 --version
} > "$OUT/machine.txt" 2>&1
row "GPU" "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"

CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")}"
SITES=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
# first directory holding a file matching $1, searched in the toolkit, the system, then the
# Python packages' nvidia/ trees
locate() {
  local pattern="$1" f
  for d in "$CUDA_HOME/lib64" "$CUDA_HOME/include" /usr/lib/x86_64-linux-gnu /usr/include; do
    f=$(ls "$d"/$pattern 2>/dev/null | head -1) && [ -n "$f" ] && { dirname "$f"; return; }
  done
  for s in $SITES; do
    f=$(find "$s/nvidia" -maxdepth 4 -name "$pattern" 2>/dev/null | head -1)
    [ -n "$f" ] && { dirname "$f"; return; }
  done
}
export CUDNN_LIB_DIR=$(locate 'libcudnn.so*')
export CUDNN_INCLUDE_DIR=$(locate 'cudnn.h')
export CUBLAS_LIB_DIR=$(locate 'libcublas.so*')
export CUBLAS_INCLUDE_DIR=$(locate 'cublas_v2.h')
NCCL_LIB_DIR=$(locate 'libnccl.so*')
NCCL_INCLUDE_DIR=$(locate 'nccl.h')
export NCCL_LIB_DIR NCCL_INCLUDE_DIR
for v in CUDNN_LIB_DIR CUDNN_INCLUDE_DIR CUBLAS_LIB_DIR CUBLAS_INCLUDE_DIR NCCL_LIB_DIR NCCL_INCLUDE_DIR; do
  echo "$v=${!v}" >> "$OUT/machine.txt"
done
export LD_LIBRARY_PATH="${CUDNN_LIB_DIR}:${CUBLAS_LIB_DIR}:${NCCL_LIB_DIR}:${LD_LIBRARY_PATH:-}"
row "cuDNN / cuBLAS / NCCL" "${CUDNN_LIB_DIR:-missing} / ${CUBLAS_LIB_DIR:-missing} / ${NCCL_LIB_DIR:-missing}"

# ---- 2. build ------------------------------------------------------------------------
B=build-gpu
GEN=""
command -v ninja >/dev/null && GEN="-G Ninja"
if cmake -S . -B "$B" $GEN -DCMAKE_BUILD_TYPE=Release -DUNETCU_CUDA=ON \
     -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH="$PWD/.deps/usr" > "$OUT/build.log" 2>&1 &&
   cmake --build "$B" -j"$(nproc)" >> "$OUT/build.log" 2>&1; then
  row "build (sm_90, on this machine)" "ok in $(elapsed)"
elif [ -x build/unet_train ] && ldd build/unet_train 2>&1 | grep -q "libcudart"; then
  B=build
  row "build (sm_90, on this machine)" "FAILED (see build.log); using the carried build/"
else
  row "build (sm_90, on this machine)" "FAILED (see build.log), no usable carried build"
  tail -30 "$OUT/build.log"
  printf '%s\n' "${ROWS[@]}" | tee "$OUTROOT/table.md"
  tar czf "$OUTROOT/gpu_check_logs.tar.gz" -C "$OUT" . && rm -rf "$OUT"
  exit 1
fi

# ---- 3. tests ------------------------------------------------------------------------
timeout 240 ctest --test-dir "$B" --output-on-failure > "$OUT/tests.log" 2>&1
row "ctest" "$(grep -E 'tests passed|tests failed' "$OUT/tests.log" | tail -1) ($(elapsed))"
# The CUDA suite's own report (every failed CHECK with its values).
timeout 120 "$B/tests/unetcu_cuda_tests" > "$OUT/cuda_tests.log" 2>&1
row "CUDA tests (doctest)" "$(grep -E 'test cases:' "$OUT/cuda_tests.log" | tail -1 | tr -s ' ')"
grep -E "ERROR|FAILED|SKIPPED" "$OUT/cuda_tests.log" | head -20

# ---- 4. training at 512x512 ------------------------------------------------------------
train() {  # batch size, label, extra flags
  local bs=$1 label=$2 log="$OUT/train_$2.log"
  shift 2
  timeout 150 "$B/unet_train" --image-size 512 --batch-size "$bs" \
    --train-size $((bs * 8)) --val-size "$bs" --epochs 3 --no-progress "$@" > "$log" 2>&1
  local rc=$?
  local ips peak
  ips=$(grep -E '^epoch [2-9]' "$log" | sed -E 's/.* ([0-9.]+) img\/s.*/\1/' | sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]}')
  peak=$(grep -E '^epoch' "$log" | tail -1 | sed -E 's/.*peak_mem ([0-9]+) MiB.*/\1/')
  if [ $rc -eq 0 ] && [ -n "$ips" ]; then
    row "$label 512x512 batch $bs (TF32)" "${ips} img/s, peak ${peak} MiB"
  else
    row "$label 512x512 batch $bs (TF32)" "FAILED rc=$rc: $(tail -1 "$log")"
  fi
}
train 14 single --device cuda:0
train 64 single --device cuda:0
train 14 dp-nccl-1rank --mode dp --devices cuda:0
train 30 single --device cuda:0
train 30 mp-2stages-1gpu --mode mp --devices cuda:0,cuda:0 --split layer3 --split-size 6

# ---- 5. the bench on cuda:0 (DP through NCCL with one rank; MP as two stages on the GPU) ----
if timeout 200 "$B/unet_bench" --devices cuda:0 --image-size 256 --batch-size 8 --mp-batch 16 \
     --split-sizes 2,4,8,16 --epochs 2 --out "$OUT/bench" > "$OUT/bench.log" 2>&1; then
  row "unet_bench cuda:0 (256x256)" "$(grep -E '^\| MP best' "$OUT/bench.log" | head -1)"
else
  row "unet_bench cuda:0 (256x256)" "FAILED: $(tail -1 "$OUT/bench.log")"
fi
# ---- 6. a profiled step: per-op table and trace (kernel-accurate with UNETCU_CUDA_SYNC=1) ----
if UNETCU_CUDA_SYNC=1 timeout 60 "$B/unet_train" --device cuda:0 --image-size 512 --batch-size 14 \
     --train-size 28 --val-size 14 --epochs 1 --no-progress --profile "$OUT/trace.json" > "$OUT/profile.log" 2>&1; then
  row "profile 512x512 batch 14" "$(grep -E '^\| conv2d \|' "$OUT/profile.log" | head -1)"
else
  row "profile 512x512 batch 14" "FAILED: $(tail -1 "$OUT/profile.log")"
fi

{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(elapsed) in all"
  printf '| %-34s | %s |\n' "check" "result"
  printf '|%s|%s|\n' "------------------------------------" "--------"
  printf '%s\n' "${ROWS[@]}"
} > "$OUTROOT/table.md"
tar czf "$OUTROOT/gpu_check_logs.tar.gz" -C "$OUT" . && rm -rf "$OUT"
echo
cat "$OUTROOT/table.md"
echo "logs: $OUTROOT/gpu_check_logs.tar.gz"
