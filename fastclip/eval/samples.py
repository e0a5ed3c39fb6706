"""Reading evaluation samples: shards (read through fastclip.data: format.py, tario.py, manifest.py, catalog.py;
labels optional) or an image folder.

Every rank reads the same ordered stream and keeps the samples at positions `rank, rank + world, ...`:
the slices are disjoint, cover everything, and need no communication. Only a rank's own images are
decoded, so the cost of the shared pass is reading tar bytes, which is small for a held-out set.
Unlike training data, eval also takes plain tar folders and globs without a manifest, and captioned-only
or unindexed samples (retrieval needs no label, zero-shot no caption).

A sample that cannot be decoded is skipped, logged with its shard and key, and reported through the
`skipped` list: one corrupt held-out image should not stop a training run at its next evaluation.
"""

from __future__ import annotations

import glob
import logging
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from fastclip.data.catalog import expand_braces
from fastclip.data.format import (
    IMAGE_EXTS,
    MANIFEST_NAME,
    caption_of,
    group_of,
    image_of,
    label_of,
    parse_meta,
    sample_index,
)
from fastclip.data.manifest import read_manifest
from fastclip.data.samples import decode_image
from fastclip.data.tario import ShardReader, TarBroken

log = logging.getLogger(__name__)


class EvalDataError(ValueError):
    """A malformed evaluation sample or source; the message names the file and sample."""


@dataclass
class EvalSample:
    image: Image.Image | None  # RGB; None when read with decode=False (labels and captions only)
    caption: str | None
    index: int | None  # global data index (shards) or position (image folder)
    dataset: str | None
    label: int | None
    source: str  # "shard.tar:key" or the image path, for error messages
    group: int | None = None  # json "group": captions of one image (retrieval counts the image once)


# ----------------------------------------------------------------------------- locating the files
def shard_paths(source: str | os.PathLike) -> list[Path]:
    """The tar files of a shard folder (manifest order, else sorted), a single tar, a glob or a {a..b} pattern."""
    return [shard.path for shard in listed_shards(source)]


@dataclass(frozen=True)
class ListedShard:
    path: Path
    size: int | None = None  # its number of samples as a folder's manifest lists it (None: not listed)
    # a manifest's indexing, read as the training loader reads it (fastclip/data/format.py sample_index): a sample
    # without .json is index_base + its position in the tar; index_offset is added to every index
    index_base: int | None = None
    index_offset: int = 0


def listed_shards(source: str | os.PathLike) -> list[ListedShard]:
    """shard_paths with what a folder's manifest says of each shard."""
    text = str(source)
    path = Path(text)
    if path.is_dir():
        if (path / MANIFEST_NAME).is_file():
            manifest = read_manifest(path)
            listed = [
                ListedShard(path / s.path, s.num_samples, s.index_base, manifest.index_offset) for s in manifest.shards
            ]
            missing = [shard.path for shard in listed if not shard.path.is_file()]
            if missing:
                raise EvalDataError(f"{path / MANIFEST_NAME}: shard {missing[0]} listed but not found")
            return listed
        tars = sorted(path.glob("*.tar"))
        if not tars:
            raise EvalDataError(f"{path}: no {MANIFEST_NAME} and no .tar shards in this folder")
        return [ListedShard(tar) for tar in tars]
    if path.is_file():
        return [ListedShard(_tar_file(path))]
    paths = expand_pattern(text)
    missing = [p for p in paths if not p.is_file()]
    if not paths or missing:
        raise EvalDataError(f"no shards found for {text!r}" + (f" (missing: {missing[0]})" if missing else ""))
    return [ListedShard(_tar_file(p)) for p in paths]


def is_pattern(source: str | os.PathLike) -> bool:
    """Shards named by a glob or a {a..b} range (expand_pattern reads them), not a path that must exist."""
    return any(c in str(source) for c in "*?[{")


def expand_pattern(text: str) -> list[Path]:
    """The paths a {a..b} range and globs name, each glob's matches sorted; a plain part stays as it is."""
    return [Path(g) for p in expand_braces(text) for g in (sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p])]


def _tar_file(path: Path) -> Path:
    """A file given as a shard is a tar (a class-names .json or a manifest given instead was read as a shard whose
    samples were all skipped)."""
    if not tarfile.is_tarfile(path):
        raise EvalDataError(f"{path}: not a tar shard; give a shard folder, a .tar or a pattern of them")
    return path


def held_out_folder(source: str | os.PathLike) -> Path | None:
    """The folder of a held-out source: itself, the folder of a .tar, or the one folder of a pattern's shards (glob,
    {a..b}); None when the pattern's shards sit in several folders. What sits beside it (zeroshot.json, train/
    for the probe, the data's name) is found from there; with several folders nothing is taken by default."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    folders = {m.parent for m in expand_pattern(str(source))}
    return folders.pop() if len(folders) == 1 else None


def shard_subfolders(path: str | os.PathLike) -> list[str]:
    """The subfolders of `path` that hold shards (a manifest or .tar files): a data root's train/ and val/, which
    is_image_folder would take for two classes without images."""
    return [p.name for p in sorted(Path(path).iterdir()) if p.is_dir() and _holds_shards(p)]


def _holds_shards(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file() or any(path.glob("*.tar"))


def is_image_folder(path: str | os.PathLike) -> bool:
    """A folder with one subfolder per class and no shards of its own."""
    path = Path(path)
    return (
        path.is_dir()
        and not (path / MANIFEST_NAME).exists()
        and not any(path.glob("*.tar"))
        and any(p.is_dir() for p in path.iterdir())
    )


# ----------------------------------------------------------------------------- shards
class Skipped(list):
    """The messages of what evaluation left out (a list of str), with the samples they stand for: one per sample
    message; a broken shard's rest counts the samples its manifest lists after the break, or, where no manifest
    lists the shard's size, adds to `cut_shards` instead (a count of samples would be a guess)."""

    def __init__(self):
        super().__init__()
        self.samples = 0
        self.cut_shards = 0

    def append(self, message: str) -> None:  # one sample (imagenet.py's loader appends its failures)
        self.add(message, 1)

    def add(self, message: str, samples: int | None) -> None:
        super().append(message)
        if samples is None:
            self.cut_shards += 1
        else:
            self.samples += samples


