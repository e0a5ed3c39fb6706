"""The autograd objectives (objective.py): ``impl="autograd"`` equals the fused losses, and every autograd loss
(dcl, hard negatives, direction weights included) equals itself in one process on 2 and 3 gloo ranks, in
float64 over 3 steps with γ < 1 and repeated indices. DCL, hard negatives and direction weights also equal their
formulas written out here, independently of the library."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from fastclip.losses import LossInputError, build_loss, reshard_states

from dist_utils import run_distributed
from helpers import assert_value_and_grads, randomize_tempnet_heads

TOL = dict(rtol=1e-10, atol=1e-10)
D, DATA_SIZE = 5, 16
# Global batches of 6 (2 ranks x 3, 3 ranks x 2); index 7 twice in steps 0 and 1, 4 twice in step 2.
STEPS = [([3, 7, 12, 5, 7, 0], 0), ([7, 3, 15, 7, 12, 11], 1), ([0, 4, 3, 9, 4, 8], 2)]
STATE = dict(data_size=DATA_SIZE, gamma_min=0.3, gamma_decay_epochs=2)
# group ids per step (a data index keeps its group): several captions of one image, positives of each other
GROUPS = [[1, 2, 1, 3, 2, 4], [2, 1, 5, 2, 1, 6], [4, 0, 1, 7, 0, 8]]
# (name, options) run with both implementations
BOTH = {
    "openclip": ("openclip", {}),
    "openclip-atanh": ("openclip", {"similarity": "atanh", "temperature": 0.5, "learn_temperature": True}),
    "siglip": ("siglip", {}),
    "v0": ("fastclip-v0", {**STATE, "temperature": 0.1}),
    "v1": ("fastclip-v1", {**STATE, "temperature": 0.1}),
    "v1-atanh": ("fastclip-v1", {**STATE, "similarity": "atanh"}),
    "v3": ("fastclip-v3", {**STATE, "temperature": 0.1, "rho": 1.5}),
    "v2": ("fastclip-v2", {**STATE, "temperature": 0.3, "lr_tau": 0.05, "rho": 1.0}),
    "tempnet": ("fastclip-tempnet", {**STATE, "temperature": 0.3, "rho": 1.0, "embed_dim": D, "tempnet_hidden": 6}),
    "v3-separate": ("fastclip-v3", {**STATE, "temperature": 0.1, "rho": 1.5, "separate_temperatures": True}),
    "openclip-groups": ("openclip", {}),
    "siglip-groups": ("siglip", {}),
    "v3-groups": ("fastclip-v3", {**STATE, "temperature": 0.1, "rho": 1.5}),
    "v2-groups": ("fastclip-v2", {**STATE, "temperature": 0.3, "lr_tau": 0.05, "rho": 1.0}),
}
# autograd only
ONLY = {
    "dcl": ("dcl", {"temperature": 0.1}),
    "dcl-fixed": ("dcl", {"temperature": 0.2, "learn_temperature": False}),
    "dcl-hard": ("dcl", {"hard_negative_topk": 3, "hard_negative_beta": 0.5}),
    "openclip-hard": ("openclip", {"hard_negative_topk": 2, "direction_weights": [0.7, 0.3]}),
    "v3-weighted": ("fastclip-v3", {**STATE, "temperature": 0.1, "direction_weights": [0.2, 0.8]}),
    "dcl-queue": ("dcl", {"queue_size": 4}),  # fills in step 0, wraps around in steps 1-2
    "openclip-queue": ("openclip", {"queue_size": 9, "hard_negative_topk": 5}),
    "v3-queue": ("fastclip-v3", {**STATE, "temperature": 0.1, "queue_size": 8}),
    "v1-queue": ("fastclip-v1", {**STATE, "temperature": 0.1, "queue_size": 3}),
    "dcl-distill": ("dcl", {"distill_alpha": 0.4, "queue_size": 5}),
    "openclip-distill": ("openclip", {"distill_alpha": 0.4}),
    "openclip-moco": ("openclip", {"queue_size": 6}),  # the queue holds the momentum model's features
    "dcl-queue-groups": ("dcl", {"queue_size": 5}),
    "v2-weighted": ("fastclip-v2", {**STATE, "temperature": 0.3, "lr_tau": 0.05, "direction_weights": [1, 3]}),
}
AUTOGRAD = {**BOTH, **ONLY}
MOMENTUM = {"dcl-distill", "openclip-distill", "openclip-moco"}  # called with a momentum model's features


def make(case: str, impl: str):
    name, options = AUTOGRAD[case]
    options = dict(options)
    if name not in ("openclip", "dcl", "siglip"):
        options["data_size"] = DATA_SIZE
    loss_fn = build_loss(name, impl=impl, **options).double()
    if name == "fastclip-tempnet":  # the same non-constant heads for both implementations and on every rank
        randomize_tempnet_heads(loss_fn)
    return loss_fn


def batch(step: int, n: int):
    gen = torch.Generator().manual_seed(200 + step)
    e1 = F.normalize(torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1)
    e2 = F.normalize(e1 + 0.8 * torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1)
    return e1, e2


def momentum_batch(step: int, n: int):
    """The momentum model's features of the step's rows: near the online ones."""
    gen = torch.Generator().manual_seed(300 + step)
    return tuple(
        F.normalize(x + 0.3 * torch.randn(x.shape, generator=gen, dtype=x.dtype), dim=1) for x in batch(step, n)
    )


def run_steps(loss_fn, rows: slice, momentum: bool = False, groups: bool = False):
    records = []
    for step, (indices, epoch) in enumerate(STEPS):
        e1, e2 = batch(step, len(indices))
        e1, e2 = e1[rows].clone().requires_grad_(), e2[rows].clone().requires_grad_()
        for p in loss_fn.parameters():
            p.grad = None
        extra = {"momentum": tuple(m[rows] for m in momentum_batch(step, len(indices)))} if momentum else {}
        if groups:
            extra["groups"] = torch.tensor(GROUPS[step])[rows]
        loss = loss_fn(e1, e2, torch.tensor(indices)[rows], epoch=epoch, **extra)
        loss.backward()
        params = {n: p.grad.clone() for n, p in loss_fn.named_parameters() if p.grad is not None}
        records.append({"loss": loss.detach(), "e1": e1.grad, "e2": e2.grad, "params": params,
                        "metrics": dict(loss_fn.metrics)})  # fmt: skip
    state = loss_fn.state_dict()
    queue = {k: v for k, v in state.items() if k.startswith("queue.")}
    return {"steps": records, "state": state.get("_extra_state"), "queue": queue}


def ranks_run(rank, world_size):
    b = len(STEPS[0][0]) // world_size
    rows = slice(rank * b, (rank + 1) * b)
    return {case: run_steps(make(case, "autograd"), rows, case in MOMENTUM, "groups" in case) for case in AUTOGRAD}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(ranks_run, 2)


@pytest.fixture(scope="module")
def three_ranks():
    return run_distributed(ranks_run, 3)


def assert_state_equal(got, want, label):
    if want is None:
        assert got is None, label
        return
    assert torch.equal(got["seen"], want["seen"]), label
    for field, value in want["fields"].items():
        torch.testing.assert_close(got["fields"][field], value, **TOL, msg=f"{label} state {field}")


@pytest.mark.parametrize("case", list(BOTH))
def test_autograd_equals_fused_in_one_process(case):
    grouped = "groups" in case
    fused = run_steps(make(case, "fused"), slice(None), groups=grouped)
    autograd = run_steps(make(case, "autograd"), slice(None), groups=grouped)
    for step, (f, a) in enumerate(zip(fused["steps"], autograd["steps"])):
        where = f"{case} step {step}"
        torch.testing.assert_close(a["loss"], f["loss"], **TOL, msg=f"{where} value")
        for name in f["metrics"].keys() & a["metrics"].keys():  # (τ quantiles: the same 2N anchors' in both)
            torch.testing.assert_close(a["metrics"][name], f["metrics"][name], **TOL, msg=f"{where} metric {name}")
        assert "objective" in a["metrics"].keys() & f["metrics"].keys(), where
        torch.testing.assert_close(a["e1"], f["e1"], **TOL, msg=f"{where} image grad")
        torch.testing.assert_close(a["e2"], f["e2"], **TOL, msg=f"{where} text grad")
        assert a["params"].keys() == f["params"].keys(), where
        for name in f["params"]:
            torch.testing.assert_close(a["params"][name], f["params"][name], **TOL, msg=f"{where} {name} grad")
    assert_state_equal(autograd["state"], fused["state"], case)


def assert_ranks_equal_one_process(per_rank, single, world_size, label):
    b = len(STEPS[0][0]) // world_size
    for step, want in enumerate(single["steps"]):
        got = [r["steps"][step] for r in per_rank]
        where = f"{label} step {step}"
        for rec in got:  # every rank computes the global loss
            torch.testing.assert_close(rec["loss"], want["loss"], **TOL, msg=f"{where} value")
            assert rec["metrics"].keys() == want["metrics"].keys(), where
            for name, value in want["metrics"].items():  # the global batch's (τ quantiles: of its 2N anchors)
                torch.testing.assert_close(rec["metrics"][name], value, **TOL, msg=f"{where} metric {name}")
        for key in ("e1", "e2"):  # this rank's rows: K × its share, which DDP's average divides by K
            stacked = torch.cat([rec[key] for rec in got]) / world_size
            torch.testing.assert_close(stacked, want[key], **TOL, msg=f"{where} {key} grad")
        for name, value in want["params"].items():
            mean = sum(rec["params"][name] for rec in got) / world_size
            torch.testing.assert_close(mean, value, **TOL, msg=f"{where} {name} grad")
        assert len(got[0]["e1"]) == b
    if single["state"] is not None:
        merged = reshard_states([r["state"] for r in per_rank], 1)[0]
        assert_state_equal(merged, single["state"], label)
    for r in per_rank:  # the feature queue: the same on every rank
        assert r["queue"].keys() == single["queue"].keys(), label
        for key, value in single["queue"].items():
            torch.testing.assert_close(r["queue"][key], value, **TOL, msg=f"{label} {key}")


@pytest.mark.parametrize("case", list(AUTOGRAD))
def test_two_ranks_equal_one_process(two_ranks, case):
    single = run_steps(make(case, "autograd"), slice(None), case in MOMENTUM, "groups" in case)
    assert_ranks_equal_one_process([r[case] for r in two_ranks], single, 2, case)


@pytest.mark.parametrize("case", list(AUTOGRAD))
def test_three_ranks_equal_one_process(three_ranks, case):
    single = run_steps(make(case, "autograd"), slice(None), case in MOMENTUM, "groups" in case)
    assert_ranks_equal_one_process([r[case] for r in three_ranks], single, 3, case)


# --- the formulas, written out independently -----------------------------------------------------------------


def reference_loss(e1, e2, idx, tau, *, decoupled, copies_negative, topk=None, beta=None, weights=(1.0, 1.0)):
    """Per-anchor loops over the global batch: ℓ_i = −z_ii + log(Σ_{j∈neg} w_ij e^{z_ij} [+ e^{z_ii}])."""
    n = len(idx)
    z = (e1 @ e2.T) / tau
    directions = []
    for logits in (z, z.T):
        terms = []
        for i in range(n):
            negatives = [j for j in range(n) if j != i and (copies_negative or idx[j] != idx[i])]
            if topk is not None:
                negatives = sorted(negatives, key=lambda j: -logits[i, j].item())[:topk]
            values = torch.stack([logits[i, j] for j in negatives])
            if beta is not None:
                w = torch.exp(beta * values) / torch.exp(beta * values).mean()
                mass = (w * torch.exp(values)).sum()
            else:
                mass = torch.exp(values).sum()
            if not decoupled:
                mass = mass + torch.exp(logits[i, i])
            terms.append(torch.log(mass) - logits[i, i])
        directions.append(torch.stack(terms).mean())
    return (weights[0] * directions[0] + weights[1] * directions[1]) / (weights[0] + weights[1])


REFERENCE_CASES = [
    ("dcl", {}, dict(decoupled=True, copies_negative=False)),
    ("dcl", {"hard_negative_topk": 2}, dict(decoupled=True, copies_negative=False, topk=2)),
    ("dcl", {"hard_negative_beta": 1.5}, dict(decoupled=True, copies_negative=False, beta=1.5)),
    (
        "openclip",
        {"hard_negative_beta": 0.5, "hard_negative_topk": 3},
        dict(decoupled=False, copies_negative=True, beta=0.5, topk=3),
    ),  # fmt: skip
    ("openclip", {"direction_weights": [0.7, 0.3]}, dict(decoupled=False, copies_negative=True, weights=(0.7, 0.3))),
    ("dcl", {"direction_weights": [0.0, 2.0]}, dict(decoupled=True, copies_negative=False, weights=(0.0, 2.0))),
]


@pytest.mark.parametrize(("name", "options", "formula"), REFERENCE_CASES)
def test_the_objective_is_its_formula(name, options, formula):
    idx = torch.tensor([3, 7, 12, 5, 7, 0, 9])
    e1, e2 = batch(9, len(idx))
    e1.requires_grad_(), e2.requires_grad_()
    loss_fn = build_loss(name, temperature=0.2, **options).double()
    got = loss_fn(e1, e2, idx)
    want = reference_loss(e1, e2, idx.tolist(), torch.exp(-loss_fn.logit_scale), **formula)
    assert_value_and_grads(got, want, (e1, e2, loss_fn.logit_scale), **TOL)


@pytest.mark.parametrize("name", ["dcl", "openclip"])
def test_rows_of_one_group_are_no_negatives_of_each_other(name):
    """groups: the reference formula with the group ids in place of the indices (openclip: only the group, not
    another copy of the same index, leaves the denominator; here they coincide)."""
    idx, groups = torch.tensor([3, 7, 12, 5, 7, 0, 9]), torch.tensor([1, 2, 1, 3, 2, 3, 4])
    e1, e2 = (x.requires_grad_() for x in batch(9, len(idx)))
    loss_fn = build_loss(name, temperature=0.2).double()
    got = loss_fn(e1, e2, idx, groups=groups)
    tau = torch.exp(-loss_fn.logit_scale)
    want = reference_loss(e1, e2, groups.tolist(), tau, decoupled=name == "dcl", copies_negative=False)
    assert_value_and_grads(got, want, (e1, e2), **TOL)
    with pytest.raises(LossInputError, match="groups must be integer ids"):
        loss_fn(e1, e2, idx, groups=groups[:3])


def test_dcl_has_the_gradient_of_fastclip_v1_at_gamma_1():
    """v1 with γ = 1 (u is the batch's own g) and ε = 0 has the gradient of (1/2N) Σ log g_i = DCL − log(N−1)."""
    idx = torch.tensor([0, 1, 2, 3, 4, 2])
    e1, e2 = batch(3, len(idx))
    dcl = build_loss("dcl", temperature=0.1, learn_temperature=False).double()
    v1 = build_loss("fastclip-v1", data_size=8, temperature=0.1, gamma_min=1.0, eps=0.0).double()
    grads = []
    for loss_fn in (dcl, v1):
        a, b = e1.clone().requires_grad_(), e2.clone().requires_grad_()
        grads.append(torch.autograd.grad(loss_fn(a, b, idx), (a, b)))
    for g_dcl, g_v1 in zip(*grads):
        torch.testing.assert_close(g_dcl, g_v1, **TOL)
    assert dcl.metrics["loss"] > 0


@pytest.mark.parametrize(
    ("name", "options", "words"),
    [
        ("dcl", {"impl": "fused"}, "no fused implementation"),
        ("openclip", {"impl": "fused", "hard_negative_topk": 2}, "autograd implementation only"),
        ("fastclip-v3", {"impl": "autograd", "compat": "reference"}, "use impl fused"),
        ("openclip", {"impl": "autograd", "fused_kernels": True}, "needs impl fused"),
        ("dcl", {"direction_weights": [0.0, 0.0]}, "positive sum"),
        ("dcl", {"direction_weights": [1.0]}, "direction_weights"),
        ("siglip", {"direction_weights": [1.0, 2.0]}, "no directions"),
        ("dcl", {"hard_negative_topk": 0}, "hard_negative_topk"),
        ("dcl", {"hard_negative_beta": -1.0}, "hard_negative_beta"),
        ("openclip", {"impl": "eager"}, "impl must be one of"),
    ],
)
def test_a_combination_that_makes_no_sense_is_one_error_naming_it(name, options, words):
    with pytest.raises(ValueError, match=words):
        build_loss(name, data_size=8, **options) if name.startswith("fastclip") else build_loss(name, **options)


def test_impl_is_chosen_by_the_options():
    assert build_loss("openclip").impl == "fused"
    assert build_loss("openclip", hard_negative_topk=4).impl == "autograd"
    assert build_loss("openclip", direction_weights=[1, 1]).impl == "fused"  # equal weights: the symmetric loss
    assert build_loss("dcl").impl == "autograd"
    assert build_loss("fastclip-v3", data_size=4, direction_weights=[2, 1]).impl == "autograd"


def test_a_learned_temperature_of_dcl_moves_and_a_fixed_one_does_not():
    e1, e2 = (x.requires_grad_() for x in batch(4, 6))
    learned, fixed = build_loss("dcl").double(), build_loss("dcl", learn_temperature=False).double()
    for loss_fn in (learned, fixed):
        loss_fn(e1, e2, torch.arange(6)).backward()
    assert learned.logit_scale.grad is not None and learned.logit_scale.grad.abs() > 0
    assert fixed.logit_scale.grad is None
    assert math.isclose(float(fixed.temperature()), 0.07, rel_tol=1e-7)  # (logit_scale made in float32)


# --- the feature queue --------------------------------------------------------------------------------------


def test_dcl_with_a_queue_is_its_formula_over_three_steps():
    """Anchor i's negatives: the batch's other samples, then every queued row of another sample (oldest pushed
    first, the last Q kept), written out with a Python list as the queue."""
    loss_fn = build_loss("dcl", temperature=0.2, queue_size=4).double()
    queued = []  # (index, image, text)
    for step, (indices, _) in enumerate(STEPS):
        e1, e2 = (x.requires_grad_() for x in batch(step, len(indices)))
        got = loss_fn(e1, e2, torch.tensor(indices))
        tau, terms = torch.exp(-loss_fn.logit_scale), []
        for anchors, candidates, queued_of in ((e1, e2, 2), (e2, e1, 1)):
            per_anchor = []
            for i, index in enumerate(indices):
                z = [anchors[i] @ candidates[j] / tau for j in range(len(indices)) if indices[j] != index]
                z += [anchors[i] @ row[queued_of] / tau for row in queued if row[0] != index]
                per_anchor.append(torch.logsumexp(torch.stack(z), 0) - anchors[i] @ candidates[i] / tau)
            terms.append(torch.stack(per_anchor).mean())
        assert_value_and_grads(got, (terms[0] + terms[1]) / 2, (e1, e2, loss_fn.logit_scale), **TOL)
        queued = (queued + [(index, e1[k].detach(), e2[k].detach()) for k, index in enumerate(indices)])[-4:]


@pytest.mark.parametrize("case", ["dcl-queue", "v3-queue"])
def test_a_resumed_queue_continues_exactly(case):
    """Two steps, state_dict into a new loss, the third step: the same as three steps in one go."""
    straight = run_steps(make(case, "autograd"), slice(None))
    first = make(case, "autograd")
    for step, (indices, epoch) in enumerate(STEPS[:2]):
        first(*batch(step, len(indices)), torch.tensor(indices), epoch=epoch)
    resumed = make(case, "autograd")
    resumed.load_state_dict(first.state_dict())
    indices, epoch = STEPS[2]
    e1, e2 = (x.requires_grad_() for x in batch(2, len(indices)))
    loss = resumed(e1, e2, torch.tensor(indices), epoch=epoch)
    loss.backward()
    want = straight["steps"][2]
    assert torch.equal(loss.detach(), want["loss"]) and torch.equal(e1.grad, want["e1"])
    for key, value in straight["queue"].items():
        assert torch.equal(resumed.state_dict()[key], value), key


@pytest.mark.parametrize("case", ["dcl-queue", "v3-queue", "v2"])
def test_rollback_restores_the_queue_and_the_state(case):
    loss_fn = make(case, "autograd")
    indices, epoch = STEPS[0]
    loss_fn(*batch(0, len(indices)), torch.tensor(indices), epoch=epoch)
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in loss_fn.state_dict().items()}
    for undo in (torch.tensor(True), None):  # the device form (a flag), then the host form
        loss_fn.begin_step()
        for step in (1, 2):
            indices, epoch = STEPS[step]
            loss_fn(*batch(step, len(indices)), torch.tensor(indices), epoch=epoch)
        assert str(loss_fn.state_dict()) != str(before)  # (the calls wrote)
        loss_fn.rollback(undo)
        after = loss_fn.state_dict()
        for key, value in before.items():
            if key == "_extra_state":
                assert_state_equal(after[key], value, case)
            else:
                assert torch.equal(after[key], value), key
    loss_fn.begin_step()  # kept where the flag is false, and after commit_step
    loss_fn(*batch(1, 6), torch.tensor(STEPS[1][0]), epoch=1)
    kept = {k: v.clone() for k, v in loss_fn.state_dict().items() if k.startswith("queue.")}
    loss_fn.rollback(torch.tensor(False))
    assert all(torch.equal(loss_fn.state_dict()[k], v) for k, v in kept.items())


