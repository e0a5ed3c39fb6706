"""Learning-rate schedules as pure functions of the step: resuming needs nothing but the step number."""

from __future__ import annotations

import math


def get_lr(
    step: int, *, base_lr: float, warmup_steps: int, total_steps: int, lr_min: float = 0.0, kind: str = "cosine"
) -> float:
    """Linear warmup to base_lr over `warmup_steps`, then `kind`:
    cosine: from base_lr down to lr_min at total_steps (lr_min afterwards); const: base_lr.
    Warmup counts from step 0 as (step+1)/warmup so the first step already moves (as OpenCLIP)."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if kind == "const":
        return base_lr
    if kind != "cosine":
        raise ValueError(f"unknown lr schedule {kind!r} (cosine, const)")
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0:
        return base_lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return lr_min + 0.5 * (1.0 + math.cos(math.pi * progress)) * (base_lr - lr_min)


def get_tau_lr(
    step: int, *, lr_tau: float, kind: str, warmup_steps: int, total_steps: int, lr_tau_min: float = 0.0
) -> float:
    """Base learning rate of the temperature group at `step`.
    cosine / const: as get_lr with lr_tau; step_thresh: lr_tau without warmup. The step_thresh division
    by `factor` once tau <= threshold depends on tau and is applied on the device (ThresholdRule)."""
    if kind == "step_thresh":
        return lr_tau
    return get_lr(
        step, base_lr=lr_tau, warmup_steps=warmup_steps, total_steps=total_steps, lr_min=lr_tau_min, kind=kind
    )
