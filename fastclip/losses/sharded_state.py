"""Per-sample state (u, and v2's τ/Adam/bound), sharded by owner: no rank ever holds all ``data_size`` entries.

Entry ``i`` lives on rank ``i % K`` at local slot ``i // K``; rank r has ``ceil((data_size - r) / K)`` slots.
Within a step, every rank reads (owner fills, all_reduce shares) before anything is written, and a global
batch that holds the same index twice writes the value of its LAST occurrence (in rank-major global order).

Saved form (``ShardedSampleState.state_dict()``, carried by the loss module's ``get_extra_state``)::

    {"format": "fastclip-sample-state/1", "data_size": int, "world_size": K, "rank": r, "owner": "modulo",
     "fields": {name: [slots] tensor}, "seen": [slots] bool}

``reshard_for_rank`` builds one new rank's shard from the old shards, read one at a time, and
``reshard_states`` does all new ranks (``fastclip reshard``, fastclip/train/reshard.py, applies them to files).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

FORMAT = "fastclip-sample-state/1"
_CHUNK = 1 << 22  # slots handled at once while resharding, bounds the temporary index tensors


def shard_size(data_size: int, world_size: int, rank: int) -> int:
    return max(0, -(-(data_size - rank) // world_size))


def last_occurrence(indices: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: True where no later position holds the same index (sort-based, deterministic, no sync)."""
    order = torch.sort(indices, stable=True).indices  # equal indices keep their position order
    sorted_idx = indices[order]
    is_last_sorted = torch.ones_like(indices, dtype=torch.bool)
    is_last_sorted[:-1] = sorted_idx[1:] != sorted_idx[:-1]
    is_last = torch.empty_like(is_last_sorted)
    is_last[order] = is_last_sorted
    return is_last


@dataclass
class BatchSlots:
    """A global batch's rows in one shard: ``owned`` [N] bool, ``slots`` [N] (spare slot if not owned),
    ``write_slots`` [N] (spare slot unless owned and the last occurrence of its index; the ``slots`` tensor
    itself when no index repeats: never modify either in place)."""

    owned: torch.Tensor
    slots: torch.Tensor
    write_slots: torch.Tensor


