"""DeepSpeed ZeRO as the trainer's backend (train.distributed: deepspeed, fastclip/train/engine.py), 2 processes
on gloo/CPU: the same parameters, temperature and per-sample state as DDP, exact resume through DeepSpeed's
shards, sharded optimizer state (ZeRO-1/2/3), a consolidated open_clip-loadable model.pt under ZeRO-3, and the
combinations that are refused. One 2-process spawn runs every trainer run (each start imports torch, open_clip
and deepspeed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from fastclip.train.cli import main  # noqa: E402
from fastclip.train.config import ConfigError, load_config  # noqa: E402

from dist_utils import run_distributed  # noqa: E402
from helpers import EMBEDDED, assert_same, load, records, removed_unless_failed, train_records  # noqa: E402
from helpers import overrides as shared_overrides  # noqa: E402

STEPS = 4  # 2 x 8 per step; 80 training samples -> 5 steps per epoch


def overrides(data: Path, run_dir: Path, **extra) -> list[str]:
    return shared_overrides(data, run_dir, **{"train.max_steps": STEPS, **extra})


V2 = {
    "loss.name": "fastclip-v2",
    "loss.rho": 7.0,
    "loss.temperature": 0.03,
    "optim.lr_tau": 0.0133,
    "optim.lr_tau_schedule": "const",
}
ZERO = {s: {"train.distributed": "deepspeed", "deepspeed.stage": s} for s in (1, 2, 3)}
RUNS = {  # name -> overrides; "split" stops after step 3 (last checkpoint at 2) and is resumed to STEPS
    "ddp": {},
    "zero2": ZERO[2],
    "zero2-split": {**ZERO[2], "train.max_steps": 3, "checkpoint.at_end": False},
    "zero2-split@": {**ZERO[2], "train.resume": "latest"},
    "ddp-clip": {"optim.grad_clip": 0.5},  # the norm is ~1-2: every step is clipped
    "zero1-clip": {**ZERO[1], "optim.grad_clip": 0.5},
    # stage 3 with every parameter sharded (no small-parameter exemption), evaluated at the end
    "zero3": {**ZERO[3], "deepspeed.param_persistence_threshold": 0, "eval.at_end": True},
    "zero2-accum2": {**ZERO[2], "optim.accum_steps": 2},
    "ddp-v2": V2,
    "zero2-v2": {**V2, **ZERO[2]},
}


def _train_runs(rank, world_size, runs):
    from fastclip.train.trainer import train

    return [train(load_config(EMBEDDED, args))["step"] for args in runs]


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory, request):
    root = tmp_path_factory.mktemp("ds-runs")
    args = [overrides(data, root / name.rstrip("@"), **extra) for name, extra in RUNS.items()]
    steps = run_distributed(_train_runs, 2, args, timeout=420)
    assert steps == [[3 if name == "zero2-split" else STEPS for name in RUNS]] * 2
    yield from removed_unless_failed(request, root)


def final(root: Path, name: str, file: str = "model.pt") -> dict:
    return load(root / name / "checkpoints" / f"step_{STEPS:08d}" / file)


def close(a: torch.Tensor, b: torch.Tensor, where: str, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")


def assert_same_training(root: Path, name: str, ref: str = "ddp", **tol):
    """Towers, temperature, per-sample state (both shards) and logged losses of run `name` equal `ref`'s."""
    a, b = final(root, ref), final(root, name)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        close(b["state_dict"][key], a["state_dict"][key], f"{name} {key}", **tol)
    assert a["loss"].keys() == b["loss"].keys()
    for key in a["loss"]:
        close(b["loss"][key], a["loss"][key], f"{name} loss.{key}", **tol)
    for r in range(2):
        sa = final(root, ref, f"rank_{r}.pt")["loss_state"]["_extra_state"]
        sb = final(root, name, f"rank_{r}.pt")["loss_state"]["_extra_state"]
        assert torch.equal(sa["seen"], sb["seen"]) and sa["seen"].sum() > 0
        for field in sa["fields"]:
            # v3 keeps log u: an absolute error in log u is a relative error in u, held to the same rtol
            field_tol = dict(tol, atol=max(tol.get("rtol", 1e-5), 1e-5)) if field.startswith("log_") else tol
            close(sb["fields"][field], sa["fields"][field], f"{name} rank {r} state {field}", **field_tol)
    ra, rb = (train_records(root / run) for run in (ref, name))
    assert len(ra) == len(rb) == STEPS
    for key in ("loss", "grad_norm"):  # DeepSpeed's pre-step norm (towers' partitions + temperature) = DDP's
        assert [r[key] for r in rb] == pytest.approx([r[key] for r in ra], rel=10 * tol.get("rtol", 1e-5)), key


