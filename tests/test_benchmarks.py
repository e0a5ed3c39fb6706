"""The benchmark programs: their arithmetic, and a smoke run of every program that writes RESULTS.md."""

import dataclasses
import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from fastclip.data.manifest import Manifest, ShardInfo, write_manifest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_e2e  # noqa: E402
import bench_estimator_bias  # noqa: E402
import bench_scaling  # noqa: E402
import bench_stat_eff  # noqa: E402
from bench_stat_eff import Ablation, Run  # noqa: E402

from common import shard_pattern  # noqa: E402


def test_student_t_p_values_holm_and_one_seed_spread():
    # two-sided 5 % and 10 % critical values of Student's t (tables), odd and even degrees of freedom
    for t, dof, p in ((12.706, 1, 0.05), (4.303, 2, 0.05), (2.571, 5, 0.05), (2.015, 5, 0.10), (2.228, 10, 0.05)):
        assert bench_stat_eff.t_two_sided_p(t, dof) == pytest.approx(p, abs=2e-4)
        assert bench_stat_eff.t_two_sided_p(-t, dof) == pytest.approx(p, abs=2e-4)
    assert bench_stat_eff.t_two_sided_p(0.0, 5) == pytest.approx(1.0)
    assert math.isnan(bench_stat_eff.t_two_sided_p(math.nan, 5))  # not "highly significant"
    assert bench_stat_eff.holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])
    assert bench_stat_eff._mean_std([0.5]) == (0.5, None)  # one seed: no spread, not a spread of 0
    assert bench_stat_eff._fmt((0.5, None)) == "50.0 (one seed)"
    assert bench_stat_eff._fmt((0.5, 0.01)) == "50.0 ± 1.0"


def test_stat_eff_pools_each_seed_over_the_batch_sizes():
    def group(gb, seeds, diffs):
        paired = (sum(diffs) / len(diffs), 0.1, diffs)
        against = {"v3_minus_baseline_paired": paired, "by_seed": [{"seed": s} for s in seeds]}
        return {"dataset": "scenes", "global_batch": gb, "against": {"openclip": against}}

    groups = [group(32, (1, 2, 3), [0.1, 0.2, 0.3]), group(64, (1, 2, 3, 4), [0.3, 0.0, 0.5, 9.0])]
    n, (mean, std, per_seed) = bench_stat_eff._pooled_over_batches(groups, "scenes", "openclip")
    assert n == 2 and per_seed == pytest.approx([0.2, 0.1, 0.4])  # seed 4 is not in every group
    assert mean == pytest.approx(0.7 / 3) and std == pytest.approx(0.152753, rel=1e-5)
    assert bench_stat_eff._pooled_over_batches(groups[:1], "scenes", "openclip") is None  # one batch size


def test_stat_eff_report_without_runs_is_a_usage_error(tmp_path, capsys):
    assert bench_stat_eff.main(["--report", "--out", str(tmp_path)]) == 2
    assert f"no runs under {tmp_path / 'stat_eff' / 'runs'}" in capsys.readouterr().err


def test_stat_eff_quick_report_keeps_the_runs_it_reports(tmp_path, capsys):
    """--quick starts its smoke study over, but --quick --report reads what is there (it deleted it first); a file
    the study did not write is named and left out."""
    runs = tmp_path / "stat_eff_quick" / "runs"
    runs.mkdir(parents=True)
    (runs / "x.json").write_text("{}")
    assert bench_stat_eff.main(["--quick", "--report", "--out", str(tmp_path)]) == 0
    assert (runs / "x.json").exists() and "x.json: not a run of this study" in capsys.readouterr().err


def test_stat_eff_pack_moves_the_run_files_into_one_archive_read_as_they_were(tmp_path, capsys):
    """--pack: every readable run file into runs.jsonl.gz (a torn one stays, named), read back equal; packing again
    with the same runs writes the same bytes; a file wins over the packed run of its id."""
    results = tmp_path / "stat_eff"
    (results / "runs").mkdir(parents=True)
    runs = [Run("scenes", 32, "openclip", lr, "temperature", 0.07, 0, "tune", 0.8) for lr in (1e-3, 2e-3)]
    records = [
        {"id": r.id, "run": dataclasses.asdict(r), "final_score": s, "tau": [[0, 0.07]]}
        for r, s in zip(runs, (0.25, 0.5))
    ]
    for record in records:
        (results / "runs" / f"{record['id']}.json").write_text(json.dumps(record, indent=1))
    (results / "runs" / "torn.json").write_text('{"id": "to')
    (results / "runs" / "list.json").write_text("[1, 2]")  # JSON, not a run's record
    assert bench_stat_eff.pack_results(results) == 2
    err = capsys.readouterr().err
    assert "torn.json: not packed (" in err and "list.json: not packed (not a run record" in err
    assert sorted(p.name for p in (results / "runs").iterdir()) == ["list.json", "torn.json"]
    assert [bench_stat_eff.load_result(results, r) for r in runs] == records
    packed = (results / "runs.jsonl.gz").read_bytes()
    (results / "runs" / "torn.json").unlink()
    (results / "runs" / "list.json").unlink()
    assert bench_stat_eff.pack_results(results) == 2 and (results / "runs.jsonl.gz").read_bytes() == packed
    assert not (results / "runs").exists()
    newer = dict(records[0], final_score=0.75)
    (results / "runs").mkdir()
    (results / "runs" / f"{runs[0].id}.json").write_text(json.dumps(newer))
    assert [r for _, r in bench_stat_eff.stored_results(results)] == [newer, records[1]]
    assert bench_stat_eff.load_result(results, runs[0]) == newer


def test_samples_to_reach_interpolates_and_reports_never():
    curve = [(100, 0.2), (200, 0.4), (300, 0.5)]
    assert bench_stat_eff.samples_to_reach(curve, 0.3) == pytest.approx(150)
    assert bench_stat_eff.samples_to_reach(curve, 0.1) == pytest.approx(100)  # nothing assumed before the first point
    assert bench_stat_eff.samples_to_reach(curve, 0.5) == pytest.approx(300)
    assert bench_stat_eff.samples_to_reach(curve, 0.51) is None
    spiky = [(100, 0.6), (200, 0.2), (300, 0.4), (400, 0.5)]  # the early spike does not count: reached at 350
    assert bench_stat_eff.samples_to_reach(spiky, 0.45) == pytest.approx(350)
    assert bench_stat_eff.samples_to_reach(spiky, 0.55) is None


