"""benchmarks/bench_tau_regimes.py's pieces: the long-tailed draw is skewed as stated, the tail's scenes and
recall are what they say, and each objective's τ is what the table reports (v3's learned, v2's per sample)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_tau_regimes as bench  # noqa: E402


def _captions(classes: list[list[int]]) -> torch.Tensor:
    """Multi-hot captions naming these classes (cell 0), size and colour 0."""
    t = torch.zeros(len(classes), bench.CLASS_COLUMNS + 4 * bench.CLASSES)
    for i, cs in enumerate(classes):
        t[i, 0] = t[i, 2] = 1
        for c in cs:
            t[i, bench.CLASS_COLUMNS + 4 * c] = 1
    return t


def test_the_long_tailed_draw_favours_the_first_ranks_and_the_tail_mask_holds_the_rarest():
    ranks = bench.class_ranks()
    by_rank = torch.argsort(ranks)  # class of rank 0, 1, ...
    gen = torch.Generator().manual_seed(0)
    pool = [[int(c)] for c in torch.randint(0, bench.CLASSES, (4000,), generator=gen)]
    data = {"t_train": _captions(pool)}
    rows = bench.draw(data, "long-tailed", 400)
    assert len(set(rows.tolist())) == 400 and bench.draw(data, "long-tailed", 400).tolist() == rows.tolist()
    counts = bench.classes_of(data["t_train"][rows]).sum(0)
    head, tail = int(counts[by_rank[0]]), int(counts[by_rank[-1]])
    assert head > 100 and tail < 10  # weights 1 and 1/20² of a uniform pool of ~200 scenes per class
    shares = bench.class_shares(data, rows)
    assert shares["head4_share"] > 0.6 and shares["tail_share"] < 0.1
    assert bench.draw(data, "balanced", 400).tolist() == list(range(400))
    # as many scenes of each object count as the balanced draw: the regime moves the classes only
    mixed = {"t_train": _captions([[i % 20] * 1 if i % 3 == 0 else [i % 20, (i + 7) % 20] for i in range(3000)])}
    objects = bench.classes_of(mixed["t_train"]).sum(1)
    tailed = bench.draw(mixed, "long-tailed", 300)
    assert sorted(objects[tailed].tolist()) == sorted(objects[:300].tolist())
    rare, frequent = int(by_rank[-1]), int(by_rank[0])
    mask = bench.tail_mask(_captions([[rare], [rare, frequent], [frequent], [int(by_rank[-bench.TAIL])]]))
    assert mask.tolist() == [True, False, False, True]


def test_recall_over_some_queries_keeps_every_candidate():
    img = torch.eye(4)
    txt = torch.eye(4)[[0, 1, 3, 2]]  # queries 2 and 3 match each other's caption
    assert bench.recall(img, txt) == pytest.approx(0.5)
    assert bench.recall(img, txt, torch.tensor([True, True, False, False])) == 1.0
    assert bench.recall(img, txt, torch.tensor([False, False, True, True])) == 0.0


@pytest.mark.parametrize("objective", bench.OBJECTIVES)
def test_each_objective_trains_and_reports_its_temperature(objective):
    gen = torch.Generator().manual_seed(1)
    n = 96
    data = {
        "x_train": torch.randn(n, 20, generator=gen), "t_train": _captions([[i % 20] for i in range(n)]),
        "x_val": torch.randn(32, 20, generator=gen), "t_val": _captions([[i % 20] for i in range(32)]),
    }  # fmt: skip
    grid = bench.Grid(n=n, samples=32 * 9)
    setting = bench.settings(grid, objective)[0]
    run = bench.train(data, torch.arange(n), objective, setting, seed=3, grid=grid)
    final = run["final"]
    assert all(0 <= final[k] <= 1 for k in ("val_R1", "test_R1", "tail_R1"))
    if objective == "fastclip-v1":  # constant
        assert final["tau_mean"] == pytest.approx(setting["tau"]) and final["tau_std"] == 0
    elif objective == "fastclip-v3":  # one τ, learned from 0.07
        assert final["tau_mean"] != pytest.approx(0.07, abs=1e-6) and final["tau_std"] == 0
    else:  # a τ per sample and modality, moved from 0.03, within its bounds
        assert final["tau_std"] > 0 and 0.01 <= final["tau_mean"] <= 1.0
    again = bench.train(data, torch.arange(n), objective, setting, seed=3, grid=grid)
    assert again["final"] == final  # one seed, one result
