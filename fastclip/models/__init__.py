"""OpenCLIP towers by architecture name, random init; nothing is downloaded.

An architecture is an open_clip name (`RN50`, `ViT-B-32`, ...), the name of a JSON file in the repo's
`configs/models/` (`tiny-vit`), or a path to such a JSON file. The model knows nothing about parallelism or
losses: the loss module owns the temperature, so the tower's own `logit_scale` is frozen by the trainer and
overwritten at export.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fastclip.compat import import_open_clip

REPO_MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


def resolve_arch(arch: str) -> tuple[str, dict | None]:
    """Return (open_clip name, config dict or None for built-ins), registering custom configs with open_clip."""
    open_clip = import_open_clip()
    path = None
    if arch.endswith(".json"):
        path = Path(arch)
        if not path.is_file():
            raise FileNotFoundError(f"model config file not found: {arch}")
    elif arch not in open_clip.list_models():
        candidate = REPO_MODEL_CONFIGS / f"{arch}.json"
        if candidate.is_file():
            path = candidate
        else:
            raise ValueError(
                f"unknown model architecture {arch!r}: not an open_clip model, not in {REPO_MODEL_CONFIGS}, "
                f"not a .json path (open_clip has e.g. RN50, ViT-B-32, ViT-B-16)"
            )
    if path is None:
        return arch, None
    open_clip.add_model_config(str(path))
    with open(path) as f:
        return path.stem, json.load(f)


@dataclass
class BuiltModel:
    model: Any
    arch: str
    config: dict  # the open_clip model config, written beside exports so open_clip can rebuild custom archs
    preprocess_train: Callable
    preprocess_val: Callable
    tokenizer: Callable


class _RandomInitNotice(logging.Filter):
    """Drops open_clip's "No pretrained weights loaded ... initialized randomly" warning: random init is what
    pretraining starts from (the trainer says so once in its first line), not something to warn about."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No pretrained weights loaded")


def build_model(arch: str, *, precision: str = "fp32", device: str = "cpu", **overrides) -> BuiltModel:
    open_clip = import_open_clip()
    name, config = resolve_arch(arch)
    notice, root = _RandomInitNotice(), logging.getLogger()  # open_clip logs on the root logger
    root.addFilter(notice)
    try:
        model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
            name, pretrained=None, precision=precision, device=device, **overrides
        )
    finally:
        root.removeFilter(notice)
    if config is None:
        config = open_clip.get_model_config(name)
    tokenizer = open_clip.get_tokenizer(name)
    return BuiltModel(model, name, config, preprocess_train, preprocess_val, tokenizer)


def image_size(model) -> int:
    size = model.visual.image_size
    return size[0] if isinstance(size, (tuple, list)) else int(size)


__all__ = ["build_model", "resolve_arch", "BuiltModel", "image_size", "REPO_MODEL_CONFIGS"]
