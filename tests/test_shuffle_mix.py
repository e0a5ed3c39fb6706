"""How well a per-GPU batch mixes the shards: distinct shards per batch of the recipes' shuffle, measured on
real shards with the real stream, against OpenCLIP's sample pipeline (webdataset: shard shuffle, then a
5,000-sample shuffle buffer with 1,000 initial samples, batches made in the worker) on the same shards.

The shape is the recipes' worst case: img2dataset's full shards of 10,000 samples (CC3M's hold ~8,200, CC12M's
~7,400) and a per-GPU batch of 128 (the smallest of the recipes), one loader worker's share of an epoch of
60,000 samples (the CC3M recipe: 2.72M samples over 8 GPUs x 6 workers = 56,700 per worker). Our stream
shuffles a worker's contiguous positions in windows of data.shuffle_buffer samples, so a batch draws from the
shards one window spans; OpenCLIP's buffer keeps a tail of older shards."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from fastclip.data import build_train_stream
from fastclip.data.sources.synthetic import synthetic_image
from fastclip.data.writer import ShardWriter

REPO = Path(__file__).resolve().parents[1]
# the cluster recipes (embedded*.yaml and scenes*.yaml are the small CPU configs: a few shards, no shuffle window)
RECIPES = sorted(p.name for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith(("embedded", "scenes")))
SHARD, SHARDS, BATCH = 10_000, 6, 128


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mix")
    image = synthetic_image(0, 4)  # one tiny picture for all: only the indices matter here
    writer = ShardWriter(out, shard_size=SHARD)
    for index in range(SHARD * SHARDS):
        writer.write(index, image, "png", f"a picture number {index}")
    writer.close(SHARD * SHARDS)
    return out


def _ours(shards: Path, shuffle_buffer: int, batches: int | None = None) -> list[int]:
    stream = build_train_stream(
        {"train": str(shards), "batch_size": BATCH, "workers": 0, "seed": 2024, "shuffle_buffer": shuffle_buffer},
        rank=0,
        world_size=1,
        preprocess=lambda image: torch.zeros(1),
        tokenizer=lambda texts: torch.zeros(len(texts), 1, dtype=torch.long),
    )
    served = itertools.islice(stream.epoch(0), batches)
    return [len(set((indices // SHARD).tolist())) for _, _, indices, _ in served]


def _openclip(shards: Path) -> list[int]:
    import webdataset as wds

    # open_clip's get_wds_dataset (training/data.py, not resampled) with its default sizes
    urls = [str(p) for p in sorted(shards.glob("*.tar"))]
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.detshuffle(bufsize=2000, initial=500, seed=2024, epoch=0),
        wds.split_by_node,
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.shuffle(bufsize=5000, initial=1000, rng=random.Random(2024)),
        wds.to_tuple("json"),
        wds.batched(BATCH, collation_fn=list, partial=False),
    )
    return [len({json.loads(j)["index"] // SHARD for (j,) in batch}) for batch in pipeline]


def _summary(counts: list[int]) -> dict:
    return {
        "mean": sum(counts) / len(counts),
        "one_shard": sum(c == 1 for c in counts) / len(counts),
        "batches": len(counts),
    }


def test_recipe_shuffle_mixes_shards_at_least_as_well_as_openclip(shards):
    buffers = {yaml.safe_load((REPO / "configs" / name).read_text())["data"]["shuffle_buffer"] for name in RECIPES}
    assert len(buffers) == 1, buffers  # one value for every recipe, measured here
    (recipe,) = buffers
    # the old window's batches come from one shard from the start: the first 100 show it, the rest would repeat it
    ours, old, openclip = (
        _summary(_ours(shards, recipe)),
        _summary(_ours(shards, 1000, 100)),
        _summary(_openclip(shards)),
    )
    print(f"distinct shards per batch of {BATCH}: recipe buffer {recipe}: {ours}; 1000: {old}; OpenCLIP: {openclip}")
    assert ours["batches"] == -(-SHARD * SHARDS // BATCH) and openclip["batches"] == SHARD * SHARDS // BATCH
    assert ours["mean"] >= openclip["mean"] and ours["one_shard"] <= openclip["one_shard"], (ours, openclip)
    assert old["mean"] < 1.2 and old["one_shard"] > 0.8, old  # what the recipes had: batches from one shard


@pytest.mark.parametrize("name", RECIPES)
def test_recipes_batches_are_at_least_the_measured_shape(name):
    data = yaml.safe_load((REPO / "configs" / name).read_text())["data"]
    assert data["batch_size"] >= BATCH  # a larger batch draws from the same window: more shards, not fewer
