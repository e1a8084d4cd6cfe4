#!/usr/bin/env bash
# The commands tools/gpu_check.sh runs on a GPU at 512² — unet_train single (fp32, bf16 NHWC,
# bf16 NHWC with CUDA graphs), under --profile with UNETCU_CUDA_SYNC=1, as one launched data-
# parallel process, the pipeline as two stages on one GPU, unet_bench on cuda:0 — here at tiny
# sizes, plus data parallelism over two GPUs, a resumed run, gradient clipping and accumulation
# (eager and in a CUDA graph) and unet_predict on the GPU (also in bf16 NHWC batches with
# flips). In the CUDA emulator build (ctest "cuda-emu: ..."), so the host side of every GPU run
# (flags, the trainer's GPU paths, checkpoints from device memory, the epoch line gpu_check.sh
# reads its figures from) has run before a GPU is lent.
#
#   tests/cuda_train_test.sh GROUP unet_train unet_predict unet_bench unet_synthetic_dataset
#
# GROUP picks the runs, each group its own ctest case (they run side by side under ctest -j):
# single (float32 with a checkpoint, its resume, prediction from it; a GPU of 4 MiB refusing
# the step; three classes on crops and tiled prediction), graphs (bf16 NHWC eager and as a
# CUDA graph), fallback (bf16 NHWC where the emulated cuDNN refuses unaligned channels),
# accumulate (accumulation eager and as a graph), launched (the profile and one launched
# process), dp (two GPUs), recompute (two GPUs, synchronised batch norm, every block
# recomputed), mp (the pipeline on one GPU), auto and auto_limit (--mode auto over two GPUs,
# under their free memory and under --max-memory 3M), bench, encoders (resnet50's Bottlenecks
# in float32 and bf16 NHWC), channels (one 16-bit gray channel, a resnet18 started from a .pth,
# and prediction from its checkpoint).
set -u
group=$1 train=$2 predict=$3 bench=$4 make_data=$5
case "$group" in single|graphs|fallback|accumulate|launched|dp|recompute|mp|auto|auto_limit|bench|encoders|channels) ;;
  *) echo "FAIL: unknown group '$group'"; exit 1 ;; esac
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
export UNETCU_CACHE_DIR="$d/cache"  # the algorithm choices: this test's own
fail=0
model=(--image-size 64 --width-divisor 8 --train-size 8 --val-size 2 --no-progress)
tiny=("${model[@]}" --batch-size 2 --epochs 3)

# run NAME COMMAND...: exit status 0, no warning (a refused capture says one and goes on eagerly).
run() {
  local name=$1 start=$SECONDS
  shift
  "$@" > "$d/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - start)) s"
  if [ "$rc" != 0 ]; then
    echo "FAIL: $name exited non-zero: $*"
    tail -15 "$d/$name.log" | sed 's/^/  /'
    fail=1
    return 1
  fi
  if grep -qi "warning" "$d/$name.log"; then
    echo "FAIL: $name warned:"
    grep -i "warning" "$d/$name.log" | sed 's/^/  /'
    fail=1
  fi
}
# expect NAME PATTERN WHAT: the log of NAME has a line matching PATTERN.
expect() {
  grep -qE "$2" "$d/$1.log" || { echo "FAIL: $1: $3"; sed 's/^/  /' "$d/$1.log" | tail -15; fail=1; }
}
# The figures gpu_check.sh takes from each epoch line (its train_result): images/s after
# val_dice, and the GPU's peak memory.
epochs() {
  local n
  n=$(grep -cE '^epoch [0-9]+/3 .* val_dice [0-9.]+ +[0-9.]+ img/s .*peak_mem [0-9]+ MiB' "$d/$1.log")
  [ "$n" = 3 ] || { echo "FAIL: $1: $n of 3 epoch lines give gpu_check.sh's img/s and peak_mem"; sed 's/^/  /' "$d/$1.log" | tail -15; fail=1; }
}
losses() { sed -nE 's/^epoch ([0-9]+)\/[0-9]+ .* loss ([0-9.]+) .*/\1 \2/p' "$d/$1.log"; }

