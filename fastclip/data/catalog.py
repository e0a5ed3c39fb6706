"""From a `--train-data` string to the list of shards an epoch is planned over.

Syntax (OpenCLIP's habits): sources joined with `::`; each source is a shard folder, a manifest (any FILE.json,
wherever it lives: `fastclip data scan --manifest`), or a shard pattern with brace expansion
(`/d/train-{000000..000041}.tar`, `{a,b}`) or a glob, whose manifest.json must sit beside the shards (it gives the
sample counts an epoch is planned with). Everything is checked
here, before training starts: an empty pattern, a missing shard file, a shard its manifest does not list, and
index ranges of different sources that overlap (the per-sample state is indexed by global index, so two
sources must not share indices; data_size is the largest over sources).

A remote source (`pipe:CMD`, `s3://`, `http(s)://`, as OpenCLIP writes them; fastclip/data/remote.py) is a
brace pattern of shard locations, or an http(s)/s3 URL of a manifest.json: the manifest beside the shards is
read through the same transport, and the shards are neither opened nor stat'ed before they are read.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from fastclip.data import remote
from fastclip.data.format import MANIFEST_NAME
from fastclip.data.manifest import Manifest, ManifestError, ShardInfo, read_manifest


class DataSpecError(ValueError):
    """A bad data specification (pattern, missing shard, overlapping sources); raised before training."""


@dataclass(frozen=True)
class Shard:
    path: str  # absolute path of the tar
    name: str  # path relative to its manifest folder (stable across moves of the data folder)
    num_samples: int
    source: int  # index of the `::` source it came from
    index_min: int | None
    index_max: int | None
    # (key, ordinal, reason, detail) listed in the manifest's problems; ordinal None: a manifest written before
    # problems named positions, whose samples are skipped by key
    skip: tuple[tuple[str, int | None, str, str], ...] = ()
    index_base: int | None = None  # plain WebDataset shard: index = index_base + position in the tar (manifest)
    index_offset: int = 0  # the manifest's (scan --index-offset): added to every index read from the shard


@dataclass(frozen=True)
class Source:
    spec: str
    shard_ids: tuple[int, ...]
    data_size: int
    index_min: int | None
    index_max: int | None
    index_offset: int | None = None  # scanned (`fastclip data scan` wrote its manifest): its offset; else None


@dataclass(frozen=True)
class Catalog:
    sources: tuple[Source, ...]
    shards: tuple[Shard, ...]
    data_size: int
    grouped: bool = False  # a manifest says some samples share a json "group" (the trainer then passes groups)
    # (shard, reason) of each shard-wide problem `fastclip data scan` listed for these shards (a truncated or
    # unreadable tar): the samples it could not read are in no epoch, so the run's counters never see them
    scan_broken: tuple[tuple[str, str], ...] = ()

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def fingerprint(self) -> str:
        """Identifies the shard list (names and counts): a saved stream position is only valid for the same."""
        blob = json.dumps([(s.source, s.name, s.num_samples) for s in self.shards]).encode()
        return hashlib.sha1(blob).hexdigest()[:16]


def global_batch_too_large(batch_size: int, world_size: int, per_epoch: int, source: str) -> str | None:
    """Why a global batch cannot be served from the data (one epoch cannot fill it), or None; `fastclip train` and
    `fastclip data info` both refuse it, each prefixing the key or flag it read the batch size from."""
    global_batch = batch_size * world_size
    if global_batch <= per_epoch:
        return None
    return (
        f"{batch_size} per process x {world_size} process(es) = {global_batch} is larger than the data "
        f"({per_epoch} samples per epoch in {source})"
    )


_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """Bash-style brace expansion: `{000..003}` keeps zero padding, `{a,b}` alternatives, nesting allowed."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    depth = 0
    for end in range(start, len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[end], 0)
        if depth == 0:
            break
    else:
        raise DataSpecError(f"pattern {pattern!r}: unbalanced '{{'")
    body, head, tail = pattern[start + 1 : end], pattern[:start], pattern[end + 1 :]
    match = _RANGE.match(body)
    if match:
        a, b = match.groups()
        width = len(a) if a.lstrip("-").startswith("0") and len(a) > 1 else 0
        step = 1 if int(b) >= int(a) else -1
        options = [f"{i:0{width}d}" for i in range(int(a), int(b) + step, step)]
    else:
        options, depth, cur = [], 0, ""
        for ch in body:  # split on top-level commas only
            if ch == "," and depth == 0:
                options.append(cur)
                cur = ""
                continue
            depth += {"{": 1, "}": -1}.get(ch, 0)
            cur += ch
        options.append(cur)
        if len(options) == 1:  # "{x}" is literal in bash; keep it so
            return [head + "{" + p for p in expand_braces(body + "}" + tail)]
    return [p for option in options for p in expand_braces(head + option + tail)]


