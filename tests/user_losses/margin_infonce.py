"""A loss of a user's own, as the trainer and the study take it: ``--loss.name margin_infonce:MARGIN_INFONCE``
with this folder on PYTHONPATH (tests/test_user_loss.py runs it; the README's "A loss of your own" shows it).

InfoNCE with an additive margin m on the positive (as in AM-softmax): per anchor i of either direction, with
s = 1/τ, ℓ_i = −s(cos_ii − m) + log(exp(s(cos_ii − m)) + Σ_{j≠i} exp(s·cos_ij)). With m = 0 it is InfoNCE.
Written once over this rank's anchors against the gathered batch (fastclip/losses/objective.py); the library
makes it exact on any number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastclip.losses import LossEntry
from fastclip.losses.objective import masked_logsumexp, weighted_directions
from fastclip.losses.options import InfoNCEOptions, LossOptionError
from fastclip.losses.softmax import SoftmaxObjective


@dataclass(frozen=True)
class MarginOptions(InfoNCEOptions):
    """InfoNCE's options (temperature, learn_temperature, ...: loss.* keys) and the margin (the trainer's
    loss.extra_options.margin)."""

    margin: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            raise LossOptionError("margin", "must be a number in [0, 1)", self.margin)


class MarginInfoNCE(SoftmaxObjective):
    name = "margin-infonce"
    unimodal_form = False

    def _objective(self, features, state):
        pairs = features.pairs()  # [2, B, N]: image anchors against the texts, text anchors against the images
        scale = self._scale(features.image.dtype)
        positive = scale * (pairs.positive - self.options.margin)
        log_denominator = torch.logaddexp(positive, masked_logsumexp(scale * pairs.cos, pairs.negative))
        loss = weighted_directions((log_denominator - positive).mean(dim=1), self.options.direction_weights)
        value = loss.detach()
        return loss, {"loss": value, "surrogate": value, "objective": value, "tau": 1.0 / scale.detach()}


MARGIN_INFONCE = LossEntry(MarginOptions, autograd=MarginInfoNCE)
