"""FastCLIP-v0, v1 and v3: global contrastive losses with one global temperature.

For each anchor i of the global batch (N = K·B) and s = 1/τ:
    g1_i = 1/(N-1) Σ_{k≠i} exp(s·(e1_i·e2_k − e1_i·e2_i))      (image anchor, text negatives)
    g2_i = 1/(N-1) Σ_{k≠i} exp(s·(e2_i·e1_k − e1_i·e2_i))      (text anchor, image negatives)
and u (per sample, sharded state) tracks g across epochs. The encoders follow the FCCO gradient
(1/2N)Σ_i (∇g1_i/u1_i + ∇g2_i/u2_i), which with u = g is ∇ (1/2N)Σ_i log g_i.

Stabilised in log space (so τ → 0.01 with a negative beating its positive by more than 0.88 in cosine does not
overflow float32): the state keeps log u, each anchor's row is computed shifted by its own maximum b_i
(g_i = e^{b_i}·Σ_k exp(d_ik − b_i)/(N-1), shared as log g), and the weights 1/(u+ε) are applied as
exp(b_i − log(u_i+ε)) on the shifted rows and as a shift of log(u_j+ε) on the columns. Both are bounded by
(N-1)/γ, since u ≥ γ·g ≥ γ·exp(d_ik)/(N-1); the gradient is the same function, only its evaluation changes.

Per rank the surrogate is S_r = ½[(1/B)Σ_{i local}(w1 g1 + w2 g2)_i + (1/B)Σ_{j global}(w1 ĝ1 + w2 ĝ2)_j] with
w = 1/(u_new+ε) frozen, where ĝ_j only sums this rank's candidates (gradient into local negatives). Averaged
over ranks (DDP), ∇S_r is exactly the gradient of ½(1/N)Σ_i (w1 g1 + w2 g2)_i on the global batch, with no
gradient collective. S_r's reported value is its first part (the second only contributes gradient);
pairwise.WeightedSurrogate writes this gradient out.

* v1 (SogCLR, cosine γ): constant τ.                     objective reported: ½·mean_N(log(u1+ε) + log(u2+ε))
* v0: learnable τ (``logit_scale``), same loss.          objective: the same
* v3 (RGCL-g): loss = τ_det·S_r + τ·(½·mean_local(log(u1+ε) + log(u2+ε)) + ρ), learnable τ (the reference
  drops the ε there); objective: τ·½·mean_N(log(u1+ε) + log(u2+ε)) + ρτ
* v3 with separate_temperatures (the textbook's RGCL-g): τ1 for the image-anchored terms, τ2 for the
  text-anchored ones, objective ½[τ1(mean log(u1+ε) + ρ) + τ2(mean log(u2+ε) + ρ)]; each term of S_r carries
  its anchor's τ as a weight. τ ≥ τ0 (tau_min) for v0/v3 alike.

Temperature-free (option ``similarity="atanh"``, Kim & Kim 2025; similarity.py): every cosine c becomes
φ(c) = 2·atanh(c) = log((1+c)/(1−c)) before the scale, g1_i = 1/(N-1) Σ_{k≠i} exp(s·(φ(e1_i·e2_k) − φ(e1_i·e2_i))).
* v1 with s = 1 (build_loss's default temperature for atanh) is the temperature-free GCL: exp(φ(a) − φ(b)) =
  odds(a)/odds(b) with odds(c) = (1+c)/(1−c), so g_i is the mean odds ratio of anchor i's negatives to its
  positive and (1/2N)Σ log g has no temperature at all. A given temperature τ divides φ (a fixed sharpening).
* v0/v3 keep their learnable τ as a scale on top of φ (init τ = 1, clamp_ keeps τ in [0.01, 1]): v0 learns a
  sharpening of the temperature-free logits, v3 is RGCL-g (the DRO form τ·log mean exp(d/τ) + ρτ) over the
  φ-differences d, so its ρ is on the φ scale and needs its own tuning. Neither is temperature-free any more.
* v2 does not take the option: its per-sample τ_i adapt exactly what the map is meant to replace.
The gradient chains ∂L/∂φ with φ'(c) = 2/(1−c²) (0 where c is clamped to ±(1 − similarity_clamp)).
"""

from __future__ import annotations

import functools
import math

import torch

from .base import SampleStateLoss
from .batch import GlobalBatch
from .comm import Comm
from .estimator import update_log_u
from .objective import AutogradObjective, masked_logsumexp, pair_map, weighted_directions
from .options import ConstantTemperatureOptions, GlobalTemperatureOptions, RGCLOptions
from .pairwise import (
    PairBlocks,
    column_terms,
    column_values,
    compute_dtype,
    exclude_,
    row_terms,
    row_values,
    weighted_surrogate,
)
from .similarity import pair_logits


