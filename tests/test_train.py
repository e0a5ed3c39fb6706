"""The trainer end to end on tiny embedded shards: every mode at 2 processes, exact resume, resume at another
world size, one process, torchrun and SLURM launches, and errors found before training.

Process launches are few (each start imports torch + open_clip): one 2-process spawn runs all modes and the
resume runs in a loop; torchrun and the SLURM-style launch are one 2-process run each; the rest runs here.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastclip.losses import reshard_states
from fastclip.optim import get_lr
from fastclip.train.cli import main
from fastclip.train.config import load_config

from dist_utils import run_distributed
from helpers import EMBEDDED, Job, assert_same, clean_env, load, overrides, records, removed_unless_failed

# a loss name, or name:impl: one per code path of the trainer (v0 and v1 are v3's GCL path with other τ settings,
# and dcl is dcl:moco without the queue: their 2-rank exactness is pinned in test_losses_distributed/_autograd)
MODES = ("openclip", "fastclip-v2", "fastclip-v3", "fastclip-tempnet", "fastclip-v3:autograd", "dcl:moco")
# MoCo/ALBEF: a queue of the momentum towers' features and their soft targets
MOCO = {"loss.queue_size": 24, "loss.distill_alpha": 0.4, "model.ema_momentum": 0.9}


def mode_overrides(data, run_dir, mode, **extra):
    name, _, variant = mode.partition(":")
    more = MOCO if variant == "moco" else {"loss.impl": variant} if variant else {}
    return overrides(data, run_dir, name, **more, **extra)


STEPS = 7  # crosses into epoch 1, where gamma < 1


# ----------------------------------------------------------------------------- 2 processes: modes + resume
def _live_ddp_wrappers() -> int:
    return sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())


def _train_runs(rank, world_size, runs):
    """Each run's last step, and how many DDP wrappers are still alive once train() has returned."""
    from fastclip.train.trainer import train

    return [(train(load_config(EMBEDDED, args))["step"], _live_ddp_wrappers()) for args in runs]


@pytest.fixture(scope="module")
def two_process_runs(data, tmp_path_factory, request):
    """Per mode: an uninterrupted run of STEPS steps, and the same run stopped then resumed from step 4."""
    root = tmp_path_factory.mktemp("runs2")
    runs = []
    for mode in MODES:
        runs.append(mode_overrides(data, root / mode / "full", mode, **{"train.max_steps": STEPS}))
        # stopped after step 5 with the last checkpoint at step 4 (as a crash would leave it)
        split = root / mode / "split"
        runs.append(mode_overrides(data, split, mode, **{"train.max_steps": 5, "checkpoint.at_end": False}))
        runs.append(mode_overrides(data, split, mode, **{"train.max_steps": STEPS, "train.resume": "latest"}))
    results = run_distributed(_train_runs, 2, runs, timeout=900)
    assert [[step for step, _ in rank] for rank in results] == [[STEPS, 5, STEPS] * len(MODES)] * 2
    (root / "live_ddp_wrappers.json").write_text(json.dumps([[live for _, live in rank] for rank in results]))
    yield from removed_unless_failed(request, root)


def _failing_train(rank, world_size, args):
    """train() stopped by its non-finite guard; the caught error (and its traceback) is still held here."""
    from fastclip.train.trainer import train

    os.environ["FASTCLIP_FAULTS"] = "nan@batch:step=2; nan@batch:step=3"
    try:
        train(load_config(EMBEDDED, args))
    except Exception as error:  # noqa: BLE001 - what the CLI does too: hold the error while reporting it
        return type(error).__name__, _live_ddp_wrappers()
    finally:
        del os.environ["FASTCLIP_FAULTS"]
    return None, _live_ddp_wrappers()


def test_no_ddp_wrapper_outlives_a_failed_train(data, tmp_path):
    """The traceback of train()'s error does not keep the DDP wrapper (its frames are cleared): the wrapper is
    freed while the group exists, not after the caller destroys it."""
    args = overrides(data, tmp_path / "run", **{"train.max_steps": 4, "train.max_nonfinite_steps": 2})
    assert run_distributed(_failing_train, 2, args, timeout=200) == [("NonFiniteStepsError", 0)] * 2


def test_no_ddp_wrapper_outlives_train(two_process_runs):
    """train() frees its DDP wrapper before returning: one freed after the group is destroyed makes gloo abort
    the process at exit now and then (SIGABRT, "terminate called without an active exception")."""
    live = json.loads((two_process_runs / "live_ddp_wrappers.json").read_text())
    assert live == [[0] * 3 * len(MODES)] * 2


