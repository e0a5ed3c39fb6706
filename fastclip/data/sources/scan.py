"""`fastclip data scan`: a manifest for existing shards (img2dataset and the like).

Reads every tar once (json and txt members only; images are not decoded), takes each sample's global index
from json["index"] or, as img2dataset writes it, int(json["key"]); a plain WebDataset shard (`{key}.jpg` +
`{key}.txt`, no .json) gets the indices of its samples' positions in the manifest's shard order (recorded as
the shard's `index_base`, which the loader adds to a sample's position in the tar), and checks that indices are
unique and below
data_size (--data-size; default 1 + the largest index found), and that a json "group" is an integer >= 0 (the
manifest says `groups: true` when some samples share one). Every problem is reported with shard and key
and recorded in the manifest's "problems" list: the training stream skips exactly those samples. Of two
samples with the same index, the first in manifest order (shard, then tar order) is kept. Each problem names
its sample by key and by position in the tar (`ordinal`, what the stream skips by), so two samples of one shard
under one key are told apart when they are apart in the tar; next to each other a tar reader merges them into
one sample, keeping the last of each member (one image lost): that is a problem (`duplicate_key`). The
manifest's num_samples counts key groups, bad ones included (what a reader walking the tar sees); the summary
says how many of them are usable, and a scan with none writes nothing. `--index-offset N` adds N to every index
(recorded as the manifest's `index_offset`, which the loader adds too: no tar is rewritten), so scanned sets can be
joined with `::`; a rescan keeps the old manifest's offset unless given one. `--manifest FILE.json` writes the
manifest elsewhere (a read-only data set), naming shards outside its folder by absolute path; training reads it as
`data.train FILE.json`.

A scan never shrinks what a folder's manifest.json offers without being told: a scan that would leave out shards
the old manifest lists and the folder still holds is refused (scan the folder, or move the manifest away); a
listed shard that is gone from the folder is left out with a note. Remote sources are not scanned: the manifest is
written where the shards are (README, "Remote shards").

At LAION scale: shards are summarised in parallel processes (--workers, default all cores) and streamed back
one at a time in manifest order; what stays in memory is one bit per index (fastclip/data/bits.py) and each
shard's entry, not an object per sample (benchmarks/bench_scan.py measures both). Where img2dataset left
`{shard}.parquet` (read with pyarrow, if installed: the keys of its `status == "success"` rows, which are the
tar's samples in order) or `{shard}_stats.json` (`successes` samples; the indices bounded by img2dataset's key
scheme, shard_id * 10**digits(samples_per_shard - 1) + row, so nothing per sample is checked) the tar is not
opened; --from-tars reads the tars anyway.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fastclip.cli import plural
from fastclip.data.bits import IndexBits
from fastclip.data.catalog import DataSpecError, expand_braces
from fastclip.data.format import (
    MANIFEST_NAME,
    SHARD_SUFFIXES,
    caption_of,
    group_of,
    image_of,
    index_from_meta,
    parse_meta,
)
from fastclip.data.manifest import Manifest, ManifestError, ShardInfo, read_manifest, write_manifest
from fastclip.data.remote import is_remote
from fastclip.data.tario import ShardReader, TarBroken

_WANT = frozenset({"json", "txt"})


@dataclass
class ScanResult:
    manifest: Manifest
    folder: Path
    problems: list[dict]
    usable: int = 0  # samples no problem lists (the stream skips listed ones): what training can use
    notes: list[str] = field(default_factory=list)  # for stderr: what the new manifest leaves out, and why
    path: Path | None = None  # where the manifest goes: folder/manifest.json, or --manifest

    def summary(self) -> str:
        counts = Counter(p["reason"] for p in self.problems)
        total = self.manifest.num_samples
        lines = [
            f"{self.folder}: {plural(len(self.manifest.shards), 'shard')}, "
            f"{plural(total, 'sample')}{'' if self.usable == total else f' ({self.usable} usable)'}, "
            f"data_size {self.manifest.data_size}, "
            + (
                f"{plain} plain WebDataset shard(s) indexed by position, "
                if (plain := sum(s.index_base is not None for s in self.manifest.shards))
                else ""
            )
            + ("multi-positive groups (json 'group'), " if self.manifest.groups else "")
            + (f"indices offset by {offset}, " if (offset := self.manifest.index_offset) else "")
            + (f"{plural(len(self.problems), 'problem')} ({dict(counts)})" if self.problems else "no problems")
        ]
        via = self.manifest.extra.get("scanned_from", {})
        if via.get("stats") or via.get("parquet"):
            lines.append(
                f"  counted from img2dataset's files without opening the tars: {via.get('parquet', 0)} "
                f"shard(s) from .parquet (keys checked), {via.get('stats', 0)} from _stats.json (counts and key "
                f"ranges only)"
            )
        if unread := self.manifest.extra.get("parquet_unread"):
            lines.append(
                f"  note: {unread} img2dataset .parquet file(s) not read: pyarrow is not installed (pip install -e "
                f"'.[parquet]'), so their shards were counted from the tars or _stats.json"
            )
        # a shard-wide problem (a truncated tar) has no sample key: its detail says where in the tar it broke
        for p in self.problems[:50]:
            sample = "" if p["key"] is None else f" key {p['key']}"
            lines.append(f"  shard {p['shard']}{sample}: {p['reason']} ({p['detail']})")
        if len(self.problems) > 50:
            lines.append(f"  ... {len(self.problems) - 50} more in the manifest's 'problems'")
        return "\n".join(lines)


def find_shards(spec: str) -> tuple[Path, list[Path]]:
    """(folder, tar files) for a folder, its manifest.json, or a brace/glob pattern; all shards must share one
    folder."""
    if is_remote(spec):  # a Path of a URL or a command names nothing (and loses the URL's "//")
        raise DataSpecError(
            f"{spec}: a remote source; `fastclip data scan` reads local shards only: scan them where they are (or a "
            f"local copy) and upload the manifest.json beside them, where training reads it (README, Remote shards)"
        )
    path = Path(spec)
    if path.name == MANIFEST_NAME and path.is_file():  # as training reads it: the manifest stands for its folder
        path = path.parent
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
        if not p.name.endswith(SHARD_SUFFIXES):  # a list of shards, a manifest: read as a tar it is "unreadable"
            where = "" if str(p) == spec else f" (from pattern {spec!r})"
            raise DataSpecError(
                f"{p}{where} is not a {'/'.join(SHARD_SUFFIXES)} shard; pass the shards' folder (or its "
                f"{MANIFEST_NAME}) or a brace/glob pattern of the shard files"
            )
    folders = {p.parent.resolve() for p in paths}
    if len(folders) > 1:
        raise DataSpecError(f"pattern {spec!r} spans several folders; scan each folder (one manifest per folder)")
    return paths[0].parent, paths


def _names(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def keep_listed_shards(folder: Path, scanned: list[str], path: Path | None = None) -> tuple[list[str], Manifest | None]:
    """Refuse a scan whose manifest would drop shards the manifest it replaces (the folder's manifest.json, or
    `path`) lists and the folder still holds (a scan of one shard would silently shrink the training data to it);
    notes for what the new manifest leaves out otherwise (listed shards gone from the folder, an old manifest that
    cannot be read), and the old manifest (None: none, or unreadable). `scanned`: names as the new manifest has
    them (relative to its folder, or absolute)."""
    path = folder / MANIFEST_NAME if path is None else path
    if not path.is_file():
        return [], None
    try:
        old = read_manifest(path)
    except ManifestError as e:  # what a rescan is for: said, since what it held is replaced
        return [f"replacing {path}, which could not be read ({e})"], None
    # compared as the files they are: a shard may be named through a link (scanned as the path it resolves to)
    base = path.parent
    reading = {(base / name).resolve() for name in scanned}
    left_out = [s.path for s in old.shards if (base / s.path).resolve() not in reading]
    present = [name for name in left_out if (base / name).is_file()]
    if present:
        raise DataSpecError(
            f"{path} lists {plural(len(old.shards), 'shard')}, this scan reads {len(scanned)}: it would drop "
            f"{_names(present)} from the manifest; scan the folder itself (or a pattern naming every listed shard), "
            f"or move {path} away to write a manifest of these shards only"
        )
    gone = [name for name in left_out if name not in present]
    if gone:
        return [
            f"{path} listed {plural(len(gone), 'shard')} no longer in {folder} ({_names(gone)}): left out of the "
            f"new manifest ({plural(len(old.shards) - len(gone), 'listed shard')} kept)"
        ], old
    return [], old


@dataclass
class ShardSummary:
    """What a scan keeps of one shard while it is checked (then only its ShardInfo and index range remain)."""

    name: str
    num_samples: int
    via: str  # "tar", "parquet" (img2dataset's {shard}.parquet) or "stats" ({shard}_stats.json: counts only)
    indices: np.ndarray | None = None  # int64 per sample in tar order, MISSING where none; None: via stats
    keys: list[str] | None = None
    notes: list[tuple[int, str, str]] = field(default_factory=list)  # (ordinal, reason, detail)
    plain: bool = False  # no .json member at all: indexed by position (fastclip/data/catalog.py)
    bounds: tuple[int, int] | None = None  # via stats: the shard's key range (img2dataset's key scheme)
    broken: str | None = None
    broken_reason: str = "truncated_tar"  # the loader's reason: unreadable_shard when the tar cannot be opened
    grouped: bool = False  # some sample's json "group" is not its own index


MISSING = np.iinfo(np.int64).min
IMG2DATASET_SAMPLES_PER_SHARD = 10_000  # img2dataset's --number_sample_per_shard default


def _stem(path: Path) -> str:
    name = path.name
    for suffix in SHARD_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _summarise(task: tuple) -> ShardSummary:
    """One shard's summary (runs in a pool process). task: (path, name, via, key_base, wanted indices)."""
    path, name, via, key_base = task[:4]
    if via == "stats":
        with open(path, encoding="utf-8") as f:
            stats = json.load(f)
        count, successes = int(stats["count"]), int(stats["successes"])
        return ShardSummary(name, successes, via, bounds=(key_base, key_base + max(count, 1) - 1))
    if via == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=["key", "status"]).to_pydict()
        keys = [str(k) for k, st in zip(table["key"], table["status"]) if st == "success"]  # the tar's samples
        indices = np.array([int(k) if k.strip().lstrip("-").isdigit() else MISSING for k in keys], dtype=np.int64)
        notes = [
            (o, "missing_index", f"parquet key {k!r} is not an integer")
            for o, k in enumerate(keys)
            if indices[o] == MISSING
        ]
        return ShardSummary(name, len(keys), via, indices, keys, notes)
    keys, values, notes, missing, any_json, broken, reader = [], [], [], [], False, None, None
    grouped = False
    try:
        with ShardReader(path, _WANT) as reader:
            while (raw := reader.next_group()) is not None:
                ordinal = len(keys)
                keys.append(raw.key)
                notes += _merged_key_notes(raw.key, raw.exts, ordinal)
                any_json |= "json" in raw.exts
                meta, why = parse_meta(raw.files.get("json"))
                index = index_from_meta(meta) if meta is not None else None
                values.append(MISSING if index is None else index)
                if index is None:
                    missing.append((ordinal, "missing_index", why or "json has no integer 'index' or 'key'"))
                group, bad_group = group_of(meta, index)
                if bad_group:
                    notes.append((ordinal, "bad_group", f"index {index}: {bad_group}"))
                grouped |= group is not None and group != index
                if caption_of(raw.files, meta) is None:
                    notes.append((ordinal, "missing_caption", "no non-empty .txt and no json 'caption'"))
                if image_of({e: b"" for e in raw.exts}) is None:
                    notes.append((ordinal, "missing_image", f"members present: {', '.join(raw.exts)}"))
    except TarBroken as e:
        broken = f"{e}; manifest counts the {plural(len(keys), 'complete sample')}"
    summary = ShardSummary(name, len(keys), via, np.array(values, dtype=np.int64), keys, notes, broken=broken)
    summary.grouped = grouped
    if broken and reader is None:  # never opened: what the loader calls it too
        summary.broken_reason = "unreadable_shard"
    # a plain WebDataset shard ({key}.jpg + {key}.txt, no .json at all): indexed by position in the manifest's
    # shard order (a shard with some .json members keeps the per-sample rule, its json-less samples missing one)
    summary.plain = bool(keys) and not any_json
    if not summary.plain:
        summary.notes += missing
    return summary


