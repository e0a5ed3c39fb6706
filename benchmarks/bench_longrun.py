"""A long run that is killed again and again: 2 processes on the embedded data, a checkpoint every N steps with
keep_last set, `kill -9` of the whole job at random moments (during steps and saves alike) and an automatic
resume with `--train.resume latest`, until the run reaches its last step.

    python benchmarks/bench_longrun.py          # 3,000 steps, a kill every 2-5 min -> results/longrun.{json,md,png}
    python benchmarks/bench_longrun.py --quick  # 60 steps, a kill 2-5 s into each launch (CI smoke) -> benchmarks/out/

Reports the steps done, the kills and resumes, the checkpoints left on disk (never more than keep_last, no
`.tmp` folder), the memory of the job over time (RSS summed over its processes, sampled every second: no growth
from one resume to the next), and whether the final state equals that of the same run without interruption,
bitwise (parameters, optimizer, per-sample state, data position, RNG).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    REPO,
    RESULTS,
    SMOKE_OUT,
    _kb,
    _tree,
    check_out,
    count,
    ensure_embedded,
    machine_info,
    save_figure,
    torchrun,
    write_json,
)

FULL = dict(steps=3000, every=50, keep_last=2, kill_after_s=(120, 300), max_per_class=100)
QUICK = dict(steps=60, every=10, keep_last=2, kill_after_s=(2, 5), max_per_class=20)


def command(data: Path, run_dir: Path, p: dict, resume: bool) -> list[str]:
    return torchrun(2) + [
        "-m", "fastclip", "train", "--", "--config", str(REPO / "configs" / "embedded.yaml"),
        "--data.train", str(data / "train"), "--data.val", "null", "--data.batch_size", "8", "--data.workers", "1",
        "--train.epochs", "1000", "--train.max_steps", str(p["steps"]), "--train.run_dir", str(run_dir),
        "--train.device", "cpu", "--train.backend", "gloo", "--train.log_every", "10", "--train.progress", "false",
        "--train.tensorboard", "false", "--eval.every_steps", "0", "--eval.at_end", "false",
        "--checkpoint.every_steps", str(p["every"]), "--checkpoint.every_minutes", "0",
        "--checkpoint.keep_last", str(p["keep_last"]), "--optim.warmup_steps", "10",
        *(["--train.resume", "latest"] if resume else []),
    ]  # fmt: skip


def rss_mb(pid: int) -> float:
    return sum(_kb(f"/proc/{p}/status", "VmRSS:") for p in _tree(pid)) / 1024


def run_segment(cmd: list[str], log: Path, kill_after: float | None, samples: list, segment: int) -> int | None:
    """One launch of the job; killed with SIGKILL (its whole process group) after `kill_after` seconds unless it
    ends first. Returns its exit status, or None when it was killed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    # the kill clock starts at the run's header line (model built, data opened): on a loaded machine the start-up
    # alone can outlast kill_after, and a job killed before its first step would never get further
    headers = _headers(log)
    training_since = None
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        while proc.poll() is None:
            elapsed = time.perf_counter() - start
            samples.append((segment, round(elapsed, 1), rss_mb(proc.pid)))
            if training_since is None and _headers(log) > headers:
                training_since = time.perf_counter()
            trained_s = time.perf_counter() - training_since if training_since is not None else 0.0
            if kill_after is not None and trained_s >= kill_after:
                # every process of the job, as a node failure would: torchrun starts its ranks in their own
                # process groups, so killing torchrun's group alone leaves ranks running (and saving) on
                job = _tree(proc.pid)
                for pid in reversed(job):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait()
                deadline = time.perf_counter() + 30  # the next launch starts only once all of them are gone
                while any(os.path.exists(f"/proc/{pid}/stat") for pid in job[1:]) and time.perf_counter() < deadline:
                    time.sleep(0.2)
                return None
            time.sleep(1.0)
    return proc.returncode


def _headers(log: Path) -> int:
    """How many runs the log has seen start training (the trainer's header line)."""
    return log.read_text(errors="replace").count(", run ") if log.is_file() else 0


def last_step(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().strip().split("_")[-1]) if latest.is_file() else 0