def _rank_state(step_dir: Path, rank: int) -> dict:
    return load(step_dir / f"rank_{rank}.pt")


@pytest.mark.parametrize("mode", MODES)
def test_two_process_run_of_every_mode(two_process_runs, mode):
    run = two_process_runs / mode / "full"
    mode, _, variant = mode.partition(":")  # the loss name
    recs = records(run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["samples_seen"] for r in recs] == [16 * s for s in range(1, STEPS + 1)]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["objective"]) for r in recs)
    assert recs[0]["samples_per_s"] > 0 and recs[0]["samples_per_s_per_rank"] == pytest.approx(
        recs[0]["samples_per_s"] / 2
    )
    total = 3 * 5  # epochs x steps per epoch: the lr schedule's horizon
    for r in recs:
        assert r["lr"] == pytest.approx(get_lr(r["step"] - 1, base_lr=1e-3, warmup_steps=2, total_steps=total))
    assert [r["epoch"] for r in recs] == [0] * 5 + [1] * (STEPS - 5)
    if mode not in ("openclip", "dcl"):  # gamma: 1 in epoch 0, the cosine at epoch 1 of 2 (gamma_min 0.2) -> 0.6
        assert [r["gamma"] for r in recs] == pytest.approx([1.0] * 5 + [0.6] * (STEPS - 5))

    final = run / "checkpoints" / f"step_{STEPS:08d}"
    assert (run / "checkpoints" / "latest").read_text().strip() == final.name
    model = load(final / "model.pt")
    assert (model["step"], model["world_size"], model["arch"], model["config"]["loss"]["name"]) == (
        STEPS,
        2,
        "tiny-vit",
        mode,
    )
    assert not model["state_dict"]["logit_scale"].requires_grad
    ranks = [_rank_state(final, r) for r in range(2)]
    tau = [r["loss_state"].get("logit_scale") for r in ranks]
    if mode == "fastclip-v2":
        state = [r["loss_state"]["_extra_state"] for r in ranks]
        assert [s["rank"] for s in state] == [0, 1] and [s["world_size"] for s in state] == [2, 2]
        # every one of the 80 samples was served in epoch 0; each rank holds only its owner shard
        assert sum(int(s["seen"].sum()) for s in state) == 80
        size = state[0]["data_size"]  # train + val indices; shard r holds ceil((size - r) / 2) slots
        assert [s["seen"].numel() for s in state] == [-(-(size - r) // 2) for r in range(2)]
        taus = torch.cat([s["fields"]["tau_img"][s["seen"]] for s in state])
        assert (taus != 0.03).all() and (taus >= 0.01).all()
        assert "tau_q50" in recs[-1] and 0.01 <= recs[-1]["tau_q50"] <= 1.0
    elif mode == "fastclip-tempnet":
        heads = [{k: v for k, v in r["loss_state"].items() if k.startswith("tempnet_")} for r in ranks]
        assert heads[0] and all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])  # averaged over ranks
        assert all(torch.equal(model["loss"][k], v) for k, v in heads[0].items())
        assert heads[0]["tempnet_img.out.weight"].abs().sum() > 0  # trained: the output layer started at zero
        state = [r["loss_state"]["_extra_state"] for r in ranks]
        assert sum(int(s["seen"].sum()) for s in state) == 80
        assert 0.01 <= recs[-1]["tau_q05"] <= recs[-1]["tau_q95"] <= 1.0
    else:
        # the temperature parameter is averaged by DDP like the towers: identical on both ranks
        assert torch.equal(tau[0], tau[1])
        assert torch.equal(model["loss"]["logit_scale"], tau[0])
        # the towers' frozen logit_scale carries the learned value (open_clip reads it)
        torch.testing.assert_close(model["state_dict"]["logit_scale"], tau[0])
        learned = mode != "fastclip-v1"
        assert (float(tau[0]) != pytest.approx(math.log(1 / 0.07), abs=1e-7)) == learned
        if mode not in ("openclip", "dcl"):
            state = [r["loss_state"]["_extra_state"] for r in ranks]
            assert sum(int(s["seen"].sum()) for s in state) == 80
    if variant == "moco":  # the queue is full, the same on both ranks, and holds the momentum towers' features
        queues = [{k: v for k, v in r["loss_state"].items() if k.startswith("queue.")} for r in ranks]
        assert queues[0]["queue.indices"].numel() == 24 and (queues[0]["queue.indices"] >= 0).all()
        assert all(torch.equal(queues[0][k], queues[1][k]) for k in queues[0])
        assert not any(k.startswith("queue.") for k in model["loss"])  # in the rank files only
        ema = model["momentum_towers"]
        assert ema.keys() == model["state_dict"].keys()
        moved = [k for k, v in ema.items() if v.is_floating_point() and not torch.equal(v, model["state_dict"][k])]
        assert moved  # an EMA, not a copy
        from fastclip.eval.export import export_model  # exported on request, loadable as the towers are

        written = export_model(final, run / "ema.pt", momentum_towers=True)
        exported = load(written["file"])["state_dict"]
        assert all(torch.equal(exported[k], v) for k, v in ema.items() if k != "logit_scale")
    # towers' weights are trained (not the init) and the optimizer has one state per trainable tensor
    n_groups = {g["name"]: len(g["params"]) for g in model["optimizer"]["param_groups"]}
    learns_tau = ("openclip", "fastclip-v0", "fastclip-v3", "fastclip-tempnet", "dcl")
    assert ("temperature" in n_groups) == (mode in learns_tau)


