"""Tower locking (LiT, https://arxiv.org/abs/2111.07991): OpenCLIP's --lock-image and --lock-text, done by the
model's own ``lock_image_tower(unlocked_groups, freeze_bn_stats)`` and ``lock_text_tower(unlocked_layers,
freeze_layer_norm)``, which set ``requires_grad`` False on the locked parameters (the optimizer then holds no
state for them) and, with ``freeze_bn_stats``, replace BatchNorm layers by FrozenBatchNorm2d (their statistics and
affine weights become buffers).

What open_clip asserts, or does silently, is a LockError here, naming the setting and what to do:

    lock_image_unlocked_groups   open_clip's groups of the image tower, counted as its lock() counts them
                                 (VisionTransformer: the stem, each block but the last, the last block with
                                 ln_post, the projection: layers + 2); as many or more unlock the whole tower
                                 (nothing locked); ModifiedResNet (RN50, ...) locks whole only (open_clip asserts)
    lock_image_freeze_bn_stats   an image tower without BatchNorm layers (a ViT) would ignore it
    lock_text_unlocked_layers    the text tower's groups: open_clip's TextTransformer the token and positional
                                 embeddings, each block but the last, the last block with ln_final, the
                                 projection; a Hugging Face tower its embeddings and each layer (its projection
                                 is never locked); as many or more lock nothing
    lock_text_freeze_layer_norm  open_clip's own text tower locks its LayerNorms with the rest and asserts this
                                 is true; a Hugging Face tower keeps its LayerNorms trainable unless it is true
    a tower without a lock method (CoCa's), or a lock that leaves no tower parameter to train

    apply_locks(model, settings, arch)   lock the towers in place; returns the start line's words, or None
    tower_parameters(model, tower)       the (name, parameter) pairs of a tower ("image" or "text")
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import torch

TOWER_WORDS = {"image": "image tower", "text": "text tower"}


class LockError(ValueError):
    """A lock setting the model cannot take: `key` is the setting's name (ModelConfig's field), `why` what to do."""

    def __init__(self, key: str, why: str):
        super().__init__(why)
        self.key, self.why = key, why


@dataclass(frozen=True)
class LockSettings:
    """ModelConfig's six lock keys (OpenCLIP's flags of the same names)."""

    lock_image: bool = False
    lock_image_unlocked_groups: int = 0
    lock_image_freeze_bn_stats: bool = False
    lock_text: bool = False
    lock_text_unlocked_layers: int = 0
    lock_text_freeze_layer_norm: bool = False

    @classmethod
    def of(cls, section) -> LockSettings:
        return cls(**{name: getattr(section, name) for name in cls.__dataclass_fields__})

    @property
    def any(self) -> bool:
        return self.lock_image or self.lock_text


def _is_hf_text(text: torch.nn.Module | None) -> bool:
    return type(text).__name__ == "HFTextEncoder"


def text_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The text tower as a module: CustomTextCLIP's `text`; None for CLIP, whose text parts are its own attributes."""
    return getattr(model, "text", None) if isinstance(getattr(model, "text", None), torch.nn.Module) else None


def tower_parameters(model: torch.nn.Module, tower: str) -> list[tuple[str, torch.nn.Parameter]]:
    """A tower's parameters by name: the image tower is `visual`; the text tower is `text` (CustomTextCLIP) or, in
    open_clip's CLIP, every parameter outside `visual` but the logit scale and bias (the loss owns those)."""
    named = list(model.named_parameters())
    if tower == "image":
        return [(n, p) for n, p in named if n.startswith("visual.")]
    if text_module(model) is not None:
        return [(n, p) for n, p in named if n.startswith("text.")]
    return [(n, p) for n, p in named if not n.startswith("visual.") and n not in ("logit_scale", "logit_bias")]


