"""The two collectives evaluation needs, usable with or without an initialised process group.

Every rank calls these the same number of times with tensors of the same dtype; that is what keeps
evaluation from hanging (OpenCLIP #1121: rank 0 evaluated alone while the others waited at a barrier).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group=None) -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_rows(rows: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's `[n_r, ...]` rows in rank order; the n_r may differ (and be 0)."""
    if not is_distributed():
        return rows
    world = dist.get_world_size(group)
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in torch.cat(counts).tolist()]
    # all_gather needs equal shapes: pad every rank to the largest slice, then trim
    padded = rows.new_zeros((max(counts), *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:n] for g, n in zip(gathered, counts)])
