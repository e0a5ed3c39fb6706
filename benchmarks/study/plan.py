"""Every run of a study, and the rule that picks each objective's setting.

Phases of a cell (dataset, global batch, objective):
- tune: every grid setting x every tuning seed, scored on `val` at the end (the same number for every objective);
- test: the chosen setting, the test seeds (headline objectives: all of them; others: other_test_seeds), on `test`;
- long: headline objectives only, the chosen setting trained epochs x long_factor with its own schedule, on `test`,
  for long_seeds (the first test seeds), run seed by seed across a table's objectives.
The chosen setting is the best mean over the tuning seeds of the final val metric (a tie: the first in grid
order); it exists once every tuning run of the cell is done, so test and long runs wait for it.

Each table (dataset, batch) names its winner and its strongest baseline on val too (the chosen settings' val
means), before a test seed is read: the test seeds then measure them afresh, and a table is not a contest won on
the data that scores it. Both get the headline objectives' treatment (every test seed and the longer training)
whether the spec marks them headline or not: the comparison the headline reports has the full seeds' power."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from . import records
from .spec import Spec, setting_id

PHASES = ("tune", "test", "long")


class Waiting(str):
    """A setting's value still to be taken from another objective's choice (spec `from_choice`): its text is
    `<that objective>`, so a waiting run has an id of its own, and the run is pending."""


@dataclass(frozen=True)
class Run:
    dataset: str
    global_batch: int
    objective: str
    # ((config key, value), ...): the grid's keys in order, then the keys taken from another objective's choice
    # (Waiting values until it exists); () for a test or long run while the cell's own choice is pending
    setting: tuple
    seed: int
    phase: str
    epochs: int

    @property
    def settings(self) -> dict:
        return dict(self.setting)

    @property
    def cell(self) -> str:
        return cell_name(self.dataset, self.global_batch, self.objective)

    @property
    def id(self) -> str:
        setting = setting_id(self.settings) if self.setting else "<chosen>"
        return f"{self.cell}/{setting}/s{self.seed}/{self.phase}/e{self.epochs}"

    @property
    def chosen_pending(self) -> bool:
        return not self.setting or any(isinstance(v, Waiting) for _, v in self.setting)


def cell_name(dataset: str, batch: int, objective: str) -> str:
    """A cell's name, as `run --cell` matches it and run ids start: dataset/batch/objective."""
    return f"{dataset}/{batch}/{objective}"


def cells(spec: Spec) -> list[tuple[str, int, str]]:
    """(dataset, batch, objective) in the order they run: dataset, then batch, headline objectives first."""
    names = sorted(spec.objectives, key=lambda n: not spec.objectives[n].headline)  # stable: spec order within
    return [(d, b, o) for d in spec.datasets for b in spec.batches for o in names if spec.objectives[o].runs_at(b)]


EDGE_STEPS = 2  # at most this many steps past a grid's edge, per knob
# a step past a grid's top stops here: the config refuses more γ_min (in (0, 1]); a KL to uniform over B - 1
# negatives is below ln(B - 1), so RGCL's ρ at or past that (rho_frac 1) only drives τ down to its floor
KNOB_MAX = {"loss.gamma_min": 1.0, "loss.rho_frac": 1.0}


def _runs_of(spec: Spec, dataset: str, batch: int, objective: str, settings: list[dict]) -> list[Run]:
    epochs = spec.datasets[dataset].epochs
    return [
        Run(dataset, batch, objective, tuple(s.items()), seed, "tune", epochs)
        for s in settings
        for seed in spec.tune_seeds
    ]


def metric_of(record: dict | None) -> float | None:
    return None if record is None else record["final"]["metric"]


def _scores(spec: Spec, runs: list[Run]) -> list[tuple[dict, list]]:
    by_setting: dict[tuple, list] = {}
    for run in runs:
        by_setting.setdefault(run.setting, []).append(metric_of(records.load(spec.results, run.id)))
    return [(dict(s), scores) for s, scores in by_setting.items()]


