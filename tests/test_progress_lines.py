"""What a long command prints when its output is not a terminal: training lines with the position, loss,
samples/s and the time left; data writing and evaluation with fastclip.progress lines (their bars on a
terminal are tqdm's)."""

from __future__ import annotations

import json
import re

from fastclip.cli import main as fastclip_main
from fastclip.train.metrics import MetricsLogger


def test_training_lines_give_position_loss_rate_and_eta(tmp_path, capsys):
    log = MetricsLogger(tmp_path, enabled=True, total_steps=40, start_step=10, tensorboard=False, progress=True)
    keys = ("loss", "samples_per_s")
    log.log({"step": 20, "loss": 0.5, "samples_per_s": 512.0, "lr": 1e-3}, keys)
    log.log({"step": 20, "eval/zeroshot/mean_top1": 0.25}, ("eval/zeroshot/mean_top1",))
    # a skipped step's counters: in metrics.jsonl, but no bare "step 30/40" line (the guard says what happened)
    log.log({"step": 30, "nonfinite_skipped": 1, "skipped": "loss"})
    log.log({"step": 40, "loss": 0.25, "samples_per_s": 500.0}, keys)
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"step 20/40 loss=0\.5 samples_per_s=512 eta \d+:\d\d", lines[0]), lines[0]
    assert lines[1:] == ["step 20/40 eval/zeroshot/mean_top1=0.25", "step 40/40 loss=0.25 samples_per_s=500"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [20, 20, 30, 40]


def test_an_evaluation_without_class_names_still_prints_a_line(tmp_path, capsys):
    """Own data often has no class names: the evaluation's line shows retrieval's R@1 and the validation loss."""
    from fastclip.train.metrics import eval_line

    record = {"step": 5, "samples_seen": 80, "eval/retrieval/image_to_text_R@1": 0.5,
              "eval/retrieval/image_to_text_R@5": 0.75, "eval/retrieval/text_to_image_R@1": 0.25,
              "eval/val_loss": 2.5, "eval/retrieval/distinct_captions": 20}  # fmt: skip
    log = MetricsLogger(tmp_path, enabled=True, total_steps=10, start_step=0, tensorboard=False, progress=True)
    log.log(record, eval_line(record))
    log.close()
    assert capsys.readouterr().out.splitlines() == [
        "step 5/10 eval/retrieval/image_to_text_R@1=0.5 eval/retrieval/text_to_image_R@1=0.25 eval/val_loss=2.5"
    ]


def test_embedded_data_prints_progress(tmp_path, capsys):
    assert (
        fastclip_main(
            [
                "data",
                "embedded",
                "--out",
                str(tmp_path / "d"),
                "--max-per-class",
                "2",
                "--max-val-per-class",
                "1",
                "--shard-size",
                "100",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("embedded: 60/60 samples (")  # 2 x 10 classes x (2 train + 1 val)


def test_a_per_sample_tau_loss_logs_each_tau_quantile_once_and_the_step_line_shows_them():
    import torch

    from fastclip.losses import build_loss
    from fastclip.train.metrics import STEP_LINE, TAU_QUANTILES, scalar_metrics

    loss_fn = build_loss("fastclip-v2", data_size=10)
    e1, e2 = (torch.nn.functional.normalize(torch.randn(4, 8), dim=-1) for _ in range(2))
    values = scalar_metrics(loss_fn, loss_fn(e1, e2, torch.arange(4)), step=1)
    assert [k for k in values if k.startswith("tau_q")] == list(TAU_QUANTILES)
    assert set(TAU_QUANTILES) <= set(STEP_LINE)
