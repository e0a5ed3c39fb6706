"""NT-Xent, SimCLR's loss (Chen et al., ICML 2020), over the global batch: InfoNCE with the positive in its own
denominator and copies of the anchor's sample out of it,
    ℓ_i = −z_i+ + log(exp(z_i+) + Σ_{k∈neg(i)} exp(z_ik)),   z = φ(cos)/τ   (softmax.py).

Unimodal (option ``unimodal``, what SimCLR is): the anchors are the 2N views, i+ the other view of anchor i's
image, neg(i) the 2N − 2 views of the other images, the loss the mean over the 2N anchors. Bimodal it is
openclip's InfoNCE, except that a copy of the anchor's own sample (a repeated data index) is no negative.
τ learnable or fixed (``learn_temperature``); hard negatives and direction weights as openclip's. Written as an
autograd objective (objective.py): this file is all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import ContrastiveLoss
from .objective import AutogradObjective
from .options import InfoNCEOptions
from .pairwise import compute_dtype
from .softmax import softmax_loss


@dataclass(frozen=True)
class NTXentOptions(InfoNCEOptions):
    """openclip's options: τ (learnable or fixed), the similarity map, hard negatives."""


class NTXentLoss(AutogradObjective, ContrastiveLoss):
    name = "ntxent"
    needs_indices = True  # copies of one sample are no negatives of each other
    min_global_batch = 2  # an anchor needs a negative
    unimodal_form = True

    def __init__(self, options: NTXentOptions):
        super().__init__(options)
        self._init_logit_scale(options.temperature, options.learn_temperature)

    def _objective(self, features, state):
        scale = self._scale(compute_dtype(features.image.dtype))
        loss = softmax_loss(features, scale, self.options, decoupled=False, exclude_copies=True)
        value = loss.detach()
        return loss, {"loss": value, "surrogate": value, "objective": value, "tau": 1.0 / scale.detach()}
