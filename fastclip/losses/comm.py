"""Every collective the losses make, with a per-call ledger of the bytes each rank moves.

A loss call makes at most these data collectives:

* ``header``   the structure handshake of validation.py, a tiny float64 all_gather: on the first call and when
  input shapes change (a second one only when some rank's values are bad, to name the row or index); also the
  first call's broadcast of the loss's parameters from rank 0 (broadcast_from_first_). In eager mode a call in
  which one rank's shapes changed makes the feature all_gather twice (once with that rank's stand-in, once after
  the handshake: validation.py);
* ``features`` + ``indices`` (+ ``header``): ONE all_gather of ``[image | text | indices | 5 check words]``
  packed into a single flat buffer of the feature dtype; the int64 indices and words travel bit-cast
  (``Tensor.view(dtype)``), which a copy-only collective preserves exactly. Nothing here carries autograd,
  so the fused losses make no backward collective;
* ``state``    all_reduce(SUM) of an ``[N, m]`` table in which every entry has exactly one contributing rank
  (all others add 0), so the sum is exact. FastCLIP-v2 makes two of these.

The autograd objectives (objective.py) make, besides the feature all_gather and (with per-sample state) the one
``state`` all_reduce of the old rows:

* ``values``   one all_reduce(SUM) at the end of the call: the loss value and the metrics (a few scalars), and the
  anchors' new state rows (counted under ``state``);
* ``gradients`` in the backward, one all_to_all of the pair blocks' ``[2, B, N]`` gradient: each rank receives
  the columns of its own rows (``exchange_columns``); counted in the forward that sets it up.

Bytes are counted per rank with the usual ring formulas (what each rank sends on the wire):
all_gather ``(K-1)/K * output_bytes``, all_reduce ``2(K-1)/K * bytes``; nothing at K = 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .batch import GlobalBatch

LEDGER_KEYS = ("header", "features", "indices", "state", "values", "gradients")


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    """Every rank's `tensor`, concatenated into `output` (one collective; no autograd)."""
    # torch >= 2.13 renamed all_gather_into_tensor; keep both so older CUDA builds work too.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


