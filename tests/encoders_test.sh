#!/usr/bin/env bash
# Every encoder depth (--encoder resnet18, 34, 50, 101, 152) trains in every mode:
#   tests/encoders_test.sh devices UNET_TRAIN UNET_PREDICT UNET_SYNTHETIC_DATASET
#     each depth one epoch on one device (float32 NCHW, and bf16 NHWC), data-parallel over cpu:0,cpu:1 and pipelined over
#     them (the split searched, 1F1B, blocks recomputed); the banner names the encoder; the
#     pipeline's checkpoint resumes for a second epoch without --encoder (read from the
#     checkpoint), and another --encoder against it is refused; unet_predict reads the
#     encoder from the checkpoint (a model of another depth would not load it strictly);
#   tests/encoders_test.sh tools UNET_TRAIN - - UNET_BENCH UNET_PERFMODEL
#     --mode auto over cpu:0,cpu:1, unet_bench's tables and unet_perfmodel's prediction (its
#     parameter count: the depth's) for resnet18 and resnet50;
#   tests/encoders_test.sh processes UNET_TRAIN
#     resnet18 and resnet50 pipelined across two processes (mpirun) write the checkpoint bytes
#     of the same pipeline in one process, and dp+mp over four processes runs; so does DP over
#     two processes with --in-channels 1 (each computes the same dataset normalisation).
set -u
what="$1" train="$2" predict="${3:-}" make_data="${4:-}" bench="${5:-}" perfmodel="${6:-}"
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail=0
common=(--width-divisor 16 --image-size 64 --train-size 8 --val-size 4 --batch-size 4 --threads 1 --seed 2
        --no-progress)
run() {  # run NAME ARGS...: one run, its output in $d/NAME.log
  local name=$1
  shift
  "$@" > "$d/$name.log" 2>&1 || { echo "FAIL: $name: $*"; tail -5 "$d/$name.log"; fail=1; return 1; }
}
if [ "$what" = tools ]; then
  for e in resnet18 resnet50; do  # a BasicBlock and a Bottleneck depth (every depth's FLOPs: test_perf_model)
    run "$e-auto" "$train" --encoder "$e" "${common[@]}" --epochs 1 --mode auto --devices cpu:0,cpu:1 --dist none \
      && { grep -q "^mode auto: " "$d/$e-auto.log" && grep -q "^model: Unet($e), " "$d/$e-auto.log" \
           || { echo "FAIL: $e --mode auto"; cat "$d/$e-auto.log"; fail=1; }; }
    run "$e-bench" "$bench" --encoder "$e" --width-divisor 16 --image-size 64 --batch-size 2 --epochs 1 --warmup 1 \
      --mp-steps 1 --split-sizes 1 --devices cpu:0,cpu:1 --threads 1 --out "$d/$e-bench" \
      && { grep -q "\"encoder\": \"$e\"" "$d/$e-bench/bench.json" && [ -s "$d/$e-bench/table2.md" ] \
           || { echo "FAIL: $e unet_bench"; cat "$d/$e-bench.log"; fail=1; }; }
    run "$e-perf" "$perfmodel" --encoder "$e" --no-memory \
      && { grep -q "^| the article's setting, 2 devices" "$d/$e-perf.log" || { echo "FAIL: $e perfmodel"; fail=1; }; }
  done
  [ $fail = 0 ] && echo "ok: --mode auto, unet_bench and unet_perfmodel for resnet18 and resnet50"
  exit $fail
