"""fastclip.losses under real torch.distributed (gloo) processes, float64.

Two spawns in all (each runs many configurations in a loop): 2 ranks and 3 ranks. Contract checked: with
every rank back-propagating its own loss and gradients averaged over ranks (as DDP does), feature and
temperature gradients, loss values, objectives and the reassembled per-sample state equal those of ONE
process on the rank-major concatenated batch, to 1e-10, over 3 steps with γ < 1 and repeated indices.
"""

from __future__ import annotations

import gc
import math
import struct

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastclip.losses import LossInputError, NonFiniteFeaturesError, build_loss, reshard_states
from fastclip.losses.byte_counter import CollectiveByteCounter

from dist_utils import run_distributed
from helpers import randomize_tempnet_heads

TOL = dict(rtol=1e-10, atol=1e-10)
D = 5
DATA_SIZE = 16
# Global batches of 8 (2 ranks x 4); 7 sits on both ranks in step 0, 3 twice in step 1, 7 twice on rank 1 in step 2.
STEPS_2 = [([3, 7, 12, 5, 9, 7, 0, 14], 0), ([7, 3, 15, 2, 12, 11, 5, 3], 1), ([0, 1, 3, 7, 7, 8, 9, 10], 2)]
# Global batches of 9 (3 ranks x 3) for the 3-rank run.
STEPS_3 = [([1, 4, 9, 4, 13, 2, 15, 0, 6], 0), ([4, 6, 2, 11, 1, 3, 9, 9, 14], 1), ([2, 5, 4, 0, 6, 7, 8, 12, 1], 2)]
CONFIGS_2 = [
    (name, compat)
    for name in ("fastclip-v0", "fastclip-v1", "fastclip-v2", "fastclip-v3")
    for compat in ("faithful", "reference")
] + [("openclip", None), ("fastclip-v3", "separate"), ("fastclip-tempnet", "faithful")]
# the loss option fused_kernels on the ranks, against the eager loss in one process
CONFIGS_2 += [("fastclip-v3", "fused"), ("fastclip-v2", "fused")]
CONFIGS_3 = [
    ("fastclip-v3", "faithful"),
    ("fastclip-v2", "reference"),
    ("fastclip-v0", "reference"),
    ("openclip", None),
]


def make_loss(name, compat, **extra):
    options = dict(gamma_min=0.3, gamma_decay_epochs=2, compat=compat)
    if compat == "separate":  # v3 with one τ per modality (faithful only)
        options.update(compat="faithful", separate_temperatures=True)
    if compat == "fused":  # the exponentials as compiled kernels (faithful)
        options.update(compat="faithful", fused_kernels=True)
    if name == "fastclip-v2":
        options.update(temperature=0.3, lr_tau=0.05, rho=1.0)
    elif name == "fastclip-tempnet":
        options.update(temperature=0.3, rho=1.0, embed_dim=D, tempnet_hidden=6)
    elif name != "openclip":
        options.update(temperature=0.1)
    else:
        options = {}
    loss_fn = build_loss(name, data_size=DATA_SIZE, **options, **extra).double()
    if name == "fastclip-tempnet":  # the same non-constant heads on every rank
        randomize_tempnet_heads(loss_fn)
    return loss_fn


def step_batch(step: int, n: int):
    gen = torch.Generator().manual_seed(100 + step)
    e1 = F.normalize(torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1)
    e2 = F.normalize(e1 + 0.8 * torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1)
    return e1, e2


def run_steps(loss_fn, steps, rows: slice):
    """Per step: this process's rows of the global batch; returns losses, gradients, metrics, bytes, state."""
    records = []
    for step, (indices, epoch) in enumerate(steps):
        e1, e2 = step_batch(step, len(indices))
        e1 = e1[rows].clone().requires_grad_()
        e2 = e2[rows].clone().requires_grad_()
        for p in loss_fn.parameters():
            p.grad = None
        loss = loss_fn(e1, e2, torch.tensor(indices)[rows], epoch=epoch)
        loss.backward()
        scale = getattr(loss_fn, "logit_scale", None)
        heads = {n: p.grad.clone() for n, p in loss_fn.named_parameters() if n.startswith("tempnet_")}
        records.append(
            {
                "loss": loss.detach(),
                "e1": e1.grad,
                "e2": e2.grad,
                "heads": heads,
                "theta": None if scale is None or scale.grad is None else scale.grad.clone(),
                "metrics": dict(loss_fn.metrics),
                "bytes": dict(loss_fn.comm_bytes),
            }
        )
    state = loss_fn.state_dict().get("_extra_state")
    return {"steps": records, "state": state}


def run_configs(configs, steps, rank, world_size):
    b = len(steps[0][0]) // world_size
    rows = slice(rank * b, (rank + 1) * b)
    return {(name, compat): run_steps(make_loss(name, compat), steps, rows) for name, compat in configs}


# --- the 2-rank suite ------------------------------------------------------------------------------------------