class GlobalTemperatureGCL(SampleStateLoss):
    """Shared computation of v0/v1/v3; subclasses choose the temperature and the outer objective."""

    state_fields = {"log_u_img": 0.0, "log_u_txt": 0.0}

    def __init__(self, options: ConstantTemperatureOptions, *, learnable: bool):
        super().__init__(options)
        self.separate = bool(getattr(options, "separate_temperatures", False))
        self._init_logit_scale(options.temperature, learnable, count=2 if self.separate else 0)

    def log_u_eps(self, log_u: torch.Tensor) -> torch.Tensor:
        """log(u + ε) from log u."""
        eps = self.options.eps
        return torch.logaddexp(log_u, log_u.new_full((), math.log(eps))) if eps > 0 else log_u

    def _compute(self, comm: Comm, batch: GlobalBatch):
        fused = self.options.fused_kernels  # the exponentials' passes as compiled kernels (kernels.py)
        dtype = compute_dtype(batch.image.dtype)
        state = self.state_for_batch(comm, batch)
        slots = state.locate(batch.all_indices, assert_in_range=self._assert_indices, repeats=batch.indices_repeat())
        gamma, n_neg, cells, local = self.gamma(), batch.global_size - 1, batch.same_sample_cells(), batch.local_rows
        scale = self._scale(dtype)  # s = 1/τ, autograd into logit_scale when learnable
        learnable, s = scale.requires_grad, scale.detach()
        logits, row_scale, col_scale, scaled = self._logits(batch, dtype, s, cells)
        sim, pos, pos_all = logits.sim, logits.pos, logits.pos_all
        # loss1 terms: this rank's anchors against all N candidates, each row shifted by its maximum b_i.
        rows = row_terms(sim, pos, row_scale, sim_is_scaled=scaled, max_shift=True, fused=fused)
        log_g_local = (rows.shift + torch.log(rows.total / n_neg)).T  # [B, 2] (image, text)

        log_g, log_u = self._update_u(comm, batch, state, slots, log_g_local, dtype, gamma)
        log_w = self.log_u_eps(log_u)  # weights 1/(u+ε) = exp(−log_w), constants for autograd
        # loss2 terms: every global anchor (column) against this rank's candidates: they give the local
        # negatives the gradient of all anchors; summed over ranks this completes each anchor's g. Shifted by
        # log(u_j+ε), their weight is 1.
        # The reference also differentiates τ through them, which counts the g-term of the τ-gradient twice.
        in_columns = learnable and self.reference
        # the τ-gradient needs the scaled similarities (before the columns overwrite them) and the positives
        kept_sim = (sim if scaled else sim * s[:, None, None]) if learnable else None
        cols = column_terms(
            sim,
            pos_all,
            col_scale,
            sim_is_scaled=scaled,
            shift=column_values(log_w),
            total=in_columns,
            in_place=not learnable or not scaled,  # (kept_sim is then a scaled copy)
            fused=fused,
        )
        # each modality's terms weighted by its τ when the temperatures are separate (the shared τ multiplies
        # the whole surrogate in _outer instead)
        row_w = torch.exp(rows.shift - row_values(log_w[local]))  # bounded by (N-1)/γ
        surrogate_w, col_w = row_w, 1.0  # (the metric: S without the τ weights, as for a shared τ)
        if self.separate:
            row_w, col_w = row_w / row_scale, 1.0 / col_scale
        kept = dict(positive=pos, positive_all=pos_all) if learnable else {}
        block = PairBlocks(rows, cols, row_w, col_w, batch.candidates, sim=kept_sim, **kept, **logits.pair_grads())
        del sim, kept_sim, logits
        coef = 0.5 / (batch.local_size * n_neg)
        divisor, tau_term, objective = self._outer(s, log_u, log_w, local)
        loss = weighted_surrogate(  # (a constant τ's scale carries no gradient: the Function gives it none)
            batch.image,
            batch.text,
            scale,
            block,
            coef if divisor is None else coef / divisor,
            scale_in_columns=in_columns,
            temperature_term=tau_term,
        )
        # computed when read (logging steps), from this call's detached tensors (and not self)
        surrogate = (coef, surrogate_w, rows.total)
        metrics = functools.partial(
            _gcl_metrics, loss.detach(), surrogate, objective, gamma, s, self.separate, log_u, log_g
        )
        return loss, metrics

    def _logits(self, batch: GlobalBatch, dtype, s, cells):
        """(logits, row scale, column scale, whether the similarities are scaled): s·(local images vs all texts),
        s·(local texts vs all images) as one [2, B, N] tensor, positives; cosines mapped by φ = 2·atanh for
        similarity="atanh" (then φ' rides along in the block for backward). With one τ per modality (v3,
        separate_temperatures) the blocks stay unscaled: block 0's rows (image anchors) take s[0] (the image τ)
        and its columns (text anchors) s[1], block 1 the other way round."""
        row_scale, col_scale = (s[:, None], s.flip(0)[:, None]) if self.separate else (s, s)
        logits = pair_logits(
            batch, dtype, None if self.separate else s, self.options.similarity, self.options.similarity_clamp
        )
        exclude_(logits.sim, cells)  # a pair's positive and copies of its sample are no negatives (both readings)
        return logits, row_scale, col_scale, not self.separate

    def _update_u(self, comm: Comm, batch: GlobalBatch, state, slots, log_g_local, dtype, gamma: float):
        """(log g, new log u) of the batch's N samples. One all_reduce: each anchor's log g from its rank, each
        sample's old log u (and seen) from its owner; the owners store the new u."""
        before = state.read(slots)
        table = comm.share_rows(batch, log_g_local, before, dtype=dtype)
        log_g, log_u_old, seen = table[:, 0:2], table[:, 2:4], table[:, 4:5] > 0.5
        log_u = update_log_u(log_u_old, log_g, seen, gamma)
        self.store(state, slots, log_u, previous=before)
        return log_g, log_u

    def _outer(self, s, log_u, log_w, local):
        """How the loss is built on the surrogate S: ``(q, t, objective)`` for loss = S/q + Σ t·τ (q None: 1,
        t None: no term; both detached, the Function adds t·τ and its τ-gradient) and a function giving the
        estimated objective. v0/v1: S itself, and the GCL ½·mean(log(u1+ε) + log(u2+ε))."""
        return None, None, log_w.mean

    def set_extra_state(self, state: dict) -> None:
        """Checkpoints written before the state kept log u held u itself: converted on load."""
        fields = state.get("fields", {})
        if set(fields) == {"u_img", "u_txt"}:  # exactly those: another objective's state is refused as saved
            state = dict(state, fields={f"log_{name}": torch.log(value) for name, value in fields.items()})
        super().set_extra_state(state)


