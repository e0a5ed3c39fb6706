"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning"): Adam moments, decoupled weight
decay inside the update, and a per-tensor trust ratio ||w|| / ||update|| that scales the step."""

from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Lamb: lr, eps and weight_decay must be >= 0 (lr={lr}, eps={eps}, wd={weight_decay})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    # a tensor step (not an int) so the state loads under torch.load(weights_only=True) either way
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()  # CPU scalar: no device sync
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                if group["bias_correction"]:
                    m_hat = exp_avg / (1 - beta1**step)
                    v_hat = exp_avg_sq / (1 - beta2**step)
                else:
                    m_hat, v_hat = exp_avg, exp_avg_sq
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"] != 0:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                # trust ratio 1 where either norm is zero (fresh zero-initialised biases, zero updates)
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * trust, alpha=-group["lr"])
        return loss
