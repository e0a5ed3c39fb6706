"""The README's first command, timed: `bash launch/quickstart.sh` (set-up, embedded shards, fastclip-v3 on 2
processes, zero-shot evaluation), with its wall time per phase and the zero-shot results it prints.

    python benchmarks/bench_quickstart.py            # writes benchmarks/results/quickstart.{md,json}

The run goes to a fresh folder (benchmarks/out/quickstart-run); the set-up and the shards are reused when they
exist (the time of a fresh machine's set-up, a pip install of about 1 GB, is not included then: the table says).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS, SMOKE_OUT, machine_info, stamp, write_json


def main(argv: list[str] | None = None) -> int:
    run = SMOKE_OUT / "quickstart-run"
    shutil.rmtree(run, ignore_errors=True)
    fresh_setup = not (REPO / ".venv" / "bin" / "python").exists()
    fresh_data = not (REPO / "data" / "embedded" / "zeroshot.json").exists()
    info = machine_info()
    start = time.time()
    proc = subprocess.Popen(
        ["bash", "launch/quickstart.sh"],
        cwd=REPO,
        env={**os.environ, "RUN": str(run), "PYTHONUNBUFFERED": "1"},  # phase marks need lines as printed
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    marks: dict[str, float] = {}
    for line in proc.stdout:  # phase boundaries from the script's own output
        sys.stdout.write(line)
        now = time.time() - start
        if line.startswith("setup: torch"):
            marks.setdefault("setup", now)
        elif line.startswith("fastclip train:"):
            marks.setdefault("data", now)
        elif line.startswith("checkpoint "):  # the trainer's last save ends training; `fastclip eval` follows
            marks["train"] = now
    rc = proc.wait()
    total = time.time() - start
    if rc != 0:
        print(f"bench_quickstart: launch/quickstart.sh exited {rc}", file=sys.stderr)
        return rc
    records = [json.loads(x) for x in (run / "checkpoints" / "results.jsonl").read_text().splitlines()]
    zeroshot = {r["dataset"]: r["top1"] for r in records if r.get("task") == "zeroshot_classification"}
    speeds = [json.loads(x).get("samples_per_s") for x in (run / "metrics.jsonl").read_text().splitlines()]
    speeds = sorted(s for s in speeds if s)
    result = {
        "machine": info,
        "seconds_total": total,
        "marks": marks,
        "fresh_setup": fresh_setup,
        "fresh_data": fresh_data,
        "zeroshot_top1": zeroshot,
        "median_samples_per_s": speeds[len(speeds) // 2] if speeds else None,
    }
    phases = {
        "set-up": marks.get("setup", 0.0),
        "shards": marks.get("data", 0.0) - marks.get("setup", 0.0),
        "training": marks.get("train", total) - marks.get("data", 0.0),
        "evaluation": total - marks.get("train", total),
    }
    lines = [
        "# Quickstart: `bash launch/quickstart.sh`",
        "",
        stamp(info),
        "",
        f"set-up {'from scratch' if fresh_setup else 'already done (re-run: seconds)'}, shards "
        f"{'written' if fresh_data else 'reused'}.",
        "",
        "| phase | seconds |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:.0f} |" for k, v in phases.items()] + [f"| **total** | **{total:.0f}** |", ""]
    lines += [
        f"Training: median {result['median_samples_per_s']:.0f} samples/s over the logged windows.",
        "",
        "| dataset | zero-shot top-1 |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {100 * top1:.2f}% |" for name, top1 in zeroshot.items()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quickstart.md").write_text("\n".join(lines) + "\n")
    write_json(RESULTS / "quickstart.json", result)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