def _remote_shards(spec: str) -> tuple[list[tuple[str, str, ShardInfo | None]], dict[str, Manifest]]:
    """(shard location, location of its manifest, its entry when the source is the manifest) for each shard of a
    remote source, and those manifests (read through the shards' own transport, once per folder; no shard is
    opened or stat'ed here)."""
    if spec.endswith(".json") and not spec.startswith("pipe:"):  # a manifest's URL, by any name
        locations = None
        manifest_locs = [spec]
    else:
        locations = expand_braces(spec)
        manifest_locs = list(dict.fromkeys(remote.sibling(loc, MANIFEST_NAME) for loc in locations))
    manifests = {}
    for loc in manifest_locs:
        try:
            data = json.loads(remote.read_bytes(loc).decode("utf-8"))
        except remote.RemoteError as e:
            raise DataSpecError(f"source {spec!r}: cannot read its manifest: {e}") from None
        except ValueError as e:
            raise DataSpecError(f"source {spec!r}: manifest {loc} is not valid JSON ({e})") from None
        manifests[loc] = Manifest.from_json(data, loc)
    if locations is None:
        return [(remote.sibling(spec, s.path), spec, s) for s in manifests[spec].shards], manifests
    return [(loc, remote.sibling(loc, MANIFEST_NAME), None) for loc in locations], manifests


def _shard_paths(spec: str) -> tuple[list[tuple[Path, Path, ShardInfo | None]], dict[Path, Manifest]]:
    """(shard file, its manifest file, its entry when the source is the manifest) for each shard of one source,
    and those manifests by file. A local source ending in .json is a manifest file, wherever it lives (`fastclip
    data scan --manifest`): its shard paths are absolute or relative to its folder."""
    if remote.is_remote(spec):
        return _remote_shards(spec)
    path = Path(spec)
    if path.is_dir() or path.suffix == ".json":
        file = path / MANIFEST_NAME if path.is_dir() else path
        file = file.parent.resolve() / file.name  # relative shard paths start from the folder it is in
        manifest = read_manifest(file)
        if not manifest.shards:
            raise DataSpecError(f"source {spec!r}: manifest {file} lists no shards")
        return [(file.parent / s.path, file, s) for s in manifest.shards], {file: manifest}
    paths = []
    for p in expand_braces(spec):
        if any(ch in p for ch in "*?["):
            paths.extend(sorted(Path(g) for g in glob.glob(p)))
        else:
            paths.append(Path(p))
    if not paths:
        raise DataSpecError(f"pattern {spec!r} matches no shard file")
    manifests: dict[Path, Manifest] = {}
    for p in paths:
        if not p.is_file():
            raise DataSpecError(f"shard file {p} (from pattern {spec!r}) does not exist")
        file = p.parent.resolve() / MANIFEST_NAME
        if file not in manifests:
            try:
                manifests[file] = read_manifest(file)
            except ManifestError as e:
                raise DataSpecError(f"shard {p} (from pattern {spec!r}): {e}") from None
    return [(p, p.parent.resolve() / MANIFEST_NAME, None) for p in paths], manifests


