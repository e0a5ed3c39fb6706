"""The checkpoint manager: a run's stateful parts by name, each saved with its `state_dict()` and restored with its
`load_state_dict(state)` (torchtitan's CheckpointManager is the model). Two kinds of part:

    shared     one state for the whole job, a key of model.pt (rank 0 writes it)
    per rank   each rank's own, a key of rank_<r>.pt; at another world size the part's
               `reshard(old_states, rank, world_size)` builds this rank's state from every old rank's

A run adds its parts as it builds them; when it resumes, each is loaded as it is added (the towers and the loss
before the engine wraps them, the optimizer once it exists, ...). A save writes every part added. Optional on a
part: `check(state)`, which refuses a saved state before it is loaded; `collective = True`, for a state_dict
every rank must call (a gather under ZeRO-3; the other shared parts' state_dict runs on rank 0 only); and
`needs_every_rank(state)`, true where a per-rank part needs every old rank's state at the same world size too
(it is then resharded as at another).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from fastclip.checkpoint.layout import (
    CHECKPOINT_FORMAT,
    is_complete,
    iter_rank_files,
    list_checkpoints,
    load_rank_file,
    prune_checkpoints,
)
from fastclip.checkpoint.records import saved_step, saved_world_size
from fastclip.checkpoint.save import save_checkpoint
from fastclip.distributed import DistInfo

RANK_FILE_KEYS = ("rank", "world_size", "step")  # what the manager itself writes into every rank file


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class SavedCheckpoint:
    """A step folder being resumed from: its model.pt (read and checked before anything was built) and this rank's
    states, read on first use. At another world size the old rank files are read once, one at a time: the first
    per-rank part loaded gets its old states as they are read (the per-sample state: never all in memory), every
    other part's old states are kept for it (data positions, RNG states: small)."""

    def __init__(self, step_dir: Path, model_file: dict, info: DistInfo):
        self.step_dir, self.model_file, self.info = step_dir, model_file, info
        self.world_size = saved_world_size(model_file)
        self._rank_file: dict | None = None
        self._old: dict[str, list] | None = None

    def shared_state(self, name: str) -> Any:
        return self.model_file.get(name)  # None: a part an older checkpoint lacks

    def rank_state(self, name: str, part) -> Any:
        if self.world_size == self.info.world_size:
            if self._rank_file is None:
                self._rank_file = load_rank_file(self.step_dir, self.info.rank, saved_step(self.model_file))
            state = self._rank_file[name]
            if getattr(part, "needs_every_rank", lambda _state: False)(state):
                # e.g. the data position at another layout, same world size: tensors stay on disk (mmap)
                old = (
                    load_rank_file(self.step_dir, r, saved_step(self.model_file), mmap=True)[name]
                    for r in range(self.world_size)
                )
                return part.reshard(old, self.info.rank, self.info.world_size)
            return state
        old = self._old_states(name)
        state = part.reshard(old, self.info.rank, self.info.world_size)
        for _ in old:  # the rest of the pass (a part that read only rank 0's): the others' states are kept
            pass
        return state

    def _old_states(self, name: str) -> Iterator:
        if self._old is not None:
            return iter(self._old.pop(name))
        self._old = {}

        def read():
            for f in iter_rank_files(self.step_dir, self.world_size, saved_step(self.model_file)):
                for key, value in f.items():
                    if key != name and key not in RANK_FILE_KEYS:
                        self._old.setdefault(key, []).append(value)
                yield f[name]

        return read()


class CheckpointManager:
    """Saves every part added into <root>/step_<N>/ (fastclip/checkpoint/save.py) and, resuming, loads each part as
    it is added."""

    def __init__(
        self,
        root: Path,
        info: DistInfo,
        *,
        keep_last: int,
        durable: bool = True,
        write_extra: Callable[[Path], None] | None = None,
        resume: SavedCheckpoint | None = None,
    ):
        self.root, self.info, self.keep_last, self.durable = root, info, keep_last, durable
        self.write_extra, self.resume = write_extra, resume  # write_extra(folder): DeepSpeed's shards
        self.shared: dict[str, Stateful] = {}
        self.per_rank: dict[str, Stateful] = {}

    def add(self, *, shared: dict | None = None, per_rank: dict | None = None, load: bool = True) -> None:
        """Add parts; resuming, load each one now (load=False: the caller loaded it already)."""
        shared, per_rank = shared or {}, per_rank or {}
        self.shared.update(shared)
        self.per_rank.update(per_rank)
        if self.resume is None or not load:
            return
        for name, part in shared.items():
            _load(part, self.resume.shared_state(name))
        for name, part in per_rank.items():
            _load(part, self.resume.rank_state(name, part))

    def save(self, step: int) -> Path:
        """Collective: model.pt on rank 0, every rank its rank file; `latest` moves, old step folders go."""
        info = self.info
        shared = {
            name: part.state_dict()
            for name, part in self.shared.items()
            if info.is_main or getattr(part, "collective", False)
        }
        model_file = {"format": CHECKPOINT_FORMAT, "world_size": info.world_size, **shared} if info.is_main else None
        rank_file = {"rank": info.rank, "world_size": info.world_size, "step": step}
        rank_file.update({name: part.state_dict() for name, part in self.per_rank.items()})
        return save_checkpoint(
            self.root,
            step,
            info,
            model_file=model_file,
            rank_file=rank_file,
            keep_last=self.keep_last,
            write_extra=self.write_extra,
            durable=self.durable,
        )

    def finish_pruning(self) -> None:
        """Rank 0, resumed from this run's newest checkpoint: finish the pruning of its save, which a kill may have
        cut short (an older checkpoint resumed from, to branch, leaves the newer ones to the next save's pruning)."""
        if self.resume is None or not self.info.is_main:
            return
        complete = [p.resolve() for p in list_checkpoints(self.root) if is_complete(p)]
        if complete and complete[-1] == self.resume.step_dir.resolve():
            prune_checkpoints(self.root, self.keep_last, keep=self.resume.step_dir)


def _load(part, state) -> None:
    check = getattr(part, "check", None)
    if check is not None:
        check(state)
    part.load_state_dict(state)


__all__ = ["Stateful", "SavedCheckpoint", "CheckpointManager"]
