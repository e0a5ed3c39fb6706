"""Whether a checkpoint can resume this run: every check in one place, run before anything is built (by the trainer
at start-up and by `fastclip train --check`), each failure one line naming the config key and what to do (a
ConfigError: `fastclip train` exits 2).

    Expected                            what this run is, as far as a saved state depends on it (the trainer builds
                                        it from its config: nothing here reads a Config)
    read_given(path, key)               a checkpoint or weights file the operator named (a .safetensors too)
    read_resume(given, run_dir)         (the step folder, its model.pt) of train.resume, every saved rank's file
                                        present, or a file refused saying what it is (with a pointer to
                                        --model.pretrained for weights)
    check_resume(step_dir, model_file, expected, rank_files=False)
                                        every part's check (CHECKS) on model.pt's and rank 0's states; rank_files:
                                        every other rank file whole too (`--check`, once for the job)

The checks are per part, under the part's name in the checkpoint (fastclip/checkpoint/manager.py): the config
(same towers and loss), the optimizer (same backend, ZeRO stage and, under ZeRO, world size), the step (steps left
to train), the data position (the data layer's IDENTITY, the batch size) and the loss state (the per-sample state's
length). The towers' shapes need the architecture: the trainer's Towers part checks them when it loads, `--check`
against the architecture on the meta device.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastclip.checkpoint.layout import DEEPSPEED_TAG, MODEL_FILE, load_rank_file, rank_file_name, resolve_resume
from fastclip.checkpoint.records import (
    RANK_FILE,
    TRAINING_CHECKPOINT,
    WEIGHTS,
    describe_checkpoint,
    read_model_file,
    saved_backend,
    saved_config,
    saved_step,
    saved_world_size,
    ssl_enabled,
)
from fastclip.data.stream import IDENTITY, identity_mismatches
from fastclip.errors import CheckpointError, ConfigError
from fastclip.models.locks import LockSettings


@dataclass(frozen=True)
class Expected:
    arch: str  # model.arch
    loss: str  # loss.name
    backend: str  # train.distributed: "ddp" or "deepspeed"
    zero_stage: int | None  # deepspeed.stage (None under ddp)
    world_size: int
    batch_size: int  # data.batch_size, per process
    batch_change_ok: bool  # train.resume_batch_change
    max_steps: int | None  # train.max_steps
    data_size: int  # the per-sample state's length
    data: dict  # the data stream's IDENTITY values (fastclip.data.stream.stream_identity)
    data_keys: dict = field(default_factory=dict)  # IDENTITY field -> the config key that sets it
    # what shapes the saved state beyond the towers (None: not checked): optim.optimizer (its state's keys), the
    # loss's parameters as model.pt "loss" holds them (name -> shape), how many of them train (the optimizer's
    # temperature group), and the loss section's options (to name the ones that differ from the checkpoint's)
    optimizer: str | None = None
    loss_parameters: dict[str, tuple] | None = None
    loss_trainable: int | None = None
    loss_options: dict = field(default_factory=dict)
    precision: str | None = None  # train.precision: fp16's loss scaling needs a saved scaler state
    epochs: int | None = None  # train.epochs (None: not checked)
    queue_size: int | None = None  # loss.queue_size's slots (0: no queue); a saved queue loads only into as many
    momentum_towers: bool | None = None  # model.ema_momentum is set (None: not checked)
    ssl: bool | None = None  # ssl.enabled: an image tower + projector alone, not a CLIP model (None: not checked)
    # the tower locks (config key -> value, model.lock_*): which parameters the saved optimizer state is for, and
    # with frozen BatchNorm statistics the towers' modules (None: not checked)
    locks: dict | None = None


# ----------------------------------------------------------------------------- files
def read_given(path: Path, key: str):
    """A checkpoint or weights file named by config key `key`, read before anything is built: a missing, torn or
    foreign file is a ConfigError (exit 2, as in eval and export; a rank file read later, during the run, stops it
    with exit 1)."""
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file as load_safetensors
        except ImportError:
            raise ConfigError(
                f"config key '{key}': {path} is a .safetensors file and the safetensors package is "
                f"not installed (pip install safetensors)"
            ) from None
        try:
            return load_safetensors(str(path))
        except Exception as e:  # safetensors' own error type: a torn or foreign file
            raise ConfigError(
                f"config key '{key}': {path}: not a readable .safetensors file ({str(e).splitlines()[0][:200]})"
            ) from None
    try:
        return read_model_file(path)
    except FileNotFoundError:
        raise ConfigError(f"config key '{key}': {path} does not exist") from None
    except CheckpointError as e:  # torn, foreign or carrying pickled objects
        raise ConfigError(f"config key '{key}': {e}") from None


def read_resume(given: str, run_dir: Path) -> tuple[Path | None, dict | None]:
    """(the step folder train.resume names, its model.pt), or (None, None) for `latest` in a run folder without a
    checkpoint yet (a fresh start); a file that is not our training checkpoint is refused, saying what it is."""
    if given != "latest" and not os.path.lexists(given):  # a typo of latest, or a path that is not there
        close = " (did you mean latest?)" if difflib.get_close_matches(given.lower(), ["latest"], cutoff=0.6) else ""
        raise ConfigError(
            f"config key 'train.resume': {given!r} is not 'latest' and no such file or folder exists{close}; give "
            f"latest (the run folder's newest checkpoint) or a checkpoint's step folder, run folder or checkpoints "
            f"folder"
        )
    if given != "latest" and Path(given).is_file():
        raise _describe_resume_file(Path(given))  # an OpenCLIP epoch_N.pt, a state dict, our model.pt ...
    try:
        step_dir = resolve_resume(given, run_dir)
    except OSError as e:  # missing, or a folder this user cannot read
        raise ConfigError(f"config key 'train.resume': {e}") from None
    if step_dir is None:
        return None, None
    model_file = read_given(step_dir / MODEL_FILE, "train.resume")
    kind = describe_checkpoint(model_file)
    if not kind.startswith(TRAINING_CHECKPOINT):
        raise _foreign_resume(step_dir / MODEL_FILE, kind)
    check_rank_files(step_dir, model_file, whole=False)  # one listing: not a per-rank error after start-up
    return step_dir, model_file


def _describe_resume_file(path: Path) -> ConfigError:
    """--train.resume given a file: say what it is (our model.pt belongs in its step folder)."""
    kind = describe_checkpoint(read_given(path, "train.resume"))
    if kind.startswith(TRAINING_CHECKPOINT):
        return ConfigError(
            f"config key 'train.resume': {path} is a fastclip training checkpoint file; pass its "
            f"folder ({path.parent}), which also holds the ranks' files"
        )
    return _foreign_resume(path, kind)


def _foreign_resume(path: Path, kind: str) -> ConfigError:
    if kind.startswith(RANK_FILE):
        where = (
            f"pass its step folder ({path.parent})"
            if path.name != MODEL_FILE
            else f"restore the step folder's {MODEL_FILE} (rank 0's training checkpoint)"
        )
        return ConfigError(f"config key 'train.resume': {path} is {kind}; {where}")
    start = (
        f"to start from its weights with a fresh optimizer and per-sample state, pass --model.pretrained {path} "
        f"(and no --train.resume)"
        if kind.startswith(WEIGHTS)
        else "pass a run folder, its checkpoints folder or a step_XXXXXXXX folder of `fastclip train`"
    )
    return ConfigError(
        f"config key 'train.resume': {path} is {kind}, not a fastclip training checkpoint: it has "
        f"no optimizer, per-sample state or data position to resume; {start}"
    )


def check_rank_files(step_dir: Path, model_file: dict, *, whole: bool = True) -> None:
    """Every rank file the checkpoint was saved with is there and (`whole`) whole, checked without reading it: a
    torch.save file is a zip, whose directory sits at its end (a cut-short copy has none). Each rank reads its own
    file only once the job has started: a bad one there stops the job after start-up, with a traceback per
    launcher."""
    saved = model_file.get("world_size")
    for rank in range(int(saved) if isinstance(saved, int) else 1):
        path = step_dir / rank_file_name(rank)
        if not path.is_file():
            problem = "is missing"
        elif whole and rank > 0 and not zipfile.is_zipfile(path):  # rank 0's is read (and so checked) before
            problem = "is not whole (cut short, or not a torch.save file)"
        elif whole and rank > 0:  # its header only (mmap): the rank and step it holds
            try:
                load_rank_file(step_dir, rank, saved_step(model_file), mmap=True)
            except CheckpointError as e:
                raise ConfigError(f"config key 'train.resume': {e}") from None
            continue
        else:
            continue
        raise ConfigError(
            f"config key 'train.resume': {path} {problem}, and the checkpoint was saved by {saved} rank"
            f"{'' if saved == 1 else 's'}; restore "
            f"it, or resume from another step folder (`fastclip train --train.resume {step_dir.parent}/step_...`)"
        )


# ----------------------------------------------------------------------------- the parts' checks
def check_resume(step_dir: Path, model_file: dict, expected: Expected, *, rank_files: bool = False) -> None:
    """A resume continues the same run: every part's check (CHECKS, in order) on its saved state, model.pt's or
    rank 0's file's (read after the config's check: a checkpoint of other towers is said as such)."""
    rank0 = None
    for name, (in_rank_file, check) in CHECKS.items():
        if in_rank_file and rank0 is None:
            try:
                rank0 = load_rank_file(step_dir, 0, saved_step(model_file))
            except CheckpointError as e:  # found before anything is built: exit 2, as a bad model.pt
                raise ConfigError(f"config key 'train.resume': {e}") from None
            if rank_files:  # --check, once: not every rank of a job over every rank's file
                check_rank_files(step_dir, model_file)
        check((rank0 if in_rank_file else model_file).get(name), expected, step_dir, model_file)


def _start_anew(step_dir: Path) -> str:
    return f"start a new run from its weights with --model.pretrained {step_dir / MODEL_FILE}"


def check_config(config: dict, expected: Expected, step_dir: Path, model_file: dict) -> None:
    """The same kind of model (CLIP or ssl), towers, loss and optimizer."""
    saved = saved_config(model_file)
    saved_ssl = ssl_enabled(saved)
    if expected.ssl is not None and saved_ssl is not None and saved_ssl != expected.ssl:
        trained = "an image tower + projector (ssl.enabled true)" if saved_ssl else "a CLIP model (ssl.enabled false)"
        raise ConfigError(
            f"config key 'ssl.enabled': {str(expected.ssl).lower()} but checkpoint {step_dir} trained {trained}; "
            f"resume with --ssl.enabled {str(saved_ssl).lower()}, or {_start_anew(step_dir)}"
        )
    keys = [("model.arch", expected.arch), ("loss.name", expected.loss)]
    keys += [("optim.optimizer", expected.optimizer)] if expected.optimizer is not None else []
    for key, now in keys:
        section, name = key.split(".")
        if name not in saved.get(section, {}):  # a checkpoint from before the key existed
            continue
        if saved[section][name] != now:
            raise ConfigError(
                f"config key '{key}': {now!r} but checkpoint {step_dir} was trained with {saved[section][name]!r}; "
                f"resume with the same value, or {_start_anew(step_dir)}"
            )
    _check_locks(saved, expected, step_dir)
    before = saved.get("train", {}).get("precision")
    if expected.precision == "fp16" and before not in (None, "fp16"):
        raise ConfigError(
            f"config key 'train.precision': 'fp16' but checkpoint {step_dir} was trained with {before!r}, which "
            f"saves no loss-scaler state for fp16 to go on from; resume with {before!r} (fp32 and bf16 resume each "
            f"other), or {_start_anew(step_dir)}"
        )


# what a checkpoint from before the lock keys existed trained with: both towers, unlocked (the keys' defaults)
LOCK_DEFAULTS = {f"model.{f.name}": f.default for f in dataclasses.fields(LockSettings)}


def _check_locks(saved: dict, expected: Expected, step_dir: Path) -> None:
    """The same tower locks: another lock trains other parameters, which the saved optimizer state does not fit (and
    frozen BatchNorm statistics are other modules)."""
    if expected.locks is None:
        return
    model = saved.get("model", {})
    said = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    changed = []
    for key, now in expected.locks.items():
        before = model.get(key.split(".", 1)[1], LOCK_DEFAULTS.get(key))
        if before != now:
            changed.append((key, before, now))
    if not changed:
        return
    keys = ", ".join(f"'{k}'" for k, _, _ in changed)
    if len(changed) == 1:
        _, before, now = changed[0]
        now, before = said(now), said(before)
    else:  # each key with its value
        now = ", ".join(f"{k} {said(v)}" for k, _, v in changed)
        before = ", ".join(f"{k} {said(v)}" for k, v, _ in changed)
    flags = " ".join(f"--{k} {said(v)}" for k, v, _ in changed)
    raise ConfigError(
        f"config key{'s' * (len(changed) > 1)} {keys}: {now} but checkpoint {step_dir} was trained with {before}: "
        f"the locks decide which parameters train, and the checkpoint's optimizer state is for those; resume with "
        f"{flags}, or {_start_anew(step_dir)}"
    )


def _loss_options_changed(expected: Expected, model_file: dict) -> str:
    """The loss options set otherwise than in the checkpoint's config, as '; loss.x: a in the checkpoint, b now'."""
    saved = saved_config(model_file).get("loss", {})
    changed = [k for k, now in expected.loss_options.items() if k in saved and saved[k] != now]
    said = lambda v: "null (the loss's default)" if v is None else repr(v)  # noqa: E731
    return "".join(
        f"; loss.{k}: {said(saved[k])} in the checkpoint, {said(expected.loss_options[k])} now" for k in changed
    )


def _loss_misfit(step_dir: Path, expected: Expected, model_file: dict, what: str) -> ConfigError:
    return ConfigError(
        f"config section 'loss': checkpoint {step_dir} holds {what}{_loss_options_changed(expected, model_file)}; "
        f"resume with the checkpoint's loss settings (its run's config.yaml), or {_start_anew(step_dir)}"
    )


def _shape(shape: tuple | None) -> str:
    return "none" if shape is None else f"shape {list(shape)}"


def _learned(n: int) -> str:
    return f"{n} learned loss parameter{'' if n == 1 else 's'}"


def check_loss_parameters(saved: Any, expected: Expected, step_dir: Path, model_file: dict) -> None:
    """The loss's parameters (temperatures, bias, temperature network) have the same names and shapes as this
    loss's: another loss option (one τ per direction, a bias, the network's width) makes a loss of other shape."""
    if expected.loss_parameters is None or not isinstance(saved, dict):
        return
    have = {k: tuple(v.shape) for k, v in saved.items() if hasattr(v, "shape")}
    want = expected.loss_parameters
    differ = sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
    if differ:
        k = differ[0]
        what = f"loss parameter {k!r} of {_shape(have.get(k))}, this loss has {_shape(want.get(k))}"
        raise _loss_misfit(step_dir, expected, model_file, what)


def _check_temperature_group(optimizer: Any, expected: Expected, step_dir: Path, model_file: dict) -> None:
    """As many learned loss parameters in the saved optimizer's temperature group as this loss has: torch's
    optimizer state (DDP) or DeepSpeed's record, whose "temperature" is the τ optimizer's state or None."""
    if expected.loss_trainable is None or not isinstance(optimizer, dict):
        return
    if optimizer.get("backend") == "deepspeed":
        if "temperature" not in optimizer:
            return
        optimizer = optimizer["temperature"] or {"param_groups": []}
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list):
        return
    saved = sum(len(g.get("params", [])) for g in groups if g.get("name") == "temperature")
    if saved != expected.loss_trainable:
        what = f"optimizer state for {_learned(saved)}, this loss has {_learned(expected.loss_trainable)}"
        raise _loss_misfit(step_dir, expected, model_file, what)


