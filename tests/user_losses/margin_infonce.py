"""A loss of a user's own, as the trainer and the study take it: ``--loss.name margin_infonce:MARGIN_INFONCE``
with this folder on PYTHONPATH (tests/test_user_loss.py runs it; the README's "A loss of your own" shows it).

InfoNCE with an additive margin m on the positive (as in AM-softmax): per anchor i of either direction, with
s = 1/τ, ℓ_i = −s(cos_ii − m) + log(exp(s(cos_ii − m)) + Σ_{j≠i} exp(s·cos_ij)). With m = 0 it is InfoNCE.
Written once over this rank's anchors against the gathered batch (fastclip/losses/objective.py); the library
makes it exact on any number of ranks.

Its options are exactly what it implements: CommonOptions (validate, impl, direction_weights) and its own fields.
Deriving from a richer options class (InfoNCEOptions: hard negatives, a queue, distillation, ...) would let a
config set options this objective then ignores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastclip.losses import ContrastiveLoss, LossEntry
from fastclip.losses.objective import AutogradObjective, masked_logsumexp, weighted_directions
from fastclip.losses.options import CommonOptions, LossOptionError


@dataclass(frozen=True)
class MarginOptions(CommonOptions):
    """τ as the library's losses have it (loss.temperature, loss.learn_temperature) and the margin (the trainer's
    loss.extra_options.margin)."""

    temperature: float = 0.07  # initial τ
    learn_temperature: bool = True
    margin: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise LossOptionError("temperature", "must be a number > 0", self.temperature)
        if not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            raise LossOptionError("margin", "must be a number in [0, 1)", self.margin)


class MarginInfoNCE(AutogradObjective, ContrastiveLoss):
    name = "margin-infonce"
    needs_indices = True  # copies of one sample in a batch are no negatives of each other (pairs().negative)
    min_global_batch = 2  # an anchor needs a negative

    def __init__(self, options: MarginOptions):
        super().__init__(options)
        self._init_logit_scale(options.temperature, options.learn_temperature)

    def _objective(self, features, state):
        pairs = features.pairs()  # [2, B, N]: image anchors against the texts, text anchors against the images
        scale = self._scale(features.image.dtype)
        positive = scale * (pairs.positive - self.options.margin)
        log_denominator = torch.logaddexp(positive, masked_logsumexp(scale * pairs.cos, pairs.negative))
        loss = weighted_directions((log_denominator - positive).mean(dim=1), self.options.direction_weights)
        value = loss.detach()
        return loss, {"loss": value, "surrogate": value, "objective": value, "tau": 1.0 / scale.detach()}


MARGIN_INFONCE = LossEntry(MarginOptions, autograd=MarginInfoNCE)