@dataclass
class Comm:
    """The process group of one loss call (or none: world_size 1) and the bytes moved in that call."""

    group: object | None
    world_size: int
    rank: int
    ledger: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEDGER_KEYS, 0))

    @classmethod
    def resolve(cls, group=None) -> Comm:
        if dist.is_available() and dist.is_initialized():
            return cls(group, dist.get_world_size(group), dist.get_rank(group))
        if group is not None:
            raise RuntimeError("loss option group= was given but torch.distributed is not initialised")
        world = os.environ.get("WORLD_SIZE", "").strip()
        if world.isdigit() and int(world) > 1:  # a launcher's process, alone: each rank would train on its own half
            raise RuntimeError(
                f"environment variable WORLD_SIZE={world} (a launcher's, e.g. torchrun) but torch.distributed is not "
                "initialised: call torch.distributed.init_process_group() before the loss's first use, or unset "
                "WORLD_SIZE to train in one process"
            )
        return cls(None, 1, 0)

    def backend(self) -> str | None:
        return dist.get_backend(self.group) if self.world_size > 1 else None

    def bytes_moved(self) -> dict[str, int]:
        return {**self.ledger, "total": sum(self.ledger.values())}

    def all_gather(self, tensor: torch.Tensor, *, ledger_key: str) -> torch.Tensor:
        """Stack of every rank's ``tensor`` (same shape everywhere), ``[K, *tensor.shape]``, no autograd."""
        tensor = tensor.detach().contiguous()
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        out = tensor.new_empty((self.world_size * tensor.numel(),))
        all_gather_single(out, tensor.reshape(-1), self.group)
        self.ledger[ledger_key] += (self.world_size - 1) * tensor.numel() * tensor.element_size()
        return out.view(self.world_size, *tensor.shape)

    def all_reduce_sum_(self, tensor: torch.Tensor, *, ledger_key: str, state_part: int = 0) -> torch.Tensor:
        """In place; ``state_part``: the first elements are state rows, counted under ``state``."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
            for key, count in ((ledger_key, tensor.numel() - state_part), ("state", state_part)):
                self.ledger[key] += 2 * (self.world_size - 1) * count * tensor.element_size() // self.world_size
        return tensor

    def gather_batch(
        self,
        image: torch.Tensor,
        text: torch.Tensor,
        indices: torch.Tensor | None,
        header: torch.Tensor | None = None,
        momentum: tuple[torch.Tensor, torch.Tensor] | None = None,
        groups: torch.Tensor | None = None,
    ) -> GlobalBatch:
        """The one feature all_gather: local rows keep autograd, the gathered copies have none. ``header``
        (int64 words, validation.py) rides at the end of the same buffer; ``momentum`` (the momentum model's
        (image, text) features of the same rows) after the features."""
        rows, dim = image.shape
        n_sets = 2 if momentum is None else 4
        with torch.no_grad():
            # text before image: the gathered [K, 2, B, d] then reads as the pair blocks' candidates (all texts,
            # all images) with one copy
            parts = [text.reshape(-1), image.reshape(-1)]
            if momentum is not None:
                parts += [momentum[1].reshape(-1).to(image.dtype), momentum[0].reshape(-1).to(image.dtype)]
            for words in (indices, groups, header):
                if words is not None:
                    parts.append(words.contiguous().view(image.dtype))  # bit-cast, exact through a copy
            packed = torch.cat(parts)
            if self.world_size == 1:
                gathered = packed.unsqueeze(0)
            else:
                gathered = packed.new_empty((self.world_size * packed.numel(),))
                all_gather_single(gathered, packed, self.group)
                gathered = gathered.view(self.world_size, -1)
        n_feat = rows * dim
        if self.world_size > 1:
            self._count_gather(n_sets * n_feat * image.element_size(), rows, indices, groups, header)
        features = gathered[:, : n_sets * n_feat].view(self.world_size, n_sets, rows, dim)
        every = features.transpose(0, 1).reshape(n_sets, self.world_size * rows, dim)  # [2 or 4, N, d], rank-major
        candidates, momentum_all = every[:2], (every[2:] if momentum is not None else None)
        if self.world_size == 1:  # the inputs themselves (no copy to make: nothing was gathered)
            all_indices, all_groups, all_header = indices, groups, None if header is None else header[None]
        else:
            all_indices, all_groups, all_header = _unpack_words(
                gathered[:, n_sets * n_feat :], rows, indices, groups, header
            )
        return GlobalBatch(
            image=image,
            text=text,
            indices=indices,
            candidates=candidates,
            all_indices=all_indices,
            rank=self.rank,
            world_size=self.world_size,
            header=all_header,
            momentum=momentum_all,
            groups=groups,
            all_groups=all_groups,
        )

    def _count_gather(self, feature_bytes: int, rows: int, indices, groups, header) -> None:
        """The ledger's bytes of one feature all_gather (ring: each rank receives the other K - 1 ranks' parts)."""
        others = self.world_size - 1
        self.ledger["features"] += others * feature_bytes
        for ids in (indices, groups):
            if ids is not None:
                self.ledger["indices"] += others * rows * 8
        if header is not None:
            self.ledger["header"] += others * header.numel() * 8

    def share_rows(
        self,
        batch: GlobalBatch,
        anchor_stats: torch.Tensor | None,
        owner_values: torch.Tensor | None = None,
        *,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """All_reduce of one ``[N, a+o]`` table: ``[anchor columns | owner columns]`` for the whole global batch.

        ``anchor_stats``: ``[B, a]`` values of this rank's anchors, placed at their global rows.
        ``owner_values``: ``[N, o]`` values already zero on rows this rank does not own (ShardedSampleState.read).
        Every entry has exactly one non-zero contributor, so the SUM reproduces it bit for bit.
        """
        parts = []
        if anchor_stats is not None:  # zero rows above and below for the other ranks' anchors
            after = batch.global_size - batch.offset - batch.local_size
            parts.append(F.pad(anchor_stats.detach().to(dtype), (0, 0, batch.offset, after)))
        if owner_values is not None:
            parts.append(owner_values.to(dtype))
        # (a new tensor either way: the all_reduce writes into it, and the caller may still read owner_values)
        table = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].clone() if anchor_stats is None else parts[0]
        return self.all_reduce_sum_(table, ledger_key="state")

    def exchange_columns(self, grad: torch.Tensor, *, views: bool = False) -> torch.Tensor:
        """The backward of the autograd objectives' pair blocks (objective.py): from every rank's ``[S, B, N]`` ``grad``
        (its anchors' rows against the N rank-major candidates) the columns of this rank's own rows, in one
        all_to_all: ``[K, S, B, B]`` with out[r, b, i, m] = grad of rank r [b, i, this rank's row m]. ``views``
        (the unimodal form): ``grad`` is ``[2, B, 2N]`` against [view 1; view 2], and out ``[K, 2, B, 2, B]`` holds
        out[r, a, i, v, m] = grad of rank r [a, i, v·N + this rank's row m]."""
        k = self.world_size
        sets, rows = grad.shape[0], grad.shape[1]
        if views:  # [a, i, v, s, m] -> [s, a, i, v, m]: one contiguous chunk per destination rank s
            send = grad.reshape(sets, rows, 2, k, rows).permute(3, 0, 1, 2, 4)
        else:  # [b, i, s, m] -> [s, b, i, m]
            send = grad.reshape(sets, rows, k, rows).permute(2, 0, 1, 3)
        if k == 1:
            return send
        send = send.contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received.view(-1), send.view(-1), group=self.group)
        return received

    def count_columns(self, cells: int, item: int) -> None:
        """The bytes ``exchange_columns`` of ``cells`` values sends: (K-1)/K of them (the own share stays)."""
        self.ledger["gradients"] += (self.world_size - 1) * cells * item // self.world_size

    def broadcast_from_first_(self, parameters: list[torch.Tensor], device: torch.device) -> None:
        """Every rank's ``parameters`` set to rank 0's (of the group): one broadcast of their values, sent on
        ``device`` (the features' device, which the backend takes)."""
        if self.world_size == 1 or not parameters:
            return
        flat = torch.cat([p.detach().reshape(-1).to(device, torch.float64) for p in parameters])
        first = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast(flat, src=first, group=self.group)
        self.ledger["header"] += (self.world_size - 1) * flat.numel() * flat.element_size()
        with torch.no_grad():
            for p, values in zip(parameters, flat.split([p.numel() for p in parameters])):
                values = values.view_as(p).to(p.device, p.dtype)
                if not torch.equal(p, values):  # (equal, as usual: no in-place write, no version bump for autograd)
                    p.copy_(values)

    def average_grads_(self, parameters) -> None:
        """Mean of each parameter's .grad over the group (what DDP does for the model's parameters)."""
        if self.world_size == 1:
            return
        for param in parameters:
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.group)
                param.grad.div_(self.world_size)


def _unpack_words(words: torch.Tensor, rows: int, indices, groups, header):
    """(all indices, all groups, all headers) from the int64 words gathered after the features (None where not
    sent): [K, B (+ B) (+ len(header))], bit-cast back in one (strided) copy."""
    if indices is None and groups is None and header is None:
        return None, None, None
    words = words.contiguous().view(torch.int64)
    all_indices = all_groups = all_header = None
    start = 0
    if indices is not None:
        all_indices, start = words[:, :rows].reshape(-1), rows
    if groups is not None:
        all_groups, start = words[:, start : start + rows].reshape(-1), start + rows
    if header is not None:
        all_header = words[:, start:]
    return all_indices, all_groups, all_header
