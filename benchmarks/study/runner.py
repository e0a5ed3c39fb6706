"""Running a study's pending runs: each a `python -m fastclip train` process (OMP_NUM_THREADS=1, one core), resumed
from its last checkpoint when it was stopped, recorded as one small JSON when it ends (records.py)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from fastclip.data.format import MANIFEST_NAME
from fastclip.data.manifest import read_manifest
from fastclip.eval.retrieval import mean_r1
from fastclip.eval.zeroshot import mean_top1

from . import held_out, records
from .plan import PHASES, Run, cell_name, cells, plan, selected, steps_of
from .settings import value_arg
from .spec import Spec, SpecError, resolve_setting
from .stops import handled, raise_stopped

CURVE_POINTS_MAX = 20


class MixedCommits(RuntimeError):
    """A table would hold runs from different code; the message names the table, the codes and what to do."""


class CodeChanged(MixedCommits):
    """The code changed under a `run` in progress (an edit, a checkout): it stopped rather than mix."""


# ----------------------------------------------------------------------------- data
def ensure_data(spec: Spec, dataset: str) -> Path:
    """The dataset's folder, made by its `make` command when missing; SpecError when it cannot be used."""
    d = spec.datasets[dataset]
    made = False
    if not (d.data / "train" / MANIFEST_NAME).is_file() and d.make:
        cmd = make_command(d.make, d.data)
        print(f"making {dataset}: {' '.join(cmd)}", flush=True)
        try:
            proc = subprocess.Popen(cmd, cwd=records.REPO, env=_env(), stdout=subprocess.DEVNULL)
        except OSError as error:
            raise SpecError(f"datasets.{dataset}.make: cannot start {cmd[0]!r} ({error.strerror})") from None
        try:
            code = proc.wait()
        except BaseException:  # a stop while making: the maker stops too (its half-made folder is refused below)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        if code != 0:
            raise SpecError(f"datasets.{dataset}.make exited {code}; run it by hand to see why")
        made = True
    # zeroshot.json: for a zero-shot metric only (else the runs report no zero-shot)
    class_list = ("zeroshot.json",) if d.metric == "zeroshot_top1" else ()
    for part in (*(f"{split}/{MANIFEST_NAME}" for split in ("train", "val", "test")), *class_list):
        if not (d.data / part).is_file():
            half = d.make and not made and (d.data / "train" / MANIFEST_NAME).is_file()
            raise SpecError(
                f"datasets.{dataset}.data {d.data}: no {part}; "
                + (
                    "a half-made folder (its make was stopped?): remove the folder and run again to make it whole"
                    if half
                    else "the study needs train/, val/ and test/ shard folders"
                    + (" and zeroshot.json (metric zeroshot_top1)" if class_list else "")
                    + " (or a `make` command that writes them)"
                )
            )
    if (names := zeroshot_file(d.data)) is not None:
        zeroshot_sets(names)
    for split in ("train", "val", "test"):
        try:
            read_manifest(d.data / split)
        except ValueError as error:  # ManifestError: names the file and field
            raise SpecError(f"datasets.{dataset}: {error}") from None
    return d.data


def zeroshot_file(data: Path) -> Path | None:
    """The data's class list, where it has one (needed for a zero-shot metric only)."""
    path = data / "zeroshot.json"
    return path if path.is_file() else None


def make_command(make: tuple[str, ...], data: Path) -> list[str]:
    """A dataset's `make` as a command: `python` is this interpreter, {data} the folder it writes."""
    return [sys.executable if x == "python" else x.replace("{data}", str(data)) for x in make]


def zeroshot_sets(path: Path) -> dict:
    """A zeroshot.json's datasets as the trainer reads it (either of its forms), {name: ZeroShotSpec}; SpecError
    naming the file otherwise."""
    from fastclip.eval.spec import load_zeroshot_spec

    try:
        return load_zeroshot_spec(path)
    except (OSError, ValueError) as error:
        why = str(error).splitlines()[0]
        raise SpecError(f"{why}; write it again (`fastclip data ...` writes it with the shards)") from None