def _merged_key_notes(key: str, exts: tuple, ordinal: int) -> list[tuple[int, str, str]]:
    """A key that names several samples next to each other: a reader takes their members as one sample and keeps
    the last of each extension (the others are lost). The same key further apart is two samples, each addressed
    by its position: nothing to list."""
    copies = max(Counter(exts).values(), default=1)
    if copies == 1:
        return []
    return [
        (
            ordinal,
            "duplicate_key",
            f"{copies} samples under key {key}, next to each other in the tar, read as one that keeps the last of "
            f"each member: skipped; give each sample its own key",
        )
    ]


def _owner_keys(task: tuple) -> dict[int, str]:
    """{index: key} of the first sample with each wanted index in one shard (to name a duplicate's first copy)."""
    summary, wanted = _summarise(task), task[4]
    out: dict[int, str] = {}
    for key, index in zip(summary.keys or (), (summary.indices if summary.indices is not None else ()).tolist()):
        if index in wanted and index not in out:
            out[index] = key
    return out


def _pyarrow_present() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


def _parquet_of(path: Path) -> Path:
    stem = path.parent / _stem(path)
    return stem.with_name(stem.name + ".parquet")


def shard_name(shard: Path, base: Path, apart: bool = False) -> str:
    """How a manifest in folder `base` names a shard: by its path relative to `base` (the pair moves together); a
    manifest kept apart (`--manifest` elsewhere) names shards outside its folder by absolute path, so it can be
    copied or moved alone. Training reads either (fastclip/data/catalog.py)."""
    real = shard.resolve()
    rel = os.path.relpath(real, base.resolve())
    return str(real) if apart and (rel == os.pardir or rel.startswith(os.pardir + os.sep)) else rel


