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
