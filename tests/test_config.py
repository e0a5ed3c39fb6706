"""Config loading: YAML + overrides, every shipped config valid, errors that name the key."""

from pathlib import Path

import pytest
import yaml

from fastclip.train.cli import main
from fastclip.train.config import Config, ConfigError, load_config, parse_overrides

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path, data, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_shipped_config_loads_and_starts_with_its_command():
    files = sorted(CONFIGS.glob("*.yaml"))
    assert {f.stem for f in files} >= {
        "embedded",
        "cc3m-openclip",
        "cc3m-fastclip-v0",
        "cc3m-fastclip-v1",
        "cc3m-fastclip-v2",
        "cc3m-fastclip-v3",
        "cc12m-fastclip-v3",
        "laion315m-fastclip-v3",
    }
    for f in files:
        first = f.read_text().splitlines()[0]
        assert first.startswith("# ") and ("fastclip train" in first or "launch/" in first), f
        load_config(f)


def test_published_recipes_carry_reference_hyperparameters():
    v3 = load_config(CONFIGS / "cc3m-fastclip-v3.yaml")
    assert (v3.model.arch, v3.data.batch_size, v3.optim.lr, v3.optim.wd, v3.optim.warmup_steps, v3.train.epochs) == (
        "RN50",
        128,
        1e-3,
        0.1,
        10000,
        37,
    )
    assert (
        v3.loss.rho,
        v3.loss.gamma_min,
        v3.loss.gamma_decay_epochs,
        v3.optim.lr_tau,
        v3.optim.lr_tau_schedule,
        v3.data.data_size,
    ) == (6.5, 0.2, 18, 2e-4, "step_thresh", 3318333)
    v2 = load_config(CONFIGS / "cc3m-fastclip-v2.yaml")
    assert (v2.loss.temperature, v2.loss.rho, v2.optim.lr_tau, v2.optim.lr_tau_schedule) == (0.03, 7.0, 0.0133, "const")
    c12 = load_config(CONFIGS / "cc12m-fastclip-v3.yaml")
    assert (c12.model.arch, c12.data.batch_size, c12.optim.lr, c12.loss.rho, c12.optim.lr_tau, c12.train.epochs) == (
        "ViT-B-32",
        256,
        4e-4,
        8.5,
        1e-4,
        33,
    )
    laion = load_config(CONFIGS / "laion315m-fastclip-v3.yaml")
    assert (
        laion.model.arch,
        laion.data.batch_size,
        laion.optim.lr,
        laion.optim.lr_min,
        laion.optim.wd,
        laion.optim.warmup_steps,
        laion.loss.rho,
        laion.loss.gamma_min,
        laion.loss.gamma_decay_epochs,
        laion.loss.eps,
        laion.optim.lr_tau,
    ) == ("ViT-B-16", 320, 2e-4, 4e-5, 0.2, 13200, 16.0, 0.8, 10, 1e-6, 5e-5)
    emb = load_config(CONFIGS / "embedded.yaml")
    assert (emb.model.arch, emb.train.device, emb.loss.name) == ("tiny-vit", "cpu", "fastclip-v3")


def test_overrides_section_alias_and_types(tmp_path):
    path = write(tmp_path, {"optim": {"lr": 0.5}, "loss": {"name": "fastclip-v1"}})
    cfg = load_config(
        path,
        [
            "--optim.lr=1e-3",
            "--batch-size",
            "8",
            "--loss.tau_betas",
            "[0.9, 0.99]",
            "--train.max_steps",
            "null",
            "--lr_tau_scheduler",
            "const",
            "--warmup",
            "5",
        ],
    )
    assert (cfg.optim.lr, cfg.data.batch_size, cfg.loss.tau_betas, cfg.train.max_steps) == (1e-3, 8, [0.9, 0.99], None)
    assert (cfg.optim.lr_tau_schedule, cfg.optim.warmup_steps, cfg.loss.name) == ("const", 5, "fastclip-v1")
    assert parse_overrides(["--rho", "2"]) == {"loss": {"rho": 2}}
    assert Config() == load_config()


@pytest.mark.parametrize(
    "data, overrides, key",
    [
        ({"optim": {"lrr": 0.1}}, [], "optim.lrr"),  # unknown key in the file
        ({"optimizer": {"lr": 0.1}}, [], "optimizer"),  # unknown section
        ({}, ["--optim.nope", "1"], "optim.nope"),  # unknown key on the command line
        ({"optim": {"lr": "fast"}}, [], "optim.lr"),  # wrong type
        ({"data": {"batch_size": 1.5}}, [], "data.batch_size"),  # float for an int
        ({"train": {"tensorboard": "yes"}}, [], "train.tensorboard"),  # str for a bool
        ({"loss": {"name": "fastclip-v9"}}, [], "loss.name"),  # not a choice
        ({"optim": {"lr": -0.1}}, [], "optim.lr"),  # negative lr
        ({}, ["--optim.wd", "-1"], "optim.wd"),
        ({"optim": {"betas": [0.9]}}, [], "optim.betas"),
        ({"loss": {"gamma_min": 0}}, [], "loss.gamma_min"),
        ({"checkpoint": {"keep_last": 0}}, [], "checkpoint.keep_last"),
    ],
)
def test_errors_name_the_key(tmp_path, data, overrides, key):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(path, overrides)


