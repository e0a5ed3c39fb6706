"""FastCLIP-v2's ε: the objective's log(ε + g) in the true scale, although u is stored shifted by the running
bound b (float64, against the objective written out directly)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastclip.losses import build_loss
from fastclip.losses.individual import objective_eps_shifted

N, EPS, TAU = 6, 1e-6, 0.02
IDX = torch.arange(N)


def reversed_pair_batch():
    """Pair 0's text is far from its image while another text is close to it: (s_0k − s_00)/τ is about 75,
    so the bound b_0 ≈ 75 and ε·e^b ≈ 4e26 swamps u in the shifted scale."""
    gen = torch.Generator().manual_seed(0)
    e1 = F.normalize(torch.randn(N, 8, generator=gen, dtype=torch.float64), dim=1)
    e2 = F.normalize(e1 + 0.3 * torch.randn(N, 8, generator=gen, dtype=torch.float64), dim=1)
    e2[0] = -e1[0]
    e2[1] = F.normalize(e1[0] + 0.05 * e2[1], dim=0)
    return e1, e2


def objective(e1, e2, tau, eps):
    """(1/2N) Σ_i τ_i (log(ε + g1_i) + log(ε + g2_i)) with τ held fixed (the encoders' objective)."""
    sim = e1 @ e2.T
    pos = torch.diagonal(sim)
    off = ~torch.eye(N, dtype=torch.bool)
    g1 = (torch.exp((sim - pos[:, None]) / tau) * off).sum(1) / (N - 1)
    g2 = (torch.exp((sim.T - pos[:, None]) / tau) * off).sum(1) / (N - 1)
    return (tau * (torch.log(eps + g1) + torch.log(eps + g2))).sum() / (2 * N)


def after_a_large_gap(compat):
    """Step 1 on the reversed-pair batch (the bound of anchor 0 jumps to about 75), step 2 on an ordinary batch
    of the same samples: b never decreases, so in step 2 u is tiny in the shifted scale. Returns step 2's
    encoder gradients, the loss, its inputs and the τ step 2 used. γ = 1 in epoch 0, so u = g."""
    loss_fn = build_loss(
        "fastclip-v2", data_size=N, temperature=TAU, eps=EPS, rho=2.0, compat=compat, state_dtype=torch.float64
    ).double()
    loss_fn(*reversed_pair_batch(), IDX)
    fields = loss_fn.state_dict()["_extra_state"]["fields"]
    tau_img, tau_txt = fields["tau_img"].clone(), fields["tau_txt"].clone()
    gen = torch.Generator().manual_seed(1)
    e1 = F.normalize(torch.randn(N, 8, generator=gen, dtype=torch.float64), dim=1)
    e2 = F.normalize(e1 + 0.5 * torch.randn(N, 8, generator=gen, dtype=torch.float64), dim=1)
    x1, x2 = e1.clone().requires_grad_(), e2.clone().requires_grad_()
    loss_fn(x1, x2, IDX).backward()
    return x1.grad, x2.grad, loss_fn, (e1, e2), (tau_img, tau_txt)


def objective2(e1, e2, tau_img, tau_txt, eps):
    sim = e1 @ e2.T
    pos = torch.diagonal(sim)
    off = ~torch.eye(N, dtype=torch.bool)
    g1 = (torch.exp((sim - pos[:, None]) / tau_img[:, None]) * off).sum(1) / (N - 1)
    g2 = (torch.exp((sim.T - pos[:, None]) / tau_txt[:, None]) * off).sum(1) / (N - 1)
    return (tau_img * torch.log(eps + g1) + tau_txt * torch.log(eps + g2)).sum() / (2 * N)


def test_faithful_v2_uses_the_objectives_eps_after_a_large_gap():
    g1, g2, loss_fn, (e1, e2), (tau_img, tau_txt) = after_a_large_gap("faithful")
    assert loss_fn.state_dict()["_extra_state"]["fields"]["b_img"][0] > 60  # the regime where it mattered
    w1, w2 = e1.clone().requires_grad_(), e2.clone().requires_grad_()
    want = torch.autograd.grad(objective2(w1, w2, tau_img, tau_txt, EPS), (w1, w2))
    torch.testing.assert_close(g1, want[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(g2, want[1], rtol=1e-9, atol=1e-12)
    # the τ-gradient at anchor 0 is the objective's too, not saturated at the clamp by a huge ε
    fields = loss_fn.state_dict()["_extra_state"]["fields"]
    tau = tau_img.clone().requires_grad_()
    sim = e1 @ e2.T
    d = (sim - torch.diagonal(sim)[:, None]) / tau[:, None]
    g = (torch.exp(d) * ~torch.eye(N, dtype=torch.bool)).sum(1) / (N - 1)
    grad = torch.autograd.grad((tau * (torch.log(EPS + g) + 2.0)).sum(), tau)[0]
    assert grad[0].abs() < 5.0
    m = fields["m_img"][0]  # epoch 0: betas 0, so m is this step's gradient
    torch.testing.assert_close(m, grad[0], rtol=1e-9, atol=1e-12)


def test_reference_keeps_the_shifted_eps_and_it_shrinks_gradients():
    """compat="reference" keeps the published code's ε in the shifted scale (ε·e^b ≈ 4e26 in the true one):
    anchor 0's weight collapses after the gap, the faithful mode's does not."""
    f1 = after_a_large_gap("faithful")[0]
    r1, _, _, (e1, e2), (tau_img, tau_txt) = after_a_large_gap("reference")
    # reference weights lack τ_i; compare per unit of weight: anchor 0's image gradient all but vanishes
    assert r1[0].norm() * tau_img[0] < 1e-3 * f1[0].norm()
    assert f1[0].norm() > 1e-3


def test_objective_eps_shifted_is_finite_where_eps_underflows():
    u = torch.tensor([0.0, 1e-30, 0.5], dtype=torch.float32)
    b = torch.tensor([200.0, 200.0, 0.0])
    denom, log_denom = objective_eps_shifted(u, b, 1e-14)
    assert torch.isfinite(log_denom).all() and (denom > 0).all()
    assert log_denom[0].item() == pytest.approx(math.log(1e-14) - 200.0, rel=1e-6)
    torch.testing.assert_close(log_denom[2], torch.tensor(math.log(0.5 + 1e-14)))
