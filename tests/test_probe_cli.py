"""Linear probe, kNN and validation loss end to end: a tiny run trained with them at its evaluation, then
`fastclip eval RUN --linear-probe --knn K` on its checkpoint (the same numbers), `fastclip summary`, and the
one-line refusals of bad probe input."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from fastclip.train.config import load_config

from helpers import EMBEDDED, one_line_error, overrides, records

PROBED = ("fashion-mnist", "mnist")  # the tiny embedded data: 40 training and 10 held-out images of each


@pytest.fixture(scope="module")
def probed_run(tiny_embedded, tmp_path_factory):
    from fastclip.train.trainer import train

    run = tmp_path_factory.mktemp("probed") / "run"
    args = overrides(
        tiny_embedded,
        run,
        **{
            "train.max_steps": 4,
            "eval.at_end": "true",
            "eval.linear_probe": "true",
            "eval.knn": "[5, 10]",
        },
    )
    train(load_config(EMBEDDED, args))
    return run


def test_the_trainer_logs_probes_and_validation_loss(probed_run):
    evals = [r for r in records(probed_run) if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [4]
    logged = evals[0]
    for dataset in PROBED:
        for name in (f"linear_probe/{dataset}/top1", f"knn/{dataset}/k5/top1", f"knn/{dataset}/k10/top1"):
            assert 0.0 <= logged[f"eval/{name}"] <= 1.0, name
            assert logged[f"eval/{name}"] * 10 == round(logged[f"eval/{name}"] * 10)  # a count of 10 images
    assert math.isfinite(logged["eval/val_loss"])


def test_eval_cli_gives_the_trainers_numbers_and_summary_shows_them(probed_run, tiny_embedded, capsys):
    from fastclip.eval.cli import main as eval_main
    from fastclip.eval.summary import main as summary_main

    argv = [str(probed_run), "--data", str(tiny_embedded), "--device", "cpu", "--linear-probe", "--knn", "5", "10"]
    assert eval_main(argv) == 0
    out = capsys.readouterr().out
    assert f"training features from {tiny_embedded / 'train'}" in out and "(pre-projection)" in out
    assert "\n\n\n" not in out  # one blank line between the tables
    rows = [json.loads(line) for line in (probed_run / "checkpoints" / "results.jsonl").read_text().splitlines()]
    logged = [r for r in records(probed_run) if "eval/val_loss" in r][0]
    for dataset in PROBED:
        linear = [r for r in rows if r["task"] == "linear_probe" and r["dataset"] == dataset]
        assert len(linear) == 1 and linear[0]["train_samples"] == 40 and linear[0]["num_samples"] == 10
        assert linear[0]["top1"] == logged[f"eval/linear_probe/{dataset}/top1"]
        for k in (5, 10):
            (knn,) = [r for r in rows if r["task"] == "knn" and r["dataset"] == dataset and r["k"] == k]
            assert knn["top1"] == logged[f"eval/knn/{dataset}/k{k}/top1"] and knn["features"] == "pre-projection"
    assert summary_main([str(probed_run)]) == 0
    summary = capsys.readouterr().out
    probe_lines = [line for line in summary.splitlines() if "kNN k=5" in line]
    assert len(probe_lines) == 2 and probe_lines[0].lstrip().startswith("probes     fashion-mnist  linear")


def test_bad_probe_input_is_one_line_exit_2(probed_run, tiny_embedded, tmp_path, capsys):
    from fastclip.eval.cli import main as eval_main

    base = [str(probed_run), "--device", "cpu", "--results", str(tmp_path / "r.jsonl")]
    assert eval_main([*base, "--data", str(tiny_embedded), "--knn", "41"]) == 2
    *progress, err = capsys.readouterr().err.strip().splitlines()  # the passes' progress lines, then the error
    assert [line.split(":")[0] for line in progress] == ["eval", "probe features"], progress
    assert err == (
        "fastclip eval: --knn 41 on 'fashion-mnist': only 40 training features; pass k <= 40 or more training "
        "data (--probe-train, --probe-max-train)"
    )
    # an image folder of one class, no train/ beside it: its own split holds one class
    folder = tmp_path / "one_class"
    (folder / "seven").mkdir(parents=True)
    for i in range(5):
        Image.new("RGB", (28, 28), (30 * i, 0, 0)).save(folder / "seven" / f"{i}.png")
    one_line_error(
        capsys,
        eval_main,
        [*base, "--data", str(folder), "--linear-probe"],
        "probe on 'one_class': its 4 training features hold only class 0; a classifier needs 2 or more classes",
    )
    one_line_error(capsys, eval_main, [*base, "--data", str(folder), "--knn", "0"], "--knn 0: k must be >= 1")
    one_line_error(
        capsys,
        eval_main,
        [*base, "--data", str(folder), "--probe-train", str(tmp_path / "nowhere")],
        "--probe-train",
        "given without --linear-probe or --knn K",
    )
    assert not (tmp_path / "r.jsonl").exists()


def test_a_probe_without_its_training_data_is_refused_before_training(tiny_embedded, tmp_path, capsys):
    from fastclip.train.cli import main as train_main

    args = overrides(tiny_embedded, tmp_path / "run", **{"eval.at_end": "true", "eval.knn": "[5]"})
    args += ["--eval.probe_train", str(tmp_path / "missing")]
    one_line_error(
        capsys, train_main, ["--config", str(EMBEDDED), *args], "config key 'eval.probe_train'", "does not exist"
    )


def test_eval_on_the_runs_own_training_shards_says_so_and_summary_does_not_call_them_held_out(
    probed_run, tiny_embedded, tmp_path, capsys
):
    """`fastclip eval RUN --data <its data.train>` scored training images, and summary called them held-out. A note
    says so, the records carry held_out false, and summary says training images; held-out data says nothing."""
    import shutil

    from fastclip.eval.cli import main as eval_main
    from fastclip.eval.summary import main as summary_main

    run = shutil.copytree(probed_run, tmp_path / "run")  # its own results file: the module's run keeps its own
    results = run / "checkpoints" / "results.jsonl"
    results.unlink(missing_ok=True)
    base = [str(run), "--device", "cpu"]
    assert (
        eval_main([*base, "--data", str(tiny_embedded / "train"), "--classnames", str(tiny_embedded / "zeroshot.json")])
        == 0
    )
    err = capsys.readouterr().err
    assert f"fastclip eval: note: --data {tiny_embedded / 'train'} holds shards this run trained on" in err
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert rows and all(r["held_out"] is False for r in rows)
    # the data's own class names given as a flag are no variant: nothing recorded (summary would set it aside)
    assert all("classnames" not in r and "templates" not in r for r in rows)
    assert eval_main([*base, "--data", str(tiny_embedded / "val")]) == 0
    assert "trained on" not in capsys.readouterr().err
    assert "held_out" not in json.loads(results.read_text().splitlines()[-1])

    assert summary_main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "training images of" in out and "held-out images of" in out, out
    # a model.pt copied out of its run folder says what it trained on itself (only the run's config.yaml was read)
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(sorted((run / "checkpoints").glob("step_*"))[-1] / "model.pt", loose / "model.pt")
    names = ["--classnames", str(tiny_embedded / "zeroshot.json")]
    assert eval_main([str(loose / "model.pt"), "--device", "cpu", "--data", str(tiny_embedded / "train"), *names]) == 0
    assert "holds shards this run trained on" in capsys.readouterr().err
    rows = [json.loads(line) for line in (loose / "results.jsonl").read_text().splitlines()]
    assert rows and all(r["held_out"] is False for r in rows)


def test_remote_training_data_is_not_fetched_to_compare_with_the_evaluated(tiny_embedded, tmp_path):
    """The held-out check reads the run's data.train: a remote one (pipe:, s3://, http) is not fetched for it."""
    from fastclip.eval.cli import training_overlap

    marker = tmp_path / "fetched"
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    shard = sorted((tiny_embedded / "train").glob("*.tar"))[0]
    spec = f"pipe:touch {marker} && cat {shard}"  # its manifest: the same command on manifest.json
    (run / "config.yaml").write_text(f"data:\n  train: '{spec}'\n")
    assert training_overlap(run / "checkpoints" / "step_00000001" / "model.pt", tiny_embedded / "val") is None
    assert not marker.exists()


