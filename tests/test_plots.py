"""`fastclip plot`: PNGs from metrics.jsonl for one or several runs; eval rows placed by samples seen."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from fastclip.eval.plots import load_run, main, plot_runs


def write_run(run_dir, *, speed: float, with_tau: bool = True, eval_samples: bool = False):
    run_dir.mkdir(parents=True)
    rows = []
    for step in range(0, 101, 10):
        row = {"step": step, "samples_seen": step * 64, "loss": 5.0 - speed * step / 50, "objective": 4.0 - step / 60}
        if with_tau:
            row["tau"] = 0.07 - step / 5000
        rows.append(row)
        if step in (50, 100):
            # the trainer logs eval rows as {"step", "eval/<name>"}, usually without samples_seen
            rows.append(
                {
                    "step": step,
                    "eval/zeroshot/mnist/top1": speed * step / 200,
                    "eval/zeroshot/fashion-mnist/top1": step / 300,
                    "eval/zeroshot/mean_top1": 0.5,
                    **({"samples_seen": step * 64} if eval_samples else {}),
                }
            )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plots_for_two_runs(tmp_path, capsys):
    write_run(tmp_path / "a" / "fastclip-v3", speed=1.0)
    write_run(tmp_path / "b" / "fastclip-v3", speed=0.5, with_tau=False)  # same name: labels fall back to paths
    runs = [str(tmp_path / "a" / "fastclip-v3"), str(tmp_path / "b" / "fastclip-v3")]
    assert main([*runs, "--out", str(tmp_path / "png")]) == 0
    names = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert names == ["loss.png", "objective.png", "overview.png", "temperature.png", "zeroshot_top1.png"]
    for name in names:
        with Image.open(tmp_path / "png" / name) as image:
            assert image.format == "PNG" and image.size[0] >= 600
    assert "wrote" in capsys.readouterr().out


def test_eval_rows_are_placed_by_samples_seen(tmp_path):
    write_run(tmp_path / "run", speed=1.0)
    run = load_run(tmp_path / "run")
    xs, ys = run.series("eval/zeroshot/mnist/top1")
    assert xs == [50 * 64.0, 100 * 64.0]  # from the training rows' step -> samples_seen
    assert ys == [0.25, 0.5]
    assert run.series("tau")[0][:2] == [0.0, 640.0]


def test_missing_metric_is_reported_not_drawn(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "samples_seen": 8, "loss": 1.0}) + "\n")
    written = plot_runs([run], tmp_path / "png")
    assert sorted(p.name for p in written) == ["loss.png", "overview.png"]
    assert main([str(run), "--out", str(tmp_path / "png2")]) == 0
    assert "not logged by any run: objective, temperature, zeroshot_top1" in capsys.readouterr().out


def test_bad_metrics_file_names_the_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\n{oops}\n{"step": 2, "loss": 0.5}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: invalid JSON"):
        load_run(run)
    assert main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "png")]) == 2
    assert "no metrics file" in capsys.readouterr().err


def test_an_ssl_runs_knn_is_drawn_in_the_held_out_panel(tmp_path, capsys):
    """An ssl run logs eval/knn_top1 (leave-one-out over data.val): plot said "not logged by any run:
    zeroshot_top1" and drew no curve of it."""
    run = tmp_path / "ssl"
    run.mkdir()
    rows = [{"step": s, "samples_seen": 8 * s, "loss": 1.0 / s} for s in (1, 2, 3)]
    rows += [{"step": 3, "eval/knn_top1": 0.4, "eval/knn_samples": 60}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot_runs([run], tmp_path / "png")
    assert sorted(p.name for p in written) == ["loss.png", "overview.png", "zeroshot_top1.png"]
    assert load_run(run).series("eval/knn_top1") == ([24.0], [0.4])
    # titled for what it holds: a kNN curve under "zero-shot top-1 accuracy" (a fresh-eyes user's run)
    from fastclip.eval.plots import PANELS, panel_title

    (_, title, _, key) = PANELS[-1]
    assert panel_title([load_run(run)], title, key) == "held-out top-1 accuracy"
    write_run(tmp_path / "clip", speed=1.0)
    assert panel_title([load_run(tmp_path / "clip")], title, key) == "zero-shot top-1 accuracy"
