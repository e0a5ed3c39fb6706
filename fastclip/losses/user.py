"""A loss of the user's own, named ``module:attribute``: the ``LossEntry`` that module defines, imported and checked
once (``loss_entry`` in __init__.py calls ``import_entry``). Whatever is wrong (the module, its import, the
attribute, the entry's classes, an option named as a trainer key but typed otherwise) is an UnknownLossError
naming it, with the line of the user's file where the import failed."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sysconfig
import traceback
import typing
from pathlib import Path


def import_entry(name: str):
    from . import ContrastiveLoss, LossEntry, UnknownLossError
    from .options import CommonOptions

    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name + ".").startswith(e.name + "."):  # it, or its package, is missing
            raise UnknownLossError(
                f"loss {name!r}: no module {e.name!r} on the Python path; put its folder on PYTHONPATH"
            ) from None
        raise UnknownLossError(f"loss {name!r}: importing {module_name!r} failed: {_said(e, module_name)}") from None
    except (Exception, SystemExit) as e:  # the user's module failed (or exited): where, in one line
        raise UnknownLossError(f"loss {name!r}: importing {module_name!r} failed: {_said(e, module_name)}") from None
    try:
        entry = getattr(module, attribute)
    except AttributeError:
        raise UnknownLossError(
            f"loss {name!r}: module {module_name!r} ({module.__file__}) has no {attribute!r}"
        ) from None
    except Exception as e:  # (a module-level __getattr__ of the user's that raised)
        said = _said(e, module_name)
        raise UnknownLossError(f"loss {name!r}: reading {attribute!r} of {module_name!r} failed: {said}") from None
    if not isinstance(entry, LossEntry):
        what = f"the class {entry.__name__}" if isinstance(entry, type) else f"a {type(entry).__name__}"
        raise UnknownLossError(
            f"loss {name!r} is {what}, not a fastclip.losses.LossEntry (LossEntry(options=YourOptions, "
            "autograd=YourLoss))"
        )
    options = entry.options
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        got = f"an instance of {type(options).__name__}" if dataclasses.is_dataclass(options) else repr(options)[:80]
        raise UnknownLossError(f"loss {name!r}: its options must be a dataclass class (options=YourOptions), got {got}")
    if not issubclass(options, CommonOptions):
        raise UnknownLossError(
            f"loss {name!r}: its options {options.__name__} must derive from a fastclip.losses.options class "
            "(CommonOptions, InfoNCEOptions, SampleStateOptions, ...)"
        )
    for impl in (entry.fused, entry.autograd):
        if impl is not None and not (isinstance(impl, type) and issubclass(impl, ContrastiveLoss)):
            got = impl.__name__ if isinstance(impl, type) else f"an instance of {type(impl).__name__}"
            raise UnknownLossError(
                f"loss {name!r}: its implementation must be a fastclip.losses.ContrastiveLoss subclass "
                f"(autograd=YourLoss), got {got}"
            )
    if entry.fused is None and entry.autograd is None:
        raise UnknownLossError(f"loss {name!r}: its LossEntry names no implementation (autograd=YourLoss)")
    _check_key_types(name, options)
    return entry


# keys of the trainer's loss section that are no option of any loss
RESERVED = {"name": "it names the loss", "extra_options": "it holds the options of a loss of your own"}


def _check_key_types(name: str, options: type) -> None:
    """An option named as a trainer key (loss.<name>) is set through that key, so it must take the key's type: a
    `bias: bool` beside the library's `bias: float` could be set neither as loss.bias nor as an extra option."""
    from . import UnknownLossError, config_options

    keys = config_options()
    try:
        hints = typing.get_type_hints(options)
    except Exception:  # (annotations that do not resolve: the dataclass checks its values itself)
        return
    for field in dataclasses.fields(options):
        if field.name in RESERVED:
            raise UnknownLossError(
                f"loss {name!r}: option {field.name!r} of {options.__name__}: loss.{field.name} is the trainer's own "
                f"key ({RESERVED[field.name]}); give the option another name"
            )
        if field.name in keys and field.metadata.get("config_key", True):
            given, key = hints.get(field.name), keys[field.name]
            if given is not None and _optional(given) != _optional(key):  # (the trainer passes no null)
                raise UnknownLossError(
                    f"loss {name!r}: option {field.name!r} of {options.__name__} is {given}, but the trainer's "
                    f"loss.{field.name} is {key}: give it that type (the same meaning), or another name"
                )


def _optional(hint):
    """``hint | None`` (an int option is set through an ``int | None`` key: the trainer passes no null)."""
    try:
        return hint | None
    except TypeError:  # (a hint that makes no union: compared as it is)
        return hint


def _said(error: BaseException, module_name: str) -> str:
    """``Type: message (file:line)``, at the last frame in the user's own module or package; else at the last frame
    outside the installed packages, the standard library and fastclip; else at the last."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<")]
    root = source_root(module_name)
    mine = [f for f in frames if root is not None and _within(Path(f.filename), {root})]
    outside = [f for f in frames if not _within(Path(f.filename), installed_roots())]
    frame = (mine or outside or frames or [None])[-1]
    where = f" ({frame.filename}:{frame.lineno})" if frame is not None else ""
    if isinstance(error, SyntaxError) and error.filename:
        where = f" ({error.filename}:{error.lineno})"
    said = f"{type(error).__name__}: {error}" if not isinstance(error, SystemExit) else f"it exited ({error.code})"
    return said + where


def source_root(module_name: str) -> Path | None:
    """The user's code a ``module:attribute`` name comes from: its top-level package's folder, or the module's file
    (None where it cannot be found)."""
    top = module_name.partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(spec.origin).resolve() if spec.origin else None


def installed_roots() -> set[Path]:
    """Where code that is not the user's lives: the standard library, the installed packages, fastclip."""
    paths = sysconfig.get_paths()
    roots = {Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return roots | {Path(__file__).resolve().parents[1]}


def _within(path: Path, roots: set[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved == root or resolved.is_relative_to(root) for root in roots)


__all__ = ["import_entry", "installed_roots", "source_root"]