def optimizer_shard_numel(step_dir: Path, rank: int) -> int:
    """Elements of the fp32 master partition in rank `rank`'s ZeRO optimizer file."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        state = torch.load(
            step_dir / "deepspeed" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            map_location="cpu",
            weights_only=True,
        )["optimizer_state_dict"]
    groups = state.get("single_partition_of_fp32_groups") or state["fp32_flat_groups"]  # stages 1-2 / 3
    return sum(t.numel() for t in groups)


# ----------------------------------------------------------------------------- equality with DDP
def test_zero2_equals_ddp(runs):
    assert_same_training(runs, "zero2")


def test_zero1_with_gradient_clipping_equals_ddp(runs):
    """Towers (sharded, clipped inside DeepSpeed's step) and temperature (outside) clipped by their joint norm.
    Zero-3's tolerance: the clip factor comes from a norm reduced in another order, and Adam turns the rounding of
    a gradient element that nearly cancels (a barely used position's embedding) into a visible part of its step
    (1.5e-6, 1 element of 4,096, after a change of the loss's rounding alone)."""
    assert_same_training(runs, "zero1-clip", ref="ddp-clip", rtol=1e-4, atol=1e-5)


def test_zero3_equals_ddp(runs):
    # stage 3 reduce-scatters gradients in its own buckets (another summation order): Adam's first steps turn
    # last-bit differences of near-zero gradients into ~1e-6 parameter differences (lr 1e-3)
    assert_same_training(runs, "zero3", rtol=1e-4, atol=1e-5)


def test_zero2_with_gradient_accumulation_equals_ddp(runs):
    """accum_steps = 2 under ZeRO-2 (DeepSpeed's micro-steps, one loss call per step) = DDP without it."""
    assert_same_training(runs, "zero2-accum2", rtol=1e-4, atol=2e-5)


def test_zero2_without_temperature_parameter_v2(runs):
    """v2 keeps its temperatures in the per-sample state: no temperature optimizer beside DeepSpeed's."""
    assert_same_training(runs, "zero2-v2", ref="ddp-v2")
    assert final(runs, "zero2-v2")["optimizer"]["temperature"] is None


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoint_layout_and_sharded_optimizer(runs):
    from fastclip.models import build_model

    # every trainable tower tensor (the towers' own logit_scale is frozen: the loss owns the temperature)
    model_numel = sum(p.numel() for n, p in build_model("tiny-vit").model.named_parameters() if n != "logit_scale")
    for name, stage in (("zero1-clip", 1), ("zero2", 2), ("zero3", 3)):
        root = runs / name / "checkpoints"
        step_dir = root / f"step_{STEPS:08d}"
        assert (root / "latest").read_text().strip() == step_dir.name
        assert {"model.pt", "rank_0.pt", "rank_1.pt", "deepspeed"} <= {p.name for p in step_dir.iterdir()}
        assert not (root / "deepspeed").exists() and not (step_dir / "deepspeed" / "latest").exists()
        model = load(step_dir / "model.pt")
        assert model["optimizer"]["backend"] == "deepspeed" and model["optimizer"]["stage"] == stage
        assert model["config"]["train"]["distributed"] == "deepspeed"
        # each rank holds half of the optimizer's fp32 master weights (plus alignment padding), not all of them
        shards = [optimizer_shard_numel(step_dir, r) for r in range(2)]
        assert model_numel <= sum(shards) <= model_numel + 4096, (shards, model_numel)
        assert all(s <= model_numel // 2 + 2048 for s in shards), (shards, model_numel)
        # the towers' frozen logit_scale carries the learned temperature (open_clip reads it)
        close(model["state_dict"]["logit_scale"], model["loss"]["logit_scale"], f"{name} logit_scale")


def test_zero3_model_file_is_consolidated_and_loads_into_open_clip(runs):
    from fastclip.models import build_model

    model = final(runs, "zero3")
    fresh = build_model("tiny-vit").model
    fresh.load_state_dict(model["state_dict"], strict=True)  # full shapes, every key (gathered from the shards)
    for key, value in fresh.state_dict().items():
        assert value.shape == final(runs, "ddp")["state_dict"][key].shape
    # stage 3 saves no whole module: DeepSpeed's per-rank model files are small, the parameters live in the shards
    ds_dir = runs / "zero3" / "checkpoints" / f"step_{STEPS:08d}" / "deepspeed"
    sizes = [p.stat().st_size for p in ds_dir.glob("zero_pp_rank_*_model_states.pt")]
    assert len(sizes) == 2 and max(sizes) < 4 * 2**20 / 10  # well under the 7.2M-parameter model's 29 MB
    # the end-of-run evaluation ran with whole parameters on both ranks
    evals = [r for r in records(runs / "zero3") if any("eval/" in k for k in r)]
    top1 = [v for k, v in evals[-1].items() if k.endswith("top1")]
    assert top1 and all(0.0 <= v <= 1.0 for v in top1)


def test_zero2_resume_equals_uninterrupted(runs):
    """Stopped after step 3 with the last checkpoint at step 2, resumed through DeepSpeed's shards to step 4:
    everything equals the uninterrupted ZeRO-2 run bitwise (CPU, fp32)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    full = runs / "zero2" / "checkpoints" / f"step_{STEPS:08d}"
    split = runs / "zero2-split" / "checkpoints" / f"step_{STEPS:08d}"
    a, b = load(full / "model.pt"), load(split / "model.pt")
    for key in ("state_dict", "loss", "optimizer", "scaler", "step", "epoch", "samples_seen"):
        assert_same(a[key], b[key], key)
    for r in range(2):
        ra, rb = load(full / f"rank_{r}.pt"), load(split / f"rank_{r}.pt")
        for key in ("loss_state", "data", "rng"):
            assert_same(ra[key], rb[key], f"rank {r} {key}")
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            oa, ob = (
                torch.load(
                    d / "deepspeed" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                    map_location="cpu",
                    weights_only=True,
                )["optimizer_state_dict"]
                for d in (full, split)
            )
        assert_same(oa["base_optimizer_state"], ob["base_optimizer_state"], f"rank {r} ZeRO Adam moments")
        assert_same(oa["single_partition_of_fp32_groups"], ob["single_partition_of_fp32_groups"], f"rank {r} fp32")
    assert [r["step"] for r in records(runs / "zero2-split")] == list(range(1, STEPS + 1))


# ----------------------------------------------------------------------------- refused combinations
def test_config_errors_name_the_key(tmp_path):
    base = ["--train.distributed", "deepspeed"]
    for extra, key in (
        (["--train.precision", "fp16"], "train.precision"),
        (["--optim.optimizer", "lamb"], "optim.optimizer"),
        (["--deepspeed.stage", "4"], "deepspeed.stage"),
        (["--deepspeed.stage", "3", "--model.compile", "true"], "model.compile"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(EMBEDDED, base + extra)
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"train_batch_size": 3}))
    from fastclip.train.engine import deepspeed_config

    with pytest.raises(ConfigError, match="deepspeed.config_file"):
        deepspeed_config(load_config(EMBEDDED, base + ["--deepspeed.config_file", str(ds_file)]), 2)
    ds_file.write_text(json.dumps({"zero_optimization": {"round_robin_gradients": True}, "prescale_gradients": True}))
    merged = deepspeed_config(load_config(EMBEDDED, base + ["--deepspeed.config_file", str(ds_file)]), 2)
    assert merged["zero_optimization"] == {**merged["zero_optimization"], "stage": 2, "round_robin_gradients": True}
    assert merged["prescale_gradients"] is True and merged["train_batch_size"] == 64 * 2


@pytest.mark.parametrize(
    "text, said",
    [
        ("[1, 2]", "holds a JSON list, not an object of DeepSpeed settings"),
        ('{"train_batch_size": 3}', "sets ['train_batch_size']; the trainer sets these"),
        ("{bad", "cannot read"),
        (None, "cannot read"),
    ],
)
def test_check_reads_the_deepspeed_config_file(data, tmp_path, capsys, text, said):
    """`--check` read no deepspeed.config_file: a missing, torn or clashing one failed on every rank once the towers
    were built (a JSON list, in a TypeError traceback)."""
    ds_file = tmp_path / "ds.json"
    if text is not None:
        ds_file.write_text(text)
    args = ["--config", str(EMBEDDED), *overrides(data, tmp_path / "run", **ZERO[2])]
    one_line = ["--check", "--world-size", "2", *args, "--deepspeed.config_file", str(ds_file)]
    assert main(one_line) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'deepspeed.config_file'" in err and said in err, err


@pytest.mark.parametrize("stage_run", ["zero2", "zero3"])
def test_a_missing_or_cut_deepspeed_shard_is_one_line_from_check(runs, data, tmp_path, capsys, stage_run):
    """(it failed on one rank inside DeepSpeed's load_checkpoint, after the towers were built; slurm.sbatch's
    --check passed it)"""
    import shutil

    step = tmp_path / "step_00000002"
    shutil.copytree(runs / stage_run / "checkpoints" / "step_00000002", step)
    stage = 3 if stage_run == "zero3" else 2
    args = ["--config", str(EMBEDDED), *overrides(data, tmp_path / "run", **ZERO[stage], **{"train.resume": step})]
    check = ["--check", "--world-size", "2", *args]
    assert main(check) == 0, capsys.readouterr().err
    capsys.readouterr()
    shard = step / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    whole = shard.read_bytes()
    for cut, said in [(None, "is missing"), (whole[: len(whole) // 2], "is cut or not a torch.save file")]:
        shard.unlink(missing_ok=True)
        if cut is not None:
            shard.write_bytes(cut)
        assert main(check) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"DeepSpeed's {shard} {said}" in err, err


def test_one_process_and_backend_mismatch_are_refused(runs, data, tmp_path, capsys):
    # one process: nothing to shard over
    assert main(["--config", str(EMBEDDED), *overrides(data, tmp_path / "one", **ZERO[2])]) == 2
    assert "train.distributed" in capsys.readouterr().err
    # a ZeRO checkpoint resumed with ddp: its optimizer state is in DeepSpeed's shards
    old = runs / "zero2" / "checkpoints" / "step_00000002"
    assert main(["--config", str(EMBEDDED), *overrides(data, tmp_path / "ddp", **{"train.resume": old})]) == 2
    err = capsys.readouterr().err
    assert "train.distributed" in err and "deepspeed" in err
