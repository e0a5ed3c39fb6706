"""File mechanics: torch.save with fsync, text written atomically (temporary file, fsync, rename), and the one
loader of checkpoint files: torch.load(weights_only=True), each way a file can be wrong said in one line.
"""

from __future__ import annotations

import os
import pickle
import shutil
import zipfile
from pathlib import Path

import torch

from fastclip.errors import CheckpointError, CheckpointFileMissing


def fsync_dir(path: Path) -> None:
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


def save_file(obj, path: Path, *, durable: bool = True) -> None:
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except RuntimeError as e:
        # a write that fails inside torch.save (a full disk) surfaces as its zip writer's "unexpected pos ..."
        # RuntimeError, raised while handling the OSError: the OSError is what happened
        if isinstance(e.__context__, OSError):
            failed = e.__context__
            raise OSError(failed.errno, failed.strerror or str(failed), str(path)) from None
        raise


def tensor_bytes(obj) -> int:
    """The bytes of the tensors in a nested dict/list (each storage once): about what torch.save writes."""
    seen: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            storage = item.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(seen.values())


def free_bytes(folder: Path) -> int:
    """Free bytes on the file system of `folder` (or of its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def write_text_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: the old file stays, and no half-written twin beside it
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def load_file(path: Path, *, mmap: bool = False) -> dict:
    if not path.is_file():
        raise CheckpointFileMissing(
            f"{path}: checkpoint file missing (an incomplete or hand-edited step folder): resume from another step "
            f"folder (--train.resume {path.parent.parent / 'step_XXXXXXXX'}) or restore the file"
        )
    size = path.stat().st_size
    if size == 0:  # (outside the try: a CheckpointError is a RuntimeError)
        raise CheckpointError(
            f"{path}: the file is empty (a write that never finished); restore the file or pass another checkpoint"
        )
    if path.name == "latest" and size < 64:  # the pointer file (layout.LATEST: layout imports this module)
        raise CheckpointError(
            f"{path} is the pointer to the latest step folder ({path.read_text(errors='replace').strip()}), not a "
            f"checkpoint: pass the run folder {path.parent.parent} (or the step folder it names)"
        )
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except PermissionError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror}); make it readable") from None
    # torch.save writes a zip (a torn one still starts with PK) or, in the legacy format, a pickle (0x80): a text
    # or CSV file would otherwise reach the unpickler and read as "pickled objects"
    if not head.startswith((b"PK", b"\x80")) and not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path} is not a torch checkpoint file (it begins {head!r}: neither torch.save's zip archive nor a "
            f"pickle); restore the file or pass another checkpoint"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except PermissionError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror}); make it readable") from None
    except pickle.UnpicklingError as e:  # what weights_only raises for anything but tensors and primitives
        detail = str(e).strip().splitlines()
        reason = next(
            (line.strip() for line in detail if "Unsupported" in line or "GLOBAL" in line), detail[0] if detail else ""
        )
        raise CheckpointError(
            f"{path}: refusing to load pickled objects: checkpoints are loaded with "
            f"torch.load(weights_only=True) and this file carries more than tensors and plain "
            f"values ({reason[:300]}); only a file from a source you trust should be converted "
            f"by hand"
        ) from None
    except Exception as e:  # torn or foreign bytes: the unpickler fails in many ways (KeyError, IndexError, ...)
        lines = str(e).strip().splitlines()
        reason = lines[0].split(". ")[0][:200] if lines else ""  # torch's first sentence; the rest is advice
        detail = f"{type(e).__name__}: {reason}" if reason else type(e).__name__
        raise CheckpointError(
            f"{path}: not a readable checkpoint file ({detail}): truncated, still being copied or not written by "
            f"torch.save; restore the file or pass another checkpoint"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a fastclip checkpoint file (holds a {type(obj).__name__}, not a dict)")
    return obj
