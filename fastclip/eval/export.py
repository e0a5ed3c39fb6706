"""`fastclip export CKPT --out PATH [--precision fp32|bf16]`: a model-only file that open_clip loads.

The file is `{"state_dict": {name: tensor}}`, nothing else, so `open_clip.create_model_and_transforms(arch,
pretrained=PATH)` loads it under `torch.load(weights_only=True)` (DataComp and clip_benchmark load models
that way). The loss owns the temperature during training, so its learned `logit_scale` (and a sigmoid loss's
`logit_bias`) replaces the tower's frozen one. Custom architectures get their config written beside the file as
`<arch>.json`; so does a built-in one given a logit_bias its open_clip config lacks (`init_logit_bias`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import stat
import sys
import tempfile
from pathlib import Path

import torch

from fastclip import checkpoint as ckpt
from fastclip.cli import OneLineParser, unwritable
from fastclip.errors import CheckpointError
from fastclip.eval.checkpoint import load_checkpoint
from fastclip.stopping import Stopped, signals_deferred, stopped_by_signals

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _is_builtin(arch: str, model_config: dict | None) -> bool:
    """A config shipped inside open_clip and equal to the one trained: nothing needs writing beside the file.
    (The registry itself cannot tell: configs added at run time, ours included, show up in list_models().)"""
    from fastclip.compat import import_open_clip

    open_clip = import_open_clip()
    shipped = Path(open_clip.__file__).parent / "model_configs" / f"{arch}.json"
    if not shipped.is_file():
        return False
    with open(shipped) as f:
        return model_config is None or json.load(f) == model_config


def _check_arch_field(file: Path, checkpoint: dict, arch: str, model_config: dict | None) -> None:
    """The export is named by the checkpoint's `arch` field; it must be the architecture the run trained (its
    config's model.arch) and, for an open_clip name, that name's shipped config: else the export would register
    one architecture's config under another's name (a built-in one shadowed), and load without a word."""
    trained = ((checkpoint.get("config") or {}).get("model") or {}).get("arch")
    if isinstance(trained, str) and Path(trained.removesuffix(".json")).name != arch:
        raise ValueError(
            f"{file}: its arch field says {arch!r} but the run trained {trained!r} (its config's model.arch): the "
            f"file was edited or mixed up; export the checkpoint as written by fastclip train"
        )
    if not _is_builtin(arch, model_config) and _is_builtin(arch, None):
        raise ValueError(
            f"{file}: its arch field says {arch!r}, open_clip's built-in architecture, but its model_config is "
            f"another one: the file was edited or mixed up; export the checkpoint as written by fastclip train"
        )


def _refuse_checkpoint_out(out: Path, source: Path) -> None:
    """An --out on the source or inside a step or checkpoints folder would replace (or sit among) training files:
    the export is smaller and has no optimizer, so a later resume from that folder would be refused."""
    refuse = "refusing to overwrite a training checkpoint: choose another --out"
    if out.resolve() == source.resolve() or (out.exists() and os.path.samefile(out, source)):
        raise ValueError(f"--out {out} is the checkpoint being exported; {refuse}")
    folder = out.resolve().parent
    if not folder.is_dir():
        return
    if any(folder.glob(ckpt.RANK_FILES)) or ((folder / ckpt.MODEL_FILE).is_file() and _is_training(folder)):
        raise ValueError(f"--out {out} is in the step folder {folder} of a training run; {refuse}")
    if (folder / ckpt.LATEST).is_file() and ckpt.list_checkpoints(folder):
        raise ValueError(f"--out {out} is in the checkpoints folder {folder} of a training run; {refuse}")


def _kind(path: Path) -> str | None:
    """What stands at `path` when it is not a regular file (None when it is one or nothing is there)."""
    if path.is_file() or not os.path.lexists(path):
        return None
    if path.is_symlink() and not path.exists():
        return "a broken symbolic link"
    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "a device")


def _check_out(out: Path) -> None:
    """Refuse, before anything is written, an --out that would replace something other than an earlier export
    (os.replace swaps even a device node for a regular file) or that cannot be written at all."""
    if out.suffix != ".pt":
        raise ValueError(f"--out {out}: does not end in .pt; name the .pt file to write")
    what = _kind(out)
    if what:
        raise ValueError(f"--out {out}: exists and is {what}, not a regular file; name the .pt file to write")
    if problem := unwritable("--out", out):  # (the export creates the folders below the nearest that exists)
        raise ValueError(problem)


def _check_beside(out: Path, files: list[Path]) -> None:
    """The files written beside the export may not replace a device, fifo or folder either."""
    for file in files:
        what = _kind(file)
        if what:
            raise ValueError(
                f"--out {out}: {file}, written beside it, exists and is {what}, not a regular file; "
                f"choose another --out folder"
            )


def _check_hf_copies(out: Path, copies: list[tuple[Path, Path]]) -> None:
    """Each Hugging Face folder copied beside the export must land in a folder (or a new one), its files replacing
    regular files only."""
    for source, copy in copies:
        if os.path.lexists(copy) and not copy.is_dir():
            raise ValueError(
                f"--out {out}: {copy}, the copy of the text tower's folder {source} written beside it, exists and is "
                f"not a folder; choose another --out folder"
            )
        _check_beside(out, [copy / f.name for f in source.iterdir() if f.is_file()])


def _is_training(folder: Path) -> bool:
    try:
        return ckpt.is_training_checkpoint(ckpt.load_file(folder / ckpt.MODEL_FILE))
    except CheckpointError:  # unreadable: not a training checkpoint to protect
        return False


def export_model(
    checkpoint_path, out: str | os.PathLike, precision: str = "fp32", momentum_towers: bool = False
) -> dict:
    """Write the model-only file (and `<arch>.json` if needed); return what was written. ``momentum_towers``: the
    EMA copy of the towers (model.ema_momentum) instead of the trained ones."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    from fastclip.eval.checkpoint import model_from_checkpoint
    from fastclip.models import hf_folder_copies

    out = Path(out)
    file, checkpoint = _training_checkpoint(checkpoint_path, out)
    if ckpt.is_ssl_checkpoint(checkpoint):  # images alone: the image tower is the model (fastclip/eval/export_ssl.py)
        if momentum_towers:
            raise ValueError(f"{file}: an ssl run has no momentum towers; export without --momentum-towers")
        from fastclip.eval.export_ssl import export_image_tower

        return export_image_tower(file, checkpoint, out, PRECISIONS[precision])
    arch, model_config = ckpt.architecture(checkpoint)
    _check_arch_field(file, checkpoint, arch, model_config)
    # the tensors fit the architecture they claim, all finite (a one-line ValueError otherwise); from the contents
    # read once: a running job's keep_last may remove the file meanwhile
    model_from_checkpoint(file, checkpoint)
    bias = ckpt.loss_logit_bias(checkpoint)
    state, scale = _exported_state(file, checkpoint, momentum_towers, PRECISIONS[precision], bias)
    if bias is not None and model_config.get("init_logit_bias") is None:  # a tower without one: open_clip's CLIP
        model_config = {**model_config, "init_logit_bias": float(bias)}  # makes its logit_bias from this key

    # fastclip-tempnet: its temperature heads belong to training, not to the CLIP model open_clip loads, so
    # they are written beside the export (weights only) for whoever continues training from it
    heads = {k: v.detach().clone() for k, v in ckpt.loss_parameters(checkpoint).items() if k.startswith("tempnet_")}
    tempnet_file = out.with_name(out.stem + ".tempnet.pt") if heads else None
    custom = not _is_builtin(arch, None)  # (a built-in one given a bias its open_clip config lacks is written too)
    config_file = None if _is_builtin(arch, model_config) else out.parent / f"{arch}.json"
    # a Hugging Face text tower's folders (its config.json, tokenizer files) go beside the export too
    hf_copies = hf_folder_copies(model_config, out.parent) if config_file is not None else []
    _check_beside(out, [f for f in (tempnet_file, config_file) if f is not None])
    _check_hf_copies(out, hf_copies)
    _write_verified(out, arch, model_config, state, heads, tempnet_file, config_file, hf_copies)
    return {
        "file": out,
        "arch": arch,
        "config_file": config_file,
        "custom_arch": custom,
        "tempnet_file": tempnet_file,
        "logit_scale": float(state["logit_scale"]) if "logit_scale" in state else None,  # as written (bf16: rounded)
        "loss_logit_scale": float(scale) if scale is not None else None,  # as the loss learned it
        "loss_logit_bias": float(bias) if bias is not None else None,  # a sigmoid loss's (SigLIP)
        "temperature_from_loss": scale is not None,
        "step": ckpt.saved_step(checkpoint),
        "source": file,
    }


