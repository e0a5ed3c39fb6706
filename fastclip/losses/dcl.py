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

from .options import InfoNCEOptions
from .softmax import SoftmaxObjective


@dataclass(frozen=True)
class DCLOptions(InfoNCEOptions):
    """openclip's options: τ (learnable or fixed), the similarity map, hard negatives, queue, distillation."""


class DCLLoss(SoftmaxObjective):
    name = "dcl"
    decoupled = True
