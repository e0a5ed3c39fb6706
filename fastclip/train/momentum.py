"""The momentum (EMA) copy of the towers (``model.ema_momentum`` m; MoCo, ALBEF): θ_m ← m·θ_m + (1 − m)·θ after
every step taken. Its features of each batch, without autograd, go to the loss (``momentum=``): a feature queue
then holds them and ``loss.distill_alpha`` mixes their softmax into the targets (fastclip/losses).

It is state: saved in model.pt (``momentum_towers``, identical on every rank), resumed bitwise. A step the NaN
guard skips leaves it as it was, also when the skip is decided on the device (the update's weight is then
(1 − m)·(1 − skipped), no host read).
"""

from __future__ import annotations

import copy

import torch

# the towers' frozen copy of the loss's temperature, written at each save (net.temperature_to_towers) into both:
# averaged, it would hold a value that depends on when the saves happened, and a resume would not be bitwise
NOT_AVERAGED = ("logit_scale",)


class MomentumTowers(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, momentum: float):
        super().__init__()
        self.towers = copy.deepcopy(model).requires_grad_(False)
        self.momentum = float(momentum)

    @torch.no_grad()
    def update(self, model: torch.nn.Module, skipped: torch.Tensor | None = None) -> None:
        """One EMA step toward ``model``'s weights; ``skipped`` (0-d, 1 where the step was not taken): none there."""
        weight = 1.0 - self.momentum
        if skipped is not None:
            weight = (1.0 - skipped.to(torch.float32)) * weight
        for (name, mine), theirs in zip(self.towers.named_parameters(), model.parameters()):
            # a locked parameter (model.lock_image/lock_text) never moves: its copy stays it, as a lerp would leave it
            if name in NOT_AVERAGED or not theirs.requires_grad:
                continue
            mine.lerp_(theirs.detach(), weight if isinstance(weight, float) else weight.to(mine.dtype))
        for mine, theirs in zip(self.towers.buffers(), model.buffers()):
            mine.copy_(theirs)

    def state_dict(self, *args, **kwargs):  # the towers' own keys: loadable by open_clip as a model
        return self.towers.state_dict(*args, **kwargs)

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        return self.towers.load_state_dict(state, strict=strict, assign=assign)


__all__ = ["MomentumTowers"]