def test_stat_eff_plan_seeds_the_best_setting_and_ablations_carry_lr_tau(tmp_path):
    study = dict(
        bench_stat_eff.STUDY,
        order=[("glyphs", 128)],
        lrs=(1e-3, 2e-3),
        extra_lrs={},
        seeds=(1, 2, 3, 4),
        variant_seeds=(1, 2),
        knobs={k: bench_stat_eff.STUDY["knobs"][k] for k in ("openclip", "fastclip-v3", "fastclip-v1")},
        knob_edges={},
        ablations=[Ablation(Run("glyphs", 128, "fastclip-v3", 2e-3, "rho_frac", 0.6, 0, "tune", 0.8, 1e-2), (1,))],
    )
    (tmp_path / "runs").mkdir()
    before = bench_stat_eff.plan(study, tmp_path)
    assert [r.phase for r in before].count("seed") == 1  # only the ablation's: no loss has finished tuning
    ablation = before[1]
    assert ablation.id == "glyphs_gb128_fastclip-v3_lr0.002_rho_frac0.6_g0.8_lt0.01_s1_seed"
    args = bench_stat_eff.loss_args(ablation, study)
    assert args[args.index("--optim.lr_tau") + 1] == "0.01"
    for loss in ("openclip", "fastclip-v3", "fastclip-v1"):  # every tuning run done, the best at lr 2e-3
        for run in bench_stat_eff.tune_runs(study, "glyphs", 128, loss):
            score = run.lr + (run.value == bench_stat_eff.STUDY["knobs"][loss][1][-1])
            (tmp_path / "runs" / f"{run.id}.json").write_text(json.dumps({"final_score": score}))
    seeds = [r for r in bench_stat_eff.plan(study, tmp_path) if r.phase == "seed" and r.lr_tau is None]
    by_loss = {loss: [(r.seed, r.lr, r.value) for r in seeds if r.loss == loss] for loss in study["knobs"]}
    assert by_loss["openclip"] == [(s, 2e-3, 0.03) for s in (1, 2, 3, 4)]  # the headline pair: all seeds
    assert by_loss["fastclip-v3"] == [(s, 2e-3, 0.85) for s in (1, 2, 3, 4)]
    assert by_loss["fastclip-v1"] == [(s, 2e-3, 0.03) for s in (1, 2)]  # the other variants: variant_seeds


def test_stat_eff_plan_runs_the_headline_losses_then_variants_first_through_every_dataset_before_the_rest(tmp_path):
    study = dict(
        bench_stat_eff.STUDY,
        order=[("scenes", 64), ("scenes", 32), ("glyphs", 64)],
        lrs=(1e-3,),
        extra_lrs={},
        headline=("openclip",),
        knobs={k: bench_stat_eff.STUDY["knobs"][k] for k in ("openclip", "fastclip-v1")},
        ablations=[],
    )
    (tmp_path / "runs").mkdir()

    def order():  # (data set, batch, loss) in the order the plan first names them
        return list(dict.fromkeys((r.dataset, r.global_batch, r.loss) for r in bench_stat_eff.plan(study, tmp_path)))

    assert order() == [
        ("scenes", 64, "openclip"),
        ("scenes", 32, "openclip"),
        ("glyphs", 64, "openclip"),
        ("scenes", 64, "fastclip-v1"),
        ("scenes", 32, "fastclip-v1"),
        ("glyphs", 64, "fastclip-v1"),
    ]
    # variants_first: those variants through every group before the other variants
    study["knobs"] = {k: bench_stat_eff.STUDY["knobs"][k] for k in ("openclip", "fastclip-v1", "fastclip-tempnet")}
    study["variants_first"] = ("fastclip-tempnet",)
    assert [key for key in order() if key[2] != "openclip"] == [
        ("scenes", 64, "fastclip-tempnet"),
        ("scenes", 32, "fastclip-tempnet"),
        ("glyphs", 64, "fastclip-tempnet"),
        ("scenes", 64, "fastclip-v1"),
        ("scenes", 32, "fastclip-v1"),
        ("glyphs", 64, "fastclip-v1"),
    ]


