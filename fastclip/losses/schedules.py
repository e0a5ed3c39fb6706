"""Per-epoch schedules: γ of the moving-average estimator u, and FastCLIP-v2's Adam betas for τ."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Literal

GammaScheduleKind = Literal["cosine", "constant"]
GAMMA_SCHEDULES = typing.get_args(GammaScheduleKind)


@dataclass(frozen=True)
class GammaSchedule:
    """γ(epoch): 1 in epoch 0 (u starts as the plain mini-batch estimate), then towards ``gamma_min``.

    ``cosine``: ``gamma_min + ½(1-gamma_min)(1+cos(π e/E))`` for 1 <= e < E = ``decay_epochs``, then
    ``gamma_min``. ``constant``: ``gamma_min`` from epoch 1 on (SogCLR's schedule). The values are checked where
    they are given, once: the loss options (options.py).
    """

    kind: GammaScheduleKind = "cosine"
    gamma_min: float = 0.8
    decay_epochs: int = 10

    def __call__(self, epoch: float) -> float:
        if epoch <= 0:
            return 1.0
        if self.kind == "constant" or epoch >= self.decay_epochs:
            return self.gamma_min
        return self.gamma_min + 0.5 * (1.0 - self.gamma_min) * (1.0 + math.cos(math.pi * epoch / self.decay_epochs))


def tau_adam_betas(epoch: float, betas: tuple[float, float]) -> tuple[float, float]:
    """Betas of v2's per-sample τ update: (0, 0) in epoch 0 (a sign-like first step, as the reference), then
    ``betas``."""
    return (0.0, 0.0) if epoch <= 0 else (float(betas[0]), float(betas[1]))
