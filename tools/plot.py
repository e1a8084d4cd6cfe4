#!/usr/bin/python3
"""Plots of unetcu's output files (matplotlib; Debian python3-matplotlib, `tools/setup.sh --plots`).

  tools/plot.py metrics RUN.csv [RUN2.jsonl ...] [--out curves.png] [--labels a,b]
      Training curves from unet_train --log files: train and validation loss (left) and
      validation IoU and Dice (right) per epoch, one colour per run, for comparing settings;
      where a run's learning rate varies (--lr-schedule, --warmup-steps), a third panel with
      each run's rate at the end of each epoch (log scale).
  tools/plot.py bench bench.json [--out-dir DIR]
      The article's figures from unet_bench's bench.json: table2.png, the mean epoch time of
      each method as bars with their standard deviation as error bars (Table 2), and table1.png,
      the model-parallel step time per cut x split size as a heat map, the best cell marked
      (Table 1).

Each PNG is written to a temporary file and renamed; the path is printed."""
import argparse
import csv
import json
import os
import sys

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plot.py: matplotlib is missing: run tools/setup.sh --plots (Debian python3-matplotlib)")


def read_metrics(path):
    """The epoch rows of a --log file (CSV or JSON Lines) as dicts of floats."""
    rows = []
    with open(path) as f:
        if path.endswith(".jsonl"):
            records = [json.loads(line) for line in f if line.strip()]
        else:
            records = list(csv.DictReader(f))
    for r in records:
        if r.get("kind") != "epoch":
            continue
        rows.append({k: float(v) for k, v in r.items() if k != "kind" and v not in ("", None)})
    if not rows:
        sys.exit(f"plot.py: {path} has no epoch rows (a unet_train --log file?)")
    return rows


def save(fig, path):
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    print(path)


def metrics(args):
    labels = args.labels.split(",") if args.labels else [os.path.splitext(os.path.basename(p))[0] for p in args.files]
    if len(labels) != len(args.files):
        sys.exit("plot.py: --labels needs one label per file")
    runs = [read_metrics(path) for path in args.files]
    scheduled = any(len({r.get("lr") for r in rows}) > 1 for rows in runs)
    fig, axes = plt.subplots(1, 3 if scheduled else 2, figsize=(15 if scheduled else 10, 4))
    ax_loss, ax_iou = axes[0], axes[1]
    for i, (rows, label) in enumerate(zip(runs, labels)):
        ep = [r["epoch"] for r in rows]
        c = f"C{i % 10}"
        ax_loss.plot(ep, [r.get("train_loss") for r in rows], color=c, label=f"{label} train")
        ax_loss.plot(ep, [r.get("val_loss") for r in rows], color=c, linestyle="--", label=f"{label} val")
        ax_iou.plot(ep, [r.get("val_iou") for r in rows], color=c, label=f"{label} IoU")
        ax_iou.plot(ep, [r.get("val_dice") for r in rows], color=c, linestyle=":", label=f"{label} Dice")
        if scheduled:
            axes[2].plot(ep, [r.get("lr") for r in rows], color=c, marker=".", label=label)
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_iou.set(xlabel="epoch", ylabel="score", title="validation IoU and Dice", ylim=(0, 1))
    if scheduled:
        axes[2].set(xlabel="epoch", ylabel="learning rate", title="learning rate (last step of each epoch)",
                    yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, args.out)


def bench(args):
    with open(args.file) as f:
        d = json.load(f)
    os.makedirs(args.out_dir, exist_ok=True)
    t2 = d.get("table2") or sys.exit(f"plot.py: {args.file} has no table2")
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["method"] for r in t2]
    ax.bar(range(len(t2)), [r["mean_epoch_s"] for r in t2], yerr=[r["std_s"] for r in t2], capsize=4,
           color=[f"C{i}" for i in range(len(t2))])
    ax.set_xticks(range(len(t2)), names, rotation=15, fontsize=8)
    ax.set(ylabel="epoch time (s)", title=f"mean epoch time per method ({d.get('image_size')}², {d.get('devices')})")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save(fig, os.path.join(args.out_dir, "table2.png"))

    t1 = d.get("table1") or sys.exit(f"plot.py: {args.file} has no table1")
    cuts = list(dict.fromkeys(r["cut_after"] for r in t1))
    splits = sorted({r["split_size"] for r in t1})
    grid = [[float("nan")] * len(splits) for _ in cuts]
    for r in t1:
        grid[cuts.index(r["cut_after"])][splits.index(r["split_size"])] = r["step_s"]
    best = min(t1, key=lambda r: r["step_s"])
    fig, ax = plt.subplots(figsize=(1.2 * len(splits) + 4, 0.4 * len(cuts) + 2))
    im = ax.imshow(grid, aspect="auto", cmap="viridis_r")
    ax.set_xticks(range(len(splits)), [str(s) for s in splits])
    ax.set_yticks(range(len(cuts)), cuts, fontsize=8)
    ax.set(xlabel="split size (samples per micro-batch)", ylabel="cut after", title="model-parallel step time (s)")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=7, color="w")
    bi, bj = cuts.index(best["cut_after"]), splits.index(best["split_size"])
    ax.add_patch(plt.Rectangle((bj - 0.5, bi - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    save(fig, os.path.join(args.out_dir, "table1.png"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("metrics")
    m.add_argument("files", nargs="+")
    m.add_argument("--out", default="curves.png")
    m.add_argument("--labels")
    b = sub.add_parser("bench")
    b.add_argument("file")
    b.add_argument("--out-dir", default=".")
    a = ap.parse_args()
    metrics(a) if a.cmd == "metrics" else bench(a)


if __name__ == "__main__":
    main()