def train_samples(data: Path) -> int:
    return read_manifest(data / "train").num_samples


def check_batches(spec: Spec, data: Path, dataset: str, batches) -> None:
    """SpecError for a global batch larger than the training split (every run of it would fail)."""
    size = train_samples(data)
    big = sorted(b for b in set(batches) if b > size)
    if big:
        raise SpecError(f"batches {big}: larger than datasets.{dataset}'s {size} training samples")


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_dir(spec: Spec, run: Run) -> Path:
    return spec.work / "runs" / run.id


def command(spec: Spec, run: Run, data: Path, extra: dict | None = None) -> list[str]:
    """The `fastclip train` command of a run: the spec's common keys, the objective's fixed options, then its
    setting (resolved at this batch), then the study's own keys (data, schedule, evaluation, checkpoints)."""
    d, o = spec.datasets[run.dataset], spec.objectives[run.objective]
    steps = steps_of(run, train_samples(data))
    every = max(1, math.ceil(steps / spec.curve_points))  # <= curve_points checkpoints (and evaluations)
    points = spec.tune_curve_points if run.phase == "tune" else spec.curve_points
    every_eval = max(1, math.ceil(steps / points))
    keys = {
        **spec.train,
        **resolve_setting(o.options, run.global_batch),
        **resolve_setting(run.settings, run.global_batch),
        "data.train": data / "train",
        "data.val": data / ("val" if run.phase == "tune" else "test"),
        "data.zeroshot": zeroshot_file(data) or "null",
        "data.batch_size": run.global_batch,
        "data.workers": spec.train.get("data.workers", 0),  # one core per run on CPU; a GPU's runs decode in workers
        "model.arch": d.arch,
        "loss.name": o.loss,
        "optim.warmup_steps": max(1, int(steps * spec.warmup_frac)),
        "train.epochs": run.epochs,
        "train.seed": run.seed,
        "train.run_dir": run_dir(spec, run),
        "train.device": spec.device,
        "train.progress": False,
        "train.tensorboard": False,
        "train.log_every": max(1, min(25, every)),
        "eval.every_steps": every_eval,
        "eval.at_end": True,
        "eval.max_samples": None,
        "checkpoint.every_steps": every,
        "checkpoint.every_minutes": 10,
        "checkpoint.keep_last": 1,
        "checkpoint.at_end": True,
    }
    keys.update(extra or {})
    args = [sys.executable, "-m", "fastclip", "train"]
    for key, value in keys.items():
        args += [f"--{key}", value_arg(str(value) if isinstance(value, Path) else value)]
    return args


def metric(record: dict, name: str) -> float | None:
    """The study's metric from one evaluation's keys (without the eval/ prefix); None when it is not there."""
    if name == "retrieval_R1":
        return mean_r1(record)
    return mean_top1(record)


def zeroshot_top1(record: dict) -> float | None:
    return metric(record, "zeroshot_top1")


def evaluations(metrics_jsonl: Path) -> list[dict]:
    """The evaluations of a run's metrics.jsonl, in sample order: {samples_seen, <keys without eval/>}."""
    points: dict[int, dict] = {}
    for line in metrics_jsonl.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        evals = {k[5:]: v for k, v in rec.items() if k.startswith("eval/") and isinstance(v, (int, float))}
        if evals:
            points[rec["samples_seen"]] = {"samples_seen": rec["samples_seen"], **evals}
    return [points[k] for k in sorted(points)]


def thin(points: list, most: int) -> list:
    """At most `most` of `points`, evenly spread, the first and the last kept."""
    if len(points) <= most:
        return points
    keep = sorted({round(i * (len(points) - 1) / (most - 1)) for i in range(most)})
    return [points[i] for i in keep]


