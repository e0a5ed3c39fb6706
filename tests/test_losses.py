"""Single-process tests of fastclip.losses (float64): gradients against the stated objectives written out
directly here, options, schedules, input validation, state save/load and resharding."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fastclip.losses import (
    LossInputError,
    NonFiniteFeaturesError,
    build_loss,
    reshard_for_rank,
    reshard_states,
    validation,
)
from fastclip.losses.schedules import GammaSchedule
from fastclip.losses.sharded_state import ShardedSampleState, last_occurrence, shard_size

from helpers import REPO, features, grads, run_loss

TOL = dict(rtol=1e-10, atol=1e-10)


# --- the stated objectives, written directly on the full N x N similarity matrix ------------------------------


def direct_g(e1, e2, scale_img, scale_txt):
    """g1_i, g2_i of every anchor of the batch; scales are scalars or per-anchor [N] tensors."""
    n = e1.shape[0]
    sim = e1 @ e2.T  # sim[i, k] = e1_i . e2_k
    pos = torch.diagonal(sim)
    off_diagonal = ~torch.eye(n, dtype=torch.bool)
    d_img = (sim - pos[:, None]) * torch.as_tensor(scale_img).reshape(-1, 1)
    d_txt = (sim.T - pos[:, None]) * torch.as_tensor(scale_txt).reshape(-1, 1)
    g1 = (torch.exp(d_img) * off_diagonal).sum(1) / (n - 1)
    g2 = (torch.exp(d_txt) * off_diagonal).sum(1) / (n - 1)
    return g1, g2


def gcl_objective(e1, e2, logit_scale, eps=1e-14):
    s = logit_scale.exp()
    g1, g2 = direct_g(e1, e2, s, s)
    return (torch.log(eps + g1) + torch.log(eps + g2)).sum() / (2 * e1.shape[0])


N, D = 6, 5
IDX = torch.tensor([3, 0, 9, 4, 7, 1])


@pytest.mark.parametrize("name", ["fastclip-v0", "fastclip-v1"])
def test_gcl_gradient_equals_direct_objective(name):
    e1, e2 = features(N, D, seed=1)
    loss_fn = build_loss(name, data_size=10, temperature=0.1).double()
    _, g_e1, g_e2, g = run_loss(loss_fn, e1, e2, IDX)
    g_theta = g.get("logit_scale")
    theta = loss_fn.logit_scale.detach().clone().requires_grad_()  # log(1/0.1), as stored
    want = grads(gcl_objective(e1, e2, theta), e1, e2, theta)
    torch.testing.assert_close(g_e1, want[0], **TOL)
    torch.testing.assert_close(g_e2, want[1], **TOL)
    if name == "fastclip-v0":
        torch.testing.assert_close(g_theta, want[2], **TOL)
        ref = build_loss(name, data_size=10, temperature=0.1, compat="reference").double()
        _, r_e1, _, r = run_loss(ref, e1, e2, IDX)
        r_theta = r["logit_scale"]
        torch.testing.assert_close(r_e1, want[0], **TOL)
        torch.testing.assert_close(r_theta, 2 * want[2], **TOL)  # the reference's doubled τ-gradient
    else:
        assert g_theta is None and not loss_fn.logit_scale.requires_grad


def test_v3_gradient_equals_rgcl_g_objective_and_reference_doubles_the_g_term():
    e1, e2 = features(N, D, seed=2)
    rho = 6.5
    loss_fn = build_loss("fastclip-v3", data_size=10, temperature=0.1, rho=rho).double()
    theta = loss_fn.logit_scale.detach().clone().requires_grad_()
    tau = torch.exp(-theta)
    objective = tau * gcl_objective(e1, e2, theta) + rho * tau  # τ(1/2N)Σ(log(ε+g1)+log(ε+g2)) + ρτ
    want = grads(objective, e1, e2, theta)
    loss, g_e1, g_e2, g = run_loss(loss_fn, e1, e2, IDX)
    g_theta = g["logit_scale"]
    torch.testing.assert_close(g_e1, want[0], **TOL)
    torch.testing.assert_close(g_e2, want[1], **TOL)
    torch.testing.assert_close(g_theta, want[2], **TOL)
    torch.testing.assert_close(loss_fn.metrics["objective"], objective.detach(), **TOL)

    # compat="reference": the g-term of the τ-gradient counted twice, encoders unchanged.
    g_term = grads(tau.detach() * gcl_objective(e1, e2, theta), theta)[0]
    ref = build_loss("fastclip-v3", data_size=10, temperature=0.1, rho=rho, compat="reference").double()
    _, r_e1, r_e2, r = run_loss(ref, e1, e2, IDX)
    r_theta = r["logit_scale"]
    torch.testing.assert_close(r_e1, want[0], **TOL)
    torch.testing.assert_close(r_e2, want[1], **TOL)
    torch.testing.assert_close(r_theta, want[2] + g_term, **TOL)
    assert abs(float(g_term)) > 1e-3  # the two modes really differ here


def test_v3_constant_temperature_has_the_learnable_ones_value_and_feature_gradients():
    # With learn_temperature false the outer τ-term is added outside the surrogate's Function (it has no gradient
    # to carry): the same loss value and encoder gradients as the learnable v3, and no τ-gradient.
    e1, e2 = features(N, D, seed=5)
    rho = 2.5
    learnable = build_loss("fastclip-v3", data_size=10, temperature=0.1, rho=rho).double()
    constant = build_loss("fastclip-v3", data_size=10, temperature=0.1, rho=rho, learn_temperature=False).double()
    loss, g_e1, g_e2, g = run_loss(learnable, e1, e2, IDX)
    c_loss, c_e1, c_e2, c = run_loss(constant, e1, e2, IDX)
    # the reported loss is τ·S + τ·(½·mean log(u+ε) + ρ); on a first visit u = g, so S = ½·mean(g1/(g1+ε) + g2/(g2+ε))
    # and the log term is the GCL objective
    eps, s = learnable.options.eps, learnable.logit_scale.detach().exp()
    g1, g2 = direct_g(e1.detach(), e2.detach(), s, s)
    surrogate = 0.5 * (g1 / (g1 + eps) + g2 / (g2 + eps)).mean()
    direct = (surrogate + gcl_objective(e1.detach(), e2.detach(), s.log(), eps=eps) + rho) / s  # τ: 0.1 in float32
    torch.testing.assert_close(c_loss, loss, **TOL)
    torch.testing.assert_close(c_loss, direct.detach(), **TOL)
    torch.testing.assert_close(constant.metrics["surrogate"], surrogate, **TOL)
    torch.testing.assert_close(c_e1, g_e1, **TOL)
    torch.testing.assert_close(c_e2, g_e2, **TOL)
    assert g["logit_scale"] is not None and c.get("logit_scale") is None


def v2_with_taus(tau_img, tau_txt, **options):
    loss_fn = build_loss("fastclip-v2", data_size=10, state_dtype=torch.float64, **options).double()
    state = loss_fn.state_dict()
    fields = state["_extra_state"]["fields"]
    fields["tau_img"][IDX] = tau_img  # world size 1: slot == index
    fields["tau_txt"][IDX] = tau_txt
    loss_fn.load_state_dict(state)
    return loss_fn


@pytest.mark.parametrize("compat", ["faithful", "reference"])
def test_v2_gradient_state_and_tau_update(compat):
    e1, e2 = features(N, D, seed=3)
    gen = torch.Generator().manual_seed(4)
    tau_img = 0.2 + 0.6 * torch.rand(N, generator=gen, dtype=torch.float64)
    tau_txt = 0.2 + 0.6 * torch.rand(N, generator=gen, dtype=torch.float64)
    rho, lr_tau, tau_eps = 0.5, 0.05, 1.0  # a large tau_eps makes the Adam step depend on the gradient's value
    loss_fn = v2_with_taus(tau_img, tau_txt, rho=rho, lr_tau=lr_tau, tau_eps=tau_eps, compat=compat)
    _, g_e1, g_e2, _ = run_loss(loss_fn, e1, e2, IDX)

    g1, g2 = direct_g(e1, e2, 1 / tau_img, 1 / tau_txt)
    weight_img, weight_txt = (tau_img, tau_txt) if compat == "faithful" else (1.0, 1.0)
    objective = (weight_img * torch.log(1e-14 + g1) + weight_txt * torch.log(1e-14 + g2)).sum() / (2 * N)
    want = grads(objective, e1, e2)
    torch.testing.assert_close(g_e1, want[0], **TOL)
    torch.testing.assert_close(g_e2, want[1], **TOL)

    # τ-gradient: ∂/∂τ_i [τ_i (log g_i(τ_i) + ρ)], then one epoch-0 Adam step (betas 0: m = grad, v = grad²).
    saved = loss_fn.state_dict()["_extra_state"]["fields"]
    e1d, e2d = e1.detach(), e2.detach()
    for name, tau0, column in (("img", tau_img, 0), ("txt", tau_txt, 1)):
        tau = tau0.clone().requires_grad_()
        g = direct_g(e1d, e2d, 1 / tau, 1 / tau)[column]
        grad = grads((tau * (torch.log(g) + rho)).sum(), tau)[0]
        assert grad.abs().max() < 5.0  # not clamped, so the value itself is tested
        expected = (tau0 - lr_tau * grad / (grad.abs() + tau_eps)).clamp(0.01, 1.0)
        torch.testing.assert_close(saved[f"tau_{name}"][IDX], expected, **TOL)
        # u and the bound b in their shifted scale: b = max(0, max_{k≠i} d_ik), u = g·exp(-b)
        sim = e1d @ e2d.T if name == "img" else e2d @ e1d.T
        diff = (sim - torch.diagonal(sim)[:, None]) / tau0[:, None]
        bound = diff.masked_fill(torch.eye(N, dtype=torch.bool), -math.inf).amax(1).clamp(min=0.0)
        torch.testing.assert_close(saved[f"b_{name}"][IDX], bound, **TOL)
        torch.testing.assert_close(saved[f"u_{name}"][IDX], g.detach() * torch.exp(-bound), **TOL)


def test_openclip_equals_clip_cross_entropy():
    e1, e2 = features(N, D, seed=5)
    loss_fn = build_loss("openclip").double()
    theta = loss_fn.logit_scale.detach().clone().requires_grad_()
    s = theta.exp()
    labels = torch.arange(N)
    clip = 0.5 * (F.cross_entropy(s * e1 @ e2.T, labels) + F.cross_entropy(s * e2 @ e1.T, labels))
    want = grads(clip, e1, e2, theta)
    loss, g_e1, g_e2, g = run_loss(loss_fn, e1, e2, None)
    g_theta = g["logit_scale"]
    torch.testing.assert_close(loss, clip.detach(), **TOL)
    for got, expected in zip((g_e1, g_e2, g_theta), want):
        torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(loss_fn.metrics["objective"], clip.detach(), **TOL)
    assert loss_fn.comm_bytes["total"] == 0


def direct_g_distinct(e1, e2, scale, idx):
    """g1_i over the negatives whose data index differs from the anchor's (a repeated sample's copies are not
    its negatives), normalised by N - 1 as always."""
    n = e1.shape[0]
    sim = e1 @ e2.T
    negative = idx[:, None] != idx[None, :]
    g1 = (torch.exp((sim - torch.diagonal(sim)[:, None]) * scale) * negative).sum(1) / (n - 1)
    return g1


def test_u_moving_average_and_repeated_index_keeps_last_occurrence():
    e1, e2 = features(N, D, seed=6)
    loss_fn = build_loss("fastclip-v1", data_size=10, temperature=0.2, gamma_min=0.3, gamma_decay_epochs=2).double()
    idx = torch.tensor([3, 0, 3, 4, 7, 1])  # 3 twice: the later row (2) wins
    loss_fn(e1, e2, idx, epoch=0)
    s = loss_fn.logit_scale.detach().exp()
    g1 = direct_g_distinct(e1.detach(), e2.detach(), s, idx)
    u = loss_fn.state_dict()["_extra_state"]["fields"]["log_u_img"].exp()  # the state keeps log u
    torch.testing.assert_close(u[[0, 3, 4, 7, 1]], g1[[1, 2, 3, 4, 5]], **TOL)
    e1b, e2b = features(N, D, seed=7)
    loss_fn(e1b, e2b, idx, epoch=1)
    gamma = GammaSchedule("cosine", 0.3, 2)(1)
    g1b = direct_g_distinct(e1b.detach(), e2b.detach(), s, idx)
    u2 = loss_fn.state_dict()["_extra_state"]["fields"]["log_u_img"].exp()
    torch.testing.assert_close(u2[3], (1 - gamma) * u[3] + gamma * g1b[2], **TOL)
    assert loss_fn.metrics["gamma"].item() == pytest.approx(0.65)


@pytest.mark.parametrize("name", ["fastclip-v1", "fastclip-v3", "fastclip-v2"])
def test_repeated_index_copies_are_not_negatives(name):
    """A sample twice in one global batch: the copies do not count each other as negatives, so the stored u
    is what a batch holding the sample once gives for that anchor (not ~(N-1+1)/(N-1)·e^0 higher), and the
    encoder gradient is that of the objective with same-index pairs left out."""
    e1, e2 = features(N, D, seed=14)
    e2 = e2.detach().clone()
    e1 = e1.detach().clone()
    e1[4], e2[4] = e1[1], e2[1]  # row 4 is a copy of row 1's pair
    idx = torch.tensor([0, 1, 2, 3, 1, 5])
    extra = {"rho": 1.0} if name != "fastclip-v1" else {}
    loss_fn = build_loss(name, data_size=10, temperature=0.2, **extra).double()
    loss_fn(e1, e2, idx)
    fields = loss_fn.state_dict()["_extra_state"]["fields"]
    scale = getattr(loss_fn, "logit_scale", None)
    s = torch.tensor(5.0, dtype=torch.float64) if scale is None else scale.detach().exp()
    g1 = direct_g_distinct(e1, e2, s, idx)
    if name == "fastclip-v2":
        u = fields["u_img"] * torch.exp(fields["b_img"])  # v2 keeps u shifted by its bound b
    else:
        u = fields["log_u_img"].exp()
    torch.testing.assert_close(u[[0, 1, 2, 3, 5]], g1[[0, 4, 2, 3, 5]], **TOL)
    # with the same-index pair included (the old behaviour) u[1] would be larger by exp(0)/(N-1)
    assert (u[1] - g1[4]).abs() < 1e-12 < 1 / (N - 1)


@pytest.mark.parametrize("name", ["fastclip-v3", "fastclip-v2", "fastclip-tempnet"])
def test_exclusion_by_positive_cells_equals_the_mask(name, monkeypatch):
    """With CPU indices and no repeated index the excluded cells are written by position (no [B, N] mask): the
    loss, the gradients and the per-sample state are bitwise those of the mask that a CUDA step builds; with a
    repeated index the mask is built on the CPU too."""
    from fastclip.losses import batch as batch_module

    extra = {"rho": 1.0, "temperature": 0.2} if name == "fastclip-v3" else {"rho": 1.0}
    if name == "fastclip-tempnet":
        extra["embed_dim"] = D
    for idx in (torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 3, 1, 5])):
        runs = []
        for on_host in (True, False):
            monkeypatch.setattr(batch_module, "CHECK_REPEATS_ON_HOST", on_host)
            torch.manual_seed(0)
            loss_fn = build_loss(name, data_size=10, **extra)
            e1, e2 = (f.detach().float() for f in features(N, D, seed=21))
            out = []
            for epoch in (0, 1):  # the second call reads the state the first wrote
                loss, g1, g2, g = run_loss(loss_fn, e1, e2, idx, epoch=epoch)
                out += [loss, g1, g2, *g.values()]
            out += [v for v in loss_fn.state_dict()["_extra_state"]["fields"].values()]
            runs.append(out)
        for got, want in zip(*runs):
            assert torch.equal(got, want)


def test_same_sample_cells_reads_indices_on_the_host_only_on_the_cpu(monkeypatch):
    """CPU indices without a repeat: the positive cells by position; with a repeat, or with the check off, the mask.
    Indices on another device (meta here, CUDA in a run) always get the mask, and no unique (a host sync there)
    is dispatched for them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastclip.losses import batch as batch_module
    from fastclip.losses.batch import GlobalBatch

    def batch(indices, rank=1, device="cpu"):
        local = indices[rank * 3 : rank * 3 + 3]
        feats = torch.zeros(3, 4, device=device)
        every = torch.zeros(2, 6, 4, device=device)  # (text, image) candidates
        return GlobalBatch(feats, feats, local.to(device), every, indices.to(device), rank, 2)

    unique, repeated = torch.tensor([5, 1, 7, 2, 9, 4]), torch.tensor([5, 1, 7, 2, 5, 4])
    # the state's locate() skips its search for repeated indices exactly when this says False
    assert batch(unique).indices_repeat() is False and batch(repeated).indices_repeat() is True
    assert batch(unique, device="meta").indices_repeat() is None
    cells = batch(unique).same_sample_cells()
    assert isinstance(cells, tuple) and [c.tolist() for c in cells] == [[0, 1, 2], [3, 4, 5]]
    mask = batch(repeated).same_sample_cells()
    assert mask.dtype == torch.bool and mask.nonzero().tolist() == [[0, 3], [1, 0], [1, 4], [2, 5]]
    monkeypatch.setattr(batch_module, "CHECK_REPEATS_ON_HOST", False)
    assert batch(unique).same_sample_cells().dtype == torch.bool and batch(unique).indices_repeat() is None
    monkeypatch.setattr(batch_module, "CHECK_REPEATS_ON_HOST", True)
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops():
        on_meta = batch(unique, device="meta").same_sample_cells()
    assert on_meta.dtype == torch.bool and on_meta.shape == (3, 6) and not any("unique" in op for op in ops)


