"""A study's spec: one YAML or JSON file naming the data, the objectives with their tuning grids, the batch sizes
and the seeds. Every mistake in it is a SpecError (one line naming the key); the CLI turns it into exit 2."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

METRICS = ("retrieval_R1", "zeroshot_top1")  # mean R@1 of both retrieval directions; mean zero-shot top-1
# batch-resolved spec keys and the config key each becomes (resolve_setting)
RESOLVED_AS = {"loss.rho_frac": "loss.rho", "optim.lr_tau_b32": "optim.lr_tau"}
# `fastclip train` keys every run's command sets from the spec itself (runner.command): a spec that set one in
# `train`, `options` or a grid would be overridden without a word
STUDY_SET = {
    "data.train": "datasets.<name>.data", "data.val": "datasets.<name>.data", "data.zeroshot": "datasets.<name>.data",
    "data.batch_size": "batches", "model.arch": "datasets.<name>.arch", "loss.name": "objectives.<name>.loss",
    "optim.warmup_steps": "warmup_frac", "train.epochs": "datasets.<name>.epochs (x long_factor)",
    "train.seed": "tune_seeds / test_seeds", "train.run_dir": "work", "train.device": "device",
    "train.progress": None, "train.tensorboard": None, "train.log_every": "curve_points",
    "eval.every_steps": "curve_points / tune_curve_points", "eval.at_end": None, "eval.max_samples": None,
    "checkpoint.every_steps": "curve_points", "checkpoint.every_minutes": None, "checkpoint.keep_last": None,
    "checkpoint.at_end": None,
}  # fmt: skip
CHECK_KEYS = ("class_blind_oracle_R1", "context_cut_share")


class SpecError(ValueError):
    """A spec that cannot be run, named by file and key."""


@dataclass(frozen=True)
class Dataset:
    name: str
    data: Path  # folder with train/, val/, test/ [novel/] shard folders and zeroshot.json
    make: tuple[str, ...] | None  # the command that writes `data` when it is missing ({data} is replaced)
    arch: str
    epochs: int
    metric: str
    placeholder: str | None  # why this data stands in for the intended one (printed in every report)
    checks: dict  # class_blind_oracle_R1 / context_cut_share measured on the data, when known


@dataclass(frozen=True)
class Objective:
    name: str
    loss: str
    options: dict  # fixed `fastclip train` config keys (dotted: loss.temperature, optim.lr_tau, model.ema_momentum)
    # dotted key -> values, or {global batch: values} (e.g. an lr grid centred per batch); the settings are their
    # product; batch-resolved keys (resolve_setting): loss.rho_frac, optim.lr_tau_b32, loss.bias: prior
    grid: dict
    baseline: bool  # a candidate for "the strongest baseline" of a table
    headline: bool  # gets the full test seeds and the longer training
    # dotted key -> another objective: the key takes that objective's chosen value in the same table (its tuning
    # waits for that choice), e.g. hard negatives tuned on top of dcl at dcl's tuned τ
    from_choice: dict = field(default_factory=dict)
    # the batches it runs at, of the spec's (None: every one), e.g. a variant's; others are ignored, as a grid's
    # values for them are, so a spec built on this one (`base:`) may run other batches
    batches: tuple[int, ...] | None = None

    def runs_at(self, batch: int) -> bool:
        return self.batches is None or batch in self.batches

    def grid_at(self, batch: int) -> dict[str, list]:
        """The grid at a global batch: a key's per-batch values taken at `batch`."""
        return {k: v[batch] if isinstance(v, dict) else v for k, v in self.grid.items()}

    def settings(self, batch: int) -> list[dict]:
        grid = self.grid_at(batch)
        return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


@dataclass(frozen=True)
class Contrast:
    """A question the study asks of two objectives, answered by a − b on their paired test seeds."""

    question: str
    a: str
    b: str