if [ "$group" = single ]; then
  # One GPU, float32 (TF32 allowed, any algorithm: the search's fastest), with a checkpoint.
  run single "$train" "${tiny[@]}" --device cuda:0 --checkpoint "$d/m.safetensors" --log "$d/m.csv" &&
    { epochs single; expect single '^strategy: one device, cuda:0$' "strategy line"; }
  [ -s "$d/m.safetensors" ] && [ -s "$d/m.safetensors.train" ] || { echo "FAIL: no checkpoint written"; fail=1; }
  [ "$(grep -c . "$d/m.csv" 2>/dev/null)" = 4 ] || { echo "FAIL: the metrics log has not a header and 3 rows"; fail=1; }
  # A GPU of 4 MiB (--max-memory): the step does not fit; one line names the device, the
  # allocation, the blocks it would take and the limit.
  "$train" "${tiny[@]}" --device cuda:0 --max-memory 4M > "$d/small.log" 2> "$d/small.err"
  rc=$?
  [ "$rc" = 1 ] && [ "$(wc -l < "$d/small.err")" = 1 ] &&
    grep -qE '^unet_train: error: out of device memory on cuda:0: allocating [0-9]+ bytes with [0-9]+ bytes in tensors \(the device.s blocks would take [0-9]+ bytes, over the limit of 4194304 bytes \(--max-memory\)\)$' "$d/small.err" ||
    { echo "FAIL: --max-memory 4M: exit $rc, expected exit 1 and one line naming the limit:"; sed 's/^/  /' "$d/small.err"; fail=1; }
  # Resumed for a fourth epoch.
  run resume "$train" "${model[@]}" --batch-size 2 --epochs 4 --device cuda:0 --resume "$d/m.safetensors" &&
    expect resume '^epoch 4/4 ' "the resumed run has no epoch 4"
  # Prediction on the GPU from the float32 run's checkpoint.
  "$make_data" "$d/data" --count 2 --image-size 64 > /dev/null || { echo "FAIL: dataset"; fail=1; }
  run predict "$predict" "$d/data/images" --checkpoint "$d/m.safetensors" --width-divisor 8 --image-size 64 \
    --masks "$d/data/masks" --device cuda:0 --out "$d/pred" &&
    expect predict '^all 2 images: IoU [0-9.]+  Dice [0-9.]+$' "no IoU/Dice summary"
  # ... and in one batch, bf16 and channels-last, with the left-right flip.
  run predict_bf16 "$predict" "$d/data/images" --checkpoint "$d/m.safetensors" --width-divisor 8 --image-size 64 \
    --device cuda:0 --out "$d/pred_bf16" --batch-size 2 --precision bf16 --memory-format nhwc --tta hflip &&
    expect predict_bf16 '^2 images in [0-9.]+ s .*, batch 2, bf16 NHWC, tta hflip, cuda:0$' "no summary line"
  # Three classes on crops (bf16 NHWC): the multiclass losses, the confusion matrix on the
  # device, tiled validation; then tiled prediction on the GPU from the checkpoint's settings.
  run classes "$train" --classes 3 --image-size 160x96 --crop-size 64 --width-divisor 8 --train-size 8 --val-size 2 \
    --batch-size 2 --epochs 2 --no-progress --device cuda:0 --precision bf16 --memory-format nhwc \
    --checkpoint "$d/c3.safetensors" && expect classes '^epoch 2/2 .* val_miou [0-9.]+ ' "no mIoU epoch line"
  "$make_data" "$d/cdata" --count 2 --size 160x96 --classes 3 > /dev/null || { echo "FAIL: 3-class dataset"; fail=1; }
  run predict_classes "$predict" "$d/cdata/images" --checkpoint "$d/c3.safetensors" --masks "$d/cdata/masks" \
    --device cuda:0 --batch-size 4 --out "$d/cpred" &&
    expect predict_classes '^all 2 images: mIoU [0-9.]+ ' "no mIoU summary"
