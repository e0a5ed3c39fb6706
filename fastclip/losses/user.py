"""A loss of the user's own, named ``module:attribute``: the ``LossEntry`` that module defines, imported and checked
once (``loss_entry`` in __init__.py calls ``import_entry``). Whatever is wrong (the module, its import, the
attribute, the entry's classes, an option named as a trainer key but typed otherwise) is an UnknownLossError
naming it, with the line of the user's file where the import failed."""

from __future__ import annotations

import dataclasses
import importlib
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
        raise UnknownLossError(f"loss {name!r}: importing {module_name!r} failed: {_said(e)}") from None
    except (Exception, SystemExit) as e:  # the user's module failed (or exited): where, in one line
        raise UnknownLossError(f"loss {name!r}: importing {module_name!r} failed: {_said(e)}") from None
    try:
        entry = getattr(module, attribute)
    except AttributeError:
        raise UnknownLossError(
            f"loss {name!r}: module {module_name!r} ({module.__file__}) has no {attribute!r}"
        ) from None
    except Exception as e:  # (a module-level __getattr__ of the user's that raised)
        raise UnknownLossError(f"loss {name!r}: reading {attribute!r} of {module_name!r} failed: {_said(e)}") from None
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
            raise UnknownLossError(f"loss {name!r}: {impl!r} is not a fastclip.losses.ContrastiveLoss subclass")
    if entry.fused is None and entry.autograd is None:
        raise UnknownLossError(f"loss {name!r}: its LossEntry names no implementation (autograd=YourLoss)")
    _check_key_types(name, options)
    return entry


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
        if field.name in keys and field.metadata.get("config_key", True):
            given, key = hints.get(field.name), keys[field.name]
            if given not in (key, key | None):
                raise UnknownLossError(
                    f"loss {name!r}: option {field.name!r} of {options.__name__} is {given}, but the trainer's "
                    f"loss.{field.name} is {key}: give it that type (the same meaning), or another name"
                )


def _said(error: BaseException) -> str:
    """``Type: message (file:line)``, the line the last frame of the user's code (not the standard library's, nor
    the import machinery's) was at."""
    frames = traceback.extract_tb(error.__traceback__)
    library = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")}
    own = [f for f in frames if not f.filename.startswith("<") and not _under(Path(f.filename), library)]
    frame = (own or frames or [None])[-1]
    where = f" ({frame.filename}:{frame.lineno})" if frame is not None else ""
    if isinstance(error, SyntaxError) and error.filename:
        where = f" ({error.filename}:{error.lineno})"
    said = f"{type(error).__name__}: {error}" if not isinstance(error, SystemExit) else f"it exited ({error.code})"
    return said + where


def _under(path: Path, roots: set[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(root) and "site-packages" not in resolved.parts for root in roots)


__all__ = ["import_entry"]