def test_cli_reports_config_errors_before_training(tmp_path, capsys):
    path = write(tmp_path, {"optim": {"lr": -1.0}})
    assert main(["--config", str(path)]) == 2
    assert "optim.lr" in capsys.readouterr().err
    assert main(["--", "--config", str(path), "--optim.lr", "0.1", "--model.bogus", "1"]) == 2
    assert "model.bogus" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert main(["--config", str(path), "--optim.lr", "0.25", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["optim"]["lr"] == 0.25


@pytest.mark.parametrize(
    "text, words",
    [
        (
            "data:\n  batch_size: 8\ntrain:\n  epochs: 1\ndata:\n  workers: 0\n",
            "at line 5, column 1: key 'data' appears twice",
        ),
        ("optim:\n  lr: 1.0\n  lr: 2.0\n", "key 'lr' appears twice"),
        ("data:\n  batch_size: [8,\n", "is not valid YAML at line 3, column 1: expected the node content"),
    ],
)
def test_a_config_file_with_a_repeated_key_or_bad_yaml_is_one_line(tmp_path, capsys, text, words):
    """YAML keeps the last of two equal keys silently (a second `data:` dropped the first): refused, naming the
    line; a syntax error is one line with its position too."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert main(["--check", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and str(path) in err, err


@pytest.mark.parametrize("mode", ["deferred", "eager", "off"])
def test_loss_validate_reaches_the_loss(mode):
    """loss.validate (the input checks: deferred rides the feature all_gather; eager reads back every call; off)."""
    from fastclip.train.net import make_loss

    cfg = load_config(CONFIGS / "embedded.yaml", ["--loss.validate", mode])
    assert make_loss(cfg, data_size=100).validate == mode
    if mode == "off":  # YAML 1.1 reads a bare off as false, in a file as on the command line
        assert load_config(CONFIGS / "embedded.yaml", ["--loss.validate", "false"]).loss.validate == "off"
    with pytest.raises(ConfigError, match="config key 'loss.validate': 'sometimes' is not one of deferred, eager, off"):
        load_config(CONFIGS / "embedded.yaml", ["--loss.validate", "sometimes"])


def test_one_key_given_by_two_spellings_with_different_values_is_a_conflict():
    """--batch-size 32 --data.batch_size 64 is refused, naming both flags as typed; the same flag twice is an
    override (a script's default, then the user's), and two spellings that agree are fine."""
    with pytest.raises(ConfigError) as conflict:
        parse_overrides(["--batch-size", "32", "--data.batch_size=64"])
    assert str(conflict.value) == (
        "config key 'data.batch_size' is given twice with different values: --batch-size 32 and "
        "--data.batch_size 64; keep one"
    )
    assert parse_overrides(["--batch-size", "32", "--batch_size", "64"]) == {"data": {"batch_size": 64}}
    assert parse_overrides(["--lr", "0.001", "--optim.lr", "0.001"]) == {"optim": {"lr": 0.001}}


def test_a_section_that_is_not_a_mapping_is_named_without_its_dot(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"config section 'data' (in {path}): expected a mapping, got 5"


def test_the_loss_section_is_the_loss_options():
    """loss's keys are made from the options of every loss (fastclip/losses/options.py), each null by default (the
    library's default), with the option's type; only the trainer's name and validate are its own (and extra_options,
    a loss of the user's own's other options), and the options the trainer derives or cannot write in YAML are no
    keys."""
    import dataclasses

    from fastclip.losses import LOSSES, option_names
    from fastclip.train.config import LossConfig

    keys = {f.name: f.default for f in dataclasses.fields(LossConfig)}
    options = set().union(*(option_names(name) for name in LOSSES))
    derived_or_objects = {"data_size", "lr_tau", "embed_dim", "unimodal", "group", "state_device", "state_dtype"}
    assert set(keys) == options - derived_or_objects - {"check_parameters", "learn_bias"} | {"name", "extra_options"}
    assert {k: v for k, v in keys.items() if v is not None} == {"name": "fastclip-v3", "validate": "deferred"}
    assert load_config(None, ["--loss.tau_betas", "[0.5, 0.9]"]).loss.tau_betas == [0.5, 0.9]  # a tuple option
    with pytest.raises(ConfigError, match="config key 'loss.similarity': 'cos' is not one of cosine, atanh"):
        load_config(None, ["--loss.similarity", "cos"])
    with pytest.raises(ConfigError, match=r"config key 'loss.gamma_min': must be in \(0, 1\] \(got 1.5\)"):
        load_config(None, ["--loss.gamma_min", "1.5"])


def test_the_stream_and_the_data_section_share_their_defaults():
    """The trainer's data section extends the stream's options (fastclip/data/stream.py): one default each."""
    import dataclasses

    from fastclip.data import StreamConfig, StreamOptions
    from fastclip.train.config import DataConfig

    data, stream = DataConfig(), StreamConfig(train="t", batch_size=8)
    shared = {f.name for f in dataclasses.fields(StreamOptions)} - {"train", "batch_size", "seed", "pin_memory"}
    assert {k: getattr(stream, k) for k in shared} == {k: getattr(data, k) for k in shared}
    assert stream.workers == data.workers == 1 and stream.remote_retry_delays == [1.0, 3.0, 9.0]
    assert (data.seed, stream.seed) == (None, 0)  # null: train.seed in the trainer; a stream by itself: 0