def clip_loss_comparison(rank, world_size):
    from fastclip.compat import import_open_clip

    open_clip = import_open_clip()
    e1_all, e2_all = step_batch(7, 4 * world_size)
    rows = slice(4 * rank, 4 * rank + 4)
    out = {}
    ours = build_loss("openclip").double()
    theta0 = ours.logit_scale.detach().clone()
    for who in ("theirs", "ours"):
        e1 = e1_all[rows].clone().requires_grad_()
        e2 = e2_all[rows].clone().requires_grad_()
        if who == "theirs":
            theta = theta0.clone().requires_grad_()
            clip = open_clip.loss.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world_size)
            with CollectiveByteCounter() as counter:
                value = clip(e1, e2, theta.exp())
                value.backward()
            out["clip_bytes"] = counter.total
        else:
            theta = ours.logit_scale
            value = ours(e1, e2, None)
            value.backward()
        out[who] = (value.detach(), e1.grad, e2.grad, theta.grad.clone())
    ours.average_grads_()  # what DDP would do with logit_scale if the loss is not inside DDP
    out["averaged_theta_grad"] = ours.logit_scale.grad.clone()
    v3 = build_loss("fastclip-v3", data_size=DATA_SIZE).double()
    e1 = e1_all[rows].clone().requires_grad_()
    v3(e1, e2_all[rows].clone().requires_grad_(), torch.arange(4) + 4 * rank).backward()
    out["v3_bytes"] = dict(v3.comm_bytes)
    return out


BAD_CASES = {
    # name: (rank that misbehaves, how) -- every rank must raise the same error
    "index_out_of_range": 1,
    "negative_index": 0,
    "float_indices": 1,
    "features_3d": 0,
    "batch_size_differs": 1,
    "feature_size_differs": 0,
    "nan_features": 1,
}


def bad_inputs(rank, world_size):
    loss_fn = build_loss("fastclip-v3", data_size=DATA_SIZE).double()
    results = {}
    for case, culprit in BAD_CASES.items():
        e1, e2 = step_batch(0, 4)
        idx = torch.arange(4) + 4 * rank
        if rank == culprit:
            if case == "index_out_of_range":
                idx[2] = DATA_SIZE
            elif case == "negative_index":
                idx[1] = -3
            elif case == "float_indices":
                idx = idx.double()
            elif case == "features_3d":
                e1 = e1[:, :, None]
            elif case == "batch_size_differs":
                e1, e2, idx = *step_batch(0, 5), torch.arange(5) + 4
            elif case == "feature_size_differs":
                e1, e2 = e1[:, :4], e2[:, :4]
            elif case == "nan_features":
                e1[3, 0] = float("nan")
        try:
            loss_fn(e1, e2, idx)
            results[case] = ("no error", "")
        except LossInputError as error:
            results[case] = (type(error).__name__, str(error))
    e1, e2 = step_batch(0, 4)  # the group is still usable afterwards
    results["after"] = float(loss_fn(e1, e2, torch.arange(4) + 4 * rank))
    return results


# momentum=, groups= and data_size, wrong on one rank (the culprit): each was read as it came (momentum bytes read
# as the check words, buffers of other sizes in the gather: gloo aborts) or refused on that rank alone (the other
# waiting in the all_gather), or, for data_size, never compared (an index valid on one rank only hung the group)
OPTIONAL_CASES = {
    "data_size_differs": (1, "data_size differs across ranks (rank 0: 16, rank 1: 18)"),
    "data_size_differs_index_valid_on_one": (1, "data_size differs across ranks (rank 0: 16, rank 1: 18)"),
    "momentum_wrong_d": (
        1,
        "rank 1: momentum image features must be a float tensor of the features' shape [4, 5], got a 2-D tensor "
        "of shape [4, 6] of float64",
    ),
    "momentum_wrong_b": (0, "rank 0: momentum text features must be a float tensor of the features' shape [4, 5]"),
    "momentum_not_a_pair": (0, "rank 0: momentum must be a pair (momentum_image, momentum_text)"),
    "momentum_on_one_rank": (0, "momentum= (given or not) differs across ranks (rank 0: given, rank 1: not given)"),
    "momentum_missing_for_distill": (1, "rank 1: distill_alpha needs the momentum model's features"),
    "groups_on_one_rank": (0, "groups= (given or not) differs across ranks (rank 0: given, rank 1: not given)"),
    "groups_a_list": (1, "rank 1: groups must be integer ids [B] = [4], got something that is not a tensor"),
    "groups_float": (0, "rank 0: groups must be integer ids [B] = [4], got a 1-D tensor of shape [4] of float64"),
}


