"""OpenCLIP towers by architecture name, random init; nothing is downloaded.

An architecture is an open_clip name (`RN50`, `ViT-B-32`, ...), the name of a JSON file in the repo's
`configs/models/` (`tiny-vit`), or a path to such a JSON file. A config whose text_cfg has `hf_model_name` gets
open_clip's Hugging Face text tower (HFTextEncoder, random init from the folder's config.json) and its HFTokenizer
(from the tokenizer files there); the folder is named relative to the config file (`tiny-vit-hf`: a 2-layer BERT
in configs/models/hf/tiny-bert whose vocab.txt holds the special tokens, characters, `##` characters and the words
of our embedded and scenes captions). The model knows nothing about parallelism or
losses: the loss module owns the temperature, so the tower's own `logit_scale` is frozen by the trainer and
overwritten at export.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastclip.compat import import_open_clip

REPO_MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
# what open_clip needs of a model config (its registry skips a file without them)
CONFIG_KEYS = ("embed_dim", "vision_cfg", "text_cfg")


def open_clip_config(arch: str) -> dict | None:
    """open_clip's own config of `arch`, None if it has none. From its registry once open_clip is imported (with any
    config added at run time), else read as the registry would from its package's model_configs/: importing it
    costs 8-10 s of CPU, which `fastclip train --check` and the launcher's check need not pay."""
    module = sys.modules.get("open_clip")
    if module is not None:
        return module.get_model_config(arch) if arch in module.list_models() else None
    spec = importlib.util.find_spec("open_clip")
    for location in spec.submodule_search_locations if spec else ():
        path = Path(location) / "model_configs" / f"{arch}.json"
        if path.is_file():
            with open(path) as f:
                config = json.load(f)
            return config if all(key in config for key in CONFIG_KEYS) else None
    return None


