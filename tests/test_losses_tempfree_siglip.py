"""The losses beyond the reference: the temperature-free map (``similarity="atanh"``) and SigLIP.

float64 throughout. Single process: gradients against objectives written out here with autograd. Then ONE
spawn of 2 real processes (gloo): every new configuration over 3 steps (γ < 1, repeated indices) against one
process on the concatenated batch, and SigLIP against open_clip's ``SigLipLoss`` rank by rank.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastclip.losses import build_loss, reshard_states
from fastclip.losses.similarity import atanh_logit_

from dist_utils import run_distributed
from helpers import features, grads, run_loss

TOL = dict(rtol=1e-10, atol=1e-10)
CLAMP = 1e-6
N, D = 6, 5
IDX = torch.tensor([3, 0, 9, 4, 7, 1])


def phi(c, clamp=CLAMP):
    """The temperature-free logit 2·atanh(c), c clamped to ±(1 − clamp), written with autograd."""
    return 2 * torch.atanh(torch.clamp(c, -(1 - clamp), 1 - clamp))


# --- the map ------------------------------------------------------------------------------------------------------


def test_atanh_map_and_its_derivative_match_autograd():
    limit = 1 - CLAMP
    c = torch.tensor([-1.0, -1 + 1e-9, -limit, -0.9, -0.3, 0.0, 0.25, 0.999, limit, 1 - 1e-8, 1.0], dtype=torch.float64)
    value, derivative = atanh_logit_(c.clone(), CLAMP)
    leaf = c.clone().requires_grad_()
    want = phi(leaf)
    (want_grad,) = torch.autograd.grad(want.sum(), leaf)
    torch.testing.assert_close(value, want.detach(), **TOL)
    torch.testing.assert_close(derivative, want_grad, **TOL)
    inside = c.abs() <= limit
    torch.testing.assert_close(value[inside], torch.log((1 + c[inside]) / (1 - c[inside])), **TOL)
    torch.testing.assert_close(derivative[inside], 2 / (1 - c[inside] ** 2), **TOL)
    assert (derivative[~inside] == 0).all() and (~inside).sum() == 4
    assert value.abs().max() == pytest.approx(math.log((2 - CLAMP) / CLAMP))


# --- temperature-free losses against the directly written objectives ------------------------------------------


def mapped_g(e1, e2, scale):
    """GCL's g1_i, g2_i with logits scale·φ(cos)."""
    n = e1.shape[0]
    logit = phi(e1 @ e2.T)
    pos = torch.diagonal(logit)
    off = ~torch.eye(n, dtype=torch.bool)
    g1 = (torch.exp(scale * (logit - pos[:, None])) * off).sum(1) / (n - 1)
    g2 = (torch.exp(scale * (logit.T - pos[:, None])) * off).sum(1) / (n - 1)
    return g1, g2


def mapped_gcl(e1, e2, scale, eps=1e-14):
    g1, g2 = mapped_g(e1, e2, scale)
    return (torch.log(eps + g1) + torch.log(eps + g2)).sum() / (2 * e1.shape[0])


