"""`fastclip export` of a self-supervised run (ssl.enabled): its image tower alone, as open_clip's `model.visual`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fastclip.checkpoint import files
from fastclip.checkpoint.records import architecture, image_tower_state, saved_step


def export_image_tower(file: Path, checkpoint: dict, out: Path, dtype: torch.dtype) -> dict:
    """`fastclip export` of an ssl run: ``{"state_dict": <open_clip model.visual's tensors>}`` (and ``<arch>.json``
    beside it for a custom architecture), checked to load strictly into the architecture's image tower first."""
    from fastclip.models import build_model

    arch, model_config = architecture(checkpoint)
    state = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().clone()
        for k, v in image_tower_state(checkpoint).items()
    }
    config_file = None
    if model_config is not None and arch is not None and not _builtin(arch):
        config_file = out.parent / f"{arch}.json"
    try:
        visual = build_model(arch).model.visual
        visual.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        first = str(e).strip().splitlines()[0][:300]
        raise ValueError(f"{file}: its image tower does not load into {arch!r}'s ({first}); nothing written") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = out.with_name(f".{out.name}.partial")
    files.save_file({"state_dict": state}, staged)
    if config_file is not None:
        files.write_text_atomic(config_file, json.dumps(model_config, indent=4) + "\n")
    staged.replace(out)
    return {"file": out, "arch": arch, "config_file": config_file, "source": file, "step": saved_step(checkpoint)}


def _builtin(arch: str) -> bool:
    from fastclip.compat import import_open_clip
    from fastclip.models import REPO_MODEL_CONFIGS

    return not (REPO_MODEL_CONFIGS / f"{arch}.json").is_file() and arch in import_open_clip().list_models()


def tower_loading_code(written: dict) -> str:
    """The python lines that load an ssl export as open_clip's image tower."""
    lines = [  # as export.loading_code: pasted as printed it runs where fastclip is installed
        "import torch",
        "from fastclip.compat import import_open_clip; open_clip = import_open_clip()  # elsewhere: import open_clip",
    ]
    if written["config_file"] is not None:
        lines.append(f"open_clip.add_model_config({str(Path(written['config_file']).resolve())!r})")
    lines += [
        f"visual = open_clip.create_model({written['arch']!r}).visual",
        f"visual.load_state_dict(torch.load({str(Path(written['file']).resolve())!r}, weights_only=True)"
        '["state_dict"])',
    ]
    return "\n".join(lines)
