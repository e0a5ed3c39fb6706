"""The contrastive loss on held-out pairs: the training objective's value on data it never stepped on.

The loss is called as in training, on global batches spread over the ranks (each rank its slice of every batch,
since the loss gathers the features itself), but in eval mode: `loss_fn.eval()` reads the per-sample state (v2's
τ_i of the samples named) and writes none of it, and γ = 1 makes u the batch's own estimate, so the value does not
depend on what an earlier evaluation saw. For the same reason a feature queue's entries and a momentum model's soft
targets (distill_alpha) are left out: the value is the in-batch objective with one-hot targets. Every rank holds
all the held-out features (gathered for retrieval), so every rank cuts the same batches and all return the same
number.

The value is the loss's estimated objective where it reports one (the FastCLIP losses' `objective` metric: their
surrogate's value is not the objective), else the loss itself, averaged over the ranks.
"""

from __future__ import annotations

import torch

from fastclip.eval.collectives import all_reduce_sum, rank_and_world


@torch.no_grad()
def validation_loss(
    loss_fn,
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    indices: torch.Tensor,
    per_rank: int,
    group=None,
    groups: torch.Tensor | None = None,
) -> tuple[float | None, int]:
    """(mean loss over full global batches of per_rank x world held-out pairs, pairs used); (None, 0) where the
    loss cannot score them: fewer pairs than its smallest global batch, or samples without the data index a
    loss with per-sample state needs. groups: several captions per image (the loss's groups=), or None."""
    rank, world = rank_and_world(group)
    n = image_features.shape[0]
    per_rank = min(per_rank, n // world)  # a held-out set smaller than one global batch: one batch of all of it
    min_global = getattr(loss_fn, "min_global_batch", 1)
    needs_indices = getattr(loss_fn, "needs_indices", False)
    if per_rank < 1 or per_rank * world < min_global:
        return None, 0
    if needs_indices:
        data_size = getattr(getattr(loss_fn, "options", None), "data_size", None)
        out_of_range = (indices < 0) | (indices >= data_size if data_size is not None else False)
        if bool(out_of_range.any()):  # an index the state has no row for (or none at all): no value, not an error
            return None, 0
    was_training = loss_fn.training
    loss_fn.eval()
    try:
        total, batches = 0.0, n // (per_rank * world)
        for b in range(batches):
            mine = slice(b * per_rank * world + rank * per_rank, b * per_rank * world + (rank + 1) * per_rank)
            loss = loss_fn(
                image_features[mine],
                text_features[mine],
                indices[mine] if needs_indices else None,
                groups=None if groups is None else groups[mine],
            )
            objective = getattr(loss_fn, "metrics", {}).get("objective")
            total += float(objective if objective is not None else loss)
    finally:
        loss_fn.train(was_training)
    total = all_reduce_sum(torch.tensor([total], dtype=torch.float64, device=image_features.device), group)
    return float(total[0]) / (world * batches), batches * per_rank * world
