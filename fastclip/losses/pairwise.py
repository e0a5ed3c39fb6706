"""The pairwise core shared by all losses: two ``[B, N]`` similarity blocks, their masked exponentials
read by row and by column, and one autograd Function that turns them into the weighted surrogate.

A block is ``S = X @ Ỹᵀ``: this rank's rows X of one modality against the gathered rows Ỹ of the other
(``S_it``: local images vs all texts; ``S_ti``: local texts vs all images). It is read two ways:

* by row: local anchor i (X's modality) against all N candidates, ``rows[i, k] = exp(a_i(S_ik − p_i) − r_i)``
  with ``p_i = e1_i·e2_i`` its positive ("loss1": gradient into the anchor and its positive);
* by column: global anchor j (Y's modality, detached) against this rank's candidates,
  ``cols[k, j] = exp(a'_j(S_kj − P_j) − r'_j)`` ("loss2": gradient into the local negatives only).

The positive pair (local row k, global column offset+k) is excluded in both readings. ``a`` is the scale
(1/τ, global or per anchor) and ``r`` an optional per-anchor shift (v2's bound b, openclip's log-sum-exp shift).

The similarities are computed without autograd and the surrogate's gradient is written out
(``WeightedSurrogate``): with ``L = c[Σ_i w_i Σ_k rows_ik + Σ_j w'_j Σ_k cols_kj]``, ``∂L/∂S = c(w_i a_i rows_ik +
w'_j a'_j cols_kj)``, so the feature gradient is one ``[B, N] @ [N, d]`` matmul per block, plus the positive's
term; the two exp matrices per block (and S itself when a global scale needs a gradient) are kept for
backward, which reuses them in place.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .batch import GlobalBatch


@contextmanager
def exact_float32(device_type: str):
    """Autocast off and float32 matmuls in IEEE precision (not TF32) on CUDA, restored afterwards: the loss's
    similarities and gradients must not depend on the towers' speed settings (train.tf32, a user's autocast)."""
    with torch.autocast(device_type, enabled=False):
        if device_type != "cuda":
            yield
            return
        matmul = torch.backends.cuda.matmul
        if hasattr(matmul, "fp32_precision"):  # torch >= 2.9: the per-backend API, which train.tf32 sets; reading
            previous = matmul.fp32_precision  # the legacy global after it raises (a mix of the two APIs)
            matmul.fp32_precision = "ieee"
            try:
                yield
            finally:
                matmul.fp32_precision = previous
            return
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(previous)


def compute_dtype(feature_dtype: torch.dtype) -> torch.dtype:
    """Exponentials and sums run in at least float32 (features may be bf16/fp16)."""
    return torch.promote_types(feature_dtype, torch.float32)


def similarity(
    local: torch.Tensor, gathered: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, N]`` block ``scale·(local @ gathered.T)`` without autograd (WeightedSurrogate writes its gradient).

    A global scale is folded in here (on the [B, d] side when no upcast is needed), which saves a pass over
    the block in ``row_terms``/``column_terms`` (``sim_is_scaled=True``).
    """
    with torch.no_grad():
        # upcast first: bf16/fp16 features are multiplied in the compute dtype (the loss runs with autocast off)
        local, gathered = local.detach().to(dtype), gathered.to(dtype)
        if scale is None:
            return local @ gathered.T
        return (local * scale) @ gathered.T


def positives(batch: GlobalBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e1_i·e2_i for the B local rows, ẽ1_j·ẽ2_j for all N)``, without autograd."""
    with torch.no_grad():
        local = (batch.image.detach().to(dtype) * batch.text.detach().to(dtype)).sum(dim=1)
        everyone = (batch.all_image.to(dtype) * batch.all_text.to(dtype)).sum(dim=1)
    return local, everyone


def _per_row(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 0 else x[:, None]


def _per_column(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 0 else x[None, :]


@dataclass
class RowTerms:
    """Local anchors (rows) against all candidates."""

    exp: torch.Tensor  # [B, N] exp(a_i(S_ik − p_i) − r_i), 0 at the positive
    total: torch.Tensor  # [B] Σ_k exp
    moment: torch.Tensor | None  # [B] Σ_k exp · a_i(S_ik − p_i)   (v2's τ-gradient)
    shift: torch.Tensor | None  # [B] r_i
    scale: torch.Tensor  # a: 0-d or [B]


@dataclass
class ColumnTerms:
    """Global anchors (columns) against this rank's candidates."""

    exp: torch.Tensor  # [B, N] exp(a'_j(S_kj − P_j) − r'_j), 0 at the positive
    total: torch.Tensor | None  # [N] Σ_k exp (only for a scale gradient through the columns)
    scale: torch.Tensor  # a': 0-d or [N]