def _refuse_unlisted_shards(spec: str, folder: Path, file: Path, manifest: Manifest) -> None:
    """A folder source is its manifest's shards: a .tar in the folder that it neither lists nor names as broken was
    added after the scan, and would be left out of every epoch without a word (as a pattern naming it is refused)."""
    named = [s.path for s in manifest.shards] + [str(q.get("shard")) for q in manifest.problems if q.get("key") is None]
    by_name = {os.path.normpath(p) for p in named}
    unlisted = [f for f in folder.glob("*.tar") if f.name not in by_name]  # (a directory listing: every start)
    if unlisted:  # linked shards are listed by their targets (scan resolves them): compared resolved, these only
        known = {os.path.realpath(file.parent / p) for p in named}
        unlisted = sorted(f.name for f in unlisted if os.path.realpath(f) not in known)
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise DataSpecError(
            f"source {spec!r}: shard {folder / unlisted[0]}{more} is in the folder but not listed in {file}, so it "
            f"would not be trained on; run `fastclip data scan` on the folder again to list it (or move it out)"
        )


def resolve_catalog(train_data: str, data_size: int | None = None) -> Catalog:
    if not isinstance(train_data, str) or not train_data.strip():
        raise DataSpecError(f"empty data pattern {train_data!r}")
    shards: list[Shard] = []
    sources: list[Source] = []
    taken: dict[str, str] = {}  # a shard's absolute path -> the source that has it
    grouped = False
    broken: list[tuple[str, str]] = []
    for source_id, spec in enumerate(s.strip() for s in train_data.split("::")):
        if not spec:
            raise DataSpecError(f"empty source in {train_data!r} (two '::' in a row?)")
        paths, manifests = _shard_paths(spec)
        grouped |= any(m.groups for m in manifests.values())
        first = len(shards)
        shards += _source_shards(spec, source_id, paths, manifests, taken)
        if not remote.is_remote(spec) and Path(spec).is_dir():  # (after its listed shards were found)
            _refuse_unlisted_shards(spec, Path(spec), *next(iter(manifests.items())))
        ids = tuple(range(first, len(shards)))
        broken += _scan_broken(paths, manifests, {os.path.normpath(shards[i].name) for i in ids})
        lows = [shards[i].index_min for i in ids if shards[i].index_min is not None]
        highs = [shards[i].index_max for i in ids if shards[i].index_max is not None]
        sources.append(
            Source(
                spec,
                ids,
                max(m.data_size for m in manifests.values()),
                min(lows, default=None),
                max(highs, default=None),
                _scan_offset(manifests.values()),
            )
        )
    _check_disjoint(sources)
    size = max(s.data_size for s in sources)
    if data_size is not None:
        if data_size < size:
            raise DataSpecError(
                f"data_size {data_size} is smaller than the manifests' data_size {size} "
                f"(largest index {size - 1} would not fit)"
            )
        size = data_size
    return Catalog(tuple(sources), tuple(shards), size, grouped, tuple(broken))


def _scan_broken(paths: list, manifests: dict, names: set[str]) -> list[tuple[str, str]]:
    """The shard-wide problems the manifests list for a source's shards: those of its shards, and where the source
    is the whole manifest (not a pattern), those of shards scan left out of it."""
    whole = bool(paths) and paths[0][2] is not None
    return [
        (str(q.get("shard")), str(q.get("reason", "manifest_problem")))
        for m in manifests.values()
        for q in m.problems
        if q.get("key") is None and (whole or os.path.normpath(str(q.get("shard"))) in names)
    ]


