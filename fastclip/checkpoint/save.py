"""The collective write of one step folder.

A save writes everything into a hidden temporary folder, fsyncs each file, renames the folder into place and only
then rewrites `latest` (temporary file, fsync, rename): a crash at any point leaves the previous checkpoint and
pointer intact. The run folder must be on a filesystem every rank sees (one writer per file).
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

from fastclip import faults
from fastclip.checkpoint.files import free_bytes, fsync_dir, mib, save_file, tensor_bytes, write_text_atomic
from fastclip.checkpoint.layout import (
    LATEST,
    MODEL_FILE,
    last_good,
    prune_checkpoints,
    rank_file_name,
    step_dir_name,
)
from fastclip.distributed import DistInfo, barrier
from fastclip.errors import CheckpointError


def save_checkpoint(
    root: Path,
    step: int,
    info: DistInfo,
    *,
    model_file: dict | None,
    rank_file: dict,
    keep_last: int,
    write_extra=None,
    durable: bool = True,
) -> Path:
    """Collective: every rank calls it with its rank_file; rank 0 also passes model_file. write_extra(folder),
    called on every rank, adds files to the step folder before it is renamed into place (DeepSpeed's shards).
    durable=False skips the fsyncs: the renames still make a kill safe, but a power loss may lose the newest save."""
    final = root / step_dir_name(step)
    tmp = root / f".tmp_{final.name}"
    try:
        return _save(root, final, tmp, step, info, model_file, rank_file, keep_last, write_extra, durable)
    except BaseException as e:
        if info.is_main:  # never leave a half-written folder behind; `latest` still names the last good one
            _remove_while_others_finish(tmp)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:  # what it needed and what was there, in one line
            needed = tensor_bytes(rank_file) + (tensor_bytes(model_file) if model_file is not None else 0)
            raise CheckpointError(
                f"rank {info.rank}: cannot write checkpoint {final} (No space left on device): this rank's files "
                f"need about {mib(needed)}, {mib(free_bytes(root))} are free on the disk of {root}; "
                f"nothing of it was kept and {last_good(root)}. Free space (or lower --checkpoint.keep_last), then "
                f"restart with --train.resume latest"
            ) from None
        if isinstance(e, OSError):
            raise CheckpointError(
                f"rank {info.rank}: cannot write checkpoint {final} ({e.strerror or e}"
                f"{': ' + str(e.filename) if e.filename else ''}); nothing of it was kept and {last_good(root)}. "
                f"Free space or make {root} writable, then restart with --train.resume latest"
            ) from None
        raise


def _remove_while_others_finish(tmp: Path, seconds: float = 5.0) -> None:
    """rmtree, again while another rank's file still lands in the folder: a rank that was writing when this one
    failed finishes its file after the first pass (seen: .tmp_step_* left with rank_1.pt in it). A file begun later
    still is removed by the next save or resume (stale folders)."""
    deadline = time.monotonic() + seconds
    while True:
        shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists() or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _save(
    root: Path,
    final: Path,
    tmp: Path,
    step: int,
    info: DistInfo,
    model_file: dict | None,
    rank_file: dict,
    keep_last: int,
    write_extra,
    durable: bool,
) -> Path:
    if info.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if final.is_symlink() or (final.exists() and not final.is_dir()):  # not ours to move aside
            raise CheckpointError(
                f"rank {info.rank}: cannot write checkpoint {final}: a {'link' if final.is_symlink() else 'file'} "
                f"has its name; nothing was written and {last_good(root)}. Move it away, then restart with "
                f"--train.resume latest"
            )
        # left over by a crash during an earlier save: a half-written .tmp, or the .old copy of a step saved
        # again whose removal was cut short (latest never names either)
        for stale in [*root.glob(".tmp_step_*"), *root.glob(".old_step_*")]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier(info)
    try:
        save_file(rank_file, tmp / rank_file_name(info.rank), durable=durable)
    except FileNotFoundError:
        if info.is_main or tmp.exists():
            raise
        # rank 0's part of this save failed and it removed the folder: the barrier below then names the save that
        # failed (rank 0's own line says why), rather than this rank blaming a file of its own
    faults.hook("checkpoint.rank_files", step=step, rank=info.rank)
    if info.is_main:
        faults.hook("checkpoint.model_file", step=step, rank=info.rank)
        save_file(model_file, tmp / MODEL_FILE, durable=durable)
    if write_extra is not None:
        write_extra(tmp)
    barrier(info)  # all rank files are on disk
    if info.is_main:
        if durable:
            fsync_dir(tmp)
        old = None
        if final.exists():  # the same step saved again (a run resumed and stopped at once)
            old = root / f".old_{final.name}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        if durable:
            fsync_dir(root)
        faults.hook("checkpoint.renamed", step=step, rank=info.rank)
        write_text_atomic(root / LATEST, final.name + "\n", durable=durable)
        if old is not None:
            shutil.rmtree(old)
        prune_checkpoints(root, keep_last, keep=final)
    barrier(info)
    return final
