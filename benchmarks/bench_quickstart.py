"""The README's first command, timed: `bash launch/quickstart.sh` (set-up, embedded shards, fastclip-v3 on 2
processes, zero-shot evaluation; then the scenes run and its retrieval), with its wall time per phase and the
results it prints.

    python benchmarks/bench_quickstart.py            # writes benchmarks/results/quickstart.{md,json}

The run goes to a fresh folder (benchmarks/out/quickstart-run); the set-up and the shards are reused when they
exist (the time of a fresh machine's set-up, a pip install of about 1 GB, is not included then: the table says).
"""

from __future__ import annotations

import argparse
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
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # no options: --help, refusals
    run, scenes_run = SMOKE_OUT / "quickstart-run", SMOKE_OUT / "quickstart-scenes-run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(scenes_run, ignore_errors=True)
    fresh_setup = not (REPO / ".venv" / "bin" / "python").exists()
    fresh_data = not (REPO / "data" / "embedded" / "zeroshot.json").exists()
    info = machine_info()
    start = time.time()
    proc = subprocess.Popen(
        ["bash", "launch/quickstart.sh"],
        cwd=REPO,
        # phase marks need lines as printed
        env={**os.environ, "RUN": str(run), "SCENES_RUN": str(scenes_run), "PYTHONUNBUFFERED": "1"},
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
        elif line.startswith("== scenes:"):
            marks["scenes"] = now
        elif line.startswith("fastclip train:"):
            marks.setdefault("scenes_data" if "scenes" in marks else "data", now)
        elif line.startswith("checkpoint "):  # the trainer's last save ends training; `fastclip eval` follows
            marks["scenes_train" if "scenes" in marks else "train"] = now
    rc = proc.wait()
    total = time.time() - start
    if rc != 0:
        print(f"bench_quickstart: launch/quickstart.sh exited {rc}", file=sys.stderr)
        return rc
    records = [json.loads(x) for x in (run / "checkpoints" / "results.jsonl").read_text().splitlines()]
    zeroshot = {r["dataset"]: r["top1"] for r in records if r.get("task") == "zeroshot_classification"}
    speeds = [json.loads(x).get("samples_per_s") for x in (run / "metrics.jsonl").read_text().splitlines()]
    speeds = sorted(s for s in speeds if s)
    scenes = {}  # split -> retrieval R@1 (mean of both directions) and zero-shot top-1 on the glyph classes
    for x in (scenes_run / "checkpoints" / "results.jsonl").read_text().splitlines():
        r = json.loads(x)
        split = Path(r["data"]).name
        if r.get("task") == "retrieval":
            # fastclip.eval.retrieval.mean_r1, written out: this script runs before the set-up (no torch, no fastclip)
            scenes.setdefault(split, {})["retrieval_R@1"] = 0.5 * (r["image_to_text_R@1"] + r["text_to_image_R@1"])
        elif r.get("task") == "zeroshot_classification":
            scenes.setdefault(split, {})["zeroshot_top1"] = r["top1"]
    result = {
        "machine": info,
        "seconds_total": total,
        "marks": marks,
        "fresh_setup": fresh_setup,
        "fresh_data": fresh_data,
        "zeroshot_top1": zeroshot,
        "median_samples_per_s": speeds[len(speeds) // 2] if speeds else None,
        "scenes": scenes,
    }
    phases = {
        "set-up": marks.get("setup", 0.0),
        "shards": marks.get("data", 0.0) - marks.get("setup", 0.0),
        "training": marks.get("train", total) - marks.get("data", 0.0),
        "evaluation, plots, export": marks.get("scenes", total) - marks.get("train", total),
        "scenes: shards": marks.get("scenes_data", total) - marks.get("scenes", total),
        "scenes: training": marks.get("scenes_train", total) - marks.get("scenes_data", total),
        "scenes: evaluation": total - marks.get("scenes_train", total),
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
    lines += [
        "",
        "Scenes (fastclip-v3, configs/scenes.yaml, 8 epochs): retrieval R@1 is the mean of both directions; "
        "zero-shot is on the single-object scenes' 20 glyph classes.",
        "",
        "| split | retrieval R@1 | zero-shot top-1 |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {split} | {100 * r.get('retrieval_R@1', float('nan')):.2f}% | "
        f"{100 * r.get('zeroshot_top1', float('nan')):.2f}% |"
        for split, r in scenes.items()
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quickstart.md").write_text("\n".join(lines) + "\n")
    write_json(RESULTS / "quickstart.json", result)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
