"""The study package (benchmarks/study): plan counts and equal budgets, the choice rule, the statistics against
scipy and by hand, the summary's schema, refusing tables of mixed code, and v2.yaml's runs passing `fastclip train
--check`. Runs are made-up JSONs here (a real run takes about a minute on 2 busy cores: too slow for this file)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from helpers import catches, one_line_error, wait_for

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `pytest` without PYTHONPATH: benchmarks/ is a folder of the repository root

from benchmarks.study import plots, records, report, runner, stats  # noqa: E402
from benchmarks.study.__main__ import _h, main  # noqa: E402
from benchmarks.study.plan import budget, cell_name, cells, choose, designate, plan, steps_of, tune_runs  # noqa: E402
from benchmarks.study.spec import SpecError, load, resolve_setting  # noqa: E402


def write_spec(tmp_path: Path, **changes) -> Path:
    """A two-batch, three-objective spec (2 x 2 settings each) over a made-up data folder with 4 classes."""
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True, exist_ok=True)
    (data / "train" / "manifest.json").write_text(json.dumps({"num_samples": 640, "shards": []}))
    (data / "zeroshot.json").write_text(
        json.dumps({"datasets": {"d": {"classnames": list("abcd"), "templates": ["a {}."]}}})
    )
    raw = {
        "name": "t",
        "results": str(tmp_path / "results"),
        "work": str(tmp_path / "work"),
        "report_md": str(tmp_path / "results" / "t.md"),
        "summary_json": str(tmp_path / "results" / "summary.json"),
        "datasets": {
            "d": {
                "data": str(data),
                "arch": "tiny-vit",
                "epochs": 2,
                "metric": "retrieval_R1",
                "checks": {"class_blind_oracle_R1": 0.12, "context_cut_share": 0.0},
            }
        },
        "batches": [32, 64],
        "tune_seeds": [10, 11],
        "test_seeds": [1, 2, 3, 4, 5, 6],
        "other_test_seeds": [1, 2, 3],
        "long_factor": 3,
        "objectives": {
            "base": {"loss": "openclip", "baseline": True, "headline": True,
                     "grid": {"optim.lr": [1e-3, 5e-4], "loss.temperature": [0.07, 0.1]}},
            "base2": {"loss": "dcl", "baseline": True,
                      "grid": {"optim.lr": [1e-3, 5e-4], "loss.temperature": [0.07, 0.1]}},
            "new": {"loss": "fastclip-v3", "headline": True,
                    "grid": {"optim.lr": [1e-3, 5e-4], "loss.rho_frac": [0.4, 0.6]}},
        },
    }  # fmt: skip
    for key, value in changes.items():
        raw[key] = value
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(raw))
    return path


def fake(spec, run, metric: float, code: str = "c1", zeroshot: float = 0.5) -> None:
    """A finished run's JSON: final metric, a rising curve ending at it."""
    steps = steps_of(run, 640)
    total = steps * run.global_batch
    curve = [[total * k // 4, metric * k / 4] for k in range(1, 5)]
    record = {
        "id": run.id,
        "run": {"epochs": run.epochs},
        "commit": code,
        "code": code,
        "dirty": False,
        "final": {"metric": metric, "zeroshot_top1": zeroshot},
        "curve": curve,
    }
    records.save(spec.results, run.id, record)


def finish_tuning(spec, scores=None) -> None:
    """Every tuning run done; `scores(objective, setting index, seed index)` sets the val metric."""
    for d in spec.datasets:
        for b in spec.batches:
            for name in spec.objectives_at(b):
                for i, run in enumerate(tune_runs(spec, d, b, name)):
                    fake(spec, run, scores(name, i // 2, i % 2) if scores else 0.5)


def test_plan_counts_and_equal_budgets(tmp_path):
    spec = load(write_spec(tmp_path))
    runs = plan(spec)
    phases = [r.phase for r in runs]
    # tune: 2 batches x 3 objectives x 4 settings x 2 seeds; test: 2 x (6 + 3 + 6); long: headline 2 x 2 x 6
    assert (phases.count("tune"), phases.count("test"), phases.count("long")) == (48, 30, 24)
    assert budget(spec) == {"base": 8, "base2": 8, "new": 8}
    assert len({r.id for r in runs if r.phase == "tune"}) == 48
    long = [r for r in runs if r.phase == "long"]
    assert {r.epochs for r in long} == {6} and {r.objective for r in long} == {"base", "new"}
    assert all(r.chosen_pending for r in runs if r.phase != "tune")  # nothing chosen yet
    assert runs[0].id == "d/32/base/lr0.001_temperature0.07/s10/tune/e2"
    assert resolve_setting({"loss.rho_frac": 0.6, "optim.lr": 1e-3}, 64) == {"loss.rho": 2.4859, "optim.lr": 1e-3}


def test_long_seeds_are_the_first_test_seeds_run_seed_by_seed_across_the_table(tmp_path, capsys):
    """long_seeds: the longer training's seeds, fewer than test_seeds (its cost is long_factor x a test run's), run
    seed by seed across each table's objectives so a stopped phase leaves pairs. Not a prefix: one line."""
    spec = load(write_spec(tmp_path, test_seeds=[1, 2, 3, 4, 5, 6, 7, 8], long_seeds=[1, 2, 3, 4, 5, 6]))
    runs = plan(spec)
    assert sorted(r.seed for r in runs if r.phase == "test" and r.objective == "base" and r.global_batch == 32) == [
        1, 2, 3, 4, 5, 6, 7, 8]  # fmt: skip
    long = [(r.global_batch, r.seed, r.objective) for r in runs if r.phase == "long"]
    assert long == [(b, s, o) for b in (32, 64) for s in range(1, 7) for o in ("base", "new")]
    assert load(write_spec(tmp_path, test_seeds=[1, 2, 3, 4, 5, 6, 7])).long_seeds == (1, 2, 3, 4, 5, 6, 7)
    for seeds, words in [([2, 3, 4, 5, 6, 7], "must be the first 6 of test_seeds"), ([1, 2, 3], "at least 6")]:
        path = write_spec(tmp_path, test_seeds=[1, 2, 3, 4, 5, 6, 7], long_seeds=seeds)
        one_line_error(capsys, main, ["plan", str(path)], "long_seeds", words)


def test_batch_resolved_keys_mean_one_regime_at_every_batch():
    """optim.lr_tau_b32 keeps lr_tau x steps (a learned τ's reach) fixed for a fixed sample budget; loss.bias: prior
    starts SigLIP's bias at sigmoid(b) = 1/B; anything else passes as it is."""
    keys = {"optim.lr_tau_b32": 1e-3, "loss.bias": "prior", "loss.temperature": 0.07}
    for batch in (32, 128, 512):
        out = resolve_setting(keys, batch)
        assert out["optim.lr_tau"] * (150_000 // batch) == pytest.approx(1e-3 * (150_000 // 32), rel=0.01)
        assert 1 / (1 + math.exp(-out["loss.bias"])) == pytest.approx(1 / batch, rel=1e-3)
        assert out["loss.temperature"] == 0.07 and set(out) == {"optim.lr_tau", "loss.bias", "loss.temperature"}
    assert resolve_setting({"loss.bias": -10.0}, 32) == {"loss.bias": -10.0}


def test_a_grid_can_differ_per_batch_with_the_same_budget(tmp_path, tiny_embedded):
    """A key's values as {batch: values}: each batch tunes its own values (ids name them); every batch of the spec
    must be named, and the budgets must be equal at each batch. The fixed options are resolved per batch too."""
    path = write_spec(tmp_path)
    raw = json.loads(path.read_text())
    raw["objectives"]["base"]["grid"]["optim.lr"] = {"32": [1e-3, 5e-4], "64": [2e-3, 1e-3]}
    raw["objectives"]["new"]["options"] = {"optim.lr_tau_b32": 1e-3}
    path.write_text(json.dumps(raw))
    spec = load(path)
    assert {r.settings["optim.lr"] for r in tune_runs(spec, "d", 32, "base")} == {1e-3, 5e-4}
    assert {r.settings["optim.lr"] for r in tune_runs(spec, "d", 64, "base")} == {2e-3, 1e-3}
    assert tune_runs(spec, "d", 64, "base")[0].id == "d/64/base/lr0.002_temperature0.07/s10/tune/e2"
    assert budget(spec) == {"base": 8, "base2": 8, "new": 8}
    args = runner.command(spec, tune_runs(spec, "d", 64, "new")[0], tiny_embedded)
    assert args[args.index("--optim.lr_tau") + 1] == "0.002" and "--optim.lr_tau_b32" not in args
    raw["objectives"]["base"]["grid"]["optim.lr"] = {"32": [1e-3, 5e-4]}
    path.write_text(json.dumps(raw))
    with pytest.raises(SpecError, match=r"objectives.base.grid.optim.lr: has no values for batch\(es\) \[64\]"):
        load(path)
    # every objective and batch alike: 3 lr values at 64 give 6 settings there against 4 elsewhere
    for objective in raw["objectives"].values():
        objective["grid"]["optim.lr"] = {"32": [1e-3, 5e-4], "64": [2e-3, 1e-3, 5e-4]}
    path.write_text(json.dumps(raw))
    with pytest.raises(SpecError, match=r"unequal tuning budgets .*base@32: 4, base@64: 6"):
        load(path)
    raw["objectives"]["base"]["grid"]["optim.lr"] = {"small": [1e-3], "32": [1e-3]}  # mixed keys: still one line
    path.write_text(json.dumps(raw))
    with pytest.raises(SpecError, match=r"keyed by global batch, got \['32', 'small'\]"):
        load(path)
    raw["objectives"]["base"]["grid"]["optim.lr"] = [1e-3, 5e-4]
    raw["objectives"]["new"]["grid"]["optim.lr_tau"] = raw["objectives"]["new"]["grid"].pop("optim.lr")
    path.write_text(json.dumps(raw))  # new: optim.lr_tau_b32 fixed and optim.lr_tau tuned are one config key
    with pytest.raises(SpecError, match=r"objectives.new: \['optim.lr_tau'\] both fixed in options and tuned"):
        load(path)


def test_a_variant_may_run_fewer_batches_than_its_base_grids_name(tmp_path):
    """`base:` merges mappings key by key, so a variant keeps its base's per-batch values; those of batches it
    does not run are ignored."""
    path = write_spec(tmp_path)
    raw = json.loads(path.read_text())
    for objective in raw["objectives"].values():
        objective["grid"]["optim.lr"] = {"32": [1e-3, 5e-4], "64": [2e-3, 1e-3]}
    path.write_text(json.dumps(raw))
    (tmp_path / "only32.json").write_text(json.dumps({"base": path.name, "name": "only32", "batches": [32]}))
    spec = load(tmp_path / "only32.json")
    assert spec.batches == (32,) and {r.global_batch for r in plan(spec)} == {32}


def test_an_objective_may_run_at_some_of_the_spec_batches_only(tmp_path, capsys):
    """`batches:` of an objective: its cells, runs and tables are those batches' only; the other batches' tables
    are complete without it, and name their winner among the objectives that run there."""
    path = write_spec(tmp_path)
    raw = json.loads(path.read_text())
    raw["objectives"]["new"]["batches"] = [32]
    raw["objectives"]["new"]["grid"]["optim.lr"] = {"32": [1e-3, 5e-4]}  # no values for 64: it does not run there
    path.write_text(json.dumps(raw))
    spec = load(path)
    assert [cell_name(*c) for c in cells(spec)] == ["d/32/base", "d/32/new", "d/32/base2", "d/64/base", "d/64/base2"]
    assert {(r.objective, r.global_batch) for r in plan(spec)} == {
        ("base", 32), ("base2", 32), ("new", 32), ("base", 64), ("base2", 64)
    }  # fmt: skip
    val = {"base": 0.50, "base2": 0.55, "new": 0.60}
    finish_tuning(spec, lambda name, i, seed: val[name])
    at32, at64 = designate(spec, "d", 32), designate(spec, "d", 64)
    assert (at32.winner, at32.baseline, at32.complete) == ("new", "base2", True)
    assert (at64.winner, at64.baseline, at64.complete) == ("base2", "base2", True) and "new" not in at64.val
    for run in plan(spec):
        if run.phase == "test":
            fake(spec, run, val[run.objective])
    text, summary = report.write(spec)
    assert {(c["loss"], c["global_batch"]) for c in summary["cells"]} == {
        ("base", 32), ("base2", 32), ("new", 32), ("base", 64), ("base2", 64)
    }  # fmt: skip
    assert "### Tuning d/64/new" not in text and "### Tuning d/32/new" in text
    refusals = [
        ({"batches": [32, 32]}, r"objectives.new.batches: repeats a batch: \[32, 32\]"),
        ({"batches": "32"}, r"objectives.new.batches: must be a list of global batch sizes >= 2, got '32'"),
        ({"batches": [True]}, r"objectives.new.batches: must be a list of global batch sizes >= 2, got \[True\]"),
        ({"batches": [64]}, r"objectives.new.grid.optim.lr: has no values for batch\(es\) \[64\] it runs at"),
    ]
    for change, words in refusals:
        path.write_text(json.dumps({**raw, "objectives": {**raw["objectives"], "new": {**raw["objectives"]["new"],
                                                                                        **change}}}))  # fmt: skip
        with pytest.raises(SpecError, match=words):
            load(path)
    # at 64 only (not the spec's first batch): its budget is counted there
    at64 = {**raw["objectives"]["new"], "batches": [64], "grid": {"optim.lr": {"64": [1e-3, 5e-4]},
                                                                  "loss.rho_frac": [0.4, 0.6]}}  # fmt: skip
    path.write_text(json.dumps({**raw, "objectives": {**raw["objectives"], "new": at64}}))
    spec64 = load(path)
    assert budget(spec64) == {"base": 8, "base2": 8, "new": 8} and spec64.objectives_at(32) == ["base", "base2"]
    assert {r.global_batch for r in plan(spec64) if r.objective == "new"} == {64}
    # a spec built on this one (`base:`) at other batches keeps the objective; one it never runs at is left out
    path.write_text(json.dumps(raw))
    (tmp_path / "at64.json").write_text(json.dumps({"base": path.name, "name": "at64", "batches": [64]}))
    only64 = load(tmp_path / "at64.json")
    assert only64.objectives_at(64) == ["base", "base2"] and budget(only64) == {"base": 8, "base2": 8}
    assert [cell_name(*c) for c in cells(only64)] == ["d/64/base", "d/64/base2"]
    assert main(["plan", str(tmp_path / "at64.json")]) == 0
    assert "new at none of them (its batches: [32])" in capsys.readouterr().out
    one_line_error(capsys, main, ["run", str(tmp_path / "at64.json"), "--cell", "d/64/new"], "--cell d/64/new",
                   "matches no cell", "new runs at none of its batches (its batches: [32])")  # fmt: skip
    taker = {**raw["objectives"]["base2"], "from_choice": {"loss.rho_frac": "new"}}
    taker["grid"] = {"optim.lr": [1e-3, 5e-4], "loss.hard_negative_beta": [0.5, 1.0]}
    path.write_text(json.dumps({**raw, "objectives": {**raw["objectives"], "base2": taker}}))
    with pytest.raises(SpecError, match=r"base2.from_choice.loss.rho_frac: new does not run at batch\(es\) \[64\]"):
        load(path)
    only32 = {name: {**o, "batches": [32]} for name, o in raw["objectives"].items() if name != "new"}
    everywhere = {"loss": "fastclip-v3", "grid": {"optim.lr": [1e-3, 5e-4], "loss.rho_frac": [0.4, 0.6]}}
    path.write_text(json.dumps({**raw, "objectives": {**only32, "new": everywhere}}))  # new runs at 64: no baseline
    with pytest.raises(SpecError, match=r"no baseline runs at batch\(es\) \[64\]; every table needs one"):
        load(path)


def test_the_readmes_example_spec_loads_as_written(tmp_path):
    """The study README's spec, as a user would copy it: it loads, and its keys mean what the README says."""
    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "study" / "README.md").read_text()
    block = text.split("## The spec (YAML or JSON)", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "example.yaml").write_text(block)
    spec = load(tmp_path / "example.yaml")
    assert spec.batches == (32, 128, 512) and spec.objectives_at(128) == ["infonce-fixed", "dcl", "dcl-hard"]
    assert spec.objectives["dcl-hard"].from_choice == {"loss.temperature": "dcl"}
    assert budget(spec) == {"infonce-fixed": 18, "dcl": 18, "dcl-hard": 18, "fastclip-v2": 18}


def test_every_finished_v2_run_is_still_planned_under_its_id():
    """Changing v2.yaml must not orphan its finished runs: each run JSON under benchmarks/results/study_v2/runs is a
    run of the current plan (the batch-32 grids are as those runs were made)."""
    spec = load(REPO / "benchmarks" / "study" / "v2.yaml")
    finished = {
        str(p.relative_to(spec.results / "runs"))[: -len(".json")] for p in (spec.results / "runs").rglob("*.json")
    }
    assert len(finished) >= 48
    planned = {r.id for r in plan(spec) if not r.chosen_pending}
    assert finished <= planned, sorted(finished - planned)[:3]


def test_a_step_past_gamma_min_or_rho_frac_stops_at_1():
    """γ_min lives in (0, 1]: past a grid's top of 0.8 the step is 1 (no moving average), not 0.8²/0.5 = 1.28, and a
    grid already at 1 has no step up."""
    from benchmarks.study.plan import step_past

    grid = {"loss.gamma_min": [0.2, 0.5, 0.8]}
    assert step_past(grid, {"loss.gamma_min": 0.8}, "loss.gamma_min") == {"loss.gamma_min": 1.0}
    assert step_past(grid, {"loss.gamma_min": 1.0}, "loss.gamma_min") is None
    assert step_past(grid, {"loss.gamma_min": 0.2}, "loss.gamma_min") == {"loss.gamma_min": 0.08}
    # RGCL's ρ past ln(B - 1) is a constraint that never binds: 0.85 -> 1, not 1.204
    rho = {"loss.rho_frac": [0.4, 0.6, 0.85]}
    assert step_past(rho, {"loss.rho_frac": 0.85}, "loss.rho_frac") == {"loss.rho_frac": 1.0}
    assert step_past(rho, {"loss.rho_frac": 1.0}, "loss.rho_frac") is None
    assert step_past({"loss.temperature": [0.05, 0.1, 0.2]}, {"loss.temperature": 0.2}, "loss.temperature") == {
        "loss.temperature": 0.4
    }


def test_the_report_names_a_bound_and_skips_words_in_a_grid(tmp_path):
    path = write_spec(tmp_path, batches=[32])
    raw = json.loads(path.read_text())
    raw["objectives"]["base"]["grid"] = {"loss.gamma_min": [0.2, 0.5, 0.8], "loss.bias": [-1.0, -2.0, "prior"]}
    for name in ("base2", "new"):
        raw["objectives"][name]["grid"] = {"optim.lr": [1e-3, 5e-4, 2.5e-4], "loss.temperature": [0.07, 0.1, 0.2]}
    path.write_text(json.dumps(raw))
    spec = load(path)
    assert report.edges(spec, "base", 32, {"loss.gamma_min": 1.0, "loss.bias": "prior"}) == [
        "gamma_min 1 is past the grid's highest, at its bound 1"
    ]
    assert report.edges(spec, "base", 32, {"loss.gamma_min": 0.5, "loss.bias": -2.0}) == []


@pytest.mark.parametrize(
    "change, words",
    [
        ({"tune_seeds": [0]}, ("tune_seeds", "at least 2")),
        ({"test_seeds": [1, 2, 3, 4, 5]}, ("test_seeds", "at least 6")),
        ({"long_factor": 2}, ("long_factor", ">= 3")),
        ({"curve_points": 40}, ("curve_points",)),
        ({"curve_points": 8, "tune_curve_points": 9}, ("tune_curve_points", "1..curve_points (8)")),
        ({"tune_seeds": [1, 100]}, ("tune_seeds", "[1] also test seeds")),
    ],
)
def test_spec_refuses_what_the_protocol_forbids(tmp_path, change, words):
    with pytest.raises(SpecError) as error:
        load(write_spec(tmp_path, **change))
    assert all(w in str(error.value) for w in words), error.value


def _objective_change(path: Path, name: str, **changes) -> None:
    raw = json.loads(path.read_text())
    raw["objectives"][name] = {**raw["objectives"][name], **changes}
    path.write_text(json.dumps(raw))


def test_an_operators_mistakes_in_a_spec_are_one_line_before_any_run(tmp_path, capsys):
    """What `fastclip train` would refuse (a misspelt key, a value, an architecture) stops `plan` and `run` before
    any run starts, and so do a spec's own wrong types, repeats, keys the study sets itself, and test seeds that
    cannot pair: one line naming the key, exit 2, never a traceback (adversarial review, 2026-11-29)."""

    path = write_spec(tmp_path)
    _objective_change(path, "base2", options={"loss.learn_temprature": False})
    one_line_error(capsys, main, ["plan", str(path)], "objectives.base2 at batch 32", "loss.learn_temprature")
    one_line_error(capsys, main, ["run", str(path), "--max-runs", "1"], "objectives.base2", "loss.learn_temprature")
    path = write_spec(tmp_path, train={"optim.wdd": 0.1})
    one_line_error(capsys, main, ["plan", str(path)], "optim.wdd")
    path = write_spec(tmp_path)
    _objective_change(path, "base2", grid={"optim.lrr": [1e-3, 5e-4], "loss.temperature": [0.07, 0.1]})
    one_line_error(capsys, main, ["plan", str(path)], "optim.lrr")
    path = write_spec(tmp_path)
    _objective_change(path, "base2", grid={"optim.lr": ["fast", 5e-4], "loss.temperature": [0.07, 0.1]})
    one_line_error(capsys, main, ["plan", str(path)], "optim.lr")
    path = write_spec(tmp_path, device="gpu")
    one_line_error(capsys, main, ["plan", str(path)], "train.device")
    raw = json.loads(write_spec(tmp_path).read_text())
    raw["datasets"]["d"]["arch"] = "tiny-vit-46"
    path.write_text(json.dumps(raw))
    one_line_error(capsys, main, ["plan", str(path)], "model.arch", "did you mean 'tiny-vit-64'")
    # the spec's own values
    grid = {"optim.lr": [1e-3, 5e-4], "loss.temperature": [0.07, 0.1]}
    for change, words in [
        ({"grid": {**grid, "optim.lr": ["1e-3", 5e-4]}}, ("grid.optim.lr", "'1e-3' is text, not a number", "0.001")),
        ({"grid": {**grid, "optim.lr": [5e-4, 5e-4]}}, ("grid.optim.lr", "repeats 0.0005")),
        ({"grid": {**grid, "optim.lr": [[1e-3], 5e-4]}}, ("config key 'optim.lr'", "expected a number")),
        ({"grid": {**grid, "optim.lr": [{"a": 1}, 5e-4]}}, ("grid.optim.lr", "scalars or lists of numbers")),
        ({"options": {"data.batch_size": 7}}, ("options.data.batch_size", "the study sets data.batch_size itself")),
        ({"options": {"model.arch": "ViT-B-32"}}, ("options.model.arch", "from datasets.<name>.arch")),
        ({"grid": {**grid, "train.seed": [1, 2]}}, ("grid.train.seed",)),
        ({"options": ["optim.wd"]}, ("options", "must map dotted config keys")),
    ]:
        path = write_spec(tmp_path)
        _objective_change(path, "base2", **change)
        one_line_error(capsys, main, ["plan", str(path)], *words)
    for change, words in [
        ({"batches": [32, 32]}, ("batches", "repeats a batch")),
        ({"other_test_seeds": [50, 51]}, ("other_test_seeds", "[50, 51] are not test seeds")),
        ({"tune_seeds": [-1, -2]}, ("tune_seeds", ">= 0")),
        ({"train": {"train.epochs": 9}}, ("train.train.epochs", "the study sets train.epochs itself")),
        ({"train": ["optim.wd"]}, ("train", "must map dotted config keys")),
        ({"warmup_frac": "x"}, ("warmup_frac", "[0, 1)")),
        ({"warmup_frac": 2}, ("warmup_frac", "[0, 1)")),
        ({"results": 5}, ("results", "must be a path")),
        ({"work": ""}, ("work", "must be a path")),
        ({"name": [1]}, ("name", "must be a word")),
        ({"datasets": ["d"]}, ("datasets", "must be a mapping of names")),
        ({"objectives": ["base"]}, ("objectives", "must be a mapping of names")),
    ]:
        one_line_error(capsys, main, ["plan", str(write_spec(tmp_path, **change))], *words)
    raw = json.loads(write_spec(tmp_path).read_text())
    for change, words in [({"data": 5}, ("datasets.d.data", "must be a folder")),
                          ({"checks": "x"}, ("datasets.d.checks", "must map")),
                          ({"checks": {"oracle": 0.1}}, ("datasets.d.checks.oracle", "unknown")),
                          ({"epochs": True}, ("datasets.d.epochs", "integer >= 1")),
                          ({"metrc": "x"}, ("datasets.d", "unknown key(s) ['metrc']; known:"))]:  # fmt: skip
        path.write_text(json.dumps({**raw, "datasets": {"d": {**raw["datasets"]["d"], **change}}}))
        one_line_error(capsys, main, ["plan", str(path)], *words)
    path.write_text(json.dumps({**raw, "objectives": {**raw["objectives"], "dcl/hard": raw["objectives"]["base2"]}}))
    one_line_error(capsys, main, ["plan", str(path)], "objectives.dcl/hard", "a word without '/'")
    # files: a directory, a base that is no spec
    one_line_error(capsys, main, ["plan", str(tmp_path)], "is a directory")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "child.yaml").write_text("base: list.yaml\nname: c\n")
    one_line_error(capsys, main, ["plan", str(tmp_path / "child.yaml")], "list.yaml (the base of", "must be a mapping")


def test_a_step_past_an_integer_knob_stays_an_integer():
    """A queue's size past its grid's top is 2048, not 2048.0 (the trainer refuses a float there) nor 32770."""
    from benchmarks.study.plan import step_past

    queue = {"loss.queue_size": [256, 512, 1024]}
    past = step_past(queue, {"loss.queue_size": 1024}, "loss.queue_size")
    assert past == {"loss.queue_size": 2048} and isinstance(past["loss.queue_size"], int)
    assert step_past(queue, {"loss.queue_size": 256}, "loss.queue_size") == {"loss.queue_size": 128}
    big = step_past({"loss.queue_size": [8192, 16384, 32768]}, {"loss.queue_size": 32768}, "loss.queue_size")
    assert big == {"loss.queue_size": 65536}
    assert step_past({"optim.lr": [1.25e-4, 2.5e-4, 5e-4]}, {"optim.lr": 5e-4}, "optim.lr") == {"optim.lr": 0.001}


def test_a_corrupt_run_record_is_one_line_naming_it_and_never_a_result(tmp_path, capsys):
    """A truncated or hand-edited run JSON under results/runs: plan, report and run name the file and say to delete
    it; a record without a numeric metric never counts as done."""
    spec = load(write_spec(tmp_path))
    run = tune_runs(spec, "d", 32, "base")[0]
    fake(spec, run, 0.5)
    path = records.run_path(spec.results, run.id)
    good = path.read_text()
    for text, why in [(good[: len(good) // 2], "unreadable"), ("[1, 2]", "no `final` mapping"),
                      (json.dumps({**json.loads(good), "final": {"metric": None}}), "final.metric is None"),
                      (json.dumps({**json.loads(good), "final": {"metric": "0.5"}}), "final.metric is '0.5'"),
                      (json.dumps({k: v for k, v in json.loads(good).items() if k != "code"}),
                       "no `code`")]:  # fmt: skip
        path.write_text(text)
        for command in (["plan"], ["report"], ["run", "--max-runs", "0"]):
            err = one_line_error(capsys, main, [command[0], str(spec.path), *command[1:]], str(path), why)
            assert f"delete it to run {run.id} again" in err
    path.write_text(good)
    assert records.load(spec.results, run.id)["final"]["metric"] == 0.5


def test_run_folders_files_are_written_whole_and_an_unreadable_one_restarts_or_is_said(tmp_path, capsys):
    """code.json and wall_s.txt: an unreadable code.json means the run starts over (what it started with is
    unknown), an unreadable wall_s.txt is said and counted from this attempt; neither stops the runner."""
    spec = load(write_spec(tmp_path))
    run = tune_runs(spec, "d", 32, "base")[0]
    folder = runner.run_dir(spec, run)
    (folder / "checkpoints" / "step_00000001").mkdir(parents=True)
    (folder / "code.json").write_text("")
    assert runner.resumable(folder, "c1", {}) is False
    (folder / "code.json").write_text(json.dumps({"code": "c1", "args": {}}))
    assert runner.resumable(folder, "c1", {}) is True
    (folder / "wall_s.txt").write_text("")
    active = runner.Active(run, None, folder, tmp_path, before=runner.wall_before(run, folder), start=0.0)
    total = runner.add_wall(active)
    assert total > 0 and float((folder / "wall_s.txt").read_text()) == pytest.approx(total, abs=0.1)
    assert "wall_s.txt unreadable" in capsys.readouterr().out
    assert not list(folder.glob("*.tmp"))
    # written while it runs (a killed runner kept only the attempts that ended: about half a resumed run's wall
    # time), each write the whole attempt so far, not added again: the next attempt starts from the last one
    import time

    (folder / "wall_s.txt").write_text("100.0")
    active = runner.Active(run, None, folder, tmp_path, before=runner.wall_before(run, folder))
    active.start -= 30.0  # 30 s into this attempt
    assert runner.add_wall(active) == pytest.approx(130.0, abs=0.5)
    assert runner.add_wall(active) == pytest.approx(130.0, abs=0.5)  # (not 160)
    assert runner.wall_before(run, folder) == pytest.approx(130.0, abs=0.5)  # after a kill, the next attempt's
    assert time.perf_counter() - active.written < 5
    # checkpoints from other code: the run starts over, and the attempts given up still count (they were dropped)
    (folder / "code.json").write_text(json.dumps({"code": "older", "args": {}}))
    assert runner.prepare_folder(run, folder, {}) is False
    assert "it starts over" in capsys.readouterr().out
    assert not (folder / "checkpoints").exists() and runner.wall_before(run, folder) == pytest.approx(130.0, abs=0.5)
    assert json.loads((folder / "code.json").read_text())["code"] == records.code_version()["code"]
    (folder / "checkpoints" / "step_00000001").mkdir(parents=True)
    assert runner.prepare_folder(run, folder, {}) is True  # the next attempt resumes what this one checkpointed


def test_report_refuses_a_folder_it_cannot_write_in_one_line(tmp_path, capsys):
    """(a traceback, exit 1, before: FileNotFoundError or NotADirectoryError from the report's mkdir)"""
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = afile / "r"
    path = write_spec(tmp_path, results=str(r), report_md=str(r / "t.md"), summary_json=str(r / "s.json"))
    one_line_error(capsys, main, ["report", str(path)], f"results {r}: cannot write there")
    path = write_spec(tmp_path, summary_json=str(afile / "summary.json"))
    one_line_error(capsys, main, ["report", str(path)], f"summary_json {afile}: cannot write there")


def test_run_refuses_what_would_waste_every_run(tmp_path, capsys, tiny_embedded):
    """Before the first run: a results or work path that is a file, a batch larger than the training split, a make
    command that cannot start, a half-made data folder, a corrupt zeroshot.json or manifest, a second `run` of the
    same study; and a run with nothing to start says why."""
    import shutil

    data = tmp_path / "copy"  # the tiny shards, with their val split as test too
    shutil.copytree(tiny_embedded, data)
    shutil.copytree(data / "val", data / "test")
    afile = tmp_path / "afile"
    afile.write_text("x")

    def spec_file(datasets=None, **top) -> Path:
        path = write_spec(tmp_path, **top)
        raw = json.loads(path.read_text())
        raw["datasets"]["d"] = {**raw["datasets"]["d"], "data": str(data), **(datasets or {})}
        path.write_text(json.dumps(raw))
        return path

    def refused(path, *words):
        return one_line_error(capsys, main, ["run", str(path), "--max-runs", "1"], *words)

    for key in ("results", "work"):
        refused(spec_file(**{key: str(afile)}), key, "cannot write there")
    size = runner.train_samples(data)
    refused(spec_file(batches=[32, 4096]), f"batches [4096]: larger than datasets.d's {size} training samples")
    made = tmp_path / "made"
    refused(spec_file({"data": str(made), "make": ["no-such-maker-x"]}), "datasets.d.make", "'no-such-maker-x'")
    (made / "train").mkdir(parents=True)
    (made / "train" / "manifest.json").write_text((data / "train" / "manifest.json").read_text())
    refused(spec_file({"data": str(made), "make": ["no-such-maker-x"]}), "no val/manifest.json", "half-made")
    path = spec_file()
    (data / "zeroshot.json").write_text("{")
    refused(path, "zeroshot.json: invalid JSON", "write it again")
    (data / "zeroshot.json").write_text((tiny_embedded / "zeroshot.json").read_text())
    (data / "val" / "manifest.json").write_text("{")
    refused(path, "datasets.d", "val")
    (data / "val" / "manifest.json").write_text((tiny_embedded / "val" / "manifest.json").read_text())
    # zeroshot.json: needed for a zero-shot metric only (a user's own images have none: it was refused for any)
    (data / "zeroshot.json").rename(tmp_path / "zeroshot.json")
    assert runner.ensure_data(load(path), "d") == data
    assert "--data.zeroshot null" in " ".join(map(str, runner.command(load(path), plan(load(path))[0], data)))
    refused(spec_file({"metric": "zeroshot_top1"}), "no zeroshot.json", "(metric zeroshot_top1)")
    (tmp_path / "zeroshot.json").rename(data / "zeroshot.json")
    path = spec_file()
    with runner.hold_lock(load(path)):
        refused(path, "another `run` of this study is active")
    assert main(["run", str(path), "--phase", "long"]) == 0  # long runs wait for the choices
    assert "no run to start: " in capsys.readouterr().out


def test_held_out_shares_and_a_split_that_is_mostly_train_is_refused(tmp_path, capsys, tiny_embedded, monkeypatch):
    """A val/test/novel image byte-identical to one of train's counts against its split: none of the embedded
    val's, every one of a copy of train/, half of a split made of val's shard and a train shard. `run` refused
    none of them before (a copy or a link of train/ passed every check, and its table measured memory)."""
    import shutil

    from benchmarks.study import held_out

    data = tmp_path / "d"
    shutil.copytree(tiny_embedded, data)
    shutil.copytree(data / "train", data / "test")
    (data / "novel").mkdir()
    shutil.copy(data / "val" / "val-000000.tar", data / "novel")
    shutil.copy(data / "train" / "train-000002.tar", data / "novel")
    manifest = json.loads((data / "val" / "manifest.json").read_text())
    last = json.loads((data / "train" / "manifest.json").read_text())["shards"][-1]
    assert last["path"] == "train-000002.tar" and last["num_samples"] == 20
    manifest["shards"].append(last)
    manifest["num_samples"] += 20
    (data / "novel" / "manifest.json").write_text(json.dumps(manifest))
    assert held_out.shares_in_train(data) == {"val": 0.0, "test": 1.0, "novel": 0.5}
    assert held_out.shares_in_train(data, up_to=1000) == {"val": None, "test": None, "novel": None}

    path = write_spec(tmp_path)
    raw = json.loads(path.read_text())
    raw["datasets"]["d"]["data"] = str(data)
    path.write_text(json.dumps(raw))
    argv = ["run", str(path), "--max-runs", "1"]
    one_line_error(capsys, main, argv, "datasets.d.data", "100.0 % of test/'s images are train/'s", "a copy or a link")
    shutil.rmtree(data / "test")
    shutil.copytree(data / "val", data / "test")
    one_line_error(capsys, main, argv, "50.0 % of novel/'s images are train/'s")
    checks = report.data_checks(load(path), "d")
    assert (checks["val_images_in_train"], checks["test_images_in_train"], checks["novel_images_in_train"]) == (
        0.0, 0.0, 0.5)  # fmt: skip
    assert report.data_line(checks).endswith("images that are also train's: val 0.0 %, test 0.0 %, novel 50.0 %.")
    # a link to a training shard is refused at any size (the shares are read up to 2 GiB of shards)
    (data / "novel" / "train-000002.tar").unlink()
    (data / "novel" / "train-000002.tar").symlink_to(data / "train" / "train-000002.tar")
    monkeypatch.setattr(records, "HASH_DATA_UP_TO", 1000)
    one_line_error(capsys, main, argv, "novel/'s shard", "train-000002.tar is a training shard's file")
    (data / "novel" / "train-000002.tar").unlink()
    shutil.copy(data / "val" / "val-000000.tar", data / "novel" / "train-000002.tar")  # (other bytes, same name)
    held_out.check(data, "d")
    assert "whether val, test, novel hold train's images is not measured" in capsys.readouterr().out


def test_spec_refuses_text_flags_a_tuned_key_in_train_and_cuda_without_a_device(tmp_path, capsys):
    """`headline: "false"` was true (bool of a text); a key tuned in a grid and set in train was the grid's,
    silently; device cuda on a machine without one failed each run after plan passed."""
    path = write_spec(tmp_path)
    raw = json.loads(path.read_text())
    raw["objectives"]["new"]["headline"] = "false"
    path.write_text(json.dumps(raw))
    one_line_error(capsys, main, ["plan", str(path)], "objectives.new.headline", "must be true or false", "'false'")
    raw["objectives"]["new"]["headline"] = False
    raw["train"] = {"optim.lr": 1e-3}
    path.write_text(json.dumps(raw))
    one_line_error(capsys, main, ["plan", str(path)], "train", "['optim.lr'] also tuned in objectives.base.grid")
    raw["train"] = {"optim.wd": 0.1}
    raw["device"] = "cuda"
    path.write_text(json.dumps(raw))
    assert main(["plan", str(path)]) == 0  # a GPU study may be planned and priced anywhere
    capsys.readouterr()
    import torch

    if not torch.cuda.is_available():
        one_line_error(capsys, main, ["run", str(path), "--max-runs", "0"], "device cuda", "no usable CUDA device")


def test_spec_refuses_unequal_budgets_and_unknown_losses(tmp_path, capsys):
    path = write_spec(tmp_path)
    raw = json.loads(path.read_text())
    raw["objectives"]["new"]["grid"]["loss.rho_frac"] = [0.4, 0.6, 0.85]
    path.write_text(json.dumps(raw))
    one_line_error(capsys, main, ["plan", str(path)], "unequal tuning budgets", "new@32: 6")
    raw["objectives"]["new"]["grid"]["loss.rho_frac"] = [0.4, 0.6]
    raw["objectives"]["new"]["loss"] = "infonce"
    path.write_text(json.dumps(raw))
    one_line_error(capsys, main, ["plan", str(path)], "objectives.new.loss", "unknown loss 'infonce'")


def test_choice_rule_is_the_best_mean_of_the_tuning_seeds(tmp_path):
    a, b, c = {"lr": 1}, {"lr": 2}, {"lr": 3}
    # b has the best single seed (0.9), a the best mean (0.6 against 0.55)
    assert choose([(a, [0.5, 0.7]), (b, [0.9, 0.2]), (c, [0.1, 0.1])]) == a
    assert choose([(a, [0.6, 0.6]), (b, [0.7, 0.5])]) == a  # a tie: the first in grid order
    assert choose([(a, [0.5, 0.7]), (b, [0.9, None])]) is None  # a tuning run missing: no choice yet
    spec = load(write_spec(tmp_path))
    # setting 2 (lr 5e-4, τ 0.07) wins on its mean; setting 0 has the single best seed
    finish_tuning(spec, lambda name, i, s: {0: (0.9, 0.1), 1: (0.4, 0.4), 2: (0.6, 0.6), 3: (0.2, 0.3)}[i][s])
    tests = [r for r in plan(spec) if r.phase != "tune"]
    assert tests and not any(r.chosen_pending for r in tests)
    assert all(r.settings in ({"optim.lr": 5e-4, "loss.temperature": 0.07}, {"optim.lr": 5e-4, "loss.rho_frac": 0.4})
               for r in tests)  # fmt: skip


def with_hard(tmp_path, **from_choice) -> Path:
    """write_spec's spec plus `hard`: dcl with hard negatives, its τ from `from_choice` (default: base2's choice)."""
    path = write_spec(tmp_path)
    raw = json.loads(path.read_text())
    raw["objectives"]["hard"] = {
        "loss": "dcl",
        "baseline": True,
        "from_choice": from_choice or {"loss.temperature": "base2"},
        "grid": {"optim.lr": [1e-3, 5e-4], "loss.hard_negative_beta": [0.5, 1.0]},
    }
    path.write_text(json.dumps(raw))
    return path


def test_an_objective_tunes_on_top_of_anothers_choice_in_each_table(tmp_path, tiny_embedded):
    """`from_choice`: hard negatives tuned at dcl's chosen τ of the same table; its runs wait for that choice."""
    spec = load(with_hard(tmp_path))
    for run in tune_runs(spec, "d", 32, "base"):
        fake(spec, run, 0.5)
    waiting = tune_runs(spec, "d", 32, "hard")
    assert len(waiting) == 8 and all(r.chosen_pending for r in waiting)
    assert len({r.id for r in waiting}) == 8 and all("temperature<base2>/" in r.id for r in waiting)
    assert not [r for r in runner.pending(spec, "d/32/hard", set(), {})]  # nothing to run before base2's choice
    text, _ = report.write(spec)
    assert "- d/32: 8 tune run(s) (waiting for the choice they take a value from)" in text
    # base2 chooses τ 0.1 at batch 32 (settings 1 and 3) and τ 0.07 at batch 64 (settings 0 and 2)
    for batch, best in ((32, {1, 3}), (64, {0, 2})):
        for i, run in enumerate(tune_runs(spec, "d", batch, "base2")):
            fake(spec, run, 0.6 if i // 2 in best else 0.4)
    for batch, tau in ((32, 0.1), (64, 0.07)):
        runs = tune_runs(spec, "d", batch, "hard")
        assert len(runs) == 8 and {r.settings["loss.temperature"] for r in runs} == {tau}
        assert {(r.settings["optim.lr"], r.settings["loss.hard_negative_beta"]) for r in runs} == {
            (1e-3, 0.5), (1e-3, 1.0), (5e-4, 0.5), (5e-4, 1.0)}  # fmt: skip
        args = runner.command(spec, runs[0], tiny_embedded)
        assert args[args.index("--loss.temperature") + 1] == str(tau)
    assert len(runner.pending(spec, "d/32/hard", set(), {})) == 8


def test_run_takes_several_cells_and_patterns(tmp_path, capsys, monkeypatch):
    """`run --cell` repeats and takes shell-style patterns; one runner then takes every named cell's runs in the
    plan's order (all their tuning before any test run), and the commit check covers their tables only."""
    path = str(write_spec(tmp_path))
    spec = load(path)
    given = []
    monkeypatch.setattr(runner, "run_pending", lambda spec, **kw: given.append(kw["cell"]) or 0)
    assert main(["run", path, "--cell", "d/32/*", "--cell", "d/64/new", "--cell", "d/32/base"]) == 0
    assert given == [["d/32/base", "d/32/new", "d/32/base2", "d/64/new"]]  # headline objectives first, no repeat
    one_line_error(capsys, main, ["run", path, "--cell", "d/128/*"], "--cell d/128/*", "matches no cell")
    both = runner.pending(spec, ["d/32/base", "d/64/new"], set(), {})
    assert [r.phase for r in both] == ["tune"] * 16 and {r.cell for r in both} == {"d/32/base", "d/64/new"}
    for run in tune_runs(spec, "d", 64, "new"):
        fake(spec, run, 0.5, code="c0")  # table d/64 from other code
    runner.check_commits(spec, "c1", ["d/32/base", "d/32/new"])  # table d/32 only: passes
    with pytest.raises(runner.MixedCommits, match="table d/64"):
        runner.check_commits(spec, "c1", ["d/32/base", "d/64/base2"])


def test_core_hours_price_each_run_by_its_phases_finished_runs(tmp_path, tiny_embedded, capsys):
    """plan --hours: a run costs its steps x the median wall seconds per step of the finished runs of its batch and
    phase (a long run: the test runs'; a phase with none: every phase of its batch), else the timing run's. Hours
    print to 0.1, under 1 to two significant digits (a small study's 0.034 printed 0.0)."""
    from benchmarks.study import hours

    assert [_h(h) for h in (0.0341, 0.38, 0.999, 12.34, 0, 4e-5)] == ["0.034", "0.38", "1.0", "12.3", "0.0", "<0.001"]

    data = tmp_path / "emb"  # the tiny glyphs, val standing in for test
    data.mkdir()
    for name, target in (("train", "train"), ("val", "val"), ("test", "val"), ("zeroshot.json", "zeroshot.json")):
        (data / name).symlink_to(tiny_embedded / target)
    spec = load(write_spec(tmp_path))
    spec = dataclasses.replace(spec, datasets={"d": dataclasses.replace(spec.datasets["d"], data=data)})
    finish_tuning(
        spec
    )  # 80 training samples: a run of 2 epochs is 6 steps at batch 32 (the last batch filled), 4 at 64
    for i, run in enumerate(r for r in plan(spec) if r.phase == "tune"):
        # batch 32: 6, 12 or 18 s over its 6 steps (1, 2 or 3 s per step, 8 runs each); batch 64: 4 s over 4 steps
        wall = 6.0 * (1 + i % 3) if run.global_batch == 32 else 4.0
        records.save(spec.results, run.id, {**records.load(spec.results, run.id), "wall_s": wall})
    test = next(r for r in plan(spec) if r.phase == "test" and r.global_batch == 32 and r.objective == "base")
    fake(spec, test, 0.5)
    records.save(spec.results, test.id, {**records.load(spec.results, test.id), "wall_s": 30.0})  # 5 s per step
    measured = hours.from_runs(spec)
    tune32 = 2.0
    assert measured["d/32/tune"] == (pytest.approx(tune32), 24) and measured["d/32/test"] == (5.0, 1)
    assert measured["d/64/tune"] == (1.0, 24) and measured["d/64"] == (1.0, 24) and "d/64/test" not in measured
    seconds = {
        ("tune", 32): tune32,
        ("test", 32): 5.0,
        ("long", 32): 5.0,  # long: as its batch's test runs
        ("tune", 64): 1.0,
        ("test", 64): 1.0,
        ("long", 64): 1.0,
    }  # no test run at 64: every phase of 64's
    runs = plan(spec)
    to_run = [r for r in runs if r.chosen_pending or records.load(spec.results, r.id) is None]
    at_median = {r: {32: 3, 64: 2}[r.global_batch] * r.epochs * seconds[r.phase, r.global_batch] / 3600 for r in runs}
    done = (8 * (6 + 12 + 18) + 24 * 4.0 + 30.0) / 3600  # a finished run costs its own wall time: tuning, 1 test run
    expected = done + sum(at_median[r] for r in to_run)
    h = hours.core_hours(spec, {}, measured)
    assert h["total"] == pytest.approx(expected) and h["timed"] == []
    assert h["done"] == pytest.approx(done)
    pending = {}
    for r in runs:
        if r.chosen_pending or records.load(spec.results, r.id) is None:
            key = f"d/{r.global_batch}/{r.phase}"
            pending[key] = (
                pending.get(key, 0.0)
                + {32: 3, 64: 2}[r.global_batch] * r.epochs * seconds[r.phase, r.global_batch] / 3600
            )
    assert h["pending_by"] == pytest.approx(pending) and "d/32/tune" not in pending  # the tuning is done
    assert sum(h["pending_by"].values()) == pytest.approx(h["pending"])
    only32 = {k: v for k, v in measured.items() if k.startswith("d/32")}
    h = hours.core_hours(spec, {"d/64": 0.25}, only32)  # batch 64 from the timing run
    assert h["timed"] == ["d/64"]
    assert h["total"] == pytest.approx(expected - sum(2 * r.epochs * 0.75 for r in to_run
                                                      if r.global_batch == 64) / 3600)  # fmt: skip
    with pytest.raises(KeyError, match="d/64"):
        hours.core_hours(spec, {}, only32)
    # a spec not yet run, priced from this one's runs: its dataset of the same architecture takes their seconds
    other = tmp_path / "other"
    other.mkdir()
    raw = json.loads(write_spec(other).read_text())
    raw["datasets"] = {"e": {**raw["datasets"]["d"], "data": str(data)}}
    raw["datasets"]["f"] = {**raw["datasets"]["e"], "arch": "tiny-vit-64"}  # another architecture: nothing lent
    (other / "spec.json").write_text(json.dumps(raw))
    lent, sources = hours.borrowed(load(other / "spec.json"), spec)
    assert lent == {f"e/{k[2:]}": v for k, v in measured.items()} and sources == {"e": "d"}
    priced = json.loads(spec.path.read_text())  # this spec as a file, over the tiny glyphs
    priced["datasets"]["d"]["data"] = str(data)
    (tmp_path / "priced.json").write_text(json.dumps(priced))
    del raw["datasets"]["f"]
    (other / "spec.json").write_text(json.dumps(raw))
    assert main(["plan", str(other / "spec.json"), "--price-from", str(tmp_path / "priced.json")]) == 0
    out = capsys.readouterr().out
    nothing_done = sum({32: 3, 64: 2}[r.global_batch] * r.epochs * seconds[r.phase, r.global_batch] / 3600
                       for r in plan(load(other / "spec.json")))  # fmt: skip
    assert f"core-hours: {_h(nothing_done)} in total" in out and "priced from" in out and "e/32/tune" in out
    (other / "spec.json").write_text(
        json.dumps({**raw, "datasets": {"f": raw["datasets"]["e"] | {"arch": "tiny-vit-64"}}})
    )
    args = ["plan", str(other / "spec.json"), "--price-from", str(tmp_path / "priced.json")]
    one_line_error(capsys, main, args, "'f/32' has no finished run")
    one_line_error(capsys, main, [*args, "--measure"], "--measure and --price-from", "give one")
    one_line_error(capsys, main, [*args[:3], str(tmp_path / "none.yaml")], "--price-from", "none.yaml: no such spec")


def test_a_borrowed_price_comes_from_one_source_dataset_and_only_for_batches_without_runs(tmp_path, monkeypatch):
    """plan --price-from: each dataset takes one source (its namesake, else the same architecture's with the most
    finished runs), never a mix, and a batch with finished runs of its own borrows nothing."""
    from benchmarks.study import hours

    theirs = {"a/32": (1.0, 2), "a/32/tune": (1.0, 2), "b/32": (9.0, 40), "b/32/test": (9.0, 40), "b/64": (5.0, 4)}
    monkeypatch.setattr(hours, "from_runs", lambda spec: theirs)  # the other study's finished runs, as measured
    raw = json.loads(write_spec(tmp_path).read_text())
    d = raw["datasets"]["d"]
    raw["datasets"] = {"a": d, "b": d, "c": {**d, "arch": "another"}}
    (tmp_path / "other.json").write_text(json.dumps(raw))
    other = load(tmp_path / "other.json")
    raw["datasets"] = {"new": d, "a": d, "c": {**d, "arch": "another"}}
    (tmp_path / "mine.json").write_text(json.dumps(raw))
    mine = load(tmp_path / "mine.json")
    prices, sources = hours.borrowed(mine, other)
    assert sources == {"new": "b", "a": "a"}  # c: its architecture has no finished runs
    assert prices == {"new/32": (9.0, 40), "new/32/test": (9.0, 40), "new/64": (5.0, 4), "a/32": (1.0, 2),
                      "a/32/tune": (1.0, 2)}  # fmt: skip
    prices, _ = hours.borrowed(mine, other, own={"new/32/tune": (2.0, 3)})
    assert sorted(prices) == ["a/32", "a/32/tune", "new/64"]
    raw["datasets"] = {"x/y": d}
    (tmp_path / "slash.json").write_text(json.dumps(raw))
    with pytest.raises(SpecError, match=r"datasets.x/y: a dataset's name is a word without '/'"):
        load(tmp_path / "slash.json")


def test_backfill_tau_takes_each_old_records_final_tau_from_its_run_folder(tmp_path, capsys):
    """`report --backfill-tau`: a record made before runs kept final.tau gets the last logged τ of its run folder's
    metrics.jsonl; one whose folder is gone is counted, not guessed; the tables say over how many runs a mean τ is."""
    spec = load(write_spec(tmp_path, batches=[32]))
    finish_tuning(spec)  # records without final.tau
    first, second = tune_runs(spec, "d", 32, "base")[:2]
    folder = runner.run_dir(spec, first)
    folder.mkdir(parents=True)
    lines = [{"step": k, "samples_per_s": 50.0, "tau": 0.07 - k / 1000} for k in (1, 2, 3)]
    lines.insert(2, {"step": 2, "eval/retrieval/image_to_text_R@1": 0.5})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["report", str(spec.path), "--backfill-tau"]) == 0
    assert "backfill-tau: 1 record(s) given final.tau from their metrics.jsonl, 23 without a run folder" in (
        capsys.readouterr().out
    )
    assert records.load(spec.results, first.id)["final"]["tau"] == 0.067
    assert "tau" not in records.load(spec.results, second.id)["final"]
    assert "| 0.067 (1 of 2) |" in spec.report_md.read_text()  # first and second share a setting (2 seeds)
    assert report._mean_tau([0.05, 0.07], 2) == "0.06" and report._mean_tau([], 3) == "–"


def test_run_takes_only_the_phases_it_is_given(tmp_path, capsys, monkeypatch):
    """`run --phase tune --phase test`: every cell's test runs before any long run (the headline's order)."""
    spec = load(write_spec(tmp_path))
    finish_tuning(spec)
    every = runner.pending(spec, "d/32/base", set(), {})
    assert {r.phase for r in every} == {"test", "long"}
    short = runner.pending(spec, "d/32/base", set(), {}, ("tune", "test"))
    assert {r.phase for r in short} == {"test"} and len(short) == 6 and short == every[:6]
    assert runner.pending(spec, "d/32/base", set(), {}, ("tune",)) == []
    path = str(write_spec(tmp_path))
    one_line_error(capsys, main, ["run", path, "--phase", "longer"], "--phase", "invalid choice: 'longer'")
    given = []
    monkeypatch.setattr(runner, "run_pending", lambda spec, **kw: given.append(kw["phases"]) or 0)
    mixed = "--allow-mixed-commits"  # the made-up runs' code is not this tree's
    assert main(["run", path, mixed, "--phase", "tune", "--phase", "test"]) == 0 and main(["run", path, mixed]) == 0
    assert given == [("tune", "test"), ("tune", "test", "long")]


@pytest.mark.parametrize(
    "from_choice, words",
    [
        ({"loss.temperature": "nobody"}, ("objectives.hard.from_choice.loss.temperature", "no other objective")),
        ({"loss.rho_frac": "base2"}, ("from_choice.loss.rho_frac", "base2 does not tune loss.rho_frac")),
        ({"optim.lr": "base2"}, ("objectives.hard.from_choice", "['optim.lr'] also fixed in options or tuned")),
        ({"loss.temperature": ["base2"]}, ("from_choice.loss.temperature", "must name an objective, got ['base2']")),
    ],
)
def test_from_choice_names_a_tuned_knob_of_another_objective(tmp_path, capsys, from_choice, words):
    one_line_error(capsys, main, ["plan", str(with_hard(tmp_path, **from_choice))], *words)


def test_from_choice_takes_one_step_only(tmp_path, capsys):
    path = with_hard(tmp_path)
    raw = json.loads(path.read_text())
    raw["objectives"]["base2"]["from_choice"] = {"loss.temperature": "base"}
    raw["objectives"]["base2"]["grid"] = {"optim.lr": [1e-3, 5e-4], "loss.hard_negative_beta": [0.5, 1.0]}
    raw["objectives"]["hard"]["from_choice"] = {"loss.hard_negative_beta": "base2"}
    raw["objectives"]["hard"]["grid"] = {"optim.lr": [1e-3, 5e-4], "loss.temperature": [0.07, 0.1]}
    path.write_text(json.dumps(raw))
    one_line_error(capsys, main, ["plan", str(path)], "from_choice.loss.hard_negative_beta", "one step only")


def test_stats_match_scipy_and_holm_by_hand():
    diffs = np.array([0.8, 2.1, -0.4, 1.3, 3.0, 0.5])
    assert stats.wilcoxon_p(diffs) == pytest.approx(sps.wilcoxon(diffs, method="exact").pvalue)
    # exact by hand: ranks of |d| 3,5,1,4,6,2; W- = 1; P(W <= 1) = 2/64 under the null, two-sided 4/64
    assert stats.wilcoxon_p(diffs) == pytest.approx(4 / 64)
    all_up = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert stats.wilcoxon_p(all_up) == pytest.approx(stats.smallest_wilcoxon_p(6)) == pytest.approx(2 / 64)
    # the sign-flip permutation test, every one of the 2^6 flips: only all-up and all-down reach |mean|
    assert stats.permutation_p(all_up) == pytest.approx(2 / 64)
    flips = np.array([[1 if (k >> i) & 1 else -1 for i in range(6)] for k in range(64)])
    by_hand = np.mean(np.abs((flips * diffs).mean(axis=1)) >= abs(diffs.mean()) - 1e-12)
    assert stats.permutation_p(diffs) == pytest.approx(by_hand)
    assert stats.wilcoxon_p(np.zeros(6)) is None and stats.wilcoxon_p(np.array([1.0])) is None
    # ties: 3 equal differences of one sign are the most extreme of the 8 sign flips, p = 2/8 (not the normal 0.083)
    assert stats.wilcoxon_p(np.full(3, 0.05)) == pytest.approx(2 / 8)
    # a tie and a zero, by hand: the zero dropped, |d| 1, 2, 2, 3 -> ranks 1, 2.5, 2.5, 4; W- = 1 (the -1); of the
    # 16 flips, W- <= 1 for 2 (W- 0, 1) and W+ <= 1 for 2: p = 4/16
    assert stats.wilcoxon_p(np.array([-1.0, 2.0, 2.0, 3.0, 0.0])) == pytest.approx(4 / 16)
    # Holm by hand: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> monotone 0.06
    assert stats.holm([0.01, 0.04, 0.03, 0.005, None]) == pytest.approx([0.03, 0.06, 0.06, 0.02, None])
    assert stats.holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])


def test_equal_differences_are_ties_despite_float_noise():
    """0.55 − 0.53 and 0.38 − 0.36 differ in the last bits; unrounded, scipy ranks them apart (p 0.359 here),
    as ties the exact test gives 0.641."""
    a = dict(enumerate([0.53, 0.24, 0.29, 0.36, 0.29, 0.34, 0.41, 0.13]))
    b = dict(enumerate([0.55, 0.25, 0.31, 0.38, 0.28, 0.33, 0.40, 0.11]))
    _, diffs = stats.paired(a, b)
    exact = np.array([-2, -1, -2, -2, 1, 1, 1, 2]) / 100
    assert np.array_equal(diffs, exact)
    want = sps.wilcoxon(exact, method=sps.PermutationMethod(n_resamples=np.inf)).pvalue
    assert stats.wilcoxon_p(diffs) == pytest.approx(want) == pytest.approx(0.640625)


def test_samples_to_target_and_ratio():
    curve = [[100, 0.1], [200, 0.5], [300, 0.4], [400, 0.7]]
    assert stats.samples_to_reach(curve, 0.45) == pytest.approx(300 + 100 * (0.05 / 0.3))  # the dip counts
    assert stats.samples_to_reach(curve, 0.05) == 100
    assert stats.samples_to_reach(curve, 0.8) is None
    winner = [[[100, 0.2], [200, 0.6], [400, 0.8]], [[100, 0.4], [200, 0.6], [400, 0.6]]]  # mean .3 .6 .7
    baseline = [[[100, 0.1], [200, 0.3], [400, 0.6]], [[100, 0.1], [200, 0.3], [400, 0.6]]]  # ends at 0.6
    assert stats.samples_ratio(winner, baseline) == pytest.approx(400 / 200)


def test_intervals_of_the_mean_difference_and_of_the_samples_ratio():
    diffs = np.array([0.8, 2.1, -0.4, 1.3, 3.0, 0.5])
    half = sps.t.ppf(0.975, 5) * diffs.std(ddof=1) / math.sqrt(6)  # by hand: mean ± t(0.975, n − 1)·sd/√n
    assert stats.mean_ci95(diffs) == pytest.approx([diffs.mean() - half, diffs.mean() + half])
    assert stats.mean_ci95(np.full(4, 0.02)) is None and stats.mean_ci95(np.array([1.0])) is None
    base = {s: [[100, 0.1], [200, 0.3], [400, 0.6]] for s in range(1, 7)}  # ends at 0.6 on every seed
    # the winner reaches 0.6 at 200 samples on seeds 1-5 (ratio 2) and never on seed 6
    win = {s: [[100, 0.3], [200, 0.6], [400, 0.8]] for s in range(1, 6)} | {6: [[100, 0.1], [200, 0.2], [400, 0.3]]}
    ratios = stats.samples_ratio_ci95(win, base)
    assert ratios == stats.samples_ratio_ci95(win, base)  # seeded: the same report each time
    assert ratios[1] == pytest.approx(2.0)  # no resample beats every seed at its best
    # a resample with seed 6 three times or more never gets there (P = 1 − P(≤ 2 of 6 draws) ≈ 0.10 > 2.5 %)
    assert ratios[0] == 0.0
    same = {s: [[100, 0.3], [200, 0.6], [400, 0.8]] for s in range(1, 7)}
    assert stats.samples_ratio_ci95(same, base) == pytest.approx([2.0, 2.0])
    assert stats.samples_ratio_ci95({1: same[1]}, {1: base[1]}) is None


def test_a_table_named_before_every_objective_is_tuned_says_it_is_provisional(tmp_path):
    spec = load(write_spec(tmp_path, batches=[32]))
    for run in tune_runs(spec, "d", 32, "base") + tune_runs(spec, "d", 32, "base2"):
        fake(spec, run, 0.5)
    for run in plan(spec, "d/32/base") + plan(spec, "d/32/base2"):
        if run.phase == "test":
            fake(spec, run, 0.4)
    md = report.write(spec)[0]
    assert "Provisional: named among the 2 of 3 objectives whose tuning is done; Holm's family grows" in md
    finish_tuning(spec)
    assert "Provisional" not in report.write(spec)[0]


def test_contrasts_answer_the_specs_questions_on_paired_seeds(tmp_path, capsys):
    """`contrasts`: a − b on the seeds both have, in the table where both ran (fastclip-v1 − dcl asks whether u
    helps, which no row against the strongest baseline says), Holm over the contrasts; a mistake in one is a line."""
    path = write_spec(tmp_path, batches=[32])
    raw = json.loads(path.read_text())
    raw["contrasts"] = [{"question": "q1", "a": "new", "b": "base"}, {"question": "q2", "a": "base2", "b": "base"}]
    path.write_text(json.dumps(raw))
    spec = load(path)
    finish_tuning(spec, lambda name, i, seed: {"base": 0.5, "base2": 0.55, "new": 0.6}[name])
    for run in plan(spec):
        if run.phase == "test":  # new: base + 0.01·seed; base2: base − 0.02 on seeds 1 and 2, equal on the rest
            extra = {"new": 0.01 * run.seed, "base2": -0.02 if run.seed < 3 else 0.0, "base": 0.0}[run.objective]
            fake(spec, run, 0.5 + extra)
    text, summary = report.write(spec)
    first, second = summary["contrasts"]
    assert (first["question"], first["a"], first["b"], first["epochs"]) == ("q1", "new", "base", 2)
    assert first["seeds"] == [1, 2, 3, 4, 5, 6] and first["wins"] == 6
    assert first["diff_mean"] == pytest.approx(0.035)
    p1 = sps.wilcoxon(np.arange(1, 7) * 0.01, method="exact").pvalue
    assert second["seeds"] == [1, 2, 3, 4, 5, 6] and second["wins"] == 0  # (base2: the strongest baseline)
    p2 = stats.wilcoxon_p(np.array([-0.02, -0.02, 0.0, 0.0, 0.0, 0.0]))  # ties dropped
    assert [first["p_holm"], second["p_holm"]] == pytest.approx(stats.holm([p1, p2]), abs=1e-4)
    assert "| q1 | new − base | 3.5 ± 1.9 [1.5, 5.5] | 6/6 | 0.031 |" in text
    raw["contrasts"] = [{"question": "q", "a": "new", "b": "nobody"}]
    path.write_text(json.dumps(raw))
    one_line_error(capsys, main, ["plan", str(path)], "contrasts[0].b", "names no objective ('nobody')")
    raw["contrasts"] = [{"question": "q", "a": "new"}]
    path.write_text(json.dumps(raw))
    one_line_error(capsys, main, ["plan", str(path)], "contrasts[0]", "must be {question, a, b}")


def test_report_schema_strongest_baseline_and_pending(tmp_path):
    """The winner and the strongest baseline are named on val (new, then base2 among the baselines), before any
    test seed; base2 is no headline objective, yet as its table's strongest baseline it gets every test seed and
    the longer training."""
    spec = load(write_spec(tmp_path))
    val = {"base": 0.50, "base2": 0.55, "new": 0.60}
    finish_tuning(spec, lambda name, i, seed: val[name])
    test_metric = {"base": 0.50, "base2": 0.55, "new": 0.60}
    for run in plan(spec):
        if run.phase != "tune" and run.global_batch == 32:  # batch 64's test runs stay pending
            bump = 0.01 * run.seed if run.objective == "new" else 0.0
            fake(spec, run, test_metric[run.objective] + bump + (0.02 if run.phase == "long" else 0.0))
    text, summary = report.write(spec)
    assert set(summary) == {"commit", "data", "cells", "comparisons"}
    assert summary["commit"] == "c1"
    assert summary["data"] == [
        {"dataset": "d", "class_blind_oracle_R1": 0.12, "context_cut_share": 0.0, "zeroshot_chance": 0.25,
         "val_images_in_train": None, "test_images_in_train": None, "novel_images_in_train": None}
    ]  # fmt: skip
    assert (
        "Data `d`: a class-blind oracle's R@1 12.0 %; captions cut by the text context 0.0 %; zero-shot chance "
        "25.0 %; images that are also train's: not measured." in text
    )
    cell_keys = {"dataset", "global_batch", "loss", "epochs", "seeds", "metric", "test_mean", "test_std",
                 "best_zeroshot_top1"}  # fmt: skip
    assert all(set(c) == cell_keys for c in summary["cells"])
    assert len(summary["cells"]) == 3 + 3  # three objectives at 2 epochs and at 6 (base2: the named baseline)
    new = next(c for c in summary["cells"] if c["loss"] == "new" and c["epochs"] == 2)
    assert new["seeds"] == [1, 2, 3, 4, 5, 6] and new["test_mean"] == pytest.approx(0.635)
    assert next(c for c in summary["cells"] if c["loss"] == "base2" and c["epochs"] == 2)["seeds"] == [1, 2, 3, 4, 5, 6]
    (row,) = summary["comparisons"]
    keys = {"dataset", "global_batch", "winner", "baseline", "diff_mean", "diff_ci95", "p_holm", "samples_ratio",
            "samples_ratio_never", "samples_ratio_at_least", "samples_ratio_ci95", "samples_ratio_epochs",
            "complete"}  # fmt: skip
    assert set(row) == keys and row["complete"] is True and row["samples_ratio_never"] is False
    assert row["samples_ratio_at_least"] is False
    assert (row["winner"], row["baseline"]) == ("new", "base2")
    assert row["diff_mean"] == pytest.approx(0.085)  # seeds 1-6 paired: 0.60 + 0.01·(1..6) − 0.55
    # Holm over the table's two comparisons with base2 (new: 6 pairs all up, exact p 2/64; base: 6 pairs all down)
    p_new, p_base = sps.wilcoxon([0.06, 0.07, 0.08, 0.09, 0.10, 0.11], method="exact").pvalue, 2 / 64
    assert p_new == pytest.approx(2 / 64) and stats.wilcoxon_p(np.full(6, -0.05)) == pytest.approx(p_base)
    assert row["p_holm"] == pytest.approx(stats.holm([p_new, p_base])[0]) == pytest.approx(4 / 64)
    # samples_ratio at the longer length (6 epochs, 3,840 samples, curves at 960·k): new's mean curve 0.655·k/4
    # reaches base2's final 0.57 between k = 3 and 4
    needed = 2880 + (0.57 - 0.655 * 0.75) / (0.655 * 0.25) * 960
    assert row["samples_ratio"] == pytest.approx(3840 / needed, abs=1e-4) and row["samples_ratio_epochs"] == 6
    # differences 0.06..0.11: mean 0.085 ± t(0.975, 5)·sd/√6; base2's curves are equal on every seed, so each
    # resample's ratio lies between the slowest and the fastest of new's seeds' own ratios
    half = sps.t.ppf(0.975, 5) * np.std([0.06, 0.07, 0.08, 0.09, 0.10, 0.11], ddof=1) / math.sqrt(6)
    assert row["diff_ci95"] == pytest.approx([0.085 - half, 0.085 + half], abs=1e-4)
    low, high = row["samples_ratio_ci95"]
    assert low < row["samples_ratio"] < high
    assert "- d/64: 18 test run(s)" in text and "- d/64: 18 long run(s)" in text
    md = spec.report_md.read_text()
    assert "Strongest baseline (named on val): `base2`; winner (named on val): `new`.\n" in md and "| new |" in md
    assert "| new | lr0.001_rho_frac0.4 | 6 | 63.5 ± 1.9 | 8.5 ± 1.9 [6.5, 10.5] | 6/6 |" in md
    # zero-shot top-1 paired too (fake records 0.5 on every run: no difference, no test), each metric its own Holm
    assert "| new | 0.0 ± 0.0 | 0/6 | – |" in md
    assert json.loads(spec.summary_json.read_text()) == summary
    # a figure per table with a baseline, linked under its title: batch 32 at both lengths (64 has no test run)
    figures = sorted(p.name for p in spec.report_md.parent.glob("*.png"))
    assert figures == ["t_d_32_long.png", "t_d_32_test.png"] and "(<t_d_32_test.png>)" in md
    assert all((spec.report_md.parent / f).stat().st_size > 10_000 for f in figures)
    # its band: each evaluation's mean and std over the seeds (new's curves: (0.60 + 0.01 s) k/4 at 320 k samples)
    t = next(t for t in report.summarize(spec)["_tables"] if t["global_batch"] == 32 and t["phase"] == "test")
    finals = [0.60 + 0.01 * s for s in range(1, 7)]
    points = plots.band(t["curves"]["new"])
    assert [p[0] for p in points] == [320, 640, 960, 1280]
    assert points[-1][1:] == pytest.approx((np.mean(finals), np.std(finals, ddof=1)))
    assert points[1][1:] == pytest.approx((np.mean(finals) / 2, np.std(finals, ddof=1) / 2))
    before = (spec.report_md.parent / "t_d_32_test.png").read_bytes()
    report.write(spec)  # the same runs: the same bytes (no date or machine in the file)
    assert (spec.report_md.parent / "t_d_32_test.png").read_bytes() == before
    # curves that share no evaluation (or none at all): the figure leaves their lines out, and is still drawn
    t["curves"] = {"base2": [[[1, None]], [[2, 0.5]]], "new": [[]] * 6, "base": t["curves"]["base"]}
    assert plots.table_figure(spec, t, "footer").stat().st_size > 10_000


def test_a_winner_that_never_reaches_the_baseline_reads_never_not_a_dash(tmp_path):
    """A winner on test whose mean curve passes the baseline's final value and falls back below it never reaches it:
    the table said "–", the mark of missing curves (found by a fresh-eyes review)."""
    spec = load(write_spec(tmp_path))
    row = {"objective": "new", "diff_mean": 0.01, "diff_ci95": [0.0, 0.02], "p_holm": 0.5}
    t = {"dataset": "d", "global_batch": 32, "winner": "new", "baseline": "base", "comparisons": [row]}
    runs = {  # new: 0.5 -> 0.6 -> 0.45 on both seeds; base ends at 0.5
        "new": {s: {"curve": [[100, 0.5], [200, 0.6], [300, 0.45]], "run": {"epochs": 2}} for s in (1, 2)},
        "base": {s: {"curve": [[100, 0.3], [200, 0.4], [300, 0.5]], "run": {"epochs": 2}} for s in (1, 2)},
    }
    c = report.headline(spec, t, {("d", 32, "test"): runs})
    assert c["samples_ratio"] is None and c["samples_ratio_never"] is True
    assert report._ratio(c) == "never [never, 0.00] (2)"  # every resample never gets there either
    runs["new"] = {s: {"curve": [], "run": {"epochs": 2}} for s in (1, 2)}  # no curves: nothing measured
    c = report.headline(spec, t, {("d", 32, "test"): runs})
    assert c["samples_ratio_never"] is False and report._ratio(c) == "–"


def test_a_winner_at_the_target_from_its_first_evaluation_reads_at_least(tmp_path):
    """A winner already at the baseline's final value at its first evaluation: the ratio is the evaluation grid's
    (the baseline's samples over the first evaluation's), a lower bound, read "≥" (it read as a point: 4.00x for a
    winner at chance against a baseline at chance, with 4 evaluations; helper-57)."""
    spec = load(write_spec(tmp_path))
    row = {"objective": "new", "diff_mean": 0.0, "diff_ci95": [0.0, 0.0], "p_holm": 1.0}
    t = {"dataset": "d", "global_batch": 32, "winner": "new", "baseline": "base", "comparisons": [row]}
    runs = {
        "new": {s: {"curve": [[100, 0.016], [200, 0.015], [300, 0.016], [400, 0.016]], "run": {"epochs": 2}}
                for s in (1, 2)},
        "base": {s: {"curve": [[100, 0.01], [200, 0.012], [300, 0.013], [400, 0.014]], "run": {"epochs": 2}}
                 for s in (1, 2)},
    }  # fmt: skip
    c = report.headline(spec, t, {("d", 32, "test"): runs})
    assert c["samples_ratio"] == 4.0 and c["samples_ratio_at_least"] is True
    assert report._ratio(c).startswith("≥ 4.00x")
    runs["new"] = {s: {"curve": [[100, 0.005], [200, 0.015], [300, 0.016], [400, 0.016]], "run": {"epochs": 2}}
                   for s in (1, 2)}  # fmt: skip
    c = report.headline(spec, t, {("d", 32, "test"): runs})
    assert c["samples_ratio_at_least"] is False and not report._ratio(c).startswith("≥")
    assert (report._pct(-0.0), report._pct(-1e-5), report._pct(-0.0006)) == ("0.0", "0.0", "-0.1")  # no "-0.0"


def test_the_samples_ratio_point_is_over_the_paired_seeds_as_its_interval(tmp_path):
    """A winner with 2 test seeds against a baseline with 3: the point used every seed of each side and the interval
    the paired ones only, so the point could sit outside its own interval (study v2: 1.29x [1.30, 1.42])."""
    spec = load(write_spec(tmp_path))
    row = {"objective": "new", "diff_mean": 0.01, "diff_ci95": [0.0, 0.02], "p_holm": 0.5}
    t = {"dataset": "d", "global_batch": 32, "winner": "new", "baseline": "base", "comparisons": [row]}
    runs = {  # paired seeds 1 and 2: base ends at 0.4, new reaches 0.4 at 200 samples; seed 3 of base ends at 0.7
        "new": {s: {"curve": [[100, 0.2], [200, 0.4], [400, 0.5]], "run": {"epochs": 2}} for s in (1, 2)},
        "base": {s: {"curve": [[100, 0.1], [200, 0.2], [400, 0.4]], "run": {"epochs": 2}} for s in (1, 2)},
    }
    runs["base"][3] = {"curve": [[100, 0.3], [200, 0.5], [400, 0.7]], "run": {"epochs": 2}}
    c = report.headline(spec, t, {("d", 32, "test"): runs})
    assert c["samples_ratio"] == pytest.approx(400 / 200)  # (over base's 3 seeds: final mean 0.5, reached at 400: 1x)
    assert c["samples_ratio_ci95"] == pytest.approx([2.0, 2.0])


def test_a_winner_that_is_the_strongest_baseline_and_alone_on_test_has_no_comparison_yet(tmp_path):
    """The first cell to finish its test seeds (study v2: dcl at batch 32) is its table's winner and baseline so far;
    its headline row says no other objective has test runs instead of printing None."""
    spec = load(write_spec(tmp_path))
    finish_tuning(spec, lambda name, i, seed: {"base": 0.7, "base2": 0.5, "new": 0.6}[name])
    for run in plan(spec):
        if run.phase == "test" and run.global_batch == 32 and run.objective == "base":
            fake(spec, run, 0.4 + 0.01 * run.seed, zeroshot=0.3 + 0.01 * run.seed)
            record = records.load(spec.results, run.id)
            records.save(spec.results, run.id, {**record, "novel": {"metric": 0.5 + 0.01 * run.seed}})
    started = next(r for r in plan(spec) if r.phase == "test" and r.objective == "base2" and r.global_batch == 32)
    (runner.run_dir(spec, started) / "checkpoints" / "step_00000004").mkdir(parents=True)  # running, or stopped
    text, summary = report.write(spec)
    assert f"Started, with a checkpoint (running, or to resume): `{started.id}`." in text
    # beside the metric: zero-shot mean over seeds 1-6 (best seed's), novel's mean
    assert "| base | lr0.001_temperature0.07 | 6 | 43.5 ± 1.9 | baseline |  | – | – | – | 33.5 (36.0) | 53.5 |" in text
    (row,) = summary["comparisons"]
    assert (row["winner"], row["baseline"], row["diff_mean"], row["complete"]) == ("base", None, None, False)
    assert "| d | 32 | base | – (no other objective tested yet) | – |" in text


def test_the_winner_is_named_on_val_not_by_test_means_over_unequal_seeds(tmp_path):
    """Test means over different seed sets would crown base (seeds 1-3 high) over new, which wins every paired
    seed; naming on val does not read the test seeds at all."""
    spec = load(write_spec(tmp_path, batches=[32]))
    val = {"base": 0.50, "base2": 0.40, "new": 0.60}
    finish_tuning(spec, lambda name, i, seed: val[name])
    for run in plan(spec):
        if run.phase == "test":
            if run.objective == "new":
                fake(spec, run, 0.70 if run.seed <= 3 else 0.30)
            else:
                fake(spec, run, 0.65 if run.seed <= 3 else 0.20)
    t = report.summarize(spec)["_tables"][0]
    assert (t["winner"], t["baseline"]) == ("new", "base")
    assert t["means"]["base2"] > t["means"]["new"]  # base2 ran seeds 1-3 only: its test mean is the highest
    row = next(r for r in t["comparisons"] if r["objective"] == "new")
    assert row["wins"] == 6 and row["diff_mean"] == pytest.approx(0.075)


def test_the_runner_up_of_a_winner_that_is_the_strongest_baseline_is_trained_longer_too(tmp_path):
    """The winner base is the strongest baseline, so its comparison is the runner-up on val, new: new (not a
    headline objective) gets every test seed and the longer training, so samples-to-target is measured at the longer
    length (it had the other test seeds only and no long runs: the long table had no comparison)."""
    path = write_spec(tmp_path, batches=[32])
    raw = json.loads(path.read_text())
    raw["objectives"]["new"]["headline"] = False
    path.write_text(json.dumps(raw))
    spec = load(path)
    val = {"base": 0.60, "base2": 0.40, "new": 0.50}
    finish_tuning(spec, lambda name, i, seed: val[name])
    named = designate(spec, "d", 32)
    assert (named.winner, named.baseline, named.runner_up) == ("base", "base", "new")
    runs = [r for r in plan(spec) if r.objective == "new" and r.phase != "tune"]
    assert sorted(r.seed for r in runs if r.phase == "test") == list(spec.test_seeds)
    assert sorted(r.seed for r in runs if r.phase == "long") == list(spec.test_seeds)
    assert not [r for r in plan(spec) if r.objective == "base2" and r.phase == "long"]
    val["new"] = 0.70  # new wins: the winner is then not the strongest baseline, and there is no runner-up
    finish_tuning(spec, lambda name, i, seed: val[name])
    assert designate(spec, "d", 32).runner_up is None


def test_report_shows_each_cells_tuning_and_a_choice_on_the_grids_edge(tmp_path):
    path = write_spec(tmp_path, batches=[32])
    raw = json.loads(path.read_text())
    for objective in raw["objectives"].values():  # 3 x 2 grids: an lr can sit on an edge
        objective["grid"]["optim.lr"] = [1e-3, 5e-4, 2.5e-4]
    path.write_text(json.dumps(raw))
    spec = load(path)
    runs = tune_runs(spec, "d", 32, "base2")  # setting i (lr-major), seeds 10 and 11
    val = {0: (0.30, 0.32), 1: (0.40, 0.42), 2: (0.45, 0.47), 3: (0.20, 0.22), 4: (0.50, 0.52), 5: (0.44, 0.44)}
    for i, run in enumerate(runs[:-1]):  # lr 2.5e-4 at τ 0.1, seed 11, still running
        fake(spec, run, val[i // 2][i % 2], zeroshot=0.2)
    md = report.write(spec)[0]
    assert "### Tuning d/32/base2: 11 of 12 runs" in md and "### Tuning d/32/base" + ":" not in md
    assert "| lr0.00025_temperature0.07 | 50.0 | 52.0 | 51.0 | 20.0 |" in md
    assert "| lr0.00025_temperature0.1 | 44.0 | – | – | 20.0 |" in md
    # the leader among complete settings, on the lr grid's lowest value
    assert "Leading so far (settings with every seed done): `lr0.00025_temperature0.07`; on the grid's edge: lr " in md
    assert "lr 0.00025 is the grid's lowest." in md
    fake(spec, runs[-1], 0.60)  # now lr 2.5e-4 at τ 0.1 has the best mean (0.52 against 0.51), on the lr edge:
    # one geometric step past it (2.5e-4 · 2.5e-4 / 5e-4) is tuned before anything is chosen
    step = tune_runs(spec, "d", 32, "base2")[len(runs) :]
    assert [r.id for r in step] == [f"d/32/base2/lr0.000125_temperature0.1/s{s}/tune/e2" for s in (10, 11)]
    md = report.write(spec)[0]
    assert "### Tuning d/32/base2: 12 of 14 runs" in md and "| lr0.000125_temperature0.1 | – | – | – |" in md
    assert "Leading so far (settings with every seed done): `lr0.00025_temperature0.1`;" in md
    assert not [r for r in plan(spec, "d/32/base2") if r.phase == "test" and not r.chosen_pending]
    fake(spec, step[0], 0.52)
    fake(spec, step[1], 0.50)  # 0.51 < 0.52: the step loses, the edge setting is chosen
    md = report.write(spec)[0]
    assert (
        "Chosen: `lr0.00025_temperature0.1`; on the grid's edge: lr 0.00025 is the grid's lowest; tuned past the "
        "grid and not chosen: `lr0.000125_temperature0.1` (51.0)." in md
    )
    assert {r.settings["optim.lr"] for r in plan(spec, "d/32/base2") if r.phase == "test"} == {2.5e-4}
    # a choice inside the grid carries no edge note
    fake(spec, runs[4], 0.95)
    fake(spec, runs[5], 0.95)
    assert "Chosen: `lr0.0005_temperature0.07`." in report.write(spec)[0]


def test_a_step_past_the_edge_that_wins_is_followed_by_another_at_most_twice(tmp_path):
    path = write_spec(tmp_path, batches=[32])
    raw = json.loads(path.read_text())
    for objective in raw["objectives"].values():
        objective["grid"]["optim.lr"] = [1e-3, 5e-4, 2.5e-4]
    path.write_text(json.dumps(raw))
    spec = load(path)
    base = tune_runs(spec, "d", 32, "new")
    for i, run in enumerate(base):  # lr 1e-3, rho_frac 0.6 best: the lr grid's highest
        fake(spec, run, 0.7 if i in (2, 3) else 0.3)
    for lr, metric in ((2e-3, 0.8), (4e-3, 0.9)):  # each step wins; the second is the last one taken
        (a, b) = tune_runs(spec, "d", 32, "new")[len(base) :][-2:]
        assert a.settings == {"optim.lr": lr, "loss.rho_frac": 0.6}
        fake(spec, a, metric)
        fake(spec, b, metric)
    runs = tune_runs(spec, "d", 32, "new")
    assert len(runs) == len(base) + 4 and report.chosen(spec, "d", 32, "new") == {
        "optim.lr": 4e-3,
        "loss.rho_frac": 0.6,
    }
    assert (
        "Chosen: `lr0.004_rho_frac0.6`; on the grid's edge: lr 0.004 is past the grid's highest; tuned past the grid "
        "and not chosen: `lr0.002_rho_frac0.6` (80.0)." in report.write(spec)[0]
    )


def test_a_step_past_the_edge_that_the_trainer_refuses_is_not_tuned_and_the_report_says_why(tmp_path):
    """ema_momentum 0.999 on the grid's top steps to 1.003, which `fastclip train` refuses: no step is tuned (every
    attempt would fail and the cell would never have a choice); the choice is the edge, with the reason."""
    path = write_spec(tmp_path, batches=[32])
    raw = json.loads(path.read_text())
    for objective in raw["objectives"].values():  # 3 x 2 grids: the momentum can sit on its top edge
        objective["grid"] = {"model.ema_momentum": [0.99, 0.995, 0.999], "optim.lr": [1e-3, 5e-4]}
    path.write_text(json.dumps(raw))
    spec = load(path)
    runs = tune_runs(spec, "d", 32, "base")
    for i, run in enumerate(runs):  # momentum 0.999 at lr 1e-3 leads
        fake(spec, run, 0.7 if i in (8, 9) else 0.3)
    assert tune_runs(spec, "d", 32, "base") == runs  # no step past the edge
    assert report.chosen(spec, "d", 32, "base") == {"model.ema_momentum": 0.999, "optim.lr": 1e-3}
    md = report.write(spec)[0]
    assert (
        "Chosen: `ema_momentum0.999_lr0.001`; on the grid's edge: ema_momentum 0.999 is the grid's highest; no step "
        "past it to ema_momentum 1.003 (config key 'model.ema_momentum': must be in (0, 1) or null (got 1.003))."
    ) in md, md
    # a step the trainer takes is still tuned: at the lowest edge, 0.99 -> 0.985
    for i, run in enumerate(runs):
        fake(spec, run, 0.7 if i in (0, 1) else 0.3)
    step = tune_runs(spec, "d", 32, "base")[len(runs) :]
    assert [r.settings["model.ema_momentum"] for r in step] == [0.985, 0.985]


def test_run_stops_when_the_code_changes_under_it(tmp_path, tiny_embedded, capsys, monkeypatch):
    """fastclip/ edited while `run` goes: the next start finds other code, so the run in progress is stopped at its
    checkpoint (a trainer imports some modules late) and none starts: one line, status 2 (a run recorded the new
    code beside the table's old one, and the report then refused the table)."""
    import shutil

    data = tmp_path / "copy"  # the tiny shards, with their val split as test too
    shutil.copytree(tiny_embedded, data)
    shutil.copytree(data / "val", data / "test")
    path = write_spec(tmp_path, batches=[32])
    raw = json.loads(path.read_text())
    raw["datasets"]["d"]["data"] = str(data)
    path.write_text(json.dumps(raw))
    started = []  # the code is edited once the first run has started
    monkeypatch.setattr(records, "code_version", lambda: {"commit": "c1", "code": "c2" if started else "c1",
                                                           "dirty": bool(started)})  # fmt: skip
    real_start = runner.start
    monkeypatch.setattr(runner, "start", lambda *a: started.append(real_start(*a)) or started[-1])
    status = main(["run", str(path), "--parallel", "2", "--max-runs", "2"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert "fastclip/ or configs/ changed while `run` ran (code c1 -> c2): the 1 run(s) in progress were stopped" in err
    assert len(started) == 1 and started[0].proc.returncode is not None  # stopped and waited for, none orphaned
    assert not any(records.load(load(path).results, r.id) for r in plan(load(path)))  # nothing recorded
    # every slot busy (one at a time, one run): `run` notices on its next look, not only when a run would start
    # (it was noticed only there: a table's last runs finished, and counted, on code that changed under them)
    started.clear()
    monkeypatch.setattr(runner, "CODE_CHECK_EVERY_S", 0.0)
    assert main(["run", str(path), "--parallel", "1", "--max-runs", "1"]) == 2
    assert "the 1 run(s) in progress were stopped" in capsys.readouterr().err
    assert len(started) == 1 and started[0].proc.returncode is not None


def test_mixed_code_is_refused_and_stale_runs_rerun(tmp_path, capsys, monkeypatch):
    path = write_spec(tmp_path)
    spec = load(path)
    finish_tuning(spec)
    first = tune_runs(spec, "d", 32, "base")[0]
    fake(spec, first, 0.5, code="c0")  # one run of table d/32 from other code
    one_line_error(capsys, main, ["report", str(path)], "table d/32", "c0", "c1", "--rerun-stale")
    assert main(["report", str(path), "--allow-mixed-commits"]) == 0
    out = capsys.readouterr().out  # the mix is said, with the tuning run's code (it named c1's commit alone)
    assert "**Mixed code**" in out and "table d/32: c0 (1 runs), c1 (" in out and "commit(s) c0,c1" in out
    monkeypatch.setattr(records, "code_version", lambda: {"commit": "c1", "code": "c1", "dirty": False})
    one_line_error(capsys, main, ["run", str(path), "--max-runs", "0"], "table d/32", "1 run(s) from other code")
    assert main(["run", str(path), "--max-runs", "0", "--cell", "d/64/base"]) == 0  # another table: not blocked
    assert main(["plan", str(path)]) == 0
    assert "(1 from other code or data than now: `run --rerun-stale` runs them again)" in capsys.readouterr().out
    # --rerun-stale over one cell, with stale runs in another cell of its table: refused before anything moves
    # (it moved the cell's runs, then refused the table)
    other = tune_runs(spec, "d", 32, "base2")[0]
    fake(spec, other, 0.5, code="c0")
    one_line_error(capsys, main, ["run", str(path), "--max-runs", "0", "--rerun-stale", "--cell", "d/32/base"],
                   "table d/32: 1 run(s) from other code than now (c1): c0 (1), in objective(s) base2",
                   "--rerun-stale --cell 'd/32/*'")  # fmt: skip
    assert records.load(spec.results, first.id) is not None  # nothing moved
    assert main(["run", str(path), "--max-runs", "0", "--rerun-stale"]) == 0
    assert records.load(spec.results, first.id) is None  # pending again; the old record kept under stale/
    assert json.loads((spec.results / "stale" / f"{first.id}.json").read_text())["code"] == "c0"
    assert main(["report", str(path)]) == 0  # one code left
    # stale again (another code since): the record moved the first time stays, this one is kept beside it
    fake(spec, first, 0.6, code="c0b")
    assert main(["run", str(path), "--max-runs", "0", "--rerun-stale"]) == 0
    assert json.loads((spec.results / "stale" / f"{first.id}.json").read_text())["code"] == "c0"
    stale_name = first.id.rsplit("/", 1)[-1]
    assert (
        json.loads((spec.results / "stale" / f"{first.id}.json").with_name(f"{stale_name}~2.json").read_text())["code"]
        == "c0b"
    )


def test_rerun_stale_moves_a_dependents_old_runs_while_its_source_retunes(tmp_path):
    """hard takes base2's τ: once base2's runs of old code are moved (pending again), hard's old-code runs at the
    τ base2 chose then are listed by no plan; `--rerun-stale` on base2's cell moves them too, so they cannot come
    back into a table when base2 chooses that τ again. hard's runs of the current code stay."""
    spec = load(with_hard(tmp_path))
    finish_tuning(spec)  # every run code c1; hard's at base2's choice (τ 0.07)
    hard = tune_runs(spec, "d", 32, "hard")
    kept = tune_runs(spec, "d", 64, "hard")[0]
    fake(spec, kept, 0.5, code="c2")  # batch 64: another table, and current code
    assert not any(r.chosen_pending for r in hard)
    assert len(runner.move_stale(spec, "c2", "d/32/base2")) == 8 + 8  # base2's 8, then hard's 8 (no plan lists them)
    assert all(r.chosen_pending for r in tune_runs(spec, "d", 32, "hard"))
    assert all((spec.results / "stale" / f"{r.id}.json").is_file() for r in hard)
    assert records.load(spec.results, kept.id) is not None
    assert len(runner.move_stale(spec, "c2", "d/32/base")) == 8  # base's own; hard takes nothing from base


def test_rerun_stale_moves_a_dependents_runs_on_other_data_too(tmp_path):
    """Of the current code but on other data: base2's runs are stale (+other-data), and hard's runs at base2's old
    choice, which no plan lists once base2's are moved, too (the second pass compared the code alone)."""
    spec = load(with_hard(tmp_path))
    finish_tuning(spec)
    for run in plan(spec):
        record = records.load(spec.results, run.id)
        if record is not None:
            records.save(spec.results, run.id, {**record, "data": "other shards"})
    runner.data_fingerprint.cache_clear()
    assert len(runner.move_stale(spec, "c1", "d/32/base2")) == 8 + 8
    assert not list((spec.results / "runs" / "d" / "32" / "hard").rglob("*.json"))


def test_a_run_made_with_other_settings_is_stale_and_its_checkpoints_are_not_resumed(
    tmp_path, tiny_embedded, monkeypatch
):
    """A run records the arguments that decide what it trains; when the spec gives the same run other ones (here
    the objective's fixed options), its table refuses it as other code and --rerun-stale moves it; a stopped run
    resumes only with the code and arguments it started with."""
    path = write_spec(tmp_path)
    raw = json.loads(path.read_text())
    raw["datasets"]["d"]["data"] = str(tiny_embedded)
    path.write_text(json.dumps(raw))
    spec = load(path)
    run = tune_runs(spec, "d", 32, "base")[0]
    args = runner.deciding_args(runner.command(spec, run, tiny_embedded))
    assert args["optim.lr"] == "0.001" and args["train.seed"] == "10" and "train.run_dir" not in args
    assert not any(k.startswith(("eval.", "checkpoint.")) for k in args)
    resumed = runner.command(spec, run, tiny_embedded) + ["--train.resume", "latest"]
    assert runner.deciding_args(resumed) == args  # a resumed run trains what it started to
    fake(spec, run, 0.5)
    record = records.load(spec.results, run.id)
    records.save(spec.results, run.id, {**record, "args": args})
    assert runner.table_codes(spec)[("d", 32)] == {"c1": [run.id]}
    raw["objectives"]["base"]["options"] = {"optim.wd": 0.2}
    path.write_text(json.dumps(raw))
    spec = load(path)
    assert runner.table_codes(spec)[("d", 32)] == {"c1+other-settings": [run.id]}
    with pytest.raises(runner.MixedCommits, match="1 run.s. from other code"):
        runner.check_commits(spec, "c1")
    # the report refuses such a table too (it showed its runs under the new spec's settings, silently)
    with pytest.raises(runner.MixedCommits, match=r"table d/32: its 1 run\(s\) were made with other settings than"):
        runner.check_commits(spec, None)
    assert len(runner.move_stale(spec, "c1", None)) == 1 and records.load(spec.results, run.id) is None
    # the data is part of a run's provenance: other shards (or a changed class list) under the same name are not the
    # data it ran on (they were taken as they were)
    import shutil

    data = tmp_path / "data_copy"
    shutil.copytree(tiny_embedded, data)
    raw["datasets"]["d"]["data"] = str(data)
    path.write_text(json.dumps(raw))
    spec = load(path)
    fake(spec, run, 0.5)
    record = records.load(spec.results, run.id)
    now = runner.deciding_args(runner.command(spec, run, data))
    records.save(spec.results, run.id, {**record, "args": now, "data": records.data_fingerprint(data)})
    runner.data_fingerprint.cache_clear()
    assert runner.table_codes(spec)[("d", 32)] == {"c1": [run.id]}
    spare = sorted((data / "train").glob("*.tar"))[-1]
    spare.rename(tmp_path / spare.name)  # one shard fewer
    runner.data_fingerprint.cache_clear()
    assert runner.table_codes(spec)[("d", 32)] == {"c1+other-data": [run.id]}
    with pytest.raises(runner.MixedCommits, match="made with other data than"):
        runner.check_commits(spec, None)
    (tmp_path / spare.name).rename(spare)
    runner.data_fingerprint.cache_clear()
    assert runner.table_codes(spec)[("d", 32)] == {"c1": [run.id]}
    raw_bytes = bytearray(spare.read_bytes())  # other content of the same size (tar's 10 KiB blocks): told apart
    raw_bytes[-2000] ^= 0xFF
    spare.write_bytes(bytes(raw_bytes))
    runner.data_fingerprint.cache_clear()
    assert runner.table_codes(spec)[("d", 32)] == {"c1+other-data": [run.id]}
    with pytest.raises(runner.MixedCommits, match="made with other data than"):
        runner.check_commits(spec, None)
    both = {("d", 32): {"c1+other-settings+other-data": [run.id]}}  # a run of both: both named (one was)
    monkeypatch.setattr(runner, "table_codes", lambda spec: both)
    with pytest.raises(runner.MixedCommits, match="made with other settings and data than"):
        runner.check_commits(spec, None)
    monkeypatch.undo()

    folder = tmp_path / "folder"
    assert not runner.resumable(folder, "c1", args)  # nothing to resume
    (folder / "checkpoints" / "step_00000002").mkdir(parents=True)
    assert runner.resumable(folder, "c1", args)  # a folder from before code.json: as it is
    (folder / "code.json").write_text(json.dumps({"code": "c1", "args": args}))
    assert runner.resumable(folder, "c1", args)
    assert not runner.resumable(folder, "c2", args)
    assert not runner.resumable(folder, "c1", {**args, "optim.wd": "0.2"})


def test_code_version_names_the_code_tree():
    version = records.code_version()
    assert len(version["commit"]) == 12 and version["code"].split("+")[0].count("-") == 1
    assert version["dirty"] == ("+dirty-" in version["code"])


def test_an_edit_to_an_untracked_code_file_is_other_code(tmp_path, monkeypatch):
    import subprocess

    for part in records.CODE_PATHS:
        (tmp_path / part).mkdir()
        (tmp_path / part / "a.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "c"]):
        subprocess.run([*git, *args], check=True)
    monkeypatch.setattr(records, "REPO", tmp_path)
    clean = records.code_version()
    assert not clean["dirty"]
    new = tmp_path / records.CODE_PATHS[0] / "new.py"
    new.write_text("y = 1\n")
    first = records.code_version()["code"]
    new.write_text("y = 2\n")
    second = records.code_version()["code"]
    assert first.startswith(clean["code"] + "+dirty-") and second.startswith(clean["code"] + "+dirty-")
    assert first != second


def test_code_version_outside_a_repository_comes_from_the_file_prepare_wrote(tmp_path, monkeypatch):
    """On a lent GPU machine the working tree is a copy without .git: the version `gpu_check.sh prepare` recorded
    here (STUDY_CODE_VERSION) is what its runs record, if the copy's code is the code it was written for; without
    that file, "unknown"."""
    import shutil

    here = records.code_version()
    (tmp_path / "version.json").write_text(json.dumps({**here, "files": records.files_digest()}))
    copy = tmp_path / "copy"  # the working tree's code, without .git
    for root in records.CODE_PATHS:
        shutil.copytree(REPO / root, copy / root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(records, "REPO", copy)
    monkeypatch.delenv("STUDY_CODE_VERSION", raising=False)
    assert records.code_version()["commit"] == "unknown"
    monkeypatch.setenv("STUDY_CODE_VERSION", str(tmp_path / "version.json"))
    assert records.code_version() == here
    (copy / "fastclip" / "cli.py").write_text("# changed after prepare\n")
    with pytest.raises(ValueError, match="was written for other code than this copy's fastclip, configs: run"):
        records.code_version()


def test_the_gpu_spec_is_v2_with_its_differences_only(tmp_path, tiny_embedded):
    """v2-gpu.yaml (`base: v2.yaml`): the same cells, seeds, data and scenes, on cuda, into its own results; its runs
    decode in a loader worker each. A base that is missing or names itself is one line."""
    v2, gpu = load(REPO / "benchmarks" / "study" / "v2.yaml"), load(REPO / "benchmarks" / "study" / "v2-gpu.yaml")
    same = ("objectives", "batches", "tune_seeds", "test_seeds", "other_test_seeds", "long_factor", "curve_points")
    assert all(getattr(v2, key) == getattr(gpu, key) for key in same)
    (d2,), (dg,) = v2.datasets.values(), gpu.datasets.values()
    assert dataclasses.replace(dg, make=d2.make) == d2 and dg.make == (
        *d2.make,
        "--fashion-mnist-root",
        ".gpu/fashion-mnist",
    )
    assert (gpu.device, gpu.train) == ("cuda", {**v2.train, "data.workers": 1}) and gpu.results != v2.results
    run = tune_runs(gpu, dg.name, 32, "dcl")[0]
    args = runner.command(gpu, run, tiny_embedded)
    assert args[args.index("--data.workers") + 1] == "1" and args[args.index("--train.device") + 1] == "cuda"
    args = runner.command(v2, run, tiny_embedded)
    assert args[args.index("--data.workers") + 1] == "0"  # on CPU a run is one process on one core
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(SpecError, match="loop.yaml: is its own base"):
        load(tmp_path / "loop.yaml")
    (tmp_path / "orphan.yaml").write_text("base: gone.yaml\n")
    with pytest.raises(SpecError, match=r"gone.yaml: no such spec file \(the base of .*orphan.yaml\)"):
        load(tmp_path / "orphan.yaml")


def test_tuning_runs_evaluate_tune_curve_points_times_and_checkpoint_as_the_others(tmp_path, tiny_embedded):
    """A tuning run evaluates `tune_curve_points` times (its choice reads the last evaluation only), a test run
    `curve_points` times (its curve gives samples-to-target); both checkpoint `curve_points` times."""
    spec = load(write_spec(tmp_path, curve_points=4, tune_curve_points=1))  # 80 samples, 2 epochs: 6 steps at 32

    def every(run) -> tuple[int, int]:
        args = runner.command(spec, run, tiny_embedded)
        return int(args[args.index("--eval.every_steps") + 1]), int(args[args.index("--checkpoint.every_steps") + 1])

    tune = tune_runs(spec, "d", 32, "base")[0]
    assert every(tune) == (6, 2)  # (3 batches an epoch, the last filled: it said 4 steps, and evaluated at 4 and 6)
    assert every(dataclasses.replace(tune, phase="test")) == (2, 2)
    assert load(write_spec(tmp_path)).tune_curve_points == 16  # unset: as curve_points


def _every_objective_passes_fastclip_train_check(spec, tmp_path, tiny_embedded, capsys) -> None:
    """Each objective's last tuning run at the spec's largest batch, on the tiny glyphs: every key known, every loss
    option taken (`fastclip train --print-config`)."""
    from fastclip.train.cli import main as train_main

    data = tmp_path / "data"  # the tiny glyphs, val standing in for test
    data.mkdir()
    for name, target in (("train", "train"), ("val", "val"), ("test", "val"), ("zeroshot.json", "zeroshot.json")):
        (data / name).symlink_to(tiny_embedded / target)
    dataset = dataclasses.replace(next(iter(spec.datasets.values())), data=data)
    spec = dataclasses.replace(spec, datasets={dataset.name: dataset}, work=tmp_path / "work", results=tmp_path / "r")
    for name, objective in spec.objectives.items():
        batch = max(spec.batches)
        run = tune_runs(spec, dataset.name, batch, name)[-1]
        if run.chosen_pending:  # waits for another objective's choice: take that objective's first value
            taken = {k: spec.objectives[source].grid_at(batch)[k][0] for k, source in objective.from_choice.items()}
            run = dataclasses.replace(run, setting=tuple({**objective.settings(batch)[-1], **taken}.items()))
        args = runner.command(spec, run, data)[4:]
        assert train_main([*args, "--print-config"]) == 0, (name, capsys.readouterr())
    assert math.isclose(runner.train_samples(data), 80)


def test_v2_spec_plans_and_every_objective_passes_fastclip_train_check(tmp_path, tiny_embedded, capsys):
    spec = load(REPO / "benchmarks" / "study" / "v2.yaml")
    assert set(spec.batches) == {32, 128, 512} and len(spec.tune_seeds) >= 2 and len(spec.test_seeds) >= 6
    assert len(set(budget(spec).values())) == 1 and spec.long_factor >= 3
    compared = {"openclip", "infonce-fixed", "dcl", "dcl-queue", "dcl-moco", "dcl-hard", "siglip", "fastclip-v1"}
    compared |= {"fastclip-v3"}
    variants = {"fastclip-v2", "fastclip-tempnet", "fastclip-v3-two-tau"}
    assert set(spec.objectives) == compared | variants
    assert not any(spec.objectives[n].headline or spec.objectives[n].baseline for n in variants)
    # the lr grid centred by sqrt(B/32), the batch-32 grid as its runs were made
    for batch in spec.batches:
        lrs = {tuple(o.grid_at(batch)["optim.lr"]) for o in spec.objectives.values()}
        assert lrs == {tuple(2.5e-4 * math.sqrt(batch / 32) * f for f in (0.5, 1, 2))}
    # a learned global τ reaches as far in log τ at every batch (lr_tau x steps of 150,000 samples >= 4)
    for name in ("fastclip-v3", "fastclip-v3-two-tau", "fastclip-tempnet"):
        for batch in spec.batches:
            lr_tau = resolve_setting(spec.objectives[name].options, batch)["optim.lr_tau"]
            assert lr_tau * (150_000 // batch) >= 4, (name, batch)
    _every_objective_passes_fastclip_train_check(spec, tmp_path, tiny_embedded, capsys)


def test_revisits_spec_tunes_gamma_on_top_of_dcl_and_passes_fastclip_train_check(tmp_path, tiny_embedded, capsys):
    """v2-revisits.yaml (issue 38 §3): v2's 150,000 samples as 30 passes over 5,000 scenes; fastclip-v1 at dcl's
    tuned τ, tuning lr x γ_min on the same budget as dcl."""
    spec = load(REPO / "benchmarks" / "study" / "v2-revisits.yaml")
    (dataset,) = spec.datasets.values()
    assert dataset.epochs == 30 and dataset.make[dataset.make.index("--num-train") + 1] == "5000"
    v1 = spec.objectives["fastclip-v1"]
    assert v1.from_choice == {"loss.temperature": "dcl"} and set(v1.grid) == {"optim.lr", "loss.gamma_min"}
    assert set(budget(spec).values()) == {18}  # 9 settings x 2 seeds each
    _every_objective_passes_fastclip_train_check(spec, tmp_path, tiny_embedded, capsys)


def test_fastclip_objectives_of_the_study_specs_use_their_moving_average():
    """Every objective with u (FastCLIP's) reaches γ <= 0.5 by its last epoch at the shortest length, at one setting
    of its grid at least: at γ near 1, u is the batch's own estimate and the study would compare FastCLIP with its
    moving average turned off (v2.yaml had γ 0.8 over 4 epochs in a 3-epoch run: γ >= 0.9 throughout)."""
    from fastclip.losses.schedules import GammaSchedule

    checked = []
    for name in ("v2.yaml", "v2-revisits.yaml"):
        spec = load(REPO / "benchmarks" / "study" / name)
        (dataset,) = spec.datasets.values()
        for objective in spec.objectives.values():
            if not objective.loss.startswith("fastclip"):
                continue
            last = []
            for setting in objective.settings(spec.batches[0]):
                keys = {**objective.options, **setting}
                kind, low, over = keys["loss.gamma_schedule"], keys["loss.gamma_min"], keys["loss.gamma_decay_epochs"]
                last.append(GammaSchedule(kind, low, over)(dataset.epochs - 1))
            assert min(last) <= 0.5, (name, objective.name, last)
            checked.append((name, objective.name))
    assert len(checked) == 6  # v2's five FastCLIP objectives, v2-revisits' fastclip-v1


def test_run_record_from_metrics_jsonl_is_small(tmp_path):
    """A run's JSON from the trainer's metrics.jsonl (its real key names): the metric, a curve of <= 20 points
    from 30 evaluations (evenly spread, the first and the last kept), rounded floats."""
    spec = load(write_spec(tmp_path))
    run = tune_runs(spec, "d", 32, "base")[0]
    run = dataclasses.replace(run, setting=(("optim.lr", 2.5e-4), ("loss.temperature", 0.07)))  # (rounds to 3e-4)
    folder = tmp_path / "run"
    folder.mkdir()
    lines = []
    for k in range(1, 31):
        lines.append(
            {"step": k, "samples_seen": 32 * k, "loss": 3.0, "samples_per_s": 60.123456, "tau": 0.1 - k / 1000}
        )
        lines.append({"step": k, "samples_seen": 32 * k, "eval/retrieval/image_to_text_R@1": k / 100 + 1e-9,
                      "eval/retrieval/text_to_image_R@1": k / 50, "eval/zeroshot/d/top1": 0.25,
                      "eval/retrieval/num_samples": 48.0})  # fmt: skip
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    record = runner.result_record(spec, run, folder, tmp_path / "data", 12.345678)
    assert record["final"]["metric"] == pytest.approx(0.5 * (0.30 + 0.60))
    assert record["final"]["zeroshot_top1"] == 0.25 and record["final"]["samples_seen"] == 960
    assert len(record["curve"]) == 20 and record["curve"][-1] == [960, 0.45] and record["curve"][0] == [32, 0.015]
    assert record["wall_s"] == 12.3457 and record["samples_per_s"] == 60.1235
    assert record["final"]["tau"] == 0.07  # where the learned τ went: its last logged value
    assert record["run"]["setting"] == {"optim.lr": 2.5e-4, "loss.temperature": 0.07} and "novel" not in record
    assert {"commit", "code", "dirty"} <= set(record)
    assert len(json.dumps(record, separators=(",", ":"))) < 1500


def test_at_commit_brings_back_no_record_its_commit_tracks(tmp_path):
    """A worktree at an older commit holds that commit's run records, some since moved off the tables here (to
    stale/ or off_grid/): at_commit.sh links the run folders without copying those back; what the worktree made
    (untracked) it keeps."""
    import subprocess

    def git(*args, cwd=REPO):
        done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    wt, old = tmp_path / "wt", "benchmarks/results/study_v2/runs/zz_at_commit_test/old.json"
    new = "benchmarks/results/study_v2/runs/zz_at_commit_test/new.json"
    try:
        git("worktree", "add", "--detach", str(wt), "HEAD")
        (wt / old).parent.mkdir(parents=True)
        (wt / old).write_text("{}")  # tracked at the worktree's commit, absent here
        git("add", "-f", old, cwd=wt)
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a record later moved", cwd=wt)
        (wt / new).write_text("{}")  # made by the worktree, tracked nowhere
        done = subprocess.run(
            ["bash", str(REPO / "benchmarks/study/at_commit.sh"), git("rev-parse", "HEAD", cwd=wt), str(wt)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        assert not (REPO / old).exists() and (REPO / new).read_text() == "{}"
    finally:
        for link in (".venv", "benchmarks/out/study_v2", "benchmarks/out/study_v2_revisits",
                     "benchmarks/results/study_v2/runs", "benchmarks/results/study_v2_revisits/runs"):  # fmt: skip
            if (wt / link).is_symlink():
                (wt / link).unlink()
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)], capture_output=True)
        for path in (REPO / old, REPO / new):
            path.unlink(missing_ok=True)
        if (REPO / new).parent.is_dir():
            (REPO / new).parent.rmdir()


def test_at_commit_makes_a_worktree_with_this_trees_package_and_run_folders(tmp_path):
    """benchmarks/study/at_commit.sh COMMIT DIR: a worktree at COMMIT running this tree's study package, its finished
    runs landing in this tree; a second call refreshes it; a wrong commit or a DIR at another commit is one line."""
    import subprocess

    script = REPO / "benchmarks" / "study" / "at_commit.sh"
    studies = ("study_v2", "study_v2_revisits")
    links = (".venv", *(f"benchmarks/out/{s}" for s in studies), *(f"benchmarks/results/{s}/runs" for s in studies))
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    first = subprocess.run(["git", "-C", str(REPO), "rev-list", "--max-parents=0", "HEAD"], capture_output=True,
                           text=True).stdout.split()[0]  # fmt: skip
    wt = tmp_path / "wt"
    # a user's own study, named on the command line: its folders are linked too (it linked v2's alone, so its runs
    # landed in the worktree)
    import shutil

    mine = write_spec(tmp_path, name="zz_at_commit_mine", results="benchmarks/results/zz_at_commit_mine",
                      work="benchmarks/out/zz_at_commit_mine")  # fmt: skip
    links += ("benchmarks/out/zz_at_commit_mine", "benchmarks/results/zz_at_commit_mine/runs")
    try:
        for _ in range(2):  # made, then refreshed
            done = subprocess.run(["bash", str(script), head, str(wt), str(mine)], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            assert f"{wt}: commit {head[:12]}, code " in done.stdout
            named = done.stdout.split("the runs of ")[-1].split(" land in")[0].split()
            assert {"study_v2", "study_v2_revisits", "zz_at_commit_mine"} <= set(named), done.stdout
        for name in ("plan.py", "runner.py", "v2.yaml"):
            assert (wt / "benchmarks/study" / name).read_bytes() == (REPO / "benchmarks/study" / name).read_bytes()
        for link in links:
            assert (wt / link).is_symlink() and (wt / link).resolve() == (REPO / link).resolve()
        timing = "benchmarks/results/study_v2/timing.json"  # `plan --hours` there prices from this tree's timing
        assert (wt / timing).read_bytes() == (REPO / timing).read_bytes() and (wt / timing).is_symlink()
        for argv, words in (
            ([head[:7] + "zz", str(wt)], ("is no commit of", "name one the tables' runs record")),
            ([first, str(wt)], (f"{wt} is at {head[:12]}, not {first}", "name another DIR")),
            ([head], ("usage: bash benchmarks/study/at_commit.sh COMMIT DIR [SPEC ...]",)),
        ):
            done = subprocess.run(["bash", str(script), *argv], capture_output=True, text=True)
            assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
            assert all(w in done.stderr for w in words), done.stderr
    finally:
        remove_worktree(wt)
        for made in ("benchmarks/out/zz_at_commit_mine", "benchmarks/results/zz_at_commit_mine"):
            shutil.rmtree(REPO / made, ignore_errors=True)


def remove_worktree(wt: Path) -> None:
    """An at_commit.sh worktree gone, its links unlinked first: the folders they name are this tree's."""
    import os
    import subprocess

    links = [wt / ".venv"]
    for folder, dirs, files in os.walk(wt / "benchmarks"):  # (never into a link)
        links += [Path(folder, name) for name in dirs + files]
    for link in links:
        if link.is_symlink():
            link.unlink()
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)], capture_output=True)


def test_the_package_plans_v2_at_the_commit_its_batch_32_runs_record(tmp_path):
    """The batch-32 table runs at its first runs' commit with this tree's package (at_commit.sh): the package must
    load v2 there, whose fastclip predates what the package later learned (2026-12-01: loss_entry, a user's loss,
    was imported from fastclip and `plan` failed there with an ImportError)."""
    import subprocess

    record = next((REPO / "benchmarks/results/study_v2/runs/scenes-semantic/32/dcl").rglob("*.json"), None)
    assert record is not None, "v2's batch-32 dcl records are committed: the table's commit is read from one"
    commit = json.loads(record.read_text())["commit"]
    known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"this clone lacks {commit} (shallow): `git fetch --unshallow` to run it")
    wt = tmp_path / "wt"
    try:
        done = subprocess.run(["bash", str(REPO / "benchmarks/study/at_commit.sh"), commit, str(wt)],
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        done = subprocess.run([sys.executable, "-m", "benchmarks.study", "plan", "benchmarks/study/v2.yaml"],
                              cwd=wt, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0 and done.stdout.startswith("study study_v2: "), done.stderr[-2000:]
        # a loss that is no name of that fastclip's, or not text: one line there too
        for loss, words in (("nope", "unknown loss 'nope'"), (["dcl"], "unknown loss ['dcl']")):
            path = write_spec(tmp_path)
            _objective_change(path, "base2", loss=loss)
            done = subprocess.run([sys.executable, "-m", "benchmarks.study", "plan", str(path)], cwd=wt,
                                  capture_output=True, text=True)  # fmt: skip
            assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr[-2000:]
            assert "objectives.base2.loss" in done.stderr and words in done.stderr, done.stderr
    finally:
        remove_worktree(wt)


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_stop_before_any_run_is_one_line_and_exit_75(tmp_path, signum):
    """A stop while the spec loads and its settings are checked (v2: seconds): one line on stderr, exit 75, no
    traceback; SIGHUP (the terminal closed) is a stop like the others."""
    import signal
    import subprocess

    def plan_stopped_by(signum, ignore_hup: bool):
        def child_signals():  # as a terminal's shell leaves them, or as nohup does
            signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore_hup else signal.SIG_DFL)

        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.study", "plan", "benchmarks/study/v2.yaml"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=child_signals)  # fmt: skip
        # once its handlers are in (SIGTERM's shows in /proc; Python catches SIGINT from its start), inside the
        # imports, load or check_settings (seconds)
        wait_for(lambda: proc.poll() is not None or catches(proc.pid, signal.SIGTERM), 60, "the stop handlers")
        proc.send_signal(getattr(signal, signum))
        out, err = proc.communicate(timeout=60)
        return proc.returncode, out, err

    code, out, err = plan_stopped_by(signum, ignore_hup=False)
    assert code == 75, (code, out, err)
    assert err.strip() == f"python -m benchmarks.study plan: stopped by {signum}", err
    if signum == "SIGHUP":  # under nohup the hangup is ignored: the command goes on to its end
        code, out, err = plan_stopped_by(signum, ignore_hup=True)
        assert code == 0 and out.startswith("study study_v2: ") and not err, (code, err)


def test_a_second_reviews_findings_stay_fixed(tmp_path, capsys):
    """An integer knob at 1 has no step below it (0 is refused by the trainer); zeroshot.json's single-dataset form
    is read as the trainer reads it; data.workers belongs in `train`; 'inf' as text is answered with YAML's .inf;
    a grid of lists of numbers (loss.tau_betas) is a grid; main() in-process leaves the caller's signal handlers."""
    import signal

    from benchmarks.study.plan import step_past

    topk = "loss.hard_negative_topk"
    assert step_past({topk: [1, 2, 4]}, {topk: 1}, topk) is None
    assert step_past({"k": [2, 4, 8]}, {"k": 2}, "k") == {"k": 1}
    single = tmp_path / "zs.json"
    single.write_text(json.dumps({"classnames": ["cat", "dog"], "templates": ["a photo of a {}."]}))
    assert [len(d.classnames) for d in runner.zeroshot_sets(single).values()] == [2]
    assert report.chance(tmp_path) is None  # no zeroshot.json there
    (tmp_path / "zeroshot.json").write_text(single.read_text())
    assert report.chance(tmp_path) == 0.5
    path = write_spec(tmp_path)
    _objective_change(path, "base2", options={"data.workers": 2})
    one_line_error(capsys, main, ["plan", str(path)], "options.data.workers", "set data.workers in the spec's `train`")
    grid = {"optim.lr": ["inf", 5e-4], "loss.temperature": [0.07, 0.1]}
    path = write_spec(tmp_path)
    _objective_change(path, "base2", grid=grid)
    one_line_error(capsys, main, ["plan", str(path)], "'inf' is text", "write .inf")
    spec = load(write_spec(tmp_path))
    raw = json.loads(spec.path.read_text())
    raw["objectives"]["base2"]["grid"] = {"optim.lr": [1e-3, 5e-4], "loss.queue_size": [[1], [2]]}
    spec.path.write_text(json.dumps(raw))
    assert load(spec.path).objectives["base2"].settings(32)[0] == {"optim.lr": 1e-3, "loss.queue_size": [1]}
    before = signal.getsignal(signal.SIGTERM)
    assert main(["plan", str(write_spec(tmp_path))]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_at_commit_refuses_in_one_line_when_it_cannot_list_the_specs(tmp_path):
    """The script's spec listing failing (here: Python told not to put the tree on its path) linked nothing and
    exited 0, so the worktree's runs would land in the worktree; it is one line, status 2."""
    import os
    import subprocess

    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    wt = tmp_path / "wt"
    try:
        done = subprocess.run(
            ["bash", str(REPO / "benchmarks" / "study" / "at_commit.sh"), head, str(wt)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONSAFEPATH": "1"},
        )
        assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
        (line,) = done.stderr.splitlines()
        assert line.startswith("at_commit.sh: could not list the study specs' folders (ModuleNotFoundError"), line
        assert not (wt / "benchmarks" / "out").exists()
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)], capture_output=True)
