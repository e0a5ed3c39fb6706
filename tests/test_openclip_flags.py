"""What OpenCLIP users type: its spellings are accepted where they mean what ours mean, the rest is refused
in one line naming the key (exit status 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fastclip.train.config import load_config

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "cc3m-fastclip-v3.yaml"


def same(openclip: list[str], ours: list[str]) -> None:
    assert load_config(RECIPE, openclip).to_dict() == load_config(RECIPE, ours).to_dict()


@pytest.mark.parametrize(
    "theirs, ours", [("amp", "fp16"), ("amp_bf16", "bf16"), ("amp_bfloat16", "bf16"), ("fp32", "fp32")]
)
def test_precision_spellings(theirs, ours):
    same(["--precision", theirs], ["--train.precision", ours])
    same([f"--precision={theirs}"], ["--train.precision", ours])


def test_report_to_resume_and_log_every():
    same(
        ["--report-to", "tensorboard", "--resume", "latest", "--log-every-n-steps", "5"],
        ["--train.tensorboard", "true", "--train.resume", "latest", "--train.log_every", "5"],
    )
    same(["--report-to", ""], ["--train.tensorboard", "false"])  # OpenCLIP's default: no reporting
    same(
        ["--report-to", "tensorboard,wandb", "--wandb-project-name", "clip-runs"],
        ["--train.tensorboard", "true", "--train.wandb", "true", "--train.wandb_project", "clip-runs"],
    )
    same(["--report-to", "all"], ["--train.tensorboard", "true", "--train.wandb", "true"])  # OpenCLIP: every one
    same(["--imagenet-val", "/data/imagenet/val"], ["--eval.imagenet_val", "/data/imagenet/val"])
    same(["--dist-backend", "gloo"], ["--train.backend", "gloo"])  # (it was "no such field in any section")
    # OpenCLIP's per-epoch cadences (refused before, with the step keys to use instead)
    same(["--save-frequency", "2"], ["--checkpoint.every_epochs", "2"])
    same(["--zeroshot-frequency", "1", "--val-frequency", "1"], ["--eval.every_epochs", "1"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastclip", "train", "--config", str(RECIPE), *args, "--print-config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "RANK": "0"},
    )


def test_local_loss_and_gather_with_grad_are_accepted_with_one_note_each():
    out = _cli("--local-loss", "--gather-with-grad", "--batch-size", "64")
    assert out.returncode == 0, out.stderr
    note = (
        "is accepted and changes nothing: every loss gathers the features once and computes the global-batch "
        "gradient exactly"
    )
    assert out.stderr.splitlines() == [
        f"fastclip train: note: --local-loss {note}",
        f"fastclip train: note: --gather-with-grad {note}",
    ]
    assert "batch_size: 64" in out.stdout
    same(["--local-loss", "--gather-with-grad"], [])


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--precision", "pure_bf16"],
            "config key 'train.precision': 'pure_bf16' (OpenCLIP: weights in half precision) "
            "is not supported; amp_bf16 (bf16 autocast, fp32 weights) is 'bf16' here, amp is "
            "'fp16'",
        ),
        (
            ["--report-to", "mlflow"],
            "--report-to mlflow: 'mlflow' is not one of tensorboard, wandb (comma-separated, or all)",
        ),
        (  # OpenCLIP's two epoch cadences are one evaluation here: told apart, they are a conflict
            ["--zeroshot-frequency", "1", "--val-frequency", "2"],
            "config key 'eval.every_epochs' is given twice with different values: --zeroshot-frequency 1 and "
            "--val-frequency 2; keep one",
        ),
        # OpenCLIP switches with no key here (issue 39: "config key 'siglip' has no value"): the equivalent, if any
        (["--siglip"], "unknown option --siglip (an OpenCLIP option): use --loss.name siglip"),
        (
            ["--delete-previous-checkpoint", "--batch-size", "8"],
            "unknown option --delete-previous-checkpoint (an OpenCLIP option): use --checkpoint.keep_last 1",
        ),
        (
            ["--force-quick-gelu"],
            "unknown option --force-quick-gelu (an OpenCLIP option): the activation comes from the architecture: use "
            "a -quickgelu one, e.g. --model.arch ViT-B-32-quickgelu",
        ),
        (  # OpenCLIP ignores it without --lock-image; here it is a setting that would do nothing (LiT is supported)
            ["--lock-image-unlocked-groups", "2"],
            "config key 'model.lock_image_unlocked_groups': applies to a locked image tower only: set "
            "model.lock_image true (OpenCLIP's --lock-image), or drop it (got 2)",
        ),
        # OpenCLIP options with an equivalent that was not named (a fresh-eyes user's run)
        (
            ["--beta1", "0.9"],
            "unknown option --beta1 (an OpenCLIP option): use --optim.betas '[BETA1, BETA2]' (both "
            "at once; default [0.9, 0.98])",
        ),
        (
            ["--imagenet-v2", "/data/v2"],
            "unknown option --imagenet-v2 (an OpenCLIP option): ImageNet-V2 is not "
            "evaluated during training; --imagenet-val DIR takes one folder of class subfolders, and `fastclip eval` "
            "scores an exported model on any such folder",
        ),
        (
            ["--frobnicate"],
            "unknown option --frobnicate: no config key of that name (--section.key VALUE, or an OpenCLIP flag that "
            "has one; `fastclip train --print-config` lists the keys)",
        ),
        (
            ["--name", "myrun"],
            "--name is OpenCLIP's run name: here the run folder is --train.run_dir DIR (or --logs DIR, the folder "
            "itself, not its parent); the loss is --loss.name",
        ),
    ],
)
def test_what_means_something_else_is_one_line_and_exit_2(args, line):
    out = _cli(*args)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [f"fastclip train: config error: {line}"]


def test_where_the_openclip_flags_differ_is_said_once_at_the_start():
    """--accum-freq (the global batch), --logs (the run folder itself), --report-to (TensorBoard only when listed),
    --pretrained (a local file): taken, and the differences said in one note (issue 39)."""
    out = _cli("--accum-freq", "2", "--logs", "/tmp/runs/a", "--report-to", "tensorboard", "--accum-freq", "2")
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "fastclip train: note: where fastclip differs from OpenCLIP: --accum-freq N splits the per-process "
        "--batch-size into N micro-batches: the global batch stays batch-size x processes (OpenCLIP's is N times "
        "that); --logs DIR is the run folder itself (OpenCLIP writes DIR/<name>/); --report-to names every logger: "
        "TensorBoard is written only when it is listed"
    ]
    assert _cli("--batch-size", "8").stderr == ""  # our own spellings: no note
    # --precision bf16 is a value of ours that OpenCLIP spells the same and means otherwise (weights in bf16)
    out = _cli("--precision", "bf16")
    assert out.returncode == 0 and out.stderr.splitlines() == [
        "fastclip train: note: where fastclip differs from OpenCLIP: --precision bf16 is autocast with fp32 weights "
        "(OpenCLIP's amp_bf16); OpenCLIP's bf16 puts the weights in half precision, which fastclip does not do"
    ]
    assert _cli("--precision", "amp_bf16").stderr == _cli("--train.precision", "bf16").stderr == ""


def test_openclip_switches_take_no_value():
    """--dataset-resampled, --grad-checkpointing, --torchcompile: OpenCLIP's switches, before another flag or last."""
    same(
        ["--dataset-resampled", "--grad-checkpointing", "--batch-size", "8", "--torchcompile"],
        [
            "--data.resampled",
            "true",
            "--model.grad_checkpointing",
            "true",
            "--data.batch_size",
            "8",
            "--model.compile",
            "true",
        ],
    )
    same(["--dataset-resampled", "false"], ["--data.resampled", "false"])
    same(["--ddp-static-graph"], ["--train.ddp_static_graph", "true"])  # (it was "has no value")