def test_gamma_schedule():
    cosine = GammaSchedule("cosine", gamma_min=0.2, decay_epochs=4)
    assert cosine(0) == 1.0 and cosine(4) == cosine(9) == pytest.approx(0.2)
    assert cosine(2) == pytest.approx(0.2 + 0.5 * 0.8 * (1 + math.cos(math.pi / 2)))
    assert GammaSchedule("constant", gamma_min=0.3)(1) == 0.3
    # its values are checked once, as loss options
    with pytest.raises(ValueError, match="gamma_schedule"):
        build_loss("fastclip-v3", data_size=10, gamma_schedule="linear")
    for gamma_min in (0, 1.5):
        with pytest.raises(ValueError) as e:
            build_loss("fastclip-v1", data_size=10, gamma_min=gamma_min)
        assert str(e.value) == f"loss option gamma_min must be in (0, 1], got {gamma_min!r}"


def test_build_loss_options():
    with pytest.raises(TypeError, match="'rho'"):
        build_loss("fastclip-v0", data_size=10, rho=1.0)
    with pytest.raises(TypeError, match="'lr_tau'"):
        build_loss("openclip", lr_tau=0.1)
    with pytest.raises(TypeError, match="data_size"):
        build_loss("fastclip-v3")
    with pytest.raises(ValueError, match="compat"):
        build_loss("fastclip-v3", data_size=10, compat="exact")
    with pytest.raises(ValueError, match="unknown loss"):
        build_loss("fastclip-v9", data_size=10)
    loss_fn = build_loss("fastclip-v3", data_size=10, rho=None, temperature=0.05)  # None = default
    assert loss_fn.rho == 8.0 and loss_fn.temperature().item() == pytest.approx(0.05)
    assert loss_fn.tau_param_names() == ["logit_scale"]
    assert build_loss("fastclip-v2", data_size=10).temperature() is None
    with torch.no_grad():
        loss_fn.logit_scale.fill_(10.0)
    loss_fn.clamp_()
    assert loss_fn.logit_scale.item() == pytest.approx(math.log(100))