def bad_optional_inputs(rank, world_size):
    results = {}
    for case, (culprit, _) in OPTIONAL_CASES.items():
        options = {"distill_alpha": 0.4} if case == "momentum_missing_for_distill" else {}
        data_size = DATA_SIZE + 2 if case.startswith("data_size") and rank == culprit else DATA_SIZE
        name = "fastclip-v1" if case.startswith("data_size") else "dcl"  # (v1: u indexed by data_size)
        loss_fn = build_loss(name, data_size=data_size, **options).double()
        e1, e2 = step_batch(0, 4)
        idx = torch.arange(4) + 4 * rank
        momentum = groups = None
        if case.startswith("momentum") and case != "momentum_missing_for_distill" or "distill" in case:
            momentum = (e1.clone(), e2.clone())
        if case.startswith("groups"):
            groups = torch.arange(4) + 4 * rank
        if rank == culprit:
            if case == "data_size_differs_index_valid_on_one":
                idx[0] = DATA_SIZE + 1
            elif case == "momentum_wrong_d":
                momentum = (torch.cat([e1, e1[:, :1]], dim=1), e2)
            elif case == "momentum_wrong_b":
                momentum = (e1, e2[:3])
            elif case == "momentum_not_a_pair":
                momentum = e1
            elif case == "momentum_missing_for_distill":
                momentum = None
            elif case == "groups_a_list":
                groups = groups.tolist()
            elif case == "groups_float":
                groups = groups.double()
        elif case in ("momentum_on_one_rank", "groups_on_one_rank"):
            momentum = groups = None
        try:
            loss_fn(e1, e2, idx, momentum=momentum, groups=groups)
            results[case] = "no error"
        except LossInputError as error:
            results[case] = str(error)
    return results


def later_bad_calls(rank, world_size):
    """After the handshake a call makes only its data collectives; a bad value on one rank is named alike on both."""
    out = {}
    for mode in ("eager", "deferred"):
        loss_fn = build_loss("fastclip-v3", data_size=DATA_SIZE, validate=mode).double()
        e1, e2 = step_batch(0, 4)
        idx = torch.arange(4) + 4 * rank
        loss_fn(e1, e2, idx).backward()  # call 1: the structure handshake
        with CollectiveByteCounter() as counter:
            loss_fn(e1, e2, idx, epoch=1).backward()  # call 2
        out[mode] = {"calls": dict(counter.calls), "seconds": dict(counter.seconds), "bytes": dict(loss_fn.comm_bytes)}
        bad = idx.clone()
        if rank == 1:
            bad[2] = DATA_SIZE
        try:
            loss_fn(e1, e2, bad)  # call 3
            out[mode]["at_call"] = None
        except LossInputError as error:
            out[mode]["at_call"] = str(error)
        try:
            loss_fn.check_inputs()
            out[mode]["at_check"] = None
        except LossInputError as error:
            out[mode]["at_check"] = str(error)
        out[mode]["after"] = float(loss_fn(e1, e2, idx))  # the group is still usable
    return out


def shapes_changed_on_one_rank(rank, world_size):
    """Eager mode: a batch that shrinks on one rank after the handshake (an uneven last batch) is the same error on
    every rank, and the loss goes on as if that call had not been made: when both shrink, and with int32 indices
    on one rank, it equals a loss that never saw the bad call. The temperature network's heads, initialised with
    a different seed on each rank, are rank 0's after the first call."""
    out = {}
    for name in ("fastclip-v3", "openclip"):
        losses = [build_loss(name, data_size=DATA_SIZE).double() for _ in range(2)]
        e1, e2 = step_batch(0, 4)
        idx = torch.arange(4) + 4 * rank
        values = [float(loss_fn(e1, e2, idx)) for loss_fn in losses]  # call 1 of each: the handshake
        n = 4 if rank == 0 else 3
        try:
            losses[0](e1[:n], e2[:n], idx[:n])
            out[name] = {"error": None}
        except LossInputError as error:
            out[name] = {"error": str(error)}
        s1, s2 = step_batch(1, 3)
        small = torch.arange(3) + 3 * rank
        for step, ids in enumerate((small, small.to(torch.int32) if rank == 1 else small)):
            values += [float(losses[0](s1, s2, ids, epoch=step + 1)), float(losses[1](s1, s2, small, epoch=step + 1))]
        out[name]["values"] = values
    # openclip takes no indices: int32 on one rank from call 2 on costs one extra round, then none
    loss_fn = build_loss("openclip").double()
    out["openclip_bytes"] = []
    for step in range(4):
        ids = torch.arange(4) + 4 * rank
        loss_fn(e1, e2, ids.int() if rank == 1 and step >= 1 else ids)
        out["openclip_bytes"].append(loss_fn.comm_bytes["total"])
    # a call before the group (a warm-up on rank 0 only, with its own τ), then calls in it: one handshake on
    # every rank, rank 0's τ everywhere; a graph that holds the parameter from before the first call still
    # backpropagates (the broadcast writes nothing where the values already agree)
    loss_fn = build_loss("fastclip-v3", data_size=DATA_SIZE).double()
    with torch.no_grad():
        loss_fn.logit_scale.fill_(2.5 + rank)
    if rank == 0:
        from fastclip.losses.comm import Comm

        loss_fn.input_checks.structure(
            Comm(None, 1, 0), e1, e2, idx, data_size=DATA_SIZE, need_indices=True, min_global_batch=2
        )
    loss_fn(e1, e2, idx)
    out["pregroup_scale"] = float(loss_fn.logit_scale)
    same = build_loss("fastclip-v3", data_size=DATA_SIZE).double()
    (1e-3 * same.logit_scale**2 + same(e1, e2, idx)).backward()
    out["graph_before_first_call"] = same.logit_scale.grad is not None
    torch.manual_seed(rank + 1)  # "seed + rank", as many training scripts do
    tempnet = build_loss("fastclip-tempnet", data_size=DATA_SIZE, embed_dim=D).double()
    before = torch.cat([p.detach().reshape(-1) for p in tempnet.parameters()])
    e1, e2 = step_batch(0, 4)
    tempnet(e1, e2, torch.arange(4) + 4 * rank)
    out["tempnet"] = {"before": before, "after": torch.cat([p.detach().reshape(-1) for p in tempnet.parameters()])}
    return out


