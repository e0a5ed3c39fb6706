"""What an operator types wrong ends in one line naming the key or file and what to do, exit status 2, before the
towers are built or data is read; --model.pretrained starts the towers from an OpenCLIP or
fastclip file. One short real training run (1 process) provides the checkpoint the cases start from."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from fastclip.models import hub_names_not_cached
from fastclip.train.cli import main

from helpers import (
    _UNSET,
    BATCH,
    EMBEDDED,
    clean_env,
    fault_overrides,
    latest,
    load,
    step_dir,
    the_error_line,
    train_records,
)


@pytest.fixture(scope="module")
def trained(tiny_embedded, tmp_path_factory) -> Path:
    """fastclip-v2 on one process for 2 steps: the checkpoint every case below starts from."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["--config", str(EMBEDDED), *fault_overrides(tiny_embedded, run, **{"train.max_steps": 2})]) == 0
    return run


def _fails(capsys, args, key, *words, code=2) -> str:
    status = main(args)
    assert status == code or (code is None and status in (1, 2)), status
    err = "\n".join(
        x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("fastclip train: note:")
    )
    assert len(err.splitlines()) == 1, err  # one line (besides notes), no traceback
    assert "Traceback" not in err and (key is None or f"'{key}'" in err or key in err), err
    for w in words:
        assert w in err, (w, err)
    return err


def _args(data, run, mode="fastclip-v2", **extra) -> list[str]:
    return ["--config", str(EMBEDDED), *fault_overrides(data, run, mode, **extra)]


# ----------------------------------------------------------------------------- names, machine, files
def test_wandb_without_a_key_or_with_a_malformed_one_is_one_line(tiny_embedded, tmp_path, capsys, monkeypatch):
    """train.wandb: no API key, or a malformed one, is refused by --check and the run before anything is written
    (wandb.init raised a UsageError traceback at the run's start)."""
    pytest.importorskip("wandb")
    from wandb.sdk import wandb_setup

    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.chdir(tmp_path)
    wandb_setup.teardown()  # wandb's settings as this environment gives them, not as an earlier test's did
    run = tmp_path / "run"
    args = _args(tiny_embedded, run, **{"train.max_steps": 1, "train.wandb": True})
    for check in (["--check"], []):
        _fails(capsys, check + args, "train.wandb", "no W&B API key", "wandb login", "WANDB_MODE=offline")
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    _fails(capsys, args, "train.wandb", "WANDB_API_KEY invalid", "wandb login")
    assert not run.exists()


def test_wandb_is_checked_as_wandb_resolves_its_mode_server_and_key(tmp_path, capsys, monkeypatch):
    """The key `wandb login` keeps in ~/.netrc for wandb's own server (not a hard-coded one), WANDB_MODE=offline
    and `mode = offline` in wandb's settings file (`wandb offline`) pass the check, with no line of wandb's; a
    settings file's server without a key for it is refused naming that server, a setting wandb refuses naming it
    and its value. wandb caches its settings per process: each case starts it afresh (teardown)."""
    from urllib.parse import urlsplit

    pytest.importorskip("wandb")
    from wandb.sdk import wandb_setup
    from wandb.sdk.wandb_settings import Settings

    from fastclip.errors import ConfigError
    from fastclip.train.preflight import check_wandb

    home = tmp_path / "home"
    (home / ".config" / "wandb").mkdir(parents=True)
    for var in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)  # no ./wandb/settings of the checkout's

    def check(**env) -> str:
        """The check's one line ("" when it passes); wandb prints nothing."""
        for key in ("WANDB_MODE",):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        wandb_setup.teardown()
        try:
            check_wandb()
            said = ""
        except ConfigError as e:
            said = str(e)
        assert capsys.readouterr() == ("", ""), "wandb printed"
        assert "\n" not in said
        return said

    try:
        server = urlsplit(Settings().base_url).netloc  # wandb's default server, whatever its version
        (home / ".netrc").write_text(f"machine {server}\n  login user\n  password {'a' * 40}\n")
        (home / ".netrc").chmod(0o600)
        assert check() == ""
        (home / ".netrc").unlink()
        assert "no W&B API key for" in check()
        assert check(WANDB_MODE="offline") == ""
        said = check(WANDB_MODE="bogus")  # pydantic's lines before
        assert "wandb setting mode 'bogus': Input should be" in said and "WANDB_* variable" in said, said
        (home / ".config" / "wandb" / "settings").write_text("[default]\nmode = offline\n")
        assert check() == ""
        (home / ".config" / "wandb" / "settings").write_text("[default]\nbase_url = https://wandb.example.org\n")
        assert "no W&B API key for https://wandb.example.org" in check()
    finally:
        wandb_setup.teardown()  # nothing of this test's settings left for the next one in this process


def test_a_run_folder_another_job_trains_in_is_refused_and_free_again_after(tiny_embedded, tmp_path, capsys):
    """A second job (or a rank 0 left alive by a killed launcher) holding <run_dir>/.fastclip.lock: one line, exit 2,
    nothing written; once the holder is gone the same command trains."""
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    holder = open(run / ".fastclip.lock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder.write("pid 4242 on node17 since 2026-11-23 10:00:00\n")
    holder.flush()
    args = _args(tiny_embedded, run, **{"train.max_steps": 1})
    _fails(capsys, args, "train.run_dir", f"{run} is in use by a running job (pid 4242 on node17", "--train.run_dir")
    # what the launchers run first says so too (issue 39: it said "ok", then every rank failed)
    _fails(capsys, ["--check", *args], "train.run_dir", f"{run} is in use by a running job (pid 4242 on node17")
    assert not (run / "metrics.jsonl").exists() and not list((run / "checkpoints").glob("step_*"))
    holder.close()  # the other job ends: the OS drops its lock
    assert main(["--check", *args]) == 0
    assert main(args) == 0
    assert (run / ".fastclip.lock").read_text().startswith("pid ")
    # a fresh start into a folder a running job trains in (with checkpoints by now): "in use", not "continue it with
    # --train.resume latest", which the lock then refuses (a fresh-eyes operator review)
    holder = open(run / ".fastclip.lock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    for check in ([], ["--check"]):
        _fails(capsys, [*check, *args], "train.run_dir", f"{run} is in use by a running job")
    holder.close()
    _fails(capsys, args, "train.run_dir", f"{run} already holds a run", "--train.resume latest")
    # before the job's first checkpoint (its metrics.jsonl only): "in use" too, not "delete that file"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    holder = open(fresh / ".fastclip.lock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    _fails(capsys, _args(tiny_embedded, fresh), "train.run_dir", f"{fresh} is in use by a running job")
    # a lock held for a moment (another rank of the launch checking too) is no running job
    import threading

    from fastclip.train.preflight import _refuse_if_in_use

    threading.Timer(0.15, holder.close).start()
    _refuse_if_in_use(fresh)


def test_unknown_arch_lists_the_known_ones(tiny_embedded, tmp_path, capsys):
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "run", **{"model.arch": "tiny-vitt"}),
        "model.arch",
        "unknown architecture 'tiny-vitt'",
        "did you mean 'tiny-vit'",
        "tiny-vit-hf",
        "RN50",
        "ViT-B-32",
    )
    assert not (tmp_path / "run").exists()  # nothing was created: checked first


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_cuda_without_a_gpu(tiny_embedded, tmp_path, capsys):
    _fails(
        capsys, _args(tiny_embedded, tmp_path / "run", **{"train.device": "cuda"}), "train.device", "--train.device cpu"
    )


def test_nccl_on_the_cpu_is_one_line(tiny_embedded, tmp_path, capsys):
    """(2 processes gave 'could not meet at localhost:PORT (Distributed package doesn't have NCCL built in)' on one
    rank, a 30-minute wait on the other)"""
    args = _args(tiny_embedded, tmp_path / "run", **{"train.device": "cpu", "train.backend": "nccl"})
    for check in (["--check", "--world-size", "2"], []):
        _fails(capsys, check + args, "train.backend", "nccl runs between CUDA GPUs", "(train.device cpu)", "gloo")
    assert not (tmp_path / "run").exists()


def test_config_that_is_a_directory_or_empty(tmp_path, capsys):
    _fails(capsys, ["--config", str(tmp_path)], None, "is a directory")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    _fails(capsys, ["--config", str(empty)], None, f"config file {empty} is empty", "leave --config out")


def test_run_dir_that_cannot_be_written(tiny_embedded, capsys):
    run = Path("/sys/fastclip-unwritable-run")  # sysfs: nobody, root included, creates folders there
    try:
        run.mkdir()
    except OSError:
        pass
    else:
        run.rmdir()
        pytest.skip("/sys is writable here")
    # the run and --check name the same folder: each named the one it tried (the run, mkdir: /sys/...-run; the
    # check, its probe: /sys), which told an operator two things (helper-61). (sysfs refuses the two with other
    # errnos, EPERM and EACCES; a read-only mount gives EROFS to both)
    for check in ([], ["--check"]):
        said = "cannot write in /sys ("
        _fails(capsys, check + _args(tiny_embedded, run), "train.run_dir", said, "choose another --train.run_dir")


def test_check_leaves_no_run_folder_and_refuses_one_under_a_file(tiny_embedded, tmp_path, capsys):
    from fastclip.train.cli import main as train_main

    run = tmp_path / "not" / "yet"
    assert train_main(["--check", *_args(tiny_embedded, run)]) == 0
    assert not (tmp_path / "not").exists() and list(tmp_path.iterdir()) == []  # no folder, no probe file left
    for value in ("[a]", "{a: 1}"):  # a loss name that is not text: the type check names the key
        _fails(capsys, ["--print-config", "--loss.name", value], "loss.name", "is not one of")
    (tmp_path / "a_file").write_text("x")
    for check in (["--check"], []):  # the run said "cannot write in ... (File exists)"; both name the file now
        for run in (tmp_path / "a_file", tmp_path / "a_file" / "run"):
            _fails(capsys, [*check, *_args(tiny_embedded, run)], "train.run_dir", "a_file is a file, not a folder")
    # what the run would refuse, --check refuses too: a broken link, checkpoints/ a file, a name too long
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    _fails(capsys, ["--check", *_args(tiny_embedded, tmp_path / "dangling")], "train.run_dir", "broken symbolic link")
    (tmp_path / "run" / "checkpoints").parent.mkdir()
    (tmp_path / "run" / "checkpoints").write_text("x")
    _fails(capsys, ["--check", *_args(tiny_embedded, tmp_path / "run")], "train.run_dir", "checkpoints is a file")
    _fails(capsys, ["--check", *_args(tiny_embedded, tmp_path / ("a" * 300) / "x")], "train.run_dir", "longer than")
    (tmp_path / "run" / "checkpoints").unlink()  # a file where a step folder goes: the save would move it aside
    (tmp_path / "run" / "checkpoints").mkdir()
    (tmp_path / "run" / "checkpoints" / "step_00000004").write_text("x")
    for argv in (_args(tiny_embedded, tmp_path / "run"), ["--check", *_args(tiny_embedded, tmp_path / "run")]):
        _fails(capsys, argv, "train.run_dir", "step_00000004 is a file where the run writes a step folder")
    _fails(capsys, _args(tiny_embedded, tmp_path / ("a" * 300) / "x"), "train.run_dir", "cannot write in")