def test_openclip_atanh_is_the_temperature_free_cross_entropy():
    e1, e2 = features(N, D, seed=1, clamped_pair=(1, 4))
    labels = torch.arange(N)
    loss_fn = build_loss("openclip", similarity="atanh").double()
    assert loss_fn.tau_param_names() == [] and loss_fn.temperature().item() == 1.0  # nothing to tune
    logit = phi(e1 @ e2.T)
    ce = 0.5 * (F.cross_entropy(logit, labels) + F.cross_entropy(logit.T, labels))
    want = grads(ce, e1, e2)
    value, g_e1, g_e2, _ = run_loss(loss_fn, e1, e2, None)
    torch.testing.assert_close(value, ce.detach(), **TOL)
    torch.testing.assert_close(g_e1, want[0], **TOL)
    torch.testing.assert_close(g_e2, want[1], **TOL)
    torch.testing.assert_close(loss_fn.metrics["objective"], ce.detach(), **TOL)
    # the clamped pair (image 1, text 4) passes no gradient through its cosine: removing it from the
    # direct objective's graph changes nothing
    assert (e1 @ e2.T)[1, 4] > 1 - CLAMP

    # a learnable scale on top: logits s·φ(cos)
    learn = build_loss("openclip", similarity="atanh", temperature=0.5, learn_temperature=True).double()
    theta = learn.logit_scale.detach().clone().requires_grad_()
    scaled = theta.exp() * phi(e1 @ e2.T)
    ce_s = 0.5 * (F.cross_entropy(scaled, labels) + F.cross_entropy(scaled.T, labels))
    want = grads(ce_s, e1, e2, theta)
    value, g_e1, g_e2, g_params = run_loss(learn, e1, e2, None)
    torch.testing.assert_close(value, ce_s.detach(), **TOL)
    for got, expected in zip((g_e1, g_e2, g_params["logit_scale"]), want):
        torch.testing.assert_close(got, expected, **TOL)


def test_clamped_cosine_gets_no_gradient():
    """Only the clamped pair differs between two batches whose cosines are both beyond the clamp: same grads."""
    e1, e2 = features(N, D, seed=2, clamped_pair=(0, 3))
    loss_fn = build_loss("fastclip-v1", data_size=10, similarity="atanh").double()
    _, g_e1, g_e2, _ = run_loss(loss_fn, e1, e2, IDX)
    e1d = e1.detach()
    sim = e1d @ e2.detach().T
    assert sim[0, 3] > 1 - CLAMP
    # autograd with the pair's cosine cut from the graph (a constant) gives the same gradients
    e1c, e2c = e1d.clone().requires_grad_(), e2.detach().clone().requires_grad_()
    cos = e1c @ e2c.T
    cut = torch.zeros_like(cos, dtype=torch.bool)
    cut[0, 3] = True
    cos = torch.where(cut, cos.detach(), cos)
    logit = phi(cos)
    pos = torch.diagonal(logit)
    off = ~torch.eye(N, dtype=torch.bool)
    g1 = (torch.exp(logit - pos[:, None]) * off).sum(1) / (N - 1)
    g2 = (torch.exp(logit.T - pos[:, None]) * off).sum(1) / (N - 1)
    want = grads((torch.log(1e-14 + g1) + torch.log(1e-14 + g2)).sum() / (2 * N), e1c, e2c)
    torch.testing.assert_close(g_e1, want[0], **TOL)
    torch.testing.assert_close(g_e2, want[1], **TOL)