fi
if [ "$group" = graphs ]; then
  # Mixed precision, channels-last; then the same replayed as a CUDA graph: the same printed
  # losses (--deterministic; the CUDA suite holds the graph step to the eager one bit for bit).
  run bf16 "$train" "${tiny[@]}" --device cuda:0 --precision bf16 --memory-format nhwc --deterministic && epochs bf16
  run bf16g "$train" "${tiny[@]}" --device cuda:0 --precision bf16 --memory-format nhwc --deterministic --cuda-graphs &&
    { epochs bf16g; expect bf16g '^strategy: one device, cuda:0, CUDA graphs$' "strategy line"; }
  [ -n "$(losses bf16)" ] && [ "$(losses bf16)" = "$(losses bf16g)" ] ||
    { echo "FAIL: bf16 losses with CUDA graphs differ from eager:"; paste <(losses bf16) <(losses bf16g) | sed 's/^/  /'; fail=1; }
fi
if [ "$group" = fallback ]; then
  # The emulated cuDNN made to refuse what tensor-core kernels may (emulator/README.md): NHWC
  # layers whose channel counts are not multiples of 8 run in NCHW, one note a layer; with no
  # algorithm for them in any format, on channels padded to multiples of 8, also replayed as a
  # CUDA graph. The emulator sums in one order whatever the layout, and zero channels add
  # nothing: the losses are those of the run that refuses nothing.
  bf=("${tiny[@]}" --device cuda:0 --precision bf16 --memory-format nhwc --deterministic)
  run plain "$train" "${bf[@]}" && epochs plain
  run nchw env UNETCU_EMU_CUDNN_ALIGN8=nhwc "$train" "${bf[@]}" && {
    epochs nchw
    expect nchw '^unetcu: the convolution in encoder.stem .*bfloat16 NHWC input 2x3x64x64.*; it runs in NCHW' "no note naming the stem's fallback"
    n=$(grep -c 'encoder.stem' "$d/nchw.log")
    [ "$n" = 1 ] || { echo "FAIL: nchw: $n notes name the stem, not 1"; fail=1; }
  }
  run padded env UNETCU_EMU_CUDNN_ALIGN8=all "$train" "${bf[@]}" --cuda-graphs && {
    epochs padded
    expect padded '^unetcu: the convolution in encoder.stem .*; it runs with channels padded with zeros to 8 in and 8 out' "no note naming the stem's padding"
    expect padded '^unetcu: the convolution in segmentation_head .*input 2x2x64x64, weight 1x2x3x3.*padded with zeros to 8 in and 8 out' "no note naming the head's padding"
    expect padded '^strategy: one device, cuda:0, CUDA graphs$' "strategy line"
  }
  for r in nchw padded; do
    [ -n "$(losses plain)" ] && [ "$(losses plain)" = "$(losses $r)" ] ||
      { echo "FAIL: $r losses differ from the run without fallbacks:"; paste <(losses plain) <(losses $r) | sed 's/^/  /'; fail=1; }
  done
fi
if [ "$group" = accumulate ]; then
  # Two batches accumulated per step, eager and as one graph holding both: the same losses.
  run acc "$train" "${tiny[@]}" --device cuda:0 --precision bf16 --memory-format nhwc --deterministic \
    --accumulate-grad-batches 2 && epochs acc
  run accg "$train" "${tiny[@]}" --device cuda:0 --precision bf16 --memory-format nhwc --deterministic \
    --accumulate-grad-batches 2 --cuda-graphs && epochs accg
  [ -n "$(losses acc)" ] && [ "$(losses acc)" = "$(losses accg)" ] ||
    { echo "FAIL: accumulated losses with CUDA graphs differ from eager:"; paste <(losses acc) <(losses accg) | sed 's/^/  /'; fail=1; }