def manifest_unwritable(path: Path) -> str | None:
    """Why the manifest cannot be written at `path`, said before an hour of scanning rather than after it."""
    if path.is_dir():
        return f"--manifest {path}: is a folder; name the manifest file (FILE.json)"
    ancestor = next(p for p in (path.parent.absolute(), *path.parent.absolute().parents) if p.exists())
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        why = "a file" if not ancestor.is_dir() else "not writable"
        return f"cannot write {path}: {ancestor} is {why}; pass --manifest PATH in a folder you can write"
    return None


def _plan(
    base: Path, paths: list[Path], from_tars: bool, samples_per_shard: int | None, apart: bool = False
) -> list[tuple]:
    """Per shard: where its summary comes from. img2dataset's {shard}.parquet (needs pyarrow) or
    {shard}_stats.json when present (the tar is not opened), else the tar. `base`: the manifest's folder."""
    parquet_ok = _pyarrow_present()
    per_shard = samples_per_shard or IMG2DATASET_SAMPLES_PER_SHARD
    oom = len(str(per_shard - 1)) if per_shard > 1 else 1  # img2dataset: key = shard_id * 10**oom + position
    tasks = []
    for path in paths:
        name = shard_name(path, base, apart)
        stem = path.parent / _stem(path)
        if not from_tars and parquet_ok and _parquet_of(path).is_file():
            tasks.append((str(_parquet_of(path)), name, "parquet", 0, frozenset()))
        elif not from_tars and stem.with_name(stem.name + "_stats.json").is_file() and stem.name.isdigit():
            tasks.append(
                (str(stem.with_name(stem.name + "_stats.json")), name, "stats", int(stem.name) * 10**oom, frozenset())
            )
        else:
            tasks.append((str(path), name, "tar", 0, frozenset()))
    return tasks