def _training_checkpoint(checkpoint_path, out: Path) -> tuple[Path, dict]:
    """(file, contents) of the checkpoint to export, once `out` is known not to replace training files."""
    file, checkpoint = load_checkpoint(checkpoint_path)
    _refuse_checkpoint_out(out, file)
    _check_out(out)
    for key in ("arch", "model_config"):
        if key not in checkpoint:
            raise ValueError(
                f"{file}: not a fastclip training checkpoint (no {key!r}: an export, or a bare state dict); pass a "
                f"run, step folder or model.pt that fastclip train wrote"
            )
    return file, checkpoint


def _exported_state(file: Path, checkpoint: dict, momentum_towers: bool, dtype: torch.dtype, bias=None):
    """(the towers' tensors in `dtype` with the loss's learned logit_scale and `bias` (its logit_bias, or None),
    that logit_scale or None)."""
    state = ckpt.towers_state(checkpoint)
    if momentum_towers:
        if "momentum_towers" not in checkpoint:
            raise ValueError(
                f"{file}: no momentum towers (the run did not set model.ema_momentum); export without --momentum-towers"
            )
        state = dict(checkpoint["momentum_towers"])
    scale = ckpt.loss_logit_scale(checkpoint)
    if scale is not None:
        if "logit_scale" not in state:
            raise ValueError(f"{file}: the loss has a logit_scale but the model state_dict has none to receive it")
        state["logit_scale"] = scale.detach().reshape(state["logit_scale"].shape)
    # SigLIP's learned bias goes with its scale (the tower's own, if it has one, is its frozen initial value)
    if bias is not None:
        state["logit_bias"] = bias.detach().reshape([])
    # clone: a tensor that is a view of a larger storage would otherwise save the whole storage
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().clone().contiguous() for k, v in state.items()}
    return state, scale