def image_groups(visual: torch.nn.Module) -> int | None:
    """The image tower's groups as its lock() counts them; None where the tower is not one of open_clip's known
    kinds (its lock is then checked by its result only)."""
    kind = type(visual).__name__
    if kind == "VisionTransformer":  # stem, blocks[:-1], [last block, ln_post], proj
        return len(visual.transformer.resblocks) + 2
    if kind == "ModifiedResNet":
        return 1
    if kind == "TimmModel":
        try:
            from timm.models import group_parameters  # (timm.models.helpers warns: deprecated)

            return max(group_parameters(visual.trunk, visual.trunk.group_matcher()).keys()) + 1
        except Exception:  # (an older timm, a trunk without a group matcher: open_clip's lock says so)
            return None
    return None


def text_groups(model: torch.nn.Module) -> int | None:
    """The text tower's groups as its lock counts them (see the module's docstring); None where unknown."""
    text = text_module(model)
    if _is_hf_text(text):
        layer_attr = _hf_layer_attr(text)
        if layer_attr is None:
            return None
        encoder = getattr(text.transformer, "encoder", text.transformer)
        return len(getattr(encoder, layer_attr)) + 1
    owner = text if text is not None else model
    transformer = getattr(owner, "transformer", None)
    blocks = getattr(transformer, "resblocks", None)
    if blocks is None or len(blocks) == 0:
        return None
    embeddings = any(
        getattr(owner, k, None) is not None for k in ("token_embedding", "positional_embedding", "cls_emb")
    )
    projection = getattr(owner, "text_projection", None) is not None
    return int(embeddings) + (len(blocks) - 1) + 1 + int(projection)


def _hf_layer_attr(text: torch.nn.Module) -> str | None:
    """The attribute of a Hugging Face tower's layer list in open_clip's hf_configs (None: its partial lock fails)."""
    from open_clip.hf_model import arch_dict

    return arch_dict.get(text.config.model_type, {}).get("config_names", {}).get("layer_attr")


def _has_batch_norm(module: torch.nn.Module) -> bool:
    norms = (torch.nn.modules.batchnorm.BatchNorm2d, torch.nn.SyncBatchNorm)
    return any(isinstance(m, norms) for m in module.modules())


def _millions(n: int) -> str:
    return f"{n / 1e6:.3g}M"


def apply_locks(model: torch.nn.Module, settings: LockSettings, arch: str) -> str | None:
    """Lock the towers `settings` names, in place, through the model's own methods; returns what the start line
    says of them (which tower, how many groups unlocked, how many parameters train), or None without a lock.
    Raises LockError for what the model cannot take (the module docstring)."""
    if not settings.any:
        return None
    said = []
    if settings.lock_image:
        said.append(_lock_image(model, settings, arch))
    if settings.lock_text:
        said.append(_lock_text(model, settings, arch))
    for tower in ("image", "text"):  # a lock that froze nothing of its tower is no lock
        if getattr(settings, f"lock_{tower}") and all(p.requires_grad for _, p in tower_parameters(model, tower)):
            key = "lock_image_unlocked_groups" if tower == "image" else "lock_text_unlocked_layers"
            raise LockError(key, f"leaves no parameter of {arch}'s {TOWER_WORDS[tower]} locked: lower it")
    towers = tower_parameters(model, "image") + tower_parameters(model, "text")
    if not any(p.requires_grad for _, p in towers):
        raise LockError(
            "lock_image",
            f"with model.lock_text, every parameter of {arch}'s towers is locked and nothing would train but the "
            "loss's temperature: unlock groups of one (model.lock_image_unlocked_groups, "
            "model.lock_text_unlocked_layers) or lock one tower only",
        )
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for _, p in towers if p.requires_grad)  # (the towers' logit_scale: the loss's)
    return f"{', '.join(said)}: {_millions(trainable)} of {_millions(total)} parameters train"


