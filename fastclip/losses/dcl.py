"""DCL, decoupled contrastive learning (Yeh et al., ECCV 2022), over the global batch: InfoNCE with the positive
left out of each anchor's denominator, ℓ_i = −z_ii + log Σ_{j≠i} exp(z_ij), z = φ(cos)/τ (softmax.py).

The statistical-efficiency study found it is what makes FastCLIP-v1 win at small batch: v1 with γ = 1 (u the
batch's own estimate) has DCL's gradient up to the constant log(N−1) and the factor τ. A learnable τ
(``learn_temperature``, default) or a fixed one; copies of an anchor's own data index are no negatives; hard
negatives and direction weights as openclip's. Written as an autograd objective (objective.py): this file is all
of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import ContrastiveLoss
from .objective import AutogradObjective
from .options import InfoNCEOptions
from .pairwise import compute_dtype
from .softmax import softmax_loss


@dataclass(frozen=True)
class DCLOptions(InfoNCEOptions):
    """openclip's options: τ (learnable or fixed), the similarity map, hard negatives, queue, distillation."""


class DCLLoss(AutogradObjective, ContrastiveLoss):
    name = "dcl"
    needs_indices = True  # copies of one sample are no negatives of each other
    min_global_batch = 2  # an anchor needs a negative
    unimodal_form = True  # the views' form: each of the 2N views against the other images' 2N − 2 views

    def __init__(self, options: DCLOptions):
        super().__init__(options)
        self._init_logit_scale(options.temperature, options.learn_temperature)

    def _objective(self, features, state):
        scale = self._scale(compute_dtype(features.image.dtype))
        loss = softmax_loss(features, scale, self.options, decoupled=True, exclude_copies=True)
        value = loss.detach()
        return loss, {"loss": value, "surrogate": value, "objective": value, "tau": 1.0 / scale.detach()}
