"""Plain WebDatasets (`{key}.jpg|png|webp` + `{key}.txt`, no .json): `fastclip data scan` indexes each sample by its
position in the manifest's shard order, records it per shard, and the training stream attaches that index
to the very sample it was given for."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fastclip.data import build_train_stream
from fastclip.data.cli import main as data_main
from fastclip.data.samples import decode_image
from fastclip.data.sources.synthetic import synthetic_image
from fastclip.data.tario import write_tar

SIZES = [5, 7, 4]  # three shards, 16 samples
EXTS = ["jpg", "png", "webp"]  # one image format per shard: each OpenCLIP reads (its "jpg;png;jpeg;webp")


def ext_of(position: int) -> str:
    return EXTS[int(np.searchsorted(np.cumsum(SIZES), position, side="right"))]


def write_plain(folder: Path) -> None:
    folder.mkdir(parents=True)
    position = 0
    for s, size in enumerate(SIZES):
        groups = []
        for _ in range(size):  # keys as a crawler names them: no index in them
            groups.append(
                (
                    f"img_{s}_{position * 7919 % 1000:03d}",
                    {
                        EXTS[s]: synthetic_image(position, 8, EXTS[s]),
                        "txt": f"a picture number {position}".encode(),
                    },
                )
            )
            position += 1
        write_tar(folder / f"shard-{s:05d}.tar", groups)


@pytest.fixture
def plain(tmp_path) -> Path:
    write_plain(tmp_path / "plain")
    return tmp_path / "plain"


def pixels(position: int) -> np.ndarray:
    return np.asarray(decode_image(synthetic_image(position, 8, ext_of(position))))


def test_scan_indexes_plain_shards_by_position(plain, capsys):
    assert data_main(["scan", str(plain)]) == 0
    out = capsys.readouterr().out
    assert "3 shards, 16 samples, data_size 16, 3 plain WebDataset shard(s) indexed by position, no problems" in out
    manifest = json.loads((plain / "manifest.json").read_text())
    assert [(s["index_base"], s["index_min"], s["index_max"]) for s in manifest["shards"]] == [
        (0, 0, 4),
        (5, 5, 11),
        (12, 12, 15),
    ]


def test_the_stream_attaches_each_sample_its_position_index(plain):
    assert data_main(["scan", str(plain)]) == 0
    stream = build_train_stream(
        {"train": str(plain), "batch_size": 4, "workers": 0, "shuffle_buffer": 16},
        rank=0,
        world_size=1,
        preprocess=lambda image: torch.from_numpy(np.array(image)),
        tokenizer=lambda texts: torch.zeros(len(texts), 1, dtype=torch.long),
    )
    served = {}
    for images, _, indices, _ in stream.epoch(0):
        for image, index in zip(images, indices.tolist()):
            served[index] = image.numpy()
    assert sorted(served) == list(range(16))
    for index, image in served.items():  # the picture written at that position, byte for byte decoded
        assert np.array_equal(image, pixels(index)), index
    assert all(n == 0 for n in stream.counters.values()), stream.counters  # nothing skipped, nothing served twice


def test_positions_beyond_data_size_are_problems_the_loader_skips(plain, capsys):
    assert data_main(["scan", str(plain), "--data-size", "10"]) == 0
    manifest = json.loads((plain / "manifest.json").read_text())
    bad = [(p["shard"], p["index"], p["reason"]) for p in manifest["problems"]]
    assert bad == [("shard-00001.tar", 10, "index_out_of_range"), ("shard-00001.tar", 11, "index_out_of_range")] + [
        ("shard-00002.tar", i, "index_out_of_range") for i in range(12, 16)
    ]


# ----------------------------------------------------------------------------- scanned sets joined with "::"
def write_set(folder: Path, name: str, sizes: list[int], *, img2dataset: bool = False) -> list[tuple[str, str]]:
    """Shards whose captions name the set and the key; img2dataset's layout (.json key = shard * 10 + row) or a
    plain WebDataset's (no .json). Returns (caption, key) in manifest order."""
    folder.mkdir(parents=True)
    written = []
    for s, size in enumerate(sizes):
        groups = []
        for row in range(size):
            key = f"{s * 10 + row:09d}" if img2dataset else f"img_{s}_{row}"
            files = {"png": synthetic_image(row, 8), "txt": f"{name} {key}".encode()}
            if img2dataset:
                files["json"] = json.dumps({"key": key, "status": "success"}).encode()
            groups.append((key, files))
            written.append((f"{name} {key}", key))
        write_tar(folder / f"{s:05d}.tar", groups)
    return written


