"""Every tensor a loss makes lives on its inputs' device. On CUDA a constant made on the CPU fails the call (v0, v1
and v3 did, at their first step: logaddexp with a CPU ε); here, without a GPU, the default device is set to 'meta'
around the call, so any tensor made without naming a device lands on 'meta' and mixing it with the CPU inputs (or
reading it as a metric) fails the same way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastclip.losses import LOSSES, LossInputError, build_loss

from dist_utils import run_distributed
from helpers import LOSS_OPTIONS

N, D = 16, 8
OPTIONS = {
    **LOSS_OPTIONS,
    "fastclip-v3-separate": {"rho": 3.0, "separate_temperatures": True},
    "fastclip-tempnet": {"embed_dim": D, "tempnet_hidden": 4},
    # the autograd objectives (objective.py) of the losses that also have a fused path
    **{
        f"{name} autograd": {**LOSS_OPTIONS[name], "impl": "autograd"} for name in ("openclip", "fastclip-v3", "siglip")
    },
    "fastclip-v3-separate autograd": {"rho": 3.0, "separate_temperatures": True, "impl": "autograd"},
    "dcl hard": {"hard_negative_topk": 3, "hard_negative_beta": 0.5, "direction_weights": [0.7, 0.3]},
    "dcl queue": {"queue_size": 24},  # (a push per call: the second and third calls read queued rows)
    "fastclip-v3 queue": {**LOSS_OPTIONS["fastclip-v3"], "queue_size": 24},
    "ntxent": {"unimodal": True},  # (SimCLR: image and text are two views of the same images)
}


def loss_name(variant: str) -> str:
    return variant.split()[0].removesuffix("-separate")


def loss_and_features(variant, *, seed=0, data_size=4 * N, dtype=torch.float32, device="cpu", **options):
    """The variant's loss (with these options besides its own) and a seeded leaf image/text pair of [N, D]."""
    loss_fn = build_loss(loss_name(variant), data_size=data_size, **OPTIONS[variant], **options)
    gen = torch.Generator().manual_seed(seed)
    image, text = (F.normalize(torch.randn(N, D, generator=gen, dtype=dtype), dim=1) for _ in range(2))
    return loss_fn.to(device, dtype), image.to(device).requires_grad_(), text.to(device).requires_grad_()


def test_every_loss_is_covered():
    assert {loss_name(variant) for variant in OPTIONS} == set(LOSSES)


@pytest.mark.parametrize("variant", list(OPTIONS))
def test_the_loss_makes_nothing_on_the_default_device(variant):
    loss_fn, image, text = loss_and_features(variant)
    for step in range(2):  # the first call makes the state; the second reads it
        index = torch.arange(step * N, (step + 1) * N)
        with torch.device("meta"):
            loss = loss_fn(image, text, index)
            loss.backward()
            metrics = dict(loss_fn.metrics)  # computed when read: inside the region too
        assert loss.device.type == "cpu" and image.grad.device.type == "cpu"
        for key, value in metrics.items():
            assert value.device.type == "cpu", key
            assert torch.isfinite(value).all(), key
        assert all(p.grad is None or p.grad.device.type == "cpu" for p in loss_fn.parameters())
        assert all(t.device.type == "cpu" for t in loss_fn.state_dict().values() if isinstance(t, torch.Tensor))


def calls_on_meta_default(rank: int, world_size: int) -> dict[str, str]:
    """Every variant on 2 ranks (the handshake, the parameter broadcast, the gathers and the state's shares),
    train steps then an eval-mode call, and once more with deferred validation: what failed, by variant."""
    failed = {}
    for validate in ("eager", "deferred"):
        for variant in OPTIONS:
            try:
                loss_fn, image, text = loss_and_features(variant, seed=rank, data_size=8 * N, validate=validate)
                for step in range(3):
                    loss_fn.train(step < 2)
                    index = torch.arange(N) + (2 * step + rank) * N
                    with torch.device("meta"):
                        loss = loss_fn(image, text, index)
                        if step < 2:
                            loss.backward()
                        values = [v for v in dict(loss_fn.metrics).values()]
                    assert all(v.device.type == "cpu" for v in [loss, *values])
                if validate == "eager":  # one rank's batch shrinks: a zero stand-in joins the gather, all ranks raise
                    loss_fn.train()
                    rows = N - rank
                    index = torch.arange(rows) + 7 * N
                    with torch.device("meta"), pytest.raises(LossInputError):
                        loss_fn(image[:rows], text[:rows], index)
            except Exception as e:  # noqa: BLE001  (reported by variant: one failure must not hide the others)
                failed[f"{variant} validate={validate}"] = f"{type(e).__name__}: {e}"
    return failed


def test_two_ranks_make_nothing_on_the_default_device():
    for rank, failed in enumerate(run_distributed(calls_on_meta_default, 2, timeout=180)):
        assert failed == {}, f"rank {rank}: {failed}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", list(OPTIONS))
def test_every_loss_runs_on_cuda_and_matches_the_cpu(variant):
    """Two steps on CUDA (the state made, then read) against the same two on the CPU, float64 on both."""
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)  # the temperature network's heads start the same on both
        loss_fn, image, text = loss_and_features(variant, dtype=torch.float64, device=device)
        out = []
        for step in range(2):
            loss = loss_fn(image, text, torch.arange(step * N, (step + 1) * N, device=device))
            loss.backward()
            out += [loss.detach(), *(value for _, value in sorted(dict(loss_fn.metrics).items()))]
        out += [image.grad, text.grad]
        results.append([t.cpu() for t in out])
    for cpu, cuda in zip(*results):
        torch.testing.assert_close(cuda, cpu, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", list(OPTIONS))
def test_a_deferred_call_on_cuda_waits_for_nothing_on_the_host(variant):
    """The trainer's calls (validate="deferred", indices handed over on the device, metrics not read) make no host
    sync: torch raises at any op that would wait for the GPU (an .item(), a nonzero, a blocking copy)."""
    loss_fn, image, text = loss_and_features(variant, device="cuda", validate="deferred")
    loss_fn(image, text, torch.arange(N, device="cuda")).backward()  # the first call: the handshake reads its header
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 3):
            loss_fn(image, text, torch.arange(step * N, (step + 1) * N, device="cuda")).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss_fn.check_inputs()  # the read the trainer makes on its logging steps