class ShardedSampleState:
    """One rank's shard of named per-sample fields (one ``[slots, F]`` table) plus a ``seen`` flag per slot."""

    def __init__(
        self,
        *,
        data_size: int,
        world_size: int,
        rank: int,
        fields: Mapping[str, float],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.data_size, self.world_size, self.rank = int(data_size), int(world_size), int(rank)
        self.num_slots = shard_size(self.data_size, self.world_size, self.rank)
        self.names = list(fields)
        # Fields are the columns of one table, so a step reads and writes all of them with one gather/scatter.
        # One spare row past the end takes the writes of rows this rank must not write: the write is then a
        # plain scatter with unique targets among real slots, with no host sync to compact the rows.
        initial = torch.tensor([float(v) for v in fields.values()], dtype=dtype, device=device)
        self._table = initial.repeat(self.num_slots + 1, 1)
        self._seen = torch.zeros(self.num_slots + 1, dtype=torch.bool, device=device)
        # When a list: every write() first appends (where, the rows before it), so a caller that decides after
        # the backward not to take the step (the trainer's NaN guard) can roll the writes back (rollback()).
        self.journal: list[tuple[BatchSlots, torch.Tensor]] | None = None
        self.loaded = False  # its values came from load_state_dict (said where it turns out to be another group's)

    @property
    def device(self) -> torch.device:
        return self._table.device

    @property
    def dtype(self) -> torch.dtype:
        return self._table.dtype

    def field(self, name: str) -> torch.Tensor:
        return self._table[: self.num_slots, self.names.index(name)]

    @property
    def seen(self) -> torch.Tensor:
        return self._seen[: self.num_slots]

    def used(self) -> bool:
        """Whether any sample holds a value (written by a call, or loaded); a host read, for the rare paths that ask."""
        return bool(self._seen.any())

    def to_(self, device: torch.device | str, dtype: torch.dtype) -> ShardedSampleState:
        self._table = self._table.to(device=device, dtype=dtype)
        self._seen = self._seen.to(device)
        return self

    def locate(self, indices: torch.Tensor, *, assert_in_range: bool = True, repeats: bool | None = None) -> BatchSlots:
        """Where the global batch's ``indices`` (``[N]``) live in this shard; computed once per step. ``repeats``:
        whether an index occurs twice, when the caller knows (False skips the search for the last occurrences)."""
        indices = indices.to(self.device)
        # (two ops, not three; max(.., 0): with data_size 0 the bound -1 would let index -1 through)
        in_range = indices.clamp(0, max(self.data_size - 1, 0)) == indices
        if self.data_size < 1:
            in_range = torch.zeros_like(in_range)
        # An out-of-range index is never "owned", so it can neither read nor write the spare row (index ==
        # data_size) or wrap to the last slot (index -1). The loss's validation names it (eager: before this;
        # deferred: at check_inputs(), so no assert here); with validation off a device-side assert stops the
        # step (no host sync on CUDA).
        if assert_in_range:
            torch._assert_async(
                in_range.all(),
                "fastclip: a sample index is outside [0, data_size) (run the loss with validate=True to name it)",
            )
        owned = (indices % self.world_size == self.rank) & in_range
        slots = torch.where(owned, indices // self.world_size, self.num_slots)
        write_slots = (
            slots if repeats is False else torch.where(owned & last_occurrence(indices), slots, self.num_slots)
        )
        return BatchSlots(owned=owned, slots=slots, write_slots=write_slots)

    def read(self, where: BatchSlots) -> torch.Tensor:
        """``[N, F+1]``: the fields (in ``names`` order) and ``seen`` (0/1) of the rows this rank owns, 0 elsewhere."""
        values = torch.cat([self._table[where.slots], self._seen[where.slots, None].to(self.dtype)], dim=1)
        return torch.where(where.owned[:, None], values, 0)

    @torch.no_grad()
    def restore(self, where: BatchSlots, saved: torch.Tensor) -> None:
        """Put back the owned rows ``saved = read(where)`` held (fields and ``seen``): undoes a step's ``write``.
        Through the write slots (copies of an index saved the same row; the others go to the spare row)."""
        saved = saved.to(device=self.device, dtype=self.dtype)
        self._table[where.write_slots] = saved[:, :-1]
        self._seen[where.write_slots] = saved[:, -1] > 0.5

    @torch.no_grad()
    def rollback(self, undo: torch.Tensor | None = None) -> None:
        """Undo the journal's writes, newest first, and empty it. With ``undo`` (a 0-d bool on the device), undo
        them only where it is true and keep them otherwise, without a host read."""
        for where, saved in reversed(self.journal or []):
            if undo is not None:  # (a flag decided with the towers' gradients: on their device)
                saved = torch.where(undo.to(self.device), saved, self.read(where))
            self.restore(where, saved)
        if self.journal is not None:
            self.journal.clear()

    def write(self, where: BatchSlots, values: torch.Tensor, *, previous: torch.Tensor | None = None) -> None:
        """Store ``values`` ``[N, F]`` for the owned rows, a repeated index keeping its last occurrence; marks seen.
        ``previous``: what ``read(where)`` returned before this write, as it returned it (same device and dtype), for
        the journal, which otherwise reads the rows again."""
        if self.journal is not None:
            self.journal.append((where, self.read(where) if previous is None else previous))
        self._table[where.write_slots] = values.detach().to(device=self.device, dtype=self.dtype)
        self._seen.index_fill_(0, where.write_slots, True)  # (an assigned Python scalar is a host copy on CUDA)

    def state_dict(self) -> dict:
        # Contiguous CPU copies: checkpoints load anywhere (offline resharding on a machine without the GPU),
        # and a copy never drags the spare row or the whole table into a field's saved storage.
        def export(column: torch.Tensor) -> torch.Tensor:
            return column.clone(memory_format=torch.contiguous_format).cpu()

        return {
            "format": FORMAT,
            "data_size": self.data_size,
            "world_size": self.world_size,
            "rank": self.rank,
            "owner": "modulo",
            "fields": {name: export(self._table[: self.num_slots, col]) for col, name in enumerate(self.names)},
            "seen": export(self.seen),
        }

    def load_state_dict(self, state: Mapping) -> None:
        check_format(state)
        saved = (state["data_size"], state["world_size"], state["rank"])
        if saved[0] != self.data_size:  # another data set, or another data_size given: resharding cannot help
            raise ValueError(
                f"sample state was saved for data_size={saved[0]} but this loss has data_size={self.data_size}: "
                f"build it with data_size={saved[0]} (the data it was trained on), or start its state afresh"
            )
        if (
            saved != (self.data_size, self.world_size, self.rank)
            and self.world_size == 1 < saved[1]
            and not (torch.distributed.is_available() and torch.distributed.is_initialized())
        ):
            raise ValueError(
                f"sample state was saved by rank {saved[2]} of {saved[1]} and this process has no process group "
                "yet: call torch.distributed.init_process_group before loading it, or, to go on in one process, "
                "reshard first (fastclip reshard --in CKPT_DIR --world-size 1, or reshard_for_rank())"
            )
        if saved != (self.data_size, self.world_size, self.rank):
            raise ValueError(
                f"sample state was saved for data_size={saved[0]}, world_size={saved[1]}, rank={saved[2]} but this "
                f"process has data_size={self.data_size}, world_size={self.world_size}, rank={self.rank}; reshard "
                f"first (fastclip reshard --in CKPT_DIR --world-size {self.world_size}, or reshard_for_rank())"
            )
        fields = state["fields"]
        if set(fields) != set(self.names):
            raise StateFieldsMismatch(
                f"sample state fields {sorted(fields)} do not match this loss's {sorted(self.names)}"
            )
        for name, value in list(fields.items()) + [("seen", state["seen"])]:
            if value.shape != (self.num_slots,):
                raise ValueError(
                    f"sample state field {name!r} has shape {tuple(value.shape)}, expected ({self.num_slots},)"
                )
        self.loaded = True
        with torch.no_grad():
            for col, name in enumerate(self.names):
                self._table[: self.num_slots, col].copy_(fields[name])
            self._seen[: self.num_slots].copy_(state["seen"])
            self._seen[self.num_slots] = False


class StateFieldsMismatch(KeyError):
    """A saved sample state whose fields are not this loss's (another objective saved it)."""


def check_format(state: Mapping) -> None:
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"not a {FORMAT} sample state (format: {got!r})")
    if state.get("owner") != "modulo":
        raise ValueError(f"sample state owner map {state.get('owner')!r} is not supported (expected 'modulo')")


def _split(state: Mapping) -> tuple[str | None, Mapping]:
    """A sample state given directly, or a loss module's state_dict that carries one under ``*_extra_state``."""
    if state.get("format") == FORMAT:
        return None, state
    keys = [k for k in state if k == "_extra_state" or k.endswith("._extra_state")]
    if len(keys) != 1:
        raise ValueError(
            f"no sample state found: expected a {FORMAT} dict or a loss state_dict with one "
            f"'_extra_state' entry, got keys {sorted(state)[:10]}"
        )
    return keys[0], state[keys[0]]


def reshard_for_rank(states: Iterable[Mapping], new_world_size: int, new_rank: int) -> dict:
    """New rank ``new_rank``'s shard at ``new_world_size`` from all old shards, consumed one at a time.

    ``states`` may be sample-state dicts or loss ``state_dict()``s (then a loss state_dict is returned, with
    the other entries, e.g. ``logit_scale``, taken from the first one). Peak memory: one old shard plus the
    new shard. Raises if an old rank is missing or repeated, or the shards disagree.
    """
    if not 0 <= new_rank < new_world_size:
        raise ValueError(f"new_rank={new_rank} is not in [0, new_world_size={new_world_size})")
    first_wrapper, out, covered, ranks, meta = None, None, None, set(), None
    for number, given in enumerate(states):
        key, state = _split(given)
        check_format(state)
        this_meta = (state["data_size"], state["world_size"], tuple(sorted(state["fields"])))
        if out is None:
            # keep only the first state_dict's other entries (logit_scale), not its shard: peak memory stays at
            # one old shard plus the new one
            first_wrapper = (key, None if key is None else {k: v for k, v in given.items() if k != key})
            meta = this_meta
            data_size, old_k = this_meta[0], this_meta[1]
            n_new = shard_size(data_size, new_world_size, new_rank)
            out = {name: torch.zeros(n_new, dtype=value.dtype) for name, value in state["fields"].items()}
            out_seen = torch.zeros(n_new, dtype=torch.bool)
            covered = torch.zeros(n_new, dtype=torch.bool)
        elif this_meta != meta:
            raise ValueError(
                f"old shard #{number} (rank {state['rank']}) has data_size/world_size/fields {this_meta}, "
                f"the first has {meta}"
            )
        old_rank = int(state["rank"])
        if old_rank in ranks or not 0 <= old_rank < old_k:
            raise ValueError(f"old rank {old_rank} given twice or outside [0, world_size={old_k})")
        ranks.add(old_rank)
        n_old = shard_size(data_size, old_k, old_rank)
        for start in range(0, n_old, _CHUNK):
            slots = torch.arange(start, min(start + _CHUNK, n_old))
            global_index = slots * old_k + old_rank
            keep = global_index % new_world_size == new_rank
            new_slots = global_index[keep] // new_world_size
            for name, value in state["fields"].items():
                out[name][new_slots] = value[start : start + len(slots)][keep].to(out[name].dtype)
            out_seen[new_slots] = state["seen"][start : start + len(slots)][keep]
            covered[new_slots] = True
    if out is None:
        raise ValueError("no old shards given")
    missing = sorted(set(range(old_k)) - ranks)
    if missing or not bool(covered.all()):
        raise ValueError(f"old shards of ranks {missing} (of world_size {old_k}) are missing")
    result = {
        "format": FORMAT,
        "data_size": data_size,
        "world_size": new_world_size,
        "rank": new_rank,
        "owner": "modulo",
        "fields": out,
        "seen": out_seen,
    }
    key, wrapper = first_wrapper
    return result if key is None else {**wrapper, key: result}


def reshard_states(states: list[Mapping], new_world_size: int) -> list[dict]:
    """All ``new_world_size`` shards from the list of old ones (offline tool and tests; a list, since each new
    shard reads all old ones: reshard_for_rank streams them for one new rank)."""
    if not isinstance(states, (list, tuple)):
        got = type(states).__name__
        raise TypeError(f"reshard_states reads the old shards once per new rank: pass a list, got a {got}")
    if isinstance(new_world_size, bool) or not isinstance(new_world_size, int) or new_world_size < 1:
        raise ValueError(f"new_world_size must be an integer >= 1, got {new_world_size!r}")
    return [reshard_for_rank(states, new_world_size, rank) for rank in range(new_world_size)]