def evaluate_split(folder: Path, data: Path, split: str, device: str = "cpu") -> dict:
    """The final model of a run on another split (`novel`), through fastclip.eval as `fastclip eval` does."""
    import torch

    from fastclip.eval import run_evals
    from fastclip.eval.checkpoint import load_model

    torch.set_num_threads(1)
    built = load_model(folder, device=device).built
    names = zeroshot_file(data)
    out = run_evals(
        built.model,
        tokenizer=built.tokenizer,
        preprocess=built.preprocess_val,
        val_dir=str(data / split),
        zeroshot_file=None if names is None else str(names),
        device=device,
        batch_size=256,
    )
    return {k: v for k, v in out.items() if isinstance(v, (int, float))}


def result_record(spec: Spec, run: Run, folder: Path, data: Path, wall_s: float) -> dict:
    """The run's JSON: final metrics, the curve (metric vs samples, <= 20 points, rounded), wall time, samples/s,
    the code that ran it."""
    name = spec.datasets[run.dataset].metric
    evals = evaluations(folder / "metrics.jsonl")
    if not evals:
        raise RuntimeError(f"{folder}/metrics.jsonl has no evaluation")
    final = evals[-1]
    logged = logged_steps(folder / "metrics.jsonl")
    out = {
        "id": run.id,
        "run": {
            "dataset": run.dataset,
            "global_batch": run.global_batch,
            "objective": run.objective,
            "loss": spec.objectives[run.objective].loss,
            "setting": run.settings,
            "seed": run.seed,
            "phase": run.phase,
            "epochs": run.epochs,
        },
        **started_with(folder),
        "data": data_fingerprint(data),
        "device": spec.device,
        "final": {
            "metric": metric(final, name),
            "zeroshot_top1": zeroshot_top1(final),
            "samples_seen": final["samples_seen"],
            **{k: v for k, v in final.items() if k.endswith("_R@1")},
            "tau": final_tau(logged),
        },
        "curve": thin([[e["samples_seen"], metric(e, name)] for e in evals], CURVE_POINTS_MAX),
        "wall_s": wall_s,
        "samples_per_s": logged[-1]["samples_per_s"] if logged else None,
    }
    if run.phase != "tune" and (data / "novel" / MANIFEST_NAME).is_file():
        novel = evaluate_split(folder, data, "novel", spec.device)
        out["novel"] = {"metric": metric(novel, name), "zeroshot_top1": zeroshot_top1(novel)}
    # the measurements rounded, the run's settings as given (rounded, an lr of 2.5e-4 read 3e-4)
    return {**records.round_floats(out), "run": out["run"]}


def logged_steps(metrics_jsonl: Path) -> list[dict]:
    """The training log lines of a run's metrics.jsonl (those with samples/s; not the evaluations); [] without it."""
    if not metrics_jsonl.is_file():
        return []
    return [json.loads(x) for x in metrics_jsonl.read_text().splitlines() if '"samples_per_s"' in x]


def final_tau(logged: list[dict]) -> float | None:
    """The global τ at the last logged step (a learned one: where it went); None for a per-sample τ or no log."""
    return logged[-1].get("tau") if logged else None


def backfill_tau(spec: Spec) -> tuple[int, int]:
    """Records made before result_record kept `final.tau` get it from their run folder's metrics.jsonl (the last
    logged τ, as result_record takes it); (records filled, records lacking it whose folder or log is gone)."""
    filled = without = 0
    for run in plan(spec):
        record = None if run.chosen_pending else records.load(spec.results, run.id)
        if record is None or "tau" in record["final"]:
            continue
        logged = logged_steps(run_dir(spec, run) / "metrics.jsonl")
        if not logged:
            without += 1
            continue
        record["final"]["tau"] = records.round_floats({"tau": final_tau(logged)})["tau"]
        records.save(spec.results, run.id, record)
        filled += 1
    return filled, without


