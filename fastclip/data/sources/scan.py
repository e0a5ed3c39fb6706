"""`fastclip data scan`: a manifest for existing shards (img2dataset and the like).

Reads every tar once (json and txt members only; images are not decoded), takes each sample's global index
from json["index"] or, as img2dataset writes it, int(json["key"]); a plain WebDataset shard (`{key}.jpg` +
`{key}.txt`, no .json) gets the indices of its samples' positions in the manifest's shard order (recorded as
the shard's `index_base`, which the loader adds to a sample's position in the tar), and checks that indices are unique and below
data_size (--data-size; default 1 + the largest index found). Every problem is reported with shard and key
and recorded in the manifest's "problems" list: the training stream skips exactly those samples. Of two
samples with the same index, the first in manifest order (shard, then tar order) is kept.
"""
from __future__ import annotations

import glob
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fastclip.data.catalog import DataSpecError, expand_braces
from fastclip.data.format import SHARD_SUFFIXES, caption_of, image_of, index_from_meta, parse_meta
from fastclip.data.manifest import Manifest, ShardInfo, write_manifest
from fastclip.data.tario import ShardReader, TarBroken

_WANT = frozenset({"json", "txt"})


@dataclass
class ScanResult:
    manifest: Manifest
    folder: Path
    problems: list[dict]

    def summary(self) -> str:
        counts = Counter(p["reason"] for p in self.problems)
        lines = [f"{self.folder}: {len(self.manifest.shards)} shards, {self.manifest.num_samples} samples, "
                 f"data_size {self.manifest.data_size}, "
                 + (f"{plain} plain WebDataset shard(s) indexed by position, " if (plain := sum(
                     s.index_base is not None for s in self.manifest.shards)) else "")
                 + (f"{len(self.problems)} problems ({dict(counts)})" if self.problems else "no problems")]
        lines += [f"  shard {p['shard']} key {p['key']}: {p['reason']} ({p['detail']})" for p in self.problems[:50]]
        if len(self.problems) > 50:
            lines.append(f"  ... {len(self.problems) - 50} more in the manifest's 'problems'")
        return "\n".join(lines)


def find_shards(spec: str) -> tuple[Path, list[Path]]:
    """(folder, tar files) for a folder or a brace/glob pattern; all shards must share one folder."""
    path = Path(spec)
    if path.is_dir():
        tars = sorted(p for p in path.iterdir() if p.name.endswith(SHARD_SUFFIXES))
        if not tars:
            raise DataSpecError(f"folder {spec} holds no .tar shards")
        return path, tars
    paths = []
    for p in expand_braces(spec):
        paths.extend(sorted(Path(g) for g in glob.glob(p)) if any(c in p for c in "*?[") else [Path(p)])
    if not paths:
        raise DataSpecError(f"pattern {spec!r} matches no shard file")
    for p in paths:
        if not p.is_file():
            raise DataSpecError(f"shard file {p} (from pattern {spec!r}) does not exist")
    folders = {p.parent.resolve() for p in paths}
    if len(folders) > 1:
        raise DataSpecError(f"pattern {spec!r} spans several folders; scan each folder (one manifest per folder)")
    return paths[0].parent, paths


def scan_shards(spec: str, data_size: int | None = None, write: bool = True) -> ScanResult:
    folder, paths = find_shards(spec)
    shards: list[ShardInfo] = []
    problems: list[dict] = []
    owner: dict[int, tuple[str, str]] = {}  # index -> (shard, key) of its first occurrence
    found: list[tuple[str, str, int]] = []  # (shard, key, index) in order, for the range check below

    def problem(shard: str, key: str | None, reason: str, detail: str, index: int | None = None) -> None:
        problems.append({"shard": shard, "key": key, "reason": reason, "detail": detail, "index": index})

    position = 0  # samples in the shards before this one, in manifest order
    for path in paths:
        name = os.path.relpath(path.resolve(), folder.resolve())
        info = ShardInfo(name, 0)
        groups = []  # (key, members present, json meta or None, why not, caption found)
        try:
            with ShardReader(path, _WANT) as reader:
                while (raw := reader.next_group()) is not None:
                    meta, why = parse_meta(raw.files.get("json"))
                    groups.append((raw.key, raw.exts, meta, why, caption_of(raw.files, meta) is not None))
        except TarBroken as e:
            problem(name, None, "truncated_tar", f"{e}; manifest counts the {len(groups)} complete samples")
        info.num_samples = len(groups)
        # a plain WebDataset shard ({key}.jpg + {key}.txt, no .json at all): each sample's index is its position
        # in the manifest's shard order; the manifest records the shard's first one and the loader adds the
        # sample's position in the tar (a shard with some .json members keeps the per-sample rule)
        if groups and not any("json" in exts for _, exts, _, _, _ in groups):
            info.index_base = position
        for ordinal, (key, exts, meta, why, has_caption) in enumerate(groups):
            if info.index_base is not None:
                index = info.index_base + ordinal
            else:
                index = index_from_meta(meta) if meta is not None else None
            if index is None:
                problem(name, key, "missing_index", why or "json has no integer 'index' or 'key'")
                continue
            if index in owner:
                first = owner[index]
                problem(name, key, "duplicate_index", f"index {index} also at shard {first[0]} key {first[1]}", index)
                continue
            owner[index] = (name, key)
            found.append((name, key, index))
            if not has_caption:
                problem(name, key, "missing_caption", "no non-empty .txt and no json 'caption'", index)
            if image_of({e: b"" for e in exts}) is None:
                problem(name, key, "missing_image", f"members present: {', '.join(exts)}", index)
        position += info.num_samples
        shards.append(info)
    largest = max((i for _, _, i in found), default=-1)
    data_size = largest + 1 if data_size is None else data_size
    bounds: dict[str, list[int]] = {}
    for shard, key, index in found:
        if not 0 <= index < data_size:
            problem(shard, key, "index_out_of_range", f"index {index} not in [0, {data_size})", index)
            continue
        lo_hi = bounds.setdefault(shard, [index, index])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], index), max(lo_hi[1], index)
    for info in shards:
        info.index_min, info.index_max = bounds.get(info.path, (None, None))
    manifest = Manifest(data_size, shards, problems, {"created_by": "fastclip data scan"})
    if write:
        write_manifest(folder, manifest)
    return ScanResult(manifest, folder, problems)
