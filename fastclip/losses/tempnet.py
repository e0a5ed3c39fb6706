"""FastCLIP with a temperature prediction network (TempNet): RGCL whose per-anchor temperatures are predicted
from the features by a small MLP head per modality, trained jointly with the encoders.

    τ_i = τ(w'; x_i) = τ_min + (τ_max − τ_min)·sigmoid(MLP_img(x_i))      (text anchors: MLP_txt(t_i))
    objective: (1/2N) Σ_i [τ_i^img (log(ε + g1_i(τ_i^img)) + ρ) + τ_i^txt (log(ε + g2_i(τ_i^txt)) + ρ)]

g1_i/g2_i, u (moving average, kept shifted by the running bound b) and the encoder surrogate are those of
FastCLIP-v2 (individual.py): the encoders follow the RGCL gradient at fixed τ, with weights τ_i/(u_i+ε). The
difference is where τ comes from: instead of a per-sample table updated by its own Adam (which only moves a
sample's τ when that sample is visited, and knows nothing of a sample never seen), τ is a function of the
features, so it is defined for unseen samples too and learns from every anchor of every batch. The head
reads the features detached: its gradient is ∂/∂τ_i [τ_i(log g_i(τ_i) + ρ)] (with g → u, as v2's τ step)
pushed through τ(w'; ·) by autograd; the towers are not trained through the temperature.

The head's parameters are the loss module's parameters (like the global logit_scale of v0/v3): they go into
the optimizer's temperature group, are averaged over ranks with ``average_grads_`` (each rank back-propagates
its own anchors' term, scaled so the average is the global gradient), and are saved with the loss state.
Every rank evaluates the head on the gathered features for the columns (global anchors), without autograd.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import SampleStateLoss
from .batch import GlobalBatch
from .comm import Comm
from .errors import LossInputError
from .estimator import update_u
from .individual import objective_eps_shifted, per_anchor_tau_terms, per_sample_tau_metrics
from .objective import AnchorRows, AutogradObjective, weighted_directions
from .options import TempNetOptions
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

FIELDS = ("u_img", "u_txt", "b_img", "b_txt")


class TemperatureHead(nn.Module):
    """d -> hidden -> 1 MLP with a sigmoid mapped onto [tau_min, tau_max]; starts at `temperature` everywhere
    (zero output layer, bias at the logit of the initial τ)."""

    def __init__(self, embed_dim: int, hidden: int, temperature: float, tau_min: float, tau_max: float):
        super().__init__()
        self.tau_min, self.tau_max = float(tau_min), float(tau_max)
        self.hidden = nn.Linear(embed_dim, hidden)
        self.out = nn.Linear(hidden, 1)
        frac = (temperature - tau_min) / (tau_max - tau_min)
        nn.init.zeros_(self.out.weight)
        nn.init.constant_(self.out.bias, math.log(frac / (1 - frac)))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        z = self.out(torch.nn.functional.gelu(self.hidden(features))).squeeze(-1)
        return self.tau_min + (self.tau_max - self.tau_min) * torch.sigmoid(z)


class TempNetLoss(SampleStateLoss):
    name = "fastclip-tempnet"
    state_fields = {name: 0.0 for name in FIELDS}

    def __init__(self, options: TempNetOptions):
        super().__init__(options)
        self.rho = float(options.rho)
        head = dict(
            embed_dim=options.embed_dim,
            hidden=options.tempnet_hidden,
            temperature=options.temperature,
            tau_min=options.tau_min,
            tau_max=options.tau_max,
        )
        self.tempnet_img = TemperatureHead(**head)
        self.tempnet_txt = TemperatureHead(**head)

    def temperature(self) -> None:
        return None

    def check_dim(self, d: int) -> None:
        if d != self.options.embed_dim:  # (d agrees across ranks: every rank raises alike)
            raise LossInputError(
                f"features have d={d} but the temperature network was built for "
                f"embed_dim={self.options.embed_dim}: build the loss with embed_dim={d}"
            )

    def _compute(self, comm: Comm, batch: GlobalBatch):
        self.check_dim(batch.image.shape[1])
        fused, eps = self.options.fused_kernels, self.options.eps  # fused: the exponentials' passes compiled
        dtype = compute_dtype(batch.image.dtype)
        state = self.state_for_batch(comm, batch)
        slots = state.locate(batch.all_indices, assert_in_range=self._assert_indices, repeats=batch.indices_repeat())
        gamma, n_neg, cells, local = self.gamma(), batch.global_size - 1, batch.same_sample_cells(), batch.local_rows
        head_dtype = self.tempnet_img.out.weight.dtype
        # τ of this rank's anchors, with autograd into the heads; of all N anchors (the columns) without
        tau_local = torch.stack(
            [
                self.tempnet_img(batch.image.detach().to(head_dtype)),
                self.tempnet_txt(batch.text.detach().to(head_dtype)),
            ],
            dim=1,
        )
        with torch.no_grad():
            tau = torch.stack(
                [self.tempnet_img(batch.all_image.to(head_dtype)), self.tempnet_txt(batch.all_text.to(head_dtype))],
                dim=1,
            ).to(dtype)
        sim = exclude_(pair_similarity(batch, dtype), cells)  # [2, B, N]
        pos, pos_all = positives(batch, dtype)

        stored = state.read(slots)  # [N, u_img, u_txt, b_img, b_txt, seen], owners' rows
        old = stored.to(pos.device, dtype)
        rows = row_terms(sim, pos, row_values(1.0 / tau[local]), max_shift=True, moment=True, fused=fused)
        # rows are shifted by their own maximum; the shared table carries each anchor's (log-free) g, shift and
        # τ-moment, plus the owners' old u, b and seen
        stats = torch.cat([rows.total.T, rows.shift.T, rows.moment.T], dim=1)  # [B, 6]: (image, text) pairs
        table = comm.share_rows(batch, stats, old, dtype=dtype)
        g_shifted, shift, h = table[:, 0:2] / n_neg, table[:, 2:4], table[:, 4:6] / n_neg
        u_old, b_old, seen = table[:, 6:8], table[:, 8:10], table[:, 10:11] > 0.5
        b_old = torch.where(seen, b_old, -math.inf)
        b_new = torch.maximum(b_old, shift)  # the running bound, as v2
        g = g_shifted * torch.exp(shift - b_new)  # g in b_new's scale
        u = update_u(u_old, g, seen, gamma, rescale=torch.exp(b_old - b_new))
        self.store(state, slots, torch.cat([u, b_new], dim=1), previous=stored)
        denom, log_denom = objective_eps_shifted(u, b_new, eps)

        # ∂/∂τ [τ(log g(τ) + ρ)] with g → u (v2's τ-gradient, unclamped), pushed into the heads by autograd:
        # each rank its own anchors, scaled so that the ranks' average is the global (1/2N)Σ
        h_new = h * torch.exp(shift - b_new)
        grad_tau = -h_new / denom + log_denom + b_new + self.rho
        tau_term = (tau_local * grad_tau[local].to(tau_local.dtype)).sum() / (2 * batch.local_size)

        # the encoders: RGCL at fixed τ, weights τ_i/(u_i+ε) (rows rescaled to b_new, as the columns)
        w = tau / denom
        w_rows = w[local] * torch.exp(shift[local] - b_new[local])
        cols = column_terms(
            sim, pos_all, column_values(1.0 / tau), shift=column_values(b_new), in_place=True, fused=fused
        )
        del sim
        block = PairBlocks(rows, cols, row_values(w_rows), column_values(w), batch.candidates)
        surrogate = weighted_surrogate(batch.image, batch.text, None, block, 0.5 / (batch.local_size * n_neg))
        loss = surrogate + tau_term - tau_term.detach()  # value: the surrogate; gradient: both

        objective = (tau * (log_denom + b_new + self.rho)).mean()
        return loss, per_sample_tau_metrics(loss, surrogate, objective, gamma, tau)


class TempNetAutograd(AutogradObjective, TempNetLoss):
    """The temperature network as an autograd objective (``impl="autograd"``): per direction and anchor i,
    τ_i = head(x_i) on the detached features, d_ik = (φ_ik − φ_ii)/τ_i over the negatives, b_i = max(b_old_i,
    max_k d_ik) (b starts at −∞), g_i and u_i as above. The heads follow Σ_m w_m mean_i τ_i·grad_i with
    grad_i = ∂/∂τ_i[τ_i(log g_i + ρ)] (g → u; τ_i·∂g_i/∂τ_i from autograd); the encoders Σ_m w_m mean_i
    (τ_i/(u_i+ε))·g_i at fixed τ (w: direction_weights, ½ each by default).

    Unimodal form: one image tower, so one head (``tempnet_img``; ``tempnet_txt`` is dropped) predicts τ for
    either view from its own features; u and b one per image, shared by the views as v2's (individual.py).
    The τ quantiles among the metrics are those of the global batch's 2N anchors, on any number of ranks."""

    unimodal_form = True

    def __init__(self, options: TempNetOptions):
        super().__init__(options)
        if options.unimodal:
            self.tempnet_txt = None  # (no parameters that nothing trains)

    def _objective(self, features, state):
        self.check_dim(features.image.shape[1])
        eps, weights, gamma, views = self.options.eps, self.options.direction_weights, self.gamma(), features.unimodal
        head_dtype = self.tempnet_img.out.weight.dtype
        image, text = features.image.detach().to(head_dtype), features.text.detach().to(head_dtype)
        second_head = self.tempnet_img if views else self.tempnet_txt
        tau_head = torch.stack([self.tempnet_img(image), second_head(text)])  # autograd into the heads
        tau = tau_head.detach().to(features.image.dtype)  # [2, B]
        pairs = features.pairs()
        gap = pairs.cos - pairs.positive[..., None]  # [2, B, M] φ_ik − φ_i+
        seen = state.seen[None, :]
        old = {name: torch.stack([state.old[f"{name}_img"], state.old[f"{name}_txt"]]) for name in ("u", "b")}
        b_old = torch.where(seen, old["b"], -math.inf)
        b_new, g, dg_dtau, g_of = per_anchor_tau_terms(gap, pairs.negative, tau, b_old, pairs.count, views)
        u = update_u(old["u"], g, seen, gamma, rescale=torch.exp(b_old - b_new))
        kept = u.mean(dim=0, keepdim=True).expand_as(u) if views else u
        state.write(u_img=kept[0], u_txt=kept[1], b_img=b_new[0], b_txt=b_new[1])
        denom, log_denom = objective_eps_shifted(u, b_new, eps)
        grad_tau = tau * dg_dtau / denom + log_denom + b_new + self.rho
        tau_term = weighted_directions((tau_head * grad_tau.to(tau_head.dtype)).mean(dim=-1), weights)
        surrogate = weighted_directions((tau / denom * g_of(tau, gap)).mean(dim=-1), weights)
        loss = surrogate + tau_term - tau_term.detach()  # value: the surrogate; gradient: both
        objective = weighted_directions((tau * (log_denom + b_new + self.rho)).mean(dim=-1), weights)
        # τ of every anchor of the global batch, as the fused loss reports: gathered in the call's one all_reduce
        return loss, per_sample_tau_metrics(loss, surrogate, objective, gamma, AnchorRows(tau))
