"""The logit of a pair: the cosine (default) or the temperature-free map ``φ(c) = 2·atanh(c)``.

Temperature-free loss (Kim & Kim, ICML 2025, "Temperature-Free Loss Function for Contrastive Learning"): the
logit ``c/τ`` is replaced by ``φ(c) = 2·atanh(c) = log((1+c)/(1−c))``, which spans (−∞, ∞) on (−1, 1), so no τ
is needed to stretch the cosine. The cosine is clamped to ``±(1 − similarity_clamp)`` (default 1e-6, so
``|φ| <= ~14.5``) and ``φ'(c) = 2/(1 − c²)`` is 0 where the clamp is active (torch.clamp's convention: the
bounds themselves still pass the gradient).

The losses keep a scale ``s = 1/τ`` on top (logit ``s·φ(c)``): ``build_loss`` makes it 1 and constant for
``similarity="atanh"`` unless a temperature is given, which is the temperature-free loss itself; v0/v3 learn it.

In the pairwise core (pairwise.py) both blocks ``S`` become ``s·φ(S)`` and every positive ``p`` becomes ``φ(p)``;
the backward multiplies ``∂L/∂φ`` by ``φ'`` cell by cell (``PairBlocks.sim_grad``, ``PairBlocks.positive_grad``) before
mapping it onto the features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import GlobalBatch
from .options import SIMILARITIES
from .pairwise import pair_similarity, positives


def atanh_logit_(cos: torch.Tensor, clamp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(φ(c), φ'(c))`` with ``c`` clamped to ``±(1 − clamp)``; overwrites ``cos`` with φ (no autograd)."""
    limit = 1.0 - clamp
    with torch.no_grad():
        inside = (cos >= -limit) & (cos <= limit)
        cos.clamp_(-limit, limit)
        derivative = torch.addcmul(torch.ones_like(cos), cos, cos, value=-1.0)  # 1 − c²
        derivative = torch.where(inside, derivative.reciprocal_().mul_(2.0), 0.0)
        value = cos.atanh_().mul_(2.0)
    return value, derivative


@dataclass
class PairLogits:
    """The blocks and positives the pairwise core reads, in logit units (before the row/column scale)."""

    sim: torch.Tensor  # [2, B, N] s·φ(local images · all texts), s·φ(local texts · all images)
    pos: torch.Tensor  # [B] φ(e1_i·e2_i) of the local pairs
    pos_all: torch.Tensor  # [N] φ(ẽ1_j·ẽ2_j) of every pair
    sim_grad: torch.Tensor | None = None  # [2, B, N] φ' of the blocks (None for the cosine: φ' = 1)
    pos_grad: torch.Tensor | None = None  # [B] φ' of the local positives

    def pair_grads(self) -> dict:
        """``PairBlocks(...)`` keyword arguments: φ' of the blocks and of the positives (none for the cosine)."""
        if self.pos_grad is None:
            return {}
        return {"sim_grad": self.sim_grad, "positive_grad": self.pos_grad}


def pair_logits(
    batch: GlobalBatch, dtype: torch.dtype, scale: torch.Tensor | None, kind: str, clamp: float
) -> PairLogits:
    """Both blocks ``[2, B, N]`` and the positives; ``scale`` (detached s, or None) folded into the blocks."""
    if kind == "cosine":
        pos, pos_all = positives(batch, dtype)
        return PairLogits(pair_similarity(batch, dtype, scale), pos, pos_all)
    if kind != "atanh":
        raise ValueError(f"loss option similarity must be one of {SIMILARITIES}, got {kind!r}")
    value, derivative = atanh_logit_(pair_similarity(batch, dtype), clamp)
    if scale is not None:
        value.mul_(scale)
    pos_all, pos_all_grad = atanh_logit_(positives(batch, dtype)[1], clamp)
    pos, pos_grad = pos_all[batch.local_rows], pos_all_grad[batch.local_rows]
    return PairLogits(value, pos, pos_all, derivative, pos_grad)