@pytest.mark.parametrize("mode", MODES)
def test_resume_continues_exactly(two_process_runs, mode):
    """Resumed from step 4 (after running on to step 5 uncheckpointed): parameters, optimizer, scaler,
    per-sample state, data position and RNG at the end equal the uninterrupted run's, bitwise (CPU, fp32)."""
    full = two_process_runs / mode / "full" / "checkpoints" / f"step_{STEPS:08d}"
    split = two_process_runs / mode / "split" / "checkpoints" / f"step_{STEPS:08d}"
    a, b = load(full / "model.pt"), load(split / "model.pt")
    for key in ("state_dict", "loss", "optimizer", "scaler", "step", "epoch", "samples_seen"):
        assert_same(a[key], b[key], key)
    assert a.keys() == b.keys()
    if "momentum_towers" in a:
        assert_same(a["momentum_towers"], b["momentum_towers"], "momentum_towers")
    for r in range(2):
        ra, rb = _rank_state(full, r), _rank_state(split, r)
        for key in ("loss_state", "data", "rng"):
            assert_same(ra[key], rb[key], f"rank {r} {key}")
    # the resumed run continues the metrics file (dropping the uncheckpointed step 5), with the same values
    ra, rb = records(full.parents[1]), records(split.parents[1])
    assert [r["step"] for r in rb] == list(range(1, STEPS + 1))
    for x, y in zip(ra, rb):
        assert (x["loss"], x["objective"], x.get("tau"), x["lr"]) == (y["loss"], y["objective"], y.get("tau"), y["lr"])


