"""launch/slurm.sbatch on a real SLURM cluster: is a stopped job requeued when it should be, and only then, and does
the requeued job end where an uninterrupted one does, bitwise?

    python benchmarks/bench_slurm.py --sbatch-args "--gres=none --cpus-per-task 1 --mem 4G --time 15"
    python benchmarks/bench_slurm.py --preempt-partition high   # and a preemption by a job in a higher-tier partition

Four jobs of the same tiny run (embedded data, 2 tasks, `--steps` steps), one after the other:
- `reference`: not disturbed;
- `usr1`: `scancel --signal=USR1` once it has trained `--stop-after` steps (what `--signal=USR1@120` sends before
  the time limit): expected requeued, then to finish;
- `preempted` (with --preempt-partition): a job of that partition's higher PriorityTier takes the node, SIGTERM
  to the tasks in GraceTime: expected requeued, then to finish;
- `cancelled`: `scancel` once it has trained `--stop-after` steps: expected not requeued.
A finished job's last checkpoint is compared with the reference's (parameters, optimizer, per-sample state, data
position, RNG). Writes <out>/slurm.{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_longrun import same_state

from common import REPO, RESULTS, ensure_embedded, machine_info, write_json


def sbatch(args: argparse.Namespace, data: Path, run_dir: Path, log: Path) -> str:
    cmd = [
        "sbatch", "--parsable", "--nodes", "1", "--ntasks-per-node", str(args.ntasks), "--output", str(log),
        *shlex.split(args.sbatch_args), *(["--partition", args.partition] if args.partition else []),
        "launch/slurm.sbatch", "configs/embedded.yaml", "--data.train", str(data / "train"), "--data.val", "null",
        "--data.batch_size", "16", "--data.workers", "1", "--train.epochs", "1000",
        "--train.max_steps", str(args.steps), "--train.run_dir", str(run_dir), "--train.device", "cpu",
        "--train.backend", "gloo",
        "--train.log_every", "10", "--eval.every_steps", "0", "--eval.at_end", "false",
        "--checkpoint.every_minutes", "0", "--optim.warmup_steps", "10",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_slurm: sbatch failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def job_state(job: str) -> str:
    """squeue's state, "" once the job has left the queue."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def steps_logged(log: Path) -> int:
    text = log.read_text(errors="replace") if log.exists() else ""
    found = re.findall(r"^step (\d+)/", text, flags=re.M)
    return int(found[-1]) if found else 0


def wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_slurm: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(2)


def run_job(args, data: Path, out: Path, name: str) -> dict:
    run_dir, log = out / name, out / f"{name}.out"
    shutil.rmtree(run_dir, ignore_errors=True)
    log.unlink(missing_ok=True)
    job = sbatch(args, data, run_dir, log)
    print(f"{name}: job {job}", flush=True)
    started = time.monotonic()
    if name != "reference":
        wait(lambda: steps_logged(log) >= args.stop_after or not job_state(job), args.timeout, f"job {job}'s steps")
        if name == "usr1":
            subprocess.run(["scancel", "--signal=USR1", job], check=True)
        elif name == "cancelled":
            subprocess.run(["scancel", job], check=True)
        else:  # a job of the higher tier that needs the same tasks
            subprocess.run(
                ["sbatch", "--parsable", "--partition", args.preempt_partition, "--ntasks", str(args.ntasks),
                 *shlex.split(args.sbatch_args), "--output", "/dev/null", "--wrap", "sleep 5"],
                check=True, capture_output=True,
            )  # fmt: skip
    wait(lambda: not job_state(job), args.timeout, f"job {job} to leave the queue")
    text = log.read_text(errors="replace")
    steps = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    return {
        "job": job,
        "requeued": text.count("; requeued job"),
        "said_not_requeued": "was cancelled: not requeued" in text,
        "last_checkpoint": steps[-1] if steps else None,
        "seconds": round(time.monotonic() - started, 1),
    }


def markdown(r: dict) -> str:
    lines = [
        f"launch/slurm.sbatch on SLURM ({r['slurm']}), {r['ntasks']} tasks, {r['steps']} steps, stop after "
        f"{r['stop_after']} steps; {r['machine']['cpu']}",
        "",
        "| job | expected | requeued | last checkpoint | final state = reference (bitwise) | as expected |",
        "|---|---|---|---|---|---|",
    ]
    for name, j in r["jobs"].items():
        equal = "-" if j.get("equals_reference") is None else ("yes" if j["equals_reference"] else "NO")
        lines.append(
            f"| {name} | {j['expected']} | {j['requeued']} | {j['last_checkpoint']} | {equal} | "
            f"{'yes' if j['as_expected'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sbatch-args", default="--gres=none --cpus-per-task 1 --mem 4G --time 15")
    parser.add_argument("--partition", default=None, help="the jobs' partition (default: the cluster's)")
    parser.add_argument("--preempt-partition", default=None, help="a partition whose jobs preempt --partition's")
    parser.add_argument("--ntasks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--stop-after", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job at most")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "slurm")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if shutil.which("sbatch") is None:
        print("bench_slurm: no sbatch on PATH: run it on a SLURM cluster's login node", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    data = ensure_embedded(args.out / "data", max_per_class=60, max_val_per_class=10)
    names = ["reference", "usr1", *(["preempted"] if args.preempt_partition else []), "cancelled"]
    jobs = {name: run_job(args, data, args.out, name) for name in names}
    for name, j in jobs.items():
        finishes = name != "cancelled"
        j["expected"] = (
            "requeued, finishes" if name in ("usr1", "preempted") else ("finishes" if finishes else "stays cancelled")
        )
        if finishes and name != "reference" and j["last_checkpoint"] == args.steps:
            step = f"step_{args.steps:08d}"
            j["equals_reference"], j["first_difference"] = same_state(
                args.out / name / "checkpoints" / step, args.out / "reference" / "checkpoints" / step
            )
        if name == "reference":
            j["as_expected"] = j["requeued"] == 0 and j["last_checkpoint"] == args.steps
        elif finishes:
            j["as_expected"] = j["requeued"] == 1 and bool(j.get("equals_reference"))
        else:
            j["as_expected"] = (
                j["requeued"] == 0 and j["said_not_requeued"] and (j["last_checkpoint"] or 0) < args.steps
            )
    version = subprocess.run(["sbatch", "--version"], capture_output=True, text=True).stdout.strip()
    result = {"slurm": version, "ntasks": args.ntasks, "steps": args.steps, "stop_after": args.stop_after,
              "machine": machine_info(), "jobs": jobs}  # fmt: skip
    write_json(args.results / "slurm.json", result)
    text = markdown(result)
    (args.results / "slurm.md").write_text(text + "\n")
    print(text)
    return 0 if all(j["as_expected"] for j in jobs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
