"""Autograd objectives: a loss written once, as plain differentiable code over its anchors' rows.

An objective's ``_objective(features, state)`` sees this rank's B anchors of each modality against the whole
gathered batch (``GlobalFeatures``: its B images against the N texts, its B texts against the N images, rank-major)
and returns the loss as a mean over those anchors (its share of the global objective); autograd does the rest.
What it does not write, the framework supplies:

* the one feature all_gather, the input checks, rank 0's parameters, byte counts (``ContrastiveLoss._forward``);
* exactness on any number of ranks. The pair blocks (``_AnchorBlocks``) carry autograd into every candidate's
  owner: in the backward one all_to_all hands each rank the gradient's columns of its own rows, so rank r's
  features get Σ_k ∂L_k/∂x_r, L_k rank k's share, in as many products as the fused losses make. The global loss is
  the ranks' mean L = (1/K) Σ_k L_k (each L_k a mean over B anchors), so rank r's rows get K·∂L/∂x_r and DDP's
  average is the single-process gradient; the loss's own parameters (τ, heads) get ∂L_k/∂θ, whose average is
  ∂L/∂θ. Every rank returns the global value L (one all_reduce at the end of the call, which also carries the
  metrics, averaged the same way, and the new state rows), with this rank's gradient;
* per-sample state (``StateRows``): the anchors' old values from their owners in one all_reduce, the anchors' new
  values to their owners in the end-of-call all_reduce, journaled for the trainer's NaN rollback, checkpointed and
  resharded with the fused losses' machinery (sharded_state.py).

Unimodal form (option ``unimodal``, SimCLR-style self-supervision): ``image`` and ``text`` are two augmented views
of the same N images. Every one of the 2N views is an anchor against the 2N views: its positive is the other view
of its image, its negatives the views of other images. ``pairs()`` keeps two directions, view-1 anchors and view-2
anchors ([2, B, 2N]), so the objectives run unchanged on both forms, with their per-sample state [2, B] per image;
losses with state share it between the two views (see each loss's docstring).

Cost: B×N similarities per direction and rank and the fused losses' matmuls; autograd's elementwise passes,
the backward all_to_all and the end-of-call all_reduce are what it pays over them (``benchmarks/bench_loss.py``
measures both). An objective gets a fused path only where a benchmark says it pays.

To add one: a ``ContrastiveLoss`` (or ``SampleStateLoss``) subclass with ``AutogradObjective`` first in its bases,
its options dataclass, one line in ``LOSSES`` (``__init__.py``), and its tests. dcl.py is the example. Outside the
library, the same class and options as a ``LossEntry`` in your own module, named ``module:attribute``
(tests/user_losses/margin_infonce.py is the example).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .batch import GlobalBatch
from .comm import Comm
from .pairwise import compute_dtype, exact_float32
from .queue import FeatureQueue


class _Similarity(torch.autograd.Function):
    """``a @ bᵀ`` (``[.., B, d]`` × ``[.., M, d]``; b may be a constant), whose backward runs with autocast off and
    IEEE float32 matmuls as the forward does (a user's loop may call backward() inside autocast, or with TF32 on)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b.transpose(-1, -2)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        with exact_float32(grad.device.type):
            grad_a = grad @ b if ctx.needs_input_grad[0] else None
            grad_b = grad.transpose(-1, -2) @ a if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ bᵀ``, differentiable, the backward's matmuls in IEEE float32 (``_Similarity``)."""
    return _Similarity.apply(a, b)


class _AnchorBlocks(torch.autograd.Function):
    """``[S, B, N]``: this rank's image anchors · the N texts (block 0) and, with S = 2, its text anchors · the N
    images (block 1), from its own rows (autograd) and the gathered ``[2, N, d]`` (text, image) candidates.

    The backward gives this rank's rows their whole gradient in S products ``[B, N] @ [N, d]``, as the fused
    losses do, not the 2S of autograd through a product (its anchors' rows, then every candidate's column): the
    gradient G of cell (i, j) reaches anchor i through row i and candidate j through column j, and candidate j's
    column is spread over the ranks' blocks. One all_to_all hands each rank the columns of its own rows
    (``Comm.exchange_columns``: C_b[m, r·B + i] = G_{r,b}[i, own m]); then
        ∂/∂image = (G_0 + C_1) @ texts,    ∂/∂text = (G_1 + C_0) @ images
    (the text anchors of all ranks are the gathered texts, and so on). Rank r's rows so get Σ_k ∂L_k/∂x_r (see the
    module docstring). One rank: block 1 is block 0 transposed (one product forward, two backward). The matmuls
    run with autocast off and in IEEE float32, in the backward too (a user may call backward() under autocast)."""

    @staticmethod
    def forward(ctx, image, text, gathered, rows, comm, sets):
        ctx.rows, ctx.comm, ctx.sets = rows, comm, sets
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            comm.count_columns(sets * image.shape[0] * gathered.shape[1], image.element_size())  # the backward's
        if comm.world_size == 1:
            ctx.save_for_backward(image, text)
            cos = image @ text.T
            return torch.stack([cos, cos.T]) if sets == 2 else cos[None]
        ctx.save_for_backward(gathered)
        anchors = torch.stack([image, text]) if sets == 2 else image[None]
        return anchors @ gathered[:sets].transpose(-1, -2)

    @staticmethod
    def backward(ctx, grad):
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, None, None, None, None
        with exact_float32(grad.device.type):
            if ctx.comm.world_size == 1:
                image, text = ctx.saved_tensors
                cells = grad[0] + grad[1].T if ctx.sets == 2 else grad[0]
                return cells @ text, cells.T @ image, None, None, None, None
            (gathered,) = ctx.saved_tensors
            columns = ctx.comm.exchange_columns(grad)  # [K, S, B, B]: [r, b, i, m]
            ranks = range(columns.shape[0])
            if ctx.sets == 2:  # image rows: G_0 + C_1, text rows: G_1 + C_0
                cells = torch.empty_like(grad)
                for b in (0, 1):
                    side_by_side([columns[r, 1 - b] for r in ranks], out=cells[b]).add_(grad[b])
                out = cells @ gathered  # [2, B, d]: (image, text)
                return out[0], out[1], None, None, None, None
            text_cells = side_by_side([columns[r, 0] for r in ranks])
            return grad[0] @ gathered[0], text_cells @ gathered[1], None, None, None, None


def side_by_side(blocks: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, k·B]``: the ``[B, B]`` blocks transposed, side by side (C[m, r·B + i] = blocks[r][i, m]); each through
    a contiguous transposed copy, which is blocked (a strided read of the whole would be 2-3× slower)."""
    return torch.cat([block.T.contiguous() for block in blocks], dim=1, out=out)


class _ViewBlocks(torch.autograd.Function):
    """The unimodal form's ``[2, B, 2N]``: this rank's view-1 and view-2 anchors · the 2N views Z = [view 1; view 2]
    (gathered ``[2, N, d]`` (view 2, view 1)), with the backward of ``_AnchorBlocks``: each rank receives the
    columns of its own rows of both views, ∂/∂view_v = (G_v + C_v) @ Z, one product."""

    @staticmethod
    def forward(ctx, view_1, view_2, gathered, rows, comm):
        ctx.rows, ctx.comm = rows, comm
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            comm.count_columns(4 * view_1.shape[0] * gathered.shape[1], view_1.element_size())  # the backward's
        views = torch.cat([view_1, view_2]) if comm.world_size == 1 else torch.cat([gathered[1], gathered[0]])
        ctx.save_for_backward(views)
        return torch.stack([view_1, view_2]) @ views.T

    @staticmethod
    def backward(ctx, grad):
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, None, None, None
        with exact_float32(grad.device.type):
            (views,) = ctx.saved_tensors
            columns = ctx.comm.exchange_columns(grad, views=True)  # [K, 2, B, 2, B]: [r, a, i, v, m]
            cells = torch.empty_like(grad)  # view v's rows: G_v + C_v, C_v[m, a·N + r·B + i] = columns[r, a, i, v, m]
            for v in (0, 1):
                blocks = [columns[r, a, :, v] for a in (0, 1) for r in range(columns.shape[0])]
                side_by_side(blocks, out=cells[v]).add_(grad[v])
            out = cells @ views  # [2, B, d]
        return out[0], out[1], None, None, None


@dataclass
class Pairs:
    """This rank's anchors against their candidates, both directions: block 0 the B image anchors against the N
    texts (then the text queue), block 1 the B text anchors against the N images (then the image queue). Unimodal
    form: block 0 the view-1 anchors, block 1 the view-2 anchors, each against the 2N views [view 1; view 2]."""

    cos: torch.Tensor  # [2, B, M] (M = N + Q, or 2N), differentiable through the anchors and the candidates
    positive: torch.Tensor  # [2, B] each anchor's positive: cos_ii (both directions), or its other view's cosine
    negative: torch.Tensor  # [2, B, M] bool: the cells that are negatives of their anchor
    count: torch.Tensor | int  # the negatives in g's mean: N − 1 (+ the queue's filled slots), or 2N − 2


@dataclass
class GlobalFeatures:
    """What an objective sees: this rank's B anchors (``image``, ``text`` ``[B, d]``, autograd) and, through
    ``pairs()``/``cosines()``, their similarities to the global batch's N candidates (differentiable into every
    candidate's owner), in the compute dtype; ``indices`` ``[N]`` (or None for losses without per-sample state)."""

    image: torch.Tensor
    text: torch.Tensor
    gathered: torch.Tensor  # [2, N, d] (text, image), rank-major, no autograd (the pair blocks carry it)
    comm: Comm
    indices: torch.Tensor | None
    local: slice  # this rank's rows of the global batch
    ids: torch.Tensor | None = None  # [N] what tells rows apart as negatives: group ids if given, else indices
    grouped: bool = False  # ids are group ids (multi-positive)
    queue: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (image, text, indices) [Q, ...]
    momentum: tuple[torch.Tensor, torch.Tensor] | None = None  # the momentum model's (image, text) [N, d]
    unimodal: bool = False  # image and text are two views of the same images (module docstring)

    @property
    def size(self) -> int:
        """N, the global batch."""
        return self.gathered.shape[1]

    @property
    def anchors(self) -> int:
        """B, this rank's anchors per direction: a loss summed over its anchors divides by this (its mean)."""
        return self.image.shape[0]

    def positive_cells(self) -> torch.Tensor:
        """``[B, N]`` bool: anchor i's own column (the global row of the pair)."""
        cells = torch.zeros(self.anchors, self.size, dtype=torch.bool, device=self.image.device)
        cells.diagonal(offset=self.local.start).fill_(True)
        return cells

    def same_sample(self) -> torch.Tensor:
        """``[B, N]`` bool: True where anchor i and column j are one sample (its pair, and copies of one data index
        or group), i.e. the cells that are no negatives of each other."""
        cells = self.positive_cells()
        if self.ids is None:
            return cells
        return cells | (self.ids[self.local, None] == self.ids[None, :])

    def same_pair(self) -> torch.Tensor:
        """``[B, N]`` bool: the pairs themselves, and with groups every same-group cell (openclip, siglip)."""
        return self.same_sample() if self.grouped else self.positive_cells()

    def cosines(self) -> torch.Tensor:
        """``[B, N]`` image anchor i · text j, differentiable."""
        return self._blocks(1)[0]

    def _blocks(self, sets: int) -> torch.Tensor:
        return _AnchorBlocks.apply(self.image, self.text, self.gathered, self.local, self.comm, sets)

    def pairs(self) -> Pairs:
        """Both directions' anchors against their candidates: the batch, then the queue (queue.py) if any."""
        if self.unimodal:
            return self._view_pairs()
        cos = self._blocks(2)  # [2, B, N]
        positive = (self.image * self.text).sum(dim=-1)  # image i · text i (not cos's cells: no [2, B, N] backward)
        negative = (~self.same_sample()).expand(2, -1, -1)
        count = self.size - 1
        if self.queue is not None:
            q_image, q_text, q_indices = self.queue
            extra = torch.stack([inner(self.image, q_text), inner(self.text, q_image)])
            valid = q_indices >= 0
            own = q_indices[None, :] == self.ids[self.local, None]  # an anchor's own sample (or group), queued before
            cos = torch.cat([cos, extra], dim=-1)
            negative = torch.cat([negative, (valid[None, :] & ~own).expand(2, -1, -1)], dim=-1)
            count = count + valid.sum()
        return Pairs(cos=cos, positive=positive.expand(2, -1), negative=negative, count=count)

    def _view_pairs(self) -> Pairs:
        """The unimodal form: each view against the 2N views; a view itself, its other view and both views of a
        copy of its image (the same data index) are no negatives."""
        n = self.size
        rows = _ViewBlocks.apply(self.image, self.text, self.gathered, self.local, self.comm)  # [2, B, 2N]
        negative = (~self.same_sample()).repeat(1, 2).expand(2, -1, -1)
        positive = (self.image * self.text).sum(dim=-1)  # view 1 · view 2 of each image, for both anchors
        return Pairs(cos=rows, positive=positive.expand(2, -1), negative=negative, count=2 * n - 2)

    @torch.no_grad()
    def momentum_cos(self) -> torch.Tensor:
        """``[2, B, M]`` as ``pairs().cos`` from the momentum model's features (the queue holds its features)."""
        image, text = self.momentum
        anchors = torch.stack([image[self.local], text[self.local]])
        rows = anchors @ torch.stack([text, image]).transpose(-1, -2)
        if self.queue is not None:
            q_image, q_text, _ = self.queue
            rows = torch.cat([rows, anchors @ torch.stack([q_text, q_image]).transpose(-1, -2)], dim=-1)
        return rows


def global_features(batch: GlobalBatch, comm: Comm, dtype: torch.dtype | None = None) -> GlobalFeatures:
    """This rank's anchors and the gathered batch, in the compute dtype."""
    dtype = dtype or compute_dtype(batch.image.dtype)
    return GlobalFeatures(
        image=batch.image.to(dtype),
        text=batch.text.to(dtype),
        gathered=batch.candidates.to(dtype),
        comm=comm,
        indices=batch.all_indices,
        local=batch.local_rows,
        ids=batch.all_ids,
        grouped=batch.all_groups is not None,
    )


def atanh_logits(cos: torch.Tensor, clamp: float) -> torch.Tensor:
    """φ(c) = 2·atanh(c) with c clamped to ±(1 − clamp), differentiable (0 where clamped, as torch.clamp)."""
    limit = 1.0 - clamp
    return 2.0 * torch.atanh(cos.clamp(-limit, limit))


def pair_map(cos: torch.Tensor, similarity: str, clamp: float) -> torch.Tensor:
    """The logits' similarity map: the cosine itself, or φ (similarity.py)."""
    return cos if similarity == "cosine" else atanh_logits(cos, clamp)


def weighted_directions(per_direction: torch.Tensor, weights: tuple[float, float] | None) -> torch.Tensor:
    """``(w_i2t·x[0] + w_t2i·x[1])/(w_i2t + w_t2i)`` of a ``[2]`` (image-anchored, text-anchored) tensor; None:
    their mean."""
    if weights is None:
        return per_direction.mean()
    w_i2t, w_t2i = (float(w) for w in weights)  # Python floats: a tensor of them is a host copy on CUDA
    return (w_i2t * per_direction[0] + w_t2i * per_direction[1]) / (w_i2t + w_t2i)


def masked_logsumexp(logits: torch.Tensor, keep: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log Σ exp over the ``keep`` cells (−inf where none), differentiable (``_MaskedLogSumExp``)."""
    if dim not in (-1, logits.dim() - 1):
        return torch.logsumexp(logits.masked_fill(~keep, -math.inf), dim=dim)
    return _MaskedLogSumExp.apply(logits, keep)


class _MaskedLogSumExp(torch.autograd.Function):
    """``masked_logsumexp`` over the last dimension in fewer passes over the ``[2, B, M]`` cells than autograd
    through masked_fill and logsumexp (4 forward, 1 backward): the shifted exponentials are kept for the gradient
    softmax·grad (0 on the cells left out, and on a row with none)."""

    @staticmethod
    def forward(ctx, logits, keep):
        e = logits.masked_fill(~keep, -math.inf)
        top = e.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)  # (a row with no cell kept: 0, its sum 0, log −inf)
        total = e.sub_(top).exp_().sum(dim=-1, keepdim=True)
        ctx.save_for_backward(e, total)
        return (top + torch.log(total)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        e, total = ctx.saved_tensors
        weight = torch.where(total > 0, grad.unsqueeze(-1) / total, 0.0)
        return e * weight, None


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
    """The per-sample state of this rank's anchors (a SampleStateLoss's shard): ``old`` (name -> ``[B]``) and
    ``seen`` ``[B]``, from the owners in one all_reduce (``batch_old``: the same for all N rows of the global batch,
    for batch-wide statistics); ``write(**new)`` (``[B]`` each) hands the anchors' new values to their owners in
    the end-of-call all_reduce (``AutogradObjective._finish``; a repeated index keeps its last occurrence; nothing
    in eval mode)."""

    def __init__(self, loss, comm: Comm, batch: GlobalBatch, dtype: torch.dtype):
        self.loss, self.state, self.batch = loss, loss.state_for_batch(comm, batch), batch
        self.slots = self.state.locate(
            batch.all_indices, assert_in_range=loss._assert_indices, repeats=batch.indices_repeat()
        )
        self.stored = self.state.read(self.slots)
        table = comm.share_rows(batch, None, self.stored, dtype=dtype)
        self.batch_old = {name: table[:, i] for i, name in enumerate(self.state.names)}
        self.old = {name: column[batch.local_rows] for name, column in self.batch_old.items()}
        self.seen = table[batch.local_rows, -1] > 0.5
        self.new: torch.Tensor | None = None  # [B, F] the anchors' new rows, until _finish

    def write(self, **new: torch.Tensor) -> None:
        self.new = torch.stack([new[name].detach() for name in self.state.names], dim=1)

    def pending(self) -> torch.Tensor | None:
        """``[N, F]``: the anchors' new rows at their global rows, zero elsewhere (None: nothing to store)."""
        if self.new is None or not self.loss.training:
            return None
        if self.batch.world_size == 1:
            return self.new
        after = self.batch.global_size - self.batch.offset - self.batch.local_size
        return torch.nn.functional.pad(self.new, (0, 0, self.batch.offset, after))

    def store(self, rows: torch.Tensor) -> None:
        """The owners' rows of the global batch's new ``[N, F]`` (every rank's anchors' rows, all-reduced)."""
        self.loss.store(self.state, self.slots, rows, previous=self.stored)


class _GlobalValue(torch.autograd.Function):
    """The identity in the backward, ``value`` (the ranks' mean of the loss) in the forward."""

    @staticmethod
    def forward(ctx, loss, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AnchorRows:
    """A metric's argument holding a value per anchor of this rank, ``[..., B]``: ``_finish`` hands the metric the
    whole global batch's ``[..., N]`` (rank-major), exact, in its one all_reduce (each rank adds its rows into its
    own slot of zeros: 2N values for two directions, no collective of their own)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows.detach()


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
        features = global_features(batch, comm, dtype)
        features.unimodal = bool(getattr(self.options, "unimodal", False))
        if batch.momentum is not None:
            features.momentum = (batch.momentum[1].to(dtype), batch.momentum[0].to(dtype))
        if self.queue is not None and self.training:  # eval mode (a validation loss): the in-batch objective
            features.queue = self.queue.entries(batch.all_image.to(dtype))
        state = StateRows(self, comm, batch, dtype) if self.uses_sample_state else None
        loss, metrics = self._finish(comm, batch, *self._objective(features, state), state)
        if self.queue is not None and self.training:  # the same rows on every rank: the queues stay identical
            # MoCo: the momentum model's features when there is one, else the online ones (cross-batch memory)
            image, text = features.momentum or (batch.all_image.to(dtype), batch.all_text.to(dtype))
            self.queue.push(image, text, batch.all_ids)
        return loss, metrics

    def _finish(self, comm: Comm, batch: GlobalBatch, loss, metrics: dict, state: StateRows | None):
        """``(loss, metrics)`` of the global batch from this rank's share: ONE all_reduce (SUM) of the new state rows
        (one contributor per row: exact), the loss value and the floating-point metrics, which become the ranks'
        mean (the global mean of a mean over anchors); the owners store their rows. The loss keeps this rank's
        gradient (module docstring)."""
        rows = state.pending() if state is not None else None
        lazy = isinstance(metrics, functools.partial)  # computed when read: its 0-d tensor arguments are reduced
        if comm.world_size == 1:
            if rows is not None:
                state.store(rows)
            if lazy:  # (this rank's anchors are the whole batch)
                args = (a.rows if isinstance(a, AnchorRows) else a for a in metrics.args)
                metrics = functools.partial(metrics.func, *args, **metrics.keywords)
            return loss, metrics
        if callable(metrics) and not lazy:
            raise TypeError(f"{self.name}: an objective's metrics are a dict or a functools.partial")
        given = dict(enumerate(metrics.args)) if lazy else metrics
        names = [k for k, v in given.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        names = [k for k in names if given[k].dim() == 0] if lazy else names
        values = [loss.detach().reshape(1)] + [given[k].detach().reshape(-1) for k in names]
        dtype = loss.dtype
        anchor_rows = [k for k, v in given.items() if isinstance(v, AnchorRows)]
        slots = [self._rank_slot(comm, given[k].rows, dtype) for k in anchor_rows]  # summed, not averaged
        flat = torch.cat(
            ([rows.reshape(-1).to(dtype)] if rows is not None else []) + slots + [v.to(dtype) for v in values]
        )
        comm.all_reduce_sum_(flat, ledger_key="values", state_part=0 if rows is None else rows.numel())
        if rows is not None:
            state.store(flat[: rows.numel()].view_as(rows))
            flat = flat[rows.numel() :]
        reduced = dict(given)
        for name, slot in zip(anchor_rows, slots):
            local = given[name].rows
            whole = flat[: slot.numel()].view(comm.world_size, *local.shape).movedim(0, -2)
            reduced[name] = whole.reshape(*local.shape[:-1], -1).to(local.dtype)
            flat = flat[slot.numel() :]
        means = (flat / comm.world_size).split([v.numel() for v in values])
        for name, mean in zip(names, means[1:]):
            reduced[name] = mean.view_as(given[name]).to(given[name].dtype)
        if lazy:
            metrics = functools.partial(metrics.func, *(reduced[i] for i in range(len(reduced))), **metrics.keywords)
        else:
            metrics = reduced
        return _GlobalValue.apply(loss, means[0].view_as(loss)), metrics

    @staticmethod
    def _rank_slot(comm: Comm, rows: torch.Tensor, dtype) -> torch.Tensor:
        """``rows`` in this rank's slot of a flat ``[world, *rows.shape]`` of zeros."""
        slot = rows.new_zeros((comm.world_size, *rows.shape), dtype=dtype)
        slot[comm.rank] = rows.to(dtype)
        return slot.reshape(-1)

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
    "AnchorRows",
    "AutogradObjective",
    "GlobalFeatures",
    "StateRows",
    "global_features",
    "hard_negatives",
    "masked_logsumexp",
    "pair_map",
    "weighted_directions",
]