def _lock_image(model: torch.nn.Module, s: LockSettings, arch: str) -> str:
    visual = getattr(model, "visual", None)
    if not callable(getattr(model, "lock_image_tower", None)) or not callable(getattr(visual, "lock", None)):
        raise LockError("lock_image", f"{arch} ({type(model).__name__}) has no image tower lock in open_clip: drop it")
    groups, unlocked = image_groups(visual), s.lock_image_unlocked_groups
    kind = type(visual).__name__
    if unlocked and kind == "ModifiedResNet":
        raise LockError(
            "lock_image_unlocked_groups",
            f"{arch}'s image tower (open_clip's ModifiedResNet) is locked whole only (open_clip: partial locking "
            "not supported for this model): set it to 0",
        )
    if groups is not None and unlocked >= groups:
        raise LockError(
            "lock_image_unlocked_groups",
            f"{unlocked} unlocks all {groups} groups of {arch}'s image tower, leaving nothing locked: use 0 to "
            f"{groups - 1}",
        )
    if s.lock_image_freeze_bn_stats and not _has_batch_norm(visual):
        raise LockError(
            "lock_image_freeze_bn_stats",
            f"{arch}'s image tower ({kind}) has no BatchNorm layer, so it would change nothing: drop it",
        )
    freeze = s.lock_image_freeze_bn_stats
    _call(model.lock_image_tower, "lock_image", arch, unlocked_groups=unlocked, freeze_bn_stats=freeze)
    of = f" of {groups}" if groups is not None else ""
    frozen = ", BatchNorm statistics frozen" if s.lock_image_freeze_bn_stats else ""
    return f"image tower locked ({unlocked}{of} groups unlocked{frozen})"


def _lock_text(model: torch.nn.Module, s: LockSettings, arch: str) -> str:
    if not callable(getattr(model, "lock_text_tower", None)):
        raise LockError("lock_text", f"{arch} ({type(model).__name__}) has no text tower lock in open_clip: drop it")
    hf = _is_hf_text(text_module(model))
    if not hf and not s.lock_text_freeze_layer_norm:
        raise LockError(
            "lock_text_freeze_layer_norm",
            f"{arch}'s text tower (open_clip's own) locks its LayerNorms with the rest (open_clip asserts "
            "freeze_layer_norm): set it true (OpenCLIP's --lock-text-freeze-layer-norm)",
        )
    groups, unlocked = text_groups(model), s.lock_text_unlocked_layers
    if unlocked and hf and _hf_layer_attr(text_module(model)) is None:
        kind = text_module(model).config.model_type
        raise LockError(
            "lock_text_unlocked_layers",
            f"open_clip locks {arch}'s Hugging Face text tower ({kind}) whole only (its hf_configs names no layer "
            "list for it): set it to 0",
        )
    if groups is not None and unlocked >= groups:
        raise LockError(
            "lock_text_unlocked_layers",
            f"{unlocked} unlocks all {groups} layer groups of {arch}'s text tower, leaving nothing locked: use 0 to "
            f"{groups - 1}",
        )
    # (a Hugging Face tower prints "Unlocking N/M layers of hf model" on every rank: the start line says it once)
    with contextlib.redirect_stdout(io.StringIO()):
        _call(
            model.lock_text_tower,
            "lock_text",
            arch,
            unlocked_layers=unlocked,
            freeze_layer_norm=s.lock_text_freeze_layer_norm,
        )
    of = f" of {groups}" if groups is not None else ""
    norms = ", LayerNorms trainable" if hf and not s.lock_text_freeze_layer_norm else ""
    return f"text tower locked ({unlocked}{of} layer groups unlocked{norms})"


def _call(lock, key: str, arch: str, **kwargs) -> None:
    """open_clip's lock; its assert (or a tower's own error) as a LockError naming the setting."""
    try:
        lock(**kwargs)
    # open_clip's asserts and the towers' refusals only: another error (an API that moved) is a bug to see whole
    except (AssertionError, NotImplementedError, ValueError) as e:
        words = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LockError(key, f"open_clip cannot lock {arch}'s tower so ({words}): change the lock settings") from None


__all__ = ["LockError", "LockSettings", "apply_locks", "tower_parameters", "image_groups", "text_groups"]
