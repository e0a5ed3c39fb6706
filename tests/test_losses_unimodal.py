"""The unimodal form (option ``unimodal``): two views of each image, every one of the 2N views an anchor against
the other images' 2N − 2 views. Each loss equals its formula written out here over the 2N anchors in float64
(SimCLR's NT-Xent, DCL, SogCLR = v1, v0, v3, iSogCLR = v2, the temperature network), over 3 steps of per-image
state; 1 process = 2 = 3 gloo ranks with repeated indices; a state saved after two steps resumes the third
exactly; the options without a unimodal form are one error naming them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastclip.losses import build_loss, reshard_states
from fastclip.losses.schedules import tau_adam_betas

from dist_utils import run_distributed
from helpers import assert_value_and_grads, randomize_tempnet_heads

TOL = dict(rtol=1e-10, atol=1e-10)
D, DATA_SIZE = 5, 16
STATE = dict(data_size=DATA_SIZE, gamma_min=0.3, gamma_decay_epochs=2)
CASES = {
    "ntxent": ("ntxent", {"temperature": 0.2}),
    "ntxent-fixed": ("ntxent", {"temperature": 0.2, "learn_temperature": False}),
    "dcl": ("dcl", {"temperature": 0.2}),
    "sogclr": ("fastclip-v1", {**STATE, "temperature": 0.2}),
    "v0": ("fastclip-v0", {**STATE, "temperature": 0.2}),
    "v3": ("fastclip-v3", {**STATE, "temperature": 0.2, "rho": 1.5}),
    "isogclr": ("fastclip-v2", {**STATE, "temperature": 0.3, "lr_tau": 0.05, "rho": 1.0}),
    "tempnet": ("fastclip-tempnet", {**STATE, "temperature": 0.3, "rho": 1.0, "embed_dim": D, "tempnet_hidden": 6}),
}
# Global batches of 6 images (2 ranks x 3, 3 ranks x 2); image 7 twice in steps 0 and 1, 4 twice in step 2.
REPEATED = [([3, 7, 12, 5, 7, 0], 0), ([7, 3, 15, 7, 12, 11], 1), ([0, 4, 3, 9, 4, 8], 2)]
# For the formulas: distinct images within a step (a repeated one keeps its last write: tested by the ranks)
DISTINCT = [([3, 7, 12, 5, 1, 0], 0), ([7, 3, 15, 2, 12, 11], 1), ([0, 4, 3, 9, 7, 8], 2)]


def make(case: str):
    name, options = CASES[case]
    loss_fn = build_loss(name, unimodal=True, **options).double()
    if name == "fastclip-tempnet":
        randomize_tempnet_heads(loss_fn)
    return loss_fn


def views(step: int, n: int):
    gen = torch.Generator().manual_seed(500 + step)
    v1 = F.normalize(torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1)
    v2 = F.normalize(v1 + 0.7 * torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1)
    return v1, v2


# --- the formulas, over the 2N views ------------------------------------------------------------------------


def anchors(v1, v2, idx):
    """Z = [view 1; view 2], each view's image index and the row of its positive (the other view)."""
    n = len(idx)
    return torch.cat([v1, v2]), idx + idx, [a + n if a < n else a - n for a in range(2 * n)]


def negatives(images, a):
    return [k for k in range(len(images)) if images[k] != images[a]]


def softmax_formula(v1, v2, idx, tau, *, decoupled):
    """NT-Xent (ℓ_a = −z_ap + log Σ_{k≠a, k not a copy} e^{z_ak}, the positive included) or DCL (without it)."""
    z, images, positive = anchors(v1, v2, idx)
    logits = z @ z.T / tau
    terms = []
    for a in range(len(images)):
        cells = negatives(images, a) + ([] if decoupled else [positive[a]])
        terms.append(torch.logsumexp(logits[a, cells], 0) - logits[a, positive[a]])
    return torch.stack(terms).mean()


def g_of(z, images, positive, a, tau):
    """g_a(τ) = 1/(2N − 2) Σ_{k∈neg(a)} exp((z_a·z_k − z_a·z_p)/τ)."""
    gaps = z[a] @ z[negatives(images, a)].T - z[a] @ z[positive[a]]
    return torch.exp(gaps / tau).sum() / (len(images) - 2)