def _write_verified(out, arch, model_config, state, heads, tempnet_file, config_file, hf_copies) -> None:
    """Everything is written into a staging folder beside --out and verified there; only then does it take the final
    names, so a failure (a full disk, a tower open_clip builds otherwise) leaves an earlier export as it was."""
    from fastclip.models import copy_hf_folder

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=".fastclip-export-"))
    committed = False
    try:  # (through an open file: torch.save's own open fails with a RuntimeError, not an OSError)
        ckpt.save_file({"state_dict": state}, staging / out.name)
        if tempnet_file is not None:
            ckpt.save_file({"state_dict": heads}, staging / tempnet_file.name)
        staged = None if config_file is None else staging / config_file.name
        staged_folders = {source: staging / copy.name for source, copy in hf_copies}  # the final names, staged
        for source, target in staged_folders.items():
            copy_hf_folder(source, target)
        if staged is not None:
            _write_model_config(staged, model_config, staged_folders)
        _verify_in_open_clip(staging / out.name, arch, staged, state)
        # the moves are one update: a stop (Ctrl-C, SIGTERM) acts once they are made and the staging folder gone
        with signals_deferred():
            try:
                _commit(out, staging, staged, config_file, model_config, hf_copies, staged_folders, tempnet_file)
                committed = True
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except (Stopped, KeyboardInterrupt) as e:
        if not committed:
            raise
        raise Stopped(e.signum if isinstance(e, Stopped) else signal.SIGINT, done=f"{out} was written") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_model_config(path: Path, model_config: dict, hf_folders: dict) -> None:
    """`<arch>.json`, its Hugging Face text tower's folders named as in `hf_folders` (source -> place)."""
    from fastclip.models import with_hf_folders

    path.write_text(json.dumps(with_hf_folders(model_config, hf_folders), indent=4) + "\n")


def _commit(out, staging, staged, config_file, model_config, hf_copies, staged_folders, tempnet_file) -> None:
    """Give the verified staged files their final names, the model file last."""
    for source, copy in hf_copies:  # file by file: a folder of an earlier export takes the new files
        if copy.resolve() == source.resolve():  # exported beside the folder itself
            continue
        copy.mkdir(exist_ok=True)
        for file in staged_folders[source].iterdir():
            shutil.move(file, copy / file.name)  # (a rename, or a copy where copy links to another disk)
    if staged is not None:  # naming the folders' final places
        _write_model_config(staged, model_config, dict(hf_copies))
        os.replace(staged, config_file)
        _register(config_file)  # for whoever loads the export in this process
    if tempnet_file is not None:
        os.replace(staging / tempnet_file.name, tempnet_file)
    os.replace(staging / out.name, out)  # last: the model file under its name means the export is whole


def _register(config_file: Path) -> None:
    from fastclip.compat import import_open_clip

    import_open_clip().add_model_config(str(config_file))


@contextlib.contextmanager
def _registry_restored(factory, arch: str):
    """open_clip's model registry is process-wide: the staged config registered for the check (its folders are
    deleted with the staging folder) must not outlive it, for whoever goes on using open_clip in this process."""
    paths, previous = list(factory._MODEL_CONFIG_PATHS), factory._MODEL_CONFIGS.get(arch)
    try:
        yield
    finally:
        factory._MODEL_CONFIG_PATHS[:] = paths
        factory._MODEL_CONFIGS.pop(arch, None)  # (a rescan rebinds the dict: looked up again here)
        if previous is not None:
            factory._MODEL_CONFIGS[arch] = previous


