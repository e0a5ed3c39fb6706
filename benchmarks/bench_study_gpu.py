"""What one run of a study costs on a device, alone and with others beside it: the study's own `fastclip train`
command (benchmarks/study/runner.py: its spec's keys, objective and first setting) for --steps steps at each batch,
K copies at once for each K of --parallel, every step logged, no evaluation or checkpoint.

    python benchmarks/bench_study_gpu.py --spec benchmarks/study/v2-gpu.yaml --out benchmarks/results/gpu_study

Prints and saves (study_timing.json / .md) the median seconds per step of one run, the samples/s of all K together,
and what a whole run (the spec's epochs over its training split, evaluation not counted) would take. The data is a
small set made with the dataset's own `make` command at --train-size scenes (a step's cost does not depend on how
many samples the split holds), unless the spec's data is already there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.study import records  # noqa: E402
from benchmarks.study import spec as spec_module
from benchmarks.study.hours import QUIET  # noqa: E402
from benchmarks.study.plan import Run  # noqa: E402
from benchmarks.study.runner import _env, command, make_command, train_samples  # noqa: E402
from fastclip.data.format import MANIFEST_NAME  # noqa: E402


def small_data(dataset, out: Path, train_size: int) -> Path:
    """The dataset's `make` command with its split sizes cut to train_size / 10 (train / the others)."""
    if (out / "train" / MANIFEST_NAME).is_file():
        return out
    cmd = make_command(dataset.make, out)
    sizes = {"--num-train": train_size, "--num-val": train_size // 10, "--num-test": train_size // 10,
             "--num-novel": train_size // 10, "--shard-size": max(100, train_size // 8)}  # fmt: skip
    for flag, value in sizes.items():
        if flag in cmd:
            cmd[cmd.index(flag) + 1] = str(value)
    subprocess.run(cmd, cwd=records.REPO, check=True, stdout=subprocess.DEVNULL)
    return out


def time_runs(spec, name: str, data: Path, batch: int, copies: int, steps: int, work: Path) -> dict:
    objective = spec.objectives_at(batch)[0]
    setting = tuple(spec.objectives[objective].settings(batch)[0].items())
    run = Run(name, batch, objective, setting, spec.tune_seeds[0], "timing", spec.datasets[name].epochs)
    procs, folders = [], []
    start = time.perf_counter()
    for i in range(copies):
        folder = work / f"{name}_{batch}_{copies}_{i}"
        extra = {**QUIET, "train.max_steps": steps, "train.run_dir": folder, "train.seed": 100 + i}
        procs.append(subprocess.Popen(command(spec, run, data, extra), cwd=records.REPO, env=_env(),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))  # fmt: skip
        folders.append(folder)
    errors = [p.communicate()[1].decode().strip().splitlines()[-1:] for p in procs]
    wall = time.perf_counter() - start
    failed = [e for p, e in zip(procs, errors) if p.returncode != 0]
    if failed:
        raise SystemExit(f"bench_study_gpu: a timing run at batch {batch} x{copies} failed: {failed[0]}")
    per_step = []
    for folder in folders:
        logged = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if "step_time" in x]
        per_step.append(statistics.median(batch / r["samples_per_s"] for r in logged if r["step"] > 5))
    s = statistics.median(per_step)
    run_steps = spec.datasets[name].epochs * spec_train_size(spec, name, data) // batch
    return {"dataset": name, "batch": batch, "objective": objective, "copies": copies, "s_per_step": round(s, 5),
            "samples_per_s_all": round(copies * batch / s, 1), "run_steps": run_steps,
            "run_minutes": round(run_steps * s / 60, 2), "wall_s": round(wall, 1)}  # fmt: skip


def spec_train_size(spec, name: str, data: Path) -> int:
    """The training split's size a real run has: read off the dataset's make command (--num-train), else the data."""
    make = spec.datasets[name].make or []
    return int(make[make.index("--num-train") + 1]) if "--num-train" in make else train_samples(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, default=Path("benchmarks/study/v2-gpu.yaml"))
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default: the spec's")
    p.add_argument("--parallel", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--train-size", type=int, default=4000)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_study"))
    args = p.parse_args()
    try:
        spec = spec_module.load(args.spec)
    except spec_module.SpecError as e:
        raise SystemExit(f"bench_study_gpu: {e}") from None
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_study_gpu"
    rows = []
    for name, dataset in spec.datasets.items():
        data = dataset.data if (dataset.data / "train" / MANIFEST_NAME).is_file() else None
        data = data or small_data(dataset, work / f"data_{name}", args.train_size)
        for batch in args.batches or spec.batches:
            for copies in args.parallel:
                row = time_runs(spec, name, data, batch, copies, args.steps, work)
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = {"spec": str(args.spec), "device": spec.device, "steps": args.steps, "cores": os.cpu_count(), "date": now}
    (args.out / "study_timing.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# A study run's cost ({args.spec}, device {spec.device}, {os.cpu_count()} cores, {now})", "",
             "| dataset | batch | objective | runs at once | s/step (one run) | samples/s (all) | steps a run | "
             "minutes a run |", "|---|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['batch']} | {r['objective']} | {r['copies']} | {r['s_per_step']:.4f} | "
                     f"{r['samples_per_s_all']:,.0f} | {r['run_steps']:,} | {r['run_minutes']:.1f} |")  # fmt: skip
    (args.out / "study_timing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
