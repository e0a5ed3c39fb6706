"""`fastclip summary` and `fastclip plot` given a run folder, file or --out that is wrong: one line on stderr naming
the file or flag and what to do, status 2, never a traceback; a field the summary only shows may be missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastclip.cli import main as fastclip_main
from fastclip.train.config import dump_config, load_config

from helpers import one_line_error

REPO = Path(__file__).resolve().parents[1]
NO_HELD_OUT = ["--data.val", "null", "--data.zeroshot", "null"]  # with data of our own: else a note
TRAIN_ROW = {"step": 5, "samples_seen": 80, "loss": 0.6, "samples_per_s": 100.0, "step_time": 0.2}


def _run(root: Path, rows: list[dict] = (TRAIN_ROW,)) -> Path:
    """A run folder as the trainer leaves it: its resolved config.yaml and metrics.jsonl."""
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    cfg = load_config(REPO / "configs" / "embedded.yaml", ["--data.train", str(root / "shards"), *NO_HELD_OUT])
    (run / "config.yaml").write_text(dump_config(cfg))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


# ----------------------------------------------------------------------------- summary: config.yaml
@pytest.mark.parametrize(
    "text, holds",
    [("", "holds nothing"), ("- model\n- loss\n", "holds a list"), ("fastclip-v3\n", "holds a single value")],
)
def test_summary_refuses_a_config_that_is_not_a_mapping(text, holds, tmp_path, capsys):
    run = _run(tmp_path)
    (run / "config.yaml").write_text(text)
    assert one_line_error(capsys, fastclip_main, ["summary", str(run)], stdout_empty=True) == (
        f"fastclip summary: {run / 'config.yaml'}: {holds} instead of the run's settings (model, loss, data, ...); "
        "pass the folder fastclip train wrote"
    )


def test_summary_shows_settings_and_samples_it_lacks_as_a_dash(tmp_path, capsys):
    """The config's settings and samples_seen are only shown: a config without `data` and a log without
    samples_seen still summarize the steps and time."""
    import yaml

    run = _run(tmp_path, [{k: v for k, v in TRAIN_ROW.items() if k != "samples_seen"}])
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    del cfg["data"]
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert fastclip_main(["summary", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[1:4] == [
        "  trained    fastclip-v3 on tiny-vit (random init), –",
        "             5 steps, – samples, batch – per process",
        "  time       1 s training, median 100 samples/s",
    ]


# ----------------------------------------------------------------------------- summary: metrics.jsonl
@pytest.mark.parametrize(
    "field, value, said",
    [("step", "3", 'step is "3", not a count'), ("samples_per_s", "fast", 'samples_per_s is "fast", not a number')],
)
def test_summary_names_the_metrics_line_with_a_field_of_the_wrong_type(field, value, said, tmp_path, capsys):
    run = _run(tmp_path, [TRAIN_ROW, {**TRAIN_ROW, "step": 10, field: value}])
    assert one_line_error(capsys, fastclip_main, ["summary", str(run)], stdout_empty=True) == (
        f"fastclip summary: {run / 'metrics.jsonl'}:2: {said}; fix or delete that line"
    )


def test_summary_names_a_metrics_file_that_is_not_text(tmp_path, capsys):
    run = _run(tmp_path)
    (run / "metrics.jsonl").write_bytes(b"\xff\xfe" + json.dumps(TRAIN_ROW).encode())
    assert one_line_error(capsys, fastclip_main, ["summary", str(run)], stdout_empty=True) == (
        f"fastclip summary: {run / 'metrics.jsonl'}: not a text file (byte 0 is not UTF-8); "
        "pass the folder fastclip train wrote"
    )


def test_summary_says_metrics_are_missing_or_hold_no_step(tmp_path, capsys):
    run = _run(tmp_path)
    (run / "metrics.jsonl").unlink()
    assert one_line_error(capsys, fastclip_main, ["summary", str(run)], stdout_empty=True) == (
        f"fastclip summary: {run / 'metrics.jsonl'}: missing; pass a run folder that fastclip train has logged "
        "steps into"
    )
    (run / "metrics.jsonl").write_text("")  # the trainer creates it before its first logged step
    assert one_line_error(capsys, fastclip_main, ["summary", str(run)], stdout_empty=True).startswith(
        f"fastclip summary: {run / 'metrics.jsonl'}: no training steps logged (no line with step and loss); "
        "summarize the run once fastclip train has logged one"
    )


# ----------------------------------------------------------------------------- summary: results.jsonl
@pytest.mark.parametrize(
    "row, said",
    [
        ({"step": 5, "dataset": "mnist", "num_samples": 10, "top1": 0.5}, "no task"),
        ({"task": "zeroshot_classification", "dataset": "mnist", "num_samples": 10, "top1": None}, "top1 is null"),
        ({"task": "zeroshot_classification", "num_samples": 10, "top1": 0.5}, "dataset is null, not a name"),
        ({"task": "retrieval", "num_samples": 10, "image_to_text_R@1": 0.5}, "no image_to_text_R@5"),
    ],
)
def test_summary_names_the_results_line_an_evaluation_cannot_have_written(row, said, tmp_path, capsys):
    run = _run(tmp_path)
    good = {"step": 5, "task": "zeroshot_classification", "dataset": "mnist", "num_samples": 10, "top1": 0.5}
    results = run / "checkpoints" / "results.jsonl"
    results.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    err = one_line_error(capsys, fastclip_main, ["summary", str(run)], stdout_empty=True)
    assert err.startswith(f"fastclip summary: {results}:2: {said}") and err.endswith("; fix or delete that line"), err


# ----------------------------------------------------------------------------- plot
def test_plot_refuses_runs_with_nothing_to_plot_and_notes_one_among_others(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    out = tmp_path / "png"
    assert one_line_error(capsys, fastclip_main, ["plot", str(empty), "--out", str(out)], stdout_empty=True) == (
        f"fastclip plot: nothing to plot in {empty / 'metrics.jsonl'} (empty); plot the run once fastclip train "
        "has logged a step (every train.log_every steps)"
    )
    assert not out.exists()  # no blank overview.png
    run = _run(tmp_path)
    assert fastclip_main(["plot", str(empty), str(run), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"wrote {out / 'overview.png'}" in lines
    assert lines[-1] == f"note: nothing to plot in {empty / 'metrics.jsonl'} (empty): left out", lines


def test_plot_refuses_an_empty_out(tmp_path, capsys, monkeypatch):
    run = _run(tmp_path / "a")
    monkeypatch.chdir(tmp_path)  # where an empty --out would write
    assert one_line_error(capsys, fastclip_main, ["plot", str(run), "--out", ""], stdout_empty=True).startswith(
        "fastclip plot: error: argument --out: empty; pass the folder for the PNG files"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, where no folder can be made")
def test_plot_names_an_out_that_cannot_be_created(tmp_path, capsys):
    run = _run(tmp_path)
    err = one_line_error(capsys, fastclip_main, ["plot", str(run), "--out", "/proc/plots"], stdout_empty=True)
    assert err.startswith("fastclip plot: --out /proc/plots: cannot create it (") and err.endswith(
        "); choose another --out"
    ), err


def test_plot_names_a_checkpoint_passed_as_a_run(tmp_path, capsys):
    import torch

    model = tmp_path / "model.pt"
    torch.save({"state_dict": {"w": torch.zeros(4)}}, model)
    err = one_line_error(capsys, fastclip_main, ["plot", str(model), "--out", str(tmp_path / "png")], stdout_empty=True)
    assert err.startswith(f"fastclip plot: {model}: not a metrics.jsonl (") and err.endswith(
        "; pass a run directory or its metrics.jsonl"
    ), err