def started_with(folder: Path) -> dict:
    """{commit, code, dirty, args}: what the run started with (its folder's code.json; `start` restarts a run whose
    code or settings changed since), else the code now and no args."""
    return _started(folder) or records.code_version()


def _started(folder: Path) -> dict | None:
    """The folder's code.json, None when it has none or it cannot be read (then the run starts over)."""
    try:
        before = json.loads((folder / "code.json").read_text())
    except (OSError, ValueError):
        return None
    return before if isinstance(before, dict) and {"code", "args"} <= set(before) else None


def wall_before(run: Run, folder: Path) -> float:
    """The wall time of the run's earlier attempts, kept in its folder (0 for a first attempt)."""
    path = folder / "wall_s.txt"
    try:
        return float(path.read_text()) if path.is_file() else 0.0
    except (OSError, ValueError):
        print(f"note: {path} unreadable: {run.id}'s wall time counts from this attempt", flush=True)
        return 0.0


def add_wall(active: Active) -> float:
    """The run's wall time over all its attempts, this attempt's so far added, written to its folder: at its end and
    every WALL_EVERY seconds while it runs, so a killed runner loses at most that much of it."""
    total = active.before + time.perf_counter() - active.start
    records.write_atomic(active.folder / "wall_s.txt", f"{total:.1f}")
    active.written = time.perf_counter()
    return total


WALL_EVERY = 60.0


@dataclass
class Active:
    run: Run
    proc: subprocess.Popen
    folder: Path
    data: Path
    before: float = 0.0  # the earlier attempts' wall time
    start: float = field(default_factory=time.perf_counter)
    written: float = field(default_factory=time.perf_counter)  # when wall_s.txt was last written


# keys of a run's command that do not decide what it trains: where things are, whether it resumes (exactly), and how
# often it evaluates, logs and checkpoints (evaluating changes nothing that trains: tests/test_train.py)
NOT_DECIDING = ("data.train", "data.val", "data.zeroshot", "train.run_dir", "train.resume", "train.progress",
                "train.tensorboard", "train.log_every", "eval.", "checkpoint.")  # fmt: skip


def deciding_args(cmd: list[str]) -> dict[str, str]:
    """The `--key value` pairs of a run's command that decide what it trains (recorded in its JSON, compared
    before more runs join its table)."""
    pairs = dict(zip(cmd[4::2], cmd[5::2]))  # after `python -m fastclip train`
    args = {k[2:]: v for k, v in pairs.items() if not k[2:].startswith(NOT_DECIDING)}
    if ":" in args.get("loss.name", ""):  # a loss of the user's own: its file is code no commit of ours records
        args["loss.source"] = loss_source(args["loss.name"])
    return args