@pytest.mark.parametrize(
    "name, options, said",
    [
        ("fastclip-v3", {"separate_temperatures": "no"}, "separate_temperatures must be true or false, got 'no'"),
        ("fastclip-v3", {"rho": float("nan")}, "rho must be a finite number, got nan"),
        ("fastclip-v2", {"rho": float("inf")}, "rho must be a finite number, got inf"),
        ("fastclip-v3", {"gamma_min": "0.2"}, "gamma_min must be a finite number, got '0.2'"),
        ("fastclip-v3", {"gamma_decay_epochs": "18"}, "gamma_decay_epochs must be an integer >= 0, got '18'"),
        ("fastclip-v3", {"eps": "1e-14"}, "eps must be a number >= 0, got '1e-14'"),
        ("openclip", {"temperature": True}, "temperature must be a positive number, got True"),
        ("openclip", {"learn_temperature": 0}, "learn_temperature must be true or false, got 0"),
        ("fastclip-v0", {"learn_temperature": "false"}, "learn_temperature must be true or false, got 'false'"),
        ("siglip", {"learn_bias": "no"}, "learn_bias must be true or false, got 'no'"),
        ("fastclip-v2", {"tau_betas": 0.9}, "tau_betas must be two numbers in [0, 1), got 0.9"),
        ("fastclip-v2", {"tau_min": 0.5, "tau_max": 0.1}, "tau_min=0.5 is above tau_max=0.1"),
        ("fastclip-tempnet", {}, "embed_dim is required: the towers' feature dimension d (embed_dim)"),
        ("fastclip-v3", {"state_device": "gpu0"}, "state_device must be a device, got 'gpu0'"),
    ],
)
def test_an_option_of_the_wrong_kind_is_named(name, options, said):
    """A string, a bool where a number goes (or the reverse), NaN: one ValueError naming the option, not a value
    silently taken (True as τ 1.0, "no" as true) nor a TypeError from deep inside."""
    size = {} if name in ("openclip", "siglip") else {"data_size": 10}
    with pytest.raises(ValueError) as e:
        build_loss(name, **size, **options)
    assert str(e.value) == f"loss option {said}"