def state_made_before_the_group(rank, world_size):
    """A loss whose state was made before the process group (a state_dict() call: world size 1) and never written
    makes it anew for the group; one whose state was written there refuses."""
    from fastclip.losses.comm import Comm

    e1, e2 = step_batch(0, 4)
    idx = torch.arange(4) + 4 * rank
    made_early, fresh = (build_loss("fastclip-v3", data_size=DATA_SIZE).double() for _ in range(2))
    made_early.sample_state(Comm(None, 1, 0))  # what state_dict() before init_process_group does
    out = {"values": [float(made_early(e1, e2, idx)), float(fresh(e1, e2, idx))]}
    written = build_loss("fastclip-v3", data_size=DATA_SIZE).double()
    written.sample_state(Comm(None, 1, 0)).write(written.sample_state(Comm(None, 1, 0)).locate(idx), torch.zeros(4, 2))
    try:
        written(e1, e2, idx)
        out["written"] = None
    except RuntimeError as error:
        out["written"] = str(error)
    # a one-process checkpoint's state loaded before the group (it said a call wrote it)
    loaded = build_loss("fastclip-v3", data_size=DATA_SIZE).double()
    saved = written.sample_state(Comm(None, 1, 0)).state_dict()
    loaded.sample_state(Comm(None, 1, 0)).load_state_dict(saved)
    try:
        loaded(e1, e2, idx)
        out["loaded"] = None
    except RuntimeError as error:
        out["loaded"] = str(error)
    return out


def forgotten_average(rank, world_size):
    """A user's loop that steps the loss's τ (and heads) with or without averaging their gradients over the ranks:
    the call at which a LossInputError stopped it (None: it ran all its steps), and the error, per case."""
    cases = {  # name: (loss, its options, optimizer, lr)
        "v3 sgd": ("fastclip-v3", {}, torch.optim.SGD, 0.5),
        "v3 adamw": ("fastclip-v3", {}, torch.optim.AdamW, 1e-3),
        "openclip sgd": ("openclip", {}, torch.optim.SGD, 0.5),
        "tempnet sgd": ("fastclip-tempnet", {"embed_dim": D}, torch.optim.SGD, 0.5),
        "v3 sgd, unchecked": ("fastclip-v3", {"check_parameters": False}, torch.optim.SGD, 0.5),
        "v3 sgd, deferred": ("fastclip-v3", {"validate": "deferred"}, torch.optim.SGD, 0.5),
    }
    out = {}
    for case, (name, options, optimizer, lr) in cases.items():
        for average in (True, False):
            loss_fn = build_loss(name, data_size=DATA_SIZE, **options).double()
            opt = optimizer(loss_fn.parameters(), lr=lr)
            stopped, message = None, None
            for step in range(12):
                e1, e2 = step_batch(step, 8)  # each rank its own rows: its own τ-gradient
                e1, e2 = e1[4 * rank : 4 * rank + 4], e2[4 * rank : 4 * rank + 4]
                try:
                    loss = loss_fn(e1, e2, torch.arange(4) + 4 * rank)
                    loss_fn.check_inputs()  # deferred mode's read: it has no parameter check to raise
                except LossInputError as error:
                    stopped, message = step, str(error)
                    break
                opt.zero_grad()
                loss.backward()
                if average:
                    loss_fn.average_grads_()
                opt.step()
            out[f"{case} average={average}"] = (stopped, message)
    return out


BIG = 10**6


def big_data_size(rank, world_size):
    out = {}
    for name in ("fastclip-v3", "fastclip-v2"):
        loss_fn = build_loss(name, data_size=BIG)
        gen = torch.Generator().manual_seed(rank)
        for step in range(2):
            e1 = F.normalize(torch.randn(16, 8, generator=gen), dim=1).requires_grad_()
            e2 = F.normalize(torch.randn(16, 8, generator=gen), dim=1).requires_grad_()
            idx = torch.randint(0, BIG, (16,), generator=gen)
            idx[0], idx[1] = BIG - 1 - rank, rank  # both ends of the range
            loss_fn(e1, e2, idx, epoch=step).backward()
        state = loss_fn.state_dict()["_extra_state"]
        out[name] = {
            "slots": {k: v.numel() for k, v in state["fields"].items()} | {"seen": state["seen"].numel()},
            "seen_total": int(state["seen"].sum()),
        }
        if name == "fastclip-v3":
            out["v3_state"] = state
    # the longest tensor on this rank (a per-sample table is [slots, fields]: its length is its slot count)
    out["longest_tensor"] = max(o.shape[0] for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dim())
    return out


