"""The OpenCLIP baseline: mini-batch InfoNCE over the global batch with local-loss semantics.

Same value and the same per-rank gradients as ``open_clip.loss.ClipLoss(local_loss=True, gather_with_grad=True)``,
without an autograd all_gather (whose backward is a reduce-scatter of K·B·d per modality):

    CE_i = LSE_k(s·e1_i·ẽ2_k) − s·e1_i·e2_i = log(1 + Σ_{k≠i} exp(s(e1_i·ẽ2_k − e1_i·e2_i)))

so the gradient of CE_i is that of the FastCLIP sum over negatives weighted by w_i = 1/(1 + Σ_{k≠i} ...), i.e.
the softmax probabilities. It runs on the same core (pairwise.py) with a per-anchor shift r_i = max(0, max_k ...)
(the log-sum-exp trick: ``w_i = 1/(e^{-r_i} + Σ_k exp(... − r_i))``). loss1 = ½(1/B)Σ_{i local}(CE_img_i + CE_txt_i);
every anchor's weight is shared by the all_reduce (N scalars per modality), so each rank also gives its local
candidates the gradient they receive from ALL anchors — what ClipLoss's backward all_gather would sum into
this rank. The logit_scale gradient comes only from this rank's anchors, as in ClipLoss.

Option ``similarity="atanh"``: the temperature-free loss of Kim & Kim (ICML 2025): logits s·2·atanh(cos) instead
of s·cos, with s = 1 and not learned by default (build_loss), i.e. CE_i = −log softmax_k(2·atanh(e1_i·ẽ2_k))_i.
"""

from __future__ import annotations

import torch

from .base import ContrastiveLoss
from .batch import GlobalBatch
from .comm import Comm
from .objective import AutogradObjective
from .options import OpenCLIPOptions
from .pairwise import (
    PairBlocks,
    column_terms,
    column_values,
    compute_dtype,
    exclude_,
    row_terms,
    row_values,
    weighted_surrogate,
)
from .similarity import pair_logits
from .softmax import softmax_objective


class OpenCLIPLoss(ContrastiveLoss):
    name = "openclip"
    min_global_batch = 2  # one pair has no negative: its loss is 0 with no gradient

    def __init__(self, options: OpenCLIPOptions):
        super().__init__(options)
        self._init_logit_scale(options.temperature, options.learn_temperature)

    def _compute(self, comm: Comm, batch: GlobalBatch):
        fused = self.options.fused_kernels  # the exponentials' passes as compiled kernels (kernels.py)
        dtype = compute_dtype(batch.image.dtype)
        scale = self._scale(dtype)
        learnable = scale.requires_grad
        s = scale.detach()
        cells = batch.group_cells()  # the pairs (with groups: every same-group cell)
        logits = pair_logits(batch, dtype, s, self.options.similarity, self.options.similarity_clamp)
        sim, pos, pos_all = logits.sim, logits.pos, logits.pos_all  # s·φ(S) [2, B, N], φ(p)
        exclude_(sim, cells)  # the positives: no negatives of their own anchors
        zero = torch.zeros((), dtype=dtype, device=pos.device)

        # Per local anchor (columns (image, text)): softmax weight w = 1/(e^{-r} + Σ exp(d − r)), CE, shift r.
        rows = row_terms(sim, pos, s, sim_is_scaled=True, bound_floor=zero, fused=fused)
        shift, total = rows.shift.T, rows.total.T  # [B, 2]
        normaliser = torch.exp(-shift) + total  # the positive's exp(0), shifted, plus negatives
        w_local, ce_local = 1.0 / normaliser, shift + torch.log(normaliser)
        table = comm.share_rows(batch, torch.cat([w_local, ce_local, shift], dim=1), dtype=dtype)
        w, ce, shift_all = table[:, 0:2], table[:, 2:4], table[:, 4:6]

        # columns: text anchors vs local images (block 0), image anchors vs local texts (block 1)
        # (the logit_scale gradient reads the blocks again in backward; otherwise the columns overwrite them)
        cols = column_terms(
            sim, pos_all, s, sim_is_scaled=True, shift=column_values(shift_all), in_place=not learnable, fused=fused
        )
        kept = dict(sim=sim, positive=pos) if learnable else {}
        block = PairBlocks(
            rows,
            cols,
            row_values(w_local),
            column_values(w),
            batch.candidates,
            **kept,
            **logits.pair_grads(),
        )
        del sim, logits
        loss = weighted_surrogate(
            batch.image, batch.text, scale if learnable else None, block, 0.5 / batch.local_size, value=ce_local.mean()
        )

        metrics = {"loss": loss, "surrogate": loss, "objective": ce.mean(), "tau": 1.0 / s}
        return loss, metrics


class OpenCLIPAutograd(AutogradObjective, OpenCLIPLoss):
    """openclip as an autograd objective (``impl="autograd"``, softmax.py): the same loss, plus hard negatives and
    direction weights, which the fused path does not implement."""

    def _objective(self, features, state):
        return softmax_objective(self, features, decoupled=False, exclude_copies=False)
