"""Where checkpoints live and how they are found: step folder and file names, `latest`, the complete step folders,
the checkpoint a resume continues from, and the pruning of old ones.

    <run_dir>/checkpoints/step_<N:08d>/model.pt      rank 0's record (fastclip/checkpoint/manager.py)
    <run_dir>/checkpoints/step_<N:08d>/rank_<r>.pt   rank r's record
    <run_dir>/checkpoints/latest                     text naming the newest complete step folder
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from fastclip.checkpoint.files import load_file
from fastclip.cli import note
from fastclip.errors import CheckpointError

STEP_DIR = re.compile(r"step_(\d{8,})")
CHECKPOINT_FORMAT = "fastclip-checkpoint/1"  # model.pt's "format"; bump when a key changes meaning
MODEL_FILE = "model.pt"
LATEST = "latest"  # <checkpoints>/latest: the name of the newest complete step folder
CHECKPOINTS = "checkpoints"  # <run_dir>/checkpoints/: the step folders and `latest`
RANK_FILES = "rank_*.pt"
DEEPSPEED_TAG = "deepspeed"  # DeepSpeed's files go to <step dir>/deepspeed/


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank}.pt"


def list_checkpoints(root: Path) -> list[Path]:
    """The step folders under `root`, complete or not (is_complete), oldest first (temporary ones start with a dot)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)), key=_step)


def read_pointer(root: Path) -> str | None:
    """What <root>/latest names (a step folder's name; "" if emptied), None without one; never raises on its bytes."""
    pointer = root / LATEST
    return pointer.read_text(errors="replace").strip() if pointer.is_file() else None


def last_good(root: Path) -> str:
    """What a failed write leaves to resume from, in words: `latest` and the step it names, or that none exists."""
    named = read_pointer(root)
    if not named:  # (none, or emptied)
        return "no checkpoint was saved yet"
    return f"{root / LATEST} still names {named}"


def _step(folder: Path) -> int:
    return int(STEP_DIR.fullmatch(folder.name).group(1))


def _step_of(keep: Path) -> int | None:
    """The step of `keep`, a step folder or a link to one (a resume may name either); None for neither."""
    match = STEP_DIR.fullmatch(keep.resolve().name)
    return int(match.group(1)) if match else None


