"""What a run folder holds, for launch/quickstart.sh's reruns (nothing trained or evaluated twice):

    python launch/run_state.py steps RUN            # the last training step RUN logged (0 before its first)
    python launch/run_state.py evaluated RUN DATA   # exit 0 if RUN's results hold an evaluation of DATA at that step

A line cut by a kill (or any unreadable line) is passed over, as `fastclip summary` does."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def trained_steps(run: Path) -> int:
    steps = [r["step"] for r in _rows(run / "metrics.jsonl") if "loss" in r and isinstance(r.get("step"), int)]
    return max(steps, default=0)


def evaluated(run: Path, data: str) -> bool:
    """A full evaluation of `data` (paths compared normalised) of the checkpoint at the run's last training step: a
    spot check (`fastclip eval --max-samples`, recorded with max_samples) is not one."""
    step, wanted = trained_steps(run), os.path.normpath(data)
    return step > 0 and any(
        r.get("step") == step
        and isinstance(r.get("data"), str)
        and os.path.normpath(r["data"]) == wanted
        and r.get("max_samples") is None
        for r in _rows(run / "checkpoints" / "results.jsonl")
    )


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "steps":
        print(trained_steps(Path(argv[1])))
        return 0
    if len(argv) == 3 and argv[0] == "evaluated":
        return 0 if evaluated(Path(argv[1]), argv[2]) else 1
    print("usage: python launch/run_state.py {steps RUN | evaluated RUN DATA}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