def step_past(grid: dict, setting: dict, key: str) -> dict | None:
    """`setting` with `key` one geometric step past its grid's edge (the ratio of the edge to its neighbour), when
    the value sits on the lowest or highest of 3 or more positive numbers; else None. A step past the key's
    KNOB_MAX lands on it (γ_min 0.8 -> 1, not 1.28), and a value already there has no step."""
    values = sorted(grid[key])
    if len(values) < 3 or not all(isinstance(v, (int, float)) and v > 0 for v in values):
        return None
    value = setting[key]
    if value <= values[0]:
        nearer = values[1] if value == values[0] else values[0]
    elif value >= values[-1]:
        nearer = values[-2] if value == values[-1] else values[-1]
    else:
        return None
    step = value * value / nearer
    # an integer knob (a queue's size, top-k) stays an integer: `fastclip train` refuses 2048.0
    step = max(1, round(step)) if all(isinstance(v, int) for v in values) else float(f"{step:.4g}")
    if step == value:  # an integer knob at 1: no step below it
        return None
    if key in KNOB_MAX and step > KNOB_MAX[key]:
        if value >= KNOB_MAX[key]:
            return None
        step = KNOB_MAX[key]
    return {**setting, key: step}


def tune_plan(spec: Spec, dataset: str, batch: int, objective: str) -> tuple[list[Run], dict | None]:
    """The cell's tuning runs and its choice (None until every run it needs is done)."""
    runs, best, _ = tune_result(spec, dataset, batch, objective)
    return runs, best


def tune_result(
    spec: Spec, dataset: str, batch: int, objective: str, known: dict | None = None
) -> tuple[list[Run], dict | None, list | None]:
    """The cell's tuning runs, its choice and the choice's val scores per tuning seed (None, None until every run
    it needs is done). First the grid; once it is done, while the best setting sits on a knob's lowest or highest
    value, the setting one step past it (2 seeds), kept while it wins, at most EDGE_STEPS steps per knob: the optimum
    may lie past the grid (issue 38)."""
    grid = spec.objectives[objective].grid_at(batch)
    taken = taken_values(spec, dataset, batch, objective, known)
    settings = [{**s, **taken} for s in spec.objectives[objective].settings(batch)]
    runs = _runs_of(spec, dataset, batch, objective, settings)
    if any(isinstance(v, Waiting) for v in taken.values()):  # the grid's runs wait for another objective's choice
        return runs, None, None
    scores = _scores(spec, runs)
    best = choose(scores)
    best_scores = next((v for s, v in scores if s == best), None)
    for key in grid:
        for _ in range(EDGE_STEPS):
            if best is None:
                return runs, None, None
            past = step_past(grid, best, key)
            if past is None or refused_step(spec, dataset, batch, objective, past):
                break
            extra = _runs_of(spec, dataset, batch, objective, [past])
            runs += extra
            past_scores = _scores(spec, extra)[0][1]
            if None in past_scores:
                return runs, None, None
            if choose([(best, best_scores), (past, past_scores)]) is best:
                break
            best, best_scores = past, past_scores
    return runs, best, best_scores if best is not None else None


def refused_step(spec: Spec, dataset: str, batch: int, objective: str, past: dict) -> str | None:
    """What the trainer says against a step past a grid's edge (None: it takes it); such a step is not tuned."""
    from .settings import config_problem  # (the trainer's config: imported when a grid's best sits on an edge)

    return config_problem(spec, objective, batch, past, dataset)


def taken_values(spec: Spec, dataset: str, batch: int, objective: str, known: dict | None = None) -> dict:
    """The values `objective` takes from other objectives' choices in this table (spec `from_choice`); a Waiting
    value where that choice is pending. `known`: objective -> tune_result already read for this table."""
    taken = {}
    for key, source in spec.objectives[objective].from_choice.items():
        choice = (known[source] if known and source in known else tune_result(spec, dataset, batch, source))[1]
        taken[key] = Waiting(f"<{source}>") if choice is None else choice[key]
    return taken


def table_results(spec: Spec, dataset: str, batch: int) -> dict:
    """objective -> tune_result, for every objective of a table (spec order), each one's tuning read once: the
    objectives that take values from another's choice come after the others, and read it from here."""
    results: dict = {}
    for name in sorted(spec.objectives_at(batch), key=lambda n: bool(spec.objectives[n].from_choice)):
        results[name] = tune_result(spec, dataset, batch, name, results)
    return {name: results[name] for name in spec.objectives_at(batch)}


def tune_runs(spec: Spec, dataset: str, batch: int, objective: str) -> list[Run]:
    return tune_plan(spec, dataset, batch, objective)[0]


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
    return tune_plan(spec, dataset, batch, objective)[1]