def test_text_options_stay_text_on_the_command_line():
    """YAML would read 2024-11-23 as a date, 2024 as a number and a::b: as a mapping: a string option keeps the text."""
    cfg = load_config(RECIPE, ["--logs", "2024-11-23", "--wandb-project-name", "2024", "--data.val", "v::"])
    assert (cfg.train.run_dir, cfg.train.wandb_project, cfg.data.val) == ("2024-11-23", "2024", "v::")
    assert load_config(RECIPE, ["--data.val", "null"]).data.val is None


def test_held_out_data_follows_your_own_train_data(capsys, monkeypatch):
    """--train-data of your own: the embedded demo's val and zero-shot files (defaults, and configs/embedded.yaml's
    copy of them) are not evaluated against it (issue 39: they had to be set to null by hand); one note says so.
    What the command line sets stays."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    embedded = REPO / "configs" / "embedded.yaml"
    for config in (embedded, None):  # the recipe's copy of the demo paths, and the built-in defaults
        cfg = load_config(config, ["--train-data", "/data/cc3m/train"])
        assert (cfg.data.train, cfg.data.val, cfg.data.zeroshot) == ("/data/cc3m/train", None, None)
        assert capsys.readouterr().err.splitlines() == [
            "fastclip train: note: data.train is your own data: data.val and data.zeroshot (the embedded demo's "
            "held-out data) set to null; set them to evaluate on held-out data of yours"
        ]
    cfg = load_config(embedded, ["--train-data", "/d/train", "--val-data", "/d/val", "--data.zeroshot", "/d/z.json"])
    assert (cfg.data.val, cfg.data.zeroshot) == ("/d/val", "/d/z.json") and capsys.readouterr().err == ""
    cfg = load_config(embedded, ["--batch-size", "8"])  # the demo's own data: its held-out data stays
    assert (cfg.data.val, cfg.data.zeroshot) == ("data/embedded/val", "data/embedded/zeroshot.json")