def test_stat_eff_seed_crossing_runs_the_chosen_setting_with_the_data_seed_crossed(tmp_path):
    crossing = bench_stat_eff.SeedCrossing("scenes", 64, ("openclip",), ((1, 3), (3, 1)))
    study = dict(
        bench_stat_eff.STUDY,
        order=[("scenes", 64)],
        lrs=(1e-3,),
        extra_lrs={},
        seeds=(1, 3),
        knobs={"openclip": ("temperature", (0.07,))},
        knob_edges={},
        ablations=[],
        seed_crossings=[crossing],
    )
    (tmp_path / "runs").mkdir()
    assert bench_stat_eff.crossing_runs(study, tmp_path) == []  # nothing chosen yet

    def write(run, test, train):
        rec = {"retrieval/image_to_text_R@1": test, "retrieval/text_to_image_R@1": test}
        curve = [{"samples_seen": 640, **rec}]
        out = {"id": run.id, "run": {"phase": run.phase}, "final_score": test, "final": rec, "curve": curve}
        out.update(tau=[], train={k: train for k in rec})
        (tmp_path / "runs" / f"{run.id}.json").write_text(json.dumps(out))

    (grid,) = bench_stat_eff.tune_runs(study, "scenes", 64, "openclip")
    write(grid, 0.5, 0.6)
    runs = bench_stat_eff.crossing_runs(study, tmp_path)
    assert [(r.seed, r.data_seed, r.phase, r.lr, r.value) for r in runs] == [
        (1, 3, "seed", 1e-3, 0.07),
        (3, 1, "seed", 1e-3, 0.07),
        (1, None, "seed", 1e-3, 0.07),  # the diagonal: the loss's own seed runs
        (3, None, "seed", 1e-3, 0.07),
    ]
    assert runs[0].id == "scenes_gb64_openclip_lr0.001_temperature0.07_s1_d3_seed"
    cmd = bench_stat_eff.command(runs[0], study, _manifest(tmp_path), tmp_path / "r")
    assert cmd[cmd.index("--train.seed") + 1] == "1" and cmd[cmd.index("--data.seed") + 1] == "3"
    seed_run = dataclasses.replace(grid, seed=1, phase="seed")
    assert "--data.seed" not in bench_stat_eff.command(seed_run, study, _manifest(tmp_path), tmp_path / "r")
    assert {r.id for r in runs} <= {r.id for r in bench_stat_eff.plan(study, tmp_path)}
    (row,) = bench_stat_eff.crossing_table(study, tmp_path)
    assert row["towers_effect"] is None and row["cells"]["1x3"] is None
    # towers 1 -> 3: +0.02 on data order 1, +0.10 on data order 3 (mean 0.06); data order 1 -> 3: +0.10 on towers
    # 1, +0.18 on towers 3 (mean 0.14)
    for (t, d), test in {(1, 1): 0.40, (1, 3): 0.50, (3, 1): 0.42, (3, 3): 0.60}.items():
        write(dataclasses.replace(grid, seed=t, data_seed=None if t == d else d, phase="seed"), test, test + 0.1)
    (row,) = bench_stat_eff.crossing_table(study, tmp_path)
    assert row["towers_effect"] == pytest.approx(0.06) and row["data_effect"] == pytest.approx(0.14)
    assert not any(r["id"].endswith("_d3_seed") for r in bench_stat_eff.extra_runs(study, tmp_path))
    assert row["cells"]["3x1"] == pytest.approx({"test": 0.42, "train": 0.52})
    text = bench_stat_eff.markdown(
        {
            "summary": bench_stat_eff.summarize(study, tmp_path),
            "seed_crossing": [row],
            "runs_done": 5,
            "runs_planned": 5,
        }
    )
    cells = "1×1: 40.0 (50.0) | 1×3: 50.0 (60.0) | 3×1: 42.0 (52.0) | 3×3: 60.0 (70.0)"
    assert f"| scenes gb64 | openclip | {cells} | +6.0 | +14.0 |" in text
    v3 = dict(
        row, loss="fastclip-v3", cells={k: {"test": v["test"] + 0.05, "train": None} for k, v in row["cells"].items()}
    )
    v3["cells"]["3x1"] = None  # still to run
    text = bench_stat_eff.markdown(
        {
            "summary": bench_stat_eff.summarize(study, tmp_path),
            "seed_crossing": [row, v3],
            "runs_done": 5,
            "runs_planned": 9,
        }
    )
    assert "| scenes gb64 | fastclip-v3 | 1×1: 45.0 | 1×3: 55.0 | 3×1: to run | 3×3: 65.0 | +6.0 | +14.0 |" in text
    assert "- scenes gb64, fastclip-v3 − openclip in each cell (test): 1×1 +5.0, 1×3 +5.0, 3×3 +5.0\n" in text


def test_stat_eff_seed_crossing_pairs_must_come_both_ways_off_the_diagonal():
    with pytest.raises(ValueError, match="both ways"):
        bench_stat_eff.SeedCrossing("scenes", 64, ("openclip",), ((1, 3),))
    with pytest.raises(ValueError, match="off the diagonal"):
        bench_stat_eff.SeedCrossing("scenes", 64, ("openclip",), ((2, 2),))


def _manifest(root: Path) -> Path:
    write_manifest(root / "data" / "train", Manifest(640, [ShardInfo("train-000000.tar", 640, 0, 639)]))
    return root / "data"


def test_stat_eff_edge_run_extends_the_grid_by_one_step_on_the_best_side(tmp_path):
    study = dict(
        bench_stat_eff.STUDY,
        order=[("scenes", 64)],
        lrs=(1e-3, 2e-3),
        extra_lrs={},
        knobs={"openclip": ("temperature", (0.07, 0.03)), "fastclip-v3": ("rho_frac", (0.4, 0.6, 0.85))},
        knob_edges={"openclip": (0.02, 0.1), "fastclip-v3": (0.2, 1.1)},
    )
    (tmp_path / "runs").mkdir()

    def write(run, score):
        (tmp_path / "runs" / f"{run.id}.json").write_text(json.dumps({"final_score": score}))

    grid = bench_stat_eff.tune_runs(study, "scenes", 64, "openclip")
    for run in grid[:-1]:
        write(run, 0.5 + (run.lr == 2e-3) * 0.1 + (run.value == 0.07) * 0.05)  # best: lr 2e-3, τ0 0.07 (the top)
    assert bench_stat_eff.edge_runs(study, tmp_path, "scenes", 64, "openclip") == []  # the grid is not done
    write(grid[-1], 0.4)
    [edge] = bench_stat_eff.edge_runs(study, tmp_path, "scenes", 64, "openclip")
    assert (edge.lr, edge.value, edge.phase, edge.seed) == (2e-3, 0.1, "tune", 0)
    assert bench_stat_eff.chosen(study, tmp_path, "scenes", 64, "openclip") is None  # waits for the edge run
    assert edge.id in {r.id for r in bench_stat_eff.plan(study, tmp_path)}
    write(edge, 0.7)  # one step past the edge wins: chosen
    assert bench_stat_eff.chosen(study, tmp_path, "scenes", 64, "openclip") == edge
    write(edge, 0.6)  # it loses: the grid's best stays
    assert bench_stat_eff.chosen(study, tmp_path, "scenes", 64, "openclip").value == 0.07
    for run in bench_stat_eff.tune_runs(study, "scenes", 64, "fastclip-v3"):  # an interior best: no edge run
        write(run, 0.5 + (run.value == 0.6) * 0.1)
    assert bench_stat_eff.edge_runs(study, tmp_path, "scenes", 64, "fastclip-v3") == []
    assert bench_stat_eff.chosen(study, tmp_path, "scenes", 64, "fastclip-v3").value == 0.6
    tuned = bench_stat_eff.summarize(study, tmp_path)["groups"][0]["tune"]["openclip"]
    assert [(r["lr"], r["temperature"]) for r in tuned][-1] == (2e-3, 0.1)  # the report shows the edge run