def _skip(skipped: list[str], message: str, samples: int | None = 1, quiet: bool = False) -> None:
    if not quiet:  # (quiet: a look ahead of the evaluation, whose own pass says it)
        log.warning("eval data: skipped %s", message)
    if isinstance(skipped, Skipped):
        skipped.add(message, samples)
    else:
        skipped.append(message)


def _decode_shard_sample(
    files: dict[str, bytes], where: str, shard: ListedShard, ordinal: int, decode: bool = True
) -> EvalSample:
    image = image_of(files)
    if image is None:
        raise EvalDataError(
            f"{where}: no image ({'/'.join('.' + e for e in IMAGE_EXTS)}) in sample, has {sorted(files)}"
        )
    meta = {}
    if "json" in files:
        meta, why = parse_meta(files["json"])
        if meta is None:
            raise EvalDataError(f"{where}.json: {why}")
    try:
        label = label_of(files, meta)
    except ValueError as err:
        raise EvalDataError(f"{where}: {err}") from None
    group, bad_group = group_of(meta, None)
    if bad_group:
        raise EvalDataError(f"{where}.json: {bad_group}")
    try:
        decoded = decode_image(image[0]) if decode else None
    except Exception as err:  # PIL raises several types on corrupt files
        raise EvalDataError(f"{where}.{image[1]}: cannot decode image ({err})") from err
    index = sample_index(meta, files, ordinal, shard.index_base, shard.index_offset)  # (every member is loaded)
    return EvalSample(decoded, caption_of(files, meta), index, meta.get("dataset"), label, where, group)


def iter_shard_samples(
    source,
    rank: int = 0,
    world_size: int = 1,
    skipped: list[str] | None = None,
    decode: bool = True,
    quiet: bool = False,
) -> Iterator[EvalSample]:
    """This rank's samples of the shards; decode=False: their labels and captions alone, no image decoded; quiet:
    what is skipped is not logged (a look ahead of the evaluation, whose pass says it)."""
    skipped = [] if skipped is None else skipped
    position = 0
    for shard in listed_shards(source):
        path, size = shard.path, shard.size
        # every rank reads every tar: only rank 0 counts a broken one, so the all-reduced count is right.
        # A broken tar ends its shard early, at the same place on every rank.
        reader = None
        try:
            with ShardReader(path) as reader:
                while (raw := reader.next_group(load=position % world_size == rank)) is not None:
                    if position % world_size == rank:
                        try:
                            yield _decode_shard_sample(raw.files, f"{path}:{raw.key}", shard, raw.ordinal, decode)
                        except EvalDataError as err:
                            _skip(skipped, str(err), quiet=quiet)
                    position += 1
        except TarBroken as err:
            if rank == 0:
                after = reader.last_key if reader is not None else None
                read = reader.ordinal if reader is not None else 0
                # a stale manifest (fewer listed than read): the rest's size is not known
                lost = size - read if size is not None and size >= read else None
                rest = (
                    f"its last {lost} sample{'' if lost == 1 else 's'}"
                    if lost is not None
                    else "the rest of the shard (its size is not listed)"
                )
                message = f"{path}: unreadable tar shard after key {after} ({err}); {rest} skipped"
                _skip(skipped, message, lost, quiet=quiet)


# ----------------------------------------------------------------------------- image folders
def image_folder_classes(root: str | os.PathLike) -> list[str]:
    """Class folder names in label order (sorted, like torchvision's ImageFolder)."""
    return sorted(p.name for p in Path(root).iterdir() if p.is_dir())


def iter_image_folder(
    root, rank: int = 0, world_size: int = 1, dataset: str | None = None, skipped: list[str] | None = None
) -> Iterator[EvalSample]:
    """One subfolder per class; an optional `<image stem>.txt` beside an image is its caption."""
    root = Path(root)
    dataset = dataset or root.name
    skipped = [] if skipped is None else skipped
    position = 0
    for label, name in enumerate(image_folder_classes(root)):
        files = sorted(p for p in (root / name).iterdir() if p.suffix.lower().lstrip(".") in IMAGE_EXTS)
        for file in files:
            if position % world_size == rank:
                try:
                    image = decode_image(file.read_bytes())
                except Exception as err:  # PIL raises several types on corrupt files
                    _skip(skipped, f"{file}: cannot decode image ({err})")
                else:
                    caption_file = file.with_suffix(".txt")
                    try:
                        caption = caption_file.read_text(encoding="utf-8").strip() if caption_file.is_file() else None
                    except (UnicodeDecodeError, OSError) as err:  # the sample goes, not the evaluation
                        _skip(skipped, f"{caption_file}: unreadable caption ({err})")
                    else:
                        yield EvalSample(image, caption, position, dataset, label, str(file))
            position += 1


def iter_samples(source, rank: int = 0, world_size: int = 1, skipped: list[str] | None = None) -> Iterator[EvalSample]:
    """This rank's slice of an image folder or of shards; undecodable samples are appended to `skipped`."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if is_image_folder(source):
        return iter_image_folder(source, rank, world_size, skipped=skipped)
    return iter_shard_samples(source, rank, world_size, skipped)
