"""Loading a model for evaluation from a training checkpoint or an exported file.

The layout of training checkpoints belongs to fastclip/checkpoint/ (`<run>/checkpoints/step_<N>/model.pt`,
`latest` naming the last step folder); it is read here through that module. Exported files (`fastclip export`)
hold only {"state_dict"}; their architecture comes from `--arch` or the `<arch>.json` written beside them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fastclip import checkpoint as ckpt
from fastclip.errors import CheckpointError


def _earlier_step(given: str | os.PathLike, file: Path) -> str:
    """Where a run or checkpoints folder led to an unreadable newest model file: the step folder before it, named."""
    chosen = Path(given).resolve() in (file.resolve(), file.parent.resolve())  # the file or its step folder
    if chosen or not ckpt.STEP_DIR.fullmatch(file.parent.name):
        return ""
    earlier = [s for s in ckpt.complete_steps(file.parent.parent) if s.name < file.parent.name]
    return f"; the step folder before it: {earlier[-1]}" if earlier else ""


def load_checkpoint(path: str | os.PathLike) -> tuple[Path, dict]:
    """(the model file found from `path`, its contents): a run, checkpoints or step folder, or the file."""
    try:
        file = ckpt.find_model_file(path)
    except FileNotFoundError:
        if _run_without_checkpoint(Path(path)):
            raise FileNotFoundError(
                f"{path}: this run has saved no checkpoint yet (no step folder in {Path(path) / 'checkpoints'}; "
                f"one is written every checkpoint.every_steps steps): pass a run that has saved one, or a .pt file"
            ) from None
        raise
    try:  # the trainer's loader: weights_only, its one-line refusal of pickled objects, the format version
        checkpoint = ckpt.read_model_file(file)
    except CheckpointError as err:
        raise ValueError(f"{err}{_earlier_step(path, file)}") from None
    if "state_dict" not in checkpoint:
        what = ckpt.describe_checkpoint(checkpoint)
        if what.startswith(ckpt.BARE_STATE_DICT):  # open_clip's model.state_dict() saved as is: what --arch builds
            return file, {"state_dict": checkpoint}
        advice = (
            "pass the model.pt of its step folder, or the step folder"
            if what.startswith(ckpt.RANK_FILE)
            else ("pass a run folder, a step folder, a model.pt or an export")
        )
        raise ValueError(f"{file} is {what}: {advice}")
    return file, checkpoint


def _run_without_checkpoint(path: Path) -> bool:
    """A run folder (what `fastclip train` writes first: config.yaml, metrics.jsonl, checkpoints/) with no step
    folder yet, e.g. a run stopped before its first save."""
    markers = ("config.yaml", "metrics.jsonl", ckpt.CHECKPOINTS)
    if ckpt.read_pointer(path / ckpt.CHECKPOINTS):  # it saved one (`latest` names it): removed since, said as such
        return False
    return any((path / m).exists() for m in markers) and not ckpt.list_checkpoints(path / ckpt.CHECKPOINTS)


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
    image_only: bool = False  # an image tower alone (an ssl run, or its export): no text tower, no tokenizer
    data_train: str | None = None  # the data.train a training checkpoint records (an export records none)


def nonfinite_tensors(state: dict) -> list[str]:
    """The names of the floating tensors of `state` that hold NaN or Inf."""
    return [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]


def load_model(path: str | os.PathLike, *, arch: str | None = None, device="cpu", image_tower=False) -> LoadedModel:
    """Build the architecture and load the weights of a training checkpoint or an exported file. `image_tower`:
    an ssl run's image tower, or its export, is loaded alone (the probe's features); else it is refused."""
    file, checkpoint = load_checkpoint(path)
    return model_from_checkpoint(file, checkpoint, arch=arch, device=device, image_tower=image_tower)


def model_from_checkpoint(file: Path, checkpoint: dict, *, arch=None, device="cpu", image_tower=False) -> LoadedModel:
    """load_model's work on a file already read (export reads it once: a running job may prune the step after)."""
    from fastclip.models import build_model

    ssl = ckpt.is_ssl_checkpoint(checkpoint)
    if ssl and not image_tower:  # an image tower + projector (fastclip/models/ssl.py): no CLIP model to build
        raise ValueError(
            f"{file}: a self-supervised run (ssl.enabled) has no text tower for zero-shot or retrieval; its kNN "
            "accuracy is eval/knn_top1 in metrics.jsonl, `fastclip eval RUN --linear-probe --knn K` probes its image "
            "tower, and `fastclip export` writes it"
        )
    saved_arch, model_config = ckpt.architecture(checkpoint)
    given_arch = arch
    if arch is None and saved_arch is not None:
        arch = saved_arch
        if model_config is not None:
            # the checkpoint's config is the truth for custom archs: register it under the arch's name
            with tempfile.TemporaryDirectory() as tmp:
                config_file = Path(tmp) / f"{arch}.json"
                config_file.write_text(json.dumps(model_config))
                built = build_model(str(config_file), device=str(device))
        else:
            built = build_model(arch, device=str(device))
    else:
        built = build_model(arch or _exported_arch(file), device=str(device))
    state = ckpt.image_tower_state(checkpoint) if ssl else ckpt.towers_state(checkpoint)
    # an ssl export holds open_clip's model.visual alone (fastclip/eval/export_ssl.py)
    tower = ssl or set(state) == set(built.model.visual.state_dict())
    if tower and not image_tower:
        raise ValueError(
            f"{file}: an image tower alone (an ssl run's export) has no text tower for zero-shot or retrieval; pass "
            "--linear-probe or --knn K to probe it"
        )
    if tower:
        from fastclip.models.ssl import ImageTower

        built = dataclasses.replace(built, model=ImageTower(built.model.visual), tokenizer=None)
    # the loss owns the temperature; show it in the model too (it does not change eval rankings)
    scale = None if tower else ckpt.loss_logit_scale(checkpoint)
    if scale is not None and "logit_scale" in state:
        state["logit_scale"] = scale.detach().reshape(state["logit_scale"].shape).to(state["logit_scale"].dtype)
    target = built.model.visual if tower else built.model
    expected = target.state_dict()
    state = ckpt.fitted_to(expected, state)
    mismatch = ckpt.shape_mismatches(expected, state)
    if mismatch:  # checked first: load_state_dict's own error is a multi-line RuntimeError
        if given_arch is None:  # the architecture the file records (or its export's name): the file is at odds
            fix = " (the architecture the file itself names)"
        elif saved_arch is not None and saved_arch != given_arch:
            fix = f"; it was trained as {saved_arch!r}: drop --arch or pass --arch {saved_arch}"
        else:
            fix = "; pass the --arch it was trained with"
        raise ValueError(f"{file}: weights do not fit architecture {built.arch!r}: {mismatch}{fix}")
    if bad := nonfinite_tensors(state):  # a diverged run: every score would be chance, said as if it were one
        raise ValueError(
            f"{file}: its weights hold NaN/Inf in {len(bad)} tensor(s) (e.g. {', '.join(bad[:3])}): the run diverged "
            f"before this checkpoint, or the file is damaged; use an earlier one"
        )
    target.load_state_dict(state)
    built.model.eval()
    trained = ((checkpoint.get("config") or {}).get("data") or {}).get("train")
    return LoadedModel(
        built, file, ckpt.saved_step(checkpoint), image_only=tower, data_train=None if trained is None else str(trained)
    )