def test_stat_eff_edge_steps_go_on_while_each_step_wins(tmp_path):
    study = dict(
        bench_stat_eff.STUDY,
        order=[("scenes", 64)],
        lrs=(1e-3,),
        extra_lrs={},
        headline=("openclip",),
        seeds=(1,),
        knobs={"openclip": ("temperature", (0.07, 0.03))},
        knob_edges={"openclip": ((0.02, 0.01), (0.1, 0.14, 0.2))},
        ablations=[],
        seed_crossings=[],
    )
    (tmp_path / "runs").mkdir()

    def write(run, score):
        record = {"id": run.id, "run": {"phase": run.phase}, "final_score": score, "tau": []}
        (tmp_path / "runs" / f"{run.id}.json").write_text(json.dumps(record))

    def steps():
        return [r.value for r in bench_stat_eff.edge_runs(study, tmp_path, "scenes", 64, "openclip")]

    for run in bench_stat_eff.tune_runs(study, "scenes", 64, "openclip"):
        write(run, 0.5 + (run.value == 0.07) * 0.1)  # best at the grid's top: the steps go up
    first = bench_stat_eff.edge_runs(study, tmp_path, "scenes", 64, "openclip")[0]
    write(first, 0.7)  # τ0 0.1 wins: the next step is planned, and nothing is chosen until it has run
    assert steps() == [0.1, 0.14]
    assert bench_stat_eff.chosen(study, tmp_path, "scenes", 64, "openclip") is None
    assert bench_stat_eff.chosen(study, tmp_path, "scenes", 64, "openclip", provisional=True).value == 0.1
    assert bench_stat_eff.edge_pending(study, tmp_path, "scenes", 64, "openclip")
    seed_of_first = dataclasses.replace(first, seed=1, phase="seed")
    write(seed_of_first, 0.6)  # a seed of the best so far stays in the protocol while the next step is pending
    assert seed_of_first.id not in {r["id"] for r in bench_stat_eff.extra_runs(study, tmp_path)}
    assert seed_of_first.id not in {r.id for r in bench_stat_eff.plan(study, tmp_path)}  # nor is it run again
    second = bench_stat_eff.edge_runs(study, tmp_path, "scenes", 64, "openclip")[1]
    write(second, 0.7)  # a tie is no win: the chain stops and the earlier run stays chosen
    assert steps() == [0.1, 0.14] and not bench_stat_eff.edge_pending(study, tmp_path, "scenes", 64, "openclip")
    assert bench_stat_eff.chosen(study, tmp_path, "scenes", 64, "openclip").value == 0.1
    write(second, 0.8)  # it wins: one step further, then chosen once that one has lost
    assert steps() == [0.1, 0.14, 0.2]
    write(bench_stat_eff.edge_runs(study, tmp_path, "scenes", 64, "openclip")[2], 0.75)
    assert bench_stat_eff.chosen(study, tmp_path, "scenes", 64, "openclip").value == 0.14
    seeds = [r for r in bench_stat_eff.plan(study, tmp_path) if r.phase == "seed"]
    assert [(r.seed, r.value) for r in seeds] == [(1, 0.14)]


def test_stat_eff_edge_run_below_the_grid_decides_the_seeds_and_the_report_keeps_results_meanwhile(tmp_path):
    """The best at the grid's lowest value gets the step below; the seeds follow the edge run once it wins; while it
    is pending the report keeps the grid's best (marked) and its seeds; an ablation with the edge run's id is one run
    of the plan and not listed as outside the protocol."""
    shared = bench_stat_eff.Run("scenes", 64, "fastclip-v3", 1e-3, "rho_frac", 0.4, 0, "tune", 0.8)
    study = dict(
        bench_stat_eff.STUDY,
        order=[("scenes", 64)],
        lrs=(1e-3, 2e-3),
        extra_lrs={},
        seeds=(1, 2),
        headline=("fastclip-v3",),
        knobs={"fastclip-v3": ("rho_frac", (0.6, 0.85))},
        knob_edges={"fastclip-v3": (0.4, 1.1)},
        ablations=[Ablation(shared, ())],
        seed_crossings=[],
    )
    (tmp_path / "runs").mkdir()

    def write(run, score):
        curve = [{"samples_seen": 100, "retrieval/image_to_text_R@1": score, "retrieval/text_to_image_R@1": score}]
        record = {"id": run.id, "run": {"phase": run.phase}, "final_score": score, "tau": []}
        (tmp_path / "runs" / f"{run.id}.json").write_text(json.dumps({**record, "curve": curve, "final": curve[-1]}))

    for run in bench_stat_eff.tune_runs(study, "scenes", 64, "fastclip-v3"):  # best: lr 1e-3, ρ 0.6 (the lowest)
        write(run, 0.5 + (run.lr == 1e-3) * 0.1 + (run.value == 0.6) * 0.05)
    [edge] = bench_stat_eff.edge_runs(study, tmp_path, "scenes", 64, "fastclip-v3")
    assert edge == shared
    planned = [r.id for r in bench_stat_eff.plan(study, tmp_path)]
    assert planned.count(shared.id) == 1 and not any(r.endswith("_seed") for r in planned)
    grid_best = bench_stat_eff.chosen(study, tmp_path, "scenes", 64, "fastclip-v3", provisional=True)
    assert grid_best.value == 0.6
    for seed in (1, 2):  # seeds of the grid's best, run before the edge rule existed
        write(dataclasses.replace(grid_best, seed=seed, phase="seed"), 0.3)
    entry = bench_stat_eff.summarize(study, tmp_path)["groups"][0]["seeds"]["fastclip-v3"]
    assert entry["edge_pending"] and entry["setting"]["rho_frac"] == 0.6 and entry["seeds_done"] == 2
    write(edge, 0.9)  # the step below wins: its seeds are planned, the old ones are outside the protocol
    seeds = [r for r in bench_stat_eff.plan(study, tmp_path) if r.phase == "seed"]
    assert [(r.seed, r.value, r.lr) for r in seeds] == [(1, 0.4, 1e-3), (2, 0.4, 1e-3)]
    outside = {r["id"] for r in bench_stat_eff.extra_runs(study, tmp_path)}
    assert shared.id not in outside
    assert outside == {dataclasses.replace(grid_best, seed=s, phase="seed").id for s in (1, 2)}
    assert "fastclip-v3" not in bench_stat_eff.summarize(study, tmp_path)["groups"][0]["seeds"]  # none run yet


