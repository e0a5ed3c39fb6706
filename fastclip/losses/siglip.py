"""SigLIP (Zhai et al. 2023): an independent sigmoid loss per pair, as a baseline on the FastCLIP communication.

With scale t = exp(logit_scale) (init 10), bias b (init −10), and z_ij = +1 on the positive pair, −1 otherwise,
each rank's loss is OpenCLIP's ``SigLipLoss`` per-rank value (normalised by the local batch B):

    L_r = −(1/B) Σ_{i local} Σ_{j global} log σ(z_ij·(t·e1_i·e2_j + b))

Every pairwise term is independent, so there is nothing to share but the features (one all_gather, no
autograd): rank r differentiates the terms (local images × all texts) into its images, t and b ("loss1", the
reported value) and the terms (all images × local texts) into its texts only ("loss2", value 0). Across ranks
each term reaches each of its two features once and t, b once, so the rank average of the gradients (DDP) is
the gradient of the single-process loss on the global batch ((1/N) Σ over all N² pairs); per rank they equal
``SigLipLoss``'s (whose text features travel around the ring with autograd: the same (K−1)·B·d per rank both
ways, where this all_gather moves images and texts once). The gradient is written out:
∂ℓ/∂logit = σ(logit) − [z = +1]. An all_reduce of B row sums per rank (N scalars) gives
``metrics["objective"]`` = the global-batch loss (1/N) Σ over all pairs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import ContrastiveLoss
from .batch import GlobalBatch
from .comm import Comm
from .objective import AutogradObjective
from .options import SigLIPOptions
from .pairwise import compute_dtype, exact_float32, similarity


def _pair_terms(sim: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, cells):
    """``(Σ_j −log σ(z·logit) per row, ∂ℓ/∂logit)`` of a ``[B, N]`` block of cosines; positives at ``cells``."""
    with torch.no_grad():
        logit = sim.mul(scale).add_(bias)
        positive = logit[cells]
        minus_z_logit = logit.clone()  # −z·logit: +logit on negatives, −logit on positives
        minus_z_logit[cells] = -positive
        loss_rows = F.softplus(minus_z_logit).sum(dim=1)  # −log σ(z·logit) = softplus(−z·logit)
        dlogit = logit.sigmoid_()  # σ(logit) − [z = +1]; on the positives −σ(−logit),
        dlogit[cells] = -torch.sigmoid(-positive)  # which keeps its digits when σ(logit) is near 1
    return loss_rows, dlogit


class SigmoidPairs(torch.autograd.Function):
    """Value ``coef·Σ loss1`` with the gradients of loss1 (images, t, b) and loss2 (texts), written out."""

    @staticmethod
    def forward(ctx, image, text, scale, bias, d_it, d_ti, all_text, all_image, sim_it, coef, value):
        ctx.save_for_backward(d_it, d_ti, all_text, all_image, sim_it)
        ctx.scale, ctx.coef = scale.detach(), coef
        ctx.dtypes = (image.dtype, text.dtype, scale.dtype, bias.dtype)
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad_out):
        with exact_float32(grad_out.device.type):  # a backward called inside autocast, or with TF32 on
            return SigmoidPairs._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        d_it, d_ti, all_text, all_image, sim_it = ctx.saved_tensors
        image_dtype, text_dtype, scale_dtype, bias_dtype = ctx.dtypes
        factor = ctx.coef * grad_out
        grads = [None] * 11
        if ctx.needs_input_grad[0]:
            grads[0] = (((factor * ctx.scale) * d_it) @ all_text.to(d_it.dtype)).to(image_dtype)
        if ctx.needs_input_grad[1]:
            grads[1] = (((factor * ctx.scale) * d_ti) @ all_image.to(d_ti.dtype)).to(text_dtype)
        if ctx.needs_input_grad[2]:
            grads[2] = (factor * torch.dot(d_it.reshape(-1), sim_it.reshape(-1))).to(scale_dtype)
        if ctx.needs_input_grad[3]:
            grads[3] = (factor * d_it.sum()).to(bias_dtype)
        return tuple(grads)


class SigLIPLoss(ContrastiveLoss):
    name = "siglip"
    min_training_batch = 1  # each pair is its own binary problem: a lone positive pair still has a gradient

    def __init__(self, options: SigLIPOptions):
        super().__init__(options)
        self._init_logit_scale(options.temperature, options.learn_temperature)
        self.logit_bias = nn.Parameter(torch.tensor(float(options.bias)), requires_grad=options.learn_bias)

    def _compute(self, comm: Comm, batch: GlobalBatch):
        dtype = compute_dtype(batch.image.dtype)
        scale = self._scale(dtype)  # t, autograd into logit_scale
        bias = self.logit_bias.to(dtype)
        cells = batch.group_cells()  # the pairs (with groups: every same-group cell)
        t, b = scale.detach(), bias.detach()
        sim_it = similarity(batch.image, batch.all_text, dtype)  # local images (rows) vs all texts
        sim_ti = similarity(batch.text, batch.all_image, dtype)  # local texts (rows) vs all images
        loss_rows, d_it = _pair_terms(sim_it, t, b, cells)  # loss1: grads into images, t, b
        _, d_ti = _pair_terms(sim_ti, t, b, cells)  # loss2: grads into texts only
        del sim_ti
        coef = 1.0 / batch.local_size
        value = loss_rows.sum() * coef
        loss = SigmoidPairs.apply(
            batch.image,
            batch.text,
            scale,
            bias,
            d_it,
            d_ti,
            batch.all_text,
            batch.all_image,
            sim_it if scale.requires_grad else None,
            coef,
            value,
        )
        rows = comm.share_rows(batch, loss_rows[:, None], dtype=dtype)  # every anchor's row sum, for the metric
        metrics = {
            "loss": loss,
            "surrogate": loss,
            "objective": rows.sum() / batch.global_size,
            "tau": 1.0 / t,
            "bias": b,
        }
        return loss, metrics

    def extra_repr(self) -> str:
        return super().extra_repr() + f", init_scale={math.exp(float(self.logit_scale)):.4g}"


class SigLIPAutograd(AutogradObjective, SigLIPLoss):
    """siglip as an autograd objective (``impl="autograd"``): (1/N) Σ_ij softplus(−z_ij·(t·cos_ij + b)) over the
    global batch, z = +1 on the N positive pairs."""

    def _objective(self, features, state):
        dtype = features.image.dtype
        scale, bias = self._scale(dtype), self.logit_bias.to(dtype)
        logits = features.cosines() * scale + bias
        sign = 2.0 * features.same_pair().to(dtype) - 1.0  # +1 on the pairs (and their groups)
        loss = F.softplus(-sign * logits).sum() / features.anchors  # this rank's image rows: its share
        value = loss.detach()
        return loss, {
            "loss": value,
            "surrogate": value,
            "objective": value,
            "tau": 1.0 / scale.detach(),
            "bias": bias.detach(),
        }