@pytest.mark.parametrize("name", ["fastclip-v0", "fastclip-v1", "fastclip-v3"])
def test_gcl_atanh_gradient_equals_direct_objective(name):
    e1, e2 = features(N, D, seed=3, clamped_pair=(2, 5))
    rho = 1.5
    extra = {"rho": rho} if name == "fastclip-v3" else {}
    temperature = 1.0 if name == "fastclip-v1" else 0.5
    loss_fn = build_loss(name, data_size=10, similarity="atanh", temperature=temperature, **extra).double()
    theta = loss_fn.logit_scale.detach().clone().requires_grad_()
    s = theta.exp()
    if name == "fastclip-v3":
        tau = torch.exp(-theta)
        objective = tau * mapped_gcl(e1, e2, s) + rho * tau
    else:
        objective = mapped_gcl(e1, e2, s)
    want = grads(objective, e1, e2, theta)
    value, g_e1, g_e2, g_params = run_loss(loss_fn, e1, e2, IDX)
    torch.testing.assert_close(g_e1, want[0], **TOL)
    torch.testing.assert_close(g_e2, want[1], **TOL)
    if name == "fastclip-v1":
        assert g_params == {} and loss_fn.temperature().item() == 1.0
        g1, g2 = mapped_g(e1.detach(), e2.detach(), 1.0)
        # temperature-free GCL: g_i is the mean odds ratio odds(c_ik)/odds(c_ii), odds(c) = (1+c)/(1-c)
        c = (e1 @ e2.T).detach().clamp(-1 + CLAMP, 1 - CLAMP)
        odds = (1 + c) / (1 - c)
        off = ~torch.eye(N, dtype=torch.bool)
        torch.testing.assert_close(g1, ((odds / torch.diagonal(odds)[:, None]) * off).sum(1) / (N - 1), **TOL)
        u = loss_fn.state_dict()["_extra_state"]["fields"]["log_u_img"][IDX].exp()
        torch.testing.assert_close(u, g1, **TOL)
        return
    torch.testing.assert_close(g_params["logit_scale"], want[2], **TOL)
    # compat="reference" counts the g-term of the scale gradient twice (as with the cosine)
    ref = build_loss(
        name, data_size=10, similarity="atanh", temperature=temperature, compat="reference", **extra
    ).double()
    _, r_e1, _, r_params = run_loss(ref, e1, e2, IDX)
    outer = torch.exp(-theta).detach() if name == "fastclip-v3" else 1.0
    g_term = grads(outer * mapped_gcl(e1, e2, theta.exp()), theta)[0]
    torch.testing.assert_close(r_e1, want[0], **TOL)
    torch.testing.assert_close(r_params["logit_scale"], want[2] + g_term, **TOL)
    assert abs(float(g_term)) > 1e-3  # the two modes really differ here


# --- SigLIP -------------------------------------------------------------------------------------------------------


def siglip_objective(e1, e2, theta, bias):
    """−(1/N) Σ_ij log σ(z_ij (t e1_i·e2_j + b)), z = +1 on the diagonal (one process: B_local = N)."""
    n = e1.shape[0]
    z = 2 * torch.eye(n, dtype=e1.dtype) - 1
    return -F.logsigmoid(z * (theta.exp() * e1 @ e2.T + bias)).sum() / n


def test_siglip_gradient_equals_direct_objective():
    e1, e2 = features(N, D, seed=4)
    loss_fn = build_loss("siglip").double()
    assert loss_fn.tau_param_names() == ["logit_scale", "logit_bias"]
    assert loss_fn.logit_scale.item() == pytest.approx(math.log(10)) and loss_fn.logit_bias.item() == -10.0
    with torch.no_grad():  # away from the init so that every term matters
        loss_fn.logit_scale.fill_(math.log(3.0))
        loss_fn.logit_bias.fill_(-1.5)
    theta = loss_fn.logit_scale.detach().clone().requires_grad_()
    bias = loss_fn.logit_bias.detach().clone().requires_grad_()
    objective = siglip_objective(e1, e2, theta, bias)
    want = grads(objective, e1, e2, theta, bias)
    value, g_e1, g_e2, g_params = run_loss(loss_fn, e1, e2, None)
    torch.testing.assert_close(value, objective.detach(), **TOL)
    torch.testing.assert_close(loss_fn.metrics["objective"], objective.detach(), **TOL)
    for got, expected in zip((g_e1, g_e2, g_params["logit_scale"], g_params["logit_bias"]), want):
        torch.testing.assert_close(got, expected, **TOL)
    frozen = build_loss("siglip", learn_temperature=False, learn_bias=False, bias=-3.0).double()
    _, f_e1, _, f_params = run_loss(frozen, e1, e2, None)
    assert f_params == {} and torch.isfinite(f_e1).all()