def test_stat_eff_variants_controls_and_baselines(tmp_path):
    """A variant runs its loss with its options under its own id; an ablation is compared with the chosen setting
    of each variant it names; the report sets v3 against every baseline that has seeds."""
    study = dict(
        bench_stat_eff.STUDY,
        order=[("scenes", 64)],
        lrs=(1e-3,),
        extra_lrs={},
        seeds=(1, 2),
        knobs={
            k: bench_stat_eff.STUDY["knobs"][k]
            for k in ("openclip", "fastclip-v3", "openclip-fixed-tau", "fastclip-v1")
        },
        knob_edges={},
        ablations=[
            Ablation(
                Run("scenes", 64, "openclip-fixed-tau", 1e-3, "temperature", 0.07, 0, "tune"),
                (1,),
                against=("openclip", "fastclip-v3"),
            )
        ],  # fmt: skip
        seed_crossings=[],
    )
    fixed = bench_stat_eff.tune_runs(study, "scenes", 64, "openclip-fixed-tau")[0]
    assert fixed.id == "scenes_gb64_openclip-fixed-tau_lr0.001_temperature0.1_s0_tune" and fixed.gamma_min is None
    assert bench_stat_eff.loss_name("openclip-fixed-tau") == "openclip"
    args = bench_stat_eff.loss_args(fixed, study)
    assert args[-2:] == ["--loss.learn_temperature", "false"] and args[args.index("--loss.temperature") + 1] == "0.1"
    sep = bench_stat_eff.Run("scenes", 64, "fastclip-v3-separate", 1e-3, "rho_frac", 0.6, 1, "seed", 0.8)
    assert bench_stat_eff.loss_args(sep, study)[-2:] == ["--loss.separate_temperatures", "true"]
    # every run done: final test R@1 = 0.5 (openclip), 0.6 (fixed τ), 0.7 (v3) after 100 samples, half of it at 50
    (tmp_path / "runs").mkdir()
    final = {"openclip": 0.5, "openclip-fixed-tau": 0.6, "fastclip-v3": 0.7, "fastclip-v1": 0.65}

    def write(run):
        if run.phase == "tune":
            record = {"final_score": run.value}
        else:
            score = final[run.loss] + (0.01 * run.seed if run.loss == "fastclip-v3" else 0.0)
            curve = [
                {"samples_seen": x, "retrieval/image_to_text_R@1": y, "retrieval/text_to_image_R@1": y}
                for x, y in ((50, score / 2), (100, score))
            ]
            record = {"final_score": score, "curve": curve, "final": curve[-1], "tau": []}
            record["train"] = {k: v + 0.1 for k, v in curve[-1].items() if k.startswith("retrieval/")}
        (tmp_path / "runs" / f"{run.id}.json").write_text(json.dumps(record))

    for loss in study["knobs"]:
        for run in bench_stat_eff.tune_runs(study, "scenes", 64, loss):
            write(run)
    for run in bench_stat_eff.plan(study, tmp_path):  # the ablation and the seeds of the chosen settings
        write(run)
    group = bench_stat_eff.summarize(study, tmp_path)["groups"][0]
    assert set(group["against"]) == {"openclip", "openclip-fixed-tau"}
    paired = group["against"]["openclip-fixed-tau"]["v3_minus_baseline_paired"]
    assert paired[2] == pytest.approx([0.11, 0.12])
    # v3 (mean 0.715 at 100 samples, linear from 0) reaches the fixed-τ baseline's 0.6 at 0.6/0.715·100 samples
    assert group["against"]["openclip-fixed-tau"]["v3_speedup"] == pytest.approx(0.715 / 0.6)
    # a variant against each baseline, seed by seed (v1's seeds beyond the study's test seeds are not paired)
    v1 = group["variants_against"]["fastclip-v1"]
    assert set(v1) == {"openclip", "openclip-fixed-tau"} and set(group["variants_against"]) == {"fastclip-v1"}
    assert v1["openclip-fixed-tau"][2] == pytest.approx([0.05, 0.05])
    assert v1["openclip"][0] == pytest.approx(0.15) and v1["openclip"][1] == pytest.approx(0.0)
    rows = group["against"]["openclip"]["by_seed"]  # each seed's test and train-sample scores, side by side
    assert [r["seed"] for r in rows] == [1, 2]
    keys = ("baseline_test", "v3_test", "baseline_train", "v3_train")
    assert [r[k] for r in rows for k in keys] == pytest.approx([0.5, 0.71, 0.6, 0.81, 0.5, 0.72, 0.6, 0.82])
    # seed 1: v3's curve (50, 0.355) -> (100, 0.71) reaches openclip's 0.5 at 50 + 0.145/0.355·50 samples
    assert [r["v3_speedup"] for r in rows] == pytest.approx(
        [100 / (50 + 50 * 0.145 / 0.355), 100 / (50 + 50 * 0.14 / 0.36)]
    )
    text = bench_stat_eff._by_seed_line(rows, "openclip")
    assert "s1 50.0 (60.0) → 71.0 (81.0); s2 50.0 (60.0) → 72.0 (82.0)" in text
    assert "same seed's final openclip score): s1 1.42x, s2 1.44x." in text

    def point(seen, r1):
        return {"samples_seen": seen, "retrieval/image_to_text_R@1": r1, "retrieval/text_to_image_R@1": r1}

    v3_seed = {"curve": [point(50, 0.355), point(100, 0.71)]}
    assert bench_stat_eff.seed_speedup({"final": point(100, 0.8)}, v3_seed, "retrieval_R@1") is None  # not reached
    assert bench_stat_eff.seed_speedup({"final": point(100, 0.71)}, v3_seed, "retrieval_R@1") == pytest.approx(1.0)
    # the baseline's own sample count: trained on 200 samples, it is reached by v3 at 100
    assert bench_stat_eff.seed_speedup({"final": point(200, 0.71)}, v3_seed, "retrieval_R@1") == pytest.approx(2.0)
    assert bench_stat_eff._by_seed_line([{"seed": 4, "v3_speedup": None}], "openclip") == (
        " Fewer samples seed by seed (v3's curve against the same seed's final openclip score): s4 not reached."
    )  # without train scores the ratios are still given
    pairs = bench_stat_eff.ablation_pairs(study, tmp_path)
    assert [p["chosen"].split()[0] for p in pairs] == ["openclip", "fastclip-v3"]
    assert pairs[1]["differences"] == pytest.approx([0.6 + 0.0 - 0.71])  # fixed τ 0.07 (0.6) − v3 seed 1 (0.71)