@pytest.mark.parametrize("case", ["dcl-queue", "v2"])
def test_a_step_is_begun_before_it_is_undone_and_ended_before_the_next_begins(case):
    """rollback() without begin_step() undid nothing, silently; begin_step() every step without commit_step()
    journaled every write since (each holding queue rows): both are refused, and an ended step journals nothing."""
    loss_fn = make(case, "autograd")
    indices, epoch = STEPS[0]
    with pytest.raises(RuntimeError, match=r"rollback\(\) without begin_step\(\): nothing was journaled"):
        loss_fn.rollback()
    loss_fn.begin_step()
    loss_fn(*batch(0, len(indices)), torch.tensor(indices), epoch=epoch)
    with pytest.raises(RuntimeError, match=r"begin_step\(\) while the last step's writes are journaled"):
        loss_fn.begin_step()
    loss_fn.commit_step()
    loss_fn(*batch(1, len(STEPS[1][0])), torch.tensor(STEPS[1][0]), epoch=1)  # after the step: not journaled
    assert all(part.journal is None for part in loss_fn.journaled_parts())
    with pytest.raises(RuntimeError, match="without begin_step"):
        loss_fn.rollback()
    loss_fn.begin_step()  # a new step after commit_step
    loss_fn.rollback()


def test_a_distilling_loss_back_in_training_mode_asks_for_momentum_again():
    """After an eval-mode call (no momentum needed: the in-batch objective), a training call without momentum=
    trained without distillation, silently: whether the call needs momentum is part of what the handshake agrees."""
    loss_fn = build_loss("dcl", data_size=20, distill_alpha=0.4).double()
    indices = torch.tensor(STEPS[0][0])
    e1, e2 = batch(0, len(indices))
    loss_fn.eval()
    loss_fn(e1, e2, indices)
    loss_fn.train()
    with pytest.raises(LossInputError, match="distill_alpha needs the momentum model's features"):
        loss_fn(e1, e2, indices)
    loss_fn(e1, e2, indices, momentum=(e1, e2))
    # eval mode is the in-batch objective with one-hot targets, momentum features passed or not (they distilled)
    loss_fn.eval()
    shuffled = (e1.flip(0), e2.flip(0))
    assert loss_fn(e1, e2, indices, momentum=shuffled).item() == loss_fn(e1, e2, indices).item()


