"""Core-hours of a study: seconds per training step at each dataset and batch (measured by a short run, or from the
runs already done), times every run's steps; one run is one process on one core. Evaluations are not counted
(about curve_points passes over val or test per run)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import subprocess

from . import records
from .plan import Run, plan
from .runner import _env, command, ensure_data, train_samples

# a timing run: every step logged, no evaluation, no checkpoint
QUIET = {"train.log_every": 1, "eval.every_steps": 0, "eval.at_end": False, "checkpoint.every_steps": 0,
         "checkpoint.every_minutes": 0, "checkpoint.at_end": False}  # fmt: skip


def timing_file(spec):
    return spec.results / "timing.json"


def measure(spec, steps: int = 8) -> dict:
    """Seconds per step at every (dataset, batch), from a `steps`-step run of the first objective's first setting
    (the first 2 steps left out: start-up); saved to <results>/timing.json with the machine's load."""
    out = {}
    for dataset in spec.datasets:
        data = ensure_data(spec, dataset)
        name = next(iter(spec.objectives))
        setting = tuple(spec.objectives[name].settings()[0].items())
        for batch in spec.batches:
            run = Run(dataset, batch, name, setting, spec.tune_seeds[0], "timing", spec.datasets[dataset].epochs)
            extra = {**QUIET, "train.max_steps": steps}
            folder = spec.work / "timing" / f"{dataset}_{batch}"
            shutil.rmtree(folder, ignore_errors=True)
            extra["train.run_dir"] = folder
            done = subprocess.run(command(spec, run, data, extra), cwd=records.REPO, env=_env(), capture_output=True)
            if done.returncode != 0:
                tail = (done.stdout + done.stderr).decode().strip().splitlines()[-1:]
                raise RuntimeError(f"timing run {dataset}/{batch} failed: {tail}")
            logged = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if "step_time" in x]
            per_step = [batch / r["samples_per_s"] for r in logged if r["step"] > 2] or [
                batch / r["samples_per_s"] for r in logged
            ]
            out[f"{dataset}/{batch}"] = statistics.median(per_step)
            shutil.rmtree(folder, ignore_errors=True)
            print(f"{dataset}/{batch}: {out[f'{dataset}/{batch}']:.3f} s/step", flush=True)
    timing = {"seconds_per_step": out, "cores": os.cpu_count(), "loadavg": list(os.getloadavg()), "date": _now()}
    timing_file(spec).parent.mkdir(parents=True, exist_ok=True)
    timing_file(spec).write_text(json.dumps(timing, indent=1))
    return timing


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def busy_note(timing: dict) -> str | None:
    """A warning when the timing ran on a machine busier than one process per core (its hours are too high)."""
    load, cores = timing.get("loadavg", [0])[0], timing.get("cores") or 1
    if load > cores:
        return (
            f"measured at load {load:.1f} on {cores} cores ({timing.get('date')}): a free core is faster, "
            "re-measure on an idle machine (`plan --hours --measure`)"
        )
    return None


def core_hours(spec, per_step: dict[str, float]) -> dict:
    """{total, headline, done, pending} core-hours, and the tables' pending hours in running order."""
    sizes = {d: train_samples(ensure_data(spec, d)) for d in spec.datasets}
    hours = {"total": 0.0, "headline": 0.0, "done": 0.0, "pending": 0.0}
    for run in plan(spec):
        key = f"{run.dataset}/{run.global_batch}"
        if key not in per_step:
            raise KeyError(key)
        h = sizes[run.dataset] // run.global_batch * run.epochs * per_step[key] / 3600
        hours["total"] += h
        if spec.objectives[run.objective].headline:
            hours["headline"] += h
        done = not run.chosen_pending and records.load(spec.results, run.id) is not None
        hours["done" if done else "pending"] += h
    return hours
