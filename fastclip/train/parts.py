"""The run's parts that need the trainer's objects to save and load (fastclip/checkpoint/manager.py): the towers,
saved through the engine and checked against the architecture, and the optimizer(s) of the engine; the run's
CheckpointManager."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from fastclip.checkpoint import CHECKPOINTS, strip_module_prefix
from fastclip.checkpoint.manager import CheckpointManager, SavedCheckpoint
from fastclip.checkpoint.parts import LossParameters, Record, Value
from fastclip.train import preflight


class Towers:
    """model.pt "state_dict": the towers in open_clip's names. Saved through the engine (a gather under ZeRO-3: every
    rank calls it); loaded strictly (a partial load would train a half-random model without a word), before the
    engine wraps the towers."""

    collective = True

    def __init__(self, model: torch.nn.Module, *, gather: Callable[[], dict | None], what: str):
        self.model, self.gather, self.what = model, gather, what

    def state_dict(self) -> dict | None:
        return self.gather()

    def check(self, state: dict) -> None:
        preflight.check_fits(self.model, dict(strip_module_prefix(state)), self.what, "train.resume")

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(dict(strip_module_prefix(state)))


class Optimizer:
    """model.pt "optimizer": the engine's record (DDP: torch's state_dict; DeepSpeed: the temperature's, and where
    its shards are: the engine reads them from the step folder resumed from)."""

    def __init__(self, engine, step_dir: Path | None):
        self.engine, self.step_dir = engine, step_dir

    def state_dict(self) -> dict:
        return self.engine.optimizer_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_optimizer(state, self.step_dir)


def run_checkpoints(cfg, info, resume: SavedCheckpoint | None, *, write_extra: Callable[[Path], None]):
    """(the run's CheckpointManager, whether the step resumed from is one of this run's checkpoints). Every part of
    the run's state is added to it by name as it is built (and loaded then, resuming). A checkpoint of this run
    exists at the step resumed from; one taken from elsewhere does not (so the run saves its own at that step)."""
    root = Path(cfg.train.run_dir) / CHECKPOINTS
    manager = CheckpointManager(
        root,
        info,
        keep_last=cfg.checkpoint.keep_last,
        durable=cfg.checkpoint.fsync,
        write_extra=write_extra,
        resume=resume,
    )
    return manager, resume is not None and resume.step_dir.parent.resolve() == root.resolve()


def run_parts(run) -> dict:
    """model.pt's parts of a run beside its towers: the loss's parameters (for export and eval; each rank's file
    restores the loss itself), the optimizer, the counters, the schedules' unit, and records for reading."""
    return {
        "loss": LossParameters(run.loss_fn),
        "optimizer": Optimizer(run.engine, run.resume_dir),  # DeepSpeed: its shards too
        **{counter: Value(run, counter) for counter in ("step", "epoch", "samples_seen")},
        "config": Record(run.cfg.to_dict),
        "schedules": run.schedules,
        "arch": Record(lambda: run.net.built.arch),
        "model_config": Record(lambda: run.net.built.config),
    }