def test_estimator_bias_is_zero_for_equal_negatives_and_large_when_one_hard_negative_carries_g():
    import torch

    n, d = 256, 16
    # every negative alike (orthogonal features): each batch's estimate equals the global mean exactly
    eye = torch.eye(n, dtype=torch.float64)[:, :n]
    flat = bench_estimator_bias.estimator_errors(eye, eye, 0.1)
    for b in bench_estimator_bias.BATCHES:
        assert abs(flat["batches"][b]["bias"]) < 1e-12 and flat["batches"][b]["std"] < 1e-12
    # pairs of near-copies: anchor 2j's hardest negative is 2j+1; a batch of B holds it with chance (B-1)/(n-1),
    # else the estimate misses almost all of g: E[log ĝ] − log g is far below 0, less so at larger B
    torch.manual_seed(0)
    base = torch.nn.functional.normalize(torch.randn(n // 2, d, dtype=torch.float64), dim=1)
    noise = 1e-3 * torch.randn(n, d, dtype=torch.float64)
    pairs = torch.nn.functional.normalize(base.repeat_interleave(2, dim=0) + noise, dim=1)
    hard = bench_estimator_bias.estimator_errors(pairs, pairs, 0.05)
    assert hard["hard_share"] > 0.99 and flat["hard_share"] == pytest.approx(1 / (n - 1) * max(1, int(0.01 * n)))
    biases = [hard["batches"][b]["bias"] for b in bench_estimator_bias.BATCHES]
    assert biases[0] < biases[1] < biases[2] < -3
    # the near-copy is of the anchor's own class: it carries all of g; over the other classes (orthogonal to the
    # anchor, all alike) every batch's estimate is exact again; captions all distinct: no same-caption share
    pairs = torch.nn.functional.normalize(torch.eye(n // 2, dtype=torch.float64).repeat_interleave(2, dim=0), dim=1)
    pairs = torch.nn.functional.normalize(pairs + 1e-3 * torch.randn(n, n // 2, dtype=torch.float64), dim=1)
    ids = {"caption": torch.arange(n), "class": torch.arange(n) // 2}
    fn = bench_estimator_bias.estimator_errors(pairs, pairs, 0.05, ids=ids)
    assert fn["class_share"] > 0.99 and fn["caption_share"] == 0.0 and fn["class_anchors"] == n
    for b in bench_estimator_bias.BATCHES:
        assert fn["batches"][b]["bias"] < -1 and abs(fn["true_batches"][b]["bias"]) < 1e-3
    # anchors without a class (id -1) are left out of the class columns, not counted as sharing nothing
    ids["class"] = torch.where(torch.arange(n) < n // 2, torch.arange(n) // 2, -1)
    half = bench_estimator_bias.estimator_errors(pairs, pairs, 0.05, ids=ids)
    assert half["class_anchors"] == n // 2 and half["class_share"] > 0.99
    assert all(abs(half["true_batches"][b]["bias"]) < 1e-3 for b in bench_estimator_bias.BATCHES)


def test_estimator_bias_measures_the_moving_average_against_the_global_g(tmp_path):
    import torch

    from fastclip.losses import build_loss

    torch.manual_seed(0)
    n = 256  # at least the largest batch measured
    feats = torch.nn.functional.normalize(torch.randn(n, 8, dtype=torch.float64), dim=1)
    exact = bench_estimator_bias.estimator_errors(feats, feats, 0.1)
    # the global log g, as the measure defines it (mean over the n - 1 negatives, positive excluded)
    d = (feats @ feats.T - (feats * feats).sum(dim=1, keepdim=True)) / 0.1
    log_g = torch.logsumexp(d.fill_diagonal_(float("-inf")), dim=1) - math.log(n - 1)
    # a u off by +0.5 nats on the anchors seen, unseen ones (NaN) left out
    log_u = torch.where(torch.arange(n) < n // 2, log_g + 0.5, float("nan"))
    got = bench_estimator_bias.estimator_errors(feats, feats, 0.1, log_u=log_u)["u"]
    assert got["anchors"] == n // 2
    assert got["bias"] == pytest.approx(0.5, abs=1e-12) and got["rmse"] == pytest.approx(0.5, abs=1e-12)
    assert "u" not in exact
    for b in bench_estimator_bias.BATCHES:  # a mean square holds the square of the mean
        assert exact["batches"][b]["rmse"] >= abs(exact["batches"][b]["bias"]) > 0
    # the state a loss checkpointed, read back whole by data index
    loss = build_loss("fastclip-v3", data_size=10)
    image = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    loss(image, torch.nn.functional.normalize(torch.randn(4, 8), dim=1), torch.tensor([3, 7, 0, 9]), epoch=0)
    step = tmp_path / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    torch.save({"loss_state": loss.state_dict()}, step / "rank_0.pt")
    (step / "model.pt").write_bytes(b"")  # only its place is read
    state = bench_estimator_bias.sample_state(step)
    assert state["seen"].nonzero().reshape(-1).tolist() == [0, 3, 7, 9]
    saved = loss.state_dict()["_extra_state"]["fields"]
    for field in ("log_u_img", "log_u_txt"):
        assert torch.equal(state[field], saved[field])
    torch.save({"loss_state": build_loss("openclip").state_dict()}, step / "rank_0.pt")
    assert bench_estimator_bias.sample_state(step) is None


def test_estimator_bias_during_picks_the_checkpoints_nearest_to_the_epochs(tmp_path):
    # the study's layout at global batch 64 on 6,000 pairs: a checkpoint every 93 steps, 94 steps an epoch, 16 epochs
    for step in [*range(93, 1489, 93), 1504]:
        (tmp_path / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    picked = bench_estimator_bias.checkpoints_at(tmp_path, 16)
    assert [step for _, step, _ in picked] == [93, 186, 372, 744, 1504]
    assert [round(epoch, 2) for epoch, _, _ in picked] == [0.99, 1.98, 3.96, 7.91, 16.0]
    assert all(path.name == f"step_{step:08d}" for _, step, path in picked)
    with pytest.raises(SystemExit, match="no checkpoints"):
        bench_estimator_bias.checkpoints_at(tmp_path / "empty", 16)


def test_ring_costs_and_fit_recover_alpha_and_bandwidth():
    alpha, bw = 50e-6, 2e9
    assert bench_scaling.ring_cost("all_reduce", 1e6, 1, alpha, bw) == 0
    # K=4 all_reduce: 6 steps, 1.5 x n on the wire
    assert bench_scaling.ring_cost("all_reduce", 1e6, 4, alpha, bw) == pytest.approx(6 * alpha + 1.5e6 / bw)
    assert bench_scaling.ring_cost("all_gather", 1e6, 4, alpha, bw) == pytest.approx(3 * alpha + 3e6 / bw)
    assert bench_scaling.ring_cost("reduce_scatter", 4e6, 4, alpha, bw) == pytest.approx(3 * alpha + 3e6 / bw)
    truth = {"all_reduce": (alpha, bw), "all_gather": (2 * alpha, bw / 3)}
    sweep = [
        {"op": op, "bytes": n, "seconds": bench_scaling.ring_cost(op, n, 2, *truth[op])}
        for op in truth
        for n in (1e3, 1e5, 1e7)
    ]
    fit = bench_scaling.fit_collectives(sweep)
    for op, (a, b) in truth.items():
        assert fit["per_op"][op]["alpha_s"] == pytest.approx(a, rel=1e-6)
        assert fit["per_op"][op]["bw_Bps"] == pytest.approx(b, rel=1e-6)
        assert bench_scaling.cost(fit, op, 1e6, 8) == pytest.approx(bench_scaling.ring_cost(op, 1e6, 8, a, b))


def test_model_rows_openclip_moves_more_loss_bytes_than_v3_at_scale():
    rows = bench_scaling.model_rows(dict(bench_scaling.NCCL_IB))
    assert rows[0]["ranks"] == 1 and rows[0]["step_v3_s"] == rows[0]["compute_s"]
    big = rows[-1]
    assert big["loss_comm_openclip_s"] > big["loss_comm_v3_s"] > 0
    assert 0 < big["efficiency_openclip"] <= big["efficiency_v3"] < 1


def test_steady_throughput_parsers_skip_warmup(tmp_path):
    log = tmp_path / "out.log"
    log.write_text(
        "\n".join(
            f"2026 | INFO | Train Epoch: 0 [{seen:>5}/1280 (1%)] Data (t): 0.1 Batch (t): {t}, 1/s, 1/s/gpu LR: 0"
            for seen, t in ((128, 5.0), (640, 9.0), (1280, 0.5))
        )
    )
    # windows: step 1 (warm-up, skipped), steps 1->5 (skipped: starts before step 2), 5->10 at 0.5 s per step
    assert bench_e2e.steady_openclip(log, 128, skip_steps=2) == pytest.approx(128 / 0.5)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"step": 2, "samples_per_s": 10.0},
                {"step": 4, "samples_per_s": 100.0},
                {"step": 4, "eval/x": 1},
                {"step": 8, "samples_per_s": 50.0},
            )
        )
    )
    # after step 2: 2 steps at 100/s and 4 steps at 50/s -> 6 steps in 2/100 + 4/50 units
    assert bench_e2e.steady_ours(metrics, skip_steps=2) == pytest.approx(6 / (2 / 100 + 4 / 50))


def test_e2e_reports_the_held_out_samples_it_scored_not_the_cap():
    params = {"eval_max": 4000}
    assert bench_e2e._eval_samples({"params": params, "rows": [{"eval_samples": 1000}] * 3}) == 1000
    assert bench_e2e._eval_samples({"params": params, "rows": [{}]}) == 4000  # results from before the count


def test_shard_pattern_is_openclip_brace_syntax(tmp_path):
    write_manifest(tmp_path, Manifest(30, [ShardInfo(f"train-{i:06d}.tar", 10, 10 * i, 10 * i + 9) for i in range(3)]))
    assert shard_pattern(tmp_path) == (f"{tmp_path}/train-{{000000..000002}}.tar", 30)


SMOKE_SKIPS = "longrun,loss,engines,tempfree,ssl"


@pytest.mark.timeout(600)  # every benchmark once: ~3 min on 2 idle cores, the suite's longest test
def test_run_all_smoke_writes_results_and_plots():
    """Every program in its --quick form (tiny sizes) but four whose subject other tests run end to end; RESULTS.md
    names the machine and links readable PNGs. Left out: longrun (a kill -9 soak of 2-5 launches; test_faults kills
    at named points of a save and at a random step), loss (test_bench_loss_against_a_revision runs it), engines
    (test_deepspeed, test_accumulate), tempfree (test_train_tempfree_siglip) and ssl (test_train_ssl: its split,
    verdict and paired test; its runs are `fastclip train` and `fastclip eval`)."""
    out = REPO / "benchmarks" / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--smoke", "--skip", SMOKE_SKIPS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,  # 460 s on 2 cores running the rest of the suite beside it, with engines and tempfree
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out / "RESULTS.md").read_text()
    assert "No GPU was available" in report or "GPU:" in report
    for stem in ("e2e", "state_memory", "stat_eff", "scaling"):
        png = out / f"{stem}.png"
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
        assert f"]({stem}.png)" in report
    e2e = json.loads((out / "e2e.json").read_text())
    systems = {s["system"]: s for s in e2e["summary"]}
    assert set(systems) == set(bench_e2e.SYSTEMS)
    for s in systems.values():
        assert s["samples_per_s"] > 0 and s["peak_pss_sum_mb"] > 100 and 0 <= s["zeroshot_mean_top1"] <= 1
    state = json.loads((out / "state_memory.json").read_text())
    for row in state["measured"]:  # each of 2 ranks owns half the ids: never a table of data_size entries
        assert row["owned_samples"] == math.ceil((row["data_size"] - row["rank"]) / 2)
        per = {"fastclip-v3": 9, "fastclip-v2": 41}[row["version"]]
        assert row["shard_tensor_bytes"] == per * row["owned_samples"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_resolves_its_imports_and_refuses_a_machine_without_cuda(tmp_path):
    """benchmarks/gpu_check.sh run, as a GPU session would start it: fastclip, open_clip (through the torchvision
    guard) and OpenCLIP's trainer import; without CUDA it stops with one line and exit 2 before any step."""
    from fastclip.compat import import_open_clip

    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)}
    env["GPU_CHECK_SITE"] = str(tmp_path / "site")  # where it installs .whl/, if this checkout has prepared one
    script = str(REPO / "benchmarks" / "gpu_check.sh")
    run = subprocess.run(["bash", script, "run"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "gpu_check: torch sees no CUDA device: run this on the GPU machine" in run.stdout  # (tee: both streams)
    # everything comes back in one archive (the device tool returns at most 8 files), the stop included
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["gpu_check.tar.gz"]
    with tarfile.open(tmp_path / "out" / "gpu_check.tar.gz") as archive:
        names = {Path(n).name for n in archive.getnames()} - {""}
        env_txt = archive.extractfile("./env.txt").read().decode()
    assert f"| open_clip {import_open_clip().__version__}" in env_txt
    assert names == {"env.txt"}  # stopped before the steps: no step's log
    # a Python without the packages (no site-packages): one line, exit 3
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    missing = subprocess.run(["bash", script, "run"], env=dict(env, PYTHON=str(bare)), capture_output=True, text=True)
    assert missing.returncode == 3, missing.stdout + missing.stderr
    assert "Traceback" not in missing.stdout + missing.stderr and "gpu_check: " in missing.stdout + missing.stderr
    usage = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: bash benchmarks/gpu_check.sh prepare|run")


def test_bench_loss_gpu_agreement_is_float64_close_and_it_refuses_a_machine_without_cuda(capsys):
    """Its agreement check (the part that runs anywhere): fused and autograd within 1e-13 in float64 on this
    device; without CUDA its main is one line and exit 2."""
    import bench_loss_gpu

    for name in ("fastclip-v2", "openclip"):
        worst = bench_loss_gpu.agreement(name, torch.device("cpu"), batch=32, dim=8)
        assert worst.keys() == {"value", "grad_features", "grad_temperature"}
        assert all(0 <= v < 1e-13 for v in worst.values()), (name, worst)
    if not torch.cuda.is_available():
        assert bench_loss_gpu.main([]) == 2
        assert capsys.readouterr().err.strip() == (
            "bench_loss_gpu: torch sees no CUDA device: run this on a GPU machine"
        )


def test_bench_loss_against_a_revision_times_it_step_by_step_and_refuses_a_bad_one(tmp_path):
    """--against REV runs v3 as committed at REV (extracted as another package) interleaved with this tree's: at
    HEAD the code is this tree's (or close to it), so the paired ratio is near 1; a name git does not know is a
    usage error (exit 2, one line naming it)."""
    import bench_loss

    assert bench_loss.main(["--quick", "--reps", "2", "--against", "HEAD", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "loss_bench.json").read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert result["header"]["against"] == head.stdout.strip()
    (row,) = result["rows"]
    assert 0.5 < row["paired_ratio_vs_previous"] < 2.0 and row["previous_ms"] > 0
    assert f"deferred v3 / at {head.stdout.strip()}" in (tmp_path / "loss_bench.md").read_text()
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_loss.py"), "--quick", "--against", "no-such-rev"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--against 'no-such-rev' is not a revision" in proc.stderr.strip().splitlines()[-1]


def test_benchmarks_refuse_an_out_they_cannot_write_before_any_work(tmp_path, capsys):
    """(a FileNotFoundError traceback once the work was done, before)"""
    import bench_loss

    (tmp_path / "a_file").write_text("")
    for module in (bench_loss, bench_stat_eff):
        with pytest.raises(SystemExit) as stopped:
            module.main(["--quick", "--out", str(tmp_path / "a_file" / "out")])
        assert stopped.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.endswith(f"error: --out {tmp_path / 'a_file' / 'out'}: {tmp_path / 'a_file'} is not a folder"), err


def test_benchmarks_refuse_a_count_below_its_minimum(capsys):
    """A count below its minimum is the parser's usage error, before any work (it was taken as given)."""
    import bench_loss
    import bench_scan

    for module, argv, said in (
        (bench_scan, ["--shards", "-3"], "argument --shards: -3 must be >= 1"),
        (bench_loss, ["--reps", "0"], "argument --reps: 0 must be >= 1"),
        (bench_stat_eff, ["--parallel", "x"], "argument --parallel: 'x' is not a whole number"),
    ):
        with pytest.raises(SystemExit) as stopped:
            module.main(argv)
        assert stopped.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(said)


def test_bench_study_gpu_makes_a_small_set_with_the_datasets_own_command_and_prices_a_full_run(tmp_path):
    """bench_study_gpu times the study's own command on a small set made by the dataset's `make` with its split
    sizes cut (train / 10 for the others), and prices a run at the spec's real training size, not the small set's."""
    import bench_study_gpu

    from benchmarks.study import spec as spec_module
    from fastclip.data.manifest import read_manifest

    spec = spec_module.load(REPO / "benchmarks" / "study" / "v2.yaml")
    data = bench_study_gpu.small_data(spec.datasets["scenes-semantic"], tmp_path / "small", train_size=120)
    sizes = {split: read_manifest(data / split).num_samples for split in ("train", "val", "test", "novel")}
    assert sizes == {"train": 120, "val": 12, "test": 12, "novel": 12}, sizes
    assert bench_study_gpu.spec_train_size(spec, "scenes-semantic", data) == 50_000  # the make command's --num-train
    # at 3 epochs of 50,000 at batch 32: the runs' own step count (runner.command's 4,687)
    assert spec.datasets["scenes-semantic"].epochs * 50_000 // 32 == 4_687


def test_bench_probe_saves_what_it_prints(tmp_path, capsys):
    """Well-separated clusters (noise 0.1): the probe and both kNN are exact; the file holds the command and lines."""
    import bench_probe

    out = tmp_path / "probe.md"
    argv = ["--train", "300", "--test", "60", "--dim", "16", "--noise", "0.1", "--out", str(out)]
    assert bench_probe.main(argv) == 0
    text = out.read_text()
    assert "python benchmarks/bench_probe.py --train 300" in text and "300 x 16 training features" in text
    assert "linear probe" in text and "kNN k=20,200" in text and "top-1 100.00%, 100.00%" in text
    assert (
        [line for line in text.splitlines() if line.startswith("linear probe")][0]
        .split("top-1 ")[1]
        .startswith("100.00%")
    )
