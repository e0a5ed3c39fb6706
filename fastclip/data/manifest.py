"""`manifest.json`: what a shard folder holds, so readers can plan an epoch without opening a tar.

    {"format": "fastclip-shards/1", "data_size": 75000, "num_samples": 63000,
     "shards": [{"path": "train-000000.tar", "num_samples": 1000, "index_min": 0, "index_max": 999}, ...],
     "problems": [{"shard": "x.tar", "key": "...", "ordinal": 17, "reason": "duplicate_index", "detail": "..."}],
     "groups": true}

`num_samples` of a shard counts its key groups in tar order, bad ones included: the stream addresses samples
by (shard, ordinal), so this must match what a reader walking the tar sees. `problems` (optional) is written by
`fastclip data scan`: the stream skips the samples listed there by ordinal (by key where an older manifest names
none). A duplicate index can only be decided with the whole data set in view, so scan decides it once and the
stream follows. `groups` (optional, written only when true): some samples share a json "group" (format.py); the
trainer then passes the group ids to the loss, which otherwise needs none (each sample its own group).

`index_offset` (optional, `fastclip data scan --index-offset`): added to every index the loader takes from these
shards (json `index`/`key`, or `index_base` + position) and to every json "group", so two scanned data sets can be
joined with `::` without rewriting a tar; `index_min`, `index_max`, `data_size` and the problems' indices already
include it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastclip.data.format import MANIFEST_FORMAT, MANIFEST_NAME


class ManifestError(ValueError):
    """A manifest that is missing, unreadable or inconsistent; the message names the file and field."""


@dataclass
class ShardInfo:
    path: str  # relative to the manifest's folder, or absolute (a manifest kept apart from its shards)
    num_samples: int
    index_min: int | None = None  # None: the shard has no sample with a usable index
    index_max: int | None = None
    # plain WebDataset shard (no .json members): sample k of the tar has global index index_base + k (written by
    # `fastclip data scan`: its position in the manifest's shard order); None: indices come from the .json
    index_base: int | None = None


@dataclass
class Manifest:
    data_size: int
    shards: list[ShardInfo]
    problems: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # free-form provenance (writer, datasets, seed)
    groups: bool = False  # some samples share a json "group"
    index_offset: int = 0  # added to every index read from the shards (scan --index-offset)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    def to_json(self) -> dict:
        out = {
            "format": MANIFEST_FORMAT,
            "data_size": self.data_size,
            "num_samples": self.num_samples,
            "shards": [
                {
                    "path": s.path,
                    "num_samples": s.num_samples,
                    "index_min": s.index_min,
                    "index_max": s.index_max,
                    **({} if s.index_base is None else {"index_base": s.index_base}),
                }
                for s in self.shards
            ],
        }
        if self.index_offset:
            out["index_offset"] = self.index_offset
        if self.problems:
            out["problems"] = self.problems
        if self.groups:  # absent when false: manifests without groups stay as they were
            out["groups"] = True
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    @classmethod
    def from_json(cls, data: dict, where: str) -> Manifest:
        def need(d: dict, key: str, kind, ctx: str):
            if key not in d:
                raise ManifestError(f"{where}: missing field {ctx}{key!r}")
            value = d[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ManifestError(f"{where}: field {ctx}{key!r} is {value!r}, expected {kind}")
            return value

        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a JSON object")
        if data.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"{where}: field 'format' is {data.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        data_size = need(data, "data_size", int, "")
        shards, seen = [], set()
        for i, entry in enumerate(need(data, "shards", list, "")):
            ctx = f"shards[{i}]."
            if not isinstance(entry, dict):
                raise ManifestError(f"{where}: shards[{i}] is not an object")
            info = ShardInfo(
                need(entry, "path", str, ctx),
                need(entry, "num_samples", int, ctx),
                entry.get("index_min"),
                entry.get("index_max"),
                need(entry, "index_base", int, ctx) if "index_base" in entry else None,
            )
            if info.num_samples < 0:
                raise ManifestError(f"{where}: {ctx}num_samples is negative ({info.num_samples})")
            if info.path in seen:
                raise ManifestError(f"{where}: shard {info.path!r} listed twice")
            if info.index_max is not None and info.index_max >= data_size:
                raise ManifestError(
                    f"{where}: shard {info.path!r} has index_max {info.index_max} >= data_size {data_size}"
                )
            seen.add(info.path)
            shards.append(info)
        problems = data.get("problems", [])
        groups = data.get("groups", False)
        if not isinstance(groups, bool):
            raise ManifestError(f"{where}: field 'groups' is {groups!r}, expected true or false")
        offset = need(data, "index_offset", int, "") if "index_offset" in data else 0
        if offset < 0:
            raise ManifestError(f"{where}: index_offset is negative ({offset})")
        known = {"format", "data_size", "num_samples", "shards", "problems", "groups", "index_offset"}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(data_size, shards, list(problems), extra, groups, offset)


def manifest_path(folder_or_file: str | os.PathLike) -> Path:
    p = Path(folder_or_file)
    return p if p.name == MANIFEST_NAME or p.suffix == ".json" else p / MANIFEST_NAME


def read_manifest(folder_or_file: str | os.PathLike) -> Manifest:
    path = manifest_path(folder_or_file)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        scan = f"{path.parent}" if path.name == MANIFEST_NAME else f"SHARDS --manifest {path}"
        raise ManifestError(
            f"no manifest at {path}: write shards with `fastclip data embedded|folder` or run "
            f"`fastclip data scan {scan}`"
        ) from None
    except ValueError as e:
        scan = f"{path.parent}" if path.name == MANIFEST_NAME else f"SHARDS --manifest {path}"
        raise ManifestError(f"{path}: not valid JSON ({e}); rewrite it with `fastclip data scan {scan}`") from None
    except OSError as e:  # a folder, no permission: one line, not a traceback
        raise ManifestError(f"{path}: cannot be read ({e.strerror or e}); pass a readable manifest file") from None
    return Manifest.from_json(data, str(path))


def write_manifest(folder: str | os.PathLike, manifest: Manifest) -> Path:
    """Write atomically (tmp + rename) so a reader never sees half a manifest."""
    path = manifest_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest.to_json(), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path
