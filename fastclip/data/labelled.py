"""Reading labelled held-out shards for evaluation (and zeroshot.json).

    for image, caption, index, dataset, label in iter_labelled_samples("data/embedded/val", rank, world):
        ...

Rank r reads the samples at positions [N*r/W, N*(r+1)/W) of the manifest order, so ranks share the work and
their union is every sample exactly once. Bad samples are skipped, logged with shard and key and, if a dict is
passed as `counters`, counted there (same reasons as training, plus "missing_label"; duplicates are caught
among the samples one rank reads, `fastclip data scan` catches them all).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterator, NamedTuple

from PIL import Image

from fastclip.data.catalog import resolve_catalog
from fastclip.data.samples import check_sample, decode_image
from fastclip.data.tario import ShardReader, TarBroken

log = logging.getLogger(__name__)


class LabelledSample(NamedTuple):
    image: Image.Image  # RGB
    caption: str
    index: int
    dataset: str | None
    label: int


def iter_labelled_samples(source: str | os.PathLike, rank: int = 0, world_size: int = 1, *,
                          counters: dict | None = None) -> Iterator[LabelledSample]:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} / world_size {world_size} is not a valid rank")
    catalog = resolve_catalog(str(source))
    total = catalog.num_samples
    lo, hi = total * rank // world_size, total * (rank + 1) // world_size
    counters = counters if counters is not None else {}

    def skip(reason: str, shard: str, key: str | None, detail: str, n: int = 1) -> None:
        counters[reason] = counters.get(reason, 0) + n
        log.warning("eval data: skipped %d sample(s): shard %s key %s: %s (%s)", n, shard, key, reason, detail)

    start, seen = 0, {}  # seen: index -> (shard, key) of its first sample on this rank
    for shard in catalog.shards:
        first, last = max(lo, start) - start, min(hi, start + shard.num_samples) - start
        start += shard.num_samples
        if first >= last:
            continue
        listed = {k: (r, d) for k, r, d in shard.skip}
        got, reader = 0, None
        try:
            with ShardReader(shard.path) as reader:
                if reader.skip_to(first):
                    while reader.ordinal < last and (raw := reader.next_group()) is not None:
                        got += 1
                        if raw.key in listed:
                            skip(listed[raw.key][0], shard.name, raw.key, listed[raw.key][1])
                            continue
                        sample = _labelled(raw, catalog.data_size, shard.name, skip)
                        if sample is None:
                            continue
                        first_seen = seen.setdefault(sample.index, (shard.name, raw.key))
                        if first_seen != (shard.name, raw.key):
                            skip("duplicate_index", shard.name, raw.key,
                                 f"index {sample.index} already read from shard {first_seen[0]} key {first_seen[1]}")
                            continue
                        yield sample
            if got < last - first:
                skip("truncated_tar", shard.name, reader.last_key, "fewer samples than the manifest says",
                     last - first - got)
        except TarBroken as e:
            skip("truncated_tar" if reader is not None else "unreadable_shard", shard.name,
                 reader.last_key if reader is not None else None, str(e), last - first - got)


def _labelled(raw, data_size: int, shard: str, skip) -> LabelledSample | None:
    cand, reason, detail = check_sample(raw, data_size)
    if cand is None:
        skip(reason, shard, raw.key, detail)
        return None
    label = cand.meta.get("label")
    if label is None and "cls" in raw.files:
        try:
            label = int(raw.files["cls"].decode().strip())
        except ValueError:
            label = None
    if not isinstance(label, int) or isinstance(label, bool):
        skip("missing_label", shard, raw.key, "no integer json 'label' or .cls")
        return None
    try:
        image = decode_image(cand.image)
    except Exception as e:
        skip("undecodable_image", shard, raw.key, f"{type(e).__name__}: {e}")
        return None
    return LabelledSample(image, cand.caption, cand.index, cand.meta.get("dataset"), label)


def load_zeroshot(path: str | os.PathLike) -> dict:
    """DIR/zeroshot.json (or the file itself): {"datasets": {name: {"classnames": [...], "templates": [...]}}}."""
    p = Path(path)
    p = p / "zeroshot.json" if p.is_dir() else p
    with open(p, encoding="utf-8") as f:
        data = json.load(f)
    for name, entry in data.get("datasets", {}).items():
        if not entry.get("classnames") or not entry.get("templates"):
            raise ValueError(f"{p}: dataset {name!r} needs non-empty 'classnames' and 'templates'")
    return data
