"""The softmax (InfoNCE) family over the global batch, as autograd code: openclip's InfoNCE (the positive in its
own denominator) and DCL (the positive left out), with hard-negative mining and direction weights.

Per anchor i of either direction, with logits z = s·φ(cos) (s = 1/τ, φ the similarity map):
    InfoNCE: ℓ_i = −z_ii + log(exp(z_ii) + Σ_{j∈neg(i)} exp(z'_ij))
    DCL:     ℓ_i = −z_ii + log Σ_{j∈neg(i)} exp(z'_ij)
neg(i) and z' after ``hard_negatives`` (objective.py); the loss is the direction-weighted mean over the anchors.

Momentum distillation (``distill_alpha`` α, ALBEF): the positive's logit z_ii becomes Σ_j y_ij z_ij with targets
y_i = (1−α)·one-hot(i) + α·softmax_j(s·φ(cos^m_ij)) over the anchor's positive and negatives, cos^m from the
momentum model (no gradient): InfoNCE becomes ALBEF's cross-entropy against y; DCL keeps its denominator.
"""

from __future__ import annotations

import math

import torch

from .base import ContrastiveLoss
from .objective import (
    AutogradObjective,
    GlobalFeatures,
    hard_negatives,
    masked_logsumexp,
    pair_map,
    weighted_directions,
)
from .options import InfoNCEOptions
from .pairwise import compute_dtype


def softmax_loss(
    features: GlobalFeatures,
    scale: torch.Tensor,
    options: InfoNCEOptions,
    *,
    decoupled: bool,
    exclude_copies: bool,
    distill: bool = True,
) -> torch.Tensor:
    """The global loss. ``exclude_copies``: a copy of the anchor's own sample (the same data index twice in the
    batch) is no negative (DCL, the FastCLIP losses); openclip keeps it, as OpenCLIP's ClipLoss does. ``distill``
    false (eval mode): one-hot targets, even where momentum features were passed."""
    pairs = features.pairs()  # [2, B, M]: both directions' anchors against the batch (and the queue)
    similarity, clamp = options.similarity, options.similarity_clamp
    rows, positive = scale * pair_map(pairs.cos, similarity, clamp), scale * pair_map(pairs.positive, similarity, clamp)
    negative = pairs.negative
    if not exclude_copies and features.ids is not None and not features.grouped:
        # only the pair (its group) is excluded: a copy of the anchor's sample counts
        n = features.size
        negative = torch.cat([(~features.same_pair()).expand(2, -1, -1), negative[..., n:]], dim=-1)
    rows, negative = hard_negatives(rows, negative, options.hard_negative_topk, options.hard_negative_beta)
    log_negatives = masked_logsumexp(rows, negative)  # [2, N]
    log_denominator = log_negatives if decoupled else torch.logaddexp(positive, log_negatives)
    if options.distill_alpha and distill and features.momentum is not None:
        positive = distilled_positive(features, rows, negative, scale, options)
    per_direction = (log_denominator - positive).mean(dim=1)  # [2]
    return weighted_directions(per_direction, options.direction_weights)


def distilled_positive(features, rows, negative, scale, options) -> torch.Tensor:
    """``[2, N]`` Σ_j y_ij z_ij: the logits weighted by the targets mixed from the momentum model's softmax."""
    own = features.positive_cells()  # [B, N]
    positive_cell = torch.cat([own, own.new_zeros(own.shape[0], rows.shape[-1] - own.shape[1])], -1).expand_as(negative)
    candidates = negative | positive_cell
    with torch.no_grad():
        momentum = scale.detach() * pair_map(features.momentum_cos(), options.similarity, options.similarity_clamp)
        soft = torch.softmax(momentum.masked_fill(~candidates, -math.inf), dim=-1)
        alpha = options.distill_alpha
        targets = alpha * soft + (1.0 - alpha) * positive_cell.to(soft.dtype)
    return (targets * rows.masked_fill(~candidates, 0.0)).sum(dim=-1)


def softmax_objective(loss_fn, features: GlobalFeatures, *, decoupled: bool, exclude_copies: bool):
    """``(loss, metrics)`` of a softmax loss with the module's ``logit_scale`` (openclip, dcl, ntxent)."""
    scale = loss_fn._scale(compute_dtype(features.image.dtype))
    loss = softmax_loss(
        features, scale, loss_fn.options, decoupled=decoupled, exclude_copies=exclude_copies, distill=loss_fn.training
    )
    value = loss.detach()
    return loss, {"loss": value, "surrogate": value, "objective": value, "tau": 1.0 / scale.detach()}


class SoftmaxObjective(AutogradObjective, ContrastiveLoss):
    """A softmax loss with a learnable or fixed τ whose copies of the anchor's sample are no negatives (dcl,
    ntxent); ``decoupled``: the positive left out of the denominator."""

    needs_indices = True  # copies of one sample are no negatives of each other
    min_global_batch = 2  # an anchor needs a negative
    unimodal_form = True  # the views' form: each of the 2N views against the other images' 2N − 2 views
    decoupled = False

    def __init__(self, options: InfoNCEOptions):
        super().__init__(options)
        self._init_logit_scale(options.temperature, options.learn_temperature)

    def _objective(self, features, state):
        return softmax_objective(self, features, decoupled=self.decoupled, exclude_copies=True)
