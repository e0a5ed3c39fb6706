"""FastCLIP-v2: RGCL with an individual temperature per sample and modality (τ_img_i, τ_txt_i in the state).

For anchor i with its own τ_i (image anchor; the text anchor is the same with roles swapped):
    d_ik = (e1_i·e2_k − e1_i·e2_i)/τ_i,   b_i = max(b_i_old, max_{k≠i} d_ik)   (b starts at 0)
    g_i  = 1/(N-1) Σ_{k≠i} exp(d_ik − b_i)                                     (g in a scale shifted by b)
    u_i  = g_i on a first visit, else (1-γ)·u_i_old·exp(b_old − b_i) + γ·g_i
Objective (RGCL): (1/2N)Σ_i τ_i(log(ε+g_i) + ρ) per modality, i.e. τ_i·(log u_i + b_i + ρ) in u's scale.
τ update (no autograd; owner of the sample applies it): grad_i = ∂/∂τ_i [τ_i(log g_i + ρ)] with g → u,
    grad_i = −[1/(N-1) Σ_{k≠i} exp(d_ik − b_i)·d_ik]/(u_i+ε) + log(u_i+ε) + b_i + ρ, clamped to ±tau_grad_clamp,
then a per-sample Adam step with betas (0,0) in epoch 0 and per-epoch bias correction, τ clamped to
[tau_min, tau_max]. The encoders see τ_old (this step's τ before its update) and the new b, with weights
τ_old_i/(u_i+ε) (faithful: the gradient of Σ τ_i log g_i) or 1/(u_i+ε) (compat="reference").
ε is the objective's (log(ε + g) in the true scale): with u stored shifted by b it enters as ε·e^−b. The
reference adds ε in the shifted scale instead (an effective ε·e^b); compat="reference" keeps that.

Communication: the anchors' ranks need τ_old and b_old of their anchors before computing g, so the state is
fetched by its own all_reduce first, then the per-anchor results (g, b, τ-gradient sums) are shared by a second.
"""

from __future__ import annotations

import functools
import math

import torch

from .base import SampleStateLoss
from .batch import GlobalBatch
from .comm import Comm
from .estimator import update_u
from .objective import AnchorRows, AutogradObjective, weighted_directions
from .options import IndividualTemperatureOptions
from .pairwise import (
    PairBlocks,
    column_terms,
    column_values,
    compute_dtype,
    exclude_,
    pair_similarity,
    positives,
    row_terms,
    row_values,
    weighted_surrogate,
)
from .schedules import tau_adam_betas

# State columns, (image, text) pairs: u, τ, b, then the Adam moments m, v.
FIELDS = ("u_img", "u_txt", "tau_img", "tau_txt", "b_img", "b_txt", "m_img", "m_txt", "v_img", "v_txt")
U, TAU, BOUND, M, V, SEEN = slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8), slice(8, 10), slice(10, 11)


def per_sample_tau_metrics(loss, surrogate, objective, gamma: float, tau: torch.Tensor):
    """The metrics of a loss with per-anchor temperatures (v2, TempNet): the batch's τ by its 5/50/95 % quantiles.
    A function computing them when read (the trainer: on logging steps; a quantile sorts, and its q tensor would be
    a host copy every step)."""
    loss, surrogate, objective = loss.detach(), surrogate.detach(), objective.detach()
    tau = tau if isinstance(tau, AnchorRows) else tau.detach()  # (AnchorRows: this rank's, gathered by _finish)
    return functools.partial(_tau_metrics, loss, surrogate, objective, gamma, tau)  # (objective.py reads its args)


TAU_QUANTILES = {"tau_q05": 0.05, "tau_q50": 0.5, "tau_q95": 0.95}  # metric name: quantile of the batch's τ


def _tau_metrics(loss, surrogate, objective, gamma: float, tau: torch.Tensor) -> dict[str, torch.Tensor]:
    q = torch.tensor(list(TAU_QUANTILES.values()), dtype=tau.dtype, device=tau.device)
    quantiles = torch.quantile(tau.reshape(-1), q)
    return {
        "loss": loss,
        "surrogate": surrogate,
        "objective": objective,
        "gamma": tau.new_full((), gamma),
        "tau_quantiles": quantiles,
        **dict(zip(TAU_QUANTILES, quantiles)),
    }