def _source_shards(spec: str, source_id: int, paths: list, manifests: dict, taken: dict[str, str]) -> list[Shard]:
    """The shards of one source (its pattern `spec`), each with its manifest entry and the samples its manifest
    lists as problems; `taken` gains each one (a shard in two sources is refused)."""
    # lookups by path, so 40k-shard patterns stay linear
    entries = {f: {os.path.normpath(s.path): s for s in m.shards} for f, m in manifests.items()}
    problems: dict[tuple[Path, str], list] = {}
    for f, m in manifests.items():
        for q in m.problems:
            if q.get("key") is not None:
                problems.setdefault((f, os.path.normpath(str(q.get("shard")))), []).append(q)
    shards = []
    for p, where, entry in paths:
        if entry is None:  # a pattern's shard: looked up in the manifest beside it
            entry = _listed_entry(p, where, entries[where], spec)
        rel = os.path.normpath(entry.path)
        absolute = p if isinstance(p, str) else _existing_shard(p, where)
        if absolute in taken:
            raise DataSpecError(f"shard {p} appears in two sources: {taken[absolute]!r} and {spec!r}")
        taken[absolute] = spec
        skip = tuple(
            (
                str(q["key"]),
                _problem_ordinal(q, rel, where),
                str(q.get("reason", "manifest_problem")),
                str(q.get("detail", "")),
            )
            for q in problems.get((where, rel), ())
        )
        shards.append(
            Shard(
                absolute,
                entry.path,
                entry.num_samples,
                source_id,
                entry.index_min,
                entry.index_max,
                skip,
                entry.index_base,
                manifests[where].index_offset,
            )
        )
    return shards


def _listed_entry(p, where: Path, entries: dict, spec: str):
    """The entry of the manifest `where` for shard p (remote: named by its file name there)."""
    if isinstance(p, str):
        rel = remote.shard_basename(p)
    else:
        rel = os.path.normpath(os.path.relpath(p.resolve(), where.parent))
    entry = entries.get(rel)
    if entry is None:
        raise DataSpecError(
            f"shard {p} (from pattern {spec!r}) is not listed in {where}; "
            f"run `fastclip data scan` on its folder to rebuild it"
        )
    return entry


def _existing_shard(p: Path, where: Path) -> str:
    """The absolute path of a local shard the manifest `where` lists, which must exist."""
    if not p.is_file():
        how = "on its folder" if where.name == MANIFEST_NAME else f"with --manifest {where}"
        raise DataSpecError(
            f"shard file {p} (listed in {where}) does not exist: restore it, or rerun `fastclip data "
            f"scan` {how} to list the shards that are there"
        )
    return str(p.resolve())


def _scan_offset(manifests) -> int | None:
    """A source's index offset when `fastclip data scan` wrote its manifests (then a rescan can move it); else None."""
    manifests = list(manifests)
    if all(m.extra.get("created_by") == "fastclip data scan" for m in manifests):
        return max(m.index_offset for m in manifests)
    return None


def _check_disjoint(sources: list[Source]) -> None:
    spans = sorted((s.index_min, s.index_max, i) for i, s in enumerate(sources) if s.index_min is not None)
    for (_, hi, i), (lo_next, _, j) in zip(spans, spans[1:]):
        if lo_next <= hi:
            a, b = sources[min(i, j)], sources[max(i, j)]  # named in `::` order; the later one is moved
            if b.index_offset is not None:  # scanned: the least offset that moves it past the other (no tar rewritten)
                offset = b.index_offset + a.index_max + 1 - b.index_min
                fix = f"rescan {b.spec} with `fastclip data scan --index-offset {offset}`"
            else:
                fix = f"write {b.spec} again with --index-offset {a.index_max + 1} (or more)"
            raise DataSpecError(
                f"sources {a.spec!r} (indices {a.index_min}..{a.index_max}) and {b.spec!r} (indices "
                f"{b.index_min}..{b.index_max}) overlap: joined sources need disjoint global indices; {fix}"
            )


def _problem_ordinal(problem: dict, shard: str, where) -> int | None:
    """A manifest problem's position in its tar (None where the manifest names the key only)."""
    ordinal = problem.get("ordinal")
    if ordinal is None:
        return None
    if isinstance(ordinal, bool) or not isinstance(ordinal, int) or ordinal < 0:
        raise DataSpecError(
            f"{where}: a problem of shard {shard} (key {problem['key']}) has ordinal {ordinal!r}, not a position "
            f"in the tar (an integer >= 0); run `fastclip data scan` on its folder to rebuild it"
        )
    return ordinal
