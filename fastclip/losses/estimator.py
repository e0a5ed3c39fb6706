"""The moving-average estimator u of each anchor's inner function g (FCCO / SogCLR)."""

from __future__ import annotations

import math

import torch

TINY_U = 1e-35  # as the reference: an old u below this (or inf/nan) is not trusted and restarts from g


def update_u(
    u_old: torch.Tensor, g: torch.Tensor, seen: torch.Tensor, gamma: float, rescale: torch.Tensor | None = None
) -> torch.Tensor:
    """``u = g`` on a first visit (or an untrustworthy old u), else ``(1-γ)·u_old·rescale + γ·g``; elementwise
    (both modalities at once as ``[N, 2]``; ``seen`` broadcasts).

    ``rescale`` is v2's ``exp(b_old − b_new)``: its u lives in a scale shifted by the per-anchor bound b.
    """
    trusted = seen & (u_old >= TINY_U) & (u_old < math.inf)  # False for NaN too
    carried = u_old if rescale is None else u_old * rescale
    return torch.where(trusted, torch.lerp(g, carried, 1.0 - gamma), g)


LOG_TINY_U = math.log(TINY_U)


def update_log_u(log_u_old: torch.Tensor, log_g: torch.Tensor, seen: torch.Tensor, gamma: float) -> torch.Tensor:
    """``update_u`` in log space: ``log((1-γ)·u_old + γ·g)`` by logaddexp, so u = exp(log u) may exceed the
    float range (a negative beating its positive at τ = 0.01 makes g ~ e^200) without overflowing."""
    # log u in [LOG_TINY_U, finite]: clamping leaves it unchanged (NaN is unequal to itself): two ops, not four
    trusted = seen & (log_u_old.clamp(LOG_TINY_U, torch.finfo(log_u_old.dtype).max) == log_u_old)
    log_keep = math.log(1.0 - gamma) if gamma < 1.0 else -math.inf
    log_new = math.log(gamma) if gamma > 0.0 else -math.inf
    return torch.where(trusted, torch.logaddexp(log_u_old + log_keep, log_g + log_new), log_g)