@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_non_finite_momentum_features_are_named_like_the_features(mode):
    """A NaN in the momentum towers' features made the loss NaN without a word: its rows are checked with the
    features' (the state untouched in eager mode)."""
    from fastclip.losses import NonFiniteFeaturesError

    loss_fn = build_loss("dcl", data_size=20, distill_alpha=0.4, validate=mode).double()
    indices = torch.tensor(STEPS[0][0])
    e1, e2 = batch(0, len(indices))
    momentum = (e1.clone(), e2.clone())
    momentum[1][2, 3] = float("nan")
    said = "rank 0: text_features (or its momentum features) has non-finite values (NaN/Inf), first in row 2"
    with pytest.raises(NonFiniteFeaturesError, match=re.escape(said)):
        loss_fn(e1, e2, indices, momentum=momentum)
        loss_fn.check_inputs()  # deferred: read here
    assert math.isfinite(loss_fn(e1, e2, indices, momentum=(e1, e2)).item())


@pytest.mark.parametrize("decoupled", [False, True])
def test_distillation_is_its_formula_with_a_momentum_queue(decoupled):
    """ALBEF's targets over the positive, the batch's negatives and the queue (which holds the momentum
    features): ℓ_i = −Σ_j y_ij z_ij + log Σ_{j∈D} e^{z_ij}, D the candidates (InfoNCE) or the negatives (DCL)."""
    alpha, q = 0.3, 4
    loss_fn = build_loss(
        "dcl" if decoupled else "openclip", temperature=0.2, distill_alpha=alpha, queue_size=q
    ).double()
    queued = []  # (index, momentum image, momentum text)
    for step, (indices, _) in enumerate(STEPS):
        e1, e2 = (x.requires_grad_() for x in batch(step, len(indices)))
        m1, m2 = momentum_batch(step, len(indices))
        got = loss_fn(e1, e2, torch.tensor(indices), momentum=(m1, m2))
        tau, terms = torch.exp(-loss_fn.logit_scale), []
        for anchors, candidates, m_anchors, m_candidates, of in ((e1, e2, m1, m2, 2), (e2, e1, m2, m1, 1)):
            per_anchor = []
            for i, index in enumerate(indices):
                others = [j for j in range(len(indices)) if j != i and (not decoupled or indices[j] != index)]
                keys = [candidates[i]] + [candidates[j] for j in others]  # the positive first
                m_keys = [m_candidates[i]] + [m_candidates[j] for j in others]
                for row in queued:
                    if row[0] != index:
                        keys.append(row[of])
                        m_keys.append(row[of])
                z = torch.stack([anchors[i] @ k for k in keys]) / tau
                soft = torch.softmax(torch.stack([m_anchors[i] @ k for k in m_keys]) / tau.detach(), 0)
                y = alpha * soft + (1 - alpha) * F.one_hot(torch.tensor(0), len(keys)).to(soft.dtype)
                denominator = torch.logsumexp(z[1:] if decoupled else z, 0)
                per_anchor.append(denominator - (y * z).sum())
            terms.append(torch.stack(per_anchor).mean())
        assert_value_and_grads(got, (terms[0] + terms[1]) / 2, (e1, e2, loss_fn.logit_scale), **TOL)
        queued = (queued + [(index, m1[k], m2[k]) for k, index in enumerate(indices)])[-q:]


