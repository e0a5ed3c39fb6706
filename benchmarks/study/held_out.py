"""Whether a study's val, test and novel splits are held out from train: the share of each split's samples whose
image is, byte for byte, one of train's. A table scored on training images measures memory, not learning, and a
split folder copied or linked from train/ passes every other check; `run` refuses a split that is mostly train's
and the report prints every share (a few exact duplicates are common in scraped data)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from fastclip.data.format import IMAGE_EXTS, image_of
from fastclip.data.manifest import read_manifest
from fastclip.data.tario import TarBroken, iter_shard

from . import records
from .spec import SpecError

SPLITS = ("val", "test", "novel")
MOSTLY = 0.5  # a split with this share of train's images or more is a copy of it, not duplicates
_IMAGES = frozenset(IMAGE_EXTS)


def _shards(folder: Path) -> list[Path]:
    """The split's shards as its manifest lists them (what training and evaluation read); none without one."""
    try:
        return [folder / shard.path for shard in read_manifest(folder).shards]
    except ValueError:  # none, or unreadable: `run` refuses a split's bad manifest itself (ensure_data)
        return []


def _split_shards(data: Path) -> dict[str, list[Path]]:
    """train's and each of SPLITS's shards (its manifest read once)."""
    return {split: _shards(data / split) for split in ("train", *SPLITS)}


def image_digests(shards: list[Path]) -> list[bytes]:
    """One digest per sample with an image, over a split's shards (a shard that breaks or is missing counts up to
    the break: training and evaluation report those themselves)."""
    digests = []
    for shard in shards:
        try:
            for sample in iter_shard(shard, _IMAGES):
                if (image := image_of(sample.files)) is not None:
                    digests.append(hashlib.blake2b(image[0], digest_size=16).digest())
        except (OSError, TarBroken):
            pass
    return digests


def shares_in_train(data: Path, up_to: int | None = None) -> dict[str, float | None]:
    """{split: share of its images that are train's}, for the splits the data has; every share None when the
    shards are larger than `up_to` bytes in all (default HASH_DATA_UP_TO; not measured: reading them would take
    minutes), or train has no manifest here."""
    up_to = records.HASH_DATA_UP_TO if up_to is None else up_to
    shards = _split_shards(data)
    splits = [s for s in SPLITS if shards[s]]
    size = sum(p.stat().st_size for s in ("train", *splits) for p in shards[s] if p.is_file())
    if size > up_to or not shards["train"]:  # (no train manifest here: nothing to compare with)
        return {s: None for s in splits}
    train = set(image_digests(shards["train"]))
    shares = {}
    for split in splits:
        digests = image_digests(shards[split])
        shares[split] = sum(d in train for d in digests) / len(digests) if digests else None
    return shares


def shared_shards(data: Path) -> dict[str, Path]:
    """{split: a shard of it that is one of train's files (a link, or the same path)}: found at any size."""

    def file_id(path: Path) -> tuple[int, int]:
        st = path.stat()
        return st.st_dev, st.st_ino

    shards = _split_shards(data)
    train = {file_id(p) for p in shards["train"] if p.is_file()}
    found = {}
    for split in SPLITS:
        for shard in (p for p in shards[split] if p.is_file()):
            if file_id(shard) in train:
                found[split] = shard
                break
    return found


def check(data: Path, dataset: str) -> dict[str, float | None]:
    """The shares; SpecError naming the first split that is mostly train's images, or holds one of train's shard
    files (said at any size; the shares are read up to HASH_DATA_UP_TO, and `run` says when they were not)."""
    for split, shard in shared_shards(data).items():
        raise SpecError(
            f"datasets.{dataset}.data {data}: {split}/'s shard {shard} is a training shard's file; {split}/ must "
            "hold samples that training does not see"
        )
    shares = shares_in_train(data)
    if shares and all(share is None for share in shares.values()):
        print(
            f"note: datasets.{dataset}: whether {', '.join(shares)} hold train's images is not measured (shards over "
            f"{records.HASH_DATA_UP_TO >> 30} GiB, or no train manifest)",
            flush=True,
        )
    for split, share in shares.items():
        if share is not None and share >= MOSTLY:
            raise SpecError(
                f"datasets.{dataset}.data {data}: {100 * share:.1f} % of {split}/'s images are train/'s, byte for "
                f"byte; {split}/ must hold samples that training does not see (is it a copy or a link of train/?)"
            )
    return shares
