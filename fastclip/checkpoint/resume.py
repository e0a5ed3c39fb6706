"""The two records of a step folder, written and read back to resume one rank (resharding the per-sample state
when the world size changed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fastclip.checkpoint.files import load_file
from fastclip.checkpoint.layout import CHECKPOINT_FORMAT, iter_rank_files, rank_file_name
from fastclip.checkpoint.records import saved_world_size, towers_state
from fastclip.distributed import DistInfo
from fastclip.losses.objective import QUEUE_PREFIX


def model_file_contents(
    *,
    towers: dict,
    loss: dict,
    optimizer: dict,
    scaler: dict,
    step: int,
    epoch: int,
    samples_seen: int,
    world_size: int,
    config: dict,
    schedules: dict,
    arch: str,
    model_config: dict,
    guards: dict,
    data_skip_report: dict,
    momentum_towers: dict | None = None,
) -> dict:
    """model.pt (rank 0): open_clip reads "state_dict" as is; the loss's parameters without per-sample state
    (that is in the rank files); the schedules' horizon and last values, for reading only."""
    return {
        "format": CHECKPOINT_FORMAT,
        "state_dict": towers,
        # the rank files hold the per-sample shards and the feature queue (identical on every rank): not here
        "loss": {k: v for k, v in loss.items() if not k.endswith("_extra_state") and not k.startswith(QUEUE_PREFIX)},
        "optimizer": optimizer,
        "scaler": scaler,
        "step": step,
        "epoch": epoch,
        "samples_seen": samples_seen,
        "world_size": world_size,
        "config": config,
        "schedules": schedules,
        "arch": arch,
        "model_config": model_config,
        "guards": guards,
        "data_skip_report": data_skip_report,
        **({"momentum_towers": momentum_towers} if momentum_towers is not None else {}),  # model.ema_momentum
    }


def rank_file_contents(*, rank: int, world_size: int, step: int, loss_state: dict, data: dict, rng: dict) -> dict:
    """rank_<r>.pt: this rank's shard of the per-sample state, its data-stream position and RNG states."""
    return {"rank": rank, "world_size": world_size, "step": step, "loss_state": loss_state, "data": data, "rng": rng}


@dataclass
class RankResume:
    """Where a resumed rank continues: the run's position, this rank's data-stream state, and its RNG states
    (None at another world size: the streams are reseeded)."""

    step: int
    samples_seen: int
    epoch: int
    data: dict
    rng: dict | None


def restore_rank(
    step_dir: Path, model_file: dict, model: torch.nn.Module, loss_fn: torch.nn.Module, info: DistInfo
) -> RankResume:
    """Load the towers and this rank's per-sample state; at another world size rebuild this rank's shard from
    the old ranks' files, read one at a time, and split the old data positions over the new ranks."""
    from fastclip.data import state_for_new_world_size
    from fastclip.losses import reshard_for_rank

    model.load_state_dict(towers_state(model_file))
    saved_world = saved_world_size(model_file)
    rng = None
    if saved_world == info.world_size:
        rank_file = load_file(step_dir / rank_file_name(info.rank))
        loss_fn.load_state_dict(rank_file["loss_state"])
        data, rng = rank_file["data"], rank_file["rng"]
    else:
        old_data = []  # every old rank's data stream state (small), read on the way

        def old_loss_states():
            for f in iter_rank_files(step_dir, saved_world):
                old_data.append(f["data"])
                yield f["loss_state"]

        if getattr(loss_fn, "uses_sample_state", False):
            loss_fn.load_state_dict(reshard_for_rank(old_loss_states(), info.world_size, info.rank))
        else:  # the same on every old rank (τ, a feature queue): rank 0's
            states = old_loss_states()
            loss_fn.load_state_dict(next(states))
            for _ in states:  # the other old ranks' data positions (old_loss_states keeps them)
                pass
        # the data layer finishes the interrupted epoch from the old position and splits the old ranks' skip
        # counters over the new ranks (fastclip/data/stream.py)
        data = state_for_new_world_size(old_data, info.rank, info.world_size)
    return RankResume(int(model_file["step"]), int(model_file["samples_seen"]), int(model_file["epoch"]), data, rng)


def restore_training_state(model_file: dict, *, scaler, guard, skip_report) -> None:
    """The small state model.pt carries beside the weights (the optimizer is the engine's: engine.load_checkpoint)."""
    scaler.load_state_dict(model_file["scaler"])
    guard.load_state_dict(model_file.get("guards"))
    skip_report.load_state_dict(model_file.get("data_skip_report"))