# Excluded cells (a pair's own positive, a copy of the same sample) hold this in the similarity blocks: after any
# scale (1/τ <= 1e3) and shift it stays finite and far below every real logit, so its exp is exactly 0 and
# 0 * it is 0 in the backward's sums (-inf would give NaN there).
EXCLUDED = -1e30


def exclude_(sim: torch.Tensor, cells) -> torch.Tensor:
    """Write EXCLUDED into the cells that are no negatives: the B positives (index tensors: positive_cells(), or
    same_sample_cells() when no index repeats), or the ``[B, N]`` bool mask of batch.same_sample_cells()
    (masked_fill_: indexing with a bool tensor would sync with the host on CUDA). Once per block: its row and
    column readings both see it."""
    with torch.no_grad():
        if isinstance(cells, torch.Tensor):
            return sim.masked_fill_(cells, EXCLUDED)
        sim[cells] = EXCLUDED
        return sim


def _differences(
    sim: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor, sim_is_scaled: bool, *, in_place: bool = False
):
    """``a·S − offset`` (``offset`` and ``a`` shaped to broadcast) into a new block, or into ``sim`` itself: one pass
    when ``sim`` already holds ``a·S``, else ``a·(S − offset/a)`` in two (two simple passes beat one broadcasting
    addcmul on CPU)."""
    if not sim_is_scaled:
        offset = offset / scale
    diff = sim.sub_(offset) if in_place else sim - offset
    return diff if sim_is_scaled else diff.mul_(scale)


def row_terms(
    sim: torch.Tensor,
    positive: torch.Tensor,
    scale: torch.Tensor,
    *,
    sim_is_scaled: bool = False,
    bound_floor: torch.Tensor | None = None,
    moment: bool = False,
) -> RowTerms:
    """Rows of one block (its excluded cells already hold EXCLUDED: exclude_). With ``bound_floor`` (v2, openclip;
    -inf for v0/v1/v3), each row is shifted by ``r_i = max(bound_floor_i, max_{k≠i} d_ik)``, found on the block
    itself: max_k a_i(S_ik − p_i) = a_i(max_k S_ik − p_i) for a_i > 0."""
    with torch.no_grad():
        a = _per_row(scale)
        offset = a * positive[:, None]  # a_i·p_i
        shift = None
        if bound_floor is not None:
            top = sim.amax(dim=1, keepdim=True)  # max over the candidates (an excluded cell never wins)
            top = top - offset if sim_is_scaled else (top - positive[:, None]) * a
            # (a row with no candidate at all keeps its EXCLUDED cells at exp 0: the floor below EXCLUDED/2)
            shift = torch.maximum(bound_floor, top.squeeze(1)).clamp_(min=EXCLUDED / 2)
            offset = offset + shift[:, None]
        diff = _differences(sim, offset, a, sim_is_scaled)  # d_ik − r_i
        if not moment:
            exp = diff.exp_()
            return RowTerms(exp=exp, total=exp.sum(dim=1), moment=None, shift=shift, scale=scale)
        exp = torch.exp(diff)
        total = exp.sum(dim=1)
        mom = diff.mul_(exp).sum(dim=1)  # Σ (d − r)·exp (excluded cells: finite · 0)
        if shift is not None:
            mom = mom + shift * total  # Σ d·exp = Σ (d − r)·exp + r·Σ exp
        return RowTerms(exp=exp, total=total, moment=mom, shift=shift, scale=scale)


def column_terms(
    sim: torch.Tensor,
    positive_all: torch.Tensor,
    scale: torch.Tensor,
    *,
    sim_is_scaled: bool = False,
    shift: torch.Tensor | None = None,
    total: bool = False,
    in_place: bool = False,
) -> ColumnTerms:
    """Columns of one block (global anchors; excluded cells already EXCLUDED), optionally shifted by ``shift`` [N].
    ``in_place``: the exponentials overwrite ``sim`` (when nothing reads the block afterwards: one [B, N] buffer
    fewer to allocate and to keep for the backward)."""
    with torch.no_grad():
        a = _per_column(scale)
        offset = a * positive_all[None, :]
        if shift is not None:
            offset = offset + shift[None, :]
        exp = _differences(sim, offset, a, sim_is_scaled, in_place=in_place).exp_()
        return ColumnTerms(exp=exp, total=exp.sum(dim=0) if total else None, scale=scale)


@dataclass
class Block:
    """One similarity block with the weights of its anchors: rows are X's modality, columns Ỹ's."""

    rows: RowTerms
    cols: ColumnTerms
    row_weight: torch.Tensor  # [B] weights of the local anchors
    col_weight: torch.Tensor  # [N] weights of the global anchors
    candidates: torch.Tensor  # Ỹ [N, d], to map ∂L/∂S back to X
    sim: torch.Tensor | None = None  # s·S (scaled by the global s), kept only when s needs a gradient
    positive: torch.Tensor | None = None  # [B] p_i, idem
    positive_all: torch.Tensor | None = None  # [N] P_j, idem (scale gradient through the columns)
    sim_grad: torch.Tensor | None = None  # [B, N] φ'(S) when the logits map S (similarity.py), else 1
    positive_grad: torch.Tensor | None = None  # [B] φ'(p_i), idem


