"""Finding and loading a model from a training checkpoint or an exported file.

Training checkpoints (INTERFACES.md): `<run>/checkpoints/step_<N>/model.pt` holding
{"state_dict", "arch", "model_config", "loss", "step", ...}; `<run>/checkpoints/latest` names the last step
directory. Exported files (`fastclip export`) hold only {"state_dict"}; their architecture comes from
`--arch` or the `<arch>.json` written beside them.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

MODEL_FILE = "model.pt"


def resolve_checkpoint_file(path: str | os.PathLike) -> Path:
    """A model file from a run directory, its checkpoints/ directory, a step directory or the file itself."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if (path / MODEL_FILE).is_file():
        return path / MODEL_FILE
    for checkpoints in (path / "checkpoints", path):
        latest = checkpoints / "latest"
        if latest.is_file():
            step_dir = checkpoints / latest.read_text().strip()
            if not (step_dir / MODEL_FILE).is_file():
                raise FileNotFoundError(f"{latest} names {step_dir}, which has no {MODEL_FILE}")
            return step_dir / MODEL_FILE
    raise FileNotFoundError(
        f"{path}: no {MODEL_FILE}, no checkpoints/latest: pass a run directory, a step directory or a .pt file"
    )


def load_checkpoint(path: str | os.PathLike) -> tuple[Path, dict]:
    from fastclip.train.checkpoint import load_file
    from fastclip.train.errors import CheckpointError

    file = resolve_checkpoint_file(path)
    try:  # the trainer's loader: weights_only, and its one-line refusal of pickled objects
        checkpoint = load_file(file)
    except CheckpointError as err:
        raise ValueError(str(err)) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        found = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"{file}: expected a dict with a 'state_dict' key, found {found}")
    return file, checkpoint


def model_state_dict(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The model's tensors, without a DDP `module.` prefix (OpenCLIP #33: a common loading trap)."""
    state = checkpoint["state_dict"]
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return dict(state)


def loss_logit_scale(checkpoint: dict) -> torch.Tensor | None:
    """The temperature the loss learned (log 1/tau), if the loss has a global one; with one τ per modality
    (v3's separate_temperatures) the mean of their logs, since open_clip's model holds a single scale."""
    loss = checkpoint.get("loss")
    if isinstance(loss, dict) and isinstance(loss.get("logit_scale"), torch.Tensor):
        return loss["logit_scale"].mean()
    return None


def _exported_arch(file: Path) -> str:
    """The `<arch>.json` written beside an export, if there is exactly one model config there."""
    configs = []
    for candidate in sorted(file.parent.glob("*.json")):
        try:
            with open(candidate) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "embed_dim" in data and "vision_cfg" in data:
            configs.append(candidate)
    if len(configs) != 1:
        several = f" (found several configs: {[c.name for c in configs]})" if configs else ""
        raise ValueError(
            f"{file} holds no 'arch' (an exported file?); pass --arch NAME (an open_clip model) or "
            f"--arch path/to/<arch>.json{several}"
        )
    return str(configs[0])


@dataclass
class LoadedModel:
    built: object  # fastclip.models.BuiltModel
    file: Path
    step: int | None


def load_model(path: str | os.PathLike, *, arch: str | None = None, device="cpu") -> LoadedModel:
    """Build the architecture and load the weights of a training checkpoint or an exported file."""
    from fastclip.models import build_model

    file, checkpoint = load_checkpoint(path)
    if arch is None and "arch" in checkpoint:
        arch = checkpoint["arch"]
        model_config = checkpoint.get("model_config")
        if isinstance(model_config, dict):
            # the checkpoint's config is the truth for custom archs: register it under the arch's name
            with tempfile.TemporaryDirectory() as tmp:
                config_file = Path(tmp) / f"{arch}.json"
                config_file.write_text(json.dumps(model_config))
                built = build_model(str(config_file), device=str(device))
        else:
            built = build_model(arch, device=str(device))
    else:
        built = build_model(arch or _exported_arch(file), device=str(device))
    state = model_state_dict(checkpoint)
    # the loss owns the temperature; show it in the model too (it does not change eval rankings)
    scale = loss_logit_scale(checkpoint)
    if scale is not None and "logit_scale" in state:
        state["logit_scale"] = scale.detach().reshape(state["logit_scale"].shape).to(state["logit_scale"].dtype)
    from fastclip.train.preflight import shape_mismatches

    mismatch = shape_mismatches(built.model.state_dict(), state)
    if mismatch:  # checked first: load_state_dict's own error is a multi-line RuntimeError
        raise ValueError(f"{file}: weights do not fit architecture {built.arch!r}: {mismatch}")
    built.model.load_state_dict(state)
    built.model.eval()
    step = checkpoint.get("step")
    return LoadedModel(built, file, int(step) if isinstance(step, (int, torch.Tensor)) else None)
