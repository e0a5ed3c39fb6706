"""Core-hours of a study: seconds per training step at each dataset and batch, times every run's steps; one run is
one process on one core. The seconds come from the runs already finished (their wall time: evaluation included)
where a batch has some, else from a short timing run (training steps only: evaluation, about curve_points passes
over val or test per run, is not counted)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import subprocess

from . import records
from .plan import Run, plan, steps_of
from .runner import _env, command, ensure_data, train_samples
from .spec import SpecError

# a timing run: every step logged, no evaluation, no checkpoint
QUIET = {"train.log_every": 1, "eval.every_steps": 0, "eval.at_end": False, "checkpoint.every_steps": 0,
         "checkpoint.every_minutes": 0, "checkpoint.at_end": False}  # fmt: skip


def timing_file(spec):
    return spec.results / "timing.json"


def measure(spec, steps: int = 8) -> dict:
    """Seconds per step at every (dataset, batch), from a `steps`-step run of the batch's first objective's first
    setting (the first 2 steps left out: start-up); saved to <results>/timing.json with the machine's load."""
    out = {}
    for dataset in spec.datasets:
        data = ensure_data(spec, dataset)
        for batch in spec.batches:
            name = spec.objectives_at(batch)[0]
            setting = tuple(spec.objectives[name].settings(batch)[0].items())
            run = Run(dataset, batch, name, setting, spec.tune_seeds[0], "timing", spec.datasets[dataset].epochs)
            extra = {**QUIET, "train.max_steps": steps}
            folder = spec.work / "timing" / f"{dataset}_{batch}"
            shutil.rmtree(folder, ignore_errors=True)
            extra["train.run_dir"] = folder
            done = subprocess.run(command(spec, run, data, extra), cwd=records.REPO, env=_env(), capture_output=True)
            if done.returncode != 0:
                tail = (done.stdout + done.stderr).decode().strip().splitlines()[-1:] or ["(no output)"]
                raise SpecError(f"--measure: the timing run of {dataset}/{batch} failed: {tail[0]}")
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


def from_runs(spec) -> dict[str, tuple[float, int]]:
    """ "dataset/batch/phase", and "dataset/batch" over every phase -> (median wall seconds per training step over
    the finished runs, how many runs): what a run has cost on this machine, evaluation and start-up included, at
    whatever load the machine then had."""
    sizes = {d: train_samples(ensure_data(spec, d)) for d in spec.datasets}
    walls: dict[str, list[float]] = {}
    for run in plan(spec):
        record = None if run.chosen_pending else records.load(spec.results, run.id)
        if record and record.get("wall_s"):
            steps = steps_of(run, sizes[run.dataset])
            for key in (f"{run.dataset}/{run.global_batch}/{run.phase}", f"{run.dataset}/{run.global_batch}"):
                walls.setdefault(key, []).append(record["wall_s"] / steps)
    return {k: (statistics.median(v), len(v)) for k, v in walls.items()}


def borrowed(spec, other, own: dict | None = None) -> tuple[dict[str, tuple[float, int]], dict[str, str]]:
    """`other` spec's from_runs, renamed onto this spec's datasets: a study not yet run priced from one that has run
    (per step, so another data size or length is priced right; its evaluation share is the other's, exact when the
    eval splits and curve points are the same, as v2-revisits' are v2's). Each dataset takes one source: the other
    spec's dataset of its name, else the one of its architecture with the most finished runs; a batch with finished
    runs of its own (`own`, from_runs(spec)) borrows nothing. Returns the prices and {dataset: its source}."""
    theirs = from_runs(other)
    mine = {"/".join(key.split("/")[:2]) for key in own or {}}
    runs = {name: sum(n for key, (_, n) in theirs.items() if key.count("/") == 1 and key.startswith(f"{name}/"))
            for name in other.datasets}  # fmt: skip
    prices, sources = {}, {}
    for name, dataset in spec.datasets.items():
        same = [o for o, d in other.datasets.items() if d.arch == dataset.arch and runs[o]]
        if not same:
            continue
        source = name if name in same else max(same, key=lambda o: runs[o])  # ties: the spec's order
        sources[name] = source
        for key, value in theirs.items():
            renamed = f"{name}/{key[len(source) + 1 :]}"
            if key.startswith(f"{source}/") and "/".join(renamed.split("/")[:2]) not in mine:
                prices[renamed] = value
    return prices, sources


def core_hours(spec, per_step: dict[str, float], measured: dict[str, tuple[float, int]] | None = None) -> dict:
    """{total, headline, done, pending} core-hours, `pending_by` ("dataset/batch/phase" -> its pending core-hours,
    in plan order), and `timed`: the batches priced by `per_step` (a timing run: training steps only) for want of
    finished runs. A finished run costs its own wall time; one to run, its steps x seconds per step: `measured`
    (from_runs) for its batch and phase; a long run without its own, its batch's test runs'; else every phase of
    its batch; else `per_step`. KeyError names a dataset/batch with neither."""
    measured = measured or {}
    sizes = {d: train_samples(ensure_data(spec, d)) for d in spec.datasets}
    hours = {"total": 0.0, "headline": 0.0, "done": 0.0, "pending": 0.0, "pending_by": {}, "timed": []}
    for run in plan(spec):
        key = f"{run.dataset}/{run.global_batch}"
        own = [f"{key}/{run.phase}"] + ([f"{key}/test"] if run.phase == "long" else []) + [key]
        seconds = next((measured[k][0] for k in own if k in measured), None)
        if seconds is None:
            if key not in per_step:
                raise KeyError(key)
            seconds = per_step[key]
            if key not in hours["timed"]:
                hours["timed"].append(key)
        h = steps_of(run, sizes[run.dataset]) * seconds / 3600
        record = None if run.chosen_pending else records.load(spec.results, run.id)
        done = record is not None
        if done and record.get("wall_s"):
            h = record["wall_s"] / 3600  # what it took, not the median
        hours["total"] += h
        if spec.objectives[run.objective].headline:
            hours["headline"] += h
        hours["done" if done else "pending"] += h
        if not done:
            by = f"{key}/{run.phase}"
            hours["pending_by"][by] = hours["pending_by"].get(by, 0.0) + h
    return hours