def same_state(a: Path, b: Path) -> tuple[bool, str]:
    """Bitwise equality of two step folders (what tests/test_train.py checks after one resume)."""
    import torch

    def same(x, y, where):
        if torch.is_tensor(x):
            return torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), where
        if isinstance(x, dict):
            if not isinstance(y, dict) or x.keys() != y.keys():
                return False, where
            for k in x:
                ok, w = same(x[k], y[k], f"{where}.{k}")
                if not ok:
                    return ok, w
            return True, ""
        if isinstance(x, (list, tuple)):
            if len(x) != len(y):
                return False, where
            for i, (u, v) in enumerate(zip(x, y)):
                ok, w = same(u, v, f"{where}[{i}]")
                if not ok:
                    return ok, w
            return True, ""
        return x == y, where

    def load(path):
        return torch.load(path, map_location="cpu", weights_only=True)

    ma, mb = load(a / "model.pt"), load(b / "model.pt")
    for key in ("state_dict", "loss", "optimizer", "step", "samples_seen"):
        ok, where = same(ma[key], mb[key], key)
        if not ok:
            return False, where
    for r in range(2):
        ra, rb = load(a / f"rank_{r}.pt"), load(b / f"rank_{r}.pt")
        for key in ("loss_state", "data", "rng"):
            ok, where = same(ra[key], rb[key], f"rank {r} {key}")
            if not ok:
                return False, where
    return True, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    parser.add_argument("--steps", type=count(), help="override the number of steps")
    parser.add_argument("--kill-after", type=float, nargs=2, metavar=("MIN_S", "MAX_S"), help="override the kill times")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    p = dict(QUICK if args.quick else FULL)
    if args.steps:
        p["steps"] = args.steps
    if args.kill_after:
        p["kill_after_s"] = tuple(args.kill_after)
    out = args.out or (SMOKE_OUT if args.quick else RESULTS)
    work = SMOKE_OUT / ("longrun_quick" if args.quick else "longrun")
    data = ensure_embedded(SMOKE_OUT / f"embedded_mpc{p['max_per_class']}", max_per_class=p["max_per_class"])
    rng = random.Random(args.seed)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    killed_run, straight_run = work / "killed", work / "straight"

    samples: list = []
    segments = []  # (first step, steps reached, outcome, seconds)
    segment = 0
    while True:
        before = last_step(killed_run)
        kill_after = rng.uniform(*p["kill_after_s"])
        start = time.perf_counter()
        # every relaunch resumes: a kill can leave a step folder that `latest` does not name yet
        rc = run_segment(
            command(data, killed_run, p, resume=segment > 0), work / "killed.log", kill_after, samples, segment
        )
        after = last_step(killed_run)
        segments.append(
            {
                "from_step": before,
                "checkpoint_after": after,
                "outcome": "killed" if rc is None else rc,
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
        print(
            f"segment {segment}: from step {before}, checkpoint at {after}, {'killed' if rc is None else f'exit {rc}'}",
            flush=True,
        )
        leftovers = [d.name for d in (killed_run / "checkpoints").glob("*") if d.is_dir()]
        segments[-1]["checkpoint_dirs"] = sorted(leftovers)
        if rc is not None:
            if rc != 0:
                raise SystemExit(f"the job failed with status {rc}: see {work / 'killed.log'}")
            break
        segment += 1
    rc = run_segment(command(data, straight_run, p, resume=False), work / "straight.log", None, [], -1)
    if rc != 0:
        raise SystemExit(f"the uninterrupted run failed with status {rc}: see {work / 'straight.log'}")
    final = f"step_{p['steps']:08d}"
    equal, where = same_state(killed_run / "checkpoints" / final, straight_run / "checkpoints" / final)
    dirs = sorted(d.name for d in (killed_run / "checkpoints").iterdir() if d.is_dir())
    # steady memory of each launch: the median of its samples after start-up (10 s), so launches of different
    # lengths compare
    steady = []
    for k in range(len(segments)):
        values = sorted(rss for s, t, rss in samples if s == k and t >= 10) or [0.0]
        steady.append(values[len(values) // 2])
    peaks = [max((rss for s, _, rss in samples if s == k), default=0.0) for k in range(len(segments))]
    result = {
        "machine": machine_info(),
        "params": p,
        "segments": segments,
        "kills": len(segments) - 1,
        "resumes": sum(1 for s in segments if s["from_step"] > 0),
        "steps": p["steps"],
        "checkpoints_left": dirs,
        "tmp_left": [d for d in dirs if d.startswith((".tmp", ".old", ".pruned"))],
        "within_keep_last": len([d for d in dirs if d.startswith("step_")]) <= p["keep_last"],
        "final_equals_uninterrupted": equal,
        "first_difference": where,
        "rss_samples": samples,
        "peak_rss_mb_per_segment": peaks,
        "steady_rss_mb_per_segment": steady,
    }
    write_json(out / "longrun.json", result)
    text = markdown(result)
    (out / "longrun.md").write_text(text + "\n")
    plot(result, out / "longrun.png")
    print(text)
    return 0 if equal and result["within_keep_last"] and not result["tmp_left"] else 1


def markdown(r: dict) -> str:
    p = r["params"]
    steady = r["steady_rss_mb_per_segment"]
    return "\n".join([
        f"2 processes (gloo), embedded data, {r['steps']} steps, a checkpoint every {p['every']} steps, keep_last "
        f"{p['keep_last']}, `kill -9` of the whole job {p['kill_after_s'][0]}-{p['kill_after_s'][1]} s after it "
        f"starts training each time, resumed with `--train.resume latest`:", "",
        "| kills | resumes | checkpoints left | `.tmp`/`.old`/`.pruned` left | "
        "final state = uninterrupted run (bitwise) | RSS of each launch after start-up (median) |",
        "|---:|---:|---|---|---|---|",
        f"| {r['kills']} | {r['resumes']} | {', '.join(r['checkpoints_left'])} | {len(r['tmp_left'])} | "
        f"{'yes' if r['final_equals_uninterrupted'] else 'NO (' + r['first_difference'] + ')'} | "
        f"{' / '.join(f'{x:.0f}' for x in steady)} MB |",
    ])  # fmt: skip


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    offset = 0.0
    for k in range(len(r["segments"])):
        pts = [(t, rss) for s, t, rss in r["rss_samples"] if s == k]
        if pts:
            ax.plot([offset + t for t, _ in pts], [rss for _, rss in pts], color="#4c72b0")
            offset += pts[-1][0]
            ax.axvline(offset, color="#c44e52", lw=0.6, alpha=0.6)
    ax.set_xlabel("seconds of training (red: kill -9 and resume)")
    ax.set_ylabel("RSS of the job (MB)")
    ax.grid(alpha=0.3)
    save_figure(fig, path, r["machine"], "Killed and resumed: memory of the job over time", top=0.9)


if __name__ == "__main__":
    sys.exit(main())
