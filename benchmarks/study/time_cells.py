"""CPU seconds per training sample at each global batch of the study v2 plan (PLAN.md), on this machine.

    python benchmarks/study/time_cells.py [--config configs/scenes-semantic.yaml] [--batches 32 128 512] \
        [-- FASTCLIP-TRAIN-FLAGS]      (e.g. -- --train.precision bf16: each setting's cost, run by run)

For each batch, two short `fastclip train` runs (one process, OMP_NUM_THREADS=1, no evaluation, no checkpoint)
of `--short` steps and of `--samples` more samples; the difference of their CPU seconds (the trainer and its
loader worker) over the difference of their samples is the cost of a training sample without start-up. CPU
seconds, not wall: this machine's 2 cores are shared, so wall time measures the others' load; CPU seconds are
the time on a free core (inflated too under heavy load: run it on a quiet machine).
Prints one JSON object: {batch: {"cpu_s_per_sample": ..., "samples_per_cpu_s": ..., "startup_cpu_s": ...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_seconds_of_run(config: str, batch: int, steps: int, run_dir: Path, flags: list[str] = ()) -> float:
    cmd = [sys.executable, "-m", "fastclip", "train", "--", "--config", config, *flags]
    cmd += ["--data.batch_size", str(batch), "--train.max_steps", str(steps), "--train.run_dir", str(run_dir)]
    cmd += ["--eval.every_steps", "0", "--eval.at_end", "False", "--train.progress", "False"]
    cmd += ["--checkpoint.every_steps", "0", "--checkpoint.every_minutes", "0", "--optim.warmup_steps", "1"]
    cmd += ["--train.tensorboard", "False", "--train.log_every", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/scenes-semantic.yaml")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--short", type=int, default=3)
    parser.add_argument(
        "--samples", type=int, default=8192, help="samples between the two runs (start-up varies by ~2 s)"
    )
    parser.add_argument(
        "flags", nargs="*", help="after --: more `fastclip train` flags for every run (--train.precision bf16, ...)"
    )
    args = parser.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batches:
            short = cpu_seconds_of_run(args.config, batch, args.short, Path(tmp) / f"{batch}-short", args.flags)
            more = -(-args.samples // batch)  # steps
            long = cpu_seconds_of_run(args.config, batch, args.short + more, Path(tmp) / f"{batch}-long", args.flags)
            per_sample = (long - short) / (more * batch)
            out[batch] = {
                "cpu_s_per_sample": per_sample,
                "samples_per_cpu_s": 1 / per_sample,
                "startup_cpu_s": short - args.short * batch * per_sample,
            }
            print(batch, out[batch], file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