class ImageState:
    """The per-image state of the formulas: u (and τ, Adam's m, v) by data index."""

    def __init__(self):
        self.u, self.tau, self.m, self.v = {}, {}, {}, {}

    def moved_u(self, index, g, gamma):
        """u of one view: g on the image's first visit, else (1 − γ)·u + γ·g from the image's stored u."""
        return g if index not in self.u else (1 - gamma) * self.u[index] + gamma * g


def gcl_formula(loss_fn, state, v1, v2, idx, case):
    """SogCLR (v1), v0, v3: per view a of image i, u_a = (1−γ)u_i + γ g_a; the image keeps mean(u_a) (SogCLR's
    reference); loss = mean_a g_a/(u_a+ε) (v3: τ_det·that + τ·(mean_a log(u_a+ε) + ρ))."""
    z, images, positive = anchors(v1, v2, idx)
    tau, gamma, eps = torch.exp(-loss_fn.logit_scale), loss_fn.gamma(), loss_fn.options.eps
    g = [g_of(z, images, positive, a, tau) for a in range(len(images))]
    u = [state.moved_u(images[a], g[a].detach(), gamma) for a in range(len(images))]
    surrogate = torch.stack([g[a] / (u[a] + eps) for a in range(len(images))]).mean()
    n = len(idx)
    for i in range(n):
        state.u[idx[i]] = (u[i] + u[i + n]) / 2
    if case != "v3":
        return surrogate
    log_term = torch.stack([torch.log(x + eps) for x in u]).mean() + loss_fn.options.rho
    return tau.detach() * surrogate + tau * log_term


def tau_gradient(z, images, positive, a, tau, u, eps, rho):
    """∂/∂τ [τ (log g_a(τ) + ρ)] with g → u: log(u+ε) + ρ + τ g_a'(τ)/(u+ε)."""
    tau = tau.detach().clone().requires_grad_()
    (dg,) = torch.autograd.grad(g_of(z.detach(), images, positive, a, tau), tau)
    return torch.log(u + eps) + rho + tau.detach() * dg / (u + eps)


def isogclr_formula(loss_fn, state, v1, v2, idx):
    """iSogCLR (v2): one τ_i per image for both views; u as SogCLR's; the τ step is Adam (betas 0 in epoch 0) on
    the mean of the views' τ-gradients; loss = mean_a (τ_i/(u_a+ε))·g_a(τ_i)."""
    opt, z, (_, images, positive) = loss_fn.options, torch.cat([v1, v2]), anchors(v1, v2, idx)
    gamma, n = loss_fn.gamma(), len(idx)
    tau = [torch.tensor(state.tau.get(i, opt.temperature), dtype=torch.float64) for i in images]
    g = [g_of(z, images, positive, a, tau[a]) for a in range(2 * n)]
    u = [state.moved_u(images[a], g[a].detach(), gamma) for a in range(2 * n)]
    loss = torch.stack([tau[a] / (u[a] + opt.eps) * g[a] for a in range(2 * n)]).mean()
    beta1, beta2 = tau_adam_betas(loss_fn.epoch, opt.tau_betas)
    for i in range(n):
        grads = [tau_gradient(z, images, positive, a, tau[a], u[a], opt.eps, opt.rho) for a in (i, i + n)]
        grad = ((grads[0] + grads[1]) / 2).clamp(-opt.tau_grad_clamp, opt.tau_grad_clamp)
        m = beta1 * state.m.get(idx[i], 0.0) + (1 - beta1) * grad
        v = beta2 * state.v.get(idx[i], 0.0) + (1 - beta2) * grad**2
        step = (m / (1 - beta1 ** (loss_fn.epoch + 1))) / (
            (v / (1 - beta2 ** (loss_fn.epoch + 1))).sqrt() + opt.tau_eps
        )
        state.tau[idx[i]] = float((tau[i] - opt.lr_tau * step).clamp(opt.tau_min, opt.tau_max))
        state.m[idx[i]], state.v[idx[i]], state.u[idx[i]] = m, v, (u[i] + u[i + n]) / 2
    return loss