def find_arch(arch: str) -> tuple[str, Path | None, dict]:
    """(open_clip name, our config file or None for one of open_clip's, the config) without importing open_clip;
    a Hugging Face text tower's folders in our config are resolved against the config file's folder.

    Raises FileNotFoundError for a .json path that is not a file (or a tower folder not found), ValueError for a
    name known nowhere."""
    if arch.endswith(".json"):
        path = Path(arch)
        if not path.is_file():
            raise FileNotFoundError(f"model config file not found: {arch}")
    elif (config := open_clip_config(arch)) is not None:  # open_clip's names come first
        return arch, None, config
    elif (REPO_MODEL_CONFIGS / f"{arch}.json").is_file():
        path = REPO_MODEL_CONFIGS / f"{arch}.json"
    else:
        raise ValueError(
            f"unknown model architecture {arch!r}: not an open_clip model, not in {REPO_MODEL_CONFIGS}, "
            f"not a .json path (open_clip has e.g. RN50, ViT-B-32, ViT-B-16)"
        )
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict) or not isinstance(config.get("text_cfg", {}), dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not a model config object")
    return path.stem, path, resolve_hf_folders(config, path) if names_hf_folders(config) else config


def resolve_arch(arch: str) -> tuple[str, dict | None]:
    """Return (open_clip name, config dict or None for built-ins), registering custom configs with open_clip."""
    name, path, config = find_arch(arch)
    if path is None:
        return name, None
    open_clip = import_open_clip()
    if not names_hf_folders(config):
        open_clip.add_model_config(str(path))
        return path.stem, config
    # a Hugging Face text tower: open_clip takes its folders as given, so it is registered as find_arch resolved it
    # (it then builds from any working directory), never from the file
    with tempfile.TemporaryDirectory() as tmp:
        resolved = Path(tmp) / path.name
        resolved.write_text(json.dumps(config))
        open_clip.add_model_config(str(resolved))  # read now; a later rescan skips the vanished file
    return path.stem, config


HF_FOLDER_KEYS = ("hf_model_name", "hf_tokenizer_name")


def names_hf_folders(config: dict) -> bool:
    """Whether the config's text tower is a Hugging Face one named by folder or hub id."""
    return any(key in config.get("text_cfg", {}) for key in HF_FOLDER_KEYS)


def resolve_hf_folders(config: dict, config_file: Path) -> dict:
    """A copy of `config` whose text_cfg.hf_model_name / hf_tokenizer_name are absolute folder paths.

    A relative name is taken from the config file's folder; an absolute one that no longer exists (an export
    moved elsewhere) is looked for by its last part beside the config file. Hub ids are refused: the text tower
    is built from its folder's config.json with random weights and the tokenizer from the files there, and
    nothing is downloaded."""
    config = json.loads(json.dumps(config))
    text = config["text_cfg"]
    for key in HF_FOLDER_KEYS:
        name = text.get(key)
        if not name:
            continue
        given = Path(name)
        candidates = [given, config_file.parent / given.name] if given.is_absolute() else [config_file.parent / given]
        found = next(
            (c for c in candidates if (c / "config.json").is_file() or (c / "tokenizer_config.json").is_file()), None
        )
        if found is None:
            raise FileNotFoundError(
                f"model config {config_file}: text_cfg.{key} {name!r} is not a folder with config.json / "
                f"tokenizer files (looked in {', '.join(str(c) for c in candidates)}); Hugging Face text towers are "
                f"built from a local folder, nothing is downloaded"
            )
        text[key] = str(found.resolve())
    # the folders are local: transformers must not ask the hub about them either
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return config


def hub_names_not_cached(config: dict) -> list[str]:
    """The Hugging Face hub ids a config's text tower needs (text_cfg.hf_model_name / hf_tokenizer_name that are not
    local folders: open_clip's built-in roberta-ViT-B-32, xlm-roberta-*, mt5-*, nllb-clip-*) whose config.json is not
    in the local hub cache. open_clip would download them when the tower is built; fastclip downloads nothing, and
    a machine without network fails there after a long wait."""
    from huggingface_hub import try_to_load_from_cache

    text = config.get("text_cfg", {})
    names = sorted({text[key] for key in HF_FOLDER_KEYS if text.get(key) and not Path(text[key]).is_dir()})
    return [n for n in names if not isinstance(try_to_load_from_cache(n, "config.json"), str)]


def hf_folder_copies(config: dict, dest: Path) -> list[tuple[Path, Path]]:
    """(source, copy) of each local Hugging Face folder a config names, copied into `dest` by copy_hf_folders: what
    an export will write, to be checked before anything is written. Two folders of the same name (a/tok, b/tok)
    get two copies (tok, tok-2)."""
    text = config.get("text_cfg", {})
    sources = [Path(name) for name in sorted({text[key] for key in HF_FOLDER_KEYS if text.get(key)})]
    for source in sources:
        if not source.is_dir():
            raise FileNotFoundError(
                f"model config: text_cfg folder {str(source)!r} (Hugging Face text tower) does not exist"
            )
    # a folder already at dest/<its name> keeps that name (never overwritten by another folder's copy)
    taken = {s.name: s.resolve() for s in sources if (dest / s.name).resolve() == s.resolve()}
    pairs = []
    for source in sources:
        copy_name, n = source.name, 1
        while taken.setdefault(copy_name, source.resolve()) != source.resolve():
            n += 1
            copy_name = f"{source.name}-{n}"
        pairs.append((source, dest / copy_name))
    return pairs


def copy_hf_folder(source: Path, target: Path) -> None:
    """The files of one Hugging Face folder (config.json, tokenizer files) into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file():
            shutil.copyfile(file, target / file.name)


def with_hf_folders(config: dict, folders: dict[Path, Path]) -> dict:
    """A copy of `config` whose text_cfg folder keys name `folders[source]` (absolute) instead of each source."""
    config = json.loads(json.dumps(config))
    for key in HF_FOLDER_KEYS:
        if config.get("text_cfg", {}).get(key) and Path(config["text_cfg"][key]) in folders:
            config["text_cfg"][key] = str(folders[Path(config["text_cfg"][key])].resolve())
    return config


def copy_hf_folders(config: dict, dest: Path) -> dict:
    """For an export: copy the local Hugging Face folders a config names (text tower config, tokenizer files)
    into `dest` and return the config naming the copies by absolute path (what open_clip needs to build it;
    if the export is moved, fastclip finds the folder beside the moved config). Other configs come back as is."""
    pairs = hf_folder_copies(config, dest)
    if not pairs:
        return config
    for source, target in pairs:
        if target.resolve() != source.resolve():  # exported next to the folder itself: nothing to copy
            copy_hf_folder(source, target)
    return with_hf_folders(config, dict(pairs))


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
        with warnings.catch_warnings():
            # open_clip applies color_jitter(_prob) and gray_scale_prob but still lists them as "unused" (it only
            # drops `scale` from its list); the keys it would really leave unused are refused in the config
            warnings.filterwarnings("ignore", message="Unused augmentation cfg items")
            model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
                # pretrained_text=False: a Hugging Face text tower starts from its config with random weights too
                name,
                pretrained=None,
                pretrained_text=False,
                precision=precision,
                device=device,
                **overrides,
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


__all__ = [
    "build_model",
    "resolve_arch",
    "copy_hf_folder",
    "copy_hf_folders",
    "hf_folder_copies",
    "resolve_hf_folders",
    "with_hf_folders",
    "BuiltModel",
    "image_size",
    "REPO_MODEL_CONFIGS",
]