@functools.cache
def loss_source(name: str) -> str:
    """A hash of the files that define a user's loss (``module:attribute``): every file of its top-level package
    (or its module's file) that the entry's classes and their bases come from, the module's own among them, and
    those classes' files elsewhere outside fastclip and the installed packages. An edit to any makes the runs
    made before other settings, as a changed option would."""
    import importlib.util
    import inspect

    from fastclip.losses import loss_entry
    from fastclip.losses.user import installed_roots, source_root

    entry, module_name = loss_entry(name), name.partition(":")[0]
    root, installed = source_root(module_name), installed_roots()
    files = {Path(importlib.util.find_spec(module_name).origin).resolve()}
    for cls in (entry.options, entry.autograd, entry.fused):
        for base in inspect.getmro(cls) if cls is not None else ():
            with contextlib.suppress(TypeError, OSError):  # (builtins have no source file)
                path = Path(inspect.getsourcefile(base)).resolve()
                if (root is not None and path.is_relative_to(root)) or not any(
                    path.is_relative_to(r) for r in installed
                ):
                    files.add(path)
    digest = hashlib.sha1()
    for path in sorted(files):
        digest.update(f"{path.name}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def resumable(folder: Path, code: str, args: dict) -> bool:
    """Whether a run folder's checkpoints may be resumed: it has one, and it started with this code and these
    arguments (a folder from before code.json was written: taken as it is)."""
    if not any((folder / "checkpoints").glob("step_*")):
        return False
    if not (folder / "code.json").is_file():
        return True
    before = _started(folder)  # unreadable: what it started with is unknown, so it starts over
    return before is not None and before["code"] == code and before["args"] == args


def prepare_folder(run: Run, folder: Path, args: list[str]) -> bool:
    """The run's folder, ready for an attempt; True when it resumes from its checkpoints (the same code and
    settings), else emptied, the wall time of its earlier attempts kept."""
    code = records.code_version()
    resumes = resumable(folder, code["code"], args)
    if not resumes:
        if any((folder / "checkpoints").glob("step_*")):
            print(f"{run.id}: its checkpoints are from other code or settings than now: it starts over", flush=True)
        spent = wall_before(run, folder)  # the attempts given up were spent on it too ("over all its attempts")
        shutil.rmtree(folder, ignore_errors=True)  # (started but never checkpointed: nothing to keep)
        if spent:
            folder.mkdir(parents=True, exist_ok=True)
            records.write_atomic(folder / "wall_s.txt", f"{spent:.1f}")
    folder.mkdir(parents=True, exist_ok=True)
    if _started(folder) is None:  # the code and settings it starts with: what its JSON records, resumed or not
        records.write_atomic(folder / "code.json", json.dumps({**code, "args": args}))
    return resumes


def start(spec: Spec, run: Run, data: Path) -> Active:
    folder = run_dir(spec, run)
    cmd = command(spec, run, data)
    if prepare_folder(run, folder, deciding_args(cmd)):
        cmd += ["--train.resume", "latest"]  # stopped before: go on from its last checkpoint
    log = open(folder / "stdout.log", "a")
    # its own process group: a terminal's signals reach the runner alone, which stops the trainers with SIGTERM
    # (the trainer's checkpointing stop); the study's lock is inherited
    fds = (_LOCK.fileno(),) if _LOCK is not None and not _LOCK.closed else ()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=records.REPO,
                            process_group=0, pass_fds=fds)  # fmt: skip
    log.close()
    print(f"[{time.strftime('%H:%M:%S')}] start {run.id}", flush=True)
    return Active(run, proc, folder, data, before=wall_before(run, folder))


def finish(spec: Spec, active: Active) -> None:
    run, folder = active.run, active.folder
    if active.proc.returncode != 0:
        add_wall(active)  # a failed attempt's time is the run's too ("over all its attempts")
        tail = (folder / "stdout.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"exit {active.proc.returncode}: {tail[0]} (log {folder}/stdout.log)")
    record = result_record(spec, run, folder, active.data, add_wall(active))
    if record["final"]["metric"] is None:
        metric_name = spec.datasets[run.dataset].metric
        raise RuntimeError(f"its last evaluation has no {metric_name} (log {folder}/stdout.log)")
    records.save(spec.results, run.id, record)
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)  # done: the JSON is the record
    print(f"[{time.strftime('%H:%M:%S')}] done  {run.id}: {record['final']['metric']}", flush=True)


# ----------------------------------------------------------------------------- provenance
def table_codes(spec: Spec) -> dict[tuple[str, int], dict[str, list[str]]]:
    """(dataset, batch) -> code key -> ids of the finished runs of that table from that code; a run whose recorded
    arguments or data differ from what the spec gives it now counts as code `<its code>+other-settings` or
    `+other-data`."""
    out: dict[tuple[str, int], dict[str, list[str]]] = {}
    for run in plan(spec):
        record = records.load(spec.results, run.id)
        if record is not None:
            out.setdefault((run.dataset, run.global_batch), {}).setdefault(code_of(spec, run, record), []).append(
                run.id
            )
    return out


