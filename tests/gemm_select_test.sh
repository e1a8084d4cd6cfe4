#!/usr/bin/env bash
# The engine corrects a GEMM library that picked generic kernels for a capable CPU: OpenBLAS
# is forced to its generic SSE3 kernels (as on CPU models it does not know) and unet_train must
# run with the kernels the CPU's instruction sets call for; UNETCU_GEMM_CORE overrides.
set -u
bin="$1"
args=(--epochs 1 --image-size 64 --train-size 8 --val-size 4 --width-divisor 16 --batch-size 4 --no-progress)
fail=0
line=$(OPENBLAS_CORETYPE=Prescott "$bin" "${args[@]}" | grep '^cpu: ')
echo "forced Prescott: $line"
case "$line" in
  *"gemm: loop GEMM"*) echo "SKIPPED: built without OpenBLAS"; exit 77 ;;
  "cpu: SSE"*) echo "SKIPPED: this CPU has no AVX; generic kernels are right for it"; exit 77 ;;
esac
grep -q "(OpenBLAS picked Prescott for this CPU" <<<"$line" || { echo "FAIL: not corrected"; fail=1; }
grep -qE "OpenBLAS [0-9.]+ Prescott kernels" <<<"$line" && { echo "FAIL: still Prescott"; fail=1; }
# The kernels match the instruction sets named.
case "$line" in
  "cpu: AVX-512 (bf16)"*) want=Cooperlake ;;
  "cpu: AVX-512"*) want=SkylakeX ;;
  "cpu: AVX2"*) want=Haswell ;;
  *) want=Sandybridge ;;
esac
grep -q " $want kernels" <<<"$line" || { echo "FAIL: expected $want kernels"; fail=1; }
# The user's choice stands.
line=$(OPENBLAS_CORETYPE=Prescott UNETCU_GEMM_CORE=keep "$bin" "${args[@]}" | grep '^cpu: ')
echo "keep: $line"
grep -q " Prescott kernels (UNETCU_GEMM_CORE=keep)" <<<"$line" || { echo "FAIL: keep not honoured"; fail=1; }
line=$(UNETCU_GEMM_CORE=Haswell "$bin" "${args[@]}" | grep '^cpu: ')
echo "forced Haswell: $line"
grep -q " Haswell kernels (UNETCU_GEMM_CORE=Haswell)" <<<"$line" || { echo "FAIL: forced core not used"; fail=1; }
exit $fail