def test_distillation_without_momentum_features_is_one_error():
    loss_fn = build_loss("dcl", distill_alpha=0.4)
    with pytest.raises(LossInputError, match="momentum="):
        loss_fn(*(x.float() for x in batch(0, 6)), torch.arange(6))
    with pytest.raises(ValueError, match="distill_alpha and hard_negative"):
        build_loss("dcl", distill_alpha=0.4, hard_negative_topk=2)
    with pytest.raises(ValueError, match="distill_alpha must be in"):
        build_loss("openclip", distill_alpha=1.5)


def test_in_eval_mode_the_queue_and_the_soft_targets_are_left_out():
    """A validation loss (eval mode) is the in-batch objective with one-hot targets, pushes nothing, and needs no
    momentum features: the trainer's evaluation has none (it failed on distill_alpha before)."""
    loss_fn = build_loss("dcl", temperature=0.2, queue_size=4, distill_alpha=0.3).double()
    for step, (indices, _) in enumerate(STEPS[:2]):  # a queue with entries
        loss_fn(*batch(step, len(indices)), torch.tensor(indices), momentum=momentum_batch(step, len(indices)))
    queued = {k: v.clone() for k, v in loss_fn.state_dict().items() if k.startswith("queue.")}
    indices = torch.tensor(STEPS[2][0])
    e1, e2 = batch(2, len(indices))
    loss_fn.eval()
    got = loss_fn(e1, e2, indices)
    want = build_loss("dcl", temperature=0.2).double()(e1, e2, indices)
    assert torch.allclose(got, want, rtol=1e-12, atol=0) and not torch.allclose(got, want * 1.01)
    assert all(torch.equal(loss_fn.state_dict()[k], v) for k, v in queued.items())
    loss_fn.train()
    assert not torch.allclose(loss_fn(e1, e2, indices, momentum=momentum_batch(2, len(indices))), want, rtol=1e-6)


