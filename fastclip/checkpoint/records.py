"""Reading a model.pt: what a loaded file is (ours, an export, OpenCLIP's, a rank file, a bare state dict), its
format version, and the accessors `fastclip eval`, `fastclip export` and the resume checks read it through (none of
them index model.pt by string).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fastclip.checkpoint.files import load_file
from fastclip.checkpoint.layout import CHECKPOINT_FORMAT
from fastclip.errors import CheckpointError


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


def loss_logit_bias(model_file: dict) -> torch.Tensor | None:
    """The bias a sigmoid loss learned (SigLIP's logit_bias), if the loss has one."""
    bias = loss_parameters(model_file).get("logit_bias")
    return bias if isinstance(bias, torch.Tensor) else None


BN_COUNTER = "num_batches_tracked"


def fitted_to(model_keys, state: dict) -> dict:
    """`state` without the sigmoid bias an export carries for open_clip (logit_bias) where the model built here has
    none: in fastclip a SigLIP loss holds its bias, not the towers (fastclip export puts it in the towers). A
    BatchNorm's step counter where only one side has it (a tower locked with model.lock_image_freeze_bn_stats has
    FrozenBatchNorm2d layers, which keep none): dropped from the file, or 0 where the file lacks it (what torch's
    BatchNorm loader gives a file without one); the statistics and affine weights are the same tensors."""
    if "logit_bias" in state and "logit_bias" not in model_keys:
        state = {k: v for k, v in state.items() if k != "logit_bias"}
    counter = lambda key: key.endswith(f".{BN_COUNTER}")  # noqa: E731
    stats = lambda key: key[: -len(BN_COUNTER)] + "running_mean"  # noqa: E731
    extra = [k for k in state if counter(k) and k not in model_keys and stats(k) in model_keys]
    missing = [k for k in model_keys if counter(k) and k not in state and stats(k) in state]
    if extra or missing:
        state = {k: v for k, v in state.items() if k not in extra}
        state.update({k: torch.zeros((), dtype=torch.long) for k in missing})
    return state


def architecture(model_file: dict) -> tuple[str | None, dict | None]:
    """(arch, model config) a training checkpoint records; (None, None) for an export."""
    config = model_file.get("model_config")
    return model_file.get("arch"), config if isinstance(config, dict) else None


def saved_step(model_file: dict) -> int | None:
    step = model_file.get("step")
    return int(step) if isinstance(step, (int, torch.Tensor)) else None


def saved_world_size(model_file: dict) -> int:
    return int(model_file["world_size"])


def saved_config(model_file: dict) -> dict:
    """The resolved config the run trained with (Config.to_dict())."""
    return model_file["config"]


def saved_backend(model_file: dict) -> str:
    """The backend that wrote a checkpoint (files from before train.distributed existed are DDP's)."""
    return model_file.get("config", {}).get("train", {}).get("distributed", "ddp")


def ssl_enabled(config: dict) -> bool | None:
    """A saved config's ssl.enabled (an image tower + projector alone); None where it has no ssl section (a
    checkpoint from before it existed)."""
    ssl = config.get("ssl")
    return bool(ssl.get("enabled")) if isinstance(ssl, dict) else None


def is_ssl_checkpoint(checkpoint: dict) -> bool:
    return bool(ssl_enabled(checkpoint.get("config") or {}))


def image_tower_state(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The tower's tensors (``visual.*`` of the saved model, the prefix dropped): open_clip's ``model.visual``
    state dict; the projector stays behind."""
    towers = towers_state(checkpoint)
    return {k[len("visual.") :]: v for k, v in towers.items() if k.startswith("visual.")}


# ----------------------------------------------------------------------------- what a file is
RANK_FILE = "a fastclip rank file"
TRAINING_CHECKPOINT = "a fastclip training checkpoint"
BARE_STATE_DICT = "a bare state dict"
WEIGHTS = (  # what describe_checkpoint calls files that hold the towers' weights (usable as --model.pretrained)
    TRAINING_CHECKPOINT,
    "an OpenCLIP training checkpoint",
    "a model-only checkpoint",
    "a checkpoint with a state_dict",
    BARE_STATE_DICT,
)


def describe_checkpoint(obj) -> str:
    """What a loaded checkpoint file is, in words (starting with RANK_FILE, one of WEIGHTS, or "not a")."""
    if not isinstance(obj, dict):
        return f"not a checkpoint (holds a {type(obj).__name__})"
    if is_training_checkpoint(obj):
        return TRAINING_CHECKPOINT
    if {"rank", "world_size", "loss_state"} <= set(obj):  # rank_<r>.pt: per-sample state, no weights
        return (
            f"{RANK_FILE} (rank {obj.get('rank')} of {obj.get('world_size')}, step {obj.get('step')}: one "
            f"process's per-sample state and data position, no weights)"
        )
    if isinstance(obj.get("state_dict"), dict):
        if "epoch" in obj and ("optimizer" in obj or "name" in obj):
            return f"an OpenCLIP training checkpoint (epoch_N.pt, epoch {obj.get('epoch')})"
        if set(obj) == {"state_dict"}:
            return "a model-only checkpoint (fastclip export, or an open_clip weights file)"
        return f"a checkpoint with a state_dict but no fastclip training state (keys {sorted(map(str, obj))[:8]})"
    if obj and all(torch.is_tensor(v) for v in obj.values()):
        return f"{BARE_STATE_DICT} ({len(obj)} tensors)"
    return f"not a model checkpoint (a dict with keys {sorted(map(str, obj))[:8]})"


def shape_mismatches(expected: dict, state: dict) -> str:
    """'' when `state` has exactly the keys and shapes of `expected`, else a short description."""
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    parts = []
    if shapes:
        parts.append(f"{len(shapes)} tensor(s) of another shape (checkpoint vs model), e.g. {'; '.join(shapes[:3])}")
    if missing:
        parts.append(f"{len(missing)} missing, e.g. {missing[:3]}")
    if extra:
        parts.append(f"{len(extra)} unexpected, e.g. {extra[:3]}")
    return ", ".join(parts)
