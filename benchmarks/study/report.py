"""The study's tables (markdown) and its flat summary (JSON, the schema in README.md), from the run JSONs.

A table is one dataset at one global batch and one training length (the tuned length: every objective; the longer
one: the fully treated objectives). Its winner and strongest baseline are named on val before any test seed
(plan.designate); every other objective is compared with that baseline seed by seed on the test seeds they share
(stats.compare, Holm over the table)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from . import held_out, records, runner
from .plan import (
    KNOB_MAX,
    PHASES,
    cell_name,
    choose,
    chosen,
    designate,
    metric_of,
    plan,
    refused_step,
    step_past,
    tune_plan,
)
from .plots import figure_path, write_figures
from .runner import run_dir, zeroshot_sets
from .spec import Spec, SpecError, setting_id
from .stats import (
    compare,
    contrast,
    mean_curve,
    mean_std,
    reached_at_first_evaluation,
    samples_ratio,
    samples_ratio_ci95,
)

# the metrics compared beside the headline metric, each its own Holm family: (name in the tables, record reader)
SECONDARY = (
    ("zero-shot top-1", lambda r: r["final"]["zeroshot_top1"]),
    ("novel", lambda r: (r.get("novel") or {}).get("metric")),
)


def finished(spec: Spec) -> tuple[dict, list]:
    """(dataset, batch, phase) -> objective -> {seed: record} for the test and long runs done; and every run
    still to do (the plan's pending runs, choices pending included)."""
    done: dict = {}
    todo = []
    for run in plan(spec):
        record = None if run.chosen_pending else records.load(spec.results, run.id)
        if record is None:
            todo.append(run)
        elif run.phase != "tune":
            key = (run.dataset, run.global_batch, run.phase)
            done.setdefault(key, {}).setdefault(run.objective, {})[run.seed] = record
    return done, todo


def table(spec: Spec, dataset: str, batch: int, runs: dict[str, dict[int, dict]]) -> dict:
    """One table: per objective its seeds' metric; the winner and strongest baseline named on val (None where that
    objective has no run in this table); the comparisons with the baseline."""
    metric = {name: {s: r["final"]["metric"] for s, r in by_seed.items()} for name, by_seed in runs.items()}
    beside = {  # reported beside the metric: zero-shot top-1 on the test split, the metric on `novel`
        name: {
            "zeroshot": [
                r["final"]["zeroshot_top1"] for r in by_seed.values() if r["final"]["zeroshot_top1"] is not None
            ],
            "novel": [
                r["novel"]["metric"] for r in by_seed.values() if (r.get("novel") or {}).get("metric") is not None
            ],
            "tau": [r["final"]["tau"] for r in by_seed.values() if r["final"].get("tau") is not None],
        }
        for name, by_seed in runs.items()
    }
    means = {name: mean_std(list(v.values()))[0] for name, v in metric.items()}
    named = designate(spec, dataset, batch)
    baseline = named.baseline if named.baseline in metric else None
    winner = named.winner if named.winner in metric else None
    rows = compare(metric, baseline) if baseline else []
    secondary = {}  # the same pairing on the metrics beside the headline one, where the runs have them
    for label, read in SECONDARY:
        values = {n: {s: read(r) for s, r in by_seed.items() if read(r) is not None} for n, by_seed in runs.items()}
        if baseline and values.get(baseline):
            secondary[label] = compare({n: v for n, v in values.items() if v}, baseline)
    pairs = [(c.question, c.a, c.b) for c in spec.contrasts]
    return {
        "metric": metric,
        "contrasts": contrast(metric, pairs),  # the spec's questions, a − b (each table its own Holm family)
        "beside": beside,
        "means": means,
        "val": named.val,
        "baseline": baseline,
        "winner": winner,
        "named_complete": named.complete,
        "named_among": len(named.val),  # objectives with a choice on val so far (the naming is final when all have)
        "objectives": len(spec.objectives_at(batch)),
        "comparisons": rows,
        "secondary": secondary,
        "curves": {name: _curves(by_seed) for name, by_seed in runs.items()},  # for the figures (plots.py)
    }


def _contrast_rows(tables: list[dict]) -> list[dict]:
    """The summary's contrasts: per table (dataset, batch, length), each question's a − b."""
    keys = ("question", "a", "b", "seeds", "diff_mean", "diff_ci95", "wins", "p_holm")
    return [
        {"dataset": t["dataset"], "global_batch": t["global_batch"], "epochs": t["epochs"], **{k: r[k] for k in keys}}
        for t in tables
        for r in t["contrasts"]
    ]


def _curves(runs: dict[int, dict]) -> list:
    return [r["curve"] for r in runs.values()]


def chance(data: Path) -> float | None:
    """Zero-shot chance: 1 / classes, averaged over the zeroshot.json's datasets."""
    path = data / "zeroshot.json"
    if not path.is_file():
        return None
    sets = zeroshot_sets(path)
    shares = [1 / len(d.classnames) for d in sets.values() if d.classnames]
    return sum(shares) / len(shares) if shares else None


def data_checks(spec: Spec, name: str) -> dict:
    """The data's checks: the spec's `checks`, else <data>/checks.json (written by whoever made the data)."""
    d = spec.datasets[name]
    checks = dict(d.checks)
    if not checks and (d.data / "checks.json").is_file():
        checks = records.read_json(d.data / "checks.json", "fix or delete it (the report then shows no checks)")
        if not isinstance(checks, dict):
            raise SpecError(f"{d.data / 'checks.json'}: must map check names to numbers; fix or delete it")
    shares = held_out.shares_in_train(d.data)
    return {
        "dataset": name,
        "class_blind_oracle_R1": checks.get("class_blind_oracle_R1"),
        "context_cut_share": checks.get("context_cut_share"),
        "zeroshot_chance": chance(d.data),
        **{f"{split}_images_in_train": shares.get(split) for split in held_out.SPLITS},
    }


def data_line(checks: dict) -> str:
    """A dataset's checks in words: what a reviewer asks of the task before reading a table."""

    def pct(value) -> str:
        return "not measured" if value is None else f"{100 * value:.1f} %"

    held = [f"{s} {pct(checks[f'{s}_images_in_train'])}" for s in held_out.SPLITS
            if checks[f"{s}_images_in_train"] is not None]  # fmt: skip
    return (
        f"Data `{checks['dataset']}`: a class-blind oracle's R@1 {pct(checks['class_blind_oracle_R1'])}; captions "
        f"cut by the text context {pct(checks['context_cut_share'])}; zero-shot chance "
        f"{pct(checks['zeroshot_chance'])}; images that are also train's: {', '.join(held) or 'not measured'}."
    )


def summarize(spec: Spec) -> dict:
    """The summary JSON (README.md's schema) plus, under keys starting with "_", what the markdown needs."""
    done, todo = finished(spec)
    # every finished run's commit, the tuning runs' too (with --allow-mixed-commits the test runs alone hid a mix)
    every = [r for r in (records.load(spec.results, run.id) for run in plan(spec) if not run.chosen_pending) if r]
    commits = Counter(r["commit"] for r in every)
    mixed = {f"{d}/{b}": {code: len(ids) for code, ids in sorted(codes.items())}
             for (d, b), codes in runner.table_codes(spec).items() if len(codes) > 1}  # fmt: skip
    cells, comparisons, tables = [], [], []
    for (dataset, batch, phase), runs in sorted(done.items(), key=lambda kv: (*kv[0][:2], PHASES.index(kv[0][2]))):
        t = table(spec, dataset, batch, runs)
        epochs = next(iter(next(iter(runs.values())).values()))["run"]["epochs"]
        tables.append({"dataset": dataset, "global_batch": batch, "phase": phase, "epochs": epochs, **t})
        for name, by_seed in runs.items():
            values = [r["final"]["metric"] for r in by_seed.values()]
            zs = t["beside"][name]["zeroshot"]
            cells.append(
                {
                    "dataset": dataset,
                    "global_batch": batch,
                    "loss": name,
                    "epochs": epochs,
                    "seeds": sorted(by_seed),
                    "metric": spec.datasets[dataset].metric,
                    "test_mean": mean_std(values)[0],
                    "test_std": mean_std(values)[1],
                    "best_zeroshot_top1": max(zs) if zs else None,
                }
            )
    pending = Counter((r.dataset, r.global_batch) for r in todo)  # a table's row is final when none is left
    for t in tables:
        if t["phase"] != "test" or t["baseline"] is None or t["winner"] is None:
            continue
        comparisons.append(headline(spec, t, done, complete=pending[t["dataset"], t["global_batch"]] == 0))
    return {
        "commit": ",".join(sorted(commits)) if commits else None,
        "_mixed": mixed,
        "data": [data_checks(spec, name) for name in spec.datasets],
        "cells": records.round_floats(cells),
        "comparisons": records.round_floats(comparisons),
        **({"contrasts": records.round_floats(_contrast_rows(tables))} if spec.contrasts else {}),
        "_tables": tables,
        "_todo": todo,
    }


def headline(spec: Spec, t: dict, done: dict, complete: bool = False) -> dict:
    """A table's summary row: its winner against the strongest baseline, both named on val (if the winner is that
    baseline: against the runner-up on val, so diff_mean >= 0 says by how much the winner leads on test);
    samples_ratio at the longer length where both have long runs, else at the tuned length (samples_ratio_epochs
    says which), over the seeds both have; diff_ci95 and samples_ratio_ci95: their 95 % intervals
    (stats.mean_ci95, stats.samples_ratio_ci95); complete: no run of the table is pending (else the row may change)."""
    winner, baseline = t["winner"], t["baseline"]
    rows = {r["objective"]: r for r in t["comparisons"]}
    row_of = {"dataset": t["dataset"], "global_batch": t["global_batch"], "winner": winner, "complete": complete}
    if winner == baseline:
        others = [n for n in t["means"] if n != baseline and n in t["val"]]
        if not others:
            return {**row_of, "baseline": None, "diff_mean": None, "diff_ci95": None, "p_holm": None,
                    "samples_ratio": None, "samples_ratio_never": False, "samples_ratio_at_least": False,
                    "samples_ratio_ci95": None, "samples_ratio_epochs": None}  # fmt: skip
        runner_up = max(others, key=lambda n: t["val"][n])
        row = rows[runner_up]  # runner-up − winner: turned round, so the row says by how much the winner leads
        diff = -row["diff_mean"] if row["diff_mean"] is not None else None
        ci = [-row["diff_ci95"][1], -row["diff_ci95"][0]] if row["diff_ci95"] else None
        p, pair = row["p_holm"], runner_up
    else:
        row = rows[winner]
        diff, ci, p, pair = row["diff_mean"], row["diff_ci95"], row["p_holm"], baseline
    long = done.get((t["dataset"], t["global_batch"], "long"), {})
    phase = "long" if winner in long and pair in long else "test"
    source = done[(t["dataset"], t["global_batch"], phase)]
    # over the seeds both sides have, as Δ and the interval are: with 6 seeds against 10 the point read 1.29x
    # outside its own interval [1.30, 1.42] (study v2, dcl-hard against dcl at batch 32)
    seeds = sorted(set(source[winner]) & set(source[pair]))
    winner_curves, pair_curves = ([source[n][s]["curve"] for s in seeds] for n in (winner, pair))
    ratio = samples_ratio(winner_curves, pair_curves)
    curves = mean_curve(winner_curves) and mean_curve(pair_curves)
    return {
        **row_of,
        "baseline": pair,
        "diff_mean": diff,
        "diff_ci95": ci,
        "p_holm": p,
        "samples_ratio": ratio,
        "samples_ratio_never": ratio is None and bool(curves),  # (null with curves: never; without: not measured)
        # at the target from the first evaluation: the ratio is the evaluation grid's, a lower bound
        "samples_ratio_at_least": reached_at_first_evaluation(winner_curves, pair_curves),
        "samples_ratio_ci95": samples_ratio_ci95(
            {s: r["curve"] for s, r in source[winner].items()}, {s: r["curve"] for s, r in source[pair].items()}
        ),
        "samples_ratio_epochs": next(iter(source[winner].values()))["run"]["epochs"],
    }


# ----------------------------------------------------------------------------- markdown
def _pct(x) -> str:
    if x is None:
        return "–"
    shown = f"{100 * x:.1f}"
    return "0.0" if shown == "-0.0" else shown  # a zero difference (or one that rounds to it) has no sign


def _p(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def _ci(ci: list | None) -> str:
    """A 95 % interval of a difference, in points, after its mean ("" where there is none)."""
    return f" [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else ""


def _delta(r: dict | None) -> str:
    """A comparison row's mean difference ± its std, and its 95 % interval, in points."""
    if r is None or r["diff_mean"] is None:
        return "–"
    return f"{_pct(r['diff_mean'])} ± {_pct(r['diff_std'])}{_ci(r.get('diff_ci95'))}"


def _ratio(c: dict) -> str:
    if c["samples_ratio"] is None and not c.get("samples_ratio_never"):
        return "–"  # no curves to compare
    ci = c.get("samples_ratio_ci95")
    interval = "" if not ci else f" [{'never' if ci[0] == 0 else f'{ci[0]:.2f}'}, {ci[1]:.2f}]"
    at_least = "≥ " if c.get("samples_ratio_at_least") else ""
    point = "never" if c["samples_ratio"] is None else f"{at_least}{c['samples_ratio']:.2f}x"
    return f"{point}{interval} ({c['samples_ratio_epochs']})"


def _mean_tau(taus: list, runs: int) -> str:
    """The mean final τ, saying over how many of the runs when some records lack it (made before runs kept it)."""
    if not taus:
        return "–"
    mean = f"{sum(taus) / len(taus):.3g}"
    return mean if len(taus) == runs else f"{mean} ({len(taus)} of {runs})"


def markdown(spec: Spec, summary: dict) -> str:
    lines = [f"# Study `{spec.name}` ({spec.path.name})", ""]
    for d in spec.datasets.values():
        if d.placeholder:
            lines += [f"**Placeholder data** `{d.name}`: {d.placeholder}", ""]
    for checks in summary["data"]:
        lines += [data_line(checks), ""]
    lines += [
        f"Code: commit(s) {summary['commit'] or '–'}. Metric in %: mean of the final test metric over seeds "
        "(± sample std). Δ: paired difference by seed against the table's strongest baseline (±: its std; "
        "[..]: the 95 % interval of its mean, scipy's one-sample t), wins: seeds where the objective is ahead; p: "
        "two-sided Wilcoxon signed-rank (exact up to 12 seeds, zero differences dropped, ties at their mean rank), "
        "p_Holm over the table's comparisons, perm: the paired permutation test, Holm-adjusted. The winner and the "
        "strongest baseline are named on val by the chosen settings' mean val metric (the naming reads no test run; "
        "it is provisional until every objective of the table has its choice). Beside the metric: zero-shot top-1 "
        "over the classes of the data's zeroshot.json (mean over seeds, and the best seed; on the split's samples "
        "that carry a class label), the metric on `novel` (mean), where the data has them, and the global τ at the "
        "last step (mean over seeds: where a learned τ went). Those two are compared with the baseline in the same "
        "way below each table, each metric its own Holm family.",
        "",
    ]
    if summary["_mixed"]:  # (--allow-mixed-commits)
        shown = "; ".join(
            f"table {t}: " + ", ".join(f"{code} ({n} runs)" for code, n in codes.items())
            for t, codes in summary["_mixed"].items()
        )
        lines += [f"**Mixed code** (made with --allow-mixed-commits; not a table to report): {shown}.", ""]
    for t in summary["_tables"]:
        title = f"## {t['dataset']}, global batch {t['global_batch']}, {t['epochs']} epochs"
        lines += [title + (" (longer training)" if t["phase"] == "long" else ""), ""]
        if t["baseline"]:
            figure = figure_path(spec, t).name
            lines += [f"![test curves and paired differences](<{figure}>) (plots.py)", ""]
        strongest = f"`{t['baseline']}`" if t["baseline"] else "none (no baseline has runs at this length)"
        so_far = (
            ""
            if t["named_complete"]
            else f" Provisional: named among the {t['named_among']} of {t['objectives']} objectives whose tuning is "
            "done; Holm's family grows with the table."
        )
        lines += [f"Strongest baseline (named on val): {strongest}; winner (named on val): `{t['winner']}`.{so_far}"]
        lines += [
            "",
            "| objective | setting | seeds | test | Δ vs baseline [95 %] | wins | p | p_Holm | perm (Holm) "
            "| zero-shot mean (best) | novel | τ at end |",
        ]
        lines += ["|---|---|---|---|---|---|---|---|---|---|---|---|"]
        rows = {r["objective"]: r for r in t["comparisons"]}
        for name in sorted(t["metric"], key=lambda n: -t["means"][n]):
            values = list(t["metric"][name].values())
            mean, std = mean_std(values)
            setting = chosen(spec, t["dataset"], t["global_batch"], name)
            r = rows.get(name)
            delta = ("baseline" if name == t["baseline"] else "–") if r is None else _delta(r)
            wins = "" if r is None else f"{r['wins']}/{len(r['seeds'])}"
            zs, novel = t["beside"][name]["zeroshot"], t["beside"][name]["novel"]
            zs_cell = f"{_pct(sum(zs) / len(zs))} ({_pct(max(zs))})" if zs else "–"
            novel_cell = _pct(sum(novel) / len(novel)) if novel else "–"
            tau_cell = _mean_tau(t["beside"][name]["tau"], len(values))
            lines.append(
                f"| {name} | {setting_id(setting) if setting else '–'} | {len(values)} | {_pct(mean)} ± {_pct(std)} "
                f"| {delta} | {wins} | {_p(r and r['p_wilcoxon'])} | {_p(r and r['p_holm'])} "
                f"| {_p(r and r['p_holm_permutation'])} | {zs_cell} | {novel_cell} | {tau_cell} |"
            )
        lines.append("")
        lines += secondary_lines(t)
        lines += contrast_lines(t)
    if summary["comparisons"]:
        lines += ["## Headline: the winner of each batch size against the strongest baseline", ""]
        lines += [
            "Against: the table's strongest baseline; where the winner is itself the strongest baseline, the "
            "runner-up on val (a headline objective or not). Δ: winner − against on the test seeds, so ≥ 0 where "
            "the winner leads (its sign is the table's row turned round), with its 95 % interval; p_Holm: that "
            "row's. Samples ratio: the against objective's samples over those the winner's mean test curve needs to "
            "reach the against objective's final mean, at the longer length where both have it, [..]: a 95 % "
            "interval from resampling the paired seeds ('never': in over 2.5 % of the resamples the winner does not "
            "get there).",
            "",
            "| dataset | batch | winner | against | Δ [95 %] | p_Holm | samples ratio [95 %] (at epochs) | runs |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in summary["comparisons"]:
            against = c["baseline"] or "– (no other objective tested yet)"
            delta = _pct(c["diff_mean"]) + _ci(c.get("diff_ci95"))
            lines.append(
                f"| {c['dataset']} | {c['global_batch']} | {c['winner']} | {against} | {delta} "
                f"| {_p(c['p_holm'])} | {_ratio(c)} | {'all done' if c['complete'] else 'some pending: may change'} |"
            )
        lines.append("")
    lines += pending_lines(spec, summary["_todo"])
    tuning = tuning_lines(spec)
    if tuning:
        lines += ["## Tuning (val, the final metric in %)", "", *tuning]
    return "\n".join(lines)


def contrast_lines(t: dict) -> list[str]:
    """The spec's contrasts in this table: a − b on their paired seeds (Holm over the contrasts)."""
    if not t.get("contrasts"):
        return []
    lines = [
        "Contrasts (the spec's questions: a − b on the paired test seeds, Holm over this table's contrasts):",
        "",
        "| question | a − b | Δ [95 %] | wins | p | p_Holm |",
        "|---|---|---|---|---|---|",
    ]
    for r in t["contrasts"]:
        lines.append(
            f"| {r['question']} | {r['a']} − {r['b']} | {_delta(r)} | {r['wins']}/{len(r['seeds'])} "
            f"| {_p(r['p_wilcoxon'])} | {_p(r['p_holm'])} |"
        )
    return lines + [""]


def secondary_lines(t: dict) -> list[str]:
    """The metrics beside the headline one, paired by seed against the same baseline (each its own Holm family)."""
    if not t.get("secondary"):
        return []
    labels = list(t["secondary"])
    lines = [f"Beside it, paired against `{t['baseline']}` (Holm within each metric):", ""]
    lines.append("| objective | " + " | ".join(f"{label}: Δ [95 %] | wins | p_Holm" for label in labels) + " |")
    lines.append("|---" * (1 + 3 * len(labels)) + "|")
    names = sorted({r["objective"] for rows in t["secondary"].values() for r in rows}, key=lambda n: -t["means"][n])
    for name in names:
        cells = []
        for label in labels:
            r = next((r for r in t["secondary"][label] if r["objective"] == name), None)
            cells += ["–", "", "–"] if r is None else [_delta(r), f"{r['wins']}/{len(r['seeds'])}", _p(r["p_holm"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def edges(spec: Spec, objective: str, batch: int, setting: dict) -> list[str]:
    """The knobs whose value in `setting` is the lowest or highest of the objective's grid (of 3 values or more), or
    past it (plan.tune_plan's steps): the optimum may lie further out."""
    out = []
    for key, values in spec.objectives[objective].grid_at(batch).items():
        value = setting[key]
        numbers = all(isinstance(v, (int, float)) for v in (*values, value))
        if len(values) < 3 or not numbers or min(values) < value < max(values):
            continue
        side = "lowest" if value <= min(values) else "highest"
        where = f"the grid's {side}" if value in values else f"past the grid's {side}"
        if key in KNOB_MAX and value >= KNOB_MAX[key]:
            where += f", at its bound {KNOB_MAX[key]:g}"
        out.append(f"{key.rsplit('.', 1)[-1]} {value:g} is {where}")
    return out


def refused_steps(spec: Spec, dataset: str, batch: int, objective: str, best: dict) -> str:
    """The steps past an edge of `best` that were not tuned because the trainer refuses their value."""
    grid = spec.objectives[objective].grid_at(batch)
    said = []
    for key in grid:
        past = step_past(grid, best, key)
        if past is not None and (problem := refused_step(spec, dataset, batch, objective, past)):
            said.append(f"no step past it to {key.rsplit('.', 1)[-1]} {past[key]:g} ({problem})")
    return "; " + "; ".join(said) if said else ""


def steps_past(spec: Spec, objective: str, batch: int, by_setting: dict, best: dict) -> str:
    """The settings tuned past the grid's edges that are not the choice, with their mean: the steps that lost."""
    grid = spec.objectives[objective].grid_at(batch)
    lost = []
    for setting, recs in by_setting.items():
        values = dict(setting)
        if values == best or all(values[k] in v for k, v in grid.items()):
            continue
        vals = [metric_of(rec) for rec in recs]
        mean = _pct(sum(vals) / len(vals)) if None not in vals else "not done"
        lost.append(f"`{setting_id(values)}` ({mean})")
    return f"; tuned past the grid and not chosen: {', '.join(lost)}" if lost else ""


def tuning_lines(spec: Spec) -> list[str]:
    """Per cell with tuning runs: every setting's val metric per tuning seed and mean, zero-shot beside it, the
    choice (or the leader among the settings whose seeds are all done) and whether it sits on the grid's edge."""
    lines = []
    for dataset in spec.datasets:
        for batch in spec.batches:
            for objective in spec.objectives_at(batch):
                runs, best = tune_plan(spec, dataset, batch, objective)
                loaded = {r.id: records.load(spec.results, r.id) for r in runs}
                if not any(loaded.values()):
                    continue
                by_setting: dict[tuple, list] = {}
                for r in runs:
                    by_setting.setdefault(r.setting, []).append(loaded[r.id])
                done = sum(rec is not None for rec in loaded.values())
                seeds = " | ".join(f"val s{s}" for s in spec.tune_seeds)
                lines += [f"### Tuning {cell_name(dataset, batch, objective)}: {done} of {len(runs)} runs", ""]
                header = f"| setting | {seeds} | mean | zero-shot (mean) | τ at end (mean) |"
                lines += [header, "|---" * (len(spec.tune_seeds) + 4) + "|"]
                for setting, recs in by_setting.items():
                    vals = [metric_of(rec) for rec in recs]
                    finished = [rec for rec in recs if rec]
                    zs = [z for z in (rec["final"]["zeroshot_top1"] for rec in finished) if z is not None]
                    taus = [x for x in (rec["final"].get("tau") for rec in finished) if x is not None]
                    mean = sum(vals) / len(vals) if None not in vals else None
                    lines.append(
                        f"| {setting_id(dict(setting))} | {' | '.join(_pct(v) for v in vals)} | {_pct(mean)} "
                        f"| {_pct(sum(zs) / len(zs) if zs else None)} | {_mean_tau(taus, len(finished))} |"
                    )
                what = "Chosen"  # plan's choice, edge steps included; else the best of the complete settings
                if best is None:
                    complete = [(dict(s), [metric_of(rec) for rec in recs]) for s, recs in by_setting.items()]
                    best = choose([(s, v) for s, v in complete if None not in v])
                    what = "Leading so far (settings with every seed done)"
                if best is not None:
                    edge = edges(spec, objective, batch, best)
                    note = f"; on the grid's edge: {', '.join(edge)}" if edge else ""
                    note += refused_steps(spec, dataset, batch, objective, best)
                    past = steps_past(spec, objective, batch, by_setting, best)
                    lines += ["", f"{what}: `{setting_id(best)}`{note}{past}."]
                lines.append("")
    return lines


def pending_lines(spec: Spec, todo: list) -> list[str]:
    if not todo:
        return ["All planned runs are done."]
    counts = Counter((r.dataset, r.global_batch, r.phase, r.chosen_pending) for r in todo)
    lines = [f"## Still pending: {len(todo)} run(s)", ""]
    started = [r.id for r in todo if not r.chosen_pending and any((run_dir(spec, r) / "checkpoints").glob("step_*"))]
    if started:  # running now, or stopped: `run` resumes them from their last checkpoint
        lines += [f"Started, with a checkpoint (running, or to resume): {', '.join(f'`{i}`' for i in started)}.", ""]
    order = sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1], PHASES.index(kv[0][2]), kv[0][3]))
    for (dataset, batch, phase, waiting), n in order:
        waits_for = "the choice they take a value from" if phase == "tune" else "the tuning's choice"
        why = f" (waiting for {waits_for})" if waiting else ""
        lines.append(f"- {dataset}/{batch}: {n} {phase} run(s){why}")
    return lines + [""]


def write(spec: Spec) -> tuple[str, dict]:
    """Writes the markdown and the summary JSON; returns both."""
    summary = summarize(spec)
    text = markdown(spec, summary)
    flat = {k: v for k, v in summary.items() if not k.startswith("_")}
    spec.report_md.parent.mkdir(parents=True, exist_ok=True)
    spec.report_md.write_text(text + "\n")
    spec.summary_json.parent.mkdir(parents=True, exist_ok=True)
    spec.summary_json.write_text(json.dumps(flat, indent=1) + "\n")
    write_figures(spec, summary["_tables"], summary["commit"])
    return text, flat