def tempnet_formula(loss_fn, state, v1, v2, idx):
    """The temperature network: τ_a = head(view a) (one head for both views); u as SogCLR's; the encoders follow
    mean_a (τ_a/(u_a+ε))·g_a(τ_a) at fixed τ, the head mean_a τ_a·∂/∂τ_a[τ_a(log g_a + ρ)] (g → u)."""
    opt, z, (_, images, positive) = loss_fn.options, torch.cat([v1, v2]), anchors(v1, v2, idx)
    gamma, n = loss_fn.gamma(), len(idx)
    tau = loss_fn.tempnet_img(z.detach())
    fixed = tau.detach()
    g = [g_of(z, images, positive, a, fixed[a]) for a in range(2 * n)]
    u = [state.moved_u(images[a], g[a].detach(), gamma) for a in range(2 * n)]
    surrogate = torch.stack([fixed[a] / (u[a] + opt.eps) * g[a] for a in range(2 * n)]).mean()
    grads = torch.stack([tau_gradient(z, images, positive, a, fixed[a], u[a], opt.eps, opt.rho) for a in range(2 * n)])
    head = (tau * grads).mean()
    for i in range(n):
        state.u[idx[i]] = (u[i] + u[i + n]) / 2
    return surrogate + head - head.detach()


def stored_state(loss_fn):
    """The loss's per-image state by data index: u in its true scale (v2/tempnet keep u·e^−b), τ."""
    fields = loss_fn.state_dict()["_extra_state"]["fields"]
    if "log_u_img" in fields:
        return {"u": torch.exp(fields["log_u_img"]), "u_other_view": torch.exp(fields["log_u_txt"])}
    out = {
        "u": fields["u_img"] * torch.exp(fields["b_img"]),
        "u_other_view": fields["u_txt"] * torch.exp(fields["b_txt"]),
    }
    if "tau_img" in fields:
        out.update(tau=fields["tau_img"], tau_other_view=fields["tau_txt"])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_each_unimodal_loss_is_its_formula_over_three_steps(case):
    loss_fn, state = make(case), ImageState()
    for step, (indices, epoch) in enumerate(DISTINCT):
        v1, v2 = (x.requires_grad_() for x in views(step, len(indices)))
        got = loss_fn(v1, v2, torch.tensor(indices), epoch=epoch)
        name = CASES[case][0]
        if name in ("ntxent", "dcl"):
            want = softmax_formula(v1, v2, indices, torch.exp(-loss_fn.logit_scale), decoupled=name == "dcl")
        elif name == "fastclip-v2":
            want = isogclr_formula(loss_fn, state, v1, v2, indices)
        elif name == "fastclip-tempnet":
            want = tempnet_formula(loss_fn, state, v1, v2, indices)
        else:
            want = gcl_formula(loss_fn, state, v1, v2, indices, case)
        params = [p for p in loss_fn.parameters() if p.requires_grad]
        assert_value_and_grads(got, want, (v1, v2, *params), **TOL)
    if state.u:  # one u (and τ) per image, the same in both views' fields
        stored = stored_state(loss_fn)
        for index, u in state.u.items():
            torch.testing.assert_close(stored["u"][index], u, **TOL, msg=f"{case} u of image {index}")
            torch.testing.assert_close(stored["u_other_view"][index], u, **TOL)
        for index, tau in state.tau.items():
            torch.testing.assert_close(stored["tau"][index].item(), tau, **TOL, msg=f"{case} τ of image {index}")
            assert stored["tau_other_view"][index] == stored["tau"][index]


# --- 1 process = 2 = 3 ranks, resume -----------------------------------------------------------------------


def run_steps(loss_fn, rows: slice, steps=REPEATED, first: int = 0):
    records = []
    for step, (indices, epoch) in enumerate(steps, start=first):
        v1, v2 = (x[rows].clone().requires_grad_() for x in views(step, len(indices)))
        for p in loss_fn.parameters():
            p.grad = None
        loss = loss_fn(v1, v2, torch.tensor(indices)[rows], epoch=epoch)
        loss.backward()
        params = {n: p.grad.clone() for n, p in loss_fn.named_parameters() if p.grad is not None}
        records.append({"loss": loss.detach(), "v1": v1.grad, "v2": v2.grad, "params": params,
                        "objective": loss_fn.metrics["objective"]})  # fmt: skip
    return {"steps": records, "state": loss_fn.state_dict().get("_extra_state")}


