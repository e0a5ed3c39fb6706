"""`fastclip reshard`: the per-sample loss state of a folder of rank_<r>.pt files, rewritten for another world size.

The resharding itself is the loss library's (fastclip/losses/sharded_state.py: reshard_for_rank); this is its
command: files in and out, read with the trainer's checkpoint reader, written whole or not at all. `fastclip train
--resume` needs none of it: it reshards a checkpoint's state itself at any world size.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from fastclip.checkpoint import MODEL_FILE, fsync_dir, load_file, rank_file_name, rank_files_in, save_file
from fastclip.cli import OneLineParser
from fastclip.errors import CheckpointError
from fastclip.losses import reshard_for_rank
from fastclip.stopping import Stopped, stopped_by_signals


def _rank_files(folder: Path) -> list[Path]:
    files = rank_files_in(folder)
    if not files:
        raise FileNotFoundError(f"no rank_<r>.pt files in {folder}")
    missing = [f"rank_{r}.pt" for r in range(max(files)) if r not in files]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise FileNotFoundError(
            f"{folder}: no {shown} (resharding needs the file of every old rank, rank_0.pt to rank_{max(files)}.pt); "
            f"copy the missing rank files in, or pass a complete step folder as --in"
        )
    return [files[r] for r in range(len(files))]


def _load(path: Path) -> dict:
    try:  # the trainer's reader: one line for torn or foreign files
        return load_file(path)
    except CheckpointError as e:
        raise ValueError(str(e).replace("pass another checkpoint", "pass another --in")) from None


def _loss_states(files: list[Path]):
    for path in files:
        payload = _load(path)
        if "loss_state" not in payload:
            raise ValueError(f"{path}: no 'loss_state' entry (a model.pt? reshard reads the rank_<r>.pt files)")
        yield payload["loss_state"]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="fastclip reshard",
        description="Reshard the per-sample loss state of a folder of rank_<r>.pt files (each with a 'loss_state' "
        "entry) to another world size. The new files hold {'loss_state', 'rank', 'world_size'}; other "
        "per-rank entries describe the old layout and are not carried over. A training checkpoint "
        "needs none of this: `fastclip train --resume` reshards itself at any world size.",
    )
    parser.add_argument("--in", dest="src", required=True, type=Path, help="folder with rank_<r>.pt files")
    parser.add_argument("--world-size", required=True, type=int, help="the new number of ranks")
    parser.add_argument("--out", type=Path, default=None, help="write here instead of rewriting --in in place")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error("--world-size must be >= 1")
    try:
        with stopped_by_signals():  # SIGTERM/SIGHUP unwind like Ctrl-C: the files written so far are removed
            return _reshard_folder(args.src, args.out, args.world_size)
    except Stopped as e:
        print(f"fastclip reshard: stopped by {e.name}; nothing was changed", file=sys.stderr)
        return 128 + e.signum
    except (FileNotFoundError, ValueError, KeyError, NotADirectoryError) as e:
        print(f"fastclip reshard: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, an unreadable file: the old files are untouched
        where = e.filename or args.out or args.src
        print(
            f"fastclip reshard: error: {where}: {e.strerror or e}; nothing was changed (free space, fix the file, or "
            f"pass another --out)",
            file=sys.stderr,
        )
        return 1


def _reshard_folder(src: Path, out: Path | None, world_size: int) -> int:
    if not src.is_dir():
        raise NotADirectoryError(f"--in {src}: not a folder (pass the folder that holds rank_<r>.pt files)")
    if out is not None and out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out}: exists and is not a folder")
    if out is not None and out.is_dir() and out.resolve() != src.resolve() and any(out.iterdir()):
        # another checkpoint's rank files would be replaced, or old ones of a larger world size left beside these
        raise ValueError(f"--out {out}: exists and holds files; pass a new or empty folder")
    files = _rank_files(src)
    out_dir = out or src
    if out_dir.resolve() == src.resolve() and (src / MODEL_FILE).exists():
        raise ValueError(
            f"{src} is a training checkpoint (it has model.pt): rewriting its rank files in place "
            f"would desynchronise it from model.pt and the data positions; `fastclip train --resume` "
            f"reshards the sample state itself, or pass --out DIR for a resharded copy of the loss state"
        )
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    first = next(_loss_states(files))
    # a loss without per-sample state (a queue, τ) holds the same on every rank: rank 0's, as the trainer takes it
    per_sample = first.get("format") is not None or any(k.split(".")[-1] == "_extra_state" for k in first)
    written = []
    try:
        for rank in range(world_size):
            payload = {
                "loss_state": reshard_for_rank(_loss_states(files), world_size, rank) if per_sample else first,
                "rank": rank,
                "world_size": world_size,
            }
            tmp = out_dir / f".{rank_file_name(rank)}.tmp"
            written.append(tmp)  # first: a save that fails part-way is removed too
            save_file(payload, tmp)
    except BaseException:
        for tmp in written:  # nothing half-written is left behind
            tmp.unlink(missing_ok=True)
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    for rank, tmp in enumerate(written):  # replace only after every new shard was built
        os.replace(tmp, out_dir / rank_file_name(rank))
    fsync_dir(out_dir)
    if out_dir.resolve() == src.resolve():
        for stale in files[world_size:]:
            stale.unlink()
    if not per_sample:
        print(f"no per-sample state in {src}: rank 0's loss state (its τ, a queue) copied to {world_size} rank(s) in "
              f"{out_dir}")  # fmt: skip
        return 0
    print(f"resharded the sample state of {len(files)} rank(s) in {src} into {world_size} rank(s) in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
