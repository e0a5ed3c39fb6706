"""The losses inside torch.autocast(bf16), as OpenCLIP's training loop calls its loss: autocast is off inside
the loss, so fp32 features give exactly the fp32 result, and bf16 features are multiplied in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastclip.losses import build_loss

from helpers import LOSS_OPTIONS

N, D = 64, 16
OPTIONS = LOSS_OPTIONS


def features(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    e1 = F.normalize(torch.randn(N, D, generator=gen, dtype=torch.float64), dim=1)
    e2 = F.normalize(e1 + 0.5 * torch.randn(N, D, generator=gen, dtype=torch.float64), dim=1)
    return e1.to(dtype), e2.to(dtype)


def grads(name, e1, e2, autocast: bool, temperature=0.01):
    loss_fn = build_loss(name, data_size=N, temperature=temperature, **OPTIONS[name])
    if e1.dtype == torch.float64:
        loss_fn = loss_fn.double()
    x1, x2 = e1.clone().requires_grad_(), e2.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(x1, x2, torch.arange(N))
        loss.backward()  # inside the region too: the custom backward turns autocast off as well
    return loss.detach(), x1.grad, x2.grad


@pytest.mark.parametrize("name", list(OPTIONS))
def test_fp32_features_under_autocast_equal_fp32(name):
    e1, e2 = features()
    plain = grads(name, e1, e2, autocast=False)
    mixed = grads(name, e1, e2, autocast=True)
    for a, b in zip(plain, mixed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["openclip", "fastclip-v3"])
def test_bf16_features_are_multiplied_in_fp32(name):
    """bf16 features (a pure-bf16 model): the loss on them equals the fp32 loss on the same (rounded) values,
    up to fp32 rounding, instead of the several-% error of a bf16 similarity matmul at τ = 0.01."""
    e1, e2 = features(torch.bfloat16)
    low = grads(name, e1, e2, autocast=True)
    ref = grads(name, e1.double(), e2.double(), autocast=False)
    for got, want in zip(low[1:], ref[1:]):
        rel = (got.double() - want).norm() / want.norm()
        assert rel < 1e-2, rel  # bf16 storage of the gradient itself: ~0.4 % per element


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (TF32 exists only there)")
@pytest.mark.parametrize("name", ["openclip", "fastclip-v3"])
def test_tf32_setting_does_not_reach_the_loss(name):
    """train.tf32 speeds up the towers; the loss still multiplies in IEEE fp32 and restores the setting."""
    e1, e2 = (x.cuda() for x in features())
    results = []
    for precision in ("highest", "high"):  # "high": TF32 matmuls
        torch.set_float32_matmul_precision(precision)
        loss_fn = build_loss(name, data_size=N, temperature=0.01, **OPTIONS[name]).cuda()
        x1, x2 = e1.clone().requires_grad_(), e2.clone().requires_grad_()
        loss_fn(x1, x2, torch.arange(N, device="cuda")).backward()
        assert torch.get_float32_matmul_precision() == precision
        results.append((x1.grad, x2.grad))
    torch.set_float32_matmul_precision("highest")
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_trainers_tf32_flag_and_the_loss_guard_use_one_api():
    """train.tf32 sets torch >= 2.9's per-backend flag; the loss's IEEE guard must not then read the legacy global
    (torch raises on the mix: every CUDA run with the default tf32 failed at its first loss call). Flags only: no
    CUDA needed."""
    from fastclip.losses.pairwise import exact_float32
    from fastclip.train.config import Config
    from fastclip.train.gpu import apply_backend_flags

    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has only the legacy API")
    before = (matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.benchmark)
    try:
        assert "TF32" in apply_backend_flags(Config(), torch.device("cuda", 0))
        assert matmul.fp32_precision == "tf32"
        with exact_float32("cuda"):
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.benchmark = before
