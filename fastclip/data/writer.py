"""ShardWriter: samples in, fastclip shards + manifest out (the format in fastclip/data/format.py)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from fastclip.data.format import IMAGE_EXTS, sample_key
from fastclip.data.manifest import Manifest, ShardInfo, write_manifest
from fastclip.data.tario import TarWriter


class ShardWriter:
    """Cuts samples into `{prefix}-000000.tar`, ... of `shard_size` samples and tracks the manifest."""

    def __init__(self, out_dir: str | os.PathLike, *, prefix: str = "train", shard_size: int = 2000):
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.out_dir = Path(out_dir)
        self.prefix, self.shard_size = prefix, shard_size
        self.shards: list[ShardInfo] = []
        self._tar: TarWriter | None = None
        self._seen: set[int] = set()
        self.grouped = False  # some sample's group is not its own index: the manifest says groups: true

    def write(
        self,
        index: int,
        image: bytes,
        image_ext: str,
        caption: str | None,  # None: an image alone (self-supervised data, `fastclip data folder --images`)
        *,
        label: int | None = None,
        dataset: str | None = None,
        extra: dict | None = None,
        group: int | None = None,  # shared by the samples of one group: the global index of its first sample
    ) -> None:
        if image_ext not in IMAGE_EXTS:
            raise ValueError(f"sample {index}: image extension {image_ext!r} not one of {IMAGE_EXTS}")
        if index < 0 or index in self._seen:
            raise ValueError(f"sample index {index} is negative or already written")
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 0):
            raise ValueError(f"sample {index}: group {group!r} is not an integer >= 0")
        self._seen.add(index)
        key = sample_key(index)
        meta = {"index": index, "key": key} | ({} if caption is None else {"caption": caption})
        if group is not None:
            meta["group"] = group
            self.grouped |= group != index
        if label is not None:
            meta["label"], meta["dataset"] = int(label), dataset
        meta.update(extra or {})
        files = {image_ext: image, "json": json.dumps(meta).encode("utf-8")}
        if caption is not None:
            files["txt"] = caption.encode("utf-8")
        if label is not None:
            files["cls"] = str(int(label)).encode()
        if self._tar is None or self.shards[-1].num_samples >= self.shard_size:
            self._start_shard()
        self._tar.add(key, files)
        info = self.shards[-1]
        info.num_samples += 1
        info.index_min = index if info.index_min is None else min(info.index_min, index)
        info.index_max = index if info.index_max is None else max(info.index_max, index)

    def cut(self) -> None:
        """End the current shard here: the next sample starts a new one (for shards of chosen sizes)."""
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def _start_shard(self) -> None:
        if self._tar is not None:
            self._tar.close()
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._tar = TarWriter(self.out_dir / name)
        self.shards.append(ShardInfo(name, 0))

    def close(self, data_size: int, extra: dict | None = None) -> Manifest:
        """Finish the last shard and write manifest.json; data_size: 1 + the largest index that may appear."""
        if self._tar is not None:
            self._tar.close()
            self._tar = None
        largest = max((s.index_max for s in self.shards if s.index_max is not None), default=-1)
        if data_size <= largest:
            raise ValueError(f"data_size {data_size} <= largest written index {largest}")
        manifest = Manifest(data_size, self.shards, extra=dict(extra or {}), groups=self.grouped)
        write_manifest(self.out_dir, manifest)
        return manifest


@contextlib.contextmanager
def removed_on_failure(out: str | os.PathLike, splits: Iterable[str] = ()) -> Iterator[Path]:
    """Run the block that writes a data set into `out` (its files, and its split folders `out/<split>`); if it fails
    (a full disk, Ctrl-C, a bad input), remove the entries it added to those folders, the split folders it created,
    and `out` itself if it was new, so that no half data set (a train split with its manifest, no val) is left to be
    trained on and the same command can be run again. Entries that were there before are not removed (a shard of
    an earlier run under the same name is overwritten, though). Only these folders are listed, not what is below."""
    out = Path(out)
    watched = [out, *(out / split for split in splits)]
    new_folders = [p for p in (*reversed(watched[1:]), out, *out.parents) if not os.path.lexists(p)]  # deepest first

    def entries() -> set[Path]:
        return {p for folder in watched if folder.is_dir() for p in folder.iterdir()}

    before = entries()
    try:
        yield out
    except BaseException:
        for path in entries() - before - set(watched):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
        for folder in new_folders:
            with contextlib.suppress(OSError):  # rmdir takes empty folders only: nothing this run did not write
                folder.rmdir()
        raise