def check_optimizer(optimizer: Any, expected: Expected, step_dir: Path, model_file: dict) -> None:
    """The backend that wrote the optimizer state; under ZeRO its shard folder, the stage's storage and the world
    size (ZeRO shards are per rank); under both the temperature's group (a loss whose temperature is learned in one
    and fixed in the other has another number of groups)."""
    saved = saved_backend(model_file)
    if expected.backend != "deepspeed":
        if saved != expected.backend:
            raise ConfigError(
                f"config key 'train.distributed': {expected.backend}, but checkpoint {step_dir} was written with "
                f"{saved} (its optimizer state is in DeepSpeed's shards); resume with --train.distributed {saved}"
            )
        _check_temperature_group(optimizer, expected, step_dir, model_file)
        return
    if saved != "deepspeed" or not (step_dir / DEEPSPEED_TAG).is_dir():
        raise ConfigError(
            f"config key 'train.distributed': deepspeed, but checkpoint {step_dir} was written with {saved} (no "
            f"{DEEPSPEED_TAG}/ shard folder); resume with --train.distributed {saved}"
        )
    if (optimizer["stage"] == 3) != (expected.zero_stage == 3):
        raise ConfigError(
            f"config key 'deepspeed.stage': {expected.zero_stage}, but checkpoint {step_dir} holds ZeRO-"
            f"{optimizer['stage']} shards (stages 1-2 and 3 store them differently)"
        )
    if saved_world_size(model_file) != expected.world_size:
        raise ConfigError(
            f"config key 'train.distributed': deepspeed checkpoint {step_dir} was written by "
            f"{saved_world_size(model_file)} processes, this run has {expected.world_size}; ZeRO shards "
            f"are per rank (convert with DeepSpeed's ds_to_universal, or resume at the same size)"
        )
    check_deepspeed_shards(step_dir / DEEPSPEED_TAG, optimizer["stage"], expected.world_size)
    _check_temperature_group(optimizer, expected, step_dir, model_file)