@functools.cache
def data_fingerprint(data: Path) -> str:
    """records.data_fingerprint, once per process and folder (the data does not change while a study runs)."""
    return records.data_fingerprint(data)


def code_of(spec: Spec, run: Run, record: dict) -> str:
    """The run's code key, marked when the spec now gives it other arguments (its objective's options, the common
    keys, the data's arch changed since it ran) or other data. Runs recorded before arguments (2026-11-29) or data
    (2026-11-30) were are taken as they are."""
    data = spec.datasets[run.dataset].data
    if not (data / "train" / MANIFEST_NAME).is_file():
        return record["code"]
    code = record["code"]
    if "args" in record and record["args"] != deciding_args(command(spec, run, data)):
        code += "+other-settings"
    if _other_data(data, record):
        code += "+other-data"
    return code


def _other_data(data: Path, record: dict) -> bool:
    """The run recorded data (records before 2026-11-30 did not) other than what `data` holds now (where it exists)."""
    return "data" in record and (data / "train" / MANIFEST_NAME).is_file() and record["data"] != data_fingerprint(data)


def check_commits(
    spec: Spec, current: str | None, cell: str | Iterable[str] | None = None, rerun_stale: bool = False
) -> None:
    """MixedCommits if a table (only the tables of the cells `cell` names, when given) holds runs from more than one
    code version, or (`current` given: before running) from another code than `current`, or (not given: a report)
    only runs made with other settings or data than the spec gives now. `rerun_stale`: the cells'
    stale runs were moved out, and the message says to name the whole table."""
    wanted = selected(cell)
    tables = None if wanted is None else {c.rsplit("/", 1)[0] for c in wanted}
    for (dataset, batch), codes in table_codes(spec).items():
        if tables is not None and f"{dataset}/{batch}" not in tables:
            continue
        keys = set(codes) | ({current} if current else set())
        if not current and (other := {c: ids for c, ids in codes.items() if "+other-" in c}) and len(keys) == 1:
            ((code, ids),) = other.items()
            what = " and ".join(m for m in ("settings", "data") if f"+other-{m}" in code)
            raise MixedCommits(
                f"table {dataset}/{batch}: its {len(ids)} run(s) were made with other {what} than {spec.path} gives "
                f"now ({code}), in objective(s) {', '.join(sorted({i.split('/')[2] for i in ids}))}: the report "
                f"would show them under this spec; restore the spec's {what}, or re-run them with `run --rerun-stale`, "
                "or pass --allow-mixed-commits"
            )
        if len(keys) > 1:
            other = {code: ids for code, ids in codes.items() if code != current} if current else codes
            shown = ", ".join(f"{code} ({len(ids)})" for code, ids in sorted(other.items()))
            cells_of = sorted({i.split("/")[2] for ids in other.values() for i in ids})
            if current:
                what = f"{sum(map(len, other.values()))} run(s) from other code than now ({current}): {shown}"
            else:
                what = f"runs from {len(codes)} code versions: {shown}"
            rerun = f"`run --rerun-stale --cell '{dataset}/{batch}/*'`" if rerun_stale else "`run --rerun-stale`"
            raise MixedCommits(
                f"table {dataset}/{batch}: {what}, in objective(s) {', '.join(cells_of)}; re-run them with {rerun}, "
                "or pass --allow-mixed-commits"
            )


def move_stale(spec: Spec, current: str, cell: str | Iterable[str] | None) -> list[tuple[str, Path]]:
    """Move the finished runs of other code (of the cells `cell` names, else every cell) out of the tables (to
    <results>/stale/): they are pending again. Also those of other code that no plan lists now, in those cells and
    in the cells that take a value from their choice (a tuning run at a value its source no longer chooses, or not
    yet again): they would be back in the tables once that choice is. Returns (run id, where it went) of each, for
    put_back."""
    moved = []
    for run in plan(spec, cell):
        record = records.load(spec.results, run.id)
        if record is not None and code_of(spec, run, record) != current:
            moved.append((run.id, records.move_stale(spec.results, run.id)))
    planned = {run.id for run in plan(spec)}
    root = spec.results / "runs"
    for prefix in _with_dependents(spec, cell):
        for path in sorted((root / prefix).rglob("*.json")):
            run_id = path.relative_to(root).with_suffix("").as_posix()
            if run_id not in planned and _unplanned_stale(spec, run_id, json.loads(path.read_text()), current):
                moved.append((run_id, records.move_stale(spec.results, run_id)))
    return moved