def objective_eps_shifted(u: torch.Tensor, b: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(u + ε·e^−b, its log) for u kept in the scale shifted by b: u_true + ε = e^b·(u + ε·e^−b), so the
    objective's ε enters as ε·e^−b. The log is a logaddexp, finite where ε·e^−b underflows; the sum is floored
    at the dtype's tiny so that a weight 1/(u + ε·e^−b) never divides by zero."""
    log_eps = math.log(eps) if eps > 0 else -math.inf
    log_denom = torch.logaddexp(torch.log(u), log_eps - b)
    return torch.exp(log_denom).clamp_min(torch.finfo(u.dtype).tiny), log_denom


class FastCLIPV2Loss(SampleStateLoss):
    name = "fastclip-v2"

    def __init__(self, options: IndividualTemperatureOptions):
        super().__init__(options)
        self.rho = float(options.rho)

    def initial_state_values(self) -> dict[str, float]:
        return {name: float(self.options.temperature) if name.startswith("tau") else 0.0 for name in FIELDS}

    def temperature(self) -> None:
        return None

    def _shifted_eps(self, u: torch.Tensor, b: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(denominator, its log) of the weights 1/(u + ε) in u's shifted scale. Faithful: the objective's ε
        (ε·e^−b in this scale). Reference: ε added in the shifted scale, i.e. an effective ε·e^b, which after a
        large similarity gap (b in the tens) swamps u, saturates the τ-gradient and shrinks encoder gradients."""
        if self.reference:
            return u + eps, torch.log(u + eps)
        return objective_eps_shifted(u, b, eps)

    def tau_step(self, tau_old, grad, seen, m_old, v_old):
        """``(τ_new, m, v)`` ``[N, 2]``: the per-sample Adam step on the τ-gradient (clamped to ±tau_grad_clamp) with
        betas (0, 0) in epoch 0 and per-epoch bias correction, τ clamped to [tau_min, tau_max]."""
        opt = self.options
        grad = grad.clamp(-opt.tau_grad_clamp, opt.tau_grad_clamp)
        beta1, beta2 = tau_adam_betas(self.epoch, opt.tau_betas)
        m1 = torch.where(seen, m_old, 0.0).lerp(grad, 1 - beta1)  # β1·m + (1-β1)·grad
        m2 = torch.where(seen, v_old, 0.0).lerp(grad * grad, 1 - beta2)
        step = (m1 / (1 - beta1 ** (self.epoch + 1))) / ((m2 / (1 - beta2 ** (self.epoch + 1))).sqrt() + opt.tau_eps)
        return (tau_old - opt.lr_tau * step).clamp(opt.tau_min, opt.tau_max), m1, m2

    def _compute(self, comm: Comm, batch: GlobalBatch):
        fused = self.options.fused_kernels  # the exponentials' passes as compiled kernels (kernels.py)
        opt = self.options
        dtype = compute_dtype(batch.image.dtype)
        state = self.state_for_batch(comm, batch)
        slots = state.locate(batch.all_indices, assert_in_range=self._assert_indices, repeats=batch.indices_repeat())
        gamma, eps = self.gamma(), opt.eps
        n_neg, cells, local = batch.global_size - 1, batch.same_sample_cells(), batch.local_rows
        # [2, B, N]: image anchors (rows) vs all texts, text anchors (rows) vs all images
        sim = exclude_(pair_similarity(batch, dtype), cells)
        pos, pos_all = positives(batch, dtype)

        # 1) old u, τ, b and seen of the whole global batch, filled by the owners ([N, 2] pairs (image, text)).
        stored = state.read(slots)  # this rank's rows only; m, v stay here
        owned = stored.to(pos.device, dtype)
        old = comm.share_rows(batch, None, torch.cat([owned[:, :6], owned[:, SEEN]], dim=1), dtype=dtype)
        u_old, tau_old, seen = old[:, U], old[:, TAU], old[:, 6:7] > 0.5
        b_old = torch.where(seen, old[:, BOUND], 0.0)  # the bound starts at 0

        # 2) this rank's anchors, each with its own τ_old: bound, g and the sum for the τ-gradient.
        rows = row_terms(
            sim, pos, row_values(1.0 / tau_old[local]), bound_floor=row_values(b_old[local]), moment=True, fused=fused
        )
        stats = torch.cat([rows.total.T, rows.shift.T, rows.moment.T], dim=1)  # [B, 6]: (image, text) pairs
        new = comm.share_rows(batch, stats, dtype=dtype)
        g, b_new, h = new[:, 0:2] / n_neg, new[:, 2:4], new[:, 4:6] / n_neg

        # 3) u, τ-gradient and the Adam step for the whole batch (cheap, [N, 2]); owners store their rows.
        u = update_u(u_old, g, seen, gamma, rescale=torch.exp(b_old - b_new))
        denom, log_denom = self._shifted_eps(u, b_new, eps)
        grad = -h / denom + log_denom + b_new + self.rho
        tau_new, m1, m2 = self.tau_step(tau_old, grad, seen, owned[:, M], owned[:, V])
        self.store(state, slots, torch.cat([u, tau_new, b_new, m1, m2], dim=1), previous=stored)

        # 4) encoder surrogate with τ_old and the new bounds: the columns of each block are the global anchors
        #    of the other modality (gradient into this rank's negatives).
        w = 1.0 / denom if self.reference else tau_old / denom
        cols = column_terms(
            sim, pos_all, column_values(1.0 / tau_old), shift=column_values(b_new), in_place=True, fused=fused
        )
        del sim
        block = PairBlocks(rows, cols, row_values(w[local]), column_values(w), batch.candidates)
        loss = weighted_surrogate(batch.image, batch.text, None, block, 0.5 / (batch.local_size * n_neg))

        objective = (tau_old * (log_denom + b_new + self.rho)).mean()  # both modalities averaged
        return loss, per_sample_tau_metrics(loss, loss, objective, gamma, tau_old)


def per_anchor_tau_terms(
    gap: torch.Tensor, negative: torch.Tensor, tau: torch.Tensor, b_old: torch.Tensor, n_neg: int, views: bool = False
):
    """RGCL with one τ per anchor over the global batch (v2, the temperature network), from ``gap`` ``[2, N, M]``
    φ_ik − φ_i+ (an anchor's candidates minus its positive), the negatives, τ and the old bound ``[2, N]``:
    ``(b_new, g, ∂g/∂τ, g_of)`` with b_i = max(b_old_i, max_k d_ik), g_i = 1/n_neg Σ_k exp(d_ik − b_i)
    (d = gap/τ), ∂g/∂τ by autograd, and ``g_of(τ, gap)`` the same g, differentiable in whatever carries a gradient.
    ``views`` (unimodal form): the two directions are two views of one image, which share one bound (the larger)."""
    with torch.no_grad():
        top = (gap / tau[..., None]).masked_fill(~negative, -math.inf).amax(dim=-1)
        b_new = torch.maximum(b_old, top)
        if views:
            b_new = b_new.amax(dim=0, keepdim=True).expand_as(b_new)

    def g_of(tau, gap):
        return torch.exp(gap / tau[..., None] - b_new[..., None]).masked_fill(~negative, 0.0).sum(-1) / n_neg

    tau_leaf = tau.detach().clone().requires_grad_()
    with torch.enable_grad():
        g_tau = g_of(tau_leaf, gap.detach())
        (dg_dtau,) = torch.autograd.grad(g_tau.sum(), tau_leaf)
    return b_new, g_tau.detach(), dg_dtau, g_of


class FastCLIPV2Autograd(AutogradObjective, FastCLIPV2Loss):
    """v2 as an autograd objective (``impl="autograd"``), the same math over the global batch: per direction and
    anchor i with its stored τ_i, d_ik = (φ_ik − φ_ii)/τ_i over the negatives, the bound b_i, g_i and u_i as above;
    the τ-gradient ∂/∂τ_i[τ_i(log g_i + ρ)] (g → u) has τ_i·∂g_i/∂τ_i from autograd; the encoders follow
    Σ_m w_m mean_i (τ_i/(u_i+ε))·g_i (w: direction_weights, ½ each by default).

    Unimodal form (iSogCLR, Qiu et al. 2023): m = the two views, 2N − 2 negatives; one τ per image, as the
    reference: both views use it, its Adam step takes the mean of the views' τ-gradients; u (and the bound b,
    the larger of the views') one per image as SogCLR's (gcl.py): each view weighted by its own update, the mean
    kept. Both state fields of a field pair hold the image's value."""

    unimodal_form = True

    def _objective(self, features, state):
        eps, weights, views = self.options.eps, self.options.direction_weights, features.unimodal
        pairs = features.pairs()  # [2, B, M]: both directions' anchors against their candidates
        old = {name: torch.stack([state.old[f"{name}_img"], state.old[f"{name}_txt"]]) for name in ("u", "tau", "b")}
        seen = state.seen[None, :]  # [1, B]: per (direction, anchor) tables are [2, B] here
        tau_old, b_old = old["tau"], torch.where(seen, old["b"], 0.0)  # the bound starts at 0
        gap = pairs.cos - pairs.positive[..., None]  # φ_ik − φ_i+
        b_new, g, dg_dtau, g_of = per_anchor_tau_terms(gap, pairs.negative, tau_old, b_old, pairs.count, views)
        u = update_u(old["u"], g, seen, self.gamma(), rescale=torch.exp(b_old - b_new))
        denom, log_denom = self._shifted_eps(u, b_new, eps)
        grad = tau_old * dg_dtau / denom + log_denom + b_new + self.rho
        if views:
            grad = grad.mean(dim=0, keepdim=True).expand_as(grad)
        tau_new, m1, m2 = self.tau_step(
            tau_old.T, grad.T, state.seen[:, None], torch.stack([state.old["m_img"], state.old["m_txt"]], 1),
            torch.stack([state.old["v_img"], state.old["v_txt"]], 1),
        )  # fmt: skip
        new = {"u": (u.mean(dim=0, keepdim=True).expand_as(u) if views else u).T, "tau": tau_new, "b": b_new.T}
        new.update(m=m1, v=m2)
        state.write(**{f"{name}_{m}": value[:, j] for name, value in new.items() for j, m in enumerate(("img", "txt"))})
        w = tau_old / denom  # faithful only (compat="reference" is refused for autograd)
        surrogate = (w * g_of(tau_old, gap)).mean(dim=-1)  # [2]: the encoders' gradient
        loss = weighted_directions(surrogate, weights)
        objective = weighted_directions((tau_old * (log_denom + b_new + self.rho)).mean(dim=-1), weights)
        batch_tau = torch.stack([state.batch_old["tau_img"], state.batch_old["tau_txt"]], dim=1)  # the N rows'
        return loss, per_sample_tau_metrics(loss, loss, objective, self.gamma(), batch_tau)