def test_eval_appends_its_records_before_the_report_and_after_a_torn_line(probed_run, tiny_embedded, tmp_path):
    """`fastclip eval ... | head -1`: the reader leaves before the report, and the records were lost (they were
    written after it; helper-59). A results file whose last line a killed writer tore keeps that one bad line: the
    new records start on their own (the first was glued onto it, unreadable)."""
    import os
    import subprocess
    import sys

    results = tmp_path / "results.jsonl"
    good = {"task": "zeroshot", "checkpoint": "earlier", "dataset": "d", "top1": 0.5}
    results.write_text(json.dumps(good) + '\n{"task": "zeroshot", "checkp')  # its writer killed mid-line
    cmd = [sys.executable, "-m", "fastclip", "eval", str(probed_run), "--device", "cpu"]
    # a reader that left before the report (`| head -1` of a longer output): the report's first line meets EPIPE
    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = subprocess.Popen([*cmd, "--data", str(tiny_embedded / "val"), "--results", str(results)],
                            stdout=write_end, stderr=subprocess.PIPE)  # fmt: skip
    os.close(write_end)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 141, err.decode()  # 128 + SIGPIPE, as `yes | head -1`
    lines = results.read_text().splitlines()
    assert json.loads(lines[0]) == good and lines[1] == '{"task": "zeroshot", "checkp' and len(lines) > 2
    assert all(json.loads(line)["checkpoint"] == str(probed_run / "checkpoints" / "step_00000004" / "model.pt")
               for line in lines[2:])  # fmt: skip