def check_deepspeed_shards(folder: Path, stage: int, world_size: int) -> None:
    """DeepSpeed's files of every rank are there and whole (a torch.save zip with its end record): a missing or
    cut one failed on one rank inside DeepSpeed's load_checkpoint, after the towers were built. Names as DeepSpeed
    writes them (a `bf16_` prefix and the like allowed): per rank its optimizer shard, and its model states under
    ZeRO-3; one model states file under stages 1-2."""
    import zipfile

    wanted = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)]
    wanted += (
        [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)]
        if stage == 3
        else ["mp_rank_00_model_states.pt"]
    )
    names = os.listdir(folder)
    for name in wanted:
        found = [n for n in names if n.endswith(name) and (n == name or n[: -len(name)].endswith("_"))]
        problem = "is missing" if not found else None
        if found and not zipfile.is_zipfile(folder / found[0]):
            name, problem = found[0], "is cut or not a torch.save file"
        if problem:
            raise ConfigError(
                f"config key 'train.resume': DeepSpeed's {folder / name} {problem}; resume from an earlier "
                f"checkpoint (pass its step folder), or copy the folder again"
            )


def check_step(step: Any, expected: Expected, step_dir: Path, model_file: dict) -> None:
    """Steps left to train."""
    step = saved_step(model_file)
    if expected.max_steps is not None and step is not None and expected.max_steps < step:
        raise ConfigError(
            f"config key 'train.max_steps': {expected.max_steps} is below step {step} of checkpoint {step_dir}, "
            f"so nothing would be trained; it counts the run's steps in all, not the steps still to go: raise it"
        )


