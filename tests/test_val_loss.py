"""The validation loss (fastclip/eval/val_loss.py): eval mode leaves the per-sample state bitwise as it was, and
the value is the objective computed by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastclip.eval.val_loss import validation_loss
from fastclip.losses import build_loss

from helpers import LOSS_OPTIONS, features

DATA_SIZE = 96


def _state(loss_fn) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loss_fn.sample_state().state_dict()["fields"].items()}


@pytest.mark.parametrize("name", ["fastclip-v0", "fastclip-v1", "fastclip-v2", "fastclip-v3"])
def test_eval_mode_writes_no_per_sample_state(name):
    loss_fn = build_loss(name, data_size=DATA_SIZE, **LOSS_OPTIONS[name])
    e1, e2 = features(32, 8, seed=0)
    e1, e2 = e1.detach(), e2.detach()
    loss_fn(e1[:16], e2[:16], torch.arange(16))  # training writes rows 0..15
    loss_fn(e1[16:], e2[16:], torch.arange(40, 56))  # and 40..55, which the validation below reads too
    before = _state(loss_fn)
    value, used = validation_loss(loss_fn, e1, e2, torch.arange(32, 64), per_rank=8)
    assert used == 32 and torch.isfinite(torch.tensor(value))
    after = _state(loss_fn)
    assert before.keys() == after.keys()
    for field in before:
        assert torch.equal(before[field], after[field]), f"{name}: {field} written in eval mode"
    assert loss_fn.training  # its mode given back
    loss_fn(e1[:16], e2[:16], torch.arange(40, 56))  # the control: a training call does write those rows
    assert any(not torch.equal(before[f], t) for f, t in _state(loss_fn).items())


def test_a_validation_loss_is_the_same_whatever_the_evaluations_before_it():
    """Eval mode's u is the batch's own estimate (γ = 1): the value does not drift with repeated evaluations."""
    loss_fn = build_loss("fastclip-v3", data_size=DATA_SIZE, **LOSS_OPTIONS["fastclip-v3"])
    e1, e2 = (t.detach() for t in features(48, 8, seed=1))
    first = validation_loss(loss_fn, e1, e2, torch.arange(48, 96), per_rank=16)
    loss_fn(e1[:16], e2[:16], torch.arange(48, 64))  # training writes state the next validation reads
    assert validation_loss(loss_fn, e1, e2, torch.arange(48, 96), per_rank=16) == first


def test_openclip_validation_loss_is_the_clip_cross_entropy_per_batch():
    """Full batches of 16 (the last 4 of 36 pairs left out), each ½(CE image->text + CE text->image)."""
    loss_fn = build_loss("openclip", temperature=0.05)
    e1, e2 = (t.detach() for t in features(36, 8, seed=2))
    value, used = validation_loss(loss_fn, e1, e2, torch.full((36,), -1), per_rank=16)
    want = []
    for b in range(2):
        img, txt = e1[16 * b : 16 * b + 16], e2[16 * b : 16 * b + 16]
        logits, target = img @ txt.T / 0.05, torch.arange(16)
        want.append(0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)))
    assert used == 32
    assert value == pytest.approx(float(sum(want) / 2), rel=1e-6)


def test_no_value_where_the_indices_a_state_needs_are_missing():
    loss_fn = build_loss("fastclip-v3", data_size=DATA_SIZE, **LOSS_OPTIONS["fastclip-v3"])
    e1, e2 = (t.detach() for t in features(16, 8, seed=3))
    assert validation_loss(loss_fn, e1, e2, torch.full((16,), -1), per_rank=8) == (None, 0)
    assert validation_loss(loss_fn, e1, e2, torch.arange(90, 106), per_rank=8) == (None, 0)  # past data_size
    assert validation_loss(loss_fn, e1[:1], e2[:1], torch.arange(1), per_rank=8) == (None, 0)  # below 2 a batch


def test_a_queue_and_momentum_distillation_leave_the_validation_loss_the_in_batch_one():
    """The trainer's evaluation has no momentum features: the soft targets and the queued negatives are left out
    (before, a run with distill_alpha stopped at its first evaluation)."""
    moco = build_loss("dcl", temperature=0.1, queue_size=8, distill_alpha=0.4)
    e1, e2 = (t.detach() for t in features(32, 8, seed=4))
    moco(e1[:16], e2[:16], torch.arange(16), momentum=(e1[:16].flip(0), e2[:16].flip(0)))  # the queue fills
    got = validation_loss(moco, e1, e2, torch.arange(16, 48), per_rank=8)
    want = validation_loss(build_loss("dcl", temperature=0.1), e1, e2, torch.arange(16, 48), per_rank=8)
    assert got[1] == want[1] == 32 and got[0] == pytest.approx(want[0], rel=1e-6)
