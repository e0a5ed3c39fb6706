"""What the operator typed, checked before anything expensive (towers, data workers, process groups).

Each failure is a ConfigError: one line naming the key or file and what to do; `fastclip train` exits 2.

    check_operator_input(cfg)           the three below, and train.wandb without the wandb package or an API key
    check_device(cfg)                   train.device cuda on a machine without a GPU, train.backend nccl on the CPU
    check_arch(cfg)                     model.arch that is no known architecture (lists the known ones), or whose
                                        Hugging Face text tower is a hub id not in the local cache
    check_run_dir(cfg)                  a run folder that cannot be written, or that holds a run and no resume
    lock_run_dir(cfg, info)             a run folder another job (or a leftover rank of a killed one) trains in
    check_run_dir_free(cfg)             the same for `--check`, which takes no lock
    expected_by(cfg, world_size, ...)   what this run expects of a checkpoint it resumes (the checks are
                                        fastclip/checkpoint/compat.py's)
    read_pretrained(path)               the towers' tensors of --model.pretrained (any format describe_checkpoint knows)
    check_fits(model, state, what)      every tensor present with the model's shape (strict: no partial loads)
    fit_pretrained(model, state, path)  model.pretrained's tensors as the model loads them, checked
    meta_towers(cfg)                    `--check`'s towers: the architecture built on the meta device
    setting_notes(cfg, device, ...)     settings that are legal but rarely what was meant: notes, said at the start
    restart_note(cfg, resume_dir)       `--train.resume latest` over records with no checkpoint: said
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections import Counter
from pathlib import Path

import torch

from fastclip.checkpoint import (
    BARE_STATE_DICT,
    CHECKPOINTS,
    LATEST,
    MODEL_FILE,
    RANK_FILE,
    STEP_DIR,
    describe_checkpoint,
    fitted_to,
    list_checkpoints,
    read_pointer,
    shape_mismatches,
    strip_module_prefix,
)
from fastclip.checkpoint.compat import Expected, read_given
from fastclip.cli import plural
from fastclip.data.plan import num_batches
from fastclip.data.stream import stream_identity
from fastclip.train.config import Config, ConfigError


# ----------------------------------------------------------------------------- machine and names
def check_operator_input(cfg: Config, *, create: bool = True) -> None:
    check_device(cfg)
    check_arch(cfg)
    if cfg.train.wandb:
        check_wandb()
    check_run_dir(cfg, create=create)  # last: a refused run leaves no folder


WANDB_NO_SERVER = ("offline", "disabled", "dryrun")  # wandb modes that need no API key


def check_wandb() -> None:
    """train.wandb: the package is installed and, unless wandb's mode keeps the run off the server, an API key is
    where wandb looks for one for its server. Mode, server and key are wandb's own resolution (WANDB_* variables,
    `wandb offline`/`wandb login --host` settings files, ~/.netrc; no prompt), its messages held back; wandb.init
    raised a UsageError at the start of the run otherwise. A wandb without these internals is not checked."""
    import contextlib
    import io

    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(
            "config key 'train.wandb': the wandb package is not installed; pip install 'fastclip[wandb]' "
            "(or drop wandb from --report-to / set --train.wandb false)"
        ) from None
    said = io.StringIO()  # "wandb: Loading settings from ...": not this command's lines
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            from wandb.sdk import wandb_setup
            from wandb.sdk.lib.wbauth import authenticate_session

            settings = wandb_setup.singleton().settings
            if str(settings.mode).lower() in WANDB_NO_SERVER:
                return
            host = settings.base_url
            found = authenticate_session(host=host, source="fastclip train", prompt=False, update_session=False)
    except (ImportError, TypeError, AttributeError):  # another wandb version's internals: wandb.init will say
        return
    except Exception as e:  # a key in the wrong format (wandb's AuthenticationError), a setting wandb refuses
        said = wandb_says(e)
        fix = (
            "fix it where it is set (a WANDB_* variable or wandb's settings file)"
            if said.startswith("wandb setting")
            else "set a valid key (`wandb login`), or WANDB_MODE=offline"
        )
        raise ConfigError(f"config key 'train.wandb': {said}; {fix}") from None
    if found is None:
        raise ConfigError(
            f"config key 'train.wandb': no W&B API key for {host} (none in WANDB_API_KEY, ~/.netrc or wandb's "
            f"settings): run `wandb login`, or set WANDB_MODE=offline to keep the logs under the run folder"
        )


def wandb_says(error: Exception) -> str:
    """wandb's error, one line (a settings error, pydantic's, names the setting and its value)."""
    if type(error).__name__ == "ValidationError" and callable(getattr(error, "errors", None)):
        first = (error.errors() or [{}])[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "a setting"
        return f"wandb setting {where} {first.get('input')!r}: {first.get('msg', 'invalid')}"
    return f"wandb: {(str(error).strip().splitlines() or [type(error).__name__])[0][:300].rstrip('.')}"


def check_device(cfg: Config) -> None:
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        built = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA GPU visible"
        raise ConfigError(
            f"config key 'train.device': cuda, but this machine has {built} "
            f"(torch.cuda.is_available() is False); use --train.device cpu, or auto to take a GPU "
            f"when there is one"
        )
    on_cpu = cfg.train.device == "cpu" or not torch.cuda.is_available()
    if cfg.train.backend == "nccl" and on_cpu:  # the processes failed to meet, "doesn't have NCCL built in"
        where = "train.device cpu" if cfg.train.device == "cpu" else "no CUDA GPU on this machine"
        raise ConfigError(
            f"config key 'train.backend': nccl runs between CUDA GPUs, and this run trains on the CPU ({where}); "
            f"use --train.backend gloo, or auto (nccl on GPUs, gloo on CPUs)"
        )


def known_archs() -> tuple[list[str], list[str]]:
    """(our configs in configs/models, open_clip's built-in names)."""
    from fastclip.compat import import_open_clip
    from fastclip.models import REPO_MODEL_CONFIGS

    ours = sorted(p.stem for p in REPO_MODEL_CONFIGS.glob("*.json"))
    return ours, sorted(import_open_clip().list_models())


def check_arch(cfg: Config) -> None:
    from fastclip.models import CONFIG_KEYS, find_arch

    arch = cfg.model.arch
    try:  # found, not registered: importing open_clip is the ranks' cost, not this check's
        _, path, config = find_arch(arch)
        missing = [k for k in CONFIG_KEYS if k not in config]
    except FileNotFoundError:
        raise ConfigError(f"config key 'model.arch': model config file {arch!r} does not exist") from None
    except (ValueError, KeyError, OSError) as e:
        if arch.endswith(".json"):
            raise ConfigError(f"config key 'model.arch': {arch}: not a usable model config ({e})") from None
    else:
        if missing:
            raise ConfigError(f"config key 'model.arch': {arch}: model config lacks {missing} (open_clip needs all 3)")
        check_text_tower_local(arch, config)
        if path is not None:
            check_vocab(arch, config)
        return
    ours, theirs = known_archs()
    theirs = [n for n in theirs if n not in ours]
    close = difflib.get_close_matches(arch, ours + theirs, n=3)
    raise ConfigError(
        f"config key 'model.arch': unknown architecture {arch!r}"
        + (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else "")
        + f"; known: ours (configs/models) {', '.join(ours)}; open_clip's {', '.join(theirs)}; "
        f"or a path to a model config .json"
    )


CLIP_VOCAB = 49408  # token ids of open_clip's own tokenizer (the one a text tower without hf_tokenizer_name gets)


def check_vocab(arch: str, config: dict) -> None:
    """A config file's text embedding must hold every id open_clip's tokenizer gives, or the first step fails on an
    index out of range."""
    text = config.get("text_cfg", {})
    vocab = text.get("vocab_size")
    if "hf_tokenizer_name" not in text and isinstance(vocab, int) and vocab < CLIP_VOCAB:
        raise ConfigError(
            f"config key 'model.arch': {arch}: text_cfg.vocab_size is {vocab}, but its tokenizer (open_clip's) "
            f"gives ids up to {CLIP_VOCAB - 1}; set vocab_size to {CLIP_VOCAB}, or name a tokenizer "
            f"(text_cfg.hf_tokenizer_name)"
        )


def check_text_tower_local(arch: str, config: dict) -> None:
    """A Hugging Face text tower named by a hub id must be in the local hub cache: nothing is downloaded."""
    from fastclip.models import hub_names_not_cached

    absent = hub_names_not_cached(config)
    if absent:
        raise ConfigError(
            f"config key 'model.arch': {arch}'s text tower is the Hugging Face hub model {' and '.join(absent)}, "
            f"which is not in the local hub cache and is not downloaded: put its config.json and tokenizer files in a "
            f"folder and use a model config naming that folder (as configs/models/tiny-vit-hf.json does)"
        )


def check_writable(path: Path) -> None:
    """A file the run writes, already there, opens for writing: probed without creating or changing anything (a
    file of another owner, a broken link, a read-only mount gave a traceback at the first write)."""
    dangling = os.path.islink(path) and not os.path.exists(path)
    target = Path(os.path.realpath(path))
    try:
        if dangling and target.parent.is_dir():  # the run's write creates the target: probe that folder
            probe = target.parent / f".fastclip-probe-{os.getpid()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            os.unlink(probe)
            return
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
    except OSError as e:
        broken = f" (a broken symbolic link to {target})" if dangling else ""
        raise ConfigError(
            f"config key 'train.run_dir': {path} cannot be written: {e.strerror}{broken}; fix it or move it away, "
            f"or choose another --train.run_dir"
        ) from None


def check_run_dir(cfg: Config, *, create: bool = True) -> None:
    """The run folder (and its checkpoints/) can be created and written: probe with a real file, since
    permissions alone do not tell (a read-only mount, root, ACLs). ``create=False`` (train --check) leaves the
    disk as it was: the probe goes into the nearest folder that exists. A folder holding checkpoints is refused
    unless train.resume is set (check_no_run_held)."""
    run_dir = Path(cfg.train.run_dir)
    resume = cfg.train.resume
    if not resume:
        check_no_run_held(run_dir)
    elif resume != "latest" and os.path.lexists(resume) and not _within(Path(resume), run_dir):
        # another run's checkpoint, continued here (a path that does not exist is said by the resume's check)
        check_no_run_held(run_dir, resuming=resume)
    appended = (RUN_LOCK, "metrics.jsonl", "config.yaml") + ("wandb_id",) * cfg.train.wandb  # opened, written
    for name in (*appended, f"{CHECKPOINTS}/{LATEST}"):  # files the run writes (latest: replaced by a rename)
        if os.path.isdir(run_dir / name):  # a folder there stops it later (never raises: a name too long is probed)
            raise ConfigError(
                f"config key 'train.run_dir': {run_dir / name} is a folder where the run writes a file; move it "
                f"away or choose another --train.run_dir"
            )
        if name in appended and os.path.lexists(run_dir / name):
            check_writable(run_dir / name)
    if (
        cfg.train.tensorboard
        and os.path.lexists(run_dir / "tensorboard")
        and not os.path.isdir(run_dir / "tensorboard")
    ):
        raise ConfigError(
            f"config key 'train.run_dir': {run_dir / 'tensorboard'} is a file where the run writes its TensorBoard "
            f"folder; move it away, choose another --train.run_dir, or set --train.tensorboard false"
        )
    if taken := _step_names_taken(run_dir / CHECKPOINTS):
        path = taken[0]
        raise ConfigError(
            f"config key 'train.run_dir': {path} is {'a link' if path.is_symlink() else 'a file'} where the run "
            f"writes a step folder; move it away or choose another --train.run_dir"
        )
    folders = (run_dir, run_dir / CHECKPOINTS)
    for path in (*folders, *run_dir.parents):  # (lexists/isdir never raise: a path too long is probed below)
        if os.path.lexists(path) and not os.path.isdir(path):
            what = "a broken symbolic link" if os.path.islink(path) else "a file"
            raise ConfigError(
                f"config key 'train.run_dir': {path} is {what}, not a folder; choose another --train.run_dir"
            )
    if cfg.train.tensorboard and os.path.isdir(run_dir / "tensorboard"):  # there already: its event files go in
        folders += (run_dir / "tensorboard",)
    if not create:
        existing = next((f for f in (run_dir, *run_dir.parents) if os.path.lexists(f)), Path("."))
        try:
            limit = os.pathconf(existing, "PC_NAME_MAX")
        except (OSError, ValueError):
            limit = 255
        missing = [*run_dir.relative_to(existing).parts] if run_dir != existing else []
        if any(len(os.fsencode(part)) > limit for part in missing):
            raise ConfigError(
                f"config key 'train.run_dir': cannot write in {run_dir} (a name in it is longer than {limit} "
                f"bytes); choose another --train.run_dir"
            )
        folders = tuple(f for f in folders if os.path.isdir(f)) or (existing,)
    for folder in folders:
        try:
            if create:
                folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".write_probe.{os.getpid()}"
            try:  # some bytes, not an empty file: a full disk still makes an empty one
                probe.write_bytes(bytes(PROBE_BYTES))
            finally:
                probe.unlink(missing_ok=True)
        except OSError as e:  # named as --check names it: the nearest folder that exists (where mkdir failed)
            where = next((f for f in (folder, *folder.parents) if os.path.isdir(f)), folder)
            raise ConfigError(
                f"config key 'train.run_dir': cannot write in {where} ({e.strerror or e}); make it "
                f"writable or choose another --train.run_dir"
            ) from None


def _step_names_taken(root: Path) -> list[Path]:
    """Entries of checkpoints/ named like a step folder that are not one (a file, a link): a save there would
    move them aside."""
    try:
        return [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p.is_symlink() or not p.is_dir())]
    except OSError:  # no such folder yet, or not one: the write probe says what
        return []