def one_rank_alone_changes(rank, world_size):
    """A rank that switches to eval() alone (it computed another objective without a word; eager: the handshake
    names the mode on every rank), and in deferred mode a rank whose batch shrinks or that switches alone (gloo
    aborted the process inside the handshake's all_gather, or it hung), then every rank shrinking and switching
    together, which must just work, equal to eager mode's calls bitwise."""

    def attempt(fn):
        try:
            return float(fn())
        except LossInputError as error:
            return str(error)

    e1, e2 = step_batch(0, 4)
    idx = torch.arange(4) + 4 * rank
    out = {}
    eager = build_loss("fastclip-v3", data_size=DATA_SIZE).double()
    eager(e1, e2, idx)
    eager.train(rank == 0)
    out["eager_alone"] = attempt(lambda: eager(e1, e2, idx))
    eager.eval()
    out["eager_together"] = attempt(lambda: eager(e1, e2, idx))
    for what in ("shrinks", "eval", "eval_autograd"):  # (autograd v3: other collectives in eval mode)
        impl = {"impl": "autograd"} if what == "eval_autograd" else {}
        deferred = build_loss("fastclip-v3", data_size=DATA_SIZE, validate="deferred", **impl).double()
        deferred(e1, e2, idx)
        n = 3 if what == "shrinks" and rank == 1 else 4
        deferred.train(not (what.startswith("eval") and rank == 1))
        out[f"deferred_{what}_alone"] = attempt(lambda: deferred(e1[:n], e2[:n], idx[:n]))
        try:  # the other rank computed with the stand-in: no input error of its own to find later
            deferred.check_inputs()
            out[f"deferred_{what}_then"] = None
        except LossInputError as error:
            out[f"deferred_{what}_then"] = str(error)
    # together: a smaller batch on every rank, then eval mode on every rank, then train mode again
    s1, s2 = step_batch(1, 3)
    small = torch.arange(3) + 3 * rank
    values = {}
    for mode in ("eager", "deferred"):
        loss_fn = build_loss("fastclip-v3", data_size=DATA_SIZE, validate=mode).double()
        values[mode] = [float(loss_fn(e1, e2, idx)), float(loss_fn(s1, s2, small))]
        loss_fn.eval()
        values[mode].append(float(loss_fn(s1, s2, small)))
        loss_fn.train()
        values[mode].append(float(loss_fn(e1, e2, idx, epoch=1)))
        loss_fn.check_inputs()
    out["together"] = values
    return out


def two_rank_suite(rank, world_size):
    torch.manual_seed(0)
    return {
        "configs": run_configs(CONFIGS_2, STEPS_2, rank, world_size),
        "clip": clip_loss_comparison(rank, world_size),
        "bad": bad_inputs(rank, world_size),
        "bad_optional": bad_optional_inputs(rank, world_size),
        "later": later_bad_calls(rank, world_size),
        "shapes_changed": shapes_changed_on_one_rank(rank, world_size),
        "alone": one_rank_alone_changes(rank, world_size),
        "made_early": state_made_before_the_group(rank, world_size),
        "forgotten": forgotten_average(rank, world_size),
        "big": big_data_size(rank, world_size),
    }


def three_rank_suite(rank, world_size):
    out = {"configs": run_configs(CONFIGS_3, STEPS_3, rank, world_size)}
    # group= option: ranks 0 and 2 form their own group; rank 1 sits it out.
    group = dist.new_group([0, 2])
    if rank != 1:
        member = [0, 2].index(rank)
        out["subgroup"] = run_steps(
            make_loss("fastclip-v3", "faithful", group=group), STEPS_2, slice(4 * member, 4 * member + 4)
        )
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(two_rank_suite, 2, timeout=240)


@pytest.fixture(scope="module")
def three_ranks():
    return run_distributed(three_rank_suite, 3, timeout=240)


# --- comparisons against one process on the concatenated batch -------------------------------------------------


