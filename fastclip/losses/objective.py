"""Autograd objectives: a loss written once, as plain differentiable code over the global batch.

An objective's ``_objective(features, state)`` sees the whole gathered batch (``GlobalFeatures``: N rows,
rank-major) and returns the global loss; autograd does the rest. What it does not write, the framework supplies:

* the one feature all_gather, the input checks, rank 0's parameters, byte counts (``ContrastiveLoss._forward``);
* exactness on any number of ranks: every rank computes the same global loss, and the gradient of this rank's
  own rows is multiplied by K (the world size) on its way back, so the ranks' average of the encoder gradients
  (what DDP takes) is the single-process gradient. The loss's own parameters (τ, heads) see the whole loss on
  every rank, so their average is it too. No backward collective;
* per-sample state (``StateRows``): the N rows' old values from their owners in one all_reduce, the new values
  stored by the owners, journaled for the trainer's NaN rollback, checkpointed and resharded with the fused
  losses' machinery (sharded_state.py).

Unimodal form (option ``unimodal``, SimCLR-style self-supervision): ``image`` and ``text`` are two augmented views
of the same N images. Every one of the 2N views is an anchor against the 2N views: its positive is the other view
of its image, its negatives the views of other images. ``pairs()`` keeps two directions, view-1 anchors and view-2
anchors ([2, N, 2N]), so the objectives run unchanged on both forms, with their per-sample state [2, N] per image;
losses with state share it between the two views (see each loss's docstring).

Cost: N×N similarities per rank where the fused losses compute B×N; at the small global batches these
objectives are for, that is little (``benchmarks/bench_loss.py`` measures both). An objective gets a fused path
only where a benchmark says it pays.

To add one: a ``ContrastiveLoss`` (or ``SampleStateLoss``) subclass with ``AutogradObjective`` first in its bases,
its options dataclass, one line in ``LOSSES`` (``__init__.py``), and its tests. dcl.py is the example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .batch import GlobalBatch
from .comm import Comm
from .pairwise import compute_dtype, exact_float32
from .queue import FeatureQueue


class _GradTimes(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``factor`` (K: see the module docstring)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _GlobalCosines(torch.autograd.Function):
    """``[N, N]`` image·text of the global batch, in which only this rank's rows carry a gradient: the backward makes
    B×N×d products per modality (what the fused losses make), not the N×N×d of autograd through the full product,
    and returns K × this rank's share (see the module docstring). The backward runs with autocast off and IEEE
    float32 matmuls, as the forward (a user's loop may call backward() inside autocast)."""

    @staticmethod
    def forward(ctx, local_image, local_text, all_image, all_text, rows, factor):
        image, text = stitch_rows(all_image, local_image, rows), stitch_rows(all_text, local_text, rows)
        ctx.save_for_backward(image, text)
        ctx.rows, ctx.factor = rows, factor
        return image @ text.T

    @staticmethod
    def backward(ctx, grad):
        with exact_float32(grad.device.type):
            image, text = ctx.saved_tensors
            rows, grad_image, grad_text = ctx.rows, None, None
            if ctx.needs_input_grad[0]:
                grad_image = grad[rows] @ text
                grad_image = grad_image * ctx.factor if ctx.factor != 1 else grad_image
            if ctx.needs_input_grad[1]:
                grad_text = grad[:, rows].T @ image
                grad_text = grad_text * ctx.factor if ctx.factor != 1 else grad_text
        return grad_image, grad_text, None, None, None, None


class _GlobalGram(torch.autograd.Function):
    """``[2N, 2N]`` Z·Zᵀ of the global batch's views Z = [view 1; view 2] (unimodal form), in which only this rank's
    rows carry a gradient, K × its share, as _GlobalCosines."""

    @staticmethod
    def forward(ctx, local_1, local_2, all_1, all_2, rows, factor):
        views = torch.cat([stitch_rows(all_1, local_1, rows), stitch_rows(all_2, local_2, rows)])
        ctx.save_for_backward(views)
        ctx.rows, ctx.factor = rows, factor
        return views @ views.T

    @staticmethod
    def backward(ctx, grad):
        with exact_float32(grad.device.type):
            (views,) = ctx.saved_tensors
            n, rows = views.shape[0] // 2, ctx.rows
            grads = []
            for offset in (0, n):  # each view's own rows: as anchors (rows of grad) and as candidates (columns)
                own = slice(offset + rows.start, offset + rows.stop)
                out = (grad[own] + grad[:, own].T) @ views
                grads.append(out * ctx.factor if ctx.factor != 1 else out)
        return grads[0], grads[1], None, None, None, None


def stitch_rows(gathered: torch.Tensor | None, local: torch.Tensor, rows: slice) -> torch.Tensor:
    """The gathered rows with this rank's replaced by its own (``local`` alone on one rank)."""
    return local if gathered is None else torch.cat([gathered[: rows.start], local, gathered[rows.stop :]])


class _RowsTimesConstant(torch.autograd.Function):
    """``[N, Q]`` anchors·constantᵀ (the queue's entries), gradient into this rank's anchor rows only (× K)."""

    @staticmethod
    def forward(ctx, local, gathered, rows, factor, constant):
        anchors = stitch_rows(gathered, local, rows)
        ctx.save_for_backward(constant)
        ctx.rows, ctx.factor = rows, factor
        return anchors @ constant.T

    @staticmethod
    def backward(ctx, grad):
        with exact_float32(grad.device.type):
            (constant,) = ctx.saved_tensors
            out = grad[ctx.rows] @ constant
        return (out * ctx.factor if ctx.factor != 1 else out), None, None, None, None


@dataclass
class Pairs:
    """Every anchor against its candidates, both directions: block 0 the image anchors against the N texts (then
    the text queue), block 1 the text anchors against the N images (then the image queue). Unimodal form: block 0
    the view-1 anchors, block 1 the view-2 anchors, each against the 2N views [view 1; view 2]."""

    cos: torch.Tensor  # [2, N, M] (M = N + Q, or 2N), differentiable through this rank's anchors and candidates
    positive: torch.Tensor  # [2, N] each anchor's positive: cos_ii (both directions), or its other view's cosine
    negative: torch.Tensor  # [2, N, M] bool: the cells that are negatives of their anchor
    count: torch.Tensor | int  # the negatives in g's mean: N − 1 (+ the queue's filled slots), or 2N − 2


@dataclass
class GlobalFeatures:
    """The global batch as an objective sees it: ``[N, d]`` image and text features in the compute dtype, rank-major,
    this rank's rows with autograd; ``indices`` ``[N]`` (or None for losses without per-sample state)."""

    image: torch.Tensor
    text: torch.Tensor
    indices: torch.Tensor | None
    local: slice  # this rank's rows
    ids: torch.Tensor | None = None  # [N] what tells rows apart as negatives: group ids if given, else indices
    batch: GlobalBatch | None = None  # (for cosines(): this rank's features and the gathered ones)
    queue: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (image, text, indices) [Q, ...]
    momentum: tuple[torch.Tensor, torch.Tensor] | None = None  # the momentum model's (image, text) [N, d]
    unimodal: bool = False  # image and text are two views of the same images (module docstring)

    @property
    def size(self) -> int:
        return self.image.shape[0]

    def same_sample(self) -> torch.Tensor:
        """``[N, N]`` bool: True where row i and column j are one sample (the diagonal, and copies of one data index),
        i.e. the cells that are no negatives of each other."""
        eye = torch.eye(self.size, dtype=torch.bool, device=self.image.device)
        if self.ids is None:
            return eye
        return eye | (self.ids[:, None] == self.ids[None, :])

    def same_pair(self) -> torch.Tensor:
        """``[N, N]`` bool: the pairs themselves, and with groups every same-group cell (openclip, siglip)."""
        if self.batch is not None and self.batch.all_groups is not None:
            return self.same_sample()
        return torch.eye(self.size, dtype=torch.bool, device=self.image.device)

    def cosines(self) -> torch.Tensor:
        """``[N, N]`` image i · text j, differentiable (through this rank's rows only, at the fused losses' cost)."""
        batch = self.batch
        if batch is None:
            return self.image @ self.text.T
        dtype, several = self.image.dtype, batch.world_size > 1
        return _GlobalCosines.apply(
            batch.image.to(dtype),
            batch.text.to(dtype),
            batch.all_image.to(dtype) if several else None,
            batch.all_text.to(dtype) if several else None,
            self.local,
            float(batch.world_size),
        )

    def gram(self) -> torch.Tensor:
        """``[2N, 2N]`` view·view over Z = [view 1; view 2], differentiable (through this rank's rows only)."""
        batch = self.batch
        if batch is None:
            views = torch.cat([self.image, self.text])
            return views @ views.T
        dtype, several = self.image.dtype, batch.world_size > 1
        return _GlobalGram.apply(
            batch.image.to(dtype),
            batch.text.to(dtype),
            batch.all_image.to(dtype) if several else None,
            batch.all_text.to(dtype) if several else None,
            self.local,
            float(batch.world_size),
        )

    def pairs(self) -> Pairs:
        """Both directions' anchors against their candidates: the batch, then the queue (queue.py) if any."""
        if self.unimodal:
            return self._view_pairs()
        cos = self.cosines()
        same = self.same_sample()
        rows, negative = torch.stack([cos, cos.T]), (~same).expand(2, -1, -1)
        count = self.size - 1
        if self.queue is not None:
            q_image, q_text, q_indices = self.queue
            extra = torch.stack([self._against(q_text, "image"), self._against(q_image, "text")])
            valid = q_indices >= 0
            own = q_indices[None, :] == self.ids[:, None]  # an anchor's own sample (or group), queued before
            rows = torch.cat([rows, extra], dim=-1)
            negative = torch.cat([negative, (valid[None, :] & ~own).expand(2, -1, -1)], dim=-1)
            count = count + valid.sum()
        return Pairs(cos=rows, positive=cos.diagonal().expand(2, -1), negative=negative, count=count)

    def _view_pairs(self) -> Pairs:
        """The unimodal form: each view against the 2N views; a view itself, its other view and both views of a
        copy of its image (the same data index) are no negatives."""
        n, gram = self.size, self.gram()
        rows = torch.stack([gram[:n], gram[n:]])  # [2, N, 2N]
        negative = (~self.same_sample()).repeat(1, 2).expand(2, -1, -1)
        positive = gram[:n, n:].diagonal().expand(2, -1)  # view 1 · view 2 of each image, for both anchors
        return Pairs(cos=rows, positive=positive, negative=negative, count=2 * n - 2)

    @torch.no_grad()
    def momentum_cos(self) -> torch.Tensor:
        """``[2, N, M]`` as ``pairs().cos`` from the momentum model's features (the queue holds its features)."""
        image, text = self.momentum
        cos = image @ text.T
        rows = torch.stack([cos, cos.T])
        if self.queue is not None:
            q_image, q_text, _ = self.queue
            rows = torch.cat([rows, torch.stack([image @ q_text.T, text @ q_image.T])], dim=-1)
        return rows

    def _against(self, constant: torch.Tensor, modality: str) -> torch.Tensor:
        """``[N, Q]`` the ``modality`` anchors against constant rows."""
        batch = self.batch
        if batch is None:
            return (self.image if modality == "image" else self.text) @ constant.T
        dtype, several = self.image.dtype, batch.world_size > 1
        local = (batch.image if modality == "image" else batch.text).to(dtype)
        gathered = (batch.all_image if modality == "image" else batch.all_text).to(dtype) if several else None
        return _RowsTimesConstant.apply(local, gathered, self.local, float(batch.world_size), constant)


def global_features(batch: GlobalBatch, dtype: torch.dtype | None = None) -> GlobalFeatures:
    """The gathered batch with this rank's rows replaced by its own (autograd) features, gradient × K."""
    dtype = dtype or compute_dtype(batch.image.dtype)
    start, stop = batch.local_rows.start, batch.local_rows.stop

    def stitch(local: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        local = local.to(dtype)
        if batch.world_size == 1:
            return local
        local = _GradTimes.apply(local, float(batch.world_size))
        gathered = gathered.to(dtype)
        return torch.cat([gathered[:start], local, gathered[stop:]])

    return GlobalFeatures(
        image=stitch(batch.image, batch.all_image),
        text=stitch(batch.text, batch.all_text),
        indices=batch.all_indices,
        local=batch.local_rows,
        ids=batch.all_ids,
        batch=batch,
    )


def atanh_logits(cos: torch.Tensor, clamp: float) -> torch.Tensor:
    """φ(c) = 2·atanh(c) with c clamped to ±(1 − clamp), differentiable (0 where clamped, as torch.clamp)."""
    limit = 1.0 - clamp
    return 2.0 * torch.atanh(cos.clamp(-limit, limit))


def pair_map(cos: torch.Tensor, similarity: str, clamp: float) -> torch.Tensor:
    """The logits' similarity map: the cosine itself, or φ (similarity.py)."""
    return cos if similarity == "cosine" else atanh_logits(cos, clamp)


def both_directions(logits: torch.Tensor) -> torch.Tensor:
    """``[2, N, N]``: image anchors' rows (logits) and text anchors' rows (logits transposed)."""
    return torch.stack([logits, logits.T])


def weighted_directions(per_direction: torch.Tensor, weights: tuple[float, float] | None) -> torch.Tensor:
    """``(w_i2t·x[0] + w_t2i·x[1])/(w_i2t + w_t2i)`` of a ``[2]`` (image-anchored, text-anchored) tensor; None:
    their mean."""
    if weights is None:
        return per_direction.mean()
    w = per_direction.new_tensor(weights)
    return (w * per_direction).sum() / w.sum()


def masked_logsumexp(logits: torch.Tensor, keep: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log Σ exp over the ``keep`` cells (−inf where none)."""
    return torch.logsumexp(logits.masked_fill(~keep, -math.inf), dim=dim)


def hard_negatives(
    logits: torch.Tensor, negative: torch.Tensor, topk: int | None, beta: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits', negative')``: the negatives' logits and mask after hard-negative mining.

    ``topk``: only each row's k largest negative logits stay negatives (the selection carries no gradient).
    ``beta`` (Robinson et al. 2021): negative j of anchor i weighted by w_ij = exp(β z_ij)/mean_k exp(β z_ik) over
    the row's negatives, so Σ_j w_ij exp(z_ij) = exp(log Σ_j exp((1+β) z_ij) − log mean_j exp(β z_ij)); written
    as logits z'_ij = (1+β) z_ij − log mean_k exp(β z_ik), differentiable through both parts as in the paper."""
    if topk is not None and topk < logits.shape[-1]:
        with torch.no_grad():
            ranked = logits.masked_fill(~negative, -math.inf)
            top = ranked.topk(topk, dim=-1).indices
            kept = torch.zeros_like(negative).scatter_(-1, top, True)
        negative = negative & kept
    if beta is not None and beta != 0:
        count = negative.sum(dim=-1, keepdim=True).clamp_min(1)
        log_mean = masked_logsumexp(beta * logits, negative).unsqueeze(-1) - torch.log(count.to(logits.dtype))
        logits = (1.0 + beta) * logits - log_mean
    return logits, negative


class StateRows:
    """The per-sample state of the global batch's N rows (a SampleStateLoss's shard): ``old`` (name -> ``[N]``) and
    ``seen`` ``[N]`` from the owners in one all_reduce; ``write(**new)`` stores the owners' rows (a repeated index
    keeps its last occurrence; nothing in eval mode)."""

    def __init__(self, loss, comm: Comm, batch: GlobalBatch, dtype: torch.dtype):
        self.loss, self.state = loss, loss.state_for_batch(comm, batch)
        self.slots = self.state.locate(
            batch.all_indices, assert_in_range=loss._assert_indices, repeats=batch.indices_repeat()
        )
        self.stored = self.state.read(self.slots)
        table = comm.share_rows(batch, None, self.stored, dtype=dtype)
        self.old = {name: table[:, i] for i, name in enumerate(self.state.names)}
        self.seen = table[:, -1] > 0.5

    def write(self, **new: torch.Tensor) -> None:
        values = torch.stack([new[name].detach() for name in self.state.names], dim=1)
        self.loss.store(self.state, self.slots, values, previous=self.stored)


class AutogradObjective:
    """Mixin (first in the bases) that runs a loss as ``_objective(features, state)``: see the module docstring.
    ``state`` is a StateRows for losses with per-sample state, else None. With the option ``queue_size`` the
    features carry a FeatureQueue's entries (queue.py), pushed after each training call."""

    impl = "autograd"
    unimodal_form = False  # the objective is written over pairs() and runs on two views of images as well

    def __init__(self, options):
        super().__init__(options)
        if getattr(options, "unimodal", False) and not self.unimodal_form:
            raise ValueError(
                f"loss {self.name!r} has no unimodal form (option unimodal): use ntxent (SimCLR), dcl, "
                "fastclip-v0/v1 (SogCLR)/v2 (iSogCLR)/v3 or fastclip-tempnet"
            )
        size = getattr(options, "queue_size", None)
        self.queue = FeatureQueue(size) if size else None
        if self.queue is not None:
            self.needs_indices = True  # an anchor's own queued sample is no negative
        self.needs_momentum = bool(getattr(options, "distill_alpha", None))

    def _compute(self, comm: Comm, batch: GlobalBatch):
        dtype = compute_dtype(batch.image.dtype)
        features = global_features(batch, dtype)
        features.unimodal = bool(getattr(self.options, "unimodal", False))
        if batch.momentum is not None:
            features.momentum = (batch.momentum[1].to(dtype), batch.momentum[0].to(dtype))
        if self.queue is not None:
            features.queue = self.queue.entries(batch.all_image.to(dtype))
        state = StateRows(self, comm, batch, dtype) if self.uses_sample_state else None
        out = self._objective(features, state)
        if self.queue is not None and self.training:  # the same rows on every rank: the queues stay identical
            # MoCo: the momentum model's features when there is one, else the online ones (cross-batch memory)
            image, text = features.momentum or (batch.all_image.to(dtype), batch.all_text.to(dtype))
            self.queue.push(image, text, batch.all_ids)
        return out

    def _objective(self, features: GlobalFeatures, state: StateRows | None):
        raise NotImplementedError

    def journaled_parts(self, device=None) -> list:
        return super().journaled_parts(device) + ([self.queue] if self.queue is not None else [])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.queue is not None:
            for key, value in self.queue.state_dict().items():
                destination[f"{prefix}{QUEUE_PREFIX}{key}"] = value

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        saved = {k[len(prefix) :]: state_dict.pop(k) for k in list(state_dict) if k.startswith(prefix + QUEUE_PREFIX)}
        if self.queue is not None:
            try:
                self.queue.load_state_dict({k[len(QUEUE_PREFIX) :]: v for k, v in saved.items()})
            except ValueError as e:
                errors.append(str(e))
        elif saved and strict:
            errors.append(
                "the saved loss state holds a feature queue but this loss has none: resume with its queue_size"
            )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)


QUEUE_PREFIX = "queue."  # the queue's keys in the loss's state_dict


__all__ = [
    "AutogradObjective",
    "GlobalFeatures",
    "StateRows",
    "global_features",
    "hard_negatives",
    "masked_logsumexp",
    "pair_map",
    "both_directions",
    "weighted_directions",
]
