"""Reading evaluation samples: WebDataset shards (fastclip/data/format.py; labels optional) or an image folder.

Every rank reads the same ordered stream and keeps the samples at positions `rank, rank + world, ...`:
the slices are disjoint, cover everything, and need no communication. Only a rank's own images are
decoded, so the cost of the shared pass is reading tar bytes, which is small for a held-out set.
(fastclip.data's `iter_labelled_samples` needs a manifest and a label on every sample; this reader also
takes plain tar folders, globs and captioned-only samples for retrieval.)

A sample that cannot be decoded is skipped, logged with its shard and key, and reported through the
`skipped` list: one corrupt held-out image should not stop a training run at its next evaluation.
"""
from __future__ import annotations

import glob
import io
import json
import logging
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from PIL import Image

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp")
log = logging.getLogger(__name__)


class EvalDataError(ValueError):
    """A malformed evaluation sample or source; the message names the file and sample."""


@dataclass
class EvalSample:
    image: Image.Image
    caption: str | None
    index: int | None  # global data index (shards) or position (image folder)
    dataset: str | None
    label: int | None
    source: str  # "shard.tar:key" or the image path, for error messages


# ----------------------------------------------------------------------------- locating the files
def shard_paths(source: str | os.PathLike) -> list[Path]:
    """The tar files of a shard folder (manifest order, else sorted), a single tar, a glob or a {a..b} pattern."""
    text = str(source)
    path = Path(text)
    if path.is_dir():
        manifest = path / "manifest.json"
        if manifest.is_file():
            return _manifest_shards(manifest)
        tars = sorted(path.glob("*.tar"))
        if not tars:
            raise EvalDataError(f"{path}: no manifest.json and no .tar shards in this folder")
        return tars
    if path.is_file():
        return [path]
    if "{" in text:
        from braceexpand import braceexpand  # a webdataset dependency

        paths = [Path(p) for p in braceexpand(text)]
    else:
        paths = [Path(p) for p in sorted(glob.glob(text))]
    missing = [p for p in paths if not p.is_file()]
    if not paths or missing:
        raise EvalDataError(f"no shards found for {text!r}" + (f" (missing: {missing[0]})" if missing else ""))
    return paths


def _manifest_shards(manifest: Path) -> list[Path]:
    try:
        with open(manifest) as f:
            entries = json.load(f)["shards"]
        paths = [manifest.parent / entry["path"] for entry in entries]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise EvalDataError(f"{manifest}: expected {{'shards': [{{'path': ...}}, ...]}} ({err!r})") from err
    for p in paths:
        if not p.is_file():
            raise EvalDataError(f"{manifest}: shard {p} listed but not found")
    return paths


def is_image_folder(path: str | os.PathLike) -> bool:
    """A folder with one subfolder per class and no shards of its own."""
    path = Path(path)
    return (
        path.is_dir()
        and not (path / "manifest.json").exists()
        and not any(path.glob("*.tar"))
        and any(p.is_dir() for p in path.iterdir())
    )


# ----------------------------------------------------------------------------- shards
def _tar_groups(path: Path, skipped: list[str]) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Yield (key, {extension: bytes}) for consecutive members sharing a key (the WebDataset convention).
    A broken tar ends its shard early (every rank reads every shard, so all stop at the same place)."""
    key, group = None, {}
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                dirname, basename = os.path.split(member.name)
                if "." not in basename or basename.startswith("."):
                    continue
                stem, ext = basename.split(".", 1)
                member_key = os.path.join(dirname, stem) if dirname else stem
                if member_key != key:
                    if group:
                        yield key, group
                    key, group = member_key, {}
                group[ext.lower()] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError) as err:
        _skip(skipped, f"{path}: unreadable tar shard after key {key} ({err}); rest of the shard skipped")
        return
    if group:
        yield key, group


def _skip(skipped: list[str], message: str) -> None:
    log.warning("eval data: skipped %s", message)
    skipped.append(message)


def _decode_shard_sample(group: dict[str, bytes], where: str) -> EvalSample:
    image_ext = next((ext for ext in IMAGE_EXTENSIONS if ext in group), None)
    if image_ext is None:
        raise EvalDataError(f"{where}: no image (.png/.jpg/.jpeg/.webp) in sample, has {sorted(group)}")
    meta = {}
    if "json" in group:
        try:
            meta = json.loads(group["json"])
        except json.JSONDecodeError as err:
            raise EvalDataError(f"{where}.json: invalid JSON ({err})") from err
    caption = group["txt"].decode("utf-8") if "txt" in group else meta.get("caption")
    label = meta.get("label")
    if label is None and "cls" in group:
        label = group["cls"].decode().strip()
    try:
        label = None if label is None else int(label)
    except ValueError as err:
        raise EvalDataError(f"{where}: label {label!r} is not an integer") from err
    index = meta.get("index")
    if index is None and "key" in meta:
        index = int(meta["key"])
    try:
        image = Image.open(io.BytesIO(group[image_ext]))
        image.load()
    except OSError as err:
        raise EvalDataError(f"{where}.{image_ext}: cannot decode image ({err})") from err
    return EvalSample(image, caption, index, meta.get("dataset"), label, where)


def iter_shard_samples(source, rank: int = 0, world_size: int = 1,
                       skipped: list[str] | None = None) -> Iterator[EvalSample]:
    skipped = [] if skipped is None else skipped
    position = 0
    for path in shard_paths(source):
        # every rank reads every tar: only rank 0 counts a broken one, so the all-reduced count is right
        for key, group in _tar_groups(path, skipped if rank == 0 else []):
            if position % world_size == rank:
                try:
                    yield _decode_shard_sample(group, f"{path}:{key}")
                except EvalDataError as err:
                    _skip(skipped, str(err))
            position += 1


# ----------------------------------------------------------------------------- image folders
def image_folder_classes(root: str | os.PathLike) -> list[str]:
    """Class folder names in label order (sorted, like torchvision's ImageFolder)."""
    return sorted(p.name for p in Path(root).iterdir() if p.is_dir())


def iter_image_folder(root, rank: int = 0, world_size: int = 1, dataset: str | None = None,
                      skipped: list[str] | None = None) -> Iterator[EvalSample]:
    """One subfolder per class; an optional `<image stem>.txt` beside an image is its caption."""
    root = Path(root)
    dataset = dataset or root.name
    skipped = [] if skipped is None else skipped
    position = 0
    for label, name in enumerate(image_folder_classes(root)):
        files = sorted(p for p in (root / name).iterdir() if p.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS)
        for file in files:
            if position % world_size == rank:
                try:
                    image = Image.open(file)
                    image.load()
                except OSError as err:
                    _skip(skipped, f"{file}: cannot decode image ({err})")
                else:
                    caption_file = file.with_suffix(".txt")
                    caption = caption_file.read_text(encoding="utf-8").strip() if caption_file.is_file() else None
                    yield EvalSample(image, caption, position, dataset, label, str(file))
            position += 1


def iter_samples(source, rank: int = 0, world_size: int = 1, skipped: list[str] | None = None) -> Iterator[EvalSample]:
    """This rank's slice of an image folder or of shards; undecodable samples are appended to `skipped`."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if is_image_folder(source):
        return iter_image_folder(source, rank, world_size, skipped=skipped)
    return iter_shard_samples(source, rank, world_size, skipped)
