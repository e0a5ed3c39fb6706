"""Optimizers for the towers and the loss's temperature.

Parameter groups (each carries a "name" so schedules and logs find it):
  decay        tower weights with ndim >= 2 (matrices, convolutions, embeddings)   weight decay = wd
  no_decay     gains, biases, class/positional tokens of ndim < 2                  weight decay = 0
  temperature  every trainable parameter of the loss (logit_scale for v0/v3/openclip), own lr and schedule
The towers' own logit_scale is frozen by the trainer (the loss owns the temperature), so it is in no group.
"""

from __future__ import annotations

import torch

from fastclip.optim.lamb import Lamb
from fastclip.optim.schedules import get_lr, get_tau_lr


def param_groups(
    model: torch.nn.Module, loss_fn: torch.nn.Module, *, lr: float, wd: float, lr_tau: float
) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    temperature = [p for p in loss_fn.parameters() if p.requires_grad]
    groups = [
        {"name": "decay", "params": decay, "weight_decay": wd, "lr": lr},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0, "lr": lr},
        {"name": "temperature", "params": temperature, "weight_decay": 0.0, "lr": lr_tau},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(name: str, groups: list[dict], *, betas, eps: float) -> torch.optim.Optimizer:
    if name == "adamw":
        # the fused kernel (CPU since torch 2.4, CUDA) is several times faster than the per-tensor loop: on the
        # embedded run it cut the step from 0.12 s to 0.02 s. Older builds fall back to the default.
        try:
            return torch.optim.AdamW(groups, betas=tuple(betas), eps=eps, fused=True)
        except (RuntimeError, TypeError, ValueError):
            return torch.optim.AdamW(groups, betas=tuple(betas), eps=eps)
    if name == "lamb":
        return Lamb(groups, betas=tuple(betas), eps=eps)
    raise ValueError(f"optim.optimizer must be adamw or lamb, got {name!r}")


class ThresholdRule:
    """The reference's `step_thresh` rule for the temperature group: its lr is lr_tau/`factor` (factor 3)
    on every step that starts with tau <= `threshold` (0.03).

    Reading tau on the host each step would stall the GPU, so the rule is applied on the device instead:
    every optimizer step here is linear in the group's lr (AdamW: p -= lr*(m_hat/(sqrt(v_hat)+eps) + wd*p);
    LAMB: p -= lr*trust*update), so taking the step at lr_tau and then keeping only 1/factor of the
    parameter change is that step at lr_tau/factor, without a sync.
    """

    def __init__(self, params: list[torch.Tensor], threshold: float = 0.03, factor: float = 3.0):
        self.params, self.threshold, self.factor = list(params), threshold, factor
        self._before: list[torch.Tensor] = []
        self._scale: torch.Tensor | None = None

    def before_step(self, tau: torch.Tensor | None) -> None:
        if not self.params or tau is None:
            self._scale = None
            return
        self._before = [p.detach().clone() for p in self.params]
        p = self.params[0]
        cold = tau.detach().to(p.device) <= self.threshold
        one = torch.ones((), dtype=p.dtype, device=p.device)  # in the parameter's dtype: 1/3 exact to its precision
        self._scale = torch.where(cold, one / self.factor, one)

    @torch.no_grad()
    def after_step(self) -> None:
        if self._scale is None:
            return
        for p, old in zip(self.params, self._before):
            p.copy_(old + (p - old) * self._scale)
        self._before = []

    def factor_now(self) -> float:
        """1/factor or 1 for the last step (host read; for logging steps only)."""
        return 1.0 if self._scale is None else float(self._scale.item())


__all__ = ["Lamb", "get_lr", "get_tau_lr", "param_groups", "build_optimizer", "ThresholdRule"]