def ranks_run(rank, world_size):
    b = len(REPEATED[0][0]) // world_size
    return {case: run_steps(make(case), slice(rank * b, (rank + 1) * b)) for case in CASES}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_equal_one_process(world_size):
    per_rank = run_distributed(ranks_run, world_size)
    for case in CASES:
        single = run_steps(make(case), slice(None))
        for step, want in enumerate(single["steps"]):
            got = [r[case]["steps"][step] for r in per_rank]
            where = f"{case} step {step} on {world_size} ranks"
            for rec in got:
                torch.testing.assert_close(rec["loss"], want["loss"], **TOL, msg=f"{where} value")
                torch.testing.assert_close(rec["objective"], want["objective"], **TOL, msg=f"{where} objective")
            for key in ("v1", "v2"):  # K × this rank's share; DDP's average divides by K
                stacked = torch.cat([rec[key] for rec in got]) / world_size
                torch.testing.assert_close(stacked, want[key], **TOL, msg=f"{where} {key} grad")
            for name, value in want["params"].items():
                mean = sum(rec["params"][name] for rec in got) / world_size
                torch.testing.assert_close(mean, value, **TOL, msg=f"{where} {name} grad")
        if single["state"] is not None:
            merged = reshard_states([r[case]["state"] for r in per_rank], 1)[0]
            assert torch.equal(merged["seen"], single["state"]["seen"]), case
            for field, value in single["state"]["fields"].items():
                torch.testing.assert_close(merged["fields"][field], value, **TOL, msg=f"{case} state {field}")


@pytest.mark.parametrize("case", ["sogclr", "isogclr", "tempnet"])
def test_a_resumed_state_continues_exactly(case):
    """Two steps, state_dict into a new loss (resharded from 2 ranks' files to 1), the third: bitwise the same."""
    straight = run_steps(make(case), slice(None))
    first = make(case)
    for step, (indices, epoch) in enumerate(REPEATED[:2]):
        first(*views(step, len(indices)), torch.tensor(indices), epoch=epoch)
    saved = first.state_dict()
    halves = reshard_states([saved["_extra_state"]], 2)  # as two ranks' files, merged back on load
    saved["_extra_state"] = reshard_states(halves, 1)[0]
    resumed = make(case)
    resumed.load_state_dict(saved)
    third = run_steps(resumed, slice(None), REPEATED[2:], first=2)["steps"][0]
    want = straight["steps"][2]
    assert torch.equal(third["loss"], want["loss"]) and torch.equal(third["v1"], want["v1"]), case
    assert torch.equal(third["v2"], want["v2"]), case


def test_the_state_is_one_per_image_shared_by_its_views():
    loss_fn = make("isogclr")
    loss_fn(*views(0, 6), torch.tensor(DISTINCT[0][0]), epoch=0)
    fields = loss_fn.state_dict()["_extra_state"]["fields"]
    for name in ("u", "tau", "b", "m", "v"):
        assert torch.equal(fields[f"{name}_img"], fields[f"{name}_txt"]), name
    assert not torch.equal(fields["tau_img"][DISTINCT[0][0]], torch.full((6,), 0.3, dtype=torch.float64))


def test_ntxent_in_one_process_is_simclr_written_in_matrix_form():
    """SimCLR's NT-Xent in its usual matrix form (cross-entropy over the 2N × 2N similarities, self masked)."""
    v1, v2 = (x.requires_grad_() for x in views(7, 5))
    loss_fn = build_loss("ntxent", unimodal=True, temperature=0.1, learn_temperature=False).double()
    got = loss_fn(v1, v2, torch.arange(5))
    z = torch.cat([v1, v2])
    tau = torch.exp(-loss_fn.logit_scale)  # (0.1 as logit_scale holds it)
    logits = (z @ z.T / tau).masked_fill(torch.eye(10, dtype=torch.bool), -math.inf)
    want = F.cross_entropy(logits, torch.cat([torch.arange(5, 10), torch.arange(5)]))
    assert_value_and_grads(got, want, (v1, v2), **TOL)


@pytest.mark.parametrize(
    ("name", "options", "words"),
    [
        ("openclip", {}, "no unimodal form"),
        ("siglip", {}, "no unimodal form"),
        ("dcl", {"queue_size": 4}, "queue_size is not implemented for the unimodal form"),
        ("fastclip-v3", {"separate_temperatures": True}, "separate_temperatures is not implemented"),
        ("fastclip-v1", {"impl": "fused"}, "autograd implementation only"),
        ("dcl", {"unimodal": "yes"}, "unimodal must be true or false"),
    ],
)
def test_an_option_without_a_unimodal_form_is_one_error_naming_it(name, options, words):
    options = {"unimodal": True, **options}
    if name.startswith("fastclip"):
        options["data_size"] = 8
    with pytest.raises(ValueError, match=words):
        build_loss(name, **options)