def assert_matches_single_process(per_rank, single, world_size, label):
    """DDP-averaged gradients, mean loss, objective and reassembled state equal to the single process."""
    b = single["steps"][0]["e1"].shape[0] // world_size
    for step, want in enumerate(single["steps"]):
        got = [r["steps"][step] for r in per_rank]
        where = f"{label} step {step}"
        for r, rec in enumerate(got):
            rows = slice(r * b, (r + 1) * b)
            torch.testing.assert_close(
                rec["e1"] / world_size, want["e1"][rows], **TOL, msg=f"{where} rank {r} image grad"
            )
            torch.testing.assert_close(
                rec["e2"] / world_size, want["e2"][rows], **TOL, msg=f"{where} rank {r} text grad"
            )
            torch.testing.assert_close(
                rec["metrics"]["objective"], want["metrics"]["objective"], **TOL, msg=f"{where} objective"
            )
        torch.testing.assert_close(
            sum(rec["loss"] for rec in got) / world_size, want["loss"], **TOL, msg=f"{where} mean loss"
        )
        for head_param, grad in want["heads"].items():  # TempNet's heads: averaged like DDP would
            torch.testing.assert_close(
                sum(rec["heads"][head_param] for rec in got) / world_size, grad, **TOL, msg=f"{where} {head_param} grad"
            )
        if want["theta"] is not None:
            torch.testing.assert_close(
                sum(rec["theta"] for rec in got) / world_size, want["theta"], **TOL, msg=f"{where} temperature grad"
            )
        else:
            assert all(rec["theta"] is None for rec in got)
    if single["state"] is not None:
        merged = reshard_states([r["state"] for r in per_rank], 1)[0]
        assert torch.equal(merged["seen"], single["state"]["seen"]), label
        for field, value in single["state"]["fields"].items():
            torch.testing.assert_close(merged["fields"][field], value, **TOL, msg=f"{label} state {field}")


@pytest.mark.parametrize("name,compat", CONFIGS_2)
def test_two_ranks_equal_one_process(two_ranks, name, compat):
    per_rank = [r["configs"][(name, compat)] for r in two_ranks]
    single = run_steps(make_loss(name, "faithful" if compat == "fused" else compat), STEPS_2, slice(None))
    assert_matches_single_process(per_rank, single, 2, f"{name}/{compat}")
    if single["state"] is not None:
        assert single["state"]["seen"].sum() == len(set(sum((s[0] for s in STEPS_2), [])))
    if name == "fastclip-v2":  # τ really moved, so its state comparison is not trivial
        assert not torch.allclose(single["state"]["fields"]["tau_img"][0], torch.tensor(0.3, dtype=torch.float64))


@pytest.mark.parametrize("name,compat", CONFIGS_3)
def test_three_ranks_equal_one_process(three_ranks, name, compat):
    per_rank = [r["configs"][(name, compat)] for r in three_ranks]
    single = run_steps(make_loss(name, compat), STEPS_3, slice(None))
    assert_matches_single_process(per_rank, single, 3, f"{name}/{compat} K=3")


def test_group_option_uses_the_subgroup(three_ranks):
    per_rank = [three_ranks[0]["subgroup"], three_ranks[2]["subgroup"]]
    single = run_steps(make_loss("fastclip-v3", "faithful"), STEPS_2, slice(None))
    assert_matches_single_process(per_rank, single, 2, "v3 on group [0, 2]")
    assert "subgroup" not in three_ranks[1]


def test_openclip_equals_open_clip_cliploss(two_ranks):
    for rank, result in enumerate(two_ranks):
        theirs, ours = result["clip"]["theirs"], result["clip"]["ours"]
        for what, got, want in zip(("value", "image grad", "text grad", "logit_scale grad"), ours, theirs):
            torch.testing.assert_close(got, want, **TOL, msg=f"rank {rank} {what}")


def test_average_grads_is_the_rank_mean(two_ranks):
    mean = sum(r["clip"]["ours"][3] for r in two_ranks) / 2
    for result in two_ranks:
        torch.testing.assert_close(result["clip"]["averaged_theta_grad"], mean, **TOL)


def test_comm_bytes_v3_half_of_cliploss(two_ranks):
    k, b, item = 2, 4, 8
    for result in two_ranks:
        v3 = result["clip"]["v3_bytes"]
        assert v3["features"] == (k - 1) * 2 * b * D * item  # one all_gather of [image | text]
        assert v3["indices"] == (k - 1) * b * 8
        assert v3["state"] == 2 * (k - 1) * (k * b) * 5 * item // k  # all_reduce of [N, 5]
        # the first call's handshake + the 5 words in the gather + the first call's broadcast of logit_scale
        assert v3["header"] == (k - 1) * (30 + 5 + 1) * 8
        assert v3["total"] == sum(v3[key] for key in ("features", "indices", "state", "header"))
        # ClipLoss, measured by wrapping torch.distributed: 2 all_gathers forward + their backward
        assert result["clip"]["clip_bytes"] == 4 * (k - 1) * b * D * item
        assert 2 * v3["features"] == result["clip"]["clip_bytes"]


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_raises_the_same_error_on_every_rank(two_ranks, case):
    (kind0, msg0), (kind1, msg1) = (r["bad"][case] for r in two_ranks)
    assert kind0 == kind1 and msg0 == msg1, (case, msg0, msg1)
    expected = {
        "index_out_of_range": (LossInputError, f"rank 1: indices[2] = {DATA_SIZE} is out of range"),
        "negative_index": (LossInputError, "rank 0: indices[1] = -3 is out of range"),
        "float_indices": (LossInputError, "rank 1: indices must be an integer tensor (int64), got dtype float64"),
        "features_3d": (LossInputError, "rank 0: image_features must be a 2-D [B, d] tensor"),
        "batch_size_differs": (LossInputError, "local batch size B differs across ranks (rank 0: 4, rank 1: 5)"),
        "feature_size_differs": (LossInputError, "feature size d differs across ranks (rank 0: 4, rank 1: 5)"),
        "nan_features": (
            NonFiniteFeaturesError,
            "rank 1: image_features has non-finite values (NaN/Inf), first in row 3",
        ),
    }[case]
    assert kind0 == expected[0].__name__
    assert expected[1] in msg0, msg0
    assert all(math.isfinite(r["bad"]["after"]) for r in two_ranks)


