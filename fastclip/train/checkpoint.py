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

This module owns the layout: `model_file_contents` and `rank_file_contents` write the two records, the
accessors below read them (the trainer, `fastclip eval` and `fastclip export` never index model.pt by
string), `read_model_file` checks CHECKPOINT_FORMAT, and `restore_rank` resumes one rank, resharding the
per-sample state when the world size changed.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastclip.distributed import DistInfo, barrier
from fastclip.losses.objective import QUEUE_PREFIX
from fastclip.train import faults
from fastclip.train.errors import CheckpointError, CheckpointFileMissing

STEP_DIR = re.compile(r"step_(\d{8,})")
CHECKPOINT_FORMAT = "fastclip-checkpoint/1"  # model.pt's "format"; bump when a key changes meaning
MODEL_FILE = "model.pt"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank}.pt"


# ----------------------------------------------------------------------------- RNG states as tensors
def capture_rng_states(device: torch.device) -> dict:
    """Python's, numpy's, torch's (and the GPU's) generators, as tensors and primitives (weights_only)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": {
            "version": int(py_version),
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss_next": py_gauss,
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_states(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss_next"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ----------------------------------------------------------------------------- atomic files
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


def _free_bytes(folder: Path) -> int:
    """Free bytes on the file system of `folder` (or of its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def write_text_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def load_file(path: Path) -> dict:
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
    if path.name == "latest" and size < 64:  # the pointer file, not a checkpoint
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
        obj = torch.load(path, map_location="cpu", weights_only=True)
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


# ----------------------------------------------------------------------------- save
def list_checkpoints(root: Path) -> list[Path]:
    """Complete step folders under `root`, oldest first (temporary folders start with a dot)."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(dirs, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))


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
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:  # what it needed and what was there, in one line
            needed = tensor_bytes(rank_file) + (tensor_bytes(model_file) if model_file is not None else 0)
            raise CheckpointError(
                f"rank {info.rank}: cannot write checkpoint {final} (No space left on device): this rank's files "
                f"need about {_mib(needed)}, {_mib(_free_bytes(root))} are free on the disk of {root}; "
                f"nothing of it was kept and {_last_good(root)}. Free space (or lower --checkpoint.keep_last), then "
                f"restart with --train.resume latest"
            ) from None
        if isinstance(e, OSError):
            raise CheckpointError(
                f"rank {info.rank}: cannot write checkpoint {final} ({e.strerror or e}"
                f"{': ' + str(e.filename) if e.filename else ''}); nothing of it was kept and {_last_good(root)}. "
                f"Free space or make {root} writable, then restart with --train.resume latest"
            ) from None
        raise


def _last_good(root: Path) -> str:
    """What a failed save leaves to resume from, in words."""
    pointer = root / "latest"
    if not pointer.is_file():
        return "no earlier checkpoint exists"
    return f"{pointer} still names {pointer.read_text().strip()}"


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
                f"has its name; nothing was written and {_last_good(root)}. Move it away, then restart with "
                f"--train.resume latest"
            )
        # left over by a crash during an earlier save: a half-written .tmp, or the .old copy of a step saved
        # again whose removal was cut short (latest never names either)
        for stale in [*root.glob(".tmp_step_*"), *root.glob(".old_step_*")]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier(info)
    save_file(rank_file, tmp / rank_file_name(info.rank), durable=durable)
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
        write_text_atomic(root / "latest", final.name + "\n", durable=durable)
        if old is not None:
            shutil.rmtree(old)
        prune_checkpoints(root, keep_last, keep=final)
    barrier(info)
    return final


def prune_checkpoints(root: Path, keep_last: int, *, keep: Path) -> None:
    """Rank 0: delete the complete checkpoints older than the newest `keep_last` (never `keep`). After each save, and
    when a run resumes: a job killed between a save and its pruning, resumed with nothing left to train, would
    otherwise end with one checkpoint more than keep_last."""
    # a folder is renamed aside before it is deleted, so a kill during the deletion leaves a .pruned_ folder (swept
    # here) and never a half-deleted step folder that no longer counts as a checkpoint and so would stay forever
    for leftover in root.glob(".pruned_step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    # keep_last counts complete checkpoints: an incomplete folder (a resume passed it over, or damaged by hand) is not
    # one of them and is left as it is (what it still holds may be wanted)
    stale = [p for p in list_checkpoints(root) if is_complete(p)][:-keep_last]
    for folder in stale:
        if folder.resolve() == keep.resolve():
            continue
        aside = root / f".pruned_{folder.name}"
        try:
            os.replace(folder, aside)
        except OSError:
            continue  # what cannot go now (a busy NFS file) goes at the next save
        shutil.rmtree(aside, ignore_errors=True)


# ----------------------------------------------------------------------------- load
def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """ "latest" -> the step folder named by <run_dir>/checkpoints/latest (None if there is no checkpoint yet: a
    fresh start, so one job script serves the first and every following job); a path -> that step folder, or a
    run/checkpoints folder -> its latest. Without the `latest` pointer (lost, or a crash between the rename and
    its write) the newest complete step folder (is_complete) is taken, with a note: never a silent fresh start."""
    if resume == "latest":
        root = run_dir / "checkpoints"
        pointer = root / "latest"
        return _from_pointer(pointer) if pointer.is_file() else _newest(root, pointer)
    path = Path(resume)
    for pointer in (path / "latest", path / "checkpoints" / "latest"):
        if pointer.is_file():
            return _from_pointer(pointer)
    if not (path / MODEL_FILE).is_file():  # a run or checkpoints folder without its pointer
        for root in (path / "checkpoints", path):
            if list_checkpoints(root):
                return _newest(root, root / "latest")
    return _checked(path, "given as train.resume")


def is_complete(step_dir: Path) -> bool:
    """A step folder holding its model.pt and rank_0..rank_{n-1}.pt (as every save writes it; a folder damaged by
    hand or by a cut-short cleanup may not)."""
    ranks = sorted(rank_files_in(step_dir))
    return (step_dir / MODEL_FILE).is_file() and bool(ranks) and ranks == list(range(len(ranks)))


def rank_files_in(folder: Path) -> dict[int, Path]:
    """The rank_<r>.pt files of a folder, by rank."""
    return {int(f.stem[5:]): f for f in folder.glob("rank_*.pt") if f.stem[5:].isdigit()}


def latest_complete(run_dir: Path) -> Path | None:
    """The checkpoint `--train.resume latest` continues from: the step folder `latest` names, else the newest
    complete one; None when there is none."""
    root = run_dir / "checkpoints"
    try:
        pointer = root / "latest"
        if pointer.is_file() and is_complete(named := root / pointer.read_text().strip()):
            return named
        complete = [p for p in list_checkpoints(root) if is_complete(p)]
    except OSError:
        return None
    return complete[-1] if complete else None


def _from_pointer(pointer: Path) -> Path | None:
    """The step folder `latest` names; if it is gone (a crash between a re-saved step's two renames), the newest
    complete one, with a note."""
    text = pointer.read_text(errors="replace").strip()
    if not text:  # emptied (a full disk while it was written, a hand edit)
        return _newest(pointer.parent, pointer, why="is empty")
    named = pointer.parent / text
    if not named.exists() and STEP_DIR.fullmatch(named.name):
        return _newest(pointer.parent, pointer, why=f"names {named.name}, which does not exist")
    return _checked(named, f"named by {pointer}")


def _newest(root: Path, pointer: Path, why: str = "is missing") -> Path | None:
    """The newest complete step folder under `root` (named in a note), None when `root` has none."""
    found = list_checkpoints(root)
    complete = [p for p in found if is_complete(p)]
    if not complete:
        if found:  # only incomplete step folders: starting from scratch would overwrite them
            raise FileNotFoundError(
                f"{pointer} {why} and no step folder under {root} is complete ({MODEL_FILE} and every rank file;"
                f" newest {found[-1].name}): restore one, or start a new run in another --train.run_dir"
            )
        return None
    from fastclip.train.config import note  # rank 0 only: every rank resolves the same folder

    skipped = [p.name for p in found[found.index(complete[-1]) + 1 :]]
    note(
        f"fastclip train: note: {pointer} {why}; resuming from the newest step folder {complete[-1]}"
        + (f" (skipped {', '.join(skipped)}: incomplete)" if skipped else "")
    )
    return complete[-1]


def _checked(step_dir: Path, how: str) -> Path:
    if not step_dir.exists():
        raise FileNotFoundError(f"checkpoint {step_dir} ({how}) does not exist")
    if not (step_dir / MODEL_FILE).is_file():
        raise FileNotFoundError(
            f"checkpoint {step_dir} ({how}) has no {MODEL_FILE}: pass a run folder, its checkpoints folder or a "
            f"step_XXXXXXXX folder"
        )
    return step_dir


def iter_rank_files(step_dir: Path, world_size: int) -> Iterator[dict]:
    """The saved ranks' files one at a time (resharding reads them in turn, never all at once)."""
    for r in range(world_size):
        yield load_file(step_dir / rank_file_name(r))


# ----------------------------------------------------------------------------- the records
def model_file_contents(
    *,
    towers: dict,
    loss: dict,
    optimizer: dict,
    scaler: dict,
    step: int,
    epoch: int,
    samples_seen: int,
    world_size: int,
    config: dict,
    schedules: dict,
    arch: str,
    model_config: dict,
    guards: dict,
    data_skip_report: dict,
    momentum_towers: dict | None = None,
) -> dict:
    """model.pt (rank 0): open_clip reads "state_dict" as is; the loss's parameters without per-sample state
    (that is in the rank files); the schedules' horizon and last values, for reading only."""
    return {
        "format": CHECKPOINT_FORMAT,
        "state_dict": towers,
        # the rank files hold the per-sample shards and the feature queue (identical on every rank): not here
        "loss": {k: v for k, v in loss.items() if not k.endswith("_extra_state") and not k.startswith(QUEUE_PREFIX)},
        "optimizer": optimizer,
        "scaler": scaler,
        "step": step,
        "epoch": epoch,
        "samples_seen": samples_seen,
        "world_size": world_size,
        "config": config,
        "schedules": schedules,
        "arch": arch,
        "model_config": model_config,
        "guards": guards,
        "data_skip_report": data_skip_report,
        **({"momentum_towers": momentum_towers} if momentum_towers is not None else {}),  # model.ema_momentum
    }


def rank_file_contents(*, rank: int, world_size: int, step: int, loss_state: dict, data: dict, rng: dict) -> dict:
    """rank_<r>.pt: this rank's shard of the per-sample state, its data-stream position and RNG states."""
    return {"rank": rank, "world_size": world_size, "step": step, "loss_state": loss_state, "data": data, "rng": rng}


def is_training_checkpoint(obj) -> bool:
    """A model.pt of `fastclip train` (an export or an OpenCLIP file is not)."""
    return isinstance(obj, dict) and obj.get("format") == CHECKPOINT_FORMAT and "config" in obj


def check_format(obj, path: Path) -> None:
    """Refuse a model.pt of another checkpoint format version: its keys may mean something else."""
    found = obj.get("format") if isinstance(obj, dict) else None
    if isinstance(found, str) and found.startswith("fastclip-checkpoint/") and found != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {found!r}; this version of fastclip reads {CHECKPOINT_FORMAT!r}"
        )


def read_model_file(path: Path) -> dict:
    """A model.pt (ours, an export, or another tool's), weights_only, its format version checked."""
    obj = load_file(path)
    check_format(obj, path)
    return obj


def strip_module_prefix(state: dict) -> dict:
    """Without a DDP `module.` prefix on every key (OpenCLIP #33)."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module.") :]: v for k, v in state.items()}
    return state


def towers_state(model_file: dict) -> dict[str, torch.Tensor]:
    """The towers' tensors (open_clip names), without a DDP `module.` prefix."""
    return dict(strip_module_prefix(model_file["state_dict"]))


def loss_parameters(model_file: dict) -> dict[str, torch.Tensor]:
    """The loss's own parameters (temperature, tempnet heads); empty for an export."""
    loss = model_file.get("loss")
    return loss if isinstance(loss, dict) else {}


def loss_logit_scale(model_file: dict) -> torch.Tensor | None:
    """The temperature the loss learned (log 1/tau), if the loss has a global one; with one tau per modality
    (v3's separate_temperatures) the mean of their logs, since open_clip's model holds a single scale."""
    scale = loss_parameters(model_file).get("logit_scale")
    return scale.mean() if isinstance(scale, torch.Tensor) else None


def architecture(model_file: dict) -> tuple[str | None, dict | None]:
    """(arch, model config) a training checkpoint records; (None, None) for an export."""
    config = model_file.get("model_config")
    return model_file.get("arch"), config if isinstance(config, dict) else None


def saved_step(model_file: dict) -> int | None:
    step = model_file.get("step")
    return int(step) if isinstance(step, (int, torch.Tensor)) else None


def saved_world_size(model_file: dict) -> int:
    return int(model_file["world_size"])


def saved_optimizer(model_file: dict) -> dict:
    """The engine's optimizer record (DDP: torch's state_dict; DeepSpeed: the temperature's and where its shards
    are)."""
    return model_file["optimizer"]


def saved_config(model_file: dict) -> dict:
    """The resolved config the run trained with (Config.to_dict())."""
    return model_file["config"]


def saved_backend(model_file: dict) -> str:
    """The backend that wrote a checkpoint (files from before train.distributed existed are DDP's)."""
    return model_file.get("config", {}).get("train", {}).get("distributed", "ddp")


def find_model_file(path: str | os.PathLike) -> Path:
    """A model file from a run folder, its checkpoints/ folder, a step folder or the file itself."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if (path / MODEL_FILE).is_file():
        return path / MODEL_FILE
    for checkpoints in (path / "checkpoints", path):
        latest = checkpoints / "latest"
        named = latest.read_text(errors="replace").strip() if latest.is_file() else ""
        if named:  # (none, or an empty one: the newest step folder, below)
            step_dir = checkpoints / named
            if not (step_dir / MODEL_FILE).is_file():
                raise FileNotFoundError(f"{latest} names {step_dir}, which has no {MODEL_FILE}")
            return step_dir / MODEL_FILE
    for checkpoints in (path / "checkpoints", path):  # no `latest` (a copy that left it out): as resume does
        steps = list_checkpoints(checkpoints)
        with_model = [s for s in steps if (s / MODEL_FILE).is_file()]
        if with_model:
            return with_model[-1] / MODEL_FILE
        if steps:
            names = ", ".join(s.name for s in steps[-3:])
            raise FileNotFoundError(
                f"{checkpoints}: no step folder holds a {MODEL_FILE} ({names}; saves cut short?): pass a run, step "
                f"folder or .pt file that has one"
            )
    raise FileNotFoundError(
        f"{path}: no {MODEL_FILE}, no checkpoints/latest: pass a run directory, a step directory or a .pt file"
    )


# ----------------------------------------------------------------------------- resume one rank
@dataclass
class RankResume:
    """Where a resumed rank continues: the run's position, this rank's data-stream state, and its RNG states
    (None at another world size: the streams are reseeded)."""

    step: int
    samples_seen: int
    epoch: int
    data: dict
    rng: dict | None


def restore_rank(
    step_dir: Path, model_file: dict, model: torch.nn.Module, loss_fn: torch.nn.Module, info: DistInfo
) -> RankResume:
    """Load the towers and this rank's per-sample state; at another world size rebuild this rank's shard from
    the old ranks' files, read one at a time, and split the old data positions over the new ranks."""
    from fastclip.data import state_for_new_world_size
    from fastclip.losses import reshard_for_rank

    model.load_state_dict(towers_state(model_file))
    saved_world = saved_world_size(model_file)
    rng = None
    if saved_world == info.world_size:
        rank_file = load_file(step_dir / rank_file_name(info.rank))
        loss_fn.load_state_dict(rank_file["loss_state"])
        data, rng = rank_file["data"], rank_file["rng"]
    else:
        old_data = []  # every old rank's data stream state (small), read on the way

        def old_loss_states():
            for f in iter_rank_files(step_dir, saved_world):
                old_data.append(f["data"])
                yield f["loss_state"]

        if getattr(loss_fn, "uses_sample_state", False):
            loss_fn.load_state_dict(reshard_for_rank(old_loss_states(), info.world_size, info.rank))
        else:  # the same on every old rank (τ, a feature queue): rank 0's
            states = old_loss_states()
            loss_fn.load_state_dict(next(states))
            for _ in states:  # the other old ranks' data positions (old_loss_states keeps them)
                pass
        # the data layer finishes the interrupted epoch from the old position and splits the old ranks' skip
        # counters over the new ranks (fastclip/data/stream.py)
        data = state_for_new_world_size(old_data, info.rank, info.world_size)
    return RankResume(int(model_file["step"]), int(model_file["samples_seen"]), int(model_file["epoch"]), data, rng)


def restore_training_state(model_file: dict, *, scaler, guard, skip_report) -> None:
    """The small state model.pt carries beside the weights (the optimizer is the engine's: engine.load_checkpoint)."""
    scaler.load_state_dict(model_file["scaler"])
    guard.load_state_dict(model_file.get("guards"))
    skip_report.load_state_dict(model_file.get("data_skip_report"))


__all__ = [
    "CHECKPOINT_FORMAT",
    "MODEL_FILE",
    "capture_rng_states",
    "restore_rng_states",
    "save_checkpoint",
    "resolve_resume",
    "load_file",
    "read_model_file",
    "check_format",
    "is_training_checkpoint",
    "iter_rank_files",
    "list_checkpoints",
    "step_dir_name",
    "rank_file_name",
    "write_text_atomic",
    "model_file_contents",
    "rank_file_contents",
    "towers_state",
    "loss_parameters",
    "loss_logit_scale",
    "architecture",
    "saved_step",
    "saved_world_size",
    "saved_optimizer",
    "saved_config",
    "saved_backend",
    "strip_module_prefix",
    "find_model_file",
    "RankResume",
    "restore_rank",
    "restore_training_state",
]