def _within(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def check_no_run_held(run_dir: Path, resuming: str | None = None) -> None:
    """A fresh start in a folder that holds a run would mix two runs (the old step folders stay beside the new ones,
    `latest` moves back, metrics.jsonl is cut), and so would another run's checkpoint continued there (`resuming`:
    its steps replace this run's): refused. A run that logged steps but saved no checkpoint counts too."""
    root = run_dir / CHECKPOINTS
    try:
        steps = list_checkpoints(root)
        pointer = read_pointer(root)
        metrics = run_dir / "metrics.jsonl"
        if steps or pointer is not None or metrics.is_file():
            _refuse_if_in_use(run_dir)  # a running job's folder: that is what to say (its files are being written)
        logged = metrics.is_file() and metrics.stat().st_size > 0
    except OSError:  # not a folder, not readable, a name too long: the write probe below says what
        return
    if not steps and pointer is None:
        if logged:
            raise ConfigError(
                f"config key 'train.run_dir': {run_dir} holds the metrics.jsonl of a run that saved no checkpoint; "
                f"a new run would cut it: choose another --train.run_dir, or delete that file to start over there"
            )
        return
    newest = root / pointer if pointer and STEP_DIR.fullmatch(pointer) else steps[-1] if steps else None
    held = f"step {int(STEP_DIR.fullmatch(newest.name).group(1))}, {newest}" if newest else f"{root / LATEST}"
    if resuming is not None:
        raise ConfigError(
            f"config key 'train.run_dir': {run_dir} already holds a run ({held}); continuing {resuming} there would "
            f"replace its checkpoints: choose a new --train.run_dir (or that checkpoint's own run folder)"
        )
    raise ConfigError(
        f"config key 'train.run_dir': {run_dir} already holds a run ({held}): continue it with "
        f"--train.resume latest, or choose another --train.run_dir"
    )


RUN_LOCK = ".fastclip.lock"
PROBE_BYTES = 4096  # what check_run_dir writes in each folder of the run (a block: a full disk refuses it)


def lock_run_dir(cfg: Config, info):
    """Rank 0 holds an exclusive lock on the run folder while the job trains (fcntl.flock on <run_dir>/.fastclip.lock;
    the OS drops it when the process ends, however it ends), so a second job, or a rank 0 left running by a killed
    launcher, cannot write the same checkpoints. Rank 0's answer is broadcast: every rank raises the same one-line
    ConfigError. Returns the open lock file on rank 0 (keep it open), else None. (Lustre and NFS need flock
    support on the mount for the lock to hold across nodes.)"""
    import socket
    import time

    from fastclip.distributed import broadcast_flag

    handle, holder, unwritable = None, "", False
    if info.is_main:
        path = Path(cfg.train.run_dir) / RUN_LOCK
        try:
            handle, holder = _take_lock(path)
            if handle is not None:
                handle.seek(0)
                handle.truncate()
                handle.write(
                    f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                )
                handle.flush()
        except OSError as e:  # a disk that filled since the checks (the lock is the run's first write)
            if handle is not None:
                with contextlib.suppress(OSError):  # (close flushes the line again, and fails again)
                    handle.close()
            handle, unwritable = None, e.strerror or str(e)
    if broadcast_flag(bool(unwritable), info):
        raise ConfigError(
            f"config key 'train.run_dir': cannot write in {cfg.train.run_dir} (its lock file {RUN_LOCK}: "
            f"{unwritable or 'see rank 0'}); free space or make it writable, or choose another --train.run_dir"
        )
    if broadcast_flag(handle is None and info.is_main, info):
        raise _run_dir_in_use(cfg.train.run_dir, holder)
    return handle


def remove_if_untouched(run_dir: Path) -> None:
    """A run folder this run made, holding nothing but its lock and empty folders (it failed before its first
    metric or checkpoint), is removed: the rerun after the fix is not told the folder holds a run."""
    try:
        entries = list(run_dir.iterdir())
        empty_folder = lambda e: e.is_dir() and not e.is_symlink() and not any(e.iterdir())  # noqa: E731
        if any(e.name != RUN_LOCK and not empty_folder(e) for e in entries):
            return
        for entry in entries:
            entry.rmdir() if entry.is_dir() else entry.unlink()
        run_dir.rmdir()
    except OSError:  # another process wrote there meanwhile, or it is not ours to remove: left as it is
        pass


def remove_if_untouched_and_free(run_dir: Path) -> None:
    """remove_if_untouched for a run that never took the lock (its group never formed): only while no other job
    holds it (another launch on the same folder may have made it and be about to write)."""
    path = run_dir / RUN_LOCK
    if not path.is_file():
        return remove_if_untouched(run_dir)
    try:
        handle, _ = _take_lock(path)
    except OSError:  # gone meanwhile, or not ours to open: left as it is
        return
    if handle is None:  # held: another job's folder now
        return
    try:
        remove_if_untouched(run_dir)
    finally:
        handle.close()


def check_run_dir_free(cfg: Config) -> None:
    """`--check`: the run folder's lock is not held by a running job (taken and let go at once; no file is made)."""
    _refuse_if_in_use(Path(cfg.train.run_dir))


def _refuse_if_in_use(run_dir: Path, tries: int = 5) -> None:
    """Refused while a running job holds the folder's lock. Tried a few times 0.1 s apart: the other ranks of this
    launch take it for a moment as they check too, where a running job holds it for its whole run."""
    import time

    path = run_dir / RUN_LOCK
    if not path.is_file():
        return
    for attempt in range(tries):
        handle, holder = _take_lock(path)
        if handle is not None:
            handle.close()
            return
        time.sleep(0.1 * (attempt < tries - 1))
    raise _run_dir_in_use(run_dir, holder)


def _take_lock(path: Path):
    """(the open lock file, "") when this process now holds it, else (None, what its holder wrote)."""
    import fcntl

    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return handle, ""
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        return None, holder


def _run_dir_in_use(run_dir, holder: str) -> ConfigError:
    return ConfigError(
        f"config key 'train.run_dir': {run_dir} is in use by a running job"
        + (f" ({holder})" if holder else "")
        + "; wait for it to end or stop it, or choose another --train.run_dir"
    )


# ----------------------------------------------------------------------------- resume
def expected_by(cfg: Config, world_size: int, catalog, data_size: int, loss_fn: torch.nn.Module) -> Expected:
    """What this run expects of a checkpoint it resumes (`loss_fn`: the run's loss, built but not yet called), and
    the config keys that set the data's identity."""
    from fastclip.checkpoint.parts import LossParameters

    d = cfg.data
    return Expected(
        arch=cfg.model.arch,
        loss=cfg.loss.name,
        optimizer=cfg.optim.optimizer,
        precision=cfg.train.precision,
        queue_size=cfg.loss.queue_size or 0,
        momentum_towers=cfg.model.ema_momentum is not None,
        ssl=bool(cfg.ssl.enabled),
        locks={f"model.{k}": v for k, v in cfg.to_dict()["model"].items() if k.startswith("lock_")},
        loss_parameters=LossParameters.shapes(loss_fn),
        loss_trainable=sum(1 for p in loss_fn.parameters() if p.requires_grad),
        loss_options={k: v for k, v in cfg.to_dict()["loss"].items() if k not in ("name", "validate")},
        backend=cfg.train.distributed,
        zero_stage=cfg.deepspeed.stage if cfg.train.distributed == "deepspeed" else None,
        world_size=world_size,
        batch_size=d.batch_size,
        batch_change_ok=bool(cfg.train.resume_batch_change),
        max_steps=cfg.train.max_steps,
        epochs=cfg.train.epochs,
        data_size=data_size,
        data=stream_identity(
            seed=data_seed(cfg), resampled=d.resampled, samples_per_epoch=d.samples_per_epoch, catalog=catalog
        ),
        data_keys={
            "seed": "data.seed" if d.seed is not None else "train.seed",
            "resampled": "data.resampled",
            "epoch_length": "data.samples_per_epoch" if d.resampled else "data.train",
            "fingerprint": "data.train",
        },
    )


def data_seed(cfg: Config) -> int:
    """The data order's seed: data.seed, else train.seed."""
    return cfg.train.seed if cfg.data.seed is None else cfg.data.seed


# ----------------------------------------------------------------------------- pretrained towers
def read_pretrained(path: str) -> dict[str, torch.Tensor]:
    """The towers' tensors of an OpenCLIP epoch_N.pt, an open_clip state dict, our export or our training
    checkpoint (its towers only); a DDP `module.` prefix is dropped."""
    file = Path(path)
    if not file.is_file():
        tag = "/" not in str(path) and "." not in str(path)  # openai, laion2b_s34b_b79k: OpenCLIP's download tags
        raise ConfigError(
            f"config key 'model.pretrained': {path} does not exist (or is not a file)"
            + (
                "; OpenCLIP's pretrained tags are downloaded by open_clip, which fastclip does not do: download the "
                "weights file and pass its path"
                if tag
                else ""
            )
        )
    obj = read_given(file, "model.pretrained")
    kind = describe_checkpoint(obj)
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        state = obj["state_dict"]
    elif kind.startswith(BARE_STATE_DICT):
        state = obj
    elif kind.startswith(RANK_FILE):
        raise ConfigError(
            f"config key 'model.pretrained': {path} is {kind}; pass the {MODEL_FILE} of its step folder "
            f"({file.parent / MODEL_FILE})"
        )
    else:
        raise ConfigError(
            f"config key 'model.pretrained': {path} is {kind}; expected an OpenCLIP checkpoint, an "
            f"open_clip state dict or a fastclip export/checkpoint"
        )
    state = strip_module_prefix(state)
    bad = [k for k, v in state.items() if not torch.is_tensor(v)]
    if bad:
        raise ConfigError(f"config key 'model.pretrained': {path}: entries that are not tensors: {bad[:5]}")
    return dict(state)


def check_fits(model: torch.nn.Module, state: dict, what: str, key: str | None = None) -> None:
    """Every tensor of the model present in `state` with its shape, nothing extra: a partial load would train
    a half-random model without a word. Raises ConfigError (or ValueError with key=None) naming the file."""
    mismatches = shape_mismatches(model.state_dict(), state)
    if mismatches:
        message = f"{what} does not fit architecture: {mismatches}"
        raise ConfigError(f"config key '{key}': {message}") if key else ValueError(message)


IMAGE_TOWER = "visual."  # open_clip's image tower, in every CLIP model's state dict


def image_tower_state(model_keys, state: dict) -> dict | None:
    """`state` in the model's names where it holds an image tower alone (LiT's start: a pretrained image model):
    keys that all begin with "visual.", or an image tower's own state dict (open_clip's model.visual, an ssl run's
    export), whose keys all are the model's image tower's without the prefix; None for anything else."""
    visual = {k for k in model_keys if k.startswith(IMAGE_TOWER)}
    if not state or not visual:
        return None
    if all(k.startswith(IMAGE_TOWER) for k in state):
        return state
    if all(IMAGE_TOWER + k in visual for k in state):
        return {IMAGE_TOWER + k: v for k, v in state.items()}
    return None


def fit_pretrained(model: torch.nn.Module, state: dict, path: str) -> dict:
    """model.pretrained's tensors as the model loads them, checked (check_fits): an export's logit_bias, where the
    model has none, is left out (a SigLIP loss holds its bias here, not the towers). A file of the image tower alone
    (image_tower_state) fills that tower, every tensor of it, and the rest keeps its init."""
    own = model.state_dict()
    image = image_tower_state(own, state)
    if image is None:
        fitted = fitted_to(own, state)
        check_fits(model, fitted, path, "model.pretrained")
        return fitted
    tower = {k: v for k, v in own.items() if k.startswith(IMAGE_TOWER)}
    fitted = fitted_to(tower, image)
    if mismatches := shape_mismatches(tower, fitted):
        raise ConfigError(f"config key 'model.pretrained': {path} (an image tower) does not fit the architecture's "
                          f"image tower: {mismatches}")  # fmt: skip
    return {**{k: v for k, v in own.items() if k not in tower}, **fitted}


def pretrained_words(model_keys, state: dict, path: str) -> str:
    """The start line's words for model.pretrained's file: the towers, or the image tower alone."""
    if image_tower_state(model_keys, state) is None:
        return f"towers from {path}"
    text = any(k.startswith(("text.", "token_embedding.")) for k in model_keys)  # (an ssl run: a projector)
    return f"image tower from {path}, {'text tower' if text else 'the rest'} random init"


def meta_towers(cfg: Config) -> torch.nn.Module:
    """`--check`'s stand-in for the run's towers: built on the meta device (shapes only: no memory, no init), and
    locked as the run locks them (model.lock_image, model.lock_text: a ConfigError where they cannot be)."""
    from fastclip.train.net import build_towers, lock_towers

    with torch.device("meta"):
        model = build_towers(cfg, device="meta").model  # an ssl run's checkpoint holds the tower + projector
        lock_towers(model, cfg)  # (frozen BatchNorm statistics change the towers' state_dict keys)
        return model


__all__ = [
    "check_device",
    "check_arch",
    "check_run_dir",
    "check_no_run_held",
    "expected_by",
    "data_seed",
    "read_pretrained",
    "check_fits",
    "fit_pretrained",
    "image_tower_state",
    "pretrained_words",
    "meta_towers",
    "check_run_dir_free",
    "known_archs",
]


# ----------------------------------------------------------------------------- notes on legal settings
def restart_note(cfg: Config, resume_dir: Path | None) -> str | None:
    """`--train.resume latest` in a run folder with no checkpoint yet but records (a job that died, or was requeued,
    before its first save) starts at step 0 and starts its metrics.jsonl over: said, with how many records go."""
    records = Path(cfg.train.run_dir) / "metrics.jsonl"
    if cfg.train.resume != "latest" or resume_dir is not None or not records.is_file():
        return None
    with open(records, "rb") as f:
        count = sum(1 for line in f if line.strip())
    if not count:
        return None
    return (
        f"fastclip train: note: train.resume latest: {cfg.train.run_dir} has no checkpoint yet, so this run starts "
        f"at step 0 and starts {records.name} over ({count} record{'s' * (count != 1)} of an earlier attempt that "
        f"saved none)"
    )


# what a resumed run trains on: loss and objective, model (but how it is computed), optimizer, ssl, augmentation
CHANGED_ON_RESUME = ("loss.", "model.ema_momentum", "optim.", "ssl.", "data.aug.")
NOT_THE_OBJECTIVE = (  # how it is computed, or evaluated: the same objective
    "loss.validate",
    "loss.fused_kernels",
    "loss.impl",
    "optim.accum_steps",
    "ssl.knn_k",
    "ssl.knn_temperature",
)


def _with_loss_defaults(flat: dict, name) -> dict | None:
    """loss.* as the loss resolves them (a null is the library's default: spelling the default out changes
    nothing); None where the loss cannot resolve them."""
    from fastclip.losses import config_option_names, resolved_options

    extra = "loss.extra_options."  # a loss of the user's own: its options beyond the loss.* keys
    loss = {
        k.removeprefix(extra).removeprefix("loss."): v
        for k, v in flat.items()
        if k.startswith("loss.") and k not in ("loss.name", "loss.extra_options")
    }
    try:
        resolved = resolved_options(name, **loss)
        own = config_option_names(name)
    except Exception:  # (a name that is no loss; a saved value a user's options class now refuses, however)
        return None
    keys = {k.removeprefix("loss.") for k in flat if k.startswith("loss.") and not k.startswith(extra)}
    out = {**flat, **{f"loss.{k}": v for k, v in resolved.items() if k in keys}}
    # every option of its own, set or not, so that one given before and dropped since (or the reverse) is compared
    out.update({f"{extra}{k}": v for k, v in resolved.items() if k in own and k not in keys})
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_on_resume_note(cfg: Config, saved: dict | None) -> str | None:
    """The settings of what is trained that a resume changes (those that cannot change are refused by the checks):
    a requeue command line that lost a flag changed the objective without a word."""
    if not saved:
        return None
    before, now = _flat(saved), _flat(cfg.to_dict())
    resolved = _with_loss_defaults(before, cfg.loss.name), _with_loss_defaults(now, cfg.loss.name)
    if None not in resolved:  # (one side that cannot be resolved: both compared as written)
        before, now = resolved
    changed = [
        k
        for k in now
        if k.startswith(CHANGED_ON_RESUME) and k not in NOT_THE_OBJECTIVE and k in before and before[k] != now[k]
    ]
    if not changed:
        return None
    said = lambda v: "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    shown = ", ".join(f"{k} {said(before[k])} -> {said(now[k])}" for k in changed)
    return f"fastclip train: note: resumed with settings the checkpoint was not trained with: {shown}"


def setting_notes(
    cfg: Config,
    device: torch.device,
    resumed_layout,
    stream,
    schedules,
    steps: tuple[int, int],
    loss_fn,
    schedule_end: int,
) -> list[str]:
    """Settings that are legal but rarely what was meant, said once at the start (`resumed_layout`: the data layout
    the checkpoint was trained at, or None; `stream`: the run's train stream; `schedules`: the run's (restored)
    Schedules; `steps`: the run's first and last; `loss_fn`: the run's loss; `schedule_end`: the schedule step the
    run ends at, its last step where the layout never changed)."""
    step, last_step = steps
    unit = schedules.unit
    kept = (
        f"the lr schedules run on samples seen in steps of {unit} samples (the global batch the run began with), so "
        f"the lr goes on from where the checkpoint left it"
    )
    o, notes = cfg.optim, []
    if cfg.train.precision == "fp16" and device.type == "cpu":  # OpenCLIP's --precision amp, on a CPU
        notes.append(
            "fastclip train: note: train.precision fp16 (--precision amp) on the CPU: most CPUs have no fast "
            "float16 matmul, so this runs several times slower than fp32, which suits a CPU"
        )
    if resumed_layout is not None and resumed_layout.batch_size != cfg.data.batch_size:
        before = num_batches(stream.epoch_length, resumed_layout)
        notes.append(
            f"fastclip train: note: data.batch_size {resumed_layout.batch_size} -> {cfg.data.batch_size} per "
            f"process (train.resume_batch_change): {before} -> {stream.batches_per_epoch} steps per epoch; "
            f"{kept}; the rest of the interrupted epoch is served at the new batch size"
        )
    if resumed_layout is not None and resumed_layout.world_size != stream.layout.world_size:
        before, now = resumed_layout.world_size, stream.layout.world_size
        notes.append(
            f"fastclip train: note: resumed at {now} process(es), trained at {before}: global batch "
            f"{resumed_layout.batch_size * before} -> {cfg.data.batch_size * now}, "
            f"{num_batches(stream.epoch_length, resumed_layout)} -> {stream.batches_per_epoch} steps per epoch; "
            f"{kept}, over {last_step - step} more steps"
        )
    if cfg.model.ema_momentum is not None and not loss_fn.uses_momentum_features:  # (net.py skips their forward)
        notes.append(
            f"fastclip train: note: model.ema_momentum {cfg.model.ema_momentum:g}: no loss.queue_size or "
            "loss.distill_alpha reads the momentum towers' features, so they are not computed; the towers are kept "
            "as an EMA of the model only (model.pt's momentum_towers, fastclip export --momentum-towers)"
        )
    if broken := stream.catalog.scan_broken:
        counts = Counter(reason for _, reason in broken)
        notes.append(
            f"fastclip train: note: data.train: `fastclip data scan` found {plural(len(broken), 'broken shard')} "
            f"({', '.join(f'{r} {n}' for r, n in sorted(counts.items()))}; the first {broken[0][0]}): the samples "
            f"it could not read are in no epoch and in no data_skipped counter (its manifest's problems list them)"
        )
    if o.warmup_steps > schedule_end:
        reach = (
            f"the run's {last_step} steps"
            if schedule_end == last_step
            else f"the {schedule_end} steps of {unit} samples the schedules reach by the run's end"
        )
        notes.append(
            f"fastclip train: note: optim.warmup_steps {o.warmup_steps} > {reach}: the learning rate never reaches "
            f"optim.lr {o.lr:g}"
        )
    return notes