fi
if [ "$group" = launched ]; then
  # gpu_check.sh's profile step: the per-op table.
  UNETCU_CUDA_SYNC=1 run profile "$train" "${model[@]}" --batch-size 2 --epochs 1 --device cuda:0 --precision bf16 --memory-format nhwc \
    --profile "$d/trace.json" && expect profile '^\| op \| calls' "no per-op table"
  [ -s "$d/trace.json" ] || { echo "FAIL: no profile trace"; fail=1; }
  # One process of a launched job (torchrun's variables, world 1): an NCCL rank through NCCL_COMM_ID,
  # accumulating two batches a step (the all-reduce after the second one's backward).
  RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 \
    NCCL_COMM_ID=127.0.0.1:29562 run launched "$train" "${tiny[@]}" --mode dp --dist env --accumulate-grad-batches 2 &&
    { epochs launched; expect launched '2 batches accumulated per optimizer step \(4 images\)' "no accumulation on the data line"; }
fi
if [ "$group" = dp ]; then
  # Data parallelism over two GPUs, NCCL inside the graph, with a learning-rate schedule (each
  # replica's eager optimizer takes the step's rate) and gradient clipping (on the device).
  run dp "$train" "${tiny[@]}" --mode dp --devices cuda:0,cuda:1 --cuda-graphs --lr-schedule cosine --warmup-steps 2 \
    --clip-grad-norm 0.5 &&
    { epochs dp; expect dp '^epoch 3/3 .*  lr [0-9.e-]+$' "no learning rate on the last epoch line"
      expect dp 'gradients clipped to norm 0.5$' "no gradient clipping on the data line"
      expect dp '^epoch 3/3 .*  grad_norm [0-9.e+-]+ \(max [0-9.e+-]+, [0-9]+/[0-9]+ clipped\)' "no gradient norms on the epoch line"; }
fi
if [ "$group" = recompute ]; then
  # Synchronised batch norm over NCCL, every block recomputed in the backward (its batch-norm
  # all-reduces run again there, in the same order on both ranks): the losses of the run
  # without recomputation (--deterministic: the same kernels).
  dpr=("${model[@]}" --batch-size 2 --epochs 2 --mode dp --devices cuda:0,cuda:1 --sync-bn --deterministic)
  run dp_plain "$train" "${dpr[@]}" && run dp_recompute "$train" "${dpr[@]}" --recompute blocks &&
    { expect dp_recompute '^model: .*every block recomputed in the backward$' "no recompute on the model line"
      [ -n "$(losses dp_plain)" ] && [ "$(losses dp_plain)" = "$(losses dp_recompute)" ] ||
        { echo "FAIL: dp losses with --recompute blocks differ:"; paste <(losses dp_plain) <(losses dp_recompute) | sed 's/^/  /'; fail=1; }; }
fi
if [ "$group" = encoders ]; then
  r50=(--image-size 64 --width-divisor 16 --train-size 4 --val-size 2 --no-progress --batch-size 2 --epochs 3
       --device cuda:0 --encoder resnet50)
  run r50 "$train" "${r50[@]}" && { epochs r50; expect r50 '^model: Unet\(resnet50\), ' "the banner names resnet50"; }
  run r50bf16 "$train" "${r50[@]}" --precision bf16 --memory-format nhwc && epochs r50bf16
fi
if [ "$group" = channels ]; then
  "$make_data" "$d/gray" --count 6 --image-size 64 --channels 1 --bit-depth 16 > /dev/null
  run gray "$train" --data "$d/gray" --image-size 64 --width-divisor 16 --no-progress --batch-size 2 --epochs 3 \
    --device cuda:0 --in-channels 1 --encoder resnet18 --encoder-weights "$(dirname "$0")/golden/resnet18_w16.pth" \
    --checkpoint "$d/gray.safetensors" && { epochs gray; expect gray "1 channel normalised" "the data line"; }
  run graypred "$predict" "$d/gray/images" --checkpoint "$d/gray.safetensors" --device cuda:0 --out "$d/graypred" &&
    expect graypred '^6 images in ' "six predictions"
