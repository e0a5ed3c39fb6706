"""Class names and prompt templates for zero-shot classification.

Accepted files:
  zeroshot.json (written by `fastclip data embedded`):
      {"datasets": {"fashion-mnist": {"classnames": [...], "templates": ["a photo of a {}.", ...]}, ...}}
  a single-dataset JSON:  {"classnames": [...], "templates": [...]}  (named by "name", else the file stem)
  a classnames .txt (one class per line) plus a templates .txt (one template per line) or JSON list.
Templates use "{}" for the class name; clip_benchmark's "{c}" is accepted too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TEMPLATES = ("a photo of a {}.",)


@dataclass(frozen=True)
class ZeroShotSpec:
    name: str
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    # Classes scored through other classes' prompts (ObjectNet's through ImageNet's): the names prompted, and per
    # class the indices of those whose prediction counts as it. None: each class is prompted by its own name.
    prompted: tuple[str, ...] | None = None
    pool: tuple[tuple[int, ...], ...] | None = None

    @property
    def prompted_names(self) -> tuple[str, ...]:
        return self.classnames if self.prompted is None else self.prompted

    def prompts(self, classname: str) -> list[str]:
        return [t.replace("{c}", "{}").format(classname) for t in self.templates]


def _checked(name: str, classnames, templates, where: str) -> ZeroShotSpec:
    if not isinstance(classnames, list) or not classnames or not all(isinstance(c, str) for c in classnames):
        raise ValueError(f"{where}: 'classnames' must be a non-empty list of strings")
    if not isinstance(templates, (list, tuple)) or not templates:
        raise ValueError(f"{where}: 'templates' must be a non-empty list of strings")
    _check_templates(templates, where)
    if len(set(classnames)) != len(classnames):
        raise ValueError(f"{where}: duplicate class names")
    return ZeroShotSpec(name, tuple(classnames), tuple(templates))


_NAME = "\x00class name\x00"  # what a template is checked with: no template holds it


def _check_templates(templates: list, where: str) -> None:
    for i, template in enumerate(templates):
        if not isinstance(template, str) or ("{}" not in template and "{c}" not in template):
            raise ValueError(f"{where}: template {i} ({template!r}) has no '{{}}' placeholder for the class name")
        try:  # filled as ZeroShotSpec.prompts fills it: "{style}", a second "{}" or a lone "}" failed only there
            filled = template.replace("{c}", "{}").format(_NAME)
        except Exception as error:  # (KeyError, IndexError, ValueError; AttributeError, TypeError for "{.x}", "{[0]}")
            why = f"field {error}" if isinstance(error, KeyError) else str(error)
            raise ValueError(
                f"{where}: template {i} ({template!r}) cannot take the class name ({why}); write '{{}}' (or "
                "'{c}') once for the name and double a literal brace ('{{' or '}}')"
            ) from None
        if _NAME not in filled:  # "{{}}" is a literal "{}": every class would get the same prompt
            raise ValueError(
                f"{where}: template {i} ({template!r}) leaves the class name out (a doubled brace is a literal "
                "one); write '{}' (or '{c}') for the name"
            )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8") from None
    except FileNotFoundError:
        raise
    except OSError as error:  # a folder, no permission
        raise ValueError(f"{path}: cannot read it ({error.strerror})") from None


def _read_json(path: Path):
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: invalid JSON ({error})") from None


def _read_lines(path: Path) -> list[str]:
    return [line.strip() for line in _read_text(path).splitlines() if line.strip()]


def load_templates(path: str | os.PathLike) -> list[str]:
    """A --templates file, checked here so that an error names it (an empty one fell back to the class names'
    own templates, silently)."""
    path = Path(path)
    if path.suffix == ".json":
        templates = _read_json(path)
        if not isinstance(templates, list):
            raise ValueError(f"{path}: expected a JSON list of templates")
    else:
        templates = _read_lines(path)
    if not templates:
        raise ValueError(f"{path}: no templates in it; one per line (or a JSON list), each with '{{}}' for the name")
    _check_templates(templates, str(path))
    return templates


# read line by line these would pass as class names (a one-column .csv/.tsv list reads as names: kept)
NOT_A_CLASS_LIST = {".yaml", ".yml", ".jsonl", ".tar", ".pt", ".pth", ".npy", ".npz", ".parquet", ".py"}


def load_zeroshot_spec(path: str | os.PathLike, templates: str | os.PathLike | None = None) -> dict[str, ZeroShotSpec]:
    """Dataset name -> spec, from any of the accepted files (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"zero-shot class names: {path} is a folder; pass the file (zeroshot.json, a .txt list)")
    if not path.is_file():
        raise FileNotFoundError(f"zero-shot class names file not found: {path}")
    if path.suffix.lower() in NOT_A_CLASS_LIST:
        raise ValueError(
            f"zero-shot class names: {path} is a {path.suffix} file; pass a zeroshot.json or a .txt list (one class "
            f"name per line)"
        )
    template_list = load_templates(templates) if templates else None
    if path.suffix != ".json":
        classnames = _read_lines(path)
        return {path.stem: _checked(path.stem, classnames, template_list or list(DEFAULT_TEMPLATES), str(path))}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with 'datasets' or 'classnames'")
    if "datasets" in data:
        if not isinstance(data["datasets"], dict) or not data["datasets"]:
            raise ValueError(f"{path}: 'datasets' must be a non-empty object of name -> {{classnames, templates}}")
        return {
            name: _checked(
                name,
                entry.get("classnames") if isinstance(entry, dict) else None,
                template_list or (entry.get("templates") if isinstance(entry, dict) else None),
                f"{path}: datasets.{name}",
            )
            for name, entry in data["datasets"].items()
        }
    if "classnames" in data:
        name = data.get("name", path.stem)
        return {name: _checked(name, data["classnames"], template_list or data.get("templates"), str(path))}
    raise ValueError(f"{path}: expected a 'datasets' or a 'classnames' field, found {sorted(data)}")


def spec_from_class_folders(name: str, folders: list[str], templates=None) -> dict[str, ZeroShotSpec]:
    """An image folder without a names file: the class folder names are the class names ('_' read as ' ')."""
    classnames = [folder.replace("_", " ") for folder in folders]
    return {name: _checked(name, classnames, list(templates or DEFAULT_TEMPLATES), f"image folder {name}")}
