"""Checkpoints: one folder per step, written atomically, a `latest` pointer, the last k kept.

    <run_dir>/checkpoints/
        step_00001000/model.pt      rank 0: towers (open_clip state_dict), loss parameters, optimizer, scaler,
                                    step, epoch, world size, resolved config, arch, model config
        step_00001000/rank_<r>.pt   rank r: its shard of the per-sample state ("loss_state"), its data-stream
                                    position ("data"), its RNG states ("rng")
        latest                      text naming the newest complete step folder; written last

A save writes everything into a hidden temporary folder, fsyncs each file, renames the folder into place
and only then rewrites `latest` (temporary file, fsync, rename): a crash at any point leaves the previous
checkpoint and pointer intact. The run folder must be on a filesystem every rank sees (one writer per file).
Every file holds only tensors and primitives, so torch.load(weights_only=True) reads it: RNG states are
stored as tensors and lists, not pickled objects. Loading is always weights_only: a file that carries pickled
objects (code that would run on load) is refused with a CheckpointError naming it.
"""
from __future__ import annotations

import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from fastclip.distributed import DistInfo, barrier
from fastclip.train import faults
from fastclip.train.errors import CheckpointError

STEP_DIR = re.compile(r"step_(\d{8,})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ----------------------------------------------------------------------------- RNG states as tensors
def rng_state(device: torch.device) -> dict:
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "python": {"version": int(py_version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss_next": py_gauss},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss_next"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ----------------------------------------------------------------------------- atomic files
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories; the renames are still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_file(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def load_file(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # what weights_only raises for anything but tensors and primitives
        detail = str(e).strip().splitlines()
        reason = next((line.strip() for line in detail if "Unsupported" in line or "GLOBAL" in line), detail[0] if detail else "")
        raise CheckpointError(f"{path}: refusing to load pickled objects: checkpoints are loaded with "
                              f"torch.load(weights_only=True) and this file carries more than tensors and plain "
                              f"values ({reason[:300]}); only a file from a source you trust should be converted "
                              f"by hand") from None
    except (RuntimeError, EOFError, OSError) as e:  # torn or foreign file
        raise CheckpointError(f"{path}: not a readable checkpoint file ({type(e).__name__}: {str(e)[:300]})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a fastclip checkpoint file (holds a {type(obj).__name__}, not a dict)")
    return obj


# ----------------------------------------------------------------------------- save
def list_checkpoints(root: Path) -> list[Path]:
    """Complete step folders under `root`, oldest first (temporary folders start with a dot)."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(dirs, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))


def save_checkpoint(root: Path, step: int, info: DistInfo, *, model_file: dict | None, rank_file: dict,
                    keep_last: int, write_extra=None) -> Path:
    """Collective: every rank calls it with its rank_file; rank 0 also passes model_file. write_extra(folder),
    called on every rank, adds files to the step folder before it is renamed into place (DeepSpeed's shards)."""
    final = root / step_dir_name(step)
    tmp = root / f".tmp_{final.name}"
    try:
        return _save(root, final, tmp, step, info, model_file, rank_file, keep_last, write_extra)
    except BaseException as e:
        if info.is_main:  # never leave a half-written folder behind; `latest` still names the last good one
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            pointer = root / "latest"
            last = (f"{pointer} still names {pointer.read_text().strip()}" if pointer.is_file()
                    else "no earlier checkpoint exists")
            raise CheckpointError(
                f"rank {info.rank}: cannot write checkpoint {final} ({e.strerror or e}"
                f"{': ' + str(e.filename) if e.filename else ''}); nothing of it was kept and {last}. Free space "
                f"or make {root} writable, then restart with --train.resume latest") from None
        raise


def _save(root: Path, final: Path, tmp: Path, step: int, info: DistInfo, model_file: dict | None,
          rank_file: dict, keep_last: int, write_extra) -> Path:
    if info.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_step_*"):  # left over by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier(info)
    save_file(rank_file, tmp / f"rank_{info.rank}.pt")
    faults.hook("checkpoint.rank_files", step=step, rank=info.rank)
    if info.is_main:
        faults.hook("checkpoint.model_file", step=step, rank=info.rank)
        save_file(model_file, tmp / "model.pt")
    if write_extra is not None:
        write_extra(tmp)
    barrier(info)  # all rank files are on disk
    if info.is_main:
        _fsync_dir(tmp)
        old = None
        if final.exists():  # the same step saved again (a run resumed and stopped at once)
            old = root / f".old_{final.name}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        faults.hook("checkpoint.renamed", step=step, rank=info.rank)
        write_text_atomic(root / "latest", final.name + "\n")
        if old is not None:
            shutil.rmtree(old)
        for stale in list_checkpoints(root)[:-keep_last]:
            if stale != final:
                shutil.rmtree(stale)
    barrier(info)
    return final


# ----------------------------------------------------------------------------- load
def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """"latest" -> the step folder named by <run_dir>/checkpoints/latest (None if there is none yet: a fresh
    start, so one job script serves the first and every following job); a path -> that step folder, or a
    run/checkpoints folder -> its latest."""
    if resume == "latest":
        pointer = run_dir / "checkpoints" / "latest"
        if not pointer.is_file():
            return None
        return _checked(run_dir / "checkpoints" / pointer.read_text().strip(), f"named by {pointer}")
    path = Path(resume)
    for pointer in (path / "latest", path / "checkpoints" / "latest"):
        if pointer.is_file():
            return _checked(pointer.parent / pointer.read_text().strip(), f"named by {pointer}")
    return _checked(path, "given as train.resume")


def _checked(step_dir: Path, how: str) -> Path:
    if not (step_dir / "model.pt").is_file():
        raise FileNotFoundError(f"checkpoint {step_dir} ({how}) has no model.pt")
    return step_dir


def iter_rank_files(step_dir: Path, world_size: int) -> Iterator[dict]:
    """The saved ranks' files one at a time (resharding reads them in turn, never all at once)."""
    for r in range(world_size):
        yield load_file(step_dir / f"rank_{r}.pt")


__all__ = ["rng_state", "set_rng_state", "save_checkpoint", "resolve_resume", "load_file", "iter_rank_files",
           "list_checkpoints", "step_dir_name", "write_text_atomic"]
