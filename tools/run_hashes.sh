#!/usr/bin/env bash
# Prints, for five fixed-seed training runs of unet_train, the SHA-256 of the checkpoint it
# writes (model and optimizer state) and of its epoch lines with the times taken out:
# one device, DP over cpu:0,cpu:1, a 1F1B pipeline over cpu:0,cpu:1, DP across two processes
# and dp+mp over four processes (both under mpirun). Two builds that must train alike (a
# refactoring, say) print the same table:
#
#   tools/run_hashes.sh build-before/unet_train > before.txt
#   tools/run_hashes.sh build/unet_train > after.txt && diff before.txt after.txt
set -euo pipefail
train=${1:?usage: tools/run_hashes.sh UNET_TRAIN}
command -v mpirun >/dev/null || { echo "run_hashes: no mpirun (tools/setup.sh installs Open MPI)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
mpi=(mpirun --oversubscribe --bind-to none)
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
common=(--width-divisor 16 --image-size 64 --train-size 24 --val-size 8 --epochs 2 --threads 1 --seed 5
        --no-progress)
run() {  # NAME COMMAND...: the checkpoint's hashes and the epoch lines' without their times
  local name=$1
  shift
  "$@" --checkpoint "$d/$name.safetensors" > "$d/$name.log" 2>&1 || { cat "$d/$name.log" >&2; exit 1; }
  # An epoch line's times and rates vary; its losses and metrics do not.
  local lines
  lines=$(grep '^epoch ' "$d/$name.log" | sed -E 's/time [0-9.]+s/time T/; s/[0-9.]+ img\/s/T img\/s/g; s/waited [0-9.]+s/waited T/')
  printf '%-8s %s %s %s (%d epoch lines)\n' "$name" \
    "$(sha256sum < "$d/$name.safetensors" | cut -c1-16)" "$(sha256sum < "$d/$name.safetensors.train" | cut -c1-16)" \
    "$(printf '%s\n' "$lines" | sha256sum | cut -c1-16)" "$(printf '%s\n' "$lines" | grep -c .)"
}
run single "$train" "${common[@]}" --batch-size 4 --dist none
run dp "$train" "${common[@]}" --batch-size 2 --mode dp --devices cpu:0,cpu:1 --dist none
run mp1f1b "$train" "${common[@]}" --batch-size 4 --mode mp --devices cpu:0,cpu:1 --split layer3 --split-size 2 \
  --schedule 1f1b --dist none
run dp_np2 "${mpi[@]}" -np 2 "$train" "${common[@]}" --batch-size 2 --mode dp
run dpmp_np4 "${mpi[@]}" -np 4 "$train" "${common[@]}" --batch-size 4 --mode dp+mp --pipeline-stages 2 --split layer3 \
  --split-size 2