def _unplanned_stale(spec: Spec, run_id: str, record: dict, current: str) -> bool:
    """A run no plan lists now (so no command to compare its arguments with): of other code, or other data."""
    return record.get("code") != current or _other_data(spec.datasets[run_id.split("/")[0]].data, record)


def put_back(spec: Spec, moved: list[tuple[str, Path]]) -> None:
    """Undo move_stale (its tables refused what it would leave)."""
    for run_id, where in reversed(moved):
        where.replace(records.run_path(spec.results, run_id))


def _with_dependents(spec: Spec, cell: str | Iterable[str] | None) -> list[str]:
    """The cells `cell` names and the cells of their tables whose objective takes a value from their choice (every
    cell when None)."""
    wanted = selected(cell)
    out = []
    for d, b, o in cells(spec):
        name = cell_name(d, b, o)
        sources = {cell_name(d, b, source) for source in spec.objectives[o].from_choice.values()}
        if wanted is None or name in wanted or sources & wanted:
            out.append(name)
    return out


# ----------------------------------------------------------------------------- the loop
def pending(
    spec: Spec,
    cell: str | Iterable[str] | None,
    busy: set[str],
    failed: dict[str, int],
    phases: tuple[str, ...] = PHASES,
) -> list[Run]:
    return [
        r
        for r in plan(spec, cell)
        if not r.chosen_pending
        and r.phase in phases
        and r.id not in busy
        and failed.get(r.id, 0) < 2
        and records.load(spec.results, r.id) is None
    ]


def check_outputs(spec: Spec) -> None:
    """SpecError unless the results' runs/ folder and the work folder can be made and written: a run that trains
    for minutes and then cannot save its record loses them."""
    for key, folder in (("results", spec.results / "runs"), ("work", spec.work)):
        check_writable(key, folder)