@pytest.mark.parametrize("case", list(OPTIONAL_CASES))
def test_momentum_groups_and_data_size_wrong_on_one_rank_are_the_same_error_on_every_rank(two_ranks, case):
    first, second = (r["bad_optional"][case] for r in two_ranks)
    assert first == second and OPTIONAL_CASES[case][1] in first, (first, second)


def test_after_the_handshake_a_call_makes_no_extra_collective(two_ranks):
    message = f"rank 1: indices[2] = {DATA_SIZE} is out of range [0, data_size={DATA_SIZE})"
    for result in two_ranks:
        for mode in ("eager", "deferred"):
            later = result["later"][mode]
            gathers = sum(n for name, n in later["calls"].items() if name.startswith("all_gather"))
            # one all_gather (features, indices and the check words), one all_reduce (the state rows)
            assert (gathers, later["calls"].get("all_reduce")) == (1, 1), later["calls"]
            # the counter also times each kind of call it saw (bench_loss splits a step's time with it)
            assert set(later["seconds"]) == set(later["calls"]) and all(t > 0 for t in later["seconds"].values())
            assert later["bytes"]["header"] == 5 * 8  # the 5 check words of the other rank
            assert math.isfinite(later["after"])
        assert result["later"]["eager"]["at_call"] == message
        assert result["later"]["eager"]["at_check"] is None
        assert result["later"]["deferred"]["at_call"] is None
        assert result["later"]["deferred"]["at_check"] == "loss call 3: " + message


