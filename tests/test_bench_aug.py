"""benchmarks/bench_aug.py: its out-of-distribution check is deterministic and draws what it says, and --quick
writes the table (settings x seeds, in-distribution and OOD top-1) with numbers in range."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_aug  # noqa: E402


def _pixels(sets):
    return {
        t: {d: [(np.asarray(im).tobytes(), label) for im, label in items] for d, items in by.items()}
        for t, by in sets.items()
    }


def test_ood_sets_are_deterministic_and_drawn_as_said(tiny_embedded):
    first, again = bench_aug.ood_sets(tiny_embedded, 3), bench_aug.ood_sets(tiny_embedded, 3)
    assert list(first) == list(bench_aug.TRANSFORMS)
    assert _pixels(first) == _pixels(again)
    assert set(first["invert"]) == {"fashion-mnist", "mnist"} and list(first["sklearn-digits"]) == ["mnist"]
    base = bench_aug.held_out(tiny_embedded, 3)
    for transform in bench_aug.TRANSFORMS[:-1]:
        for dataset, items in first[transform].items():
            assert [label for _, label in items] == [label for _, label in base[dataset]]
            assert all(im.size == (28, 28) and im.mode == "L" for im, _ in items)
    original = np.asarray(base["mnist"][0][0], dtype=np.int64)
    assert (np.asarray(first["invert"]["mnist"][0][0]) == 255 - original).all()
    assert (np.asarray(first["dilate"]["mnist"][0][0]) >= original).all()  # thicker: a max filter
    assert (np.asarray(first["erode"]["mnist"][0][0]) <= original).all()
    assert np.asarray(first["dilate"]["mnist"][0][0]).sum() > original.sum()
    # the shift: 4 px right for the first image, 4 px down for the second
    square = Image.fromarray(np.pad(np.full((4, 4), 200, np.uint8), 12))
    assert np.argwhere(np.asarray(bench_aug.redraw(square, "shift", 0)))[:, 1].min() == 16
    assert np.argwhere(np.asarray(bench_aug.redraw(square, "shift", 1)))[:, 0].min() == 16
    digits = bench_aug.sklearn_digits(20)
    assert len(digits) == 20 and [label for _, label in digits[:10]] == list(range(10))
    assert np.asarray(digits[0][0]).shape == (28, 28) and np.asarray(digits[0][0])[:4].max() == 0


def test_quick_writes_the_table(tiny_embedded, tmp_path):
    settings = [bench_aug.DEFAULT, "scale 0.5-1"]
    out = tmp_path / "aug"
    argv = ["--quick", "--data", str(tiny_embedded), "--out", str(out), "--settings", *settings]
    assert bench_aug.main(argv) == 0
    result = json.loads((out / "aug.json").read_text())
    assert result["mode"] == "quick" and result["seeds"] == [0, 1]
    table = result["summary"]["table"]
    assert list(table) == settings
    for row in table.values():
        assert row["seeds"] == [0, 1]
        keys = [k for k in row if k.startswith(("in_dist", "ood"))]
        assert keys == [
            "in_dist/fashion-mnist",
            "in_dist/mnist",
            "in_dist_mean",
            *[f"ood/{t}" for t in bench_aug.TRANSFORMS],
            "ood_mean",
        ]
        for key in keys:
            cell = row[key]
            assert len(cell["values"]) == 2 and all(0.0 <= v <= 1.0 for v in cell["values"])
            assert cell["mean"] == np.mean(cell["values"]) and cell["sd"] >= 0.0
        transforms = np.mean([row[f"ood/{t}"]["mean"] for t in bench_aug.TRANSFORMS])
        assert abs(transforms - row["ood_mean"]["mean"]) < 1e-9
    assert result["summary"]["chosen"] in settings and bench_aug.DEFAULT in result["summary"]["eligible"]
    text = (out / "aug.md").read_text()
    assert "| setting | ID fashion-mnist | ID mnist | ID mean | dilate |" in text
    assert sum(line.startswith(f"| {s} |") for s in settings for line in text.splitlines()) == 2