class FastCLIPV0Loss(GlobalTemperatureGCL):
    """GCL with a learnable global temperature (``logit_scale``)."""

    name = "fastclip-v0"

    def __init__(self, options: GlobalTemperatureOptions):
        super().__init__(options, learnable=options.learn_temperature)


class FastCLIPV1Loss(GlobalTemperatureGCL):
    """GCL with a constant temperature (``logit_scale`` is a frozen parameter)."""

    name = "fastclip-v1"

    def __init__(self, options: ConstantTemperatureOptions):
        super().__init__(options, learnable=False)


class FastCLIPV3Loss(GlobalTemperatureGCL):
    """RGCL-g: τ·(1/2N)Σ(log(ε+g1)+log(ε+g2)) + ρτ with a learnable global τ."""

    name = "fastclip-v3"

    def __init__(self, options: RGCLOptions):
        super().__init__(options, learnable=options.learn_temperature)
        self.rho = float(options.rho)

    def _outer(self, s, log_u, log_w, local):
        # loss = τ·S + τ·(½·mean_local(log(u1+ε) + log(u2+ε)) + ρ), τ = 1/s: S divided by the detached s, the outer
        # term's τ-gradient through the surrogate's Function (no autograd node of its own).
        # Faithful: log(u+ε), the stated objective's log(ε+g); the reference takes log u without ε.
        rho = self.rho
        if self.separate:  # ½[τ1(mean log(u1+ε) + ρ) + τ2(mean log(u2+ε) + ρ)]; the surrogate is τ-weighted
            per_modality = 0.5 * (log_w[local].mean(dim=0) + rho)
            return None, per_modality, lambda: 0.5 * ((log_w.mean(dim=0) + rho) / s).sum()
        log_u_local = (log_u if self.reference else log_w)[local].mean()  # ½·mean(log u1 + log u2)
        return s, log_u_local + rho, lambda: (log_w.mean() + rho) / s


def _gcl_metrics(loss, surrogate, objective, gamma: float, s, separate: bool, log_u, log_g) -> dict:
    """The fused GCL losses' metrics, from one call's detached tensors (``objective``: a function of them;
    ``surrogate``: (coef, row weights, row totals), S summed as the surrogate's forward sums it)."""
    coef, row_w, row_total = surrogate
    out = {
        "loss": loss,
        "surrogate": coef * (row_w * row_total).sum(),
        "objective": objective(),
        "gamma": loss.new_full((), gamma, dtype=log_u.dtype),
        "tau": 1.0 / s.mean() if not separate else torch.exp(-torch.log(s).mean()),
    }
    # how far the moving average lags this batch's estimate (log u − log g, mean and mean |.|): the staleness of u,
    # a diagnostic of the estimator (the study logs it)
    lag = log_u - log_g
    out.update(u_lag=lag.mean(), u_lag_abs=lag.abs().mean())
    if separate:
        out.update(tau_img=1.0 / s[0], tau_txt=1.0 / s[1])
    return out