def test_data_size_million_is_sharded_and_reshards_losslessly(two_ranks):
    for result in two_ranks:
        big = result["big"]
        for name in ("fastclip-v3", "fastclip-v2"):
            assert set(big[name]["slots"].values()) == {BIG // 2}, (name, big[name]["slots"])
            assert big[name]["seen_total"] >= 2
        assert big["longest_tensor"] <= BIG // 2 + 1, "a tensor longer than this rank's shard exists on a rank"
    shards = [r["big"]["v3_state"] for r in two_ranks]
    seen_before = sum(int(s["seen"].sum()) for s in shards)

    def same(a_shards, b_shards):
        for a, b in zip(a_shards, b_shards):
            assert a["rank"] == b["rank"] and torch.equal(a["seen"], b["seen"])
            for field in a["fields"]:
                assert torch.equal(a["fields"][field], b["fields"][field]), field

    one = reshard_states(shards, 1)
    three = reshard_states(one, 3)
    assert [s["seen"].numel() for s in three] == [333334, 333333, 333333]
    assert sum(int(s["seen"].sum()) for s in three) == seen_before
    same(reshard_states(three, 2), shards)  # 2 -> 1 -> 3 -> 2
    same(reshard_states(shards, 3), three)  # 2 -> 3 directly agrees
    same(reshard_states(three, 1), one)  # 3 -> 1


@pytest.mark.parametrize("name", ["fastclip-v3", "openclip"])
def test_a_batch_that_shrinks_on_one_rank_is_the_same_error_everywhere_and_loses_nothing(two_ranks, name):
    said = "local batch size B differs across ranks (rank 0: 4, rank 1: 3); every rank must pass the same"
    for result in two_ranks:
        got = result["shapes_changed"][name]
        assert got["error"] == said
        # [call 1, then 2 calls at B=3] of the loss that met the bad call, each beside the untouched loss's
        met, untouched = got["values"][0::2], got["values"][1::2]
        assert met == untouched  # bitwise: the bad call left no trace


def test_a_rank_that_changes_mode_or_shapes_alone_is_named_and_all_changing_together_works(two_ranks):
    (a, b) = (r["alone"] for r in two_ranks)
    mode = "the loss's mode (train() or eval(): every rank must switch) differs across ranks (rank 0: train, rank 1: "
    assert a["eager_alone"] == b["eager_alone"] == mode + "eval); every rank must pass the same"
    assert isinstance(a["eager_together"], float) and a["eager_together"] == b["eager_together"]
    # deferred: the rank that changed makes the call's collectives with a stand-in, then says what changed; the
    # other computed on the stand-in (in a run it stops in its next collective, one the raising rank never makes)
    assert all(isinstance(a[f"deferred_{w}_alone"], float) for w in ("shrinks", "eval", "eval_autograd"))
    assert a["deferred_shrinks_then"] is a["deferred_eval_then"] is a["deferred_eval_autograd_then"] is None
    tail = (
        "; with validate='deferred' the ranks must change them at the same call (drop each epoch's last partial "
        "batch, switch train()/eval() on every rank), or build the loss with validate='eager', which checks every "
        "call on every rank; the other ranks stop in their next collective"
    )
    changed = "rank 1: fastclip-v3's inputs changed on this rank alone"
    shrunk = "image: a 2-D tensor of shape [4, 5] of float64 -> a 2-D tensor of shape [3, 5] of float64"
    assert b["deferred_shrinks_alone"] == f"{changed} ({shrunk}){tail}"
    assert b["deferred_eval_alone"] == f"{changed} (the loss's mode: train() -> eval()){tail}"
    assert b["deferred_eval_autograd_alone"] == b["deferred_eval_alone"]  # (gloo aborted it: the stand-in's
    # collectives were eval mode's)
    for r in (a, b):  # together: deferred makes the handshake as eager does, the same numbers bitwise
        assert r["together"]["deferred"] == r["together"]["eager"]


def test_loss_parameters_are_rank_0s_after_the_first_call(two_ranks):
    (a, b) = (r["shapes_changed"]["tempnet"] for r in two_ranks)
    assert not torch.equal(a["before"], b["before"])  # seeded per rank: they differed
    assert torch.equal(a["after"], a["before"]) and torch.equal(b["after"], a["before"])


def test_a_state_made_before_the_group_and_never_written_is_made_anew(two_ranks):
    for rank, result in enumerate(two_ranks):
        made_early = result["made_early"]
        assert made_early["values"][0] == made_early["values"][1]
        assert made_early["written"] == (  # (it said only: reshard)
            f"fastclip-v3: sample state belongs to rank 0 of 1 but this call runs as rank {rank} of 2; a call before "
            "init_process_group wrote it: call init_process_group before the loss's first call (or reshard its "
            "state: reshard_for_rank)"
        )
        assert made_early["loaded"] == (
            f"fastclip-v3: sample state belongs to rank 0 of 1 but this call runs as rank {rank} of 2; it was loaded "
            "before init_process_group: load this rank's state after init_process_group (a one-process checkpoint: "
            "reshard it to this world size first, fastclip reshard or reshard_for_rank)"
        )


def test_one_rank_that_agreed_alone_or_passes_other_indices_costs_one_round_at_most(two_ranks):
    """A signature agreed before the group is no agreement: every rank makes the handshake (a stand-in against a
    handshake aborted the job). Indices openclip ignores, int32 on one rank: one extra round, then none (the ranks
    kept swapping stand-ins). The broadcast leaves a graph built before the first call usable."""
    for result in two_ranks:
        got = result["shapes_changed"]
        steady = got["openclip_bytes"][-1]
        assert got["openclip_bytes"][2:] == [steady, steady] and got["openclip_bytes"][1] > steady
        assert got["pregroup_scale"] == 2.5  # rank 0's
        assert got["graph_before_first_call"]


@pytest.mark.parametrize("case", ["v3 sgd", "v3 adamw", "openclip sgd", "tempnet sgd"])
def test_forgetting_to_average_the_loss_gradients_is_named_on_every_rank(two_ranks, case):
    """Without average_grads_ each rank steps its own τ: the first call after the ranks' τ differ says so, on every
    rank, with the remedy (SGD: the next call; AdamW's normalised steps keep a scalar τ equal a few steps longer);
    with it the ranks agree bitwise and no call complains."""
    for result in two_ranks:
        assert result["forgotten"][f"{case} average=True"] == (None, None)
        stopped, message = result["forgotten"][f"{case} average=False"]
        assert stopped == 1 if "sgd" in case else 1 <= stopped <= 11, (stopped, message)
        assert message.startswith("rank 1's loss parameters differ from rank 0's") and "average_grads_()" in message


@pytest.mark.parametrize("case", ["v3 sgd, unchecked", "v3 sgd, deferred"])
def test_the_parameter_check_is_off_on_request_and_in_deferred_mode(two_ranks, case):
    """check_parameters=False (local SGD, model averaging) and validate="deferred" never raise it."""
    for result in two_ranks:
        assert result["forgotten"][f"{case} average=False"] == (None, None)


def test_the_parameter_check_compares_exactly_and_names_a_non_finite_rank():
    from fastclip.losses.validation import check_parameters_agree

    def words(*values):
        return [struct.unpack("<q", struct.pack("<d", v))[0] for v in values]

    check_parameters_agree(words(2.5, 2.5, 2.5))
    check_parameters_agree(words(0.0, -0.0))  # equal values
    check_parameters_agree(words(math.nan, -math.nan))  # NaN everywhere: the NaN checks' business, not this one
    with pytest.raises(LossInputError, match=r"^rank 2's loss parameters differ from rank 0's"):
        check_parameters_agree(words(2.5, 2.5, math.nextafter(2.5, 3.0)))  # one ulp
    with pytest.raises(LossInputError, match=r"^rank 1's loss parameters are not finite .*check_parameters=False"):
        check_parameters_agree(words(2.5, math.inf))
