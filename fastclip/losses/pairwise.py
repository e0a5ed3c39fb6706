"""The pairwise core shared by all losses: the two similarity blocks of a global batch, stacked as one
``[2, B, N]`` tensor, their masked exponentials read by row and by column, and one autograd Function that turns
them into the weighted surrogate.

Block 0 is ``S_it``: this rank's images (rows) against all gathered texts (columns); block 1 is ``S_ti``: this
rank's texts against all gathered images. Both are ``X @ Ỹᵀ`` with ``X = [images, texts]`` ``[2, B, d]`` and
``Ỹ = batch.candidates = [all texts, all images]`` ``[2, N, d]``: one batched matmul, and every step after it
runs once for both blocks (at small B and d each op's fixed cost is what a loss call pays).

A block is read two ways:

* by row: local anchor i (the rows' modality) against all N candidates,
  ``rows[b, i, k] = exp(a_bi(S_bik − p_i) − r_bi)`` with ``p_i = e1_i·e2_i`` its positive ("loss1": gradient into
  the anchor and its positive);
* by column: global anchor j (the other modality, detached) against this rank's candidates,
  ``cols[b, k, j] = exp(a'_bj(S_bkj − P_j) − r'_bj)`` ("loss2": gradient into the local negatives only).

So block 0's rows are image anchors and its columns text anchors, block 1 the other way round: a per-anchor
table ``x`` ``[N, 2]`` (image, text) reads as ``row_values(x[local])`` and ``column_values(x)``.
The positive pair (local row k, global column offset+k) is excluded in both readings. ``a`` is the scale
(1/τ: 0-d, ``[2, 1]`` per block, or per anchor) and ``r`` an optional per-anchor shift (v2's bound b, openclip's
log-sum-exp shift).

The similarities are computed without autograd and the surrogate's gradient is written out
(``WeightedSurrogate``): with ``L = c·Σ_b[Σ_i w_bi Σ_k rows_bik + Σ_j w'_bj Σ_k cols_bkj]``, ``∂L/∂S_b =
c(w_bi a_bi rows_bik + w'_bj a'_bj cols_bkj)``, so the feature gradient is one ``[2, B, N] @ [2, N, d]`` batched
matmul, plus the positive's term; the two exp tensors (and S itself when a global scale needs a gradient) are
kept for backward, which reuses them in place.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .batch import GlobalBatch
from .kernels import shifted_exp


def _autocast_query_takes_a_device() -> bool:
    try:  # torch >= 2.4; before, is_autocast_enabled() asked about CUDA only
        torch.is_autocast_enabled("cpu")
        return True
    except TypeError:
        return False


_AUTOCAST_QUERY_BY_DEVICE = _autocast_query_takes_a_device()


@contextmanager
def exact_float32(device_type: str):
    """Autocast off and float32 matmuls in IEEE precision (not TF32) on CUDA, restored afterwards: the loss's
    similarities and gradients must not depend on the towers' speed settings (train.tf32, a user's autocast)."""
    if device_type != "cuda" and _AUTOCAST_QUERY_BY_DEVICE and not torch.is_autocast_enabled(device_type):
        # nothing to switch off (5 µs a call saved)
        yield
        return
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
    """``[B, N]`` block ``scale·(local @ gathered.T)`` without autograd (siglip's own Function writes its gradient)."""
    with torch.no_grad():
        # upcast first: bf16/fp16 features are multiplied in the compute dtype (the loss runs with autocast off)
        local, gathered = local.detach().to(dtype), gathered.to(dtype)
        if scale is None:
            return local @ gathered.T
        return (local * scale) @ gathered.T


def pair_similarity(batch: GlobalBatch, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``[2, B, N]``: ``scale·(images @ all textsᵀ)`` and ``scale·(texts @ all imagesᵀ)``, one batched matmul,
    without autograd (WeightedSurrogate writes its gradient). A global scale is folded in on the ``[2, B, d]``
    side, which saves a pass over the blocks in ``row_terms``/``column_terms`` (``sim_is_scaled=True``)."""
    with torch.no_grad():
        local = torch.stack([batch.image.detach(), batch.text.detach()]).to(dtype)
        if scale is not None:
            local = local * scale
        return torch.bmm(local, batch.candidates.to(dtype).transpose(1, 2))


def positives(batch: GlobalBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e1_i·e2_i for the B local rows, ẽ1_j·ẽ2_j for all N)``, without autograd (the local ones are the
    gathered copies' rows: the same bits)."""
    with torch.no_grad():
        everyone = (batch.all_image.to(dtype) * batch.all_text.to(dtype)).sum(dim=1)
    return everyone[batch.local_rows], everyone


def row_values(per_anchor: torch.Tensor) -> torch.Tensor:
    """``[2, B]`` row values of the two blocks from this rank's ``[B, 2]`` (image, text) anchor values: block 0's
    rows are the image anchors, block 1's the text anchors."""
    return per_anchor.T


def column_values(per_anchor: torch.Tensor) -> torch.Tensor:
    """``[2, N]`` column values of the two blocks from the global ``[N, 2]`` (image, text) anchor values: block 0's
    columns are the text anchors, block 1's the image anchors. Contiguous: a pass over ``[2, B, N]`` that broadcasts
    a strided ``[2, 1, N]`` runs at half speed on the CPU (and ``per_anchor.T.flip(0)`` keeps the stride)."""
    return torch.stack((per_anchor[:, 1], per_anchor[:, 0]))


def _per_row(x: torch.Tensor) -> torch.Tensor:
    """A row value (0-d, ``[2, 1]`` per block, ``[2, B]`` per anchor) shaped to broadcast over ``[2, B, N]``."""
    return x if x.dim() == 0 else x.unsqueeze(-1)


def _per_column(x: torch.Tensor) -> torch.Tensor:
    """A column value (0-d, ``[2, 1]`` per block, ``[2, N]`` per anchor) shaped to broadcast over ``[2, B, N]``."""
    return x if x.dim() == 0 else x.unsqueeze(-2)


@dataclass
class RowTerms:
    """Local anchors (rows) against all candidates, both blocks."""

    exp: torch.Tensor  # [2, B, N] exp(a_bi(S_bik − p_i) − r_bi), 0 at excluded cells (÷ total if normalized)
    total: torch.Tensor  # [2, B] Σ_k exp
    moment: torch.Tensor | None  # [2, B] Σ_k exp · a_bi(S_bik − p_i)   (the τ-gradient of v2 and TempNet)
    shift: torch.Tensor | None  # [2, B] r_bi
    scale: torch.Tensor  # a: 0-d, [2, 1] or [2, B]
    normalized: bool = False  # exp holds each row's softmax: the terms are exp·total (one pass fewer to make)

    def values(self) -> torch.Tensor:
        """``[2, B, N]`` exp(a_bi(S_bik − p_i) − r_bi) (a new tensor when ``exp`` holds the softmax)."""
        return self.exp * self.total.unsqueeze(-1) if self.normalized else self.exp


@dataclass
class ColumnTerms:
    """Global anchors (columns) against this rank's candidates, both blocks."""

    exp: torch.Tensor  # [2, B, N] exp(a'_bj(S_bkj − P_j) − r'_bj), 0 at the excluded cells
    total: torch.Tensor | None  # [2, N] Σ_k exp (only for a scale gradient through the columns)
    scale: torch.Tensor  # a': 0-d, [2, 1] or [2, N]


# Excluded cells (a pair's own positive, a copy of the same sample) hold this in the similarity blocks: after any
# scale (1/τ <= 1e3) and shift it stays finite and far below every real logit, so its exp is exactly 0 and
# 0 * it is 0 in the backward's sums (-inf would give NaN there).
EXCLUDED = -1e30


def exclude_(sim: torch.Tensor, cells) -> torch.Tensor:
    """Write EXCLUDED into the cells that are no negatives, in both blocks of ``sim`` ``[2, B, N]`` (or in one
    ``[B, N]`` block): the B positives (index tensors: positive_cells(), or same_sample_cells() when no index
    repeats), or the ``[B, N]`` bool mask of batch.same_sample_cells() (masked_fill_: indexing with a bool tensor
    would sync with the host on CUDA). Once per block: its row and column readings both see it."""
    with torch.no_grad():
        if isinstance(cells, torch.Tensor):
            return sim.masked_fill_(cells, EXCLUDED)
        # the value as a device tensor: a Python scalar is copied from the host, a sync on CUDA
        sim[..., cells[0], cells[1]] = sim.new_full((), EXCLUDED)
        return sim


def _offset_and_scale(offset: torch.Tensor, a: torch.Tensor, sim_is_scaled: bool):
    """``(offset', scale')`` with ``(S − offset')·scale' = a·S − offset``: ``sim`` already holds ``a·S`` (one
    subtraction), or ``a·(S − offset/a)`` (two simple passes beat one broadcasting addcmul on CPU)."""
    return (offset, None) if sim_is_scaled else (offset / a, a)


def row_terms(
    sim: torch.Tensor,
    positive: torch.Tensor,
    scale: torch.Tensor,
    *,
    sim_is_scaled: bool = False,
    bound_floor: torch.Tensor | None = None,
    max_shift: bool = False,
    moment: bool = False,
    fused: bool = False,
) -> RowTerms:
    """Rows of both blocks (``sim`` ``[2, B, N]``, its excluded cells already EXCLUDED: exclude_). Each row may be
    shifted by ``r_bi``: with ``bound_floor`` (v2, openclip; 0-d or ``[2, B]``) ``r_bi = max(bound_floor_bi,
    max_{k≠i} d_bik)``; with ``max_shift`` (v0/v1/v3, TempNet) by the row's own maximum ``max_{k≠i} d_bik``. Both
    are found on the block itself: max_k a(S_k − p) = a(max_k S_k − p) for a > 0. ``fused``: the exponentials in
    one compiled pass (kernels.py)."""
    if max_shift and bound_floor is not None:
        raise ValueError("row_terms: give bound_floor or max_shift, not both")
    with torch.no_grad():
        a = _per_row(scale)
        offset = a * positive[:, None]  # a·p_i, [2, B, 1] (or [B, 1] for a 0-d scale)
        if sim_is_scaled and not moment and not fused:
            return _softmax_rows(sim, offset, scale, max_shift, bound_floor)
        shift = None
        if max_shift:  # d − r = a(S − max S): the positive cancels; the floor keeps an all-excluded row at exp 0
            top = sim.amax(dim=-1, keepdim=True).clamp_(min=EXCLUDED / 2)
            shift = (top - offset if sim_is_scaled else (top - positive[:, None]) * a).squeeze(-1)
            shift.clamp_(min=EXCLUDED / 2)  # as the floor's path: an all-excluded row's shift stays EXCLUDED/2
            offset, factor = top, (None if sim_is_scaled else a)  # d − r = (S − max S)·a
        else:
            if bound_floor is not None:
                top = sim.amax(dim=-1, keepdim=True)  # max over the candidates (an excluded cell never wins)
                top = top - offset if sim_is_scaled else (top - positive[:, None]) * a
                # (a row with no candidate at all keeps its EXCLUDED cells at exp 0: the floor below EXCLUDED/2)
                shift = torch.maximum(_per_row(bound_floor), top).clamp_(min=EXCLUDED / 2)
                offset = offset + shift
                shift = shift.squeeze(-1)
            offset, factor = _offset_and_scale(offset, a, sim_is_scaled)  # d_bik − r_bi = (S − offset)·factor
        exp, total, mom = shifted_exp(sim, offset, factor, row_sums=True, moment=moment, fused=fused)
        if mom is not None and shift is not None:
            mom = mom + shift * total  # Σ d·exp = Σ (d − r)·exp + r·Σ exp
        return RowTerms(exp=exp, total=total, moment=mom, shift=shift, scale=scale)


def _softmax_rows(sim, offset, scale, max_shift: bool, bound_floor) -> RowTerms:
    """row_terms for blocks that hold a·S (one scale per row): the exponentials as each row's softmax, one fused
    ATen pass (max, exp, sum and division per row, in cache; on the CPU the subtract, exp and sum passes it
    replaces take twice as long at [2, 1024, 2048]). With m_i the row's largest d_ik = a·S_ik − offset_i, the
    largest softmax entry is 1/Σ_k exp(d_ik − m_i), so Σ_k exp(d_ik − r_i) = exp(m_i − r_i)/max softmax, and the
    terms are softmax·total."""
    top = (sim.amax(dim=-1, keepdim=True) - offset).squeeze(-1)  # m_i (an excluded cell never wins)
    if max_shift:  # r = m: the positive cancels; an all-excluded row's shift is EXCLUDED/2
        shift = top.clamp(min=EXCLUDED / 2)
    else:  # r = max(floor, m)
        shift = torch.maximum(bound_floor, top).clamp_(min=EXCLUDED / 2)
    exp = torch.softmax(sim, dim=-1)
    # exp(m − r) <= 1: 1 where r = m, 0 for an all-excluded row (whose softmax is uniform over EXCLUDED cells)
    total = exp.amax(dim=-1).reciprocal_().mul_((top - shift).exp_())
    return RowTerms(exp=exp, total=total, moment=None, shift=shift, scale=scale, normalized=True)


def column_terms(
    sim: torch.Tensor,
    positive_all: torch.Tensor,
    scale: torch.Tensor,
    *,
    sim_is_scaled: bool = False,
    shift: torch.Tensor | None = None,
    total: bool = False,
    in_place: bool = False,
    fused: bool = False,
) -> ColumnTerms:
    """Columns of both blocks (global anchors; excluded cells already EXCLUDED), optionally shifted by ``shift``
    ``[2, N]`` (column_values). ``in_place``: the exponentials overwrite ``sim`` (when nothing reads the blocks
    afterwards: one ``[2, B, N]`` buffer fewer to allocate and to keep for the backward), except with ``fused``
    (one compiled pass into a new tensor: kernels.py)."""
    with torch.no_grad():
        a = _per_column(scale)
        offset = a * positive_all
        if shift is not None:
            offset = offset + _per_column(shift)
        offset, factor = _offset_and_scale(offset, a, sim_is_scaled)
        exp = shifted_exp(sim, offset, factor, in_place=in_place, fused=fused)[0]
        return ColumnTerms(exp=exp, total=exp.sum(dim=-2) if total else None, scale=scale)


@dataclass
class PairBlocks:
    """The two similarity blocks with the weights of their anchors: block b's rows are X_b's modality, its
    columns Ỹ_b's."""

    rows: RowTerms
    cols: ColumnTerms
    row_weight: torch.Tensor  # [2, B] weights of the local anchors (row_values)
    col_weight: torch.Tensor | float  # [2, N] weights of the global anchors (column_values), [2, 1], or one for all
    candidates: torch.Tensor  # Ỹ [2, N, d], to map ∂L/∂S back to X
    sim: torch.Tensor | None = None  # s·S (s[b]·S_b with one s per block), kept only when s needs a gradient
    positive: torch.Tensor | None = None  # [B] p_i, idem
    positive_all: torch.Tensor | None = None  # [N] P_j, idem (scale gradient through the columns)
    sim_grad: torch.Tensor | None = None  # [2, B, N] φ'(S) when the logits map S (similarity.py), else 1
    positive_grad: torch.Tensor | None = None  # [B] φ'(p_i), idem


class WeightedSurrogate(torch.autograd.Function):
    """``c·Σ_b Σ_i w_bi Σ_k rows_bik`` (the value: this rank's anchors), with the gradient of
    ``c·Σ_b [Σ_i w_bi Σ_k rows_bik + Σ_j w'_bj Σ_k cols_bkj]`` into the image rows, the text rows and the scale.

    Inputs: ``image`` (X of block 0), ``text`` (X of block 1), ``scale`` (the global s = 1/τ whose gradient
    is wanted, or None; ``[2]`` when each block's rows have their own scale, with ``block.sim`` = s[b]·S_b),
    ``block`` (both blocks), ``coef`` c (a float, or a detached 0-d tensor such as v3's τ·c), ``scale_in_columns``:
    whether the columns' exponentials count in the scale's gradient (compat="reference"), ``value``: a value to
    report instead (openclip reports the cross-entropy whose gradient this is), ``temperature_term``: a detached
    ``t`` shaped like ``scale`` whose ``Σ t/s = Σ t·τ`` is added to the value and to the scale's gradient (v3's outer
    ``τ·(mean log(u+ε) + ρ)``: in here it costs no autograd node of its own).
    Backward reuses the saved exponentials in place, so it can run once (no retain_graph double backward).
    """

    @staticmethod
    def forward(ctx, image, text, scale, block, coef, scale_in_columns, value, temperature_term):
        ctx.block, ctx.coef, ctx.scale_in_columns = block, coef, scale_in_columns
        ctx.save_for_backward(image, text, scale)
        ctx.tau_term = None
        if value is not None:
            value = value.detach().clone()
        else:
            value = coef * (block.row_weight * block.rows.total).sum()
        if temperature_term is not None:
            ctx.tau_term = temperature_term / scale.detach()  # t·τ
            value = value + (ctx.tau_term if ctx.tau_term.dim() == 0 else ctx.tau_term.sum())
        return value

    @staticmethod
    def backward(ctx, grad_out):
        with exact_float32(grad_out.device.type):  # a backward called inside autocast, or with TF32 on
            return WeightedSurrogate._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        if ctx.block is None:
            raise RuntimeError("the FastCLIP surrogate's backward can run only once per forward")
        image, text, scale = ctx.saved_tensors
        want_scale = scale is not None and ctx.needs_input_grad[2]
        s = scale.detach() if want_scale else None
        per_block = want_scale and s.dim() == 1  # [2]: block b's rows have their own scale s[b]
        block, coef = ctx.block, ctx.coef * grad_out
        # ∂L/∂S by row, per anchor, [2, B], and by column (one product fewer where both readings share the scale)
        row_coef = coef * block.rows.scale
        row_factor = block.row_weight * row_coef
        # the exp(d − r) of a softmax row are exp·total (RowTerms.normalized)
        exp_factor = row_factor * block.rows.total if block.rows.normalized else row_factor
        col_factor = row_coef if block.cols.scale is block.rows.scale else coef * block.cols.scale
        if not (isinstance(block.col_weight, float) and block.col_weight == 1.0):
            col_factor = col_factor * block.col_weight
        grad_sim = block.rows.exp.mul_(_per_row(exp_factor))
        # p_i enters every row term of anchor i, [2, B]
        positive_term = row_factor * block.rows.total
        grad_scale = None
        # d/ds exp(s·(S − p)) = (S − p)·exp: with grad_sim = factor·exp, Σ grad_sim·(S − p) / s, per block
        if want_scale and not ctx.scale_in_columns:
            grad_scale = _scale_term(grad_sim, block, positive_term, s, per_block)
        grad_sim.addcmul_(block.cols.exp, _per_column(col_factor))
        if want_scale and ctx.scale_in_columns:
            column_part = col_factor * block.cols.total * block.positive_all
            column_part = column_part.sum(dim=-1) if per_block else column_part.sum()
            grad_scale = _scale_term(grad_sim, block, positive_term, s, per_block) - column_part
        if grad_scale is not None:
            if ctx.tau_term is not None:  # d/ds (t/s) = −(t/s)/s
                grad_scale = grad_scale - grad_out * ctx.tau_term
            grad_scale = (grad_scale / s).to(scale.dtype)
        if block.sim_grad is not None:  # chain rule through the similarity map (0 where it clamps)
            grad_sim.mul_(block.sim_grad)
        grads = torch.bmm(grad_sim, block.candidates.to(grad_sim.dtype))  # [2, B, d]
        if block.positive_grad is not None:
            positive_term = positive_term * block.positive_grad
        ctx.block = None  # free the [2, B, N] tensors now
        grad_positive = -positive_term.sum(dim=0)[:, None]
        grad_image = torch.addcmul(grads[0], grad_positive, text.detach())
        grad_text = torch.addcmul(grads[1], grad_positive, image.detach())
        return grad_image.to(image.dtype), grad_text.to(text.dtype), grad_scale, None, None, None, None, None


def _scale_term(
    grad_sim: torch.Tensor, block: PairBlocks, positive_term: torch.Tensor, scale: torch.Tensor, per_block: bool
) -> torch.Tensor:
    """``Σ_ik grad_sim_bik·S_bik − Σ_i factor_bi·total_bi·p_i`` (``positive_term`` = factor·total), per block
    (``[2]``, ``scale`` = s ``[2]``) or summed over both (0-d); dot products, no temporary (a batched matmul of
    1-row matrices is 5x slower on CPU); ``block.sim`` = s·S."""
    positive_part = positive_term * block.positive
    if per_block:
        dot = torch.stack([torch.dot(g.reshape(-1), x.reshape(-1)) for g, x in zip(grad_sim, block.sim)])
        return dot / scale - positive_part.sum(dim=-1)
    return torch.dot(grad_sim.reshape(-1), block.sim.reshape(-1)) / scale - positive_part.sum()


def weighted_surrogate(
    image, text, scale, block, coef, *, scale_in_columns=False, value=None, temperature_term=None
) -> torch.Tensor:
    if temperature_term is not None and scale is None:
        raise ValueError("weighted_surrogate: a temperature_term needs the scale it divides")
    return WeightedSurrogate.apply(image, text, scale, block, coef, scale_in_columns, value, temperature_term)