@dataclass(frozen=True)
class Spec:
    path: Path
    name: str
    results: Path  # one JSON per run under results/runs/, the tables beside
    work: Path  # run folders (checkpoints while a run is in progress) and made data
    datasets: dict[str, Dataset]
    objectives: dict[str, Objective]
    batches: tuple[int, ...]
    tune_seeds: tuple[int, ...]
    test_seeds: tuple[int, ...]  # headline objectives
    other_test_seeds: tuple[int, ...]  # the others (paired with the first headline seeds)
    long_factor: int  # the headline objectives' longer training: epochs x this, its own schedule
    long_seeds: tuple[int, ...]  # the longer training's seeds: the first of test_seeds (default: all of them)
    warmup_frac: float
    curve_points: int  # evaluations per run (the curve), also its checkpoints (a killed run loses at most one)
    # evaluations per tuning run: its choice reads only the last, and evaluating never changes what trains
    # (tests/test_study.py), so fewer passes over val cost less; its checkpoints stay at curve_points
    tune_curve_points: int
    device: str
    train: dict  # config keys every run gets (e.g. optim.wd)
    report_md: Path  # the tables
    summary_json: Path  # the flat summary (README.md of this package: its schema)
    # questions asked of two objectives, a − b on paired test seeds (u: fastclip-v1 − dcl), each table's own family
    contrasts: tuple[Contrast, ...] = ()

    def objectives_at(self, batch: int) -> list[str]:
        """The objectives of the tables at `batch` (spec order): those that run at it."""
        return [name for name, o in self.objectives.items() if o.runs_at(batch)]

    def batches_of(self, objective: str) -> list[int]:
        """The spec's batches `objective` runs at (spec order)."""
        return [b for b in self.batches if self.objectives[objective].runs_at(b)]


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise SpecError(f"{where}: {what}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _not_study_set(keys, where: str, train: bool = False) -> None:
    for key in keys:
        if key == "data.workers" and not train:  # the runner reads it from `train` only
            raise SpecError(f"{where}.{key}: set data.workers in the spec's `train` (every run's loader); remove it")
        if key in STUDY_SET:
            by = f" (from {STUDY_SET[key]})" if STUDY_SET[key] else ""
            raise SpecError(f"{where}.{key}: the study sets {key} itself in every run{by}; remove it")


def _config_keys(raw, where: str, train: bool = False) -> dict:
    _need(isinstance(raw, dict), where, f"must map dotted config keys to values, got {raw!r}")
    for key in raw:
        _need(isinstance(key, str) and "." in key, f"{where}.{key}", "must be a dotted config key (optim.lr)")
    _not_study_set(raw, where, train)
    return dict(raw)


def _grid_values(values: list, where: str) -> None:
    _need(isinstance(values, list) and values, where, "must be a non-empty list")
    for v in values:
        scalar = v is None or isinstance(v, (int, float, str, bool))
        numbers = isinstance(v, list) and all(_is_number(x) for x in v)  # e.g. loss.tau_betas: [0.9, 0.98]
        _need(scalar or numbers, where, f"values must be scalars or lists of numbers, got {v!r}")
        if isinstance(v, str):
            try:
                number = float(v)
            except ValueError:
                continue
            as_yaml = (
                repr(number) if math.isfinite(number) else {"inf": ".inf", "-inf": "-.inf"}.get(str(number), ".nan")
            )
            raise SpecError(f"{where}: {v!r} is text, not a number (YAML reads 1e-3 as text): write {as_yaml}")
    repeated = sorted({repr(v) for v in values if values.count(v) > 1})
    _need(not repeated, where, f"repeats {', '.join(repeated)}: each value once (every setting costs the same runs)")


def _path(raw: dict, key: str, where: str) -> str | None:
    value = raw.get(key)
    _need(value is None or (isinstance(value, str) and value.strip()), f"{where}: {key}",
          f"must be a path (text), got {value!r}")  # fmt: skip
    return value


def _seeds(raw, where: str, least: int) -> tuple[int, ...]:
    ok = isinstance(raw, list) and all(_is_int(s) and s >= 0 for s in raw)
    _need(ok and len(set(raw)) == len(raw), where, f"must be a list of distinct integers >= 0, got {raw!r}")
    _need(len(raw) >= least, where, f"needs at least {least} seeds (the protocol), got {len(raw)}")
    return tuple(raw)


def _dataset(name: str, raw: dict, base: Path, where: str) -> Dataset:
    _name(name, where, "dataset")
    _need(isinstance(raw, dict), where, "must be a mapping (data, arch, epochs, metric)")
    known = {"data", "make", "arch", "epochs", "metric", "placeholder", "checks"}
    unknown = set(raw) - known
    _need(not unknown, where, f"unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    for key in ("data", "arch", "epochs", "metric"):
        _need(key in raw, where, f"needs `{key}`")
    _need(
        isinstance(raw["data"], str) and raw["data"].strip(), f"{where}.data", f"must be a folder, got {raw['data']!r}"
    )
    _need(isinstance(raw["arch"], str) and raw["arch"], f"{where}.arch", f"must be a model name, got {raw['arch']!r}")
    _need(raw["metric"] in METRICS, f"{where}.metric", f"must be one of {METRICS}, got {raw['metric']!r}")
    _need(_is_int(raw["epochs"]) and raw["epochs"] >= 1, f"{where}.epochs", "must be an integer >= 1")
    make = raw.get("make")
    _need(make is None or (isinstance(make, list) and make), f"{where}.make", "must be a command as a list")
    checks = raw.get("checks") or {}
    _need(isinstance(checks, dict), f"{where}.checks", f"must map {list(CHECK_KEYS)} to numbers, got {checks!r}")
    for key, value in checks.items():
        _need(key in CHECK_KEYS, f"{where}.checks.{key}", f"unknown; known: {list(CHECK_KEYS)}")
        _need(_is_number(value), f"{where}.checks.{key}", f"must be a number, got {value!r}")
    return Dataset(
        name=name,
        data=(base / raw["data"]).resolve(),
        make=None if make is None else tuple(str(x) for x in make),
        arch=str(raw["arch"]),
        epochs=raw["epochs"],
        metric=raw["metric"],
        placeholder=raw.get("placeholder"),
        checks=dict(checks),
    )


def _name(name, where: str, what: str) -> None:
    ok = isinstance(name, str) and name and not any(c in name for c in "/*?[] ")
    _need(ok, where, f"a {what}'s name is a word without '/', '*', '?', '[', ']' or spaces (run ids are "
          "dataset/batch/objective/..., --cell takes patterns)")  # fmt: skip


def _check_loss_name(name, where: str) -> None:
    """A fastclip loss, or module:attribute naming one of the user's own (on PYTHONPATH). The package also runs a
    table's cells at the older fastclip its runs started with (at_commit.sh), which knows its own names only."""
    try:
        from fastclip.losses import UnknownLossError, loss_entry
    except ImportError:  # fastclip before 2026-12-01
        from fastclip.losses import LOSSES

        _need(isinstance(name, str) and name in LOSSES, where, f"unknown loss {name!r}: this fastclip knows "
              f"{sorted(LOSSES)}")  # fmt: skip
        return
    try:
        loss_entry(name)
    except UnknownLossError as e:
        _need(False, where, str(e))


def _objective(name: str, raw: dict, where: str) -> Objective:
    _name(name, where, "objective")
    what = "must be a mapping with `loss` (a fastclip loss name, or module:attribute)"
    _need(isinstance(raw, dict) and "loss" in raw, where, what)
    known = {"loss", "options", "grid", "baseline", "headline", "from_choice", "batches"}
    unknown = set(raw) - known
    _need(not unknown, where, f"unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    _check_loss_name(raw["loss"], f"{where}.loss")
    grid = raw.get("grid") or {}
    _need(isinstance(grid, dict) and grid, f"{where}.grid", "must map config keys to lists of values")
    for key, values in list(grid.items()):
        _need(isinstance(key, str) and "." in key, f"{where}.grid.{key}", "must be a dotted config key (optim.lr)")
        if isinstance(values, dict):  # per global batch (JSON keys are strings)
            ok = all(str(b).isdigit() for b in values)
            got = sorted(map(str, values))
            _need(ok, f"{where}.grid.{key}", f"per-batch values must be keyed by global batch, got {got}")
            values = grid[key] = {int(b): v for b, v in values.items()}
            for b, v in values.items():
                _grid_values(v, f"{where}.grid.{key}.{b}")
        else:
            _grid_values(values, f"{where}.grid.{key}")
    _not_study_set(grid, f"{where}.grid")
    options = _config_keys(raw.get("options") or {}, f"{where}.options")
    clash = {RESOLVED_AS.get(k, k) for k in options} & {RESOLVED_AS.get(k, k) for k in grid}
    _need(not clash, where, f"{sorted(clash)} both fixed in options and tuned in grid")
    from_choice = raw.get("from_choice") or {}
    _need(isinstance(from_choice, dict), f"{where}.from_choice", "must map config keys to objective names")
    clash = {RESOLVED_AS.get(k, k) for k in from_choice} & {RESOLVED_AS.get(k, k) for k in (*options, *grid)}
    _need(not clash, f"{where}.from_choice", f"{sorted(clash)} also fixed in options or tuned in grid")
    for key in ("baseline", "headline"):  # (text "false" is true to bool())
        _need(raw.get(key) is None or isinstance(raw.get(key), bool), f"{where}.{key}",
              f"must be true or false, got {raw.get(key)!r}")  # fmt: skip
    baseline, headline = bool(raw.get("baseline")), bool(raw.get("headline"))
    batches = raw.get("batches")
    ok = batches is None or (
        isinstance(batches, list) and batches and all(isinstance(b, int) and not isinstance(b, bool) for b in batches)
    )
    ok = ok and all(b >= 2 for b in batches or ())
    _need(ok, f"{where}.batches", f"must be a list of global batch sizes >= 2, got {batches!r}")
    _need(batches is None or len(set(batches)) == len(batches), f"{where}.batches", f"repeats a batch: {batches}")
    batches = None if batches is None else tuple(batches)
    return Objective(name, raw["loss"], options, grid, baseline, headline, dict(from_choice), batches)


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The mapping of a spec file; `base: FILE` (beside it) gives the keys it does not set, mappings merged key by
    key (lists replaced): a study's variant (another device, more seeds) is its differences only."""
    of = f" (the base of {seen[-1]})" if seen else ""
    if path.is_dir():
        raise SpecError(f"{path}: is a directory{of}; give a spec file (e.g. benchmarks/study/v2.yaml)")
    if not path.is_file():
        raise SpecError(f"{path}: no such spec file{of}")
    _need(path.resolve() not in seen, str(path), "is its own base (a cycle of `base:`)")
    try:
        import yaml

        text = path.read_text()
        # JSON is YAML: one parser for any suffix (.yml, .YAML, .txt)
        raw = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: cannot read it{of} ({error})") from None
    except (ValueError, yaml.YAMLError) as error:
        raise SpecError(f"{path}: not valid YAML/JSON{of} ({str(error).splitlines()[0]})") from None
    _need(isinstance(raw, dict), str(path) + of, "must be a mapping of the spec's keys")
    if "base" not in raw:
        return raw
    _need(isinstance(raw["base"], str) and raw["base"], f"{path}: base", "must name a spec file beside this one")
    base = _read(path.parent / raw.pop("base"), (*seen, path.resolve()))
    return _merged(base, raw)


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load(path: Path) -> Spec:
    """The spec at `path` (YAML or JSON), checked: equal tuning budgets, >= 2 tuning seeds, >= 6 test seeds for
    headline objectives, a longer-training factor >= 3, at least one baseline."""
    path = Path(path)
    raw = _read(path)
    known = {
        "name", "results", "work", "datasets", "objectives", "batches", "tune_seeds", "test_seeds",
        "other_test_seeds", "long_factor", "long_seeds", "warmup_frac", "curve_points", "tune_curve_points",
        "device", "train", "report_md", "summary_json", "contrasts",
    }  # fmt: skip
    unknown = set(raw) - known
    _need(not unknown, str(path), f"unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    for key in ("name", "datasets", "objectives", "batches", "tune_seeds", "test_seeds"):
        _need(key in raw, str(path), f"needs `{key}`")
    _need(isinstance(raw["name"], str) and raw["name"].strip(), f"{path}: name", f"must be a word, got {raw['name']!r}")
    for key in ("datasets", "objectives"):
        _need(isinstance(raw[key] or {}, dict), f"{path}: {key}", f"must be a mapping of names, got {raw[key]!r}")
    for key in ("results", "work", "report_md", "summary_json"):
        _path(raw, key, str(path))
    repo = Path(__file__).resolve().parents[2]
    datasets = {n: _dataset(n, d, repo, f"{path}: datasets.{n}") for n, d in (raw["datasets"] or {}).items()}
    objectives = {n: _objective(n, o, f"{path}: objectives.{n}") for n, o in (raw["objectives"] or {}).items()}
    _need(bool(datasets) and bool(objectives), str(path), "needs at least one dataset and one objective")
    _need(any(o.baseline for o in objectives.values()), f"{path}: objectives", "mark at least one `baseline: true`")
    for name, objective in objectives.items():
        for key, source in objective.from_choice.items():
            where = f"{path}: objectives.{name}.from_choice.{key}"
            _need(isinstance(source, str), where, f"must name an objective, got {source!r}")
            _need(source in objectives and source != name, where, f"names no other objective ({source!r})")
            _need(key in objectives[source].grid, where, f"{source} does not tune {key}, so it has no choice of it")
            _need(not objectives[source].from_choice, where, f"{source} takes a choice itself (one step only)")
    batches = raw["batches"]
    _need(
        isinstance(batches, list) and batches and all(_is_int(b) and b >= 2 for b in batches),
        f"{path}: batches",
        "must be a list of global batch sizes >= 2",
    )
    _need(len(set(batches)) == len(batches), f"{path}: batches", f"repeats a batch: {batches}")
    for name, objective in objectives.items():
        own = [b for b in batches if objective.runs_at(b)]
        for key, values in objective.grid.items():
            if isinstance(values, dict):
                where = f"{path}: objectives.{name}.grid.{key}"
                missing = sorted(set(own) - set(values))  # more are fine: another spec may run more batches
                _need(not missing, where, f"has no values for batch(es) {missing} it runs at")
        for key, source in objective.from_choice.items():
            lacking = [b for b in own if not objectives[source].runs_at(b)]
            where = f"{path}: objectives.{name}.from_choice.{key}"
            _need(not lacking, where, f"{source} does not run at batch(es) {lacking}, so it has no choice there")
    bare = [b for b in batches if not any(o.baseline and o.runs_at(b) for o in objectives.values())]
    _need(not bare, f"{path}: objectives", f"no baseline runs at batch(es) {bare}; every table needs one")
    budgets = {(n, b): len(o.settings(b)) for n, o in objectives.items() for b in batches if o.runs_at(b)}
    _need(
        len(set(budgets.values())) == 1,
        f"{path}: objectives",
        "unequal tuning budgets (settings per objective and batch: "
        + ", ".join(f"{n}@{b}: {k}" for (n, b), k in budgets.items())
        + "); give every objective as many settings at every batch",
    )
    test_seeds = _seeds(raw["test_seeds"], f"{path}: test_seeds", 6)
    other = _seeds(raw.get("other_test_seeds", raw["test_seeds"]), f"{path}: other_test_seeds", 2)
    tune_seeds = _seeds(raw["tune_seeds"], f"{path}: tune_seeds", 2)
    outside = sorted(set(other) - set(test_seeds))
    _need(not outside, f"{path}: other_test_seeds", f"{outside} are not test seeds: the others' seeds must be some "
          "of test_seeds, for the comparisons to pair them")  # fmt: skip
    shared = sorted(set(tune_seeds) & (set(test_seeds) | set(other)))
    _need(not shared, f"{path}: tune_seeds", f"{shared} also test seeds; the test seeds must be fresh")
    long_seeds = _seeds(raw.get("long_seeds", raw["test_seeds"]), f"{path}: long_seeds", 6)
    prefix = test_seeds[: len(long_seeds)]
    _need(long_seeds == prefix, f"{path}: long_seeds", f"must be the first {len(long_seeds)} of test_seeds "
          f"{list(test_seeds)}, for the tuned length's runs to pair with them")  # fmt: skip
    long_factor = raw.get("long_factor", 3)
    _need(isinstance(long_factor, int) and long_factor >= 3, f"{path}: long_factor", "must be an integer >= 3")
    curve_points = raw.get("curve_points", 16)
    _need(isinstance(curve_points, int) and 1 <= curve_points <= 20, f"{path}: curve_points", "must be 1..20")
    tune_points = raw.get("tune_curve_points", curve_points)
    _need(
        isinstance(tune_points, int) and 1 <= tune_points <= curve_points,
        f"{path}: tune_curve_points",
        f"must be 1..curve_points ({curve_points})",
    )
    warmup_frac = raw.get("warmup_frac", 0.05)
    ok = _is_number(warmup_frac) and 0 <= warmup_frac < 1
    _need(ok, f"{path}: warmup_frac", f"must be a number in [0, 1), got {warmup_frac!r}")
    device = raw.get("device", "cpu")
    _need(isinstance(device, str) and device, f"{path}: device", f"must be cpu or cuda, got {device!r}")
    train = _config_keys(raw.get("train") or {}, f"{path}: train", train=True)
    for name, objective in objectives.items():  # (the grid's value was taken, the train one dropped, silently)
        tuned = {RESOLVED_AS.get(k, k) for k in objective.grid} & {RESOLVED_AS.get(k, k) for k in train}
        _need(not tuned, f"{path}: train", f"{sorted(tuned)} also tuned in objectives.{name}.grid, whose values the "
              "runs take; remove it from train")  # fmt: skip
    contrasts = _contrasts(raw.get("contrasts") or [], objectives, f"{path}: contrasts")
    results = (repo / raw.get("results", f"benchmarks/results/{raw['name']}")).resolve()
    return Spec(
        path=path,
        name=str(raw["name"]),
        results=results,
        work=(repo / raw.get("work", f"benchmarks/out/{raw['name']}")).resolve(),
        datasets=datasets,
        objectives=objectives,
        batches=tuple(batches),
        tune_seeds=tune_seeds,
        test_seeds=test_seeds,
        other_test_seeds=other,
        long_factor=long_factor,
        long_seeds=long_seeds,
        warmup_frac=float(warmup_frac),
        curve_points=curve_points,
        tune_curve_points=tune_points,
        device=device,
        train=train,
        report_md=(repo / raw["report_md"]).resolve() if "report_md" in raw else results / "report.md",
        summary_json=(repo / raw["summary_json"]).resolve() if "summary_json" in raw else results / "summary.json",
        contrasts=contrasts,
    )


def _contrasts(raw, objectives: dict, where: str) -> tuple[Contrast, ...]:
    """`contrasts: [{question: ..., a: objective, b: objective}, ...]`, checked."""
    _need(isinstance(raw, list), where, f"must be a list of {{question, a, b}}, got {raw!r}")
    out = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        shaped = isinstance(item, dict) and set(item) == {"question", "a", "b"}
        _need(shaped, at, f"must be {{question, a, b}}, got {item!r}")
        _need(isinstance(item["question"], str) and item["question"].strip(), f"{at}.question", "must be a sentence")
        for side in ("a", "b"):
            _need(item[side] in objectives, f"{at}.{side}", f"names no objective ({item[side]!r}); objectives: "
                  f"{sorted(objectives)}")  # fmt: skip
        _need(item["a"] != item["b"], at, f"compares {item['a']} with itself")
        out.append(Contrast(item["question"].strip(), item["a"], item["b"]))
    return tuple(out)


def resolve_setting(setting: dict, global_batch: int) -> dict:
    """Config keys of an objective's options or grid setting at a global batch B, where one value should mean one
    regime at every batch:
    - loss.rho_frac f: loss.rho = f * ln(B - 1) (RGCL's ρ bounds the KL to uniform over the B - 1 negatives);
    - optim.lr_tau_b32 v: optim.lr_tau = v * B / 32 (a run of fixed samples takes 32/B times the steps at B, so the
      learned temperature's reach, lr_tau x steps in log τ under Adam, is the same at every batch);
    - loss.bias: prior: loss.bias = -ln(B - 1), so sigmoid(bias) = 1/B, a pair's prior chance of being the positive
      (SigLIP's -10 is that rule at B of about 22,000)."""
    out = {}
    for key, value in setting.items():
        if key == "loss.rho_frac":
            out["loss.rho"] = round(float(value) * math.log(global_batch - 1), 4)
        elif key == "optim.lr_tau_b32":
            out["optim.lr_tau"] = float(f"{float(value) * global_batch / 32:.6g}")
        elif key == "loss.bias" and value == "prior":
            out["loss.bias"] = round(-math.log(global_batch - 1), 4)
        else:
            out[key] = value
    return out


def setting_id(setting: dict) -> str:
    """A setting's short name: its last key parts and values, e.g. lr5e-04_temperature0.07."""

    def fmt(v) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    return "_".join(f"{k.rsplit('.', 1)[-1]}{fmt(v)}" for k, v in setting.items())
