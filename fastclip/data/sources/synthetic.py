"""Synthetic shards (no dataset needed): chosen shard sizes, index offsets and image formats, for the loader
benchmark (benchmarks/bench_loader.py) and the tests."""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image

from fastclip.data.manifest import Manifest
from fastclip.data.writer import ShardWriter

COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "black", "white", "grey", "pink")


def synthetic_image(index: int, size: int = 16, fmt: str = "png") -> bytes:
    """A smooth random picture (gradients plus a little noise) that compresses like a photo, not like noise."""
    rng = np.random.default_rng(index)
    yy, xx = np.mgrid[0:size, 0:size] / max(size - 1, 1)
    a, b, c = rng.uniform(-1, 1, (3, 3))
    img = np.stack([128 + 100 * np.sin(3 * (a[i] * xx + b[i] * yy) + c[i]) for i in range(3)], axis=-1)
    img += rng.normal(0, 8, img.shape)
    buf = io.BytesIO()
    jpeg = fmt in ("jpg", "jpeg")
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
        buf, format="JPEG" if jpeg else fmt.upper(), **({"quality": 90} if jpeg else {})
    )
    return buf.getvalue()


def synthetic_caption(index: int) -> str:
    return f"a {COLOURS[index % 10]} picture number {index}"


def write_synthetic(
    out_dir: str | os.PathLike,
    shard_sizes: list[int],
    *,
    index_offset: int = 0,
    image_size: int = 16,
    fmt: str = "png",
    prefix: str = "train",
    data_size: int | None = None,
    labelled: bool = False,
) -> Manifest:
    """Shards of exactly these sizes with indices index_offset, index_offset+1, ... and a manifest."""
    writer = ShardWriter(out_dir, prefix=prefix, shard_size=max(max(shard_sizes), 1))
    index = index_offset
    for size in shard_sizes:
        writer.cut()
        for _ in range(size):
            writer.write(
                index,
                synthetic_image(index, image_size, fmt),
                fmt,
                synthetic_caption(index),
                label=index % 10 if labelled else None,
                dataset="synthetic" if labelled else None,
            )
            index += 1
    return writer.close(data_size if data_size is not None else index)
