"""Stateful parts the manager (fastclip/checkpoint/manager.py) saves and loads, for what has no state_dict of its
own or keeps a state in a form of its own: a plain value, a record kept for reading, the RNG states, the loss's
parameters and per-sample state, the data stream's position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from fastclip.checkpoint.rng import capture_rng_states, restore_rng_states


class Value:
    """An attribute of an object (the step, the epoch): saved as is, set back on load."""

    def __init__(self, owner, name: str, cast: Callable = int):
        self.owner, self.name, self.cast = owner, name, cast

    def state_dict(self):
        return getattr(self.owner, self.name)

    def load_state_dict(self, state) -> None:
        setattr(self.owner, self.name, self.cast(state))


class Record:
    """Written for people and other tools to read (the config, the architecture, the schedules); a resume does not
    load it back."""

    def __init__(self, read: Callable[[], Any]):
        self.read = read

    def state_dict(self):
        return self.read()

    def load_state_dict(self, state) -> None:
        pass


class RNGStates:
    """Per rank: Python's, numpy's, torch's (and the GPU's) generators. At another world size the old ranks' streams
    mean nothing to the new ranks: `reseed()` starts fresh ones, as a new run does."""

    def __init__(self, device: torch.device, reseed: Callable[[], None]):
        self.device, self.reseed = device, reseed

    def state_dict(self) -> dict:
        return capture_rng_states(self.device)

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            self.reseed()
        else:
            restore_rng_states(state, self.device)

    def reshard(self, old_states: Iterator, rank: int, world_size: int) -> None:
        return None


class LossParameters:
    """model.pt "loss": the loss's own parameters (temperature, tempnet heads) for export and eval; without the
    per-sample state and the feature queue, which the rank files hold (LossState)."""

    def __init__(self, loss_fn: torch.nn.Module):
        self.loss_fn = loss_fn

    def state_dict(self) -> dict:
        from fastclip.losses.objective import QUEUE_PREFIX

        state = self.loss_fn.state_dict()
        return {k: v for k, v in state.items() if not k.endswith("_extra_state") and not k.startswith(QUEUE_PREFIX)}

    def load_state_dict(self, state) -> None:
        pass  # the rank files' "loss_state" restores the loss whole

    @staticmethod
    def shapes(loss_fn: torch.nn.Module) -> dict[str, tuple]:
        """The names and shapes state_dict() gives, from the parameters and buffers alone: state_dict() would also
        build the per-sample state (a loss's extra state), which a resume's checks must not allocate."""
        from fastclip.losses.objective import QUEUE_PREFIX

        tensors = [*loss_fn.named_parameters(), *loss_fn.named_buffers()]
        return {k: tuple(v.shape) for k, v in tensors if not k.startswith(QUEUE_PREFIX)}


class LossState:
    """Per rank: the loss's whole state (parameters, this rank's shard of the per-sample state, the feature queue).
    At another world size this rank's shard is rebuilt from the old ranks' (fastclip/losses/sharded_state.py); a loss
    without per-sample state holds the same on every rank: rank 0's."""

    def __init__(self, loss_fn: torch.nn.Module):
        self.loss_fn = loss_fn

    def state_dict(self) -> dict:
        return self.loss_fn.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loss_fn.load_state_dict(state)

    def reshard(self, old_states: Iterator[dict], rank: int, world_size: int) -> dict:
        from fastclip.losses import reshard_for_rank

        if getattr(self.loss_fn, "uses_sample_state", False):
            return reshard_for_rank(old_states, world_size, rank)
        return next(old_states)


class DataPosition:
    """Per rank: the data stream's position. At another layout the data layer finishes the interrupted epoch from
    every old rank's position and splits the old ranks' counters over the new ranks (fastclip/data/stream.py)."""

    def __init__(self, stream):
        self.stream, self.loaded = stream, None  # loaded: the saved state (its layout: what the checkpoint trained at)

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.loaded = None if state is None else {"layout": state.get("layout")}  # (not its tensors: maybe mmap'd)
        self.stream.load_state_dict(state)

    def needs_every_rank(self, state: dict | None) -> bool:
        """At another layout (workers, batch size, shuffle buffer) the interrupted epoch is finished from every old
        rank's position, at the same world size too."""
        return bool(state) and state.get("epoch") is not None and state.get("layout") != self.stream.layout.as_dict()

    def reshard(self, old_states: Iterator[dict], rank: int, world_size: int) -> dict:
        from fastclip.data import state_for_new_world_size

        return state_for_new_world_size(list(old_states), rank, world_size)


__all__ = ["Value", "Record", "RNGStates", "LossParameters", "LossState", "DataPosition"]