def prune_checkpoints(root: Path, keep_last: int, *, keep: Path) -> None:
    """Rank 0: delete the complete checkpoints older than the newest `keep_last` up to `keep` (never `keep`), and
    those after `keep`: a branch abandoned by resuming from an older step, which must not count towards keep_last nor
    be taken for the run's newest if `latest` is lost. After each save (`keep`: the folder just saved, which `latest`
    names), and when a run resumes from its newest checkpoint: a job killed between a save and its pruning, resumed
    with nothing left to train, would otherwise end with one checkpoint more than keep_last."""
    # a folder is renamed aside before it is deleted, so a kill during the deletion leaves a .pruned_ folder (swept
    # here) and never a half-deleted step folder that no longer counts as a checkpoint and so would stay forever
    for leftover in root.glob(".pruned_step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    # keep_last counts complete checkpoints: an incomplete folder (a resume passed it over, or damaged by hand) is not
    # one of them and is left as it is (what it still holds may be wanted)
    complete, kept = [p for p in list_checkpoints(root) if is_complete(p)], _step_of(keep)
    after = [p for p in complete if kept is not None and _step(p) > kept]
    if after:
        note(f"fastclip train: note: deleting {', '.join(p.name for p in after)}: after {keep.resolve().name}, this "
             f"run's newest, a branch left by resuming from an earlier step (checkpoint.keep_last counts the run's "
             f"own checkpoints)")  # fmt: skip
    stale = [p for p in complete if p not in after][:-keep_last] + after
    for folder in stale:
        if folder.resolve() == keep.resolve():
            continue
        aside = root / f".pruned_{folder.name}"
        try:
            os.replace(folder, aside)
        except OSError:
            continue  # what cannot go now (a busy NFS file) goes at the next save
        shutil.rmtree(aside, ignore_errors=True)


def resolve_resume(resume: str, run_dir: Path, *, quiet: bool = False) -> Path | None:
    """ "latest" -> the step folder named by <run_dir>/checkpoints/latest (None if there is no checkpoint yet: a
    fresh start, so one job script serves the first and every following job); a path -> that step folder, or a
    run/checkpoints folder -> its latest. Without the `latest` pointer (lost, or a crash between the rename and
    its write), or where a complete newer step was saved after it was written, the newest complete step folder
    (is_complete) is taken, with a note (none if `quiet`): never a silent fresh start or lost steps; a `latest`
    that names a step folder when none is left is an error."""
    if resume == LATEST:
        root = run_dir / CHECKPOINTS
        pointer = root / LATEST
        return _from_pointer(pointer, quiet) if pointer.is_file() else _newest(root, pointer, quiet=quiet)
    path = Path(resume)
    for pointer in (path / LATEST, path / CHECKPOINTS / LATEST):
        if pointer.is_file():
            return _from_pointer(pointer, quiet)
    if not (path / MODEL_FILE).is_file():  # a run or checkpoints folder without its pointer
        for root in (path / CHECKPOINTS, path):
            if list_checkpoints(root):
                return _newest(root, root / LATEST, quiet=quiet)
    return _checked(path, "given as train.resume")


def is_complete(step_dir: Path) -> bool:
    """A step folder holding its model.pt and rank_0..rank_{n-1}.pt (as every save writes it; a folder damaged by
    hand or by a cut-short cleanup may not)."""
    ranks = sorted(rank_files_in(step_dir))
    return (step_dir / MODEL_FILE).is_file() and bool(ranks) and ranks == list(range(len(ranks)))


def rank_files_in(folder: Path) -> dict[int, Path]:
    """The rank_<r>.pt files of a folder, by rank."""
    return {int(f.stem[5:]): f for f in folder.glob(RANK_FILES) if f.stem[5:].isdecimal()}  # rank_<r>


def latest_complete(run_dir: Path) -> Path | None:
    """The checkpoint `--train.resume latest` continues from (resolve_resume's rules, without its notes), if it is
    complete; None when there is none, it is not complete (the resume refuses it) or it cannot be told."""
    try:
        found = resolve_resume(LATEST, run_dir, quiet=True)
    except (OSError, ValueError):
        return None
    return found if found is not None and is_complete(found) else None


def _from_pointer(pointer: Path, quiet: bool) -> Path:
    """The step folder `latest` names; if it is gone (a crash between a re-saved step's two renames), the newest
    complete one, with a note. A checkpoint was written here once: none left is an error, not a fresh start."""
    text = read_pointer(pointer.parent)
    if not text:  # emptied (a full disk while it was written, a hand edit)
        return _newest(pointer.parent, pointer, why="is empty", quiet=quiet, required=True)
    named = pointer.parent / text
    if not named.exists() and STEP_DIR.fullmatch(named.name):
        why = f"names {named.name}, which does not exist"
        return _newest(pointer.parent, pointer, why=why, quiet=quiet, required=True)
    if not named.exists():  # not a step folder's name: edited by hand, or overwritten
        raise FileNotFoundError(
            f"checkpoint {named} (named by {pointer}) does not exist: write a step folder's name into {pointer}, or "
            f"delete it to resume from the newest complete step folder"
        )
    if STEP_DIR.fullmatch(named.name):
        # a stop between a save's rename and the pointer's update: a complete newer folder, renamed into place after
        # the pointer was last written (a pointer set back by hand, to roll back, is newer than every folder)
        written = pointer.stat().st_mtime
        newer = [
            p
            for p in list_checkpoints(pointer.parent)
            if _step(p) > _step(named) and p.stat().st_ctime > written and is_complete(p)
        ]
        if newer:
            if not quiet:
                note(
                    f"fastclip train: note: {pointer} names {named.name}, but {newer[-1].name} is complete and newer "
                    f"(a stop between its save and the pointer's update): resuming from {newer[-1]}; to resume "
                    f"from {named.name}, write its name into {pointer} again"
                )
            return _checked(newer[-1], f"the newest complete step folder under {pointer.parent}")
    return _checked(named, f"named by {pointer}")


def _newest(root: Path, pointer: Path, why: str = "is missing", *, quiet: bool, required: bool = False):
    """The newest complete step folder under `root` (named in a note), None when `root` has none (an error if
    `required`)."""
    found = list_checkpoints(root)
    complete = [p for p in found if is_complete(p)]
    if not complete:
        if found:  # only incomplete step folders: starting from scratch would overwrite them
            raise FileNotFoundError(
                f"{pointer} {why} and no step folder under {root} is complete ({MODEL_FILE} and every rank file;"
                f" newest {found[-1].name}): restore one, or start a new run in another --train.run_dir"
            )
        if required:  # moved away (to free disk, say): starting over would overwrite `latest` at the first save
            raise FileNotFoundError(
                f"{pointer} {why} and no step folder is left under {root}: restore the step folders, or start a "
                f"new run in another --train.run_dir"
            )
        return None
    skipped = [p.name for p in found[found.index(complete[-1]) + 1 :]]
    if not quiet:
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


def iter_rank_files(step_dir: Path, world_size: int, step: int | None = None) -> Iterator[dict]:
    """The saved ranks' files one at a time (resharding reads them in turn, never all at once)."""
    for r in range(world_size):
        yield load_rank_file(step_dir, r, step)


def load_rank_file(step_dir: Path, rank: int, step: int | None, *, mmap: bool = False) -> dict:
    """Rank `rank`'s file of the step folder, holding that rank's state at `step` (model.pt's; None: not checked):
    a file copied in from another step folder, or renamed, would resume a rank's data position and per-sample
    state from elsewhere without a word. `mmap`: tensors left on disk (a check that reads only the header)."""
    path = step_dir / rank_file_name(rank)
    file = load_file(path, mmap=mmap)
    saved_rank, saved_step = file.get("rank"), file.get("step")
    if (saved_rank is not None and saved_rank != rank) or (None not in (step, saved_step) and saved_step != step):
        raise CheckpointError(
            f"{path} holds rank {saved_rank}'s state at step {saved_step}, not rank {rank}'s at step {step} as "
            f"model.pt says (copied from another step folder, or renamed): restore the step folder's own file, or "
            f"resume from another step folder"
        )
    return file


def complete_steps(checkpoints: Path, steps: list[Path] | None = None) -> list[Path]:
    """The step folders of `checkpoints` (or `steps`, listed already) that hold a model file, oldest first."""
    return [s for s in (list_checkpoints(checkpoints) if steps is None else steps) if (s / MODEL_FILE).is_file()]


def find_model_file(path: str | os.PathLike) -> Path:
    """A model file from a run folder, its checkpoints/ folder, a step folder or the file itself."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if (path / MODEL_FILE).is_file():
        return path / MODEL_FILE
    if STEP_DIR.fullmatch(path.name):
        raise FileNotFoundError(
            f"{path}: no {MODEL_FILE} in this step folder (removed, or its save cut short): pass another step folder "
            f"or the run folder"
        )
    for checkpoints in (path / CHECKPOINTS, path):
        named = read_pointer(checkpoints)
        if named:  # (none, or an empty one: the newest step folder, below)
            step_dir = checkpoints / named
            if not (step_dir / MODEL_FILE).is_file():
                complete = complete_steps(checkpoints)
                fix = (
                    f"the newest step folder with one is {complete[-1]}: pass it"
                    if complete
                    else "no step folder there holds one: pass a run, step folder or .pt file that has one"
                )
                raise FileNotFoundError(
                    f"{checkpoints / LATEST} names {step_dir}, which has no {MODEL_FILE} (removed, or its save cut "
                    f"short); {fix}"
                )
            return step_dir / MODEL_FILE
    for checkpoints in (path / CHECKPOINTS, path):  # no `latest` (a copy that left it out): as resume does
        steps = list_checkpoints(checkpoints)
        with_model = complete_steps(checkpoints, steps)
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