def _check_key_scheme(tasks: list[tuple], paths: list[Path], per_shard: int) -> None:
    """Shards counted from img2dataset's _stats.json take their index ranges from the key scheme that --samples-per-
    shard implies (key = shard_id * 10**digits + row). A wrong value gives ranges too wide (or overlapping) and a
    data_size many times the data. The first key of one tar (the first such shard with an id above 0) shows the
    scheme: it must lie in its shard's range, else the scan is refused naming the value the keys imply. A tar that
    cannot be read is left to the shard's own checks."""
    for (_, name, via, base, _), path in zip(tasks, paths):
        shard_id = int(_stem(path)) if via == "stats" else 0
        if shard_id == 0:
            continue
        try:
            with ShardReader(path, _WANT) as reader:
                first = reader.next_group(load=False)
        except (TarBroken, OSError):
            return
        if first is None or not first.key.isdigit():
            return
        key = int(first.key)
        if base <= key < base + 10 ** len(str(per_shard - 1)):
            return
        implied = next((d for d in range(19) if key // 10**d == shard_id), None)
        hint = f" (its keys imply --samples-per-shard {10**implied})" if implied else ""
        raise DataSpecError(
            f"shard {name} (img2dataset shard {shard_id}) starts with key {first.key}, outside the range "
            f"{base}..{base + 10 ** len(str(per_shard - 1)) - 1} that --samples-per-shard {per_shard} gives it: pass "
            f"--samples-per-shard as given to img2dataset{hint}, or --from-tars to read the indices from the tars"
        )


def _start_method() -> str:
    """fork, unless pyarrow is loaded here: its jemalloc keeps a background thread, and a fork taken while that
    thread holds its lock leaves the child waiting on it for ever (a parallel scan hung so in the test suite);
    forkserver's children fork from a clean server instead."""
    methods = mp.get_all_start_methods()
    if "fork" in methods and "pyarrow" not in sys.modules:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


def _map(fn, tasks: list, workers: int):
    """fn over tasks in order, in `workers` processes (1: here); results stream back one shard at a time."""
    if workers <= 1 or len(tasks) <= 1:
        yield from map(fn, tasks)
        return
    ctx = mp.get_context(_start_method())
    with ctx.Pool(min(workers, len(tasks))) as pool:
        yield from pool.imap(fn, tasks, chunksize=1)


def scan_shards(
    spec: str,
    data_size: int | None = None,
    write: bool = True,
    *,
    workers: int | None = None,
    from_tars: bool = False,
    samples_per_shard: int | None = None,
    progress=None,
    captions: bool = True,
    index_offset: int | None = None,
    manifest: str | os.PathLike | None = None,
) -> ScanResult:
    """Scan in `workers` processes (default: all cores), one shard summary at a time: what stays in memory is a
    bitmap of the indices seen (fastclip/data/bits.py), each shard's ShardInfo and the problems found.
    ``captions`` False (image-only shards, for ssl training): a sample without a caption is no problem.
    ``index_offset``: added to every index found (recorded in the manifest; the loader adds it too); None: the
    old manifest's (a rescan keeps the indices a run's per-sample state refers to), else 0. ``manifest``: the
    file to write (default: manifest.json beside the shards)."""
    folder, paths = find_shards(spec)
    target = folder / MANIFEST_NAME if manifest is None else Path(manifest)
    tasks = _plan(target.parent, paths, from_tars, samples_per_shard, apart=manifest is not None)
    _check_key_scheme(tasks, paths, samples_per_shard or IMG2DATASET_SAMPLES_PER_SHARD)
    notes, old = keep_listed_shards(folder, [task[1] for task in tasks], target)  # before any work: it may refuse
    if index_offset is None:
        index_offset = old.index_offset if old is not None else 0
        if index_offset:
            notes.append(f"keeping --index-offset {index_offset} of {target} (pass --index-offset to change it)")
    workers = (os.cpu_count() or 1) if workers is None else workers
    tally = _Tally(data_size, index_offset)
    for s_id, summary in enumerate(_map(_summarise, tasks, workers)):
        if not captions:
            summary.notes = [note for note in summary.notes if note[1] != "missing_caption"]
        tally.add(s_id, summary)
        if progress is not None:
            progress(1)
    shards = tally.shards
    _name_first_copies(tally.pending, tally.spans, tasks, workers, shards, index_offset)
    _check_stats_ranges(tasks, tally.spans, shards)
    if data_size is None:
        data_size = tally.largest + 1
        if old is not None and old.data_size > data_size:  # e.g. the val split's indices follow train's
            notes.append(
                f"keeping data_size {old.data_size:,} of {target}, above the largest index found + 1 ({data_size:,}): "
                f"a run's per-sample state is sized by it (pass --data-size to change it)"
            )
            data_size = old.data_size
    extra = {"created_by": "fastclip data scan"}
    if tally.via["stats"] or tally.via["parquet"]:
        extra["scanned_from"] = dict(tally.via)
    unread = 0 if from_tars or _pyarrow_present() else sum(_parquet_of(path).is_file() for path in paths)
    if unread:  # said in the summary: without pyarrow the scan reads those tars (or _stats.json) instead
        extra["parquet_unread"] = unread
    result = Manifest(data_size, shards, tally.problems, extra, groups=tally.grouped, index_offset=index_offset)
    if write:
        write_manifest(target, result)
    return ScanResult(result, folder, tally.problems, tally.usable, notes, target)


class _Tally:
    """What a scan keeps across the shard summaries, in manifest order: a bitmap of the indices seen, each shard's
    ShardInfo and span of indices it owns, the problems found and the samples usable."""

    def __init__(self, data_size: int | None, index_offset: int):
        self.data_size, self.index_offset = data_size, index_offset
        self.shards: list[ShardInfo] = []
        self.problems: list[dict] = []
        self.seen = IndexBits()
        self.spans: list[
            tuple[int, int] | None
        ] = []  # per shard: min/max of the indices it owns (to find a first copy)
        self.pending: list[tuple[dict, int, int]] = []  # (duplicate problem, its index, its shard): first copy earlier
        self.via = Counter()
        self.grouped = False
        self.position, self.largest, self.usable = 0, -1, 0  # position: samples in the shards before this one

    def problem(self, shard: str, key: str | None, reason: str, detail: str, index=None, ordinal=None) -> dict:
        entry = {"shard": shard, "key": key, "ordinal": ordinal, "reason": reason, "detail": detail, "index": index}
        self.problems.append(entry)
        return entry

    def add(self, s_id: int, summary: ShardSummary) -> None:
        """Shard number s_id's summary."""
        self.via[summary.via] += 1
        self.grouped |= summary.grouped
        info = ShardInfo(summary.name, summary.num_samples)
        if summary.broken:
            self.problem(summary.name, None, summary.broken_reason, summary.broken)
        if summary.bounds is not None:  # counts only: the key range bounds the indices, nothing per sample
            bounds = (summary.bounds[0] + self.index_offset, summary.bounds[1] + self.index_offset)
            info.index_min, info.index_max = bounds
            self.largest = max(self.largest, bounds[1])
            self.spans.append(bounds)
            self.usable += summary.num_samples  # nothing per sample is known to be wrong
        else:
            self._add_samples(s_id, summary, info)
        self.position += info.num_samples
        self.shards.append(info)

    def _add_samples(self, s_id: int, summary: ShardSummary, info: ShardInfo) -> None:
        """A shard read sample by sample: its indices checked against those seen and data_size."""
        idx = summary.indices
        if summary.plain:
            info.index_base = self.position
            idx = self.position + np.arange(summary.num_samples, dtype=np.int64)
        if self.index_offset:  # as the loader does: a negative index stays negative (out of range)
            idx = np.where(idx >= 0, idx + self.index_offset, idx)
        valid = idx != MISSING
        ok = valid & (idx >= 0)
        dup = np.zeros(len(idx), dtype=bool)
        dup[ok] = self.seen.add_many(idx[ok])
        keep = ok & ~dup
        if self.data_size is not None:
            out = keep & (idx >= self.data_size)
        else:
            out = np.zeros(len(idx), dtype=bool)
        rows = self._rows(summary, idx, valid, keep, dup, out)
        for o, reason, detail, index in sorted(rows, key=lambda r: r[0]):
            entry = self.problem(summary.name, summary.keys[o], reason, detail, index, o)
            if detail is None:
                self.pending.append((entry, index, s_id))
        self.usable += summary.num_samples - len({o for o, *_ in rows})
        owned = idx[ok & ~dup]
        self.spans.append((int(owned.min()), int(owned.max())) if len(owned) else None)
        kept = idx[keep & ~out]
        if len(kept):
            info.index_min, info.index_max = int(kept.min()), int(kept.max())
            self.largest = max(self.largest, info.index_max)

    def _rows(self, summary: ShardSummary, idx, valid, keep, dup, out) -> list[tuple[int, str, str | None, int | None]]:
        """(ordinal, reason, detail, index) of the shard's problem samples; a duplicate whose first copy is in an
        earlier shard has no detail yet (_name_first_copies writes it)."""
        data_size = self.data_size
        rows: list[tuple[int, str, str, int | None]] = [
            (o, r, d, None) for o, r, d in summary.notes if r == "missing_index"
        ]
        rows += [(o, r, d, int(idx[o])) for o, r, d in summary.notes if r != "missing_index" and keep[o]]
        # (without --data-size only a negative index is out of range: no upper bound to name)
        bound = f"not in [0, {data_size})" if data_size is not None else "is negative"
        rows += [
            (o, "index_out_of_range", f"index {int(idx[o])} {bound}", int(idx[o]))
            for o in np.nonzero((valid & (idx < 0)) | out)[0].tolist()
        ]
        first_here = {}
        for o in np.nonzero(keep)[0].tolist():
            first_here.setdefault(int(idx[o]), o)
        for o in np.nonzero(dup)[0].tolist():
            i = int(idx[o])
            if i in first_here and first_here[i] < o:
                detail = f"index {i} also at shard {summary.name} key {summary.keys[first_here[i]]}"
                rows.append((o, "duplicate_index", detail, i))
            else:
                rows.append((o, "duplicate_index", None, i))
        return rows


def _name_first_copies(pending, spans, tasks, workers, shards, offset: int = 0) -> None:
    """A duplicate whose first copy is in an earlier shard: re-read the earlier shards whose index range holds
    it (usually one, usually none) for that copy's key, so the problem names both samples. (Indices here include
    the offset; the shards' own do not.)"""
    wanted: dict[int, set[int]] = {}
    for _, index, s_id in pending:
        for t in range(s_id):
            if spans[t] is not None and spans[t][0] <= index <= spans[t][1] and tasks[t][2] != "stats":
                wanted.setdefault(t, set()).add(index - offset)
    owners: dict[int, tuple[str, str]] = {}
    order = sorted(wanted)
    jobs = [tasks[t][:4] + (frozenset(wanted[t]),) for t in order]
    for t, found in zip(order, _map(_owner_keys, jobs, workers)):
        for index, key in found.items():
            owners.setdefault(index + offset, (shards[t].path, key))
    for entry, index, _ in pending:
        shard, key = owners.get(index, ("(earlier shard)", "?"))
        entry["detail"] = f"index {index} also at shard {shard} key {key}"


def _check_stats_ranges(tasks, spans, shards) -> None:
    """A shard counted from img2dataset's stats has only a key range: it must not overlap another shard's."""
    ranges = sorted(
        (lo, hi, shards[t].path, tasks[t][2]) for t, span in enumerate(spans) if span is not None for lo, hi in [span]
    )
    for (lo_a, hi_a, a, via_a), (lo_b, hi_b, b, via_b) in zip(ranges, ranges[1:]):
        if lo_b <= hi_a and "stats" in (via_a, via_b):
            raise DataSpecError(
                f"shards {a} (key range {lo_a}..{hi_a}) and {b} (key range {lo_b}..{hi_b}) overlap "
                f"by img2dataset's _stats.json: pass --samples-per-shard as given to img2dataset, or "
                f"--from-tars to read the indices from the tars"
            )