class GCLAutograd(AutogradObjective):
    """v0, v1 and v3 as autograd objectives (``impl="autograd"``; first in the bases of the fused class, whose
    temperature, state fields and γ schedule it keeps). Over the global batch, per direction m (image anchors,
    text anchors) and anchor i, with d_ik = s_m·(φ_ik − φ_ii) over the negatives k (copies of i's sample excluded):
        log g_mi = log Σ_k exp(d_ik) − log(N−1),   u ← (1−γ)u + γ g   (log space; estimator.py)
        S_m = mean_i g_mi/(u_mi + ε)   (u detached: the surrogate whose gradient is the objective's)
    v0/v1: loss = Σ_m w_m S_m; v3: loss = Σ_m w_m [τ_m,det·S_m + τ_m·(mean_i log(u_mi + ε) + ρ)], with
    w = direction_weights normalised to sum 1 (½, ½ by default) and τ_m the shared τ unless separate_temperatures.
    Unimodal form (SogCLR, Yuan et al. 2022): m = the two views, N − 1 → 2N − 2 negatives; as SogCLR's reference
    one u per image: both views update the stored u, each is weighted by its own update u_mi, and the image keeps
    their mean (both state fields hold it).
    """

    unimodal_form = True

    def _objective(self, features, state):
        dtype = features.image.dtype
        scale = self._scale(dtype)  # s = 1/τ: 0-d, or [2] (image anchors, text anchors) when separate
        weights = self.options.direction_weights
        pairs = features.pairs()  # [2, B, M]: both directions' anchors against the batch (and the queue)
        similarity, clamp = self.options.similarity, self.options.similarity_clamp
        rows, positive = pair_map(pairs.cos, similarity, clamp), pair_map(pairs.positive, similarity, clamp)
        per_direction = scale.reshape(-1, 1, 1) if self.separate else scale
        d = (rows - positive[..., None]) * per_direction
        log_count = math.log(pairs.count) if isinstance(pairs.count, int) else torch.log(pairs.count.to(d.dtype))
        log_g = (masked_logsumexp(d, pairs.negative) - log_count).T  # [B, 2] (image, text)
        old = torch.stack([state.old["log_u_img"], state.old["log_u_txt"]], dim=1)
        gamma = self.gamma()
        log_u = update_log_u(old, log_g.detach(), state.seen[:, None], gamma)
        stored = log_u
        if features.unimodal:  # SogCLR: one u per image, read by both views, the mean of the views' updates kept
            stored = (torch.logsumexp(log_u, dim=1, keepdim=True) - math.log(2.0)).expand(-1, 2)
        state.write(log_u_img=stored[:, 0], log_u_txt=stored[:, 1])
        log_w = self.log_u_eps(log_u)  # log(u + ε), a constant for autograd
        surrogate = torch.exp(log_g - log_w).mean(dim=0)  # [2]: S_m
        rho = getattr(self, "rho", None)
        tau = 1.0 / scale
        if rho is None:  # v0, v1
            loss = weighted_directions(surrogate, weights)
            objective = weighted_directions(log_w.mean(dim=0), weights)
        else:  # v3 (RGCL-g)
            loss = weighted_directions(tau.detach() * surrogate + tau * (log_w.mean(dim=0) + rho), weights)
            objective = weighted_directions(tau.detach() * (log_w.mean(dim=0) + rho), weights)
        s = scale.detach()
        lag = log_u - log_g.detach()
        metrics = {
            "loss": loss.detach(),
            "surrogate": weighted_directions(surrogate.detach(), weights),
            "objective": objective,
            "gamma": log_u.new_full((), gamma),
            "tau": 1.0 / s.mean() if not self.separate else torch.exp(-torch.log(s).mean()),
            "u_lag": lag.mean(),
            "u_lag_abs": lag.abs().mean(),
        }
        if self.separate:
            metrics.update(tau_img=1.0 / s[0], tau_txt=1.0 / s[1])
        return loss, metrics


class FastCLIPV0Autograd(GCLAutograd, FastCLIPV0Loss):
    pass


class FastCLIPV1Autograd(GCLAutograd, FastCLIPV1Loss):
    pass


class FastCLIPV3Autograd(GCLAutograd, FastCLIPV3Loss):
    pass