def test_scanned_sets_with_an_index_offset_join_with_disjoint_indices(tmp_path, capsys):
    from fastclip.train.cli import main as train_main

    from helpers import EMBEDDED, one_line_error

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    caps_a = write_set(a, "a", [5, 7, 4])  # plain: indices 0..15 by position
    caps_b = write_set(b, "b", [3, 6])  # plain: 0..8, then 16..24 with --index-offset 16
    caps_c = write_set(c, "c", [5, 4], img2dataset=True)  # keys 0..4, 10..13: 25..29, 35..38 with offset 25
    assert data_main(["scan", str(a), "--workers", "1"]) == 0
    assert data_main(["scan", str(b), "--workers", "1"]) == 0
    capsys.readouterr()
    # without an offset the two sets share indices 0..8: refused in one line naming both, their ranges and the fix
    said = (
        f"sources '{a}' (indices 0..15) and '{b}' (indices 0..8) overlap: joined sources need disjoint global "
        f"indices; rescan {b} with `fastclip data scan --index-offset 16`"
    )
    assert one_line_error(capsys, data_main, ["info", f"{a}::{b}"], said) == f"fastclip data info: error: {said}"
    run = ["--config", str(EMBEDDED), "--data.val", "null", "--data.zeroshot", "null"]
    run += ["--train.run_dir", str(tmp_path / "run"), "--data.train", f"{a}::{b}"]
    assert (
        one_line_error(capsys, train_main, run, said)
        == f"fastclip train: config error: config key 'data.train': {said}"
    )

    assert data_main(["scan", str(b), "--workers", "1", "--index-offset", "16"]) == 0
    assert (
        "2 shards, 9 samples, data_size 25, 2 plain WebDataset shard(s) indexed by position, indices offset by 16"
        in (capsys.readouterr().out)
    )
    manifest = json.loads((b / "manifest.json").read_text())
    assert manifest["index_offset"] == 16 and manifest["data_size"] == 25
    assert [(s["index_base"], s["index_min"], s["index_max"]) for s in manifest["shards"]] == [(0, 16, 18), (3, 19, 24)]
    before = (b / "manifest.json").read_text()
    assert data_main(["scan", str(b), "--workers", "1"]) == 0  # a rescan keeps the indices, and says so
    assert capsys.readouterr().err == (
        "fastclip data scan: note: keeping --index-offset 16 of "
        + f"{b}/manifest.json (pass --index-offset to change it)\n"
    )
    assert (b / "manifest.json").read_text() == before
    assert data_main(["scan", str(c), "--workers", "1", "--index-offset", "25"]) == 0
    assert [(s["index_min"], s["index_max"]) for s in json.loads((c / "manifest.json").read_text())["shards"]] == [
        (25, 29),
        (35, 38),
    ]

    expected = {cap: i for i, (cap, _) in enumerate(caps_a)}
    expected |= {cap: 16 + i for i, (cap, _) in enumerate(caps_b)}
    expected |= {cap: 25 + int(key) for cap, key in caps_c}
    stream = build_train_stream(
        {"train": f"{a}::{b}::{c}", "batch_size": 4, "workers": 0, "shuffle_buffer": 8},
        rank=0,
        world_size=1,
        preprocess=lambda image: torch.zeros(1),
        tokenizer=lambda texts: torch.tensor([[expected[t]] for t in texts]),  # each caption's expected index
    )
    assert stream.data_size == 39
    served = {}
    for _, texts, indices, _ in stream.epoch(0):
        assert texts[:, 0].tolist() == indices.tolist()  # every sample carries the index expected for it
        served.update(zip(indices.tolist(), texts[:, 0].tolist()))
    assert sorted(served) == sorted(expected.values()) and len(served) == len(expected) == 34
    assert stream.counters["wrapped"] == 2 and sum(stream.counters.values()) == 2, stream.counters