class WeightedSurrogate(torch.autograd.Function):
    """``c·Σ_blocks Σ_i w_i Σ_k rows_ik`` (the value: this rank's anchors), with the gradient of
    ``c·Σ_blocks [Σ_i w_i Σ_k rows_ik + Σ_j w'_j Σ_k cols_kj]`` into the image rows, the text rows and the scale.

    Inputs: ``image`` (X of block 0), ``text`` (X of block 1), ``scale`` (the global s = 1/τ whose gradient
    is wanted, or None; ``[2]`` when each block's rows have their own scale, with ``block.sim`` = s[b]·S), ``blocks``
    (image block, text block), ``coef`` c, ``scale_in_columns``: whether the
    columns' exponentials count in the scale's gradient (compat="reference"), ``value``: a value to report
    instead (openclip reports the cross-entropy whose gradient this is).
    Backward reuses the saved exponentials in place, so it can run once (no retain_graph double backward).
    """

    @staticmethod
    def forward(ctx, image, text, scale, blocks, coef, scale_in_columns, value):
        ctx.blocks, ctx.coef, ctx.scale_in_columns = blocks, coef, scale_in_columns
        ctx.save_for_backward(image, text, scale)
        if value is not None:
            return value.detach().clone()
        return coef * sum((b.row_weight * b.rows.total).sum() for b in blocks)

    @staticmethod
    def backward(ctx, grad_out):
        with exact_float32(grad_out.device.type):  # a backward called inside autocast, or with TF32 on
            return WeightedSurrogate._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        if ctx.blocks is None:
            raise RuntimeError("the FastCLIP surrogate's backward can run only once per forward")
        image, text, scale = ctx.saved_tensors
        want_scale = scale is not None and ctx.needs_input_grad[2]
        s = scale.detach() if want_scale else None
        per_block = want_scale and s.dim() == 1  # [2]: block b's rows have their own scale s[b]
        coef = ctx.coef * grad_out
        grads, grad_positive, scale_sums = [], 0.0, []
        for b, block in enumerate(ctx.blocks):
            s_b = s[b] if per_block else s
            row_factor = coef * block.row_weight * block.rows.scale  # ∂L/∂S by row, per anchor
            col_factor = coef * block.col_weight * block.cols.scale
            grad_sim = block.rows.exp.mul_(_per_row(row_factor))
            if want_scale and not ctx.scale_in_columns:
                scale_sums.append(_scale_term(grad_sim, block, row_factor, s_b) / s_b)
            grad_sim.addcmul_(block.cols.exp, _per_column(col_factor))
            if want_scale and ctx.scale_in_columns:
                scale_sums.append(
                    (
                        _scale_term(grad_sim, block, row_factor, s_b)
                        - (col_factor * block.cols.total * block.positive_all).sum()
                    )
                    / s_b
                )
            if block.sim_grad is not None:  # chain rule through the similarity map (0 where it clamps)
                grad_sim.mul_(block.sim_grad)
            grads.append(grad_sim @ block.candidates.to(grad_sim.dtype))
            positive_term = row_factor * block.rows.total  # p_i enters every row term of anchor i
            if block.positive_grad is not None:
                positive_term = positive_term * block.positive_grad
            grad_positive = grad_positive - positive_term
        ctx.blocks = None  # free the [B, N] matrices now
        # d/ds exp(s·(S − p)) = (S − p)·exp: with grad_sim = factor·exp, Σ grad_sim·(S − p) / s.
        grad_scale = None
        if want_scale:
            grad_scale = (torch.stack(scale_sums) if per_block else sum(scale_sums)).to(scale.dtype)
        grad_positive = grad_positive[:, None]
        grad_image = grads[0] + (grad_positive * text.detach()).to(image.dtype)
        grad_text = grads[1] + (grad_positive * image.detach()).to(text.dtype)
        return grad_image.to(image.dtype), grad_text.to(text.dtype), grad_scale, None, None, None, None


def _scale_term(grad_sim: torch.Tensor, block: Block, row_factor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``Σ_ik grad_sim_ik·S_ik − Σ_i factor_i·total_i·p_i`` (one dot product over the block; ``block.sim`` = s·S)."""
    dot = torch.dot(grad_sim.reshape(-1), block.sim.reshape(-1)) / scale
    return dot - (row_factor * block.rows.total * block.positive).sum()


def weighted_surrogate(image, text, scale, blocks, coef, *, scale_in_columns=False, value=None) -> torch.Tensor:
    return WeightedSurrogate.apply(image, text, scale, blocks, coef, scale_in_columns, value)