# ----------------------------------------------------------------------------- resuming
def test_resume_with_another_seed_or_data_is_refused_before_building(tiny_embedded, trained, tmp_path, capsys):
    ckpt = step_dir(trained, 2)
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "a", **{"train.resume": ckpt, "train.seed": 7}),
        "train.seed",
        "was trained with 2024, this config gives 7",
        f"--model.pretrained {ckpt / 'model.pt'}",
    )
    _fails(capsys, _args(tiny_embedded, tmp_path / "b", **{"train.resume": ckpt, "data.seed": 7}), "data.seed")
    from fastclip.data.manifest import read_manifest

    size = read_manifest(tiny_embedded / "train").data_size  # a manifest rewritten with another size: said how to fix
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "b", **{"train.resume": ckpt, "data.data_size": size + 7}),
        "data.data_size",
        f"holds per-sample state for {size} samples, this data gives {size + 7}",
        f"set --data.data_size {size})",
    )
    _fails(
        capsys,
        _args(
            tiny_embedded,
            tmp_path / "c",
            **{"train.resume": ckpt, "data.resampled": True, "data.samples_per_epoch": 40},
        ),
        "data.resampled",
    )
    other = tmp_path / "other"  # the same samples in other shards: the saved position means nothing there
    shutil.copytree(tiny_embedded, other)
    from fastclip.data.manifest import write_manifest

    manifest = read_manifest(other / "train")
    (other / "train" / manifest.shards[-1].path).unlink()  # (a folder's manifest lists every shard in it)
    manifest.shards = manifest.shards[:-1]
    write_manifest(other / "train", manifest)
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "d", **{"train.resume": ckpt, "data.train": other / "train"}),
        "data.train",
        "epoch of that length",
    )


def _openclip_checkpoint(trained: Path, path: Path, **change) -> Path:
    """What OpenCLIP's trainer writes as epoch_N.pt (DDP `module.` keys, its own optimizer state)."""
    state = {f"module.{k}": v for k, v in load(step_dir(trained, 2) / "model.pt")["state_dict"].items()}
    for key, shape in change.items():
        state[f"module.{key}"] = torch.zeros(shape)
    torch.save(
        {"epoch": 3, "name": "openclip-run", "state_dict": state, "optimizer": {"state": {}, "param_groups": []}}, path
    )
    return path


def test_a_resumed_run_says_its_weights_come_from_the_checkpoint_not_model_pretrained(
    tiny_embedded, trained, tmp_path, capsys
):
    """--model.pretrained starts a new run only: resumed, the banner says the checkpoint's weights are used and the
    file is not loaded (not "random init", not silence)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    epoch = _openclip_checkpoint(trained, tmp_path / "epoch_3.pt")
    extra = {"train.resume": "latest", "train.max_steps": 3, "model.pretrained": epoch}
    assert main(_args(tiny_embedded, run, **extra)) == 0
    banner = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fastclip train: fastclip-"))
    assert "weights from the checkpoint, model.pretrained not loaded" in banner and "random init" not in banner
    assert "resumed from" in banner


def test_foreign_checkpoints_given_to_resume_say_what_they_are(tiny_embedded, trained, tmp_path, capsys):
    epoch = _openclip_checkpoint(trained, tmp_path / "epoch_3.pt")
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "a", **{"train.resume": epoch}),
        "train.resume",
        "an OpenCLIP training checkpoint (epoch_N.pt, epoch 3)",
        f"--model.pretrained {epoch}",
    )
    bare = tmp_path / "weights.pt"
    torch.save(load(step_dir(trained, 2) / "model.pt")["state_dict"], bare)
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "b", **{"train.resume": bare}),
        "train.resume",
        "a bare state dict",
        "--model.pretrained",
    )
    folder = tmp_path / "step_00000009"  # a step folder whose model.pt is not ours
    folder.mkdir()
    shutil.copy(bare, folder / "model.pt")
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "c", **{"train.resume": folder}),
        "train.resume",
        "a bare state dict (",
        "not a fastclip training checkpoint",
    )
    ours = step_dir(trained, 2) / "model.pt"
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "d", **{"train.resume": ours}),
        "train.resume",
        f"pass its folder ({ours.parent})",
    )


def test_a_file_where_the_run_writes_its_tensorboard_folder(tiny_embedded, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("")
    args = _args(tiny_embedded, run, **{"train.tensorboard": True})
    for check in (["--check"], []):
        _fails(capsys, check + args, "train.run_dir", f"{run / 'tensorboard'} is a file", "--train.tensorboard false")
    assert main(_args(tiny_embedded, run, **{"train.tensorboard": False})) == 0


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc: a folder that takes no file, even from root")
def test_a_tensorboard_folder_that_takes_no_file_is_one_line(tiny_embedded, tmp_path, capsys):
    """(the SummaryWriter's first event file failed in a traceback after the towers were built)"""
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").symlink_to("/proc/self")
    args = _args(tiny_embedded, run, **{"train.tensorboard": True, "train.max_steps": 1})
    for check in (["--check"], []):
        _fails(capsys, check + args, "train.run_dir", f"cannot write in {run / 'tensorboard'}")
    assert main(_args(tiny_embedded, run, **{"train.tensorboard": False, "train.max_steps": 1})) == 0


def test_deepspeed_on_one_process_is_refused_by_check_as_by_the_run(tiny_embedded, tmp_path, capsys):
    """--check said ok, then the run built the towers and refused: the launchers' first step must say it."""
    args = _args(tiny_embedded, tmp_path / "run", **{"train.distributed": "deepspeed"})
    for check in (["--check"], []):
        _fails(capsys, check + args, "train.distributed", "deepspeed shards the optimizer over processes")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_mistyped_resume_says_so_in_a_folder_holding_a_run_and_in_a_new_one(tiny_embedded, trained, tmp_path, capsys):
    """`--train.resume last` (or LATEST) in the run's own folder was told the folder already holds a run, which is
    true but not the mistake; a path that does not exist is said as such wherever it is given."""
    for run in (trained, tmp_path / "fresh"):
        for given, hint in (("last", " (did you mean latest?)"), ("LATEST", " (did you mean latest?)"), ("nope", "")):
            for check in (["--check"], []):
                err = _fails(capsys, check + _args(tiny_embedded, run, **{"train.resume": given}), "train.resume")
                assert f"'{given}' is not 'latest' and no such file or folder exists{hint}; give latest" in err


def test_resume_with_another_optimizer_or_loss_of_other_shape_is_refused(tiny_embedded, tmp_path, capsys):
    """Options that change what the saved state holds (the optimizer's kind, fp16's loss scaler, one τ per
    direction, a τ that no longer trains) are refused in one line by the run and by --check, naming the option;
    before, the run loaded the state and died in a traceback (a size mismatch, a missing parameter group, LAMB's
    missing hyperparameter at step 1, GradScaler's empty state)."""
    run = tmp_path / "v3"
    assert main(_args(tiny_embedded, run, mode="fastclip-v3", **{"train.max_steps": 2})) == 0
    resume = {"train.resume": "latest", "train.max_steps": 3}
    for change, key, words in [
        ({"optim.optimizer": "lamb"}, "optim.optimizer", ["'lamb' but checkpoint", "trained with 'adamw'"]),
        # fp16's GradScaler had no saved state to load: a traceback at the resume (audit, 2026-11-30)
        ({"train.precision": "fp16"}, "train.precision", ["'fp16' but checkpoint", "trained with 'fp32'"]),
        (
            {"loss.separate_temperatures": True},
            "loss",
            ["loss parameter 'logit_scale' of shape [], this loss has shape [2]", "loss.separate_temperatures: null"],
        ),
        (
            {"loss.learn_temperature": False},
            "loss",
            ["optimizer state for 1 learned loss parameter, this loss has 0", "loss.learn_temperature"],
        ),
    ]:
        args = _args(tiny_embedded, run, mode="fastclip-v3", **resume, **change)
        for check in (["--check"], []):
            _fails(capsys, check + args, key, *words, f"--model.pretrained {step_dir(run, 2) / 'model.pt'}")
    assert latest(run) == "step_00000002"
    assert main(_args(tiny_embedded, run, mode="fastclip-v3", **resume)) == 0  # the same settings resume


def test_resume_with_another_feature_queue_size_is_refused_and_a_queue_added_starts_empty(
    tiny_embedded, tmp_path, capsys
):
    """A saved feature queue loads only into as many slots: another loss.queue_size, or none, is one line from the
    run and --check (it was a RuntimeError from load_state_dict); a queue added on resume starts empty."""
    run = tmp_path / "queue"
    assert main(_args(tiny_embedded, run, mode="dcl", **{"train.max_steps": 2, "loss.queue_size": 16})) == 0
    resume = {"train.resume": "latest", "train.max_steps": 3}
    for size, now in [(32, "this loss has 32 slots"), ("null", "this loss has no queue")]:
        args = _args(tiny_embedded, run, mode="dcl", **resume, **{"loss.queue_size": size})
        for check in (["--check"], []):
            _fails(capsys, check + args, "loss", f"a feature queue of 16 slots, {now}", "loss.queue_size: 16")
    assert latest(run) == "step_00000002"
    plain = tmp_path / "plain"
    assert main(_args(tiny_embedded, plain, mode="dcl", **{"train.max_steps": 2})) == 0
    assert main(_args(tiny_embedded, plain, mode="dcl", **resume, **{"loss.queue_size": 16})) == 0
    capsys.readouterr()
    queue = load(step_dir(plain, 3) / "rank_0.pt")["loss_state"]
    assert queue["queue.indices"].shape == (16,) and int(queue["queue.position"]) == BATCH  # one push since


def test_resume_with_train_epochs_below_the_checkpoints_epoch_is_refused(tiny_embedded, tmp_path, capsys):
    """train.epochs counts the run's epochs in all: below the epochs a checkpoint has trained, or cutting the epoch it
    is part-way through, nothing (or not that epoch's rest) would be trained, and the run ended 0 without a word.
    Equal to a finished run's epochs is a requeue of a finished job: it trains nothing and ends 0."""
    run = tmp_path / "run"
    args = lambda **extra: _args(tiny_embedded, run, **{"train.epochs": 2, "checkpoint.every_steps": 5, **extra})  # noqa: E731
    assert main(args()) == 0
    capsys.readouterr()
    steps_per_epoch = 80 // BATCH
    assert latest(run) == f"step_{2 * steps_per_epoch:08d}"
    mid = step_dir(run, steps_per_epoch + 5)
    for resume, words in [
        ("latest", ["has trained 2 epochs", "nothing would be trained"]),
        (mid, ["is part-way through epoch 2", "whose rest would not be trained"]),
    ]:
        for check in (["--check"], []):
            _fails(capsys, check + args(**{"train.epochs": 1, "train.resume": resume}), "train.epochs", *words)
    assert main(args(**{"train.resume": "latest"})) == 0  # the finished run, started again
    assert f"steps {2 * steps_per_epoch} -> {2 * steps_per_epoch}" in capsys.readouterr().out
    assert latest(run) == f"step_{2 * steps_per_epoch:08d}"


def test_resume_whose_tensors_do_not_fit_the_model(tiny_embedded, trained, tmp_path, capsys):
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(step_dir(trained, 2), ckpt)
    model = load(ckpt / "model.pt")
    model["state_dict"]["text_projection"] = torch.zeros(3, 5)
    torch.save(model, ckpt / "model.pt")
    for check in ([], ["--check"]):  # --check (the launchers' first step) builds the towers on the meta device
        _fails(
            capsys,
            check + _args(tiny_embedded, tmp_path / "run", **{"train.resume": ckpt}),
            "train.resume",
            "does not fit architecture",
            "text_projection (3, 5) vs",
        )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_check_refuses_a_pretrained_file_that_does_not_fit(tiny_embedded, trained, tmp_path, capsys):
    """`--check` makes the checks train makes before its first step: --model.pretrained against the architecture's
    shapes (issue 39: "ok", then train failed on every rank)."""
    wrong = _openclip_checkpoint(trained, tmp_path / "epoch_4.pt", text_projection=(3, 5))
    args = _args(tiny_embedded, tmp_path / "run", **{"model.pretrained": wrong})
    _fails(capsys, ["--check", *args], "model.pretrained", "does not fit architecture", "text_projection (3, 5) vs")
    fits = _openclip_checkpoint(trained, tmp_path / "epoch_5.pt")
    assert main(["--check", *_args(tiny_embedded, tmp_path / "run", **{"model.pretrained": fits})]) == 0
    capsys.readouterr()
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(
    not hub_names_not_cached({"text_cfg": {"hf_model_name": "roberta-base"}}),
    reason="roberta-base is in this machine's Hugging Face cache",
)
def test_a_hub_text_tower_not_in_the_cache_is_one_line_in_check_and_train(tiny_embedded, tmp_path, capsys):
    """A Hugging Face text tower named by a hub id not in the local cache: nothing is downloaded (issue 39: `--check`
    said "ok", then train waited and printed 109 lines)."""
    for check in (["--check"], []):
        _fails(
            capsys,
            check + _args(tiny_embedded, tmp_path / "run", **{"model.arch": "roberta-ViT-B-32"}),
            "model.arch",
            "roberta-ViT-B-32's text tower is the Hugging Face hub model roberta-base, which is not in the local hub "
            "cache",
            "configs/models/tiny-vit-hf.json",
        )
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- --model.pretrained
def test_pretrained_starts_the_towers_from_an_openclip_checkpoint(tiny_embedded, trained, tmp_path, capsys):
    epoch = _openclip_checkpoint(trained, tmp_path / "epoch_3.pt")
    run = tmp_path / "run"
    # lr 0: the towers after one step are the loaded ones, so the saved weights show exactly what was loaded
    assert (
        main(
            _args(
                tiny_embedded,
                run,
                **{"model.pretrained": epoch, "train.max_steps": 1, "optim.lr": 0.0, "checkpoint.every_steps": 1},
            )
        )
        == 0
    )
    assert f"towers from {epoch}" in capsys.readouterr().out
    source = load(step_dir(trained, 2) / "model.pt")
    got = load(step_dir(run, 1) / "model.pt")
    for k, v in source["state_dict"].items():
        if k != "logit_scale":  # the loss owns the temperature: the saved scale is the loss's
            assert torch.equal(got["state_dict"][k], v), k
    assert got["step"] == 1 and got["optimizer"]["state"]  # a fresh optimizer that took one step
    state = load(step_dir(run, 1) / "rank_0.pt")["loss_state"]["_extra_state"]
    assert int(state["seen"].sum()) == 8  # fresh per-sample state: only this step's batch
    # an export of our own and a bare state dict work the same way; shapes are strict
    bare = tmp_path / "weights.pt"
    torch.save(source["state_dict"], bare)
    assert main(_args(tiny_embedded, tmp_path / "run2", **{"model.pretrained": bare, "train.max_steps": 1})) == 0
    capsys.readouterr()
    wrong = _openclip_checkpoint(trained, tmp_path / "epoch_4.pt", text_projection=(3, 5))
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "run3", **{"model.pretrained": wrong}),
        "model.pretrained",
        "does not fit architecture",
        "text_projection (3, 5) vs",
    )
    unrelated = tmp_path / "notes.pt"
    torch.save({"notes": "hello", "n": 3}, unrelated)
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "run4", **{"model.pretrained": unrelated}),
        "model.pretrained",
        "not a model checkpoint",
    )
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "run5", **{"model.pretrained": tmp_path / "missing.pt"}),
        "model.pretrained",
        "does not exist",
    )