def test_resume_at_another_world_size(two_process_runs, data, tmp_path, capsys):
    """2 -> 1: the per-sample state is resharded (every entry kept), weights and optimizer carry over, the data
    position follows the data layer's rule, and training continues; the start says what the layout changed (it
    said only "steps 4 -> 4")."""
    old = two_process_runs / "fastclip-v2" / "split" / "checkpoints" / "step_00000004"
    data_dir = data
    # resume with no further step: the new run's checkpoint holds exactly what was loaded
    args = overrides(data_dir, tmp_path / "one", "fastclip-v2", **{"train.max_steps": 4, "train.resume": old})
    assert main(["--config", str(EMBEDDED), *args]) == 0
    assert (
        "fastclip train: note: resumed at 1 process(es), trained at 2: global batch 16 -> 8, 5 -> 10 steps per "
        "epoch; the lr schedules run on samples seen in steps of 16 samples (the global batch the run began with), "
        "so the lr goes on from where the checkpoint left it, over 0 more steps" in capsys.readouterr().err
    )
    new = tmp_path / "one" / "checkpoints" / "step_00000004"
    m_old, m_new = load(old / "model.pt"), load(new / "model.pt")
    assert m_new["world_size"] == 1
    for key in ("state_dict", "loss", "optimizer", "step", "samples_seen"):
        assert_same(m_old[key], m_new[key], key)
    expected = reshard_states([_rank_state(old, r)["loss_state"] for r in range(2)], 1)[0]
    got = _rank_state(new, 0)["loss_state"]
    assert_same(expected, got, "loss_state")
    assert got["_extra_state"]["world_size"] == 1 and int(got["_extra_state"]["seen"].sum()) == 64
    # the interrupted epoch 0 (80 samples) is finished at the new layout: 64 served at 2 x 8, the rest here
    data_state = _rank_state(new, 0)["data"]
    assert data_state["layout"]["world_size"] == 1 and data_state["epoch"] == 0
    # the one new rank carries both old ranks' tallies (samples served, skip and wrap counters), once each
    old_data = [_rank_state(old, r)["data"] for r in range(2)]
    assert data_state["samples_seen"] == sum(d["samples_seen"] for d in old_data) == 64
    assert data_state["counters"] == {k: sum(d["counters"][k] for d in old_data) for k in old_data[0]["counters"]}
    # and it trains on: 3 more steps at batch 8 on one process
    args = overrides(data_dir, tmp_path / "one", "fastclip-v2", **{"train.max_steps": 7, "train.resume": "latest"})
    assert main(["--config", str(EMBEDDED), *args]) == 0
    recs = records(tmp_path / "one")
    assert [r["step"] for r in recs] == [5, 6, 7] and all(math.isfinite(r["loss"]) for r in recs)
    assert [r["samples_seen"] for r in recs] == [64 + 8, 64 + 16, 64 + 24]
    # the lr goes on in steps of 16 samples, the batch the run began with (it went on in steps of 8: a warmup 2x
    # slower, the lr halved at the resume): steps 5 and 6 (samples 64-79) at schedule step 4, step 7 at 5
    from fastclip.optim import get_lr

    schedules = load(tmp_path / "one" / "checkpoints" / "step_00000007" / "model.pt")["schedules"]
    o = load_config(tmp_path / "one" / "config.yaml").optim
    # the span: 3 epochs of 5 steps of 16. The data rule serves the 16 samples of epoch 0 the old ranks had not
    # served (2 batches of 8) and nothing again, so the run ends where the schedule does: nothing to stretch
    assert schedules["total_steps"] == 3 * 80 // 16 == 15
    lr = lambda at: get_lr(at, base_lr=o.lr, warmup_steps=o.warmup_steps, total_steps=schedules["total_steps"])  # noqa: E731
    assert schedules["unit"] == 16 and [r["lr"] for r in recs] == pytest.approx([lr(4), lr(4), lr(5)], rel=1e-12)
    args = overrides(data_dir, tmp_path / "one", "fastclip-v2", **{"train.resume": "latest"})
    assert main(["--config", str(EMBEDDED), *args]) == 0
    recs = records(tmp_path / "one")
    assert recs[-1]["step"] == 4 + 2 + 2 * 10 and recs[-1]["samples_seen"] == 3 * 80
    assert all(r["lr"] > 0 for r in recs[:-1]), [(r["step"], r["lr"]) for r in recs if r["lr"] <= 0]


def test_resume_at_another_batch_size_serves_the_rest_of_the_epoch_once_and_stretches_the_schedules(
    data, tmp_path, capsys
):
    """Same world size, another layout (data.batch_size 8 -> 14): the data position is rebuilt from every old
    rank's, so epoch 0's 48 unserved samples are served once, in 4 batches of 14 (8 wrapped, counted); epochs 1 and 2
    wrap 4 each. The run is then 16 samples longer than the schedules' 3 epochs, which end with it, said in one
    line."""
    run = tmp_path / "run"
    assert main(["--config", str(EMBEDDED), *overrides(data, run, **{"train.max_steps": 4})]) == 0
    more = {"train.resume": "latest", "data.batch_size": 14, "train.resume_batch_change": True}
    assert main(["--config", str(EMBEDDED), *overrides(data, run, **more)]) == 0
    out = capsys.readouterr().out
    assert (
        "resumed at another data layout: the rest of the run is 16 batches of 14, so the lr schedules now end at "
        "32 steps of 8 samples, not 30" in out
    ), out
    assert "data: epoch 0: 0 sample(s) skipped, summed over ranks; 8 served twice to fill the batches" in out
    recs = records(run)
    assert recs[-1]["step"] == 4 + 4 + 2 * 6 and recs[-1]["samples_seen"] == 4 * 8 + 16 * 14 == 3 * 80 + 16
    assert all(r["lr"] > 0 for r in recs[:-1])
    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    counters = _rank_state(last, 0)["data"]["counters"]
    assert counters["wrapped"] == 16 and sum(counters.values()) == 16  # the batches' fill, and nothing else