def test_indices_that_are_not_a_tensor():
    e1, e2 = features(N, D, seed=3)
    for name in ("openclip", "siglip"):  # they take no indices: whatever is passed is left alone
        assert torch.isfinite(build_loss(name).double()(e1, e2, list(range(N))))
    with pytest.raises(LossInputError, match=r"got none or not a tensor \(torch.as_tensor\)$"):
        build_loss("fastclip-v3", data_size=10).double()(e1, e2, list(range(N)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_a_cuda_state_device_without_cuda_is_said_when_the_loss_is_built():
    with pytest.raises(ValueError, match="state_device is 'cuda' but CUDA is not available here"):
        build_loss("fastclip-v3", data_size=10, state_device="cuda")


def test_a_numpy_data_size_is_taken():
    import numpy as np

    assert build_loss("fastclip-v3", data_size=np.int64(10)).options.data_size == 10


@pytest.mark.parametrize("name", ["dcl", "fastclip-v1", "fastclip-v3", "openclip"])
def test_a_global_batch_of_one_sample_has_no_negatives_and_is_refused(name):
    """Every row one index (or one group): no row has a negative; dcl returned -inf, v1 0 and v3 a number, silently.
    The state is left as it was. Where negatives come from elsewhere, or none are needed, it is no error: a feature
    queue's entries, siglip; nor in eval mode (a validation batch of one image and its captions: the value
    is the loss's, -inf for dcl)."""
    e1, e2 = features(N, D, seed=8)
    loss_fn = build_loss(name, **({} if name == "openclip" else {"data_size": 10})).double()
    one = torch.full((N,), 3)
    call = (lambda: loss_fn(e1, e2, groups=one)) if name == "openclip" else (lambda: loss_fn(e1, e2, one))
    before = str(loss_fn.state_dict())
    with pytest.raises(LossInputError, match=f"all {N} rows of the global batch are one sample .* no row has a "
                       "negative"):  # fmt: skip
        call()
    assert str(loss_fn.state_dict()) == before
    assert math.isfinite(loss_fn(e1, e2, IDX).item())  # two samples are enough
    loss_fn.eval()
    call()  # checked in training mode only
    queued = build_loss("dcl", data_size=10, queue_size=8).double()
    queued(e1, e2, IDX)  # the queue now holds samples 0..5
    assert math.isfinite(queued(e1[:2], e2[:2], torch.tensor([9, 9])).item())
    siglip = build_loss("siglip").double()
    assert math.isfinite(siglip(e1, e2, groups=one).item())
    single = build_loss("openclip").double()  # one pair: 0 with no gradient, taken silently before
    with pytest.raises(LossInputError, match="global batch has 1 samples; this loss needs at least 2"):
        single(e1[:1], e2[:1])


def test_features_that_are_not_l2_normalised_are_refused_naming_the_row():
    """The losses take L2-normalised rows; a forgotten F.normalize gave a number that meant nothing (atanh clamps
    every |cos| > 1), silently. The check rides in the value words (no extra sync): a NaN row is still said first
    (the trainer skips such a step), and bf16's rounding of a normalised row passes."""
    e1, e2 = features(N, D, seed=8)
    for name in ("fastclip-v3", "openclip", "dcl", "siglip"):
        loss_fn = build_loss(name, **({"data_size": 10} if name in ("fastclip-v3", "dcl") else {})).double()
        scaled = e2.clone()
        scaled[4] *= 1.5
        with pytest.raises(LossInputError, match=r"rank 0: text_features row 4 is not L2-normalised .*F\.normalize"):
            loss_fn(e1, scaled, IDX)
        scaled[2, 0] = float("nan")
        with pytest.raises(NonFiniteFeaturesError, match="text_features has non-finite values .* first in row 2"):
            loss_fn(e1, scaled, IDX)
    loss_fn = build_loss("fastclip-v3", data_size=10)
    assert math.isfinite(loss_fn(e1.bfloat16(), e2.bfloat16(), IDX).item())
    nearly = e1 * 1.04  # inside the tolerance (0.05)
    assert math.isfinite(build_loss("openclip")(nearly.float(), e2.float()).item())


def test_deferred_checks_keep_a_row_not_normalised_apart_from_a_nan_row():
    """Deferred mode (the trainer's): a row not L2-normalised shared the non-finite kind, so the NaN guard's
    check_inputs(features=False) forgot it, and the trainer said it as a bad index ("re-run fastclip data scan")."""
    from fastclip.losses import FeaturesNotNormalisedError
    from fastclip.train.errors import TrainingError
    from fastclip.train.guards import check_loss_inputs

    e1, e2 = features(N, D, seed=8)
    loss_fn = build_loss("fastclip-v3", data_size=10, validate="deferred").double()
    nan, zero = e1.clone(), e1.clone()
    nan[1, 0] = float("nan")
    zero[3] = 0.0  # what F.normalize gives for a tower's zero output
    loss_fn(e1, e2, IDX)  # (the first call's handshake reads its words at once)
    loss_fn(nan, e2, IDX)
    loss_fn(zero, e2, IDX)
    with pytest.raises(FeaturesNotNormalisedError, match="loss call 3: rank 0: image_features row 3 is not L2-norm"):
        loss_fn.check_inputs(features=False)  # the NaN call is forgiven (the guard skipped it), this one is not
    loss_fn(nan, e2, IDX)
    with pytest.raises(NonFiniteFeaturesError, match="loss call 4: rank 0: image_features has non-finite"):
        loss_fn.check_inputs()  # a NaN call alone is said as such (fatal errors come first: index, then norm)
    loss_fn(zero, e2, IDX)
    with pytest.raises(TrainingError, match="step 7: the loss refused its inputs: .*row 3 is not L2-normalised") as e:
        check_loss_inputs(loss_fn, 7)
    assert "fastclip data scan" not in str(e.value)


def test_a_launchers_process_without_a_process_group_is_refused(monkeypatch):
    """Under torchrun with init_process_group forgotten, each rank trained on its own half batch with a full copy
    of the per-sample state, silently."""
    e1, e2 = features(N, D, seed=8)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 .* torch.distributed is not initialised: call torch.distri"):
        build_loss("fastclip-v3", data_size=10)(e1, e2, IDX)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert math.isfinite(build_loss("fastclip-v3", data_size=10)(e1, e2, IDX).item())


def test_the_state_of_another_objective_is_refused_with_its_fields_as_saved():
    """A v2 state loaded into v3 was converted as an old v3 state first: every field got a log_ prefix and a log."""
    e1, e2 = features(N, D, seed=8)
    v2 = build_loss("fastclip-v2", data_size=10)
    v2(e1.float(), e2.float(), IDX)
    with pytest.raises(KeyError, match=r"fastclip-v3: sample state fields \['b_img', .*'u_img', .* do not match this "
                       r"loss's \['log_u_img', 'log_u_txt'\]: it was saved by another objective"):  # fmt: skip
        build_loss("fastclip-v3", data_size=10).load_state_dict(v2.state_dict())


def test_bad_input_single_process():
    e1, e2 = features(N, D, seed=8)
    loss_fn = build_loss("fastclip-v3", data_size=10).double()
    cases = [
        ((e1, e2, torch.tensor([0, 1, 2, 3, 4, 10])), LossInputError, r"indices\[5\] = 10 is out of range"),
        ((e1, e2, torch.tensor([0, 1, -2, 3, 4, 5])), LossInputError, r"indices\[2\] = -2"),
        ((e1, e2, IDX.double()), LossInputError, "integer"),
        ((e1, e2, IDX[:5]), LossInputError, "length B=6"),
        ((e1, e2, None), LossInputError, "indices"),
        ((e1[:, :, None], e2, IDX), LossInputError, "image_features must be a 2-D"),
        ((e1, e2[:, :4], IDX), LossInputError, "shapes differ"),
        ((e1, e2.float(), IDX), LossInputError, "dtypes differ"),
        ((e1, e2.long(), IDX), LossInputError, "text_features must be floating point"),
        ((e1[:1], e2[:1], IDX[:1]), LossInputError, "at least 2"),
    ]
    for args, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            loss_fn(*args)
    bad = e1.detach().clone()
    bad[4, 1] = float("nan")
    with pytest.raises(NonFiniteFeaturesError, match="image_features has non-finite values.*row 4"):
        loss_fn(bad, e2, IDX)


def test_state_dict_round_trip_and_wrong_world_size():
    e1, e2 = features(N, D, seed=9)
    loss_fn = build_loss("fastclip-v2", data_size=10).double()
    loss_fn(e1, e2, IDX)
    saved = loss_fn.state_dict()
    assert saved["_extra_state"]["format"] == "fastclip-sample-state/1"
    assert saved["_extra_state"]["seen"].sum() == N
    fresh = build_loss("fastclip-v2", data_size=10).double()
    fresh.load_state_dict(saved)
    for name, value in fresh.state_dict()["_extra_state"]["fields"].items():
        torch.testing.assert_close(value, saved["_extra_state"]["fields"][name], rtol=0, atol=0)
    as_if_two_ranks = reshard_states([saved], 2)[0]
    # rank 0 of 2's state in a process without a group: the group may be what is missing (it said only: reshard)
    with pytest.raises(ValueError, match="saved by rank 0 of 2 and this process has no process group yet: call "
                       "torch.distributed.init_process_group before loading it, or, .*reshard first"):  # fmt: skip
        build_loss("fastclip-v2", data_size=10).load_state_dict(as_if_two_ranks)
    # another data_size: resharding cannot help, and the message does not send the user there
    with pytest.raises(ValueError) as e:
        build_loss("fastclip-v2", data_size=12).load_state_dict(saved)
    assert str(e.value) == (
        "sample state was saved for data_size=10 but this loss has data_size=12: build it with data_size=10 (the "
        "data it was trained on), or start its state afresh"
    )
    with pytest.raises(TypeError, match="pass a list, got a generator"):
        reshard_states((s for s in [saved]), 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"new_world_size must be an integer >= 1, got {bad!r}"):
            reshard_states([saved], bad)


def test_last_occurrence():
    idx = torch.tensor([5, 2, 5, 9, 2, 5, 1])
    assert last_occurrence(idx).tolist() == [False, False, False, True, True, True, True]


def random_shards(data_size, world_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shards = []
    for rank in range(world_size):
        state = ShardedSampleState(
            data_size=data_size, world_size=world_size, rank=rank, fields={"u_img": 0.0, "u_txt": 0.0}
        ).state_dict()
        n = shard_size(data_size, world_size, rank)
        state["fields"] = {k: torch.rand(n, generator=gen) for k in state["fields"]}
        state["seen"] = torch.rand(n, generator=gen) > 0.5
        shards.append(state)
    return shards


def assemble(shards):
    """Global view for the test only (data_size is small here)."""
    k = shards[0]["world_size"]
    full = {name: torch.empty(shards[0]["data_size"]) for name in shards[0]["fields"]}
    seen = torch.empty(shards[0]["data_size"], dtype=torch.bool)
    for s in shards:
        for name, value in s["fields"].items():
            full[name][s["rank"] :: k] = value
        seen[s["rank"] :: k] = s["seen"]
    return full, seen


def test_reshard_keeps_every_entry():
    shards = random_shards(101, 4)
    original = assemble(shards)
    for k in (1, 3, 4, 7):
        resharded = reshard_states(shards, k)
        assert [s["fields"]["u_img"].numel() for s in resharded] == [shard_size(101, k, r) for r in range(k)]
        got = assemble(resharded)
        for name in original[0]:
            assert torch.equal(got[0][name], original[0][name])
        assert torch.equal(got[1], original[1])
    # streaming form on loss state_dicts (the per-rank checkpoint entry), reading shards lazily
    wrapped = ({"logit_scale": torch.tensor(2.0), "_extra_state": s} for s in shards)
    one = reshard_for_rank(wrapped, 2, 1)
    assert one["logit_scale"].item() == 2.0 and one["_extra_state"]["rank"] == 1
    with pytest.raises(ValueError, match=r"ranks \[2\]"):
        reshard_for_rank([shards[0], shards[1], shards[3]], 2, 0)


def test_reshard_cli(tmp_path):
    from fastclip.train.reshard import main

    shards = random_shards(50, 2)
    for r, s in enumerate(shards):
        torch.save({"loss_state": {"_extra_state": s}, "data_position": r}, tmp_path / f"rank_{r}.pt")
    assert main(["--in", str(tmp_path), "--world-size", "3"]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rank_0.pt", "rank_1.pt", "rank_2.pt"]
    loaded = [torch.load(tmp_path / f, weights_only=True)["loss_state"]["_extra_state"] for f in files]
    got, want = assemble(loaded), assemble(shards)
    assert torch.equal(got[0]["u_txt"], want[0]["u_txt"]) and torch.equal(got[1], want[1])
    assert main(["--in", str(tmp_path), "--world-size", "1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0.pt"]
    (tmp_path / "model.pt").write_bytes(b"")  # a training checkpoint: not rewritten in place
    assert main(["--in", str(tmp_path), "--world-size", "2"]) == 2
    assert main(["--in", str(tmp_path), "--world-size", "2", "--out", str(tmp_path / "copy")]) == 0
    assert torch.load(tmp_path / "copy" / "rank_1.pt", weights_only=True)["world_size"] == 2


def test_reshard_cli_copies_a_loss_state_without_per_sample_state(tmp_path, capsys):
    """dcl with a queue: no per-sample state, the same τ and queue on every rank; reshard refused it ("no sample state
    found"), where the trainer resumes it at any world size (rank 0's)."""
    from fastclip.train.reshard import main

    loss_fn = build_loss("dcl", data_size=10, queue_size=8).double()
    e1, e2 = features(N, D, seed=3)
    loss_fn(e1, e2, IDX)
    state = loss_fn.state_dict()
    for r in range(2):
        torch.save({"loss_state": state, "rank": r}, tmp_path / f"rank_{r}.pt")
    assert main(["--in", str(tmp_path), "--world-size", "3", "--out", str(tmp_path / "three")]) == 0
    assert "no per-sample state" in capsys.readouterr().out
    for r in range(3):
        got = torch.load(tmp_path / "three" / f"rank_{r}.pt", weights_only=True)
        assert got["world_size"] == 3 and all(torch.equal(got["loss_state"][k], v) for k, v in state.items())


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing", "not a folder"),
        ("a file", "not a folder"),
        ("empty", "no rank_<r>.pt files"),
        ("gap", "no rank_0.pt (resharding needs the file of every old rank"),
        ("text", "rank_0.pt is not a torch checkpoint file"),
        ("model.pt", "no 'loss_state' entry"),
        ("out is a file", "exists and is not a folder"),
    ],
)
def test_reshard_cli_refuses_bad_input_in_one_line(tmp_path, capsys, case, words):
    """Every wrong --in/--out: one line on stderr naming the path, status 2, nothing written to --out."""
    from fastclip.train.reshard import main

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    state = {"loss_state": {"_extra_state": random_shards(10, 1)[0]}}
    if case == "missing":
        src = tmp_path / "nowhere"
    elif case == "a file":
        torch.save(state, src / "rank_0.pt")
        src = src / "rank_0.pt"
    elif case == "gap":
        torch.save(state, src / "rank_1.pt")
    elif case == "text":
        (src / "rank_0.pt").write_text("hello")
    elif case == "model.pt":
        torch.save({"towers": {}}, src / "rank_0.pt")
    elif case == "out is a file":
        torch.save(state, src / "rank_0.pt")
        out.write_text("x")
    assert main(["--in", str(src), "--world-size", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and words in err, err
    assert case == "out is a file" or not out.exists() or not list(out.iterdir())


@pytest.mark.parametrize("name", ["openclip", "fastclip-v0", "fastclip-v1", "fastclip-v2", "fastclip-v3"])
def test_low_precision_features_follow_float64(name):
    """float32 and bfloat16 features: same code path, gradients in the features' dtype, close to float64."""
    e1, e2 = features(N, D, seed=10)
    results = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        loss_fn = build_loss(name, data_size=10, temperature=0.1)
        if dtype == torch.float64:
            loss_fn = loss_fn.double()
        x1 = e1.detach().to(dtype).requires_grad_()
        x2 = e2.detach().to(dtype).requires_grad_()
        for epoch in range(2):
            x1.grad = x2.grad = None
            loss = loss_fn(x1, x2, IDX.int(), epoch=epoch)  # int32 indices are accepted too
            loss.backward()
        assert x1.grad.dtype == dtype and torch.isfinite(x1.grad).all() and torch.isfinite(x2.grad).all()
        results[dtype] = (loss.detach().double(), x1.grad.double(), loss_fn.metrics["objective"].double())
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        for got, want in zip(results[dtype], results[torch.float64]):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_validate_false_and_no_process_group():
    e1, e2 = features(N, D, seed=11)
    checked = build_loss("fastclip-v3", data_size=10).double()
    unchecked = build_loss("fastclip-v3", data_size=10, validate=False).double()
    a, b = checked(e1, e2, IDX), unchecked(e1, e2, IDX)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert checked.comm_bytes == dict.fromkeys(
        ("header", "features", "indices", "state", "values", "gradients", "total"), 0
    )
    with pytest.raises(RuntimeError, match="not initialised"):
        build_loss("fastclip-v3", data_size=10, group=object())(e1, e2, IDX)


def test_no_fp32_overflow_at_tau_001():
    """At τ = 0.01 a negative that beats its positive by more than 0.88 in cosine makes exp(d) overflow float32
    (e^200 here). Every loss shifts by a per-anchor maximum (v0/v1/v3 keep log u), so the float32 gradients
    equal the float64 ones on the same batch, including the temperature's."""
    img = F.normalize(torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64), dim=-1)
    txt = img.clone()
    txt[0] = -img[0]  # pair 0's positive has cosine -1: every other text beats it by about 1
    options = {
        "fastclip-v0": {},
        "fastclip-v1": {},
        "fastclip-v3": {"rho": 6.5},
        "fastclip-v2": {"rho": 6.5},
        "openclip": {},
    }
    for name, extra in options.items():
        got = {}
        for dtype in (torch.float32, torch.float64):
            loss_fn = build_loss(name, data_size=8, temperature=0.01, **extra)
            if dtype == torch.float64:
                loss_fn = loss_fn.double()
            for epoch in range(2):  # the second call carries u over
                _, g1, g2, g = run_loss(loss_fn, img.to(dtype), txt.to(dtype), torch.arange(4), epoch=epoch)
            g_tau = g.get("logit_scale")
            got[dtype] = [g for g in (g1, g2, g_tau) if g is not None]
        for low, high in zip(got[torch.float32], got[torch.float64]):
            assert torch.isfinite(low).all(), name
            torch.testing.assert_close(low.double(), high, rtol=1e-4, atol=1e-4 * high.abs().max().item())


@pytest.mark.parametrize("state_dtype", [None, torch.float64])
@pytest.mark.parametrize("name", ["fastclip-v1", "fastclip-v2", "fastclip-v3", "fastclip-tempnet"])
def test_state_journal_rolls_a_call_back_exactly(name, state_dtype):
    """With the journal on (the trainer's NaN guard), a call's writes are undone bitwise by rollback(), also for a
    batch that holds an index twice; rollback(undo=False on the device) keeps them. Each loss hands the journal
    the rows it read itself (write(previous=)): this checks that they are the rows as they were, also when the
    state is kept wider than the float32 features (v2's initial τ 0.03 is not a float32 number)."""
    extra = dict(embed_dim=D) if name == "fastclip-tempnet" else {}
    extra["state_dtype"] = state_dtype
    loss_fn = build_loss(name, data_size=10, **extra)
    e1, e2 = features(N, D, seed=16)
    loss_fn(e1.float(), e2.float(), IDX)  # first visits: seen, u, (τ, moments) written
    state = loss_fn.sample_state()
    before = state.state_dict()
    repeated = torch.tensor([1, 7, 2, 7, 8, 0])  # 7 twice, 8 and 0 not seen yet
    for undo in (None, torch.tensor(False)):
        state.journal = []
        loss_fn(e1.float(), e2.float(), repeated, epoch=1)
        written = state.state_dict()
        assert not torch.equal(written["fields"][state.names[0]], before["fields"][state.names[0]])
        state.rollback(undo)
        after = state.state_dict()
        expect = before if undo is None else written
        assert torch.equal(after["seen"], expect["seen"]) and state.journal == []
        for field in state.names:
            assert torch.equal(after["fields"][field], expect["fields"][field]), (field, undo)
        state.load_state_dict(before)
    state.journal = None


def test_state_saved_as_u_before_log_u_loads_as_log_u():
    """Checkpoints from before the log-space state hold u itself; they load as log u, unseen rows untouched."""
    e1, e2 = features(N, D, seed=12)
    loss_fn = build_loss("fastclip-v3", data_size=10).double()
    loss_fn(e1, e2, IDX)
    saved = loss_fn.state_dict()
    extra = saved["_extra_state"]
    old = dict(extra, fields={name[len("log_") :]: value.exp() for name, value in extra["fields"].items()})
    fresh = build_loss("fastclip-v3", data_size=10).double()
    fresh.load_state_dict({**saved, "_extra_state": old})
    for name, value in fresh.state_dict()["_extra_state"]["fields"].items():
        seen = extra["seen"]
        torch.testing.assert_close(value[seen], extra["fields"][name][seen], **TOL)


@pytest.mark.parametrize("data_size", [0, 1, 10])
def test_locate_owns_exactly_the_indices_in_range(data_size):
    from fastclip.losses.sharded_state import ShardedSampleState

    state = ShardedSampleState(data_size=data_size, world_size=1, rank=0, fields={"u": 0.0})
    indices = torch.tensor([-1, 0, 9, 10, data_size - 1, data_size])
    where = state.locate(indices, assert_in_range=False)
    want = (indices >= 0) & (indices < data_size)
    assert torch.equal(where.owned, want)
    assert torch.equal(where.slots[~want], torch.full_like(where.slots[~want], state.num_slots))  # the spare row


@pytest.mark.parametrize("bad", [10, -1])
def test_validate_false_never_writes_the_spare_row(bad):
    """With validate=False an index == data_size or -1 stops the step (a device-side assert, no host sync) and
    leaves every stored entry as it was."""
    e1, e2 = features(N, D, seed=13)
    loss_fn = build_loss("fastclip-v1", data_size=10, validate=False).double()
    loss_fn(e1, e2, IDX)
    before = {k: v.clone() for k, v in loss_fn.state_dict()["_extra_state"]["fields"].items()}
    with pytest.raises(RuntimeError, match=r"outside \[0, data_size\)"):
        loss_fn(e1, e2, torch.tensor([0, 1, 2, 3, 4, bad]))
    state = loss_fn.sample_state()
    assert not state._seen[state.num_slots]  # the spare row was never marked as a sample
    for k, v in loss_fn.state_dict()["_extra_state"]["fields"].items():
        assert torch.equal(v, before[k])


def test_repeated_index_gradient_is_the_objective_without_same_index_pairs():
    e1, e2 = features(N, D, seed=15)
    e1, e2 = e1.detach().clone(), e2.detach().clone()
    e1[4], e2[4] = e1[1], e2[1]
    idx = torch.tensor([0, 1, 2, 3, 1, 5])
    loss_fn = build_loss("fastclip-v1", data_size=10, temperature=0.2).double()
    _, g_e1, g_e2, _ = run_loss(loss_fn, e1, e2, idx)
    s = loss_fn.logit_scale.detach().exp()
    w1, w2 = e1.clone().requires_grad_(), e2.clone().requires_grad_()
    g1 = direct_g_distinct(w1, w2, s, idx)
    g2 = direct_g_distinct(w2, w1, s, idx)
    objective = (torch.log(1e-14 + g1) + torch.log(1e-14 + g2)).sum() / (2 * N)
    want = grads(objective, w1, w2)
    torch.testing.assert_close(g_e1, want[0], **TOL)
    torch.testing.assert_close(g_e2, want[1], **TOL)


def test_v3_separate_temperatures_follow_the_textbook_objective():
    """RGCL-g with τ1 (image-anchored) and τ2 (text-anchored): ½[τ1(mean log(ε+g1(τ1)) + ρ) + τ2(mean log(ε+g2(τ2))
    + ρ)]; gradients into both features and both temperatures, float64."""
    e1, e2 = features(N, D, seed=16)
    rho = 1.5
    loss_fn = build_loss("fastclip-v3", data_size=10, rho=rho, separate_temperatures=True).double()
    with torch.no_grad():
        loss_fn.logit_scale.copy_(torch.tensor([math.log(1 / 0.1), math.log(1 / 0.25)]))
    theta = loss_fn.logit_scale.detach().clone().requires_grad_()
    w1, w2 = e1.detach().clone().requires_grad_(), e2.detach().clone().requires_grad_()
    s = theta.exp()
    g1, g2 = direct_g(w1, w2, s[0], s[1])
    tau = 1 / s
    objective = 0.5 * (tau[0] * (torch.log(1e-14 + g1).mean() + rho) + tau[1] * (torch.log(1e-14 + g2).mean() + rho))
    want = grads(objective, w1, w2, theta)
    value, g_e1, g_e2, g = run_loss(loss_fn, e1, e2, IDX)
    g_theta = g["logit_scale"]
    torch.testing.assert_close(g_e1, want[0], **TOL)
    torch.testing.assert_close(g_e2, want[1], **TOL)
    torch.testing.assert_close(g_theta, want[2], **TOL)
    torch.testing.assert_close(loss_fn.metrics["objective"], objective.detach(), **TOL)
    assert loss_fn.metrics["tau_img"].item() == pytest.approx(0.1) and loss_fn.metrics[
        "tau_txt"
    ].item() == pytest.approx(0.25)
    # with τ1 = τ2 it is the shared-τ loss
    shared = build_loss("fastclip-v3", data_size=10, rho=rho, temperature=0.1).double()
    both = build_loss("fastclip-v3", data_size=10, rho=rho, temperature=0.1, separate_temperatures=True).double()
    a, b = run_loss(shared, e1, e2, IDX), run_loss(both, e1, e2, IDX)
    for x, y in zip(a[:3], b[:3]):
        torch.testing.assert_close(x, y, **TOL)
    torch.testing.assert_close(b[3]["logit_scale"].sum(), a[3]["logit_scale"], **TOL)


def test_tau_min_bounds_the_global_temperature():
    loss_fn = build_loss("fastclip-v3", data_size=10, temperature=0.07, tau_min=0.03, separate_temperatures=True)
    with torch.no_grad():
        loss_fn.logit_scale.fill_(10.0)
    loss_fn.clamp_()
    torch.testing.assert_close(loss_fn.logit_scale.detach(), torch.full((2,), math.log(1 / 0.03)))
    with pytest.raises(ValueError, match="tau_min"):
        build_loss("fastclip-v0", data_size=10, temperature=0.05, tau_min=0.1)
    with pytest.raises(ValueError, match="compat='faithful'"):
        build_loss("fastclip-v3", data_size=10, separate_temperatures=True, compat="reference")


@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_later_bad_call_is_named_by_the_words_in_the_feature_gather(mode):
    """After the first call (the structure handshake), the value checks ride in the feature all_gather: eager
    raises at the bad call before any state is written; deferred raises at check_inputs(), naming the call, and
    the out-of-range index was owned by no rank (nothing written for it, no assert)."""
    e1, e2 = features(N, D, seed=14)
    loss_fn = build_loss("fastclip-v1", data_size=10, validate=mode).double()
    loss_fn(e1, e2, IDX)
    before = loss_fn.sample_state().read(loss_fn.sample_state().locate(torch.arange(10))).clone()
    bad = torch.tensor([0, 1, 2, 3, 4, 10])
    if mode == "eager":
        with pytest.raises(LossInputError, match=r"^rank 0: indices\[5\] = 10 is out of range"):
            loss_fn(e1, e2, bad)
        after = loss_fn.sample_state().read(loss_fn.sample_state().locate(torch.arange(10)))
        assert torch.equal(after, before)  # raised before the state was touched
        return
    state = loss_fn.sample_state()
    loss_fn(e1, e2, IDX)  # call 2: fine
    rows = state.read(state.locate(torch.arange(10))).clone()
    loss_fn(e1, e2, bad)  # call 3: no error yet, no assert
    after = state.read(state.locate(torch.arange(10)))
    assert not torch.equal(after[:5], rows[:5])  # the good rows were updated
    assert torch.equal(after[5:], rows[5:])  # not in this batch; index 10 was owned by no rank
    nan = e1.clone()
    nan[2, 1] = float("nan")
    loss_fn(nan, e2, IDX)  # call 4: a later bad call does not replace the first one
    with pytest.raises(LossInputError, match=r"^loss call 3: rank 0: indices\[5\] = 10 is out of range"):
        loss_fn.check_inputs()
    loss_fn.check_inputs()  # reported once
    loss_fn(nan, e2, IDX)  # call 5
    loss_fn.check_inputs(features=False)  # a NaN guard handled it: forgotten, no error
    loss_fn(nan, e2, IDX)  # call 6
    with pytest.raises(NonFiniteFeaturesError, match=r"^loss call 6: rank 0: image_features .* row 2"):
        loss_fn.check_inputs()


def test_deferred_checks_fold_on_the_device_and_still_name_the_first_bad_call(monkeypatch):
    """Deferred mode keeps each call's gathered words and folds them on the device every FOLD_EVERY calls: the
    first bad call is named whether it was folded, pending, or both kinds are there; an out-of-range index is
    raised before non-finite features (it is fatal, they are forgiven by a NaN guard), so neither hides it."""
    monkeypatch.setattr(validation, "FOLD_EVERY", 3)
    e1, e2 = features(N, D, seed=15)
    loss_fn = build_loss("fastclip-v1", data_size=10, validate="deferred").double()
    checks = loss_fn.input_checks
    nan = e1.clone()
    nan[3, 0] = float("inf")
    bad = torch.tensor([0, 1, 2, 3, 4, -7])
    worse = torch.tensor([0, 1, 2, 3, 10, 4])
    calls = [(e1, IDX), (e1, IDX), (e1, bad), (nan, IDX), (e1, worse), (e1, IDX), (e1, IDX), (e1, IDX)]
    for x, idx in calls:  # folds after calls 3 and 6; 7 and 8 pending
        loss_fn(x, e2, idx)
    assert len(checks._pending) == 2 and set(checks._first_bad) == {"features", "unit", "index"}
    with pytest.raises(LossInputError, match=r"^loss call 3: rank 0: indices\[5\] = -7 is out of range"):
        loss_fn.check_inputs()
    assert checks._pending == [] and checks._first_bad == {}
    for x in (e1, e1, e1, nan, e1):  # calls 9-13: a fold after 11 finds nothing, the bad call 12 is pending
        loss_fn(x, e2, IDX)
    with pytest.raises(NonFiniteFeaturesError, match=r"^loss call 12: rank 0: image_features .* row 3"):
        loss_fn.check_inputs()
    # calls 14-17: NaN features folded (14), then a bad index pending (17): the index is raised, with or without
    # the features being forgiven
    for features_too in (True, False):
        for x, idx in ((nan, IDX), (e1, IDX), (e1, IDX), (e1, worse)):
            loss_fn(x, e2, idx)
        with pytest.raises(
            LossInputError, match=rf"^loss call {17 if features_too else 21}: rank 0: indices\[4\] = 10 "
        ):
            loss_fn.check_inputs(features=features_too)
    for x in (nan, e1):  # forgiven features, nothing else: no error
        loss_fn(x, e2, IDX)
    loss_fn.check_inputs(features=False)
    for _ in range(4):  # all good: nothing to raise
        loss_fn(e1, e2, IDX)
    loss_fn.check_inputs()


@pytest.mark.parametrize("name", ["fastclip-v3", "fastclip-v2", "openclip"])
def test_metrics_are_computed_when_read_and_survive_a_pickle(name):
    """GCL/v2 metrics are computed on first read (from the call's detached tensors), equal to the reference value,
    also read after a later parameter update or after pickling the module (then they are computed first)."""
    e1, e2 = features(N, D, seed=17)
    loss_fn = build_loss(name, **({} if name == "openclip" else {"data_size": 10})).double()
    loss = loss_fn(e1, e2, IDX)
    if name != "fastclip-v2":
        with torch.no_grad():  # a later update must not change this call's metrics
            loss_fn.logit_scale.add_(0.5)
    copy = pickle.loads(pickle.dumps(loss_fn))
    for metrics in (copy.metrics, loss_fn.metrics):
        assert metrics["loss"].item() == loss.item() and not metrics["loss"].requires_grad
        tau = metrics["tau_q50"] if name == "fastclip-v2" else metrics["tau"]
        assert tau.item() == pytest.approx(0.03 if name == "fastclip-v2" else 0.07, rel=1e-6)  # float32 init


def test_validate_option_values():
    assert build_loss("fastclip-v3", data_size=10).validate == "eager"
    assert build_loss("fastclip-v3", data_size=10, validate=False).validate == "off"
    assert build_loss("openclip", validate="deferred").validate == "deferred"
    with pytest.raises(ValueError, match="validate must be"):
        build_loss("fastclip-v3", data_size=10, validate="sometimes")


def test_softmax_rows_equal_the_shifted_exponentials_with_either_shift():
    """Blocks holding a·S take the softmax form (RowTerms.normalized): its terms exp·total, totals and shifts are
    the subtract-exp-sum form's (which the moment still takes), for the row-maximum shift and for a floor that
    is above some rows' maximum; an all-excluded row keeps no terms, total 0 and the shift EXCLUDED/2."""
    from fastclip.losses.pairwise import EXCLUDED, row_terms

    gen = torch.Generator().manual_seed(5)
    sim = 7.0 * torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    sim[:, 2, :] = EXCLUDED
    sim[0, 1, 3] = EXCLUDED
    pos = torch.randn(5, generator=gen, dtype=torch.float64)
    scale = torch.tensor(7.0, dtype=torch.float64)
    floor = torch.tensor([[0.0, 3.0, 0.0, -2.0, 40.0], [1.0, 0.0, 0.0, 50.0, -1.0]], dtype=torch.float64)
    for shift in (dict(max_shift=True), dict(bound_floor=floor)):
        soft = row_terms(sim.clone(), pos, scale, sim_is_scaled=True, **shift)
        plain = row_terms(sim.clone(), pos, scale, sim_is_scaled=True, moment=True, **shift)
        assert soft.normalized and not plain.normalized
        torch.testing.assert_close(soft.values(), plain.exp, rtol=1e-12, atol=1e-300)
        torch.testing.assert_close(soft.total, plain.total, rtol=1e-12, atol=0)
        torch.testing.assert_close(soft.shift, plain.shift, rtol=0, atol=0)
        assert torch.all(soft.values()[:, 2] == 0) and torch.all(soft.total[:, 2] == 0)
    assert torch.all(soft.shift[:, 2] == floor[:, 2])  # the floor form's empty row sits at its floor


def test_row_terms_shift_by_the_row_maximum_matches_the_floor_form_and_refuses_both():
    """max_shift (v0/v1/v3, TempNet) is the floor form at floor −inf, in fewer passes; an all-excluded row keeps
    exp 0 and a shift of EXCLUDED/2 either way; asking for both is an error, not a silent choice."""
    from fastclip.losses.pairwise import EXCLUDED, row_terms

    gen = torch.Generator().manual_seed(3)
    sim = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64)
    sim[:, 2, :] = EXCLUDED  # a row with no candidate at all
    pos = torch.randn(4, generator=gen, dtype=torch.float64)
    global_scale, per_block_scale = torch.tensor(7.0).double(), torch.tensor([[5.0], [9.0]]).double()
    for scale, scaled in ((global_scale, True), (per_block_scale, False)):
        by_max = row_terms(sim.clone(), pos, scale, sim_is_scaled=scaled, max_shift=True, moment=True)
        floor = torch.full((), -math.inf, dtype=torch.float64)
        by_floor = row_terms(sim.clone(), pos, scale, sim_is_scaled=scaled, bound_floor=floor, moment=True)
        for name in ("exp", "total", "moment", "shift"):
            torch.testing.assert_close(getattr(by_max, name), getattr(by_floor, name), rtol=1e-12, atol=1e-12)
        assert torch.all(by_max.exp[:, 2] == 0) and torch.all(by_max.shift[:, 2] == EXCLUDED / 2)
    with pytest.raises(ValueError, match="not both"):
        row_terms(sim, pos, scale, bound_floor=floor, max_shift=True)


def test_the_loss_library_imports_nothing_of_the_trainer_data_or_command_line():
    """The losses are usable in a user's own training loop: every module of fastclip.losses loads without the
    rest of fastclip: no trainer, data layer, evaluation, models or command line (fastclip reshard lives in train/)."""
    code = (
        "import importlib, pkgutil, sys, fastclip.losses as L\n"
        "for m in pkgutil.iter_modules(L.__path__): importlib.import_module('fastclip.losses.' + m.name)\n"
        "print(sorted(n for n in sys.modules if n.startswith('fastclip.') and not n.startswith('fastclip.losses')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_reshard_on_a_full_disk_is_one_line_status_1_and_changes_nothing(tmp_path, capsys, monkeypatch):
    """The second new file fails part-way: the old rank files stay as they were and no temporary file is left."""
    import fastclip.train.reshard as reshard

    for r, s in enumerate(random_shards(50, 2)):
        torch.save({"loss_state": {"_extra_state": s}}, tmp_path / f"rank_{r}.pt")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real, calls = reshard.save_file, []

    def fills_up(obj, path):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"PK part of it")
            raise OSError(28, "No space left on device")
        real(obj, path)

    monkeypatch.setattr(reshard, "save_file", fills_up)
    assert reshard.main(["--in", str(tmp_path), "--world-size", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"fastclip reshard: error: {tmp_path}: No space left on device; nothing was changed (free space, fix the "
        f"file, or pass another --out)"
    )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("name", ["fastclip-v0", "fastclip-v1", "fastclip-v2", "fastclip-v3", "fastclip-tempnet"])
def test_eval_mode_reads_the_state_and_writes_none(name):
    """A validation loss (loss_fn.eval(), no_grad) leaves the per-sample state as it was; its value is the train-mode
    loss with γ = 1 on the same state (u = the batch's own estimate). Back in train mode the state moves again."""
    import copy

    extra = {"embed_dim": 6} if name == "fastclip-tempnet" else {}
    loss_fn = build_loss(name, data_size=16, gamma_min=0.5, gamma_decay_epochs=2, **extra).double()
    for step in range(2):
        e1, e2 = features(8, 6, seed=step)
        run_loss(loss_fn, e1, e2, torch.arange(8) + 4 * step, epoch=step)
    before = copy.deepcopy(loss_fn.state_dict())
    gamma_one = copy.deepcopy(loss_fn)
    gamma_one.gamma_schedule = lambda epoch: 1.0
    e1, e2 = features(8, 6, seed=7)
    idx = torch.arange(8) + 6  # 6..11 seen, 12 and 13 not
    loss_fn.eval()
    with torch.no_grad():
        value = loss_fn(e1, e2, idx, epoch=1)
    after = loss_fn.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        if key == "_extra_state":
            for field, saved in before[key]["fields"].items():
                assert torch.equal(saved, after[key]["fields"][field]), field
            assert torch.equal(before[key]["seen"], after[key]["seen"])
        else:
            assert torch.equal(before[key], after[key]), key
    assert float(loss_fn.metrics["gamma"]) == 1.0
    assert torch.equal(value, gamma_one(e1, e2, idx, epoch=1).detach())
    loss_fn.train()
    loss_fn(e1, e2, idx, epoch=1)
    assert int(loss_fn.state_dict()["_extra_state"]["seen"].sum()) > int(before["_extra_state"]["seen"].sum())
