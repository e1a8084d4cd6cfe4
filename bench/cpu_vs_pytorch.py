#!/usr/bin/python3
"""Side-by-side CPU training step of unetcu and PyTorch on this machine.

The same step on both: SMP's UNet-ResNet34 (full width), BCE + Dice, Adam 1e-3, one batch of
random images, THREADS threads; float32, or with --precision bf16 mixed precision on both
(unetcu --precision bf16; PyTorch autocast bf16 on the CPU, the loss in float32), in the memory
format --memory-format gives both (nhwc: channels_last in PyTorch). For each size the two run in turn ROUNDS times
(alternated: the one that ran second runs first in the next round), each run a fresh process
timing STEPS steps after WARMUP; the table gives the median over all timed steps of each, the
range of the per-run medians, and the ratio unetcu / PyTorch (below 1: unetcu faster).

  bench/cpu_vs_pytorch.py [--build build] [--size 4x128 --size 2x256 --size 1x512]
                          [--rounds 3] [--steps 5] [--warmup 2] [--threads 2] [--out FILE.md]
                          [--precision fp32|bf16] [--memory-format nchw|nhwc]

Needs PyTorch (Debian: python3-torch, for /usr/bin/python3) and a build of bench_cpu_step."""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def processor():
    """The model name, with the family and model numbers: a virtual machine often shows only
    "AMD EPYC", which names no generation (family 25 is Zen 3/4, 26 Zen 5)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown processor"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def torch_python():
    for py in (sys.executable, "/usr/bin/python3"):
        if subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0:
            return py
    sys.exit("cpu_vs_pytorch: no Python with PyTorch found (install Debian's python3-torch)")


def run_json(cmd, env):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"cpu_vs_pytorch: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr}{p.stdout}")
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if not lines:
        sys.exit(f"cpu_vs_pytorch: no JSON line from {' '.join(cmd)}:\n{p.stdout}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--size", action="append", help="BATCHxSIZE (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="also write the table (markdown) here")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--memory-format", choices=["nchw", "nhwc"], default="nchw")
    a = ap.parse_args()
    sizes = a.size or ["4x128", "2x256", "1x512"]
    exe = os.path.join(a.build, "bench_cpu_step")
    if not os.access(exe, os.X_OK):
        sys.exit(f"cpu_vs_pytorch: {exe} not found (build first: cmake --build {a.build})")
    py = torch_python()
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads),
              "--precision", a.precision, "--memory-format", a.memory_format]
    rows, kernels, torch_version = [], "", ""
    for size in sizes:
        b, s = size.split("x")
        ours, theirs = [], []
        for r in range(a.rounds):
            runs = [("unetcu", [exe, "--json", "--size", size] + common),
                    ("torch", [py, os.path.join(ROOT, "tools", "pytorch_reference.py"), "bench",
                               "--batch", b, "--size", s] + common)]
            if r % 2:
                runs.reverse()
            for who, cmd in runs:
                res = run_json(cmd, env)
                (ours if who == "unetcu" else theirs).append(res["steps"])
                kernels = res.get("kernels", kernels)
                torch_version = res.get("torch", torch_version)
                print(f"  {size} round {r + 1} {who}: median {res['median']:.3f} s", file=sys.stderr, flush=True)
        med_u = statistics.median([t for run in ours for t in run])
        med_t = statistics.median([t for run in theirs for t in run])
        ru = [statistics.median(run) for run in ours]
        rt = [statistics.median(run) for run in theirs]
        rows.append(f"| {b} | {s}x{s} | {a.threads} | {med_u:.3f} | {min(ru):.3f}–{max(ru):.3f} | "
                    f"{med_t:.3f} | {min(rt):.3f}–{max(rt):.3f} | {med_u / med_t:.2f} |")
    out = [f"processor: {processor()}, {os.cpu_count()} logical CPUs",
           f"unetcu: {kernels}",
           f"PyTorch {torch_version} (its own oneDNN/MKL-DNN convolutions)",
           f"precision {a.precision}, memory format {a.memory_format} (both)",
           f"{a.rounds} alternated runs per size, {a.steps} timed steps after {a.warmup} per run", "",
           "| batch | image | threads | unetcu median (s) | unetcu runs | PyTorch median (s) | PyTorch runs | ratio |",
           "|---|---|---|---|---|---|---|---|"] + rows
    text = "\n".join(out) + "\n"
    print(text, end="")
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