def test_a_queue_and_momentum_towers_resume_at_another_world_size(two_process_runs, data, tmp_path):
    """2 -> 1 for dcl with a queue, the momentum towers and distillation: the queue (the same on every old rank)
    and the momentum towers carry over as they were, and training continues."""
    old = two_process_runs / "dcl:moco" / "split" / "checkpoints" / "step_00000004"
    args = mode_overrides(data, tmp_path / "one", "dcl:moco", **{"train.max_steps": 4, "train.resume": old})
    assert main(["--config", str(EMBEDDED), *args]) == 0
    new = tmp_path / "one" / "checkpoints" / "step_00000004"
    m_old, m_new = load(old / "model.pt"), load(new / "model.pt")
    for key in ("state_dict", "loss", "optimizer", "momentum_towers"):
        assert_same(m_old[key], m_new[key], key)
    assert_same(_rank_state(old, 0)["loss_state"], _rank_state(new, 0)["loss_state"], "loss_state (queue)")
    args = mode_overrides(data, tmp_path / "one", "dcl:moco", **{"train.max_steps": 6, "train.resume": "latest"})
    assert main(["--config", str(EMBEDDED), *args]) == 0
    assert [r["step"] for r in records(tmp_path / "one")] == [5, 6]


# ----------------------------------------------------------------------------- one process
def test_single_process_run_with_eval_and_grad_checkpointing(data, tmp_path):
    run = tmp_path / "single"
    # checkpoints by wall clock only (every 1e-6 minutes: every logging step), keeping the last 2
    args = overrides(
        data,
        run,
        "fastclip-v3",
        **{
            "train.max_steps": 3,
            "data.batch_size": 16,
            "eval.at_end": True,
            "model.grad_checkpointing": True,
            "optim.grad_clip": 1.0,
            "optim.optimizer": "lamb",
            "train.tensorboard": True,
            "checkpoint.every_steps": 0,
            "checkpoint.every_minutes": 1e-6,
            "checkpoint.keep_last": 2,
        },
    )
    assert main(["--config", str(EMBEDDED), *args]) == 0
    recs = records(run)
    train_recs = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train_recs] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in train_recs)
    evals = [r for r in recs if any(k.startswith("eval/") for k in r)]
    assert len(evals) == 1 and evals[0]["step"] == 3
    top1 = {k: v for k, v in evals[0].items() if k.endswith("/top1")}
    assert top1 and all(0.0 <= v <= 1.0 for v in top1.values())
    assert (run / "config.yaml").is_file() and load_config(run / "config.yaml").loss.name == "fastclip-v3"
    assert any((run / "tensorboard").iterdir())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000002", "step_00000003"]
    model = load(run / "checkpoints" / "step_00000003" / "model.pt")
    assert model["world_size"] == 1 and model["optimizer"]["param_groups"][0]["name"] == "decay"
    assert model["schedules"]["lr"] == pytest.approx(get_lr(2, base_lr=1e-3, warmup_steps=2, total_steps=3 * 5))


def test_fp16_grad_scaler(data, tmp_path):
    """fp16 autocast with a GradScaler (and gradient clipping after unscaling); the scaler state is saved."""
    run = tmp_path / "fp16"
    args = overrides(
        data, run, "fastclip-v3", **{"train.max_steps": 2, "train.precision": "fp16", "optim.grad_clip": 0.5}
    )
    assert main(["--config", str(EMBEDDED), *args]) == 0
    assert all(math.isfinite(r["loss"]) for r in records(run))
    scaler = load(run / "checkpoints" / "step_00000002" / "model.pt")["scaler"]
    assert scaler["scale"] == 65536.0 and scaler["_growth_tracker"] == 2  # two finite steps at the initial scale


def test_evaluating_every_step_trains_exactly_what_evaluating_never_does(data, tmp_path):
    """An evaluation draws no random number and moves no data state: a run that evaluates after every step ends
    with the same bits as one that never evaluates (the study evaluates its tuning runs less often on that)."""
    states = {}
    for every in (1, 0):
        run = tmp_path / f"eval_every_{every}"
        args = overrides(data, run, "fastclip-v1", **{"train.max_steps": 4, "eval.every_steps": every})
        assert main(["--config", str(EMBEDDED), *args]) == 0
        # steps 1-4 (eval.at_end is off here: the last step is the cadence's)
        assert sum("eval/retrieval/image_to_text_R@1" in r for r in records(run)) == (4 if every else 0)
        model, rank = (load(run / "checkpoints" / "step_00000004" / f) for f in ("model.pt", "rank_0.pt"))
        assert model["config"]["eval"]["every_steps"] == every
        states[every] = [{k: v for k, v in model.items() if k != "config"}, rank]
    assert_same(states[1], states[0])