def test_sigterm_during_eval_is_one_line(probed_run, tiny_embedded, tmp_path):
    """SIGTERM (a cluster's time limit, scancel) during the pass: one line saying nothing was appended, status 143
    (it ended with no word, status 143; export says its stop so)."""
    import signal
    import subprocess
    import sys

    from helpers import catches, wait_for

    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "fastclip", "eval", str(probed_run), "--device", "cpu", "--batch-size", "1"]
    proc = subprocess.Popen([*cmd, "--data", str(tiny_embedded / "train"), "--results", str(results)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for(lambda: proc.poll() is not None or catches(proc.pid, signal.SIGTERM), 120, "eval's stop handlers")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    said = [line for line in err.splitlines() if not line.startswith(("eval: ", "fastclip eval: note:"))]
    assert proc.returncode == 143 and len(said) == 1, (proc.returncode, err)
    if results.exists():  # the signal came after the pass (a slow start here, a fast pass): it says so
        assert said[0] == f"fastclip eval: stopped by SIGTERM after appending its records to {results}"
    else:
        assert said[0] == "fastclip eval: stopped by SIGTERM before its records were appended (nothing written)"


def test_eval_of_a_run_whose_newest_model_file_is_torn_names_the_step_before(
    probed_run, tiny_embedded, tmp_path, capsys
):
    """`fastclip eval RUN` where the newest step's model.pt was cut short: the one line names the step folder before
    it (it said "pass another checkpoint" alone); the torn file named directly is refused without that advice."""
    import shutil

    from fastclip.eval.cli import main as eval_main

    run = shutil.copytree(probed_run, tmp_path / "run")
    steps = sorted(p for p in (run / "checkpoints").glob("step_*") if (p / "model.pt").is_file())
    newest = steps[-1] / "model.pt"
    newest.write_bytes(newest.read_bytes()[:50_000])
    args = ["--device", "cpu", "--data", str(tiny_embedded / "val")]
    for given, advice in ((run, f"; the step folder before it: {steps[-2]}"), (newest, None)):
        assert eval_main([str(given), *args]) == 2
        said = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("eval: ")]
        assert len(said) == 1 and str(newest) in said[0] and "truncated" in said[0], said
        assert said[0].endswith(advice) if advice else "before it" not in said[0], said


def test_ctrl_c_after_the_records_are_appended_says_so(probed_run, tiny_embedded, tmp_path, capsys, monkeypatch):
    """Ctrl-C while the report prints: the records are in, and the line says so, status 130 (it said "interrupted"
    alone, as when nothing was written); another class-names file than the data's own is recorded as a variant."""
    from fastclip.eval import cli as eval_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_cli, "_print_report", interrupted)
    results = tmp_path / "results.jsonl"
    names = tmp_path / "names.json"
    names.write_text((tiny_embedded / "zeroshot.json").read_text())
    args = [str(probed_run), "--device", "cpu", "--data", str(tiny_embedded / "val"), "--results", str(results)]
    assert eval_cli.main([*args, "--classnames", str(names)]) == 130
    said = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("eval: ")]
    assert said == [f"fastclip eval: interrupted after appending its records to {results}"], said
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert rows and all(r["classnames"] == str(names) for r in rows if r["task"] == "zeroshot")