def test_a_queue_where_it_is_not_defined_is_refused():
    with pytest.raises(TypeError, match="queue_size.*per-sample temperatures"):
        build_loss("fastclip-v2", data_size=8, queue_size=4)
    with pytest.raises(ValueError, match="queue_size"):
        build_loss("dcl", queue_size=0)
    with pytest.raises(ValueError, match="autograd implementation only"):
        build_loss("fastclip-v3", data_size=8, queue_size=4, impl="fused")
    loss_fn = build_loss("dcl", queue_size=4)
    with pytest.raises(RuntimeError, match="queue_size"):
        loss_fn.load_state_dict(build_loss("dcl", queue_size=8).state_dict() | _pushed(8))


def _pushed(size):
    loss_fn = build_loss("dcl", queue_size=size)
    loss_fn(*(x.float() for x in batch(0, 6)), torch.arange(6))
    return {k: v for k, v in loss_fn.state_dict().items() if k.startswith("queue.")}


# --- what a rank computes and sends ---------------------------------------------------------------------------


def anchors_run(rank, world_size):
    """One training call of dcl and of v3 (after a first call, which adds the handshake): the similarity blocks the
    objective sees and the collectives the call (forward and backward) makes."""
    from fastclip.losses import objective
    from fastclip.losses.byte_counter import CollectiveByteCounter

    shapes, pairs = [], objective.GlobalFeatures.pairs

    def recorded(self):
        out = pairs(self)
        shapes.append(tuple(out.cos.shape))
        return out

    objective.GlobalFeatures.pairs = recorded
    b = len(STEPS[0][0]) // world_size
    rows, out = slice(rank * b, (rank + 1) * b), {}
    for case in ("dcl", "v3"):
        loss_fn = make(case, "autograd")
        for step, (indices, epoch) in enumerate(STEPS[:2]):
            e1, e2 = (x[rows].clone().requires_grad_() for x in batch(step, len(indices)))
            shapes.clear()
            with CollectiveByteCounter() as counter:
                loss_fn(e1, e2, torch.tensor(indices)[rows], epoch=epoch).backward()
        out[case] = {"shapes": list(shapes), "calls": dict(counter.calls), "bytes": counter.total,
                     "ledger": dict(loss_fn.comm_bytes)}  # fmt: skip
    return out


def test_each_rank_computes_its_own_anchors_rows_and_one_all_to_all():
    """2 ranks, B = 3, N = 6: the objective sees [2, B, N] blocks (not the N×N batch on every rank); a step makes
    the feature all_gather, the end-of-call all_reduce (value, metrics, new state rows), for v3 the old state rows'
    all_reduce, and in the backward one all_to_all of the blocks' gradient columns; comm_bytes counts them all."""
    for result in run_distributed(anchors_run, 2):
        for case, state in (("dcl", 0), ("v3", 1)):
            got = result[case]
            assert got["shapes"] == [(2, 3, 6)], case
            calls = {name.replace("_into_tensor", "_single").replace("_tensor", "_single"): n
                     for name, n in got["calls"].items()}  # fmt: skip
            assert calls == {"all_gather_single": 1, "all_reduce": 1 + state, "all_to_all_single": 1}, case
            assert got["ledger"]["gradients"] == 2 * 3 * 6 * 8 // 2, case  # (K−1)/K of [2, B, N] float64
            assert got["ledger"]["total"] == got["bytes"], case
