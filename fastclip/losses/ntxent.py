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

from .options import InfoNCEOptions
from .softmax import SoftmaxObjective


@dataclass(frozen=True)
class NTXentOptions(InfoNCEOptions):
    """openclip's options: τ (learnable or fixed), the similarity map, hard negatives."""


class NTXentLoss(SoftmaxObjective):
    name = "ntxent"
    decoupled = False
