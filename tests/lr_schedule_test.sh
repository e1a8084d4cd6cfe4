#!/usr/bin/env bash
# unet_train's learning-rate schedules are PyTorch's: every step's rate, as the metrics file's
# step rows give it (--log-every 1; the rate the first optimizer held for the step: in the
# pipeline, stage 0's), against torch.optim.lr_scheduler's stepped once per
# optimizer step (LinearLR warmup; SequentialLR into CosineAnnealingLR or PolynomialLR,
# ChainedScheduler beside StepLR), in one-device, data-parallel and pipeline runs. The file
# writes 9 significant digits: agreement to 1e-8 relative. Skipped (77) without Debian's
# python3-torch, with the reason.
set -u
train="$1"
. "$(dirname "$0")/python_test_lib.sh"
need_python torch torch "Debian python3-torch"
small=(--image-size 32 --width-divisor 16 --train-size 24 --val-size 4 --epochs 3 --no-progress --log-every 1)

# case NAME "SCHEDULE ARGS FOR PYTHON" unet_train flags...
case_() {
  local name=$1 spec=$2
  shift 2
  if ! "$train" "${small[@]}" --log "$d/$name.csv" "$@" > "$d/$name.out" 2>&1; then
    echo "FAIL: $name: unet_train failed"; cat "$d/$name.out"; fail=1; return
  fi
  if ! "$py" - "$d/$name.csv" $spec <<'EOF'; then
import csv, sys, warnings
import torch
from torch.optim import lr_scheduler as S
warnings.simplefilter("ignore")  # SequentialLR's note on step(epoch)
path, kind, lr, warmup, per_epoch = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
extra = [float(x) for x in sys.argv[6:]]
rows = [r for r in csv.DictReader(open(path)) if r["kind"] == "step"]
got = [float(r["lr"]) for r in rows]
T = len(got)
assert T > 0 and T % per_epoch == 0, f"{T} step rows for epochs of {per_epoch} steps"
opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
warm = S.LinearLR(opt, 1 / warmup, 1.0, total_iters=warmup - 1) if warmup > 1 else None
if kind == "constant":
    sched = warm
elif kind == "step":
    main = S.StepLR(opt, step_size=int(extra[0]) * per_epoch, gamma=extra[1])
    sched = S.ChainedScheduler([warm, main]) if warm else main
else:
    rest = T - (warmup if warm else 0)
    main = (S.CosineAnnealingLR(opt, T_max=rest, eta_min=extra[0]) if kind == "cosine"
            else S.PolynomialLR(opt, total_iters=rest, power=extra[0]))
    sched = S.SequentialLR(opt, [warm, main], milestones=[warmup]) if warm else main
want = []
for _ in range(T):
    want.append(opt.param_groups[0]["lr"])
    opt.step()
    if sched:
        sched.step()
bad = [(t, g, w) for t, (g, w) in enumerate(zip(got, want)) if abs(g - w) > 1e-8 * abs(w)]
for t, g, w in bad[:5]:
    print(f"step {t}: unet_train {g!r}, PyTorch {w!r}")
sys.exit(1 if bad else 0)
EOF
    echo "FAIL: $name: the rates differ from PyTorch's"; fail=1
  fi
}

# 24 images in batches of 4: 6 steps an epoch (DP: 12 per replica in batches of 2), 18 in all.
case_ cosine_single "cosine 0.001 4 6 1e-05" --batch-size 4 --lr-schedule cosine --warmup-steps 4 --min-lr 1e-5
case_ poly_dp "poly 0.002 0 6 2" --batch-size 2 --lr 0.002 --mode dp --devices cpu:0,cpu:1 --lr-schedule poly \
  --lr-power 2
case_ step_mp "step 0.001 5 6 1 0.5" --batch-size 4 --mode mp --devices cpu:0,cpu:1 --split-size 2 \
  --lr-schedule step --lr-step-epochs 1 --lr-gamma 0.5 --warmup-steps 5
case_ warmup_single "constant 0.001 7 6" --batch-size 4 --warmup-steps 7
case_ constant_single "constant 0.001 0 6" --batch-size 4
# The run's header names the schedule; its epoch lines give the last step's rate.
grep -q "adam lr 0.001, cosine to 1e-05, 4 warmup steps" "$d/cosine_single.out" ||
  { echo "FAIL: the header does not name the schedule"; cat "$d/cosine_single.out"; fail=1; }
grep -qE "^epoch 3/3 .*  lr 0\.00025( |$)" "$d/step_mp.out" ||
  { echo "FAIL: the last epoch line does not give lr 0.00025"; cat "$d/step_mp.out"; fail=1; }
exit $fail