@pytest.mark.parametrize(
    "name,options", [("siglip", {}), ("openclip", {"similarity": "atanh"}), ("fastclip-v3", {"similarity": "atanh"})]
)
def test_low_precision_follows_float64(name, options):
    e1, e2 = features(N, D, seed=5)
    results = {}
    for dtype in (torch.float64, torch.float32):
        loss_fn = build_loss(name, data_size=10, **options).to(dtype)
        loss, g_e1, g_e2, _ = run_loss(loss_fn, e1.detach().to(dtype), e2.detach().to(dtype), IDX)
        assert g_e1.dtype == dtype
        results[dtype] = (loss.double(), g_e1.double(), g_e2.double())
    for got, want in zip(results[torch.float32], results[torch.float64]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_options_of_the_new_losses():
    with pytest.raises(TypeError, match="similarity.*per-sample"):
        build_loss("fastclip-v2", data_size=10, similarity="atanh")
    with pytest.raises(ValueError, match="similarity must be one of"):
        build_loss("openclip", similarity="tanh")
    with pytest.raises(ValueError, match="similarity_clamp"):
        build_loss("fastclip-v1", data_size=10, similarity="atanh", similarity_clamp=0.0)
    with pytest.raises(TypeError, match="'rho'"):
        build_loss("siglip", rho=1.0)
    with pytest.raises(ValueError, match="bias"):
        build_loss("siglip", bias=float("nan"))
    v3 = build_loss("fastclip-v3", data_size=10, similarity="atanh")
    assert v3.temperature().item() == 1.0 and v3.tau_param_names() == ["logit_scale"]
    assert build_loss("fastclip-v1", data_size=10, similarity="atanh", temperature=0.5).temperature().item() == 0.5
    assert build_loss("openclip").options.similarity == "cosine"  # the default is unchanged
    assert build_loss("openclip").temperature().item() == pytest.approx(0.07)


# --- 2 real processes ------------------------------------------------------------------------------------------

DATA_SIZE = 16
STEPS = [([3, 7, 12, 5, 9, 7, 0, 14], 0), ([7, 3, 15, 2, 12, 11, 5, 3], 1), ([0, 1, 3, 7, 7, 8, 9, 10], 2)]
CONFIGS = {
    "openclip-atanh": ("openclip", dict(similarity="atanh")),
    "openclip-atanh-learn": ("openclip", dict(similarity="atanh", temperature=0.5, learn_temperature=True)),
    "v1-atanh": ("fastclip-v1", dict(similarity="atanh")),
    "v0-atanh-reference": ("fastclip-v0", dict(similarity="atanh", temperature=0.5, compat="reference")),
    "v3-atanh": ("fastclip-v3", dict(similarity="atanh", temperature=0.5, rho=1.0)),
    "v3-atanh-reference": ("fastclip-v3", dict(similarity="atanh", temperature=0.5, rho=1.0, compat="reference")),
    "siglip": ("siglip", dict(temperature=0.3, bias=-2.0)),
}


def make(label):
    name, options = CONFIGS[label]
    if name != "openclip" and name != "siglip":
        options = dict(gamma_min=0.3, gamma_decay_epochs=2, **options)
    return build_loss(name, data_size=DATA_SIZE, **options).double()


def step_batch(step, n):
    """A step's global batch; text 5 equals image 1 (a clamped negative pair across the two ranks)."""
    e1, e2 = features(n, D, seed=100 + step, clamped_pair=(1, 5))
    return e1.detach(), e2.detach()


def run_steps(loss_fn, rows):
    records = []
    for step, (indices, epoch) in enumerate(STEPS):
        e1, e2 = step_batch(step, len(indices))
        loss, g_e1, g_e2, g_params = run_loss(loss_fn, e1[rows], e2[rows], torch.tensor(indices)[rows], epoch)
        records.append(
            {
                "loss": loss,
                "e1": g_e1,
                "e2": g_e2,
                "params": {k: v.clone() for k, v in g_params.items()},
                "objective": loss_fn.metrics["objective"],
                "bytes": dict(loss_fn.comm_bytes),
            }
        )
    return {"steps": records, "state": loss_fn.state_dict().get("_extra_state")}


def siglip_against_open_clip(rank, world_size):
    from fastclip.compat import import_open_clip

    open_clip = import_open_clip()
    e1_all, e2_all = step_batch(7, 4 * world_size)
    rows = slice(4 * rank, 4 * rank + 4)
    ours = make("siglip")
    out = {"ours": run_loss(ours, e1_all[rows], e2_all[rows], None)}
    theta = ours.logit_scale.detach().clone().requires_grad_()
    bias = ours.logit_bias.detach().clone().requires_grad_()
    e1, e2 = e1_all[rows].clone().requires_grad_(), e2_all[rows].clone().requires_grad_()
    theirs = open_clip.loss.SigLipLoss(rank=rank, world_size=world_size)
    value = theirs(e1, e2, theta.exp(), bias)
    value.backward()
    out["theirs"] = (value.detach(), e1.grad, e2.grad, {"logit_scale": theta.grad, "logit_bias": bias.grad})
    return out


def two_rank_suite(rank, world_size):
    rows = slice(4 * rank, 4 * rank + 4)
    return {
        "configs": {label: run_steps(make(label), rows) for label in CONFIGS},
        "siglip_open_clip": siglip_against_open_clip(rank, world_size),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(two_rank_suite, 2, timeout=240)


@pytest.mark.parametrize("label", list(CONFIGS))
def test_two_ranks_equal_one_process(two_ranks, label):
    single = run_steps(make(label), slice(None))
    k, b = 2, 4
    for step, want in enumerate(single["steps"]):
        got = [r["configs"][label]["steps"][step] for r in two_ranks]
        where = f"{label} step {step}"
        for r, rec in enumerate(got):
            rows = slice(r * b, (r + 1) * b)
            torch.testing.assert_close(rec["e1"] / k, want["e1"][rows], **TOL, msg=f"{where} rank {r} image grad")
            torch.testing.assert_close(rec["e2"] / k, want["e2"][rows], **TOL, msg=f"{where} rank {r} text grad")
            torch.testing.assert_close(rec["objective"], want["objective"], **TOL, msg=f"{where} objective")
        torch.testing.assert_close(sum(rec["loss"] for rec in got) / k, want["loss"], **TOL, msg=f"{where} loss")
        assert set(want["params"]) == set(got[0]["params"])
        for name, value in want["params"].items():
            torch.testing.assert_close(
                sum(rec["params"][name] for rec in got) / k, value, **TOL, msg=f"{where} {name} grad"
            )
    if single["state"] is not None:
        merged = reshard_states([r["configs"][label]["state"] for r in two_ranks], 1)[0]
        assert torch.equal(merged["seen"], single["state"]["seen"])
        for field, value in single["state"]["fields"].items():
            torch.testing.assert_close(merged["fields"][field], value, **TOL, msg=f"{label} state {field}")


def test_siglip_equals_open_clip_sigliploss_per_rank(two_ranks):
    """Per rank: the same value (local-batch normalisation), the same feature gradients (OpenCLIP's text
    gradient arrives through its ring exchange's backward, ours through loss2) and the same t, b gradients."""
    for rank, result in enumerate(two_ranks):
        ours, theirs = result["siglip_open_clip"]["ours"], result["siglip_open_clip"]["theirs"]
        for what, got, want in zip(("value", "image grad", "text grad"), ours[:3], theirs[:3]):
            torch.testing.assert_close(got, want, **TOL, msg=f"rank {rank} {what}")
        for name in ("logit_scale", "logit_bias"):
            torch.testing.assert_close(ours[3][name], theirs[3][name], **TOL, msg=f"rank {rank} {name} grad")


def test_siglip_comm_bytes(two_ranks):
    k, b, item = 2, 4, 8
    for result in two_ranks:
        sent = result["configs"]["siglip"]["steps"][0]["bytes"]
        assert sent["features"] == (k - 1) * 2 * b * D * item  # one all_gather of [image | text]
        assert sent["indices"] == 0  # no indices shipped
        assert sent["state"] == 2 * (k - 1) * (k * b) * item // k  # the objective's N row sums
        assert sent["total"] == sum(sent[key] for key in ("header", "features", "indices", "state"))