fi
if [ "$what" = devices ]; then
  for e in resnet18 resnet34 resnet50 resnet101 resnet152; do
    for mode in single bf16 dp mp; do
      case $mode in
        single) args=(--dist none) ;;
        bf16) args=(--precision bf16 --memory-format nhwc --dist none) ;;
        dp) args=(--mode dp --devices cpu:0,cpu:1 --dist none) ;;
        mp) args=(--mode mp --devices cpu:0,cpu:1 --split auto --schedule 1f1b --split-size 2 --recompute blocks
                  --dist none) ;;
      esac
      run "$e-$mode" "$train" --encoder "$e" "${common[@]}" --epochs 1 "${args[@]}" \
        --checkpoint "$d/$e-$mode.safetensors" || continue
      grep -q "^model: Unet($e), " "$d/$e-$mode.log" || { echo "FAIL: $e $mode: the banner"; fail=1; }
      [ "$(grep -c '^epoch 1/1 ' "$d/$e-$mode.log")" = 1 ] || { echo "FAIL: $e $mode: one epoch line"; fail=1; }
    done
    if run "$e-resume" "$train" "${common[@]}" --epochs 2 --dist none --resume "$d/$e-mp.safetensors"; then
      grep -q "^model: Unet($e), " "$d/$e-resume.log" && grep -q "^epoch 2/2 " "$d/$e-resume.log" \
        || { echo "FAIL: $e: resumed without --encoder"; cat "$d/$e-resume.log"; fail=1; }
    fi
    other=resnet34
    [ "$e" = resnet34 ] && other=resnet18
    if "$train" "${common[@]}" --epochs 2 --dist none --encoder $other --resume "$d/$e-mp.safetensors" \
      > "$d/other.log" 2>&1; then
      echo "FAIL: $e: resumed as $other"; fail=1
    else
      grep -q "error: --encoder $other contradicts the checkpoint .* trained with $e" "$d/other.log" \
        || { echo "FAIL: $e: the refusal"; cat "$d/other.log"; fail=1; }
    fi
  done
  "$make_data" "$d/images" --count 2 --image-size 64 > /dev/null || { echo "FAIL: the images"; exit 1; }
  for e in resnet18 resnet50; do
    "$predict" "$d/images/images" --checkpoint "$d/$e-single.safetensors" --out "$d/pred-$e" --device cpu \
      > "$d/pred.log" 2>&1 && [ "$(ls "$d/pred-$e" | wc -l)" = 2 ] \
      || { echo "FAIL: unet_predict with the $e checkpoint"; cat "$d/pred.log"; fail=1; }
  done
  [ $fail = 0 ] && echo "ok: five encoder depths on one device, DP and MP, resumed and predicted from their checkpoints"
  exit $fail
fi

if ! command -v mpirun >/dev/null; then echo "SKIPPED: no mpirun (tools/setup.sh installs Open MPI)"; exit 77; fi
if ! ldd "$train" | grep -q libmpi; then echo "SKIPPED: built without MPI (libopenmpi-dev)"; exit 77; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# Without leak checking under the sanitizer build: see tests/dist_test.sh.
mpi=(env "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" timeout 300 mpirun --oversubscribe --bind-to none)
for e in resnet18 resnet50; do
  pipe=(--encoder "$e" "${common[@]}" --epochs 1 --mode mp --split layer3 --split-size 2 --schedule 1f1b)
  run "$e-threads" "$train" "${pipe[@]}" --devices cpu:0,cpu:1 --dist none --checkpoint "$d/$e-threads.safetensors" \
    && run "$e-procs" "${mpi[@]}" -np 2 "$train" "${pipe[@]}" --checkpoint "$d/$e-procs.safetensors" || continue
  if cmp -s "$d/$e-threads.safetensors" "$d/$e-procs.safetensors" \
    && cmp -s "$d/$e-threads.safetensors.train" "$d/$e-procs.safetensors.train"; then
    echo "ok: $e pipelined across 2 processes equals the pipeline in one process"
  else
    echo "FAIL: $e: the checkpoints of the two pipelines differ"; fail=1
  fi
done
if run gray "${mpi[@]}" -np 2 "$train" --in-channels 1 "${common[@]}" --epochs 1 --mode dp; then
  grep -q "1 channel normalised with the training set's mean and deviation" "$d/gray.log" \
    && echo "ok: --in-channels 1, DP over 2 processes" || { echo "FAIL: --in-channels 1 over processes"; cat "$d/gray.log"; fail=1; }
fi
if run dpmp "${mpi[@]}" -np 4 "$train" --encoder resnet50 "${common[@]}" --epochs 1 --mode dp+mp \
  --pipeline-stages 2 --split layer3 --split-size 1; then
  grep -q "^model: Unet(resnet50), " "$d/dpmp.log" && [ "$(grep -c '^epoch 1/1 ' "$d/dpmp.log")" = 1 ] \
    && echo "ok: resnet50 dp+mp over 4 processes" || { echo "FAIL: dp+mp: the output"; cat "$d/dpmp.log"; fail=1; }
fi
exit $fail