def test_openclip_with_a_fixed_temperature(data, tmp_path, capsys):
    """loss.learn_temperature false keeps openclip's τ at loss.temperature (the study's fixed-τ control), where the
    default learns it; a loss whose τ is constant anyway (v1) refuses the key."""
    scales = {}
    for learn in ("true", "false"):
        run = tmp_path / f"learn_{learn}"
        args = overrides(data, run, "openclip", **{"train.max_steps": 2, "loss.temperature": 0.05})
        assert main(["--config", str(EMBEDDED), *args, "--loss.learn_temperature", learn]) == 0
        scales[learn] = load(run / "checkpoints" / "step_00000002" / "model.pt")["loss"]["logit_scale"]
    assert scales["false"].item() == torch.tensor(math.log(1 / 0.05)).item()
    assert abs(scales["true"].item() - math.log(1 / 0.05)) > 1e-6
    args = overrides(data, tmp_path / "v1", "fastclip-v1")
    assert main(["--config", str(EMBEDDED), *args, "--loss.learn_temperature", "false"]) == 2
    assert "config key loss.learn_temperature: loss fastclip-v1 does not take it" in capsys.readouterr().err


def test_errors_before_training(data, tmp_path, capsys):
    base = overrides(data, tmp_path / "err", "fastclip-v3")
    assert main(["--config", str(EMBEDDED), *base, "--data.batch_size", "81"]) == 2  # 80 training samples
    err = capsys.readouterr().err
    assert "data.batch_size" in err and "80" in err
    assert main(["--config", str(EMBEDDED), *base, "--data.train", str(tmp_path / "none")]) == 2
    assert "data.train" in capsys.readouterr().err
    # rho typed for v1, which has none (the file's own rho is left out when another loss is named: test_operator_errors)
    assert main(["--config", str(EMBEDDED), *base, "--loss.name", "fastclip-v1", "--loss.rho", "6.5"]) == 2
    assert "config key loss.rho: loss fastclip-v1 does not take it" in capsys.readouterr().err
    assert main(["--config", str(EMBEDDED), *base, "--train.resume", str(tmp_path / "no-such-checkpoint")]) == 2
    assert "train.resume" in capsys.readouterr().err
    assert not (tmp_path / "err" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--loss.distill_alpha", "0.4"], "loss.distill_alpha': needs model.ema_momentum"),
        (["--model.ema_momentum", "1.0"], "model.ema_momentum': must be in (0, 1)"),
        (["--model.ema_momentum", "0.9", "--train.distributed", "deepspeed"], "works with train.distributed ddp"),
        (["--loss.name", "openclip", "--loss.queue_size", "8", "--loss.impl", "fused"], "autograd implementation only"),
        (["--loss.name", "fastclip-v2", "--loss.queue_size", "8"], "per-sample temperatures"),
        (
            ["--loss.distill_alpha", "0.4", "--loss.hard_negative_topk", "2", "--model.ema_momentum", "0.9"],
            "distill_alpha and hard_negative",
        ),  # fmt: skip
    ],
)
def test_an_objective_combination_that_makes_no_sense_is_one_line_before_any_model(data, tmp_path, capsys, args, words):
    base = overrides(data, tmp_path / "err", "dcl", **{"train.max_steps": 1})
    assert main(["--config", str(EMBEDDED), *base, *args, "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "err").exists()


# ----------------------------------------------------------------------------- launchers
def _env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def test_torchrun_two_processes(data, tmp_path):
    run = tmp_path / "torchrun"
    # eager validation: its parameter check reads every call whether DDP kept the ranks' τ equal
    settings = {"train.max_steps": 3, "eval.at_end": True, "data.workers": 1, "loss.validate": "eager"}
    args = overrides(data, run, "fastclip-v3", **settings)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "fastclip",
        "train",
        "--",
        "--config",
        str(EMBEDDED),
        *args,
    ]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 process(es) on cpu (torchrun)" in out.stdout
    # what a user reads: random init said once in our words; no library warnings (DDP's deprecated
    # broadcast_buffers, open_clip's "No pretrained weights loaded" per rank and loader worker)
    assert out.stdout.count("random init") == 1
    for noise in ("FutureWarning", "No pretrained weights", "WARNING:root", "torchvision's C extension"):
        assert noise not in out.stdout + out.stderr, noise
    recs = records(run)
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3]
    assert any(k.startswith("eval/zeroshot/") for k in recs[-1])
    step_dir = run / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in step_dir.iterdir()) == ["model.pt", "rank_0.pt", "rank_1.pt"]