def check_data(data: dict | None, expected: Expected, step_dir: Path, model_file: dict) -> None:
    """The data position is a place in the same data (the data layer's IDENTITY), at the same batch size unless the
    change is intended (the steps per epoch, and with them the schedules, follow it)."""
    data = data or {}
    for name in identity_mismatches(data, expected.data)[:1]:
        saved, now = data[name], expected.data[name]
        shown = (f"{saved!r}", f"{now!r}") if name != "fingerprint" else ("other shards", "these")
        raise ConfigError(
            f"config key '{expected.data_keys.get(name, 'data.train')}': checkpoint {step_dir} was trained with "
            f"{shown[0]}, this config gives {shown[1]} ({IDENTITY[name]}); resume with the same data and value, or "
            f"{_start_anew(step_dir)}"
        )
    check_epochs(data, expected, step_dir, model_file)
    saved_batch = (data.get("layout") or {}).get("batch_size")
    if saved_batch is not None and saved_batch != expected.batch_size and not expected.batch_change_ok:
        raise ConfigError(
            f"config key 'data.batch_size': {expected.batch_size} but checkpoint {step_dir} was trained with "
            f"{saved_batch} per process: the steps per epoch would change, and with them the lr schedule and the "
            f"other schedules; resume with --data.batch_size {saved_batch}, or add --train.resume_batch_change true "
            f"if the change is intended"
        )


