"""The logit of a pair: the cosine (default) or the temperature-free map ``φ(c) = 2·atanh(c)``.

Temperature-free loss (Kim & Kim, ICML 2025, "Temperature-Free Loss Function for Contrastive Learning"): the
logit ``c/τ`` is replaced by ``φ(c) = 2·atanh(c) = log((1+c)/(1−c))``, which spans (−∞, ∞) on (−1, 1), so no τ
is needed to stretch the cosine. The cosine is clamped to ``±(1 − similarity_clamp)`` (default 1e-6, so
``|φ| <= ~14.5``) and ``φ'(c) = 2/(1 − c²)`` is 0 where the clamp is active (torch.clamp's convention: the
bounds themselves still pass the gradient).

The losses keep a scale ``s = 1/τ`` on top (logit ``s·φ(c)``): ``build_loss`` makes it 1 and constant for
``similarity="atanh"`` unless a temperature is given, which is the temperature-free loss itself; v0/v3 learn it.

In the pairwise core (pairwise.py) every block ``S`` becomes ``s·φ(S)`` and every positive ``p`` becomes ``φ(p)``;
the backward multiplies ``∂L/∂φ`` by ``φ'`` cell by cell (``Block.sim_grad``, ``Block.positive_grad``) before
mapping it onto the features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import GlobalBatch
from .options import SIMILARITIES
from .pairwise import positives, similarity


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

    sim_it: torch.Tensor  # [B, N] s·φ(local images · all texts)
    sim_ti: torch.Tensor  # [B, N] s·φ(local texts · all images)
    pos: torch.Tensor  # [B] φ(e1_i·e2_i) of the local pairs
    pos_all: torch.Tensor  # [N] φ(ẽ1_j·ẽ2_j) of every pair
    sim_it_grad: torch.Tensor | None = None  # [B, N] φ' of the blocks (None for the cosine: φ' = 1)
    sim_ti_grad: torch.Tensor | None = None
    pos_grad: torch.Tensor | None = None  # [B] φ' of the local positives

    def block_grads(self, which: int) -> dict:
        """``Block(...)`` keyword arguments of block 0 (images as rows) or 1 (texts as rows)."""
        if self.pos_grad is None:
            return {}
        return {"sim_grad": (self.sim_it_grad, self.sim_ti_grad)[which], "positive_grad": self.pos_grad}


def pair_logits(
    batch: GlobalBatch, dtype: torch.dtype, scale: torch.Tensor | None, kind: str, clamp: float
) -> PairLogits:
    """Both ``[B, N]`` blocks and the positives; ``scale`` (detached s, or None) folded into the blocks."""
    if kind == "cosine":
        pos, pos_all = positives(batch, dtype)
        return PairLogits(
            similarity(batch.image, batch.all_text, dtype, scale),
            similarity(batch.text, batch.all_image, dtype, scale),
            pos,
            pos_all,
        )
    if kind != "atanh":
        raise ValueError(f"loss option similarity must be one of {SIMILARITIES}, got {kind!r}")
    blocks = []
    for local, gathered in ((batch.image, batch.all_text), (batch.text, batch.all_image)):
        value, derivative = atanh_logit_(similarity(local, gathered, dtype), clamp)
        blocks.append((value if scale is None else value.mul_(scale), derivative))
    pos, pos_all = positives(batch, dtype)
    pos, pos_grad = atanh_logit_(pos, clamp)
    pos_all, _ = atanh_logit_(pos_all, clamp)
    return PairLogits(blocks[0][0], blocks[1][0], pos, pos_all, blocks[0][1], blocks[1][1], pos_grad)