# ----------------------------------------------------------------------------- eval and export
def test_eval_and_export_refuse_unusable_checkpoints_in_one_line(trained, tmp_path, capsys):
    from fastclip.eval.cli import main as eval_main
    from fastclip.eval.export import main as export_main

    class _Payload:  # what a malicious checkpoint would carry: code that runs on unpickling
        def __reduce__(self):
            return (print, ("pickled code ran",))

    pickled = tmp_path / "pickled" / "step_00000002"
    shutil.copytree(step_dir(trained, 2), pickled)
    torch.save({**load(pickled / "model.pt"), "extra": _Payload()}, pickled / "model.pt")
    wrong = tmp_path / "wrong" / "step_00000002"
    shutil.copytree(step_dir(trained, 2), wrong)
    model = load(wrong / "model.pt")
    model["state_dict"]["text_projection"] = torch.zeros(3, 5)
    torch.save(model, wrong / "model.pt")
    data = tmp_path / "no-data"
    data.mkdir()
    for ckpt, words in (
        (pickled, "refusing to load pickled objects"),
        (wrong, "weights do not fit architecture 'tiny-vit': 1 tensor(s) of another shape"),
    ):
        assert export_main([str(ckpt), "--out", str(tmp_path / "export" / "model.pt")]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and words in err and "weights_only=False" not in err, err
        assert "pickled code ran" not in captured.out
        assert not (tmp_path / "export" / "model.pt").exists()  # nothing unusable is left to load
        assert not list((tmp_path / "export").glob(".fastclip-export-*"))  # nor a staging folder
        assert eval_main([str(ckpt), "--data", str(data)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    # another --arch than the checkpoint's: the fix is named
    assert eval_main([str(step_dir(trained, 2)), "--data", str(data), "--arch", "tiny-vit-64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("it was trained as 'tiny-vit': drop --arch or pass --arch tiny-vit"), err
    # a good checkpoint exports, is loaded back in open_clip before success is reported
    assert export_main([str(step_dir(trained, 2)), "--out", str(tmp_path / "export" / "model.pt")]) == 0
    assert (tmp_path / "export" / "model.pt").is_file()


@pytest.mark.parametrize(
    "extra, key, words",
    [
        (
            {"loss.bias": 1},
            "loss.bias",
            "loss fastclip-v2 does not take it (it takes loss.compat, loss.direction_weights",
        ),
        (
            {"loss.name": "openclip", "loss.rho": 6.5},
            "loss.rho",
            "(it takes loss.direction_weights, loss.distill_alpha, loss.fused_kernels, loss.hard_negative_beta,",
        ),
        (
            {"loss.name": "fastclip-v2", "loss.separate_temperatures": "true", "loss.rho": 7.0},
            "loss.separate_temperatures",
            "drop it or set it to null",
        ),
        ({"loss.temperature": ".inf"}, "loss.temperature", "expected a finite number, got inf"),
        ({"optim.wd": ".inf"}, "optim.wd", "finite"),
        ({"loss.rho": "nan"}, "loss.rho", "expected a finite number, got nan"),  # else every step skipped
        ({"train.dist_timeout_minutes": "inf"}, "train.dist_timeout_minutes", "finite"),  # else under torchrun only
        ({"checkpoint.every_minutes": ".inf"}, "checkpoint.every_minutes", "finite"),
        ({"train.run_dir": "''"}, "train.run_dir", "must name a folder"),  # '' would be the working directory
        ({"eval.max_samples": -5}, "eval.max_samples", "must be >= 1 or null"),
        ({"data.train": "pipe:false"}, "data.train", "pipe:false: no argument ends in .tar"),
        ({"train.seed": -1}, "train.seed", "must be >= 0"),
        ({"data.seed": -5}, "data.seed", "must be >= 0"),
        ({"optim.betas": "[0.9,"}, "optim.betas", "is not a valid value"),
        ({"optim.lr": 1, "optim.lr.x": 2}, "optim.lr.x", "optim.lr is a value, not a section"),
        ({"data.resampled": "true", "data.upsampling_factors": "a::b"}, "data.upsampling_factors", "one factor >= 0"),
        ({"data.resampled": "true", "data.upsampling_factors": "1::2"}, "data.upsampling_factors", "(1 sources"),
    ],
)
def test_check_refuses_what_the_run_would_refuse(tiny_embedded, tmp_path, capsys, extra, key, words):
    """`train --check` (the launchers' preflight) builds the loss from its section and checks every value the run
    would: a loss option the version does not take, an infinite weight decay (it trained a NaN model), a negative
    seed, an override that is not YAML. One line, status 2, with and without --check."""
    args = _args(tiny_embedded, tmp_path / "run", **{"train.max_steps": 1, **extra})
    _fails(capsys, ["--check", *args], key, words)
    _fails(capsys, args, key, words)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_held_out_folder_without_shards_is_refused_before_training(tiny_embedded, tmp_path, capsys):
    """Found at the start, not at the first evaluation hours later."""
    (tmp_path / "empty").mkdir()
    extra = {"data.val": tmp_path / "empty", "eval.at_end": True, "train.max_steps": 1}
    args = _args(tiny_embedded, tmp_path / "run", **extra)
    _fails(capsys, ["--check", *args], "data.val", "no manifest.json and no .tar shards", "set it to null")
    _fails(capsys, args, "data.val", "no manifest.json and no .tar shards")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    (tmp_path / "empty" / "manifest.json").write_text('{"shards": 3}')  # a manifest that is no manifest
    _fails(capsys, ["--check", *args], "data.val", "manifest.json")


@pytest.mark.parametrize(
    "val, said",
    [
        ("", "subfolders train, val are shard folders, not one folder of images per class: give the held-out one"),
        ("zeroshot.json", "zeroshot.json: not a tar shard"),
        ("val/x-*.tar", "no shards found for"),
        ("val/*.tar", None),  # OpenCLIP's --val-data patterns: the evaluation reads them
        ("val/val-{000000..000000}.tar", None),
    ],
)
def test_data_val_given_as_a_data_root_or_a_file_that_is_no_shard_is_refused(
    tiny_embedded, tmp_path, capsys, val, said
):
    """The data root (its train/ and val/ taken for two classes without images) and a class-names file (read as a
    shard whose samples were all skipped) passed the checks; a pattern was refused as a path that does not exist."""
    extra = {"data.val": f"{tiny_embedded}/{val}", "eval.at_end": True, "train.max_steps": 1}
    args = ["--check", *_args(tiny_embedded, tmp_path / "run", **extra)]
    if said is None:
        assert main(args) == 0, capsys.readouterr().err
    else:
        _fails(capsys, args, "data.val", said)


def test_data_val_as_a_shard_pattern_finds_the_files_beside_its_folder(tiny_embedded, tmp_path, capsys):
    """zeroshot.json and the probe's train/ are found beside the folder of the pattern's shards, and the metrics
    take that folder's name (they were looked for beside the pattern text: no zero-shot, a probe refused)."""
    extra = {"data.val": f"{tiny_embedded}/val/*.tar", "data.zeroshot": "null", "eval.at_end": True}
    extra |= {"train.max_steps": 1, "eval.linear_probe": True}
    run = tmp_path / "run"
    assert main(["--check", *_args(tiny_embedded, run, **extra)]) == 0, capsys.readouterr().err
    assert main(_args(tiny_embedded, run, **extra)) == 0, capsys.readouterr().err
    record = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert {"eval/zeroshot/fashion-mnist/top1", "eval/zeroshot/mnist/top1"} <= set(record), sorted(record)
    assert any(k.startswith("eval/linear_probe/") for k in record) and not any("*" in k for k in record), record
    # fastclip eval on the same pattern: the same class lists, the probe fitted on the train/ beside its folder
    from fastclip.eval.cli import main as eval_main

    assert eval_main([str(run), "--data", extra["data.val"], "--linear-probe"]) == 0
    printed = capsys.readouterr().out
    assert f"class names: {tiny_embedded / 'zeroshot.json'}" in printed and "mnist" in printed, printed
    assert "80/20 split" not in printed, printed
    # a ? or [..] glob is a pattern too, as train's data.val takes it (it was refused as a path not found)
    assert eval_main([str(run), "--data", f"{tiny_embedded}/val/val-00000[0-9].tar"]) == 0, capsys.readouterr().err
    assert f"class names: {tiny_embedded / 'zeroshot.json'}" in capsys.readouterr().out


def test_a_val_pattern_over_two_folders_takes_no_class_list_by_default_and_checks_each(tiny_embedded, tmp_path, capsys):
    """Shards of two data sets by one pattern (each folder with its own zeroshot.json): no one list is taken by
    default (the first folder's scored the other's samples against its classes, found at the first evaluation),
    and a list given is checked on the first shard of each folder."""
    from fastclip.data.tario import iter_shard, write_tar
    from fastclip.eval.samples import shard_paths

    spec = json.loads((tiny_embedded / "zeroshot.json").read_text())
    for dataset in ("mnist", "fashion-mnist"):
        (tmp_path / dataset / "val").mkdir(parents=True)
        names = {"datasets": {dataset: spec["datasets"][dataset]}}
        (tmp_path / dataset / "zeroshot.json").write_text(json.dumps(names))
        samples = [
            (raw.key, raw.files)
            for shard in shard_paths(tiny_embedded / "val")
            for raw in iter_shard(shard)
            if json.loads(raw.files["json"])["dataset"] == dataset
        ]
        write_tar(tmp_path / dataset / "val" / "part-000000.tar", samples)
    extra = {"data.val": f"{tmp_path}/*/val/*.tar", "eval.at_end": True, "train.max_steps": 1}
    default = _args(tiny_embedded, tmp_path / "run", **extra, **{"data.zeroshot": "null"})
    assert main(["--check", *default]) == 0 and main(default) == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "eval/retrieval/image_to_text_R@1" in record and not any("zeroshot" in k for k in record), record
    given = {"data.zeroshot": str(tmp_path / "mnist" / "zeroshot.json")}
    said = "holds one class list ('mnist'), which would score the labelled samples of 2+ datasets"
    _fails(capsys, ["--check", *_args(tiny_embedded, tmp_path / "run2", **extra, **given)], "data.zeroshot", said)


def test_command_line_mistakes_that_would_be_ignored_are_refused(tiny_embedded, tmp_path, capsys):
    """--world-size outside --check (one process would train), two --config files (the last would win), an
    unknown key typed on the command line (named as typed there, not as from the file)."""
    args = _args(tiny_embedded, tmp_path / "run", **{"train.max_steps": 1})
    _fails(capsys, [*args, "--world-size", "2"], None, "--world-size 2 is read by --check only", "torchrun")
    _fails(capsys, ["--config", str(EMBEDDED), *args], None, "--config given twice")
    err = _fails(capsys, [*args, "--data.bogus", "3"], "data.bogus", "(command line)")
    assert str(EMBEDDED) not in err
    assert not (tmp_path / "run").exists()


def test_another_runs_checkpoint_is_not_continued_over_a_run_and_a_log_is_not_cut(
    tiny_embedded, trained, tmp_path, capsys
):
    """Continuing run A's checkpoint in run B's folder would replace B's checkpoints; a fresh start in a folder whose
    run logged steps but saved no checkpoint would cut its metrics.jsonl. Both refused, nothing touched; a new folder
    takes the checkpoint."""
    other = tmp_path / "other"
    shutil.copytree(trained, other)
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    args = _args(tiny_embedded, other, **{"train.resume": step_dir(trained, 2), "train.max_steps": 3})
    _fails(capsys, args, "train.run_dir", "already holds a run (step 2", "would replace its checkpoints")
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before
    logged = tmp_path / "logged"
    logged.mkdir()
    (logged / "metrics.jsonl").write_text('{"step": 1, "loss": 4.2}\n')
    _fails(capsys, _args(tiny_embedded, logged, **{"train.max_steps": 1}), "train.run_dir", "saved no checkpoint")
    assert (logged / "metrics.jsonl").read_text() == '{"step": 1, "loss": 4.2}\n'
    # a requeued job that died before its first save starts over, and says so (it was silent)
    assert main(_args(tiny_embedded, logged, **{"train.max_steps": 1, "train.resume": "latest"})) == 0
    said = capsys.readouterr().err
    assert "starts at step 0 and starts metrics.jsonl over (1 record of an earlier attempt" in said, said
    assert [json.loads(line)["step"] for line in (logged / "metrics.jsonl").read_text().splitlines()] == [1]
    assert json.loads((logged / "metrics.jsonl").read_text())["loss"] != 4.2
    fresh = _args(tiny_embedded, tmp_path / "new", **{"train.resume": step_dir(trained, 2), "train.max_steps": 3})
    assert main(["--check", *fresh]) == 0


@pytest.mark.parametrize("name", [".fastclip.lock", "metrics.jsonl", "config.yaml", "checkpoints/latest"])
def test_a_folder_where_the_run_writes_a_file_is_one_line(tiny_embedded, tmp_path, capsys, name):
    (tmp_path / "run" / name).mkdir(parents=True)
    args = _args(tiny_embedded, tmp_path / "run", **{"train.max_steps": 1, "train.resume": "latest"})
    for check in (["--check"], []):  # (checkpoints/latest was found only at the first save)
        said = f"{tmp_path / 'run' / name} is a folder where the run writes a file"
        _fails(capsys, check + args, "train.run_dir", said)


@pytest.mark.parametrize("name", [".fastclip.lock", "metrics.jsonl", "config.yaml"])
def test_a_file_the_run_writes_that_cannot_be_written_is_one_line(tiny_embedded, tmp_path, capsys, name):
    """A broken link stands in for any file that will not open for writing (another owner's, a read-only mount:
    as root here, permissions cannot refuse): a FileNotFoundError/PermissionError traceback at the first write."""
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(tmp_path / "gone" / name)
    args = _args(tiny_embedded, run, **{"train.max_steps": 1, "train.resume": "latest"})
    for check in (["--check"], []):
        said = f"{run / name} cannot be written: No such file or directory (a broken symbolic link to"
        _fails(capsys, check + args, "train.run_dir", said)
    assert not (tmp_path / "gone").exists() and sorted(p.name for p in run.iterdir()) == [name]
    (tmp_path / "gone").mkdir()  # a link into a folder that is there: the run's write makes its file
    assert main(["--check", *args]) == 0
    assert main(args) == 0 and (tmp_path / "gone" / name).exists()
    capsys.readouterr()
    if Path("/proc/self").is_dir():  # a folder that is there but takes no new file, even from root
        (run / name).unlink()
        (run / name).symlink_to(f"/proc/self/{name}")
        for check in (["--check"], []):
            _fails(capsys, check + args, "train.run_dir", f"{run / name} cannot be written")


def test_resuming_with_max_steps_below_the_checkpoint_is_refused(tiny_embedded, trained, tmp_path, capsys):
    """train.max_steps counts the run's steps in all: below the checkpoint's step nothing would be trained, and
    the run would exit 0 as if it had finished."""
    args = _args(tiny_embedded, trained, **{"train.resume": "latest", "train.max_steps": 1})
    _fails(capsys, ["--check", *args], "train.max_steps", "1 is below step 2 of checkpoint", "raise it")


def test_another_loss_named_on_the_command_line_leaves_out_the_files_options_for_its_loss(
    tiny_embedded, tmp_path, capsys
):
    """configs/embedded.yaml sets v3's rho and γ: `--loss.name openclip` trains openclip with the file's other
    settings (a note names what is left out); an option typed on the command line is still checked."""
    from fastclip.train.cli import main as train_main
    from fastclip.train.config import load_config

    cfg = load_config(EMBEDDED, ["--loss.name", "openclip"])
    err = capsys.readouterr().err.strip()
    assert cfg.loss.rho is None and cfg.loss.gamma_min is None and cfg.loss.temperature == 0.07
    assert err == (
        f"fastclip train: note: --loss.name openclip: {EMBEDDED} sets loss.rho, loss.gamma_min, "
        "loss.gamma_decay_epochs, loss.gamma_schedule for fastclip-v3, which openclip does not take: left out"
    )
    cfg = load_config(EMBEDDED, ["--loss.name", "fastclip-v2", "--loss.rho", "7"])  # v2 takes every one of them
    assert cfg.loss.rho == 7 and cfg.loss.gamma_min is not None and capsys.readouterr().err == ""
    assert load_config(EMBEDDED, ["--loss.name", "fastclip-v3"]).loss.rho is not None  # the file's own loss
    pinned = {"loss.gamma_decay_epochs": _UNSET, "loss.gamma_min": _UNSET}  # typed here, they would be checked
    args = fault_overrides(tiny_embedded, tmp_path / "run", "fastclip-v3", **pinned)
    assert train_main(["--check", "--config", str(EMBEDDED), *args, "--loss.name", "openclip"]) == 0
    # --print-config refuses what the run would: an option typed for a loss that does not take it
    capsys.readouterr()
    assert (
        train_main(["--print-config", "--config", str(EMBEDDED), "--loss.name", "openclip", "--loss.rho", "0.5"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastclip train: config error: config key loss.rho: loss openclip does not take it"), err
    assert "\n" not in err


@pytest.mark.parametrize("what", ["a text file", "a step folder without rank_0.pt", "a text rank_0.pt"])
def test_checkpoint_files_that_are_not_checkpoints_are_one_line(tiny_embedded, trained, tmp_path, capsys, what):
    """A text file given as --train.resume or --model.pretrained, or a step folder with its rank file missing or
    replaced: one line naming the file, no traceback."""
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    run = tmp_path / "run"
    if what == "a text file":
        for flag in ("train.resume", "model.pretrained"):
            _fails(capsys, _args(tiny_embedded, run, **{flag: str(text)}), None, str(text), code=None)
        empty, torn, junk = tmp_path / "empty.pt", tmp_path / "torn.pt", tmp_path / "junk.safetensors"
        empty.write_bytes(b"")
        torn.write_bytes((step_dir(trained, 2) / "model.pt").read_bytes()[:50_000])
        junk.write_text("junk")
        pointer, odd = tmp_path / "checkpoints" / "latest", tmp_path / "odd.pt"
        pointer.parent.mkdir()
        pointer.write_text("step_00000002\n")
        odd.write_bytes(b"\x80\x02step_0001\n")  # a pickle header, then bytes the unpickler fails on (IndexError)
        for file, words in (
            (empty, "the file is empty"),
            (torn, "truncated, still being copied"),
            (junk, ""),
            (
                pointer,
                "is the pointer to the latest step folder (step_00000002), not a checkpoint: pass the run folder",
            ),
            (odd, "not a readable checkpoint file (IndexError"),
        ):
            if file.suffix == ".safetensors" and importlib.util.find_spec("safetensors") is None:
                continue
            _fails(capsys, _args(tiny_embedded, run, **{"model.pretrained": str(file)}), "model.pretrained", words)
        return
    step = run / "checkpoints" / "step_00000002"
    shutil.copytree(step_dir(trained, 2), step)
    (run / "checkpoints" / "latest").write_text("step_00000002")
    shutil.copy(step_dir(trained, 2).parents[1] / "config.yaml", run / "config.yaml")
    if what == "a text rank_0.pt":
        (step / "rank_0.pt").write_text("hello")
    else:
        (step / "rank_0.pt").unlink()
    args = _args(tiny_embedded, run, **{"train.resume": "latest", "train.max_steps": 3})
    err = _fails(capsys, args, "train.resume", str(step / "rank_0.pt"))
    want = (
        "is not a torch checkpoint file"
        if what == "a text rank_0.pt"
        else "is missing, and the checkpoint was saved by 1 rank;"
    )
    assert want in err, err
    _fails(capsys, ["--check", *args], "train.resume", str(step / "rank_0.pt"))


def test_files_and_folders_typed_wrong_in_the_other_commands_are_one_line(trained, tmp_path, capsys):
    """An incomplete model config, a run folder with a broken config.yaml, an --out that is a file: one line, 2."""
    from fastclip.cli import main as fastclip_main

    arch = tmp_path / "arch.json"
    arch.write_text('{"embed_dim": 64}')
    _fails(capsys, ["--check", "--config", str(EMBEDDED), "--model.arch", str(arch)], "model.arch", "lacks")
    arch.write_text("[1, 2]")  # a list: was an AttributeError traceback
    _fails(capsys, ["--check", "--config", str(EMBEDDED), "--model.arch", str(arch)], "model.arch", "JSON list")
    # a text embedding smaller than the tokenizer's ids: --check said ok, the first step died of an IndexError
    tiny = json.loads((Path(EMBEDDED).parent / "models" / "tiny-vit.json").read_text())
    tiny["text_cfg"]["vocab_size"] = 100
    arch.write_text(json.dumps(tiny))
    _fails(
        capsys,
        ["--check", "--config", str(EMBEDDED), "--model.arch", str(arch)],
        "model.arch",
        "text_cfg.vocab_size is 100, but its tokenizer (open_clip's) gives ids up to 49407",
    )
    broken = tmp_path / "broken"
    shutil.copytree(trained, broken)
    (broken / "config.yaml").write_text("data: [1,\n")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("hello")
    for args, words in (
        (["summary", str(broken)], f"{broken / 'config.yaml'}: not valid YAML"),
        (["plot", str(trained), "--out", str(a_file)], "is a file; pass a folder"),
        (["data", "embedded", "--out", str(a_file), "--max-per-class", "2"], "is a file; pass a folder"),
        (["eval", str(trained), "--data", str(tmp_path), "--device", "tpu"], "--device tpu: not a device"),
        (["export", str(trained), "--out", str(tmp_path)], "is a folder; pass the .pt file"),
        (["data", "embedded", "--out", str(tmp_path / "d"), "--max-per-class", "0"], "--max-per-class 0: must be"),
        (["eval", str(trained), "--data", str(tmp_path), "--results", str(tmp_path)], "is a folder"),
        (["eval", str(trained), "--data", str(tmp_path), "--max-samples", "-1"], "--max-samples -1: must be >= 1"),
    ):
        assert fastclip_main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, err


def test_class_names_that_do_not_fit_the_val_data_stop_the_run_in_one_line(tiny_embedded, tmp_path, capsys):
    """A zero-shot class list the val labels do not fit: refused before training when val's first shard shows it
    (--check too); else found by the evaluation: one line naming both files, status 1, the checkpoint of the last
    step written before. A file of another format (a .yaml read line by line) is refused as such. A list per
    dataset: each named dataset's labels against its own list (only unnamed samples were checked)."""
    import json

    from fastclip.data.tario import iter_shard, write_tar
    from fastclip.eval.samples import shard_paths

    names = tmp_path / "classes.txt"
    names.write_text("hello\n")
    val = tmp_path / "val"  # the embedded val without its dataset names: one class list then applies to it
    val.mkdir()
    for shard in shard_paths(tiny_embedded / "val"):
        samples = []
        for raw in iter_shard(shard):
            meta = json.loads(raw.files["json"])
            meta.pop("dataset", None)
            samples.append((raw.key, {**raw.files, "json": json.dumps(meta).encode()}))
        write_tar(val / shard.name, samples)
    run = tmp_path / "run"
    extra = {"train.max_steps": 1, "data.val": str(val), "data.zeroshot": str(names), "eval.at_end": "true"}
    for check in (["--check"], []):
        _fails(capsys, check + _args(tiny_embedded, run, **extra), "data.zeroshot", "names 1 class, but sample")
    assert not (run / "metrics.jsonl").exists()
    yaml = tmp_path / "classes.yaml"
    yaml.write_text("- hello\n")
    _fails(capsys, _args(tiny_embedded, run, **(extra | {"data.zeroshot": str(yaml)})), "data.zeroshot", ".yaml file")
    # one list over samples that name 2 datasets would score both against its classes (found by the evaluation
    # hours in, before): refused up front, as the evaluation picks lists
    extra["data.val"] = str(tiny_embedded / "val")
    for check in (["--check"], []):
        said = "holds one class list ('classes'), which would score the labelled samples of 2+ datasets"
        _fails(capsys, check + _args(tiny_embedded, run, **extra), "data.zeroshot", said, "(fashion-mnist, mnist)")
    # a list named as one of the data's datasets scores that dataset's samples: its labels checked up front
    spec = json.loads((tiny_embedded / "zeroshot.json").read_text())
    mnist = {"datasets": {"mnist": {**spec["datasets"]["mnist"], "classnames": ["zero", "one", "two"]}}}
    (tmp_path / "mnist3.json").write_text(json.dumps(mnist))
    for check in (["--check"], []):
        said = "mnist3.json names 3 classes, but sample"
        args = _args(tiny_embedded, run, **(extra | {"data.zeroshot": str(tmp_path / "mnist3.json")}))
        _fails(capsys, check + args, "data.zeroshot", said)
    assert not run.exists() or not (run / "metrics.jsonl").exists()
    # several lists, one per dataset the samples name: each dataset's labels against its own list, before training
    spec["datasets"]["mnist"]["classnames"] = spec["datasets"]["mnist"]["classnames"][:3]
    (tmp_path / "short.json").write_text(json.dumps(spec))
    extra |= {"data.zeroshot": str(tmp_path / "short.json")}
    for check in (["--check"], []):
        said = "short.json names 3 classes for dataset 'mnist', but sample"
        _fails(capsys, check + _args(tiny_embedded, tmp_path / "run2", **extra), "data.zeroshot", said)
    # a template that cannot take a class name passed the checks and killed the run at its first evaluation
    spec = json.loads((tiny_embedded / "zeroshot.json").read_text())
    spec["datasets"]["mnist"]["templates"] = ["a photo of a {} in {style}."]
    (tmp_path / "style.json").write_text(json.dumps(spec))
    extra |= {"data.zeroshot": str(tmp_path / "style.json")}
    for check in (["--check"], []):
        said = "datasets.mnist: template 0 ('a photo of a {} in {style}.') cannot take the class name"
        _fails(capsys, check + _args(tiny_embedded, tmp_path / "run3", **extra), "data.zeroshot", said)
    assert not (tmp_path / "run3" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- a disk that fills during a save
def test_a_disk_that_fills_inside_torch_save_is_one_line_with_the_bytes(tiny_embedded, tmp_path, capsys, monkeypatch):
    """The disk fills while torch.save writes model.pt: its zip writer then raises "unexpected pos ..." over the
    OSError (issue 39: 92 lines). One line naming the folder, the bytes the save needed and those free; `latest`
    still names the last good step."""
    import errno
    import io
    import os

    from fastclip.checkpoint import files

    class FillsUp(io.FileIO):  # the disk is full after the first 4 KiB of this file
        def write(self, data):
            if self.tell() + len(data) > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    def opener(path, mode="r", *args, **kwargs):
        if "step_00000004" in str(path) and Path(path).name == "model.pt":
            return FillsUp(path, "wb")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(files, "open", opener, raising=False)
    run = tmp_path / "run"
    err = _fails(
        capsys,
        _args(tiny_embedded, run, **{"train.max_steps": 6}),
        None,
        f"cannot write checkpoint {run / 'checkpoints' / 'step_00000004'} (No space left on device): this rank's "
        f"files need about ",
        f"MiB are free on the disk of {run / 'checkpoints'}; nothing of it was kept and "
        f"{run / 'checkpoints' / 'latest'} still names step_00000002",
        code=1,
    )
    assert "unexpected pos" not in err
    needed = float(err.split("need about ")[1].split(" MiB")[0])
    weights = load(step_dir(run, 2) / "model.pt")
    assert needed == pytest.approx(files.tensor_bytes(weights) / 2**20, rel=0.05, abs=0.2)  # model.pt + rank file
    assert latest(run) == "step_00000002" and not list((run / "checkpoints").glob(".tmp_*"))


def test_a_disk_without_room_is_refused_by_the_checks_and_mid_run_is_one_line(tiny_embedded, tmp_path):
    """A file-size limit (RLIMIT_FSIZE) is a disk with that much room left: the kernel refuses a write past it
    (EFBIG) as a full disk does (ENOSPC). The checks probed with an empty file, which a full disk still takes, and
    said ok; metrics.jsonl's write that failed mid-run was a traceback (helper-61)."""
    import resource
    import signal
    import subprocess
    import sys

    def run(limit: int, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
        def limited():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process

        args = fault_overrides(tiny_embedded, run_dir, **{"checkpoint.every_steps": 0, "train.max_steps": 60})
        # -B: a bytecode file cut at the limit would break the next import of that module
        cmd = [sys.executable, "-B", "-m", "fastclip", "train", "--", "--config", str(EMBEDDED), *args, *extra]
        return subprocess.run(cmd, preexec_fn=limited, capture_output=True, text=True, env=clean_env(), timeout=300)

    done = run(2048, tmp_path / "full", "--check")
    assert done.returncode == 2, done.stderr
    assert the_error_line(done.stderr) == (
        f"fastclip train: config error: config key 'train.run_dir': cannot write in {tmp_path} (File too large); "
        "make it writable or choose another --train.run_dir"
    )
    done = run(12000, tmp_path / "fills")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    line = the_error_line(done.stderr)
    assert line.startswith(
        f"fastclip train: error: rank 0: cannot write {tmp_path / 'fills' / 'metrics.jsonl'} at step "
    )
    assert line.endswith(
        f"(File too large); no checkpoint was saved yet. Free space in {tmp_path / 'fills'} (or make it writable), "
        "then start it again with --train.resume latest (from step 0)"
    )


def test_a_lock_file_that_cannot_be_written_is_the_one_line_config_error(tmp_path):
    """The run's lock is its first write: on a disk that filled since the checks, closing the file flushed the
    line again and raised again, past the one-line ConfigError (the session's review)."""
    import subprocess
    import sys

    code = f"""
import resource, signal, types
from pathlib import Path
from fastclip.train import preflight
from fastclip.train.config import ConfigError
resource.setrlimit(resource.RLIMIT_FSIZE, (10, 10))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
cfg = types.SimpleNamespace(train=types.SimpleNamespace(run_dir=Path({str(tmp_path)!r})))
info = types.SimpleNamespace(is_main=True, distributed=False)
try:
    preflight.lock_run_dir(cfg, info)
except ConfigError as e:
    print(e)
"""
    done = subprocess.run([sys.executable, "-B", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == (
        f"config key 'train.run_dir': cannot write in {tmp_path} (its lock file .fastclip.lock: File too large); "
        "free space or make it writable, or choose another --train.run_dir"
    ), done.stdout + done.stderr


def test_disk_full_during_a_save_keeps_the_last_checkpoint(tiny_embedded, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("FASTCLIP_FAULTS", "enospc@checkpoint.model_file:step=4")
    err = _fails(
        capsys,
        _args(tiny_embedded, run, **{"train.max_steps": 6}),
        None,
        f"cannot write checkpoint {run / 'checkpoints' / 'step_00000004'} (No space left on device)",
        "still names step_00000002",
        "--train.resume latest",
        code=1,
    )
    assert err.startswith("fastclip train: error: rank 0:")
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]  # no .tmp_ left behind
    monkeypatch.delenv("FASTCLIP_FAULTS")
    assert main(_args(tiny_embedded, run, **{"train.max_steps": 6, "train.resume": "latest"})) == 0
    assert (checkpoints / "latest").read_text().strip() == "step_00000006"


def test_a_missing_val_folder_is_read_by_rank_0_and_stops_every_rank_in_one_line(tiny_embedded, tmp_path):
    """Rank 0 checks the evaluations' inputs with the manifests and broadcasts its answer (a 1,000-rank job does not
    stat them 1,000 times): every rank exits 2 with the same line, before a tower is built."""
    from helpers import Job

    missing = tmp_path / "no_val"
    args = fault_overrides(tiny_embedded, tmp_path / "run", **{"data.val": str(missing), "eval.at_end": "true"})
    job = Job(args, 2, tmp_path / "job")
    assert job.wait(240) == [2, 2], job.outputs()  # (wait kills the job if it outlasts that)
    said = f"fastclip train: config error: config key 'data.val': {str(missing)!r} does not exist (set it to null"
    for rank in (0, 1):
        lines = [x for x in job.output(rank).splitlines() if x.startswith("fastclip train: config error")]
        assert len(lines) == 1 and lines[0].startswith(said), job.outputs()
    assert "Traceback" not in job.output(0) + job.output(1)


def test_a_rank_that_fails_in_a_save_the_others_name_the_save_and_its_timeout(tiny_embedded, tmp_path):
    from helpers import Job

    run = tmp_path / "run"
    args = fault_overrides(tiny_embedded, run, **{"train.max_steps": 6, "train.dist_timeout_minutes": 10})
    job = Job(args, 2, tmp_path / "job", env={"FASTCLIP_FAULTS": "enospc@checkpoint.model_file:step=4:rank=0"})
    try:
        codes = job.wait(240)
    finally:
        job.kill()
    assert codes == [1, 1], job.outputs()
    lines0 = [x for x in job.output(0).splitlines() if x.startswith("fastclip train: error")]
    assert len(lines0) == 1 and "cannot write checkpoint" in lines0[0], job.outputs()
    lines1 = [x for x in job.output(1).splitlines() if x.startswith("fastclip train: error")]
    assert len(lines1) == 1, job.outputs()
    # the save phase and its own timeout are named, not "during the training step" with the step timeout
    assert "during the checkpoint save at step 4" in lines1[0], lines1[0]
    assert "time out after 10 min, set by train.dist_timeout_minutes" in lines1[0], lines1[0]
    assert "Traceback" not in job.output(0) + job.output(1)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert not list((run / "checkpoints").glob(".tmp_*"))


# ----------------------------------------------------------------------------- launchers (torchrun)
def test_launcher_checks_the_config_before_torchrun(tiny_embedded, tmp_path):
    import subprocess

    from helpers import REPO, clean_env

    out = subprocess.run(
        [
            "bash",
            str(REPO / "launch" / "single_node.sh"),
            str(EMBEDDED),
            "2",
            *fault_overrides(tiny_embedded, tmp_path / "run", **{"data.batch_size": 41}),
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr  # one line, no torchrun traceback
    assert out.stderr.startswith("fastclip train: config error: config key 'data.batch_size': 41 per process x 2")
    assert "ChildFailedError" not in out.stderr and out.stdout == ""
    # --check itself: 0 and one line for a good config, at the world size asked
    from fastclip.train.cli import main as train_main

    assert train_main(["--check", "--world-size", "2", *_args(tiny_embedded, tmp_path / "ok")]) == 0
    assert (
        train_main(["--check", "--world-size", "3", *_args(tiny_embedded, tmp_path / "ok", **{"data.batch_size": 27})])
        == 2
    )


def test_a_rank_whose_every_shard_is_bad_stops_the_job_with_one_line(tmp_path):
    from fastclip.data import build_train_stream
    from fastclip.data.sources.synthetic import write_synthetic

    from helpers import Job

    data = tmp_path / "data"
    write_synthetic(data / "train", [16] * 4)  # fault_overrides() trains on data/train
    stream = build_train_stream(
        {"train": str(data / "train"), "batch_size": 4, "seed": 2024},
        rank=1,
        world_size=2,
        preprocess=lambda x: x,
        tokenizer=lambda x: x,
    )
    shards = sorted((data / "train").glob("*.tar"))
    bad = [shards[int(s)] for s in stream._sequence(0).slots[2:]]  # rank 1's half of epoch 0
    for shard in bad:
        shard.write_bytes(b"not a tar")
    args = fault_overrides(data, tmp_path / "run", **{"data.batch_size": 4, "train.max_steps": 4})
    job = Job(args, 2, tmp_path / "job")
    try:
        codes = job.wait(240)
    finally:
        job.kill()
    assert codes == [1, 1], job.outputs()
    lines = [x for x in job.output(1).splitlines() if x.startswith("fastclip train: error")]
    assert len(lines) == 1 and lines[0].startswith("fastclip train: error: rank 1: no usable sample"), job.outputs()
    for shard in bad:
        assert f"{shard.name} (unreadable_shard" in lines[0]  # (with its detail for the first few)
    assert "Traceback" not in job.output(0) + job.output(1)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["evl"], "fastclip: unknown command 'evl'; did you mean 'eval'?"),
        (["bogus"], "fastclip: unknown command 'bogus'; commands: data, train"),
        (["eval"], "fastclip eval: error: the following arguments are required: checkpoint, --data (see fastclip eval"),
        (["data", "scan"], "fastclip data scan: error: the following arguments are required: shards"),
        (["data", "nothing"], "fastclip data: error: argument command: invalid choice: 'nothing'"),
        (["export", "x", "--out", "y", "--precision", "q"], "argument --precision: invalid choice: 'q'"),
        (["reshard"], "fastclip reshard: error: the following arguments are required: --in, --world-size"),
        (["plot"], "fastclip plot: error:"),
        (["summary", "a", "--bogus"], "fastclip summary: error: unrecognized arguments: --bogus"),
    ],
)
def test_command_line_mistakes_in_every_command_are_one_line_on_stderr(argv, words, capsys):
    """argparse's usage block is for --help: a mistake is one line naming the command, nothing on stdout, exit 2."""
    from fastclip.cli import main as fastclip_main

    try:
        status = fastclip_main(argv)
    except SystemExit as e:  # argparse exits
        status = e.code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert status == 2 and captured.out == "" and len(err.splitlines()) == 1 and words in err, (status, err)


# ----------------------------------------------------------------------------- the operator's run folders and files
def _snapshot(folder: Path) -> dict:
    """Every file under `folder` with its size and mtime: what must be unchanged after a refusal."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_training_into_a_folder_that_holds_a_run_without_resume_is_refused(tiny_embedded, trained, tmp_path, capsys):
    """A fresh start there would cut metrics.jsonl and move `latest` back beside the old step folders: refused,
    naming the folder and its step, with and without --check, the pointer there or not; nothing is touched."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = _snapshot(run)
    args = _args(tiny_embedded, run, **{"train.max_steps": 1})
    words = (f"{run} already holds a run (step 2, {step_dir(run, 2)})", "--train.resume latest", "--train.run_dir")
    _fails(capsys, args, "train.run_dir", *words)
    _fails(capsys, ["--check", *args], "train.run_dir", *words)
    (run / "checkpoints" / "latest").unlink()  # the step folder alone is a run too
    del before[run / "checkpoints" / "latest"]
    _fails(capsys, args, "train.run_dir", *words)
    assert _snapshot(run) == before and len((run / "metrics.jsonl").read_text().splitlines()) == 2
    # `--train.resume latest` in a new folder is still a fresh start (one job script for every job)
    assert main(["--check", *_args(tiny_embedded, tmp_path / "new", **{"train.resume": "latest"})]) == 0


def test_a_run_saved_at_an_epoch_end_resumes_in_the_next_epoch_and_reports_each_epoch_once(
    tiny_embedded, tmp_path, capsys
):
    """The checkpoint at an epoch's last step is written after the epoch ended: the resume starts the next epoch
    instead of ending that one again (which repeated its `data: epoch N` line)."""
    run = tmp_path / "run"
    assert main(_args(tiny_embedded, run, **{"train.epochs": 1})) == 0
    first = capsys.readouterr().out
    model = load(run / "checkpoints" / latest(run) / "model.pt")
    assert model["epoch"] == 1 and first.count("data: epoch 0:") == 1
    assert main(_args(tiny_embedded, run, **{"train.epochs": 2, "train.resume": "latest"})) == 0
    second = capsys.readouterr().out
    assert "data: epoch 0:" not in second and second.count("data: epoch 1:") == 1, second
    assert load(run / "checkpoints" / latest(run) / "model.pt")["step"] == 2 * model["step"]


def test_a_resume_with_nothing_left_to_train_finishes_the_pruning_a_kill_cut_short(tiny_embedded, tmp_path):
    """Killed after the last save but before its pruning (keep_last 2, three step folders): the resume, with no step
    left to train, deletes the oldest; a resume from an older step (to branch) deletes nothing."""
    import shutil

    run = tmp_path / "run"
    args = _args(tiny_embedded, run, **{"train.max_steps": 3, "checkpoint.every_steps": 1, "checkpoint.keep_last": 2})
    assert main(args) == 0
    folders = lambda: sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))  # noqa: E731
    assert folders() == ["step_00000002", "step_00000003"]
    shutil.copytree(step_dir(run, 2), step_dir(run, 1))  # as if step 1's folder had not been pruned yet
    older = _args(tiny_embedded, run, **{"train.max_steps": 2, "checkpoint.keep_last": 2})
    assert main(older + ["--train.resume", str(step_dir(run, 2))]) == 0  # an older one, nothing to train: kept
    assert folders() == ["step_00000001", "step_00000002", "step_00000003"]
    assert main(args + ["--train.resume", "latest"]) == 0
    assert folders() == ["step_00000002", "step_00000003"]


def test_resume_latest_without_the_pointer_takes_the_newest_step_folder(tiny_embedded, trained, tmp_path, capsys):
    """`latest` lost (or a crash between the rename and its write): the newest step folder is resumed, with a note,
    never a silent start from scratch over it; a run folder given as train.resume resolves the same way."""
    from fastclip.checkpoint import resolve_resume

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "checkpoints" / "latest").unlink()
    step2 = _snapshot(step_dir(run, 2))
    old_lines = (run / "metrics.jsonl").read_text().splitlines()
    capsys.readouterr()
    assert resolve_resume(str(run), tmp_path / "elsewhere") == step_dir(run, 2)
    assert resolve_resume(str(run / "checkpoints"), tmp_path / "elsewhere") == step_dir(run, 2)
    note = f"fastclip train: note: {run / 'checkpoints' / 'latest'} is missing; resuming from the newest step folder"
    assert capsys.readouterr().err.strip().splitlines() == [f"{note} {step_dir(run, 2)}"] * 2
    assert main(_args(tiny_embedded, run, **{"train.resume": "latest", "train.max_steps": 3})) == 0
    captured = capsys.readouterr()
    assert f"resumed from {step_dir(run, 2)}" in captured.out, captured.out
    assert captured.err.strip() == f"{note} {step_dir(run, 2)}"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[:2] == old_lines and [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert _snapshot(step_dir(run, 2)) == step2 and latest(run) == "step_00000003"
    # a newer step folder that lost a rank file is passed over, and said so
    (run / "checkpoints" / "latest").unlink()
    (step_dir(run, 3) / "rank_0.pt").unlink()
    assert resolve_resume("latest", run) == step_dir(run, 2)
    assert capsys.readouterr().err.strip() == f"{note} {step_dir(run, 2)} (skipped step_00000003: incomplete)"
    # a pointer naming a step folder that is gone (a crash between a re-saved step's renames): the newest complete
    (run / "checkpoints" / "latest").write_text("step_00000009\n")
    assert resolve_resume("latest", run) == step_dir(run, 2)
    gone = f"{run / 'checkpoints' / 'latest'} names step_00000009, which does not exist; resuming from the newest"
    assert capsys.readouterr().err.strip().startswith(f"fastclip train: note: {gone}")
    # training on from there, keep_last counts complete checkpoints: the incomplete step 3 is not one of them
    args = _args(tiny_embedded, run, **{"train.resume": "latest", "train.max_steps": 4, "checkpoint.keep_last": 1})
    assert main(args) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000003", "step_00000004"]
    assert latest(run) == "step_00000004"
    # step folders none of which holds a model.pt: one line, not a fresh start over them
    broken = tmp_path / "broken"
    (broken / "checkpoints" / "step_00000004").mkdir(parents=True)
    _fails(
        capsys,
        _args(tiny_embedded, broken, **{"train.resume": "latest"}),
        "train.resume",
        "no step folder under",
        "is complete (model.pt and every rank file; newest step_00000004)",
    )
    assert [p.name for p in (broken / "checkpoints").rglob("*")] == ["step_00000004"]
    assert not (broken / "metrics.jsonl").exists()


def test_export_refuses_to_overwrite_a_training_checkpoint(trained, tmp_path, capsys):
    """--out on the model.pt being exported, another file of a step folder, or the checkpoints folder's pointer:
    one line, 2, every file as it was; a re-export over an earlier export still works."""
    from fastclip.eval.export import main as export_main

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = _snapshot(run)
    step = step_dir(run, 2)
    for source, out, where in (
        (run, step / "model.pt", "is the checkpoint being exported"),
        (step / "model.pt", step / "model.pt", "is the checkpoint being exported"),
        (step, step / "rank_0.pt", f"is in the step folder {step}"),
        (step, step / "export.pt", f"is in the step folder {step}"),
        (run, run / "checkpoints" / "latest", f"is in the checkpoints folder {run / 'checkpoints'}"),
    ):
        assert export_main([str(source), "--out", str(out)]) == 2, out
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and where in err, err
        assert "refusing to overwrite a training checkpoint: choose another --out" in err, err
    assert _snapshot(run) == before
    out = run / "export" / "model.pt"
    assert export_main([str(run), "--out", str(out)]) == 0 and export_main([str(run), "--out", str(out)]) == 0


def test_files_that_are_not_a_resume_get_the_right_advice(tiny_embedded, trained, tmp_path, capsys):
    """A rank file has no weights: pass its step folder (resume) or its model.pt (pretrained), never
    --model.pretrained on the rank file; a dict of something else is no checkpoint at all."""
    rank0 = step_dir(trained, 2) / "rank_0.pt"
    err = _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "a", **{"train.resume": rank0}),
        "train.resume",
        f"{rank0} is a fastclip rank file (rank 0 of 1, step 2",
        f"pass its step folder ({rank0.parent})",
    )
    assert "--model.pretrained" not in err
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "b", **{"model.pretrained": rank0}),
        "model.pretrained",
        "a fastclip rank file",
        f"pass the model.pt of its step folder ({rank0.parent / 'model.pt'})",
    )
    other = tmp_path / "other.pt"
    torch.save({"foo": 1}, other)
    err = _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "c", **{"train.resume": other}),
        "train.resume",
        "not a model checkpoint (a dict with keys ['foo'])",
        "pass a run folder, its checkpoints folder or a step_XXXXXXXX folder",
    )
    assert "--model.pretrained" not in err
    assert not any((tmp_path / x / "metrics.jsonl").exists() for x in "abc")
    # fastclip eval given the rank file: the same words, and what to pass instead
    from fastclip.cli import main as fastclip_main

    assert fastclip_main(["eval", str(rank0), "--data", str(tiny_embedded / "val")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a fastclip rank file" in err, err
    assert "pass the model.pt of its step folder" in err, err


def test_a_text_or_csv_file_given_as_a_checkpoint_is_named_as_such(tiny_embedded, tmp_path, capsys):
    """Not "refusing to load pickled objects (Unsupported operand 102)": the file is no torch file at all."""
    csv = tmp_path / "captions.csv"
    csv.write_text("filepath,title\na.jpg,a dog\n")
    for flag in ("train.resume", "model.pretrained"):
        err = _fails(
            capsys,
            _args(tiny_embedded, tmp_path / "run", **{flag: csv}),
            flag,
            f"{csv} is not a torch checkpoint file (it begins b'filepath,tit'",
        )
        assert "pickled" not in err, err


def test_imagenet_val_without_any_scheduled_evaluation_is_named_not_ignored(tiny_embedded, tmp_path, capsys):
    """--imagenet-val with evaluation off is never read: one note says so (with evaluation on, a missing folder is
    an error, tested with the ImageNet evaluation)."""
    missing = tmp_path / "no-imagenet"
    extra = {"eval.every_steps": 0, "eval.at_end": False}
    assert main(_args(tiny_embedded, tmp_path / "run", **extra) + ["--imagenet-val", str(missing), "--check"]) == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if "eval.imagenet_val" in x]
    assert notes == [
        f"fastclip train: note: eval.imagenet_val {missing} is not read: no evaluation is scheduled "
        "(eval.every_steps 0, eval.every_epochs 0, eval.at_end false)"
    ]


def test_the_banner_names_the_precision_and_fp16_on_the_cpu_gets_a_note(tiny_embedded, tmp_path, capsys):
    """OpenCLIP's --precision amp is fp16 autocast: the banner says which precision runs, and on the CPU (where
    float16 autocast is slow) one note says so."""
    assert main(_args(tiny_embedded, tmp_path / "run", **{"train.max_steps": 1}) + ["--precision", "amp"]) == 0
    captured = capsys.readouterr()
    banner = next(x for x in captured.out.splitlines() if x.startswith("fastclip train: fastclip-"))
    assert ", fp16 autocast with loss scaling, " in banner
    assert [x for x in captured.err.splitlines() if "train.precision fp16" in x] == [
        "fastclip train: note: train.precision fp16 (--precision amp) on the CPU: most CPUs have no fast "
        "float16 matmul, so this runs several times slower than fp32, which suits a CPU"
    ]


def test_a_warmup_longer_than_the_run_gets_a_note(tiny_embedded, tmp_path, capsys):
    assert main(_args(tiny_embedded, tmp_path / "run", **{"train.max_steps": 1, "optim.warmup_steps": 50})) == 0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "warmup_steps" in x]
    assert line.startswith(
        "fastclip train: note: optim.warmup_steps 50 > the run's 1 steps: the learning rate never reaches optim.lr "
    )


def test_a_global_batch_larger_than_the_data_is_refused_in_the_words_data_info_uses(tiny_embedded, tmp_path, capsys):
    train = tiny_embedded / "train"
    n = json.loads((train / "manifest.json").read_text())["num_samples"]
    args = _args(tiny_embedded, tmp_path / "run", **{"data.batch_size": n + 1}) + ["--check"]
    _fails(
        capsys,
        args,
        "data.batch_size",
        f"{n + 1} per process x 1 process(es) = {n + 1} is larger than the data ({n} samples per epoch in ",
    )


@pytest.mark.parametrize("mode", ["openclip", "dcl", "fastclip-v1"])
def test_a_global_batch_of_one_sample_is_refused_before_a_step(mode, tiny_embedded, tmp_path, capsys):
    """One sample has no negative: openclip trained at loss 0 with no gradient, silently; dcl and fastclip-v1 (a
    queue or not: it is empty at the first step) passed --check, then the loss's first call was a traceback."""
    for extra in ({}, {"loss.queue_size": 8}):
        args = _args(tiny_embedded, tmp_path / "run", mode, **{"data.batch_size": 1, "train.max_steps": 2, **extra})
        for check in (["--check"], []):
            _fails(capsys, args + check, "data.batch_size", f"a global batch of 1 sample (1 x 1 process(es)) gives "
                   f"{mode}'s anchors no negative: use a global batch of at least 2")  # fmt: skip
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))
    # siglip's lone positive pair still trains
    no_gamma = {"loss.gamma_min": "null", "loss.gamma_decay_epochs": "null", "loss.gamma_schedule": "null"}
    args = _args(tiny_embedded, tmp_path / "sig", "siglip", **{"data.batch_size": 1, "train.max_steps": 1, **no_gamma})
    assert main([*args, "--check"]) == 0, capsys.readouterr().err


def test_a_knn_k_beyond_the_probes_training_features_is_refused_before_training(tiny_embedded, tmp_path, capsys):
    """eval.knn 1000 with 80 probe training samples stopped the run after training, at its first evaluation, naming
    fastclip eval's flags (--knn, --probe-train); now --check and the run refuse it, naming the config keys."""
    n = json.loads((tiny_embedded / "train" / "manifest.json").read_text())["num_samples"]
    extra = {"data.val": tiny_embedded / "val", "eval.at_end": "true", "eval.knn": "[5, 1000]", "train.max_steps": 1}
    args = _args(tiny_embedded, tmp_path / "run", **extra)
    for check in (["--check"], []):
        _fails(capsys, [*args, *check], "eval.knn", f"k 1000 but the probe has at most {n} training features "
               f"(eval.probe_max_train 5000, {n} samples in {tiny_embedded / 'train'}): use k <= {n}")  # fmt: skip
    assert main([*_args(tiny_embedded, tmp_path / "ok", **{**extra, "eval.knn": "[5]"}), "--check"]) == 0


def test_a_queue_too_large_for_memory_is_one_line_naming_it(tiny_embedded, tmp_path):
    """loss.queue_size 1e9 asks for 256 GB at the first step (2·Q·d floats): the allocator's refusal was a 65-line
    traceback; now one line naming the rank, the step, the allocator's words and loss.queue_size first. The process's
    address space is capped at 16 GiB (RLIMIT_AS), so the allocation fails whatever the machine's overcommit."""
    import resource
    import subprocess
    import sys

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))

    args = _args(tiny_embedded, tmp_path / "run", "dcl", **{"loss.queue_size": 1_000_000_000, "train.max_steps": 2})
    done = subprocess.run(
        [sys.executable, "-m", "fastclip", "train", *args],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=cap,
    )
    err = [line for line in done.stderr.splitlines() if not line.startswith("fastclip train: note:")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert err[-1].startswith("fastclip train: error: rank 0 ran out of memory at step "), err
    assert "(training step; " in err[-1] and "can't allocate memory" in err[-1]
    assert "lower loss.queue_size (1,000,000,000: 2 x that many" in err[-1] and "raise optim.accum_steps" in err[-1]


def test_reshard_out_holding_files_is_refused_and_a_failed_reshard_leaves_no_out(
    trained, tmp_path, capsys, monkeypatch
):
    """--out over another checkpoint's rank files would replace them (or leave a larger world size's beside the
    new ones); a reshard that fails or is stopped part-way leaves no --out folder it made."""
    import os
    import signal

    import fastclip.train.reshard as reshard

    from helpers import full_disk_after

    src = step_dir(trained, 2)
    held = tmp_path / "held"
    shutil.copytree(src, held)
    before = {p.name: p.read_bytes() for p in held.iterdir()}
    args = ["--in", str(src), "--world-size", "2", "--out"]
    assert reshard.main([*args, str(held)]) == 2
    assert (
        capsys.readouterr().err
        == f"fastclip reshard: error: --out {held}: exists and holds files; pass a new or empty folder\n"
    )
    assert {p.name: p.read_bytes() for p in held.iterdir()} == before

    save_file = reshard.save_file
    monkeypatch.setattr(reshard, "save_file", full_disk_after(1, save_file))
    assert reshard.main([*args, str(tmp_path / "full" / "out")]) == 1
    assert "No space left on device; nothing was changed" in capsys.readouterr().err
    assert not (tmp_path / "full" / "out").exists()

    def stopped_after_one(payload, path):
        save_file(payload, path)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(reshard, "save_file", stopped_after_one)
    assert reshard.main([*args, str(tmp_path / "stopped")]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "fastclip reshard: stopped by SIGTERM; nothing was changed\n"
    assert not (tmp_path / "stopped").exists()
    monkeypatch.undo()
    assert reshard.main([*args, str(tmp_path / "new")]) == 0
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["rank_0.pt", "rank_1.pt"]


def test_check_finds_a_rank_file_missing_or_cut_short_before_the_job_starts(tiny_embedded, trained, tmp_path, capsys):
    """Each rank reads its own file only once the job runs: --check (the launchers run it first) reads the sizes,
    zip directories and headers of all of them, so a lost, cut-short or misplaced rank_1.pt is one line and status
    2, as rank_0.pt is."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    step = step_dir(run, 2)
    model = load(step / "model.pt")
    torch.save({**model, "world_size": 2}, step / "model.pt")  # as a 2-rank job saved it
    args = ["--check", "--world-size", "2", *_args(tiny_embedded, run, **{"train.resume": "latest"})]
    _fails(capsys, args, "train.resume", f"{step / 'rank_1.pt'} is missing", "saved by 2 ranks")
    data = (step / "rank_0.pt").read_bytes()
    (step / "rank_1.pt").write_bytes(data[: len(data) // 2])
    _fails(capsys, args, "train.resume", f"{step / 'rank_1.pt'} is not whole")
    # another rank's file, or this rank's from another step, under the name: read (its header) and refused
    (step / "rank_1.pt").write_bytes(data)
    _fails(capsys, args, "train.resume", f"{step / 'rank_1.pt'} holds rank 0's state at step 2, not rank 1's at step 2")
    rank_file = load(step / "rank_0.pt")
    torch.save({**rank_file, "rank": 1, "step": 1}, step / "rank_1.pt")
    _fails(capsys, args, "train.resume", f"{step / 'rank_1.pt'} holds rank 1's state at step 1, not rank 1's at step 2")
    torch.save({**rank_file, "rank": 1}, step / "rank_1.pt")
    assert main(args) == 0


def test_a_run_resuming_a_rank_file_of_another_step_is_one_line(tiny_embedded, trained, tmp_path, capsys):
    """(it resumed that rank's data position and per-sample state from the other step, without a word)"""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    step = step_dir(run, 2)
    torch.save({**load(step / "rank_0.pt"), "step": 1}, step / "rank_0.pt")
    args = _args(tiny_embedded, run, **{"train.resume": "latest", "train.max_steps": 3})
    _fails(capsys, args, "train.resume", f"{step / 'rank_0.pt'} holds rank 0's state at step 1, not rank 0's at step 2")
    assert latest(run) == "step_00000002"


def test_sparse_indices_that_would_exhaust_memory_are_refused_before_allocating(tmp_path, capsys):
    """A mistyped --index-offset: 40 samples indexed from 10^13 (one more digit than meant) would have each rank
    allocate per-sample state for 10^13 indices; said before anything is allocated, naming the sizes."""
    from fastclip.data.cli import main as data_main

    data = tmp_path / "data"
    args = ["embedded", "--out", str(data), "--datasets", "mnist", "--max-per-class", "4", "--max-val-per-class", "1"]
    assert data_main([*args, "--index-offset", str(10**13)]) == 0
    capsys.readouterr()
    err = _fails(capsys, ["--check", *_args(data, tmp_path / "run")], "data.train", "per-sample state of each of 1")
    assert "data_size 10,000,000,000,050 (the largest index + 1) for 40 samples" in err, err
    assert "a mistyped --index-offset?" in err


def test_a_resume_with_another_batch_size_is_refused_unless_intended(tiny_embedded, trained, tmp_path, capsys):
    """The steps per epoch, and with them the schedules, follow the batch size (issue 39: 63 -> 250 steps per epoch,
    silently). One line and status 2, with and without --check; with train.resume_batch_change the run goes on and
    the start says the new rule once."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    args = _args(tiny_embedded, run, **{"train.resume": "latest", "data.batch_size": 4, "train.max_steps": 3})
    for check in (["--check"], []):
        _fails(
            capsys,
            check + args,
            "data.batch_size",
            f"4 but checkpoint {step_dir(run, 2)} was trained with 8 per process",
            "resume with --data.batch_size 8, or add --train.resume_batch_change true",
        )
    assert latest(run) == "step_00000002"
    assert main([*args, "--train.resume_batch_change", "true"]) == 0
    out = "".join(capsys.readouterr())
    assert (
        out.count(
            "fastclip train: note: data.batch_size 8 -> 4 per process (train.resume_batch_change): 10 -> 20 "
            "steps per epoch; the lr schedules run on samples seen in steps of 8 samples (the global batch the run "
            "began with), so the lr goes on from where the checkpoint left it; the rest of the interrupted epoch is "
            "served at the new batch size"
        )
        == 1
    )
    assert latest(run) == "step_00000003"
    # the lr of step 3 (samples 16-19) is the batch-8 schedule's third: it was the batch-4 schedule's at its third
    # step of 4 samples (warmup 2x slower), while the note said it went on
    from fastclip.optim import get_lr

    o = yaml.safe_load((run / "config.yaml").read_text())["optim"]
    lr = get_lr(2, base_lr=o["lr"], warmup_steps=o["warmup_steps"], total_steps=3 * 10, lr_min=o["lr_min"])
    assert train_records(run)[-1]["step"] == 3 and train_records(run)[-1]["lr"] == pytest.approx(lr, rel=1e-12)
    assert load(step_dir(run, 3) / "model.pt")["schedules"]["unit"] == 8


def test_check_refuses_a_shard_of_0_bytes(tiny_embedded, tmp_path, capsys):
    """A shard whose copy failed (0 bytes, its manifest listing samples): training would skip its samples, or stop
    when a rank has nothing else; the launchers' check says so in one line (issue 39: it said "ok")."""
    data = tmp_path / "data"
    shutil.copytree(tiny_embedded, data)
    empty = sorted((data / "train").glob("*.tar"))[0]
    empty.write_bytes(b"")
    args = _args(data, tmp_path / "run")
    _fails(capsys, ["--check", *args], "data.train", f"shard {empty} is empty (0 bytes) but its manifest lists 30")


def test_a_pretrained_file_holding_nan_skips_its_steps_then_stops_in_one_line(tiny_embedded, trained, tmp_path, capsys):
    """NaN features from step 1 (issue 39: an AttributeError in log_step, the device-mode skip read overwriting the
    step's refusal): each skipped step is logged, then the divergence stop is one line, status 1."""
    state = load(step_dir(trained, 2) / "model.pt")["state_dict"]
    state["visual.proj"] = torch.full_like(state["visual.proj"], float("nan"))
    torch.save(state, tmp_path / "nan.pt")
    extra = {"model.pretrained": tmp_path / "nan.pt", "train.max_steps": 10, "train.max_nonfinite_steps": 3}
    assert main(_args(tiny_embedded, tmp_path / "run", **extra)) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    skipped = [line for line in out.splitlines() if "skipped (non-finite features" in line]
    assert [line.split(":")[0] for line in skipped] == ["step 1", "step 2", "step 3"], out
    assert err.strip().splitlines() == [err.strip()] and err.startswith(
        "fastclip train: error: 3 steps in a row were skipped for NaN/Inf (steps 1..3; last: non-finite features"
    ), err


def test_an_openclip_pretrained_tag_is_said_to_need_the_file(tiny_embedded, tmp_path, capsys):
    """OpenCLIP's `--pretrained openai` downloads; here nothing is: say so, not only "does not exist"."""
    _fails(
        capsys,
        _args(tiny_embedded, tmp_path / "run", **{"model.pretrained": "openai"}),
        "model.pretrained",
        "openai does not exist (or is not a file); OpenCLIP's pretrained tags are downloaded by open_clip, which "
        "fastclip does not do: download the weights file and pass its path",
    )
