"""The study's records: one small JSON per finished run under <results>/runs/<run id>.json, and the code that ran it.

A run records the commit it ran at, the git tree of the code (fastclip/ and configs/) and whether that code had
uncommitted changes (then a hash of the diff). Two runs are "from the same code" when those keys are equal, so a
commit that touches only docs or benchmarks does not make a table stale. It records its data too (data_fingerprint):
a run on other data is not from the same code either."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from .spec import SpecError

REPO = Path(__file__).resolve().parents[2]
CODE_PATHS = ("fastclip", "configs")


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def code_version() -> dict:
    """{commit, code (the key runs are compared by), dirty}: code is the tree id of fastclip/ and configs/ at HEAD,
    plus "+dirty-<hash of the diff>" when either has uncommitted changes. Outside a repository (a copy of the working
    tree on a lent GPU machine) the file named by STUDY_CODE_VERSION says it (written, from the repository, by
    `bash benchmarks/gpu_check.sh prepare`)."""
    commit = _git("rev-parse", "HEAD")
    given = os.environ.get("STUDY_CODE_VERSION")
    if not commit and given:
        version = json.loads(Path(given).read_text())
        if version.pop("files", None) != files_digest():
            raise SpecError(
                f"STUDY_CODE_VERSION {given} was written for other code than this copy's {', '.join(CODE_PATHS)}: "
                "run `bash benchmarks/gpu_check.sh prepare` again where the repository is, and carry it anew"
            )
        return version
    commit = commit or "unknown"
    trees = [_git("rev-parse", f"HEAD:{p}")[:12] for p in CODE_PATHS]
    diff = _git("diff", "HEAD", "--", *CODE_PATHS)
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", *CODE_PATHS).splitlines()
    dirty = bool(diff or untracked)
    code = "-".join(trees)
    if dirty:  # the diff, and each new file's name and bytes (an edit to an untracked file is other code too)
        digest = hashlib.sha1(diff.encode())
        for name in untracked:
            digest.update(f"\0{name}\0".encode() + (REPO / name).read_bytes())
        code += "+dirty-" + digest.hexdigest()[:8]
    return {"commit": commit[:12], "code": code, "dirty": dirty}


def files_digest() -> str:
    """A hash of the code's files as they are (names and bytes; caches left out): what a copy without .git is
    checked by against the version recorded where the repository is."""
    digest = hashlib.sha1()
    for root in CODE_PATHS:
        for path in sorted((REPO / root).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                digest.update(f"{path.relative_to(REPO)}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def run_path(results: Path, run_id: str) -> Path:
    return results / "runs" / f"{run_id}.json"


def read_json(path: Path, fix: str):
    """A JSON file's content; SpecError naming the file and `fix` (what to do) when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        why = getattr(error, "strerror", None) or str(error).splitlines()[0]
        raise SpecError(f"{path}: unreadable ({why}); {fix}") from None


def load(results: Path, run_id: str) -> dict | None:
    """A finished run's record, None when the run has none; SpecError for a file that is no run record (a
    truncated write, a hand edit): a table must not take it as a result, nor the runner as done."""
    path = run_path(results, run_id)
    if not path.is_file():
        return None
    fix = f"delete it to run {run_id} again"
    record = read_json(path, fix)
    final = record.get("final") if isinstance(record, dict) else None
    if not isinstance(final, dict):
        raise SpecError(f"{path}: not a run record (no `final` mapping); {fix}")
    value = final.get("metric")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise SpecError(f"{path}: not a run record (final.metric is {value!r}, not a number); {fix}")
    if not isinstance(record.get("code"), str):
        raise SpecError(f"{path}: not a run record (no `code`: the code version that ran it); {fix}")
    return record


def write_atomic(path: Path, text: str) -> None:
    """Never half-written: a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def save(results: Path, run_id: str, record: dict) -> None:
    path = run_path(results, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, separators=(",", ":")))  # a run is done exactly when its JSON exists


def move_stale(results: Path, run_id: str) -> Path:
    """Move a run's JSON out of the tables (to <results>/stale/, kept for the record) so the run is pending again;
    one moved there before (from older code) stays: this one becomes <run>~2.json, ~3, ..."""
    src = run_path(results, run_id)
    dst = results / "stale" / f"{run_id}.json"
    dst.parent.mkdir(parents=True, exist_ok=True)
    copy = 2
    while dst.exists():
        dst, copy = dst.with_name(f"{Path(run_id).name}~{copy}.json"), copy + 1
    src.replace(dst)
    return dst


HASH_DATA_UP_TO = 2 << 30  # bytes of shards read for the fingerprint; past it, their names and sizes stand in


def data_fingerprint(data: Path) -> str:
    """What tells a study's data apart: a hash of its splits' manifests, its zeroshot.json and its shards' bytes (2
    GiB take about 10 s, once per process); past HASH_DATA_UP_TO, every shard's name and size instead (tar files
    come in 10 KiB blocks, so other shards of the same count and similar content may then pass)."""
    digest = hashlib.sha1()
    shards = []
    for split in ("train", "val", "test", "novel"):
        folder = data / split
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                if path.name == "manifest.json":
                    digest.update(f"{split}/{path.name}\0".encode() + path.read_bytes())
                elif path.suffix == ".tar":
                    shards.append((f"{split}/{path.name}", path))
    whole = sum(path.stat().st_size for _, path in shards) <= HASH_DATA_UP_TO
    for name, path in shards:
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        if whole:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    zeroshot = data / "zeroshot.json"
    if zeroshot.is_file():
        digest.update(b"zeroshot.json\0" + zeroshot.read_bytes())
    return digest.hexdigest()[:12]


def round_floats(value, digits: int = 4):
    """Floats rounded for the JSONs (issue 41: the old study's per-run JSONs were 14 MB)."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: round_floats(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [round_floats(v, digits) for v in value]
    return value