def check_writable(key: str, folder: Path) -> None:
    """SpecError naming the spec's key unless `folder` can be made and written in."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise SpecError(f"{key} {folder}: cannot write there ({error.strerror}); give a folder you can write") from None


@contextlib.contextmanager
def hold_lock(spec: Spec):
    """An exclusive lock on the study (a file in its work folder) inside the block; SpecError when another `run` of
    it holds it (two would start the same runs in the same folders)."""
    import fcntl

    global _LOCK
    path = spec.work / ".run.lock"  # the work folder: git-ignored, and shared with an at_commit.sh worktree
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        pid = handle.read().strip() or "?"
        handle.close()
        raise SpecError(
            f"another `run` of this study is active (pid {pid}, or its trainers; lock {path}): one `run` per study "
            "at a time (give it --parallel N for more runs at once); wait for it or stop it"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    _LOCK = handle
    try:
        yield handle
    finally:
        _LOCK = None
        handle.close()  # (trainers still running hold it on: they inherited it)


_LOCK = None  # the study's lock while this process holds it: its trainers inherit it (a killed runner's orphaned
# trainers keep it held, so no second `run` resumes their folders under them)


def run_pending(
    spec: Spec,
    *,
    cell: str | Iterable[str] | None = None,
    max_runs: int | None = None,
    parallel: int = 1,
    phases: tuple[str, ...] = PHASES,
    code: str | None = None,
) -> int:
    """Runs pending runs `parallel` at a time until none is left (a cell's test runs start once its tuning is done)
    or `max_runs` have started; only runs of `phases` (e.g. tune and test of every cell before any long run). A
    failed run is retried once from its checkpoint, then left for the next call. Returns the number of runs that
    failed twice. SIGINT/SIGTERM: the runs in progress get SIGTERM (the trainer checkpoints and exits 75), then
    Stopped. `code`: the code the tables take; where fastclip/ or configs/ no longer is that code when a run is
    to start, the runs in progress are stopped the same way (a trainer imports some modules late) and CodeChanged
    says so."""
    selected_runs = plan(spec, cell)
    data = {}
    for dataset in {r.dataset for r in selected_runs} if max_runs != 0 else ():
        data[dataset] = ensure_data(spec, dataset)  # a missing folder is one line now, not after hours of other runs
        held_out.check(data[dataset], dataset)
        check_batches(spec, data[dataset], dataset, [r.global_batch for r in selected_runs if r.dataset == dataset])
    active: list[Active] = []
    previous = {s: signal.signal(s, raise_stopped) for s in handled()}
    try:
        return _loop(spec, active, data, cell, max_runs, parallel, phases, code)
    except BaseException:  # a stop, or a bug here: the runs in progress checkpoint and exit, none is orphaned
        for a in active:
            a.proc.send_signal(signal.SIGTERM)
        for a in active:
            a.proc.wait()
            add_wall(a)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


CODE_CHECK_EVERY_S = 30.0  # how often `run` looks for code changed under it while its runs go (git: ~50 ms)


def _refuse_changed_code(code: str, active: list) -> None:
    """CodeChanged where fastclip/ or configs/ is no longer `code` (the runs in progress are then stopped)."""
    if (now := records.code_version()["code"]) != code:
        raise CodeChanged(
            f"fastclip/ or configs/ changed while `run` ran (code {code} -> {now}): the {len(active)} run(s) in "
            f"progress were stopped at their last checkpoint and no other started, as a table takes runs of one "
            f"code; restore the code to resume them, or commit it and `run --rerun-stale`"
        )


def _loop(
    spec: Spec,
    active: list[Active],
    data: dict[str, Path],
    cell: str | Iterable[str] | None,
    max_runs: int | None,
    parallel: int,
    phases: tuple[str, ...],
    code: str | None,
) -> int:
    failed: dict[str, int] = {}  # run id -> failed attempts
    started, checked = 0, 0.0
    while True:
        if code is not None and time.perf_counter() - checked >= CODE_CHECK_EVERY_S:  # before a finished run counts
            _refuse_changed_code(code, active)
            checked = time.perf_counter()
        for a in [a for a in active if a.proc.poll() is not None]:
            active.remove(a)
            try:
                finish(spec, a)
            except (RuntimeError, OSError, KeyError, ValueError) as error:
                failed[a.run.id] = failed.get(a.run.id, 0) + 1
                print(f"[{time.strftime('%H:%M:%S')}] FAILED {a.run.id}: {error}", flush=True)
        todo = pending(spec, cell, {a.run.id for a in active}, failed, phases)
        while todo and len(active) < parallel and (max_runs is None or started < max_runs):
            if code is not None:
                _refuse_changed_code(code, active)
            run = todo.pop(0)
            active.append(start(spec, run, data[run.dataset]))
            started += 1
        if not active:
            if started == 0 and max_runs != 0:
                waiting = [r for r in plan(spec, cell) if r.phase in phases and r.chosen_pending]
                print(
                    "no run to start: "
                    + (f"{len(waiting)} wait for a tuning choice; " if waiting else "")
                    + "the others of these cells and phases are done (`plan` lists them)",
                    flush=True,
                )
            # runs whose last attempt failed (twice, or once where --max-runs allowed no retry)
            return sum(1 for run_id in failed if records.load(spec.results, run_id) is None)
        for a in active:
            if time.perf_counter() - a.written >= WALL_EVERY:
                add_wall(a)
        time.sleep(2)