def check_epochs(data: dict, expected: Expected, step_dir: Path, model_file: dict) -> None:
    """train.epochs reaches past the epoch the data stream stands in (0-based `epoch` of its last batch): below it
    the run trains nothing, or cuts the epoch under way. Equal to a finished run's epochs is allowed: a requeued job
    of a finished run trains nothing and ends."""
    current, done = data.get("epoch"), model_file.get("epoch")
    if expected.epochs is None or not isinstance(current, int) or expected.epochs > current:
        return
    at = f"checkpoint {step_dir} (step {saved_step(model_file)})"
    if isinstance(done, int) and done > current:  # the stream's last batch ended its epoch
        if expected.epochs >= done:
            return
        where = f"{at} has trained {done} epochs, so nothing would be trained"
    else:
        where = f"{at} is part-way through epoch {current + 1}, whose rest would not be trained"
    raise ConfigError(
        f"config key 'train.epochs': {expected.epochs}, but {where}; it counts the run's epochs in all, not the "
        f"epochs still to go: raise it"
    )


def check_loss_state(loss_state: dict | None, expected: Expected, step_dir: Path, model_file: dict) -> None:
    """The per-sample state is as long as this data's; a saved feature queue has this loss's slots (a queue added
    on resume starts empty, which is allowed)."""
    queued = (loss_state or {}).get("queue.indices")
    if expected.queue_size is not None and hasattr(queued, "shape") and queued.shape[0] != expected.queue_size:
        now = f"{expected.queue_size} slots" if expected.queue_size else "no queue"
        raise _loss_misfit(
            step_dir, expected, model_file, f"a feature queue of {queued.shape[0]} slots, this loss has {now}"
        )
    extra = (loss_state or {}).get("_extra_state")
    saved = extra.get("data_size") if isinstance(extra, dict) else None
    if saved is not None and int(saved) != int(expected.data_size):
        raise ConfigError(
            f"config key 'data.data_size': checkpoint {step_dir} holds per-sample state for {int(saved)} samples, "
            f"this data gives {expected.data_size}; resume with the same data (if it is, its manifest's data_size "
            f"changed: set --data.data_size {int(saved)}), or {_start_anew(step_dir)}"
        )


def check_momentum_towers(towers: dict | None, expected: Expected, step_dir: Path, model_file: dict) -> None:
    """Momentum towers saved are kept: a run without model.ema_momentum would drop them (and fill a queue with the
    online towers' features instead), silently. Towers added on resume start from the online ones, as a queue
    added starts empty."""
    if towers is not None and expected.momentum_towers is False:
        raise ConfigError(
            f"config key 'model.ema_momentum': checkpoint {step_dir} holds momentum towers (model.ema_momentum), "
            f"this run has none; pass --model.ema_momentum with the value it trained with to keep them, or "
            f"{_start_anew(step_dir)}"
        )


Check = Callable[[Any, Expected, Path, dict], None]  # (the part's saved state, this run, the step folder, model.pt)
CHECKS: dict[str, tuple[bool, Check]] = {  # part name: (in the rank files, its check)
    "config": (False, check_config),
    "loss": (False, check_loss_parameters),
    "data": (True, check_data),
    "step": (False, check_step),
    "loss_state": (True, check_loss_state),
    "optimizer": (False, check_optimizer),
    "momentum_towers": (False, check_momentum_towers),
}

__all__ = ["Expected", "read_given", "read_resume", "check_rank_files", "check_resume", "TRAINING_CHECKPOINT"]
