"""benchmarks/bench_u_regimes.py's measurements: the exact log g against a brute-force float64 sum, FastCLIP-v1 at
γ = 1 (u = the batch's own estimate) training the same towers as DCL (the two differ by u alone, which is what the
benchmark compares), and u's error read from the loss state."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_u_regimes as bench  # noqa: E402


def test_log_g_matches_a_float64_sum():
    gen = torch.Generator().manual_seed(0)
    a = torch.nn.functional.normalize(torch.randn(37, 8, generator=gen), dim=1)
    c = torch.nn.functional.normalize(torch.randn(37, 8, generator=gen), dim=1)
    a64, c64 = a.double(), c.double()
    want = [
        math.log(sum(math.exp((a64[i] @ c64[j] - a64[i] @ c64[i]) / bench.TAU) for j in range(37) if j != i) / 36)
        for i in range(37)
    ]
    assert bench.log_g(a, c).tolist() == pytest.approx(want, abs=1e-5)


def _tiny():
    gen = torch.Generator().manual_seed(1)
    n = 96
    return {
        "x_train": torch.randn(n, 20, generator=gen), "t_train": (torch.rand(n, 12, generator=gen) < 0.3).float(),
        "x_val": torch.randn(32, 20, generator=gen), "t_val": (torch.rand(32, 12, generator=gen) < 0.3).float(),
    }  # fmt: skip


def test_v1_at_gamma_1_trains_what_dcl_trains_and_u_has_the_measured_error():
    grid = bench.Grid(sizes=(96,), samples=32 * 9, val=32, evals=3)  # 3 epochs of 3 steps
    data = _tiny()
    dcl = bench.train(data, "dcl", 96, 3e-3, seed=5, grid=grid)
    same = bench.train(data, "fastclip-v1/g1", 96, 3e-3, seed=5, grid=grid)
    other = bench.train(data, "fastclip-v1/g0.2", 96, 3e-3, seed=5, grid=grid)
    assert [p[1] for p in same["curve"]] == pytest.approx([p[1] for p in dcl["curve"]], abs=2e-4)
    assert [p[2] for p in same["curve"]] == [p[2] for p in dcl["curve"]]
    assert [p[0] for p in dcl["curve"]] == [96, 192, 288] and dcl["epochs"] == 3
    assert abs(other["final"]["objective"] - dcl["final"]["objective"]) > 1e-3  # γ < 1: u changes the training
    # at γ = 1 every entry of u is its sample's last batch estimate: its error is a mini-batch estimate's (> 0)
    assert 0.05 < same["final"]["estimator_rmse"] < 5 and 0.05 < dcl["final"]["estimator_rmse"] < 5