def test_slurm_environment_launch(data, tmp_path):
    """Two plain processes that only know SLURM's variables (as under srun) form the group and train."""
    run = tmp_path / "slurm"
    args = overrides(data, run, "fastclip-v2", **{"train.max_steps": 2, "train.precision": "bf16"})
    slurm = dict(SLURM_NTASKS="2", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost")
    job = Job(
        args,
        2,
        tmp_path / "job",
        rank_env=lambda r, port: dict(slurm, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), MASTER_PORT=str(port)),
    )
    assert job.wait(240) == [0, 0], job.outputs()
    assert "2 process(es) on cpu (slurm)" in job.output(0)
    recs = records(run)
    assert [r["step"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    state = [
        load(run / "checkpoints" / "step_00000002" / f"rank_{r}.pt")["loss_state"]["_extra_state"] for r in range(2)
    ]
    assert [s["rank"] for s in state] == [0, 1]


def test_the_momentum_towers_temperature_does_not_depend_on_when_checkpoints_were_saved(data, tmp_path):
    """The towers' frozen logit_scale is written from the loss's τ at each save; the EMA averaged it too, so the
    momentum towers' copy depended on the save cadence (a stop signal's extra save changed it: a resume was not
    bitwise, 2e-6). Two runs of openclip (learned τ) with a queue of momentum features, saved every 1 and every 4
    steps, end with the same momentum towers, bitwise."""
    ends = []
    for every in (1, 4):
        run = tmp_path / f"every{every}"
        moco = {"loss.queue_size": 24, "model.ema_momentum": 0.9, "train.max_steps": 4, "checkpoint.every_steps": every}
        assert main(["--config", str(EMBEDDED), *overrides(data, run, "openclip", **moco)]) == 0
        ends.append(load(run / "checkpoints" / "step_00000004" / "model.pt"))
    assert_same(ends[0]["momentum_towers"], ends[1]["momentum_towers"], "momentum_towers")
    tau = torch.exp(-ends[0]["momentum_towers"]["logit_scale"])  # the loss's τ at the save, as the online towers'
    assert torch.equal(ends[0]["momentum_towers"]["logit_scale"], ends[0]["state_dict"]["logit_scale"])
    assert abs(float(tau) - 0.07) > 1e-5  # (τ was learned: it moved from its start)


def test_a_resume_without_model_ema_momentum_is_refused_where_the_checkpoint_has_momentum_towers(
    data, tmp_path, capsys
):
    """Resumed without model.ema_momentum, the saved momentum towers were dropped and the queue filled with the
    online towers' features, silently (exit 0): now one line naming the key, exit 2, from --check and the run."""
    run = tmp_path / "moco"
    moco = {"loss.queue_size": 24, "model.ema_momentum": 0.9, "train.max_steps": 2}
    assert main(["--config", str(EMBEDDED), *overrides(data, run, "openclip", **moco)]) == 0
    capsys.readouterr()
    dropped = {"loss.queue_size": 24, "train.max_steps": 4, "train.resume": "latest"}
    for check in (["--check"], []):
        assert main([*check, "--config", str(EMBEDDED), *overrides(data, run, "openclip", **dropped)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "config key 'model.ema_momentum'" in err[0] and "holds momentum towers" in err[0]
    assert main(["--config", str(EMBEDDED), *overrides(data, run, "openclip", **{**moco, **dropped})]) == 0


def test_a_resume_that_changes_the_objective_says_which_settings_changed(data, tmp_path, capsys):
    """A requeue command line that lost --loss.distill_alpha and changed model.ema_momentum and the hard-negative β
    resumed with no word (config ok, exit 0); the start now lists each changed setting with both values. A resume
    with the same settings says nothing."""
    run = tmp_path / "moco"
    first = {"loss.queue_size": 24, "model.ema_momentum": 0.99, "loss.distill_alpha": 0.4, "train.max_steps": 2,
             "loss.temperature": "null"}  # fmt: skip
    assert main(["--config", str(EMBEDDED), *overrides(data, run, "dcl", **first)]) == 0
    capsys.readouterr()
    # the same settings, a default spelled out (dcl's τ 0.07 where it was null) and the micro-batches changed:
    # the same objective, no note
    same = {**first, "train.max_steps": 3, "train.resume": "latest", "loss.temperature": 0.07, "optim.accum_steps": 2}
    assert main(["--config", str(EMBEDDED), *overrides(data, run, "dcl", **same)]) == 0
    assert "not trained with" not in capsys.readouterr().err
    changed = {**same, "train.max_steps": 4, "model.ema_momentum": 0.9, "loss.hard_negative_beta": 0.5}
    del changed["loss.distill_alpha"]
    assert main(["--config", str(EMBEDDED), *overrides(data, run, "dcl", **changed)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "not trained with" in line]
    assert notes == [
        "fastclip train: note: resumed with settings the checkpoint was not trained with: "
        "model.ema_momentum 0.99 -> 0.9, loss.hard_negative_beta null -> 0.5, loss.distill_alpha 0.4 -> null"
    ]


@pytest.mark.parametrize(
    "loss_options, reads",
    [({}, False), ({"queue_size": 8}, True), ({"queue_size": 8, "distill_alpha": 0.4}, True)],
)
def test_momentum_towers_run_only_where_the_loss_reads_their_features(loss_options, reads):
    """model.ema_momentum with no queue and no distillation: the momentum towers' forward ran every step and their
    features doubled the all_gather, read by nothing (the losses were the same to the bit). Now the towers follow
    the EMA alone there; with a queue or distillation their features are the batch's, from the EMA copy."""
    from fastclip.losses import build_loss
    from fastclip.models import build_model
    from fastclip.train.momentum import MomentumTowers
    from fastclip.train.net import TowersWithLoss

    model = build_model("tiny-vit").model
    loss_fn = build_loss("dcl", data_size=16, **loss_options)
    towers = TowersWithLoss(
        model, loss_fn, precision="fp32", compile=False, momentum_towers=MomentumTowers(model, 0.99)
    )
    images, texts = torch.randn(4, 3, 32, 32), torch.randint(0, 100, (4, 32))
    got = towers.encode_momentum(images, texts)
    assert (got is not None) == reads and loss_fn.uses_momentum_features == reads
    if reads:  # the EMA copy starts equal to the towers: the same features as theirs
        want = towers.encode(images, texts)
        assert all(torch.allclose(g, w) for g, w in zip(got, want))


def test_a_linear_probe_during_training_leaves_every_rng_state_as_it_was(data, tmp_path):
    """In a fresh process (its imports are the probe's first), a run with eval.linear_probe and eval.knn every step
    ends with the bits of one that never evaluates, RNG states included: the first probe's imports advanced
    Python's random state, so the rank file's rng.python differed (the weights did not)."""
    states = {}
    for every in (1, 0):  # the probing run in a fresh process; the other needs none (it imports nothing new)
        run = tmp_path / f"probe_every_{every}"
        extra = {"train.max_steps": 2, "eval.every_steps": every, "eval.linear_probe": "true", "eval.knn": "[3]"}
        args = ["--config", str(EMBEDDED), *overrides(data, run, "fastclip-v1", **extra)]
        if every:
            command = [sys.executable, "-m", "fastclip", "train", *args]
            done = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
        else:
            assert main(args) == 0
        assert sum("eval/linear_probe/fashion-mnist/top1" in r for r in records(run)) == 2 * every  # (steps 1, 2)
        model, rank = (load(run / "checkpoints" / "step_00000002" / f) for f in ("model.pt", "rank_0.pt"))
        states[every] = [{k: v for k, v in model.items() if k != "config"}, rank]
    assert_same(states[1], states[0])


def test_an_evaluation_puts_back_every_global_rng_state_it_drew_from(monkeypatch):
    """Whatever an evaluation draws from (an ImageNet DataLoader pass takes its base seed from torch's generator,
    the probe's imports from Python's), the states the rank files save are as before it."""
    import random

    import numpy as np

    from fastclip.train.evaluation import Evaluation

    def draws(self, step, samples_seen):
        random.random(), np.random.rand(), torch.rand(3)

    monkeypatch.setattr(Evaluation, "_evaluate", draws)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    evaluation = object.__new__(Evaluation)
    evaluation.device = torch.device("cpu")
    evaluation.evaluate(1, 8)
    after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state())
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and torch.equal(before[2], after[2])