fi
if [ "$group" = mp ]; then
  # The article's pipeline on one GPU (two stages, two streams), micro-batches of 1, as a graph;
  # its stages' optimizers take each step's rate without waiting for their streams, and clip by
  # both stages' gradient norm (read from their streams).
  run mp "$train" "${model[@]}" --batch-size 4 --epochs 3 --mode mp --devices cuda:0,cuda:0 --split-size 1 --cuda-graphs \
    --lr-schedule step --lr-step-epochs 1 --lr-gamma 0.5 --clip-grad-norm 0.5 &&
    { epochs mp; expect mp '^epoch 3/3 .*  lr 0.00025  live_micro_batches' "not lr 0.00025 on the last epoch line"
      expect mp '^epoch 3/3 .*  grad_norm [0-9.e+-]+ \(max [0-9.e+-]+, [0-9]+/[0-9]+ clipped\)  lr ' "no gradient norms on the epoch line"; }
fi
if [ "$group" = auto ] || [ "$group" = auto_limit ]; then
  # --mode auto over two GPUs: without --max-memory the limit is their free memory (everything
  # fits); under 3 MiB each (width/16: one GPU's plain step predicted at 3.3 MiB, DP's 2.8) the
  # memory model's choice. Each times one plan of each kind and trains the fastest measured,
  # its measured peak under the limit.
  limit=
  [ "$group" = auto_limit ] && limit=3M
  for name in "$group"; do
    run "$name" "$train" --image-size 64 --width-divisor 16 --train-size 8 --val-size 2 --no-progress --batch-size 4 --epochs 1 --mode auto \
      --devices cuda:0,cuda:1 ${limit:+--max-memory $limit} &&
      { expect "$name" '^chosen: ' "no chosen plan"
        expect "$name" '^\| dp x2' "no DP plan in the table"
        expect "$name" '^\| mp x2' "no MP plan in the table"
        expect "$name" '^epoch 1/1 ' "no epoch"
        chosen=$(sed -n 's/^chosen: //p' "$d/$name.log")
        awk -F'|' -v chosen="$chosen" -v limit="${limit%M}" '
            /^\| (single|dp|mp)/ {
              n = $2; gsub(/^ +| +$/, "", n); t = $4; gsub(/ /, "", t); p = $6; gsub(/ /, "", p)
              if (t !~ /^[0-9.]+$/) next
              if (best == "" || t + 0 < best + 0) best = t
              if (n == chosen) { mine = t; peak = p }
            }
            END { exit !(mine != "" && mine + 0 == best + 0 && (limit == "" || peak + 0 <= limit)) }' "$d/$name.log" ||
          { echo "FAIL: $name: the chosen plan is not the fastest one measured under the limit"; sed -n '/^mode auto/,/^chosen/p' "$d/$name.log" | sed 's/^/  /'; fail=1; }; }
  done
fi
if [ "$group" = bench ]; then
  # unet_bench on cuda:0 (one device: DP of one replica, MP as two stages on it).
  # (Table 1 runs every cut: a narrower model and one step per cell.)
  run bench "$bench" --devices cuda:0 --image-size 64 --width-divisor 16 --batch-size 2 --mp-batch 2 \
    --split-sizes 1 --epochs 1 --warmup 0 --mp-steps 1 --epoch-images 2 --out "$d/bench" &&
    { [ "$(grep -cE '^\| (single|DP ring|MP best)' "$d/bench.log")" = 3 ] ||
      { echo "FAIL: bench: not the three Table 2 rows single, DP ring, MP best"; fail=1; }; }
fi
exit "$fail"
