"""The loss option fused_kernels (fastclip/losses/kernels.py): each loss with its exponentials as torch.compile'd
kernels gives the eager loss's values, gradients and per-sample state (float64: to 1e-12; float32: to float32
rounding); a machine that cannot compile runs the eager kernels after one warning; the trainer's config takes the
key. The compiled kernels need a C++ compiler: without one the comparisons are skipped (they would compare eager
with eager)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fastclip.losses import build_loss, kernels
from fastclip.losses.pairwise import EXCLUDED, row_terms

from helpers import features, run_loss

LOSSES = [
    ("openclip", {}),
    ("fastclip-v0", {}),
    ("fastclip-v1", {}),
    ("fastclip-v2", {}),
    ("fastclip-v3", {}),
    ("fastclip-v3", {"separate_temperatures": True}),
    ("fastclip-tempnet", {"embed_dim": 5}),
]
IDX = torch.tensor([3, 0, 9, 4, 7, 1, 12, 5])


def _compiled_or_skip():
    if kernels.compile_failure() is not None:
        pytest.skip(f"torch.compile cannot build kernels here: {kernels.compile_failure()}")


def _build(name, options, fused, dtype):
    sized = {} if name == "openclip" else {"data_size": 16}
    torch.manual_seed(0)  # TempNet's heads start from the same weights on both sides
    loss_fn = build_loss(name, **sized, fused_kernels=fused, **options)
    return loss_fn.to(dtype)


def _calls(loss_fn, e1, e2):
    """Three calls (γ < 1 from the second epoch on, the state read back): values and every gradient."""
    out = []
    for epoch in range(3):
        loss, g1, g2, params = run_loss(loss_fn, e1, e2, IDX, epoch=epoch)
        out.append([loss, g1, g2, *(params[k] for k in sorted(params))])
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("name", "options"), LOSSES, ids=lambda x: x if isinstance(x, str) else "-".join(x) or "")
def test_fused_kernels_give_the_eager_loss(name, options, dtype):
    e1, e2 = features(len(IDX), 5, seed=4)
    e1, e2 = e1.to(dtype), e2.to(dtype)
    eager = _build(name, options, False, dtype)
    fused = _build(name, options, True, dtype)
    want, got = _calls(eager, e1, e2), _calls(fused, e1, e2)
    _compiled_or_skip()
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    for w_call, g_call in zip(want, got):
        assert len(w_call) == len(g_call)
        for w, g in zip(w_call, g_call):
            torch.testing.assert_close(g, w, **tol)
    w_state, g_state = eager.state_dict(), fused.state_dict()
    assert w_state.keys() == g_state.keys()
    for key, w in w_state.items():
        if key == "_extra_state":
            for field, value in w["fields"].items():
                torch.testing.assert_close(g_state[key]["fields"][field], value, **tol)
        else:
            torch.testing.assert_close(g_state[key], w, **tol)


def test_fused_rows_keep_an_all_excluded_row_at_zero():
    """A row with no candidate: exp 0, total 0 and the shift EXCLUDED/2, as the eager form."""
    gen = torch.Generator().manual_seed(3)
    sim = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64)
    sim[:, 2, :] = EXCLUDED
    pos = torch.randn(4, generator=gen, dtype=torch.float64)
    scale = torch.tensor([[5.0], [9.0]], dtype=torch.float64)
    for moment in (False, True):
        want = row_terms(sim.clone(), pos, scale, max_shift=True, moment=moment)
        got = row_terms(sim.clone(), pos, scale, max_shift=True, moment=moment, fused=True)
        _compiled_or_skip()
        assert torch.all(got.exp[:, 2] == 0) and torch.all(got.total[:, 2] == 0)
        assert torch.all(got.shift[:, 2] == EXCLUDED / 2)
        for field in ("exp", "total", "moment", "shift"):
            w, g = getattr(want, field), getattr(got, field)
            assert (w is None) == (g is None)
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_a_machine_that_cannot_compile_runs_the_eager_kernels_after_one_warning(tmp_path):
    """No working C++ compiler (CXX names none, an empty inductor cache): one RuntimeWarning naming the option,
    then the same loss as without the option."""
    script = textwrap.dedent(
        """
        import warnings
        import torch
        from fastclip.losses import build_loss
        e1 = torch.nn.functional.normalize(torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), dim=1)
        e2 = torch.nn.functional.normalize(torch.randn(8, 4, generator=torch.Generator().manual_seed(2)), dim=1)
        idx = torch.arange(8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fused = [build_loss("fastclip-v3", data_size=8, fused_kernels=True)(e1, e2, idx, epoch=e) for e in (0, 1)]
        eager = [build_loss("fastclip-v3", data_size=8)(e1, e2, idx, epoch=e) for e in (0, 1)]
        mine = [str(w.message) for w in caught if "fused_kernels" in str(w.message)]
        print(len(mine))
        print(mine[0] if mine else "")
        print(all(torch.equal(a, b) for a, b in zip(fused, eager)))
        """
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    count, message, same = run.stdout.strip().splitlines()[-3:]
    assert count == "1", run.stdout  # once per process, though the loss uses two kernels (rows, columns)
    assert "loss option fused_kernels: torch.compile failed" in message and "eager" in message, message
    assert same == "True"


def test_config_takes_fused_kernels_and_siglip_refuses_it(tmp_path, capsys):
    from fastclip.train.config import ConfigError, load_config

    cfg = load_config(None, ["--loss.name", "fastclip-v3", "--loss.fused_kernels", "true"])
    assert cfg.loss.fused_kernels is True
    with pytest.raises(ConfigError, match="loss.fused_kernels"):
        load_config(None, ["--loss.fused_kernels", "sometimes"])
    with pytest.raises(TypeError, match="fused_kernels"):
        build_loss("siglip", fused_kernels=True)
    with pytest.raises(ValueError, match="fused_kernels must be true or false"):
        build_loss("fastclip-v3", data_size=4, fused_kernels="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernels)")
@pytest.mark.parametrize("name", ["fastclip-v3", "fastclip-v2", "openclip"])
def test_fused_kernels_on_cuda_give_the_eager_loss(name):
    """On a GPU the kernels are Triton's: the same values and gradients as the eager loss (float32 rounding)."""
    e1, e2 = features(len(IDX), 5, seed=5)
    e1, e2 = e1.float().cuda(), e2.float().cuda()
    eager = _build(name, {}, False, torch.float32).cuda()
    fused = _build(name, {}, True, torch.float32).cuda()
    want, got = _calls(eager, e1, e2), _calls(fused, e1, e2)
    assert kernels.compile_failure() is None, kernels.compile_failure()
    for w_call, g_call in zip(want, got):
        for w, g in zip(w_call, g_call):
            torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6)
