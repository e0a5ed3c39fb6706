"""Every run of a study, and the rule that picks each objective's setting.

Phases of a cell (dataset, global batch, objective):
- tune: every grid setting x every tuning seed, scored on `val` at the end (the same number for every objective);
- test: the chosen setting, the test seeds (headline objectives: all of them; others: other_test_seeds), on `test`;
- long: headline objectives only, the chosen setting trained epochs x long_factor with its own schedule, on `test`.
The chosen setting is the best mean over the tuning seeds of the final val metric (a tie: the first in grid
order); it exists once every tuning run of the cell is done, so test and long runs wait for it."""

from __future__ import annotations

from dataclasses import dataclass

from . import records
from .spec import Spec, setting_id

PHASES = ("tune", "test", "long")


@dataclass(frozen=True)
class Run:
    dataset: str
    global_batch: int
    objective: str
    setting: tuple  # ((config key, value), ...) in grid order; () while the cell's choice is pending
    seed: int
    phase: str
    epochs: int

    @property
    def settings(self) -> dict:
        return dict(self.setting)

    @property
    def cell(self) -> str:
        return f"{self.dataset}/{self.global_batch}/{self.objective}"

    @property
    def id(self) -> str:
        setting = setting_id(self.settings) if self.setting else "<chosen>"
        return f"{self.cell}/{setting}/s{self.seed}/{self.phase}/e{self.epochs}"

    @property
    def chosen_pending(self) -> bool:
        return not self.setting


def cells(spec: Spec) -> list[tuple[str, int, str]]:
    """(dataset, batch, objective) in the order they run: dataset, then batch, headline objectives first."""
    names = sorted(spec.objectives, key=lambda n: not spec.objectives[n].headline)  # stable: spec order within
    return [(d, b, o) for d in spec.datasets for b in spec.batches for o in names]


def tune_runs(spec: Spec, dataset: str, batch: int, objective: str) -> list[Run]:
    epochs = spec.datasets[dataset].epochs
    return [
        Run(dataset, batch, objective, tuple(s.items()), seed, "tune", epochs)
        for s in spec.objectives[objective].settings()
        for seed in spec.tune_seeds
    ]


def metric_of(record: dict | None) -> float | None:
    return None if record is None else record["final"]["metric"]


def choose(tune_results: list[tuple[dict, list[float | None]]]) -> dict | None:
    """The rule: the setting with the best mean of its seeds' final val metric; None while any run is missing.
    `tune_results`: (setting, [metric per tuning seed]) in grid order; a tie goes to the first."""
    best, best_mean = None, None
    for setting, scores in tune_results:
        if not scores or any(s is None for s in scores):
            return None
        mean = sum(scores) / len(scores)
        if best_mean is None or mean > best_mean:
            best, best_mean = setting, mean
    return best


def chosen(spec: Spec, dataset: str, batch: int, objective: str) -> dict | None:
    by_setting: dict[tuple, list] = {}
    for run in tune_runs(spec, dataset, batch, objective):
        by_setting.setdefault(run.setting, []).append(metric_of(records.load(spec.results, run.id)))
    return choose([(dict(s), scores) for s, scores in by_setting.items()])


def final_runs(spec: Spec, dataset: str, batch: int, objective: str, setting: dict | None) -> list[Run]:
    """The test runs, and the long runs of a headline objective, at `setting` (None: not chosen yet)."""
    key = tuple(setting.items()) if setting else ()
    epochs = spec.datasets[dataset].epochs
    runs = [Run(dataset, batch, objective, key, s, "test", epochs) for s in spec.seeds_of(objective)]
    if spec.objectives[objective].headline:
        runs += [Run(dataset, batch, objective, key, s, "long", epochs * spec.long_factor) for s in spec.test_seeds]
    return runs


def plan(spec: Spec, only_cell: str | None = None) -> list[Run]:
    """Every run of the study in running order (tuning of every cell first, then test runs, then long runs);
    test and long runs of a cell whose choice is pending carry setting ()."""
    tune, test, long = [], [], []
    for dataset, batch, objective in cells(spec):
        if only_cell and only_cell != f"{dataset}/{batch}/{objective}":
            continue
        tune += tune_runs(spec, dataset, batch, objective)
        for run in final_runs(spec, dataset, batch, objective, chosen(spec, dataset, batch, objective)):
            (test if run.phase == "test" else long).append(run)
    return tune + test + long


def budget(spec: Spec) -> dict[str, int]:
    """Tuning runs per objective and cell: settings x tuning seeds (spec.load refuses unequal ones)."""
    return {name: len(o.settings()) * len(spec.tune_seeds) for name, o in spec.objectives.items()}


def steps_of(spec: Spec, run: Run, train_samples: int) -> int:
    return train_samples // run.global_batch * run.epochs
