"""Checkpoints and evaluations by epochs (checkpoint.every_epochs, eval.every_epochs: OpenCLIP's --save-frequency,
--val-frequency and --zeroshot-frequency), one process in this one, on the tiny embedded data: 80 training
samples in batches of 8, so an epoch is 10 steps."""

from __future__ import annotations

from pathlib import Path

from fastclip.train.cli import main
from fastclip.train.preemption import EXIT_PREEMPTED

from helpers import EMBEDDED, fault_overrides, records

EPOCH = 10  # steps


def _run(data: Path, run: Path, *flags: str, **extra) -> int:
    settings = {
        "train.epochs": 3,
        "checkpoint.every_steps": 0,
        "checkpoint.every_minutes": 0,
        "data.val": data / "val",
        "data.zeroshot": data / "zeroshot.json",
        "eval.every_steps": 0,
        "eval.max_samples": 16,
        "eval.val_loss": False,
        **extra,
    }
    return main(["--config", str(EMBEDDED), *fault_overrides(data, run, "dcl", **settings), *flags])


def _evaluated(run: Path) -> list[int]:
    return [r["step"] for r in records(run) if any(k.startswith("eval/") for k in r)]


def _saved(run: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))


def test_openclip_epoch_frequencies_save_and_evaluate_at_those_epochs_ends(tiny_embedded, tmp_path):
    ends = {"eval.at_end": False, "checkpoint.at_end": False}
    assert _run(tiny_embedded, tmp_path / "none", **ends) == 0
    assert _evaluated(tmp_path / "none") == [] and _saved(tmp_path / "none") == []  # the same run without them
    flags = ["--save-frequency", "1", "--zeroshot-frequency", "2", "--val-frequency", "2"]
    assert _run(tiny_embedded, tmp_path / "run", *flags, **ends) == 0
    assert _saved(tmp_path / "run") == [EPOCH, 2 * EPOCH, 3 * EPOCH]
    assert _evaluated(tmp_path / "run") == [2 * EPOCH]  # the third epoch is no multiple of 2; at_end is off


def test_the_last_epochs_evaluation_is_made_once_with_at_end(tiny_embedded, tmp_path):
    run = tmp_path / "run"
    assert _run(tiny_embedded, run, **{"eval.every_epochs": 1, "eval.at_end": True}) == 0
    assert _evaluated(run) == [EPOCH, 2 * EPOCH, 3 * EPOCH]  # the end's once, not twice
    run = tmp_path / "no_end"
    assert _run(tiny_embedded, run, **{"eval.every_epochs": 1, "eval.at_end": False}) == 0
    assert _evaluated(run) == [EPOCH, 2 * EPOCH, 3 * EPOCH]  # the last epoch's by its cadence


def test_a_finished_run_called_again_resumes_at_its_end_without_evaluating_it_twice(tiny_embedded, tmp_path):
    """The quickstart's "run again": a finished run (checkpoint and evaluation at its last step) called again with
    --train.resume latest trains nothing and logs no second evaluation of that step; a run whose final evaluation
    is missing from its log (a crash in it, after the save) gets it then."""
    run, again = tmp_path / "run", {"eval.at_end": True, "train.resume": "latest"}
    assert _run(tiny_embedded, run, **{"eval.at_end": True}) == 0
    assert _evaluated(run) == [3 * EPOCH] and _saved(run) == [3 * EPOCH]
    assert _run(tiny_embedded, run, **again) == 0
    assert _evaluated(run) == [3 * EPOCH]  # once (it was twice)
    log = run / "metrics.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines() if '"eval/' not in line))
    assert _run(tiny_embedded, run, **again) == 0
    assert _evaluated(run) == [3 * EPOCH]


def test_a_stop_at_an_epochs_end_is_evaluated_by_the_resume(tiny_embedded, tmp_path, monkeypatch):
    """A stop signal at the step that ends epoch 1 checkpoints there without evaluating; the resume evaluates that
    step first, so the run logs the evaluations of one never stopped. A stop mid-epoch owes none."""
    straight = tmp_path / "straight"
    cadence = {"eval.every_epochs": 1, "eval.at_end": True}
    assert _run(tiny_embedded, straight, **cadence) == 0
    expected = [r for r in records(straight) if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in expected] == [EPOCH, 2 * EPOCH, 3 * EPOCH]
    for stop in (EPOCH, EPOCH + 5):
        run = tmp_path / f"run{stop}"
        monkeypatch.setenv("FASTCLIP_FAULTS", f"usr1@batch:step={stop}")
        assert _run(tiny_embedded, run, **cadence) == EXIT_PREEMPTED
        assert _saved(run) == [stop] and _evaluated(run) == [EPOCH] * (stop > EPOCH)
        monkeypatch.delenv("FASTCLIP_FAULTS")
        assert _run(tiny_embedded, run, **cadence, **{"train.resume": "latest"}) == 0
        assert [r for r in records(run) if any(k.startswith("eval/") for k in r)] == expected


def test_the_last_steps_evaluation_by_either_cadence_is_owed_and_made_without_at_end(
    tiny_embedded, tmp_path, monkeypatch
):
    """With eval.at_end false the last step is the cadences' own: evaluated by steps as by epochs, and after a stop
    there, by the resume (it was lost for good: the resume skipped it as the last step)."""
    for cadence in ({"eval.every_steps": EPOCH}, {"eval.every_epochs": 1}):
        run = tmp_path / f"straight{len(cadence)}{next(iter(cadence))}"
        assert _run(tiny_embedded, run, **cadence, **{"eval.at_end": False}) == 0
        assert _evaluated(run) == [EPOCH, 2 * EPOCH, 3 * EPOCH], cadence
    run = tmp_path / "stopped"
    monkeypatch.setenv("FASTCLIP_FAULTS", f"usr1@batch:step={3 * EPOCH}")
    assert _run(tiny_embedded, run, **{"eval.every_epochs": 1, "eval.at_end": False}) == EXIT_PREEMPTED
    monkeypatch.delenv("FASTCLIP_FAULTS")
    assert _evaluated(run) == [EPOCH, 2 * EPOCH]
    assert _run(tiny_embedded, run, **{"eval.every_epochs": 1, "eval.at_end": False, "train.resume": "latest"}) == 0
    assert _evaluated(run) == [EPOCH, 2 * EPOCH, 3 * EPOCH]


def test_a_mid_epoch_resume_at_another_batch_owes_no_evaluation(tiny_embedded, tmp_path, monkeypatch):
    """Stopped one step into epoch 2 and resumed at batch 16: the rest of the epoch (72 samples) is 5 batches, as a
    whole epoch is at that batch, which read as an epoch's start and evaluated step 11."""
    run = tmp_path / "run"
    monkeypatch.setenv("FASTCLIP_FAULTS", f"usr1@batch:step={EPOCH + 1}")
    assert _run(tiny_embedded, run, **{"eval.every_epochs": 1}) == EXIT_PREEMPTED
    monkeypatch.delenv("FASTCLIP_FAULTS")
    more = {"eval.every_epochs": 1, "train.resume": "latest", "data.batch_size": 16, "train.resume_batch_change": True}
    assert _run(tiny_embedded, run, **more) == 0
    assert _evaluated(run) == [EPOCH, EPOCH + 1 + 5, EPOCH + 1 + 10]  # the ends of epochs 2 and 3, at batch 16