@dataclass(frozen=True)
class Designation:
    """A table's winner and strongest baseline, named by the val mean of each objective's chosen setting (a tie:
    the first in spec order); `complete` once every objective of the table has its choice (until then they are
    the leaders among those that have one)."""

    winner: str | None
    baseline: str | None
    complete: bool
    val: dict  # objective -> val mean of its chosen setting

    @property
    def runner_up(self) -> str | None:
        """When the winner is the strongest baseline, the objective it is compared with: the best other on val."""
        others = [n for n in self.val if n != self.winner]
        return max(others, key=self.val.get) if self.winner == self.baseline and others else None


def designate(spec: Spec, dataset: str, batch: int, results: dict | None = None) -> Designation:
    """`results`: objective -> its tune_result, when the caller has them (else read here)."""
    if results is None:
        results = table_results(spec, dataset, batch)
    val = {o: sum(scores) / len(scores) for o, (_, best, scores) in results.items() if best is not None}
    baselines = [n for n in val if spec.objectives[n].baseline]
    return Designation(
        winner=max(val, key=val.get) if val else None,
        baseline=max(baselines, key=val.get) if baselines else None,
        complete=len(val) == len(results),
        val=val,
    )


def full_treatment(spec: Spec, objective: str, designation: Designation) -> bool:
    """Every test seed and the longer training: a headline objective, or its table's winner or strongest baseline
    once every choice of the table is made (and the runner-up where those are one: the winner's comparison, whose
    samples-to-target is measured at the longer length too)."""
    named = designation.complete and objective in (designation.winner, designation.baseline, designation.runner_up)
    return spec.objectives[objective].headline or named


def final_runs(spec: Spec, dataset: str, batch: int, objective: str, setting: dict | None, full: bool) -> list[Run]:
    """The test runs, and the long runs of a fully treated objective (full_treatment), at `setting` (None: not
    chosen yet)."""
    key = tuple(setting.items()) if setting else ()
    epochs = spec.datasets[dataset].epochs
    runs = [
        Run(dataset, batch, objective, key, s, "test", epochs)
        for s in (spec.test_seeds if full else spec.other_test_seeds)
    ]
    if full:
        runs += [Run(dataset, batch, objective, key, s, "long", epochs * spec.long_factor) for s in spec.long_seeds]
    return runs


def selected(only: str | Iterable[str] | None) -> set[str] | None:
    """The cells ("dataset/batch/objective") `only` names: one, several, or None for every cell."""
    return None if only is None else {only} if isinstance(only, str) else set(only)


def plan(spec: Spec, only: str | Iterable[str] | None = None) -> list[Run]:
    """Every run of the study (of the cells `only` names: one or several) in running order (tuning of every cell
    first, then test runs, then long runs); test and long runs of a cell whose choice is pending carry setting (),
    tuning runs that wait for another objective's choice a Waiting value (Run.chosen_pending)."""
    wanted = selected(only)
    tune, test, long = [], [], []
    tables: dict[tuple[str, int], tuple[dict, Designation]] = {}  # each table's tune_results (read once), naming
    for dataset, batch, objective in cells(spec):
        if wanted is not None and cell_name(dataset, batch, objective) not in wanted:
            continue
        if (dataset, batch) not in tables:
            results = table_results(spec, dataset, batch)
            tables[dataset, batch] = results, designate(spec, dataset, batch, results)
        results, named = tables[dataset, batch]
        runs, best, _ = results[objective]
        tune += runs
        for run in final_runs(spec, dataset, batch, objective, best, full_treatment(spec, objective, named)):
            (test if run.phase == "test" else long).append(run)
    # each table's long runs seed by seed across its objectives: a stopped phase leaves paired seeds, not one
    # objective's every seed and another's none
    tables_order = list(dict.fromkeys((r.dataset, r.global_batch) for r in long))
    long.sort(key=lambda r: (tables_order.index((r.dataset, r.global_batch)), spec.long_seeds.index(r.seed)))
    return tune + test + long


def budget(spec: Spec) -> dict[str, int]:
    """Tuning runs per objective and cell: settings x tuning seeds (spec.load refuses unequal ones)."""
    return {
        name: len(spec.objectives[name].settings(at[0])) * len(spec.tune_seeds)
        for name in spec.objectives
        if (at := spec.batches_of(name))
    }


def steps_of(run: Run, train_samples: int) -> int:
    """The run's training steps as the trainer counts them: each epoch's last batch filled (num_batches in
    fastclip/data/plan.py), not dropped."""
    return math.ceil(train_samples / run.global_batch) * run.epochs