def _verify_in_open_clip(file: Path, arch: str, config_file: Path | None, state: dict) -> None:
    """Load `file` as a user would (open_clip.create_model(arch, pretrained=file)) and compare every tensor."""
    from fastclip.compat import import_open_clip

    open_clip = import_open_clip()
    with _registry_restored(open_clip.factory, arch):
        if config_file is not None:
            open_clip.add_model_config(str(config_file))
        try:
            model = open_clip.create_model(arch, pretrained=str(file), device="cpu")
        except Exception as e:  # open_clip's errors are long: keep the start (torch's names the keys on line 2)
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
            first = " ".join(lines[:2])
            raise ValueError(
                f"the export of {arch!r} does not load back in open_clip ({first[:300]}); nothing written"
            ) from None
    loaded = model.state_dict()
    differ = [k for k, v in state.items() if k not in loaded or not torch.equal(loaded[k].to(v.dtype), v)]
    if differ:
        raise ValueError(
            f"the export of {arch!r} loads back in open_clip with other values for {differ[:5]}; nothing written"
        )


def loading_code(written: dict) -> str:
    """The python lines that load the export (printed, and put in the README by the lead)."""
    lines = [
        # pasted as printed it runs where fastclip is installed, a CPU torch with CUDA torchvision wheels included
        "from fastclip.compat import import_open_clip; open_clip = import_open_clip()  # elsewhere: import open_clip",
    ]
    if written["config_file"] is not None:
        lines.append(f"open_clip.add_model_config({str(Path(written['config_file']).resolve())!r})")
    lines += [
        f"model, _, preprocess = open_clip.create_model_and_transforms("
        f"{written['arch']!r}, pretrained={str(Path(written['file']).resolve())!r})",
        f"tokenizer = open_clip.get_tokenizer({written['arch']!r})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="fastclip export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="run dir, checkpoints dir, step dir or model.pt")
    parser.add_argument("--out", required=True, help="output .pt file")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    parser.add_argument(
        "--momentum-towers", action="store_true", help="export the EMA copy of the towers (model.ema_momentum)"
    )
    args = parser.parse_args(argv)
    if Path(args.out).is_dir():  # checked first: the export would be written and then fail to land
        print(f"fastclip export: --out {args.out}: is a folder; pass the .pt file to write", file=sys.stderr)
        return 2
    replaced = Path(args.out).is_file()  # an earlier export: replaced, as a re-export after more training means
    try:
        with stopped_by_signals():  # unwinds like Ctrl-C, so the staging folder is removed
            written = export_model(args.checkpoint, args.out, args.precision, args.momentum_towers)
    except Stopped as e:
        said = f"after {e.done}" if e.done else "before anything was written (an earlier export there is as it was)"
        print(f"fastclip export: stopped by {e.name} {said}", file=sys.stderr)
        return 128 + e.signum
    except (FileNotFoundError, ValueError) as err:  # the checkpoint named is missing, foreign or unusable
        print(f"fastclip export: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # writing failed midway (disk full): the checkpoint is fine, try elsewhere
        print(
            f"fastclip export: --out {args.out}: cannot write it ({err.strerror or err}); free space or choose "
            "another --out",
            file=sys.stderr,
        )
        return 1
    size_mb = written["file"].stat().st_size / 2**20
    instead = " (it replaces the earlier export there)" if replaced else ""
    print(f"wrote {written['file']} ({size_mb:.1f} MiB, {args.precision}) from {written['source']}{instead}")
    if written["config_file"] is not None:
        custom = written.get("custom_arch", True)  # (an ssl run's image tower: export_ssl.py)
        what = "the custom architecture" if custom else "open_clip's architecture with init_logit_bias:"
        print(f"wrote {written['config_file']} (model config for {what} {written['arch']!r})")
    if "logit_scale" not in written:  # an ssl run's image tower (fastclip/train/ssl.py)
        from fastclip.eval.export_ssl import tower_loading_code

        print("the image tower alone (open_clip's model.visual; the projector is not exported)")
        print("\nload it with:\n" + tower_loading_code(written))
        return 0
    if written.get("tempnet_file") is not None:
        print(f"wrote {written['tempnet_file']} (the temperature network's heads, for further training)")
    if written["loss_logit_bias"] is not None:
        print(f"logit_bias = {written['loss_logit_bias']:.4f} from the loss (model.logit_bias)")
    if written["temperature_from_loss"]:
        scale, stored = written["loss_logit_scale"], written["logit_scale"]
        rounded = f" ({stored:.4f} as written in {args.precision})" if stored != scale else ""
        print(f"logit_scale = {scale:.4f} (tau = {math.exp(-scale):.4f}) from the loss{rounded}")
    else:
        print(
            "note: the checkpoint's loss has no global logit_scale (per-sample or constant temperature); "
            "the model's own logit_scale is kept"
        )
    print("\nload it with:\n" + loading_code(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
