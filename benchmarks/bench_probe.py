"""Time of the linear probe and kNN (fastclip/eval/probe.py) on 10,000 x 512 training features, the size
`fastclip eval --linear-probe` caps its training features at by default (--probe-max-train; the trainer's
eval.probe_max_train is 5,000); the target is under 30 s on 2 cores.

    OMP_NUM_THREADS=2 python benchmarks/bench_probe.py            # prints the times and accuracies, saves them
    python benchmarks/bench_probe.py --train 20000 --classes 100 --out /tmp/probe.md

Features: one Gaussian cluster per class (means drawn at unit scale, noise of scale `--noise`), 10 classes,
2,000 test features; the probe (C sweep and refit) and the kNN (both k) are timed separately, in wall time and
in this process's CPU time (the machine's other load inflates the first, not the second).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from fastclip.eval.probe import LabelledFeatures, knn_top1, linear_probe


def clusters(n: int, dim: int, classes: int, noise: float, rng) -> LabelledFeatures:
    means = np.random.default_rng(1234).standard_normal((classes, dim)).astype(np.float32) / np.sqrt(dim)
    labels = rng.integers(0, classes, n)
    features = means[labels] + noise * rng.standard_normal((n, dim)).astype(np.float32) / np.sqrt(dim)
    return LabelledFeatures(features.astype(np.float32), labels.astype(np.int64))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=10000)
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--noise", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "probe_time.md")
    args = parser.parse_args(argv)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line)
        lines.append(line)

    rng = np.random.default_rng(0)
    train = clusters(args.train, args.dim, args.classes, args.noise, rng)
    test = clusters(args.test, args.dim, args.classes, args.noise, rng)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    say(
        f"{args.train} x {args.dim} training features, {args.test} test, {args.classes} classes, "
        f"OMP_NUM_THREADS {threads}"
    )
    started, cpu = time.perf_counter(), time.process_time()
    top1, c = linear_probe(train, test)
    probe_s, probe_cpu = time.perf_counter() - started, time.process_time() - cpu
    say(f"linear probe  {probe_s:6.1f} s ({probe_cpu:5.1f} s CPU)  top-1 {100 * top1:.2f}%  (C = {c:g})")
    started, cpu = time.perf_counter(), time.process_time()
    knn = knn_top1(train, test, (20, 200))
    knn_s, knn_cpu = time.perf_counter() - started, time.process_time() - cpu
    say(
        f"kNN k=20,200  {knn_s:6.1f} s ({knn_cpu:5.1f} s CPU)  top-1 "
        + ", ".join(f"{100 * v:.2f}%" for v in knn.values())
    )
    total = probe_s + knn_s
    say(f"total         {total:6.1f} s ({probe_cpu + knn_cpu:5.1f} s CPU)  ({'under' if total < 30 else 'OVER'} 30 s)")
    say(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/bench_probe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.write_text(f"`OMP_NUM_THREADS={threads} {command.strip()}`\n\n```\n" + "\n".join(lines) + "\n```\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
