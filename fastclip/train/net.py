"""The network a run trains: the towers, the loss and the data-parallel engine around them, built in one place
(`build_net`) for the trainer, the tests and the benchmarks.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fastclip.distributed import DistInfo
from fastclip.losses import option_names
from fastclip.train.config import (
    LOSS_NAMES,
    Config,
    ConfigError,
    LossConfig,
    aug_options,
    loss_section_error,
    section_loss_options,
)
from fastclip.train.momentum import MomentumTowers


class TowersWithLoss(torch.nn.Module):
    """What DDP wraps: the towers and the loss in one module, so the loss's temperature is a DDP parameter and
    its gradient is averaged with the towers'. forward: encode under autocast, L2-normalise in fp32, loss in fp32
    (the loss gathers features itself; its per-sample state is plain tensors, so DDP never broadcasts it)."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: torch.nn.Module,
        *,
        precision: str,
        compile: bool,
        momentum_towers: MomentumTowers | None = None,
    ):
        super().__init__()
        self.model, self.loss_fn, self.momentum_towers = model, loss_fn, momentum_towers
        self.amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        # compile the towers' encoders only: the loss holds collectives and data-dependent state updates
        self.encode_image = torch.compile(model.encode_image) if compile else model.encode_image
        self.encode_text = torch.compile(model.encode_text) if compile else model.encode_text

    def encode(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._encode_with(self.encode_image, self.encode_text, images, texts)

    @torch.no_grad()
    def encode_momentum(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The momentum towers' features of the batch (None without model.ema_momentum, or where the loss reads
        none: no queue, no distillation; the towers' EMA still follows, for export)."""
        if self.momentum_towers is None or not getattr(self.loss_fn, "uses_momentum_features", False):
            return None
        towers = self.momentum_towers.towers
        return self._encode_with(towers.encode_image, towers.encode_text, images, texts)

    def _encode_with(self, encode_image, encode_text, images, texts):
        with torch.autocast(
            images.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None
        ):
            image_features = encode_image(images)
            text_features = encode_text(texts)
        return F.normalize(image_features.float(), dim=-1), F.normalize(text_features.float(), dim=-1)

    def forward(
        self,
        images: torch.Tensor,
        texts: torch.Tensor,
        indices: torch.Tensor | None,
        epoch: int,
        features_only: bool = False,
        groups: torch.Tensor | None = None,
    ):
        image_features, text_features = self.encode(images, texts)
        if features_only:  # gradient accumulation calls the loss itself, once per step (fastclip/train/accumulate.py)
            return image_features, text_features
        momentum = self.encode_momentum(images, texts)
        return self.loss_fn(image_features, text_features, indices, epoch=epoch, momentum=momentum, groups=groups)


def loss_options(cfg: Config, embed_dim: int | None = None) -> dict:
    """The loss section's set values (every LossConfig field but the name), passed to build_loss, which rejects
    options a version lacks; v2 also gets the temperature lr, the temperature network the towers' embed_dim."""
    opts = section_loss_options(cfg.loss)
    if "tau_betas" in opts:
        opts["tau_betas"] = tuple(opts["tau_betas"])
    takes = option_names(cfg.loss.name)  # (by option, not by name: a loss of the user's own may take them too)
    if "lr_tau" in takes:  # v2 updates its per-sample tau itself, at lr_tau
        opts["lr_tau"] = cfg.optim.base_lr_tau
    if "embed_dim" in takes and embed_dim is not None:  # the temperature network's input
        opts["embed_dim"] = cfg.ssl.projector_dim if cfg.ssl.enabled else embed_dim
    if cfg.ssl.enabled:  # two views of each image (fastclip/train/ssl.py)
        opts["unimodal"] = True
    return opts


def make_loss(cfg: Config, data_size: int, embed_dim: int | None = None):
    """build_loss with the loss section; an option this version does not take, or a bad value, is a ConfigError.
    `fastclip train --check` calls it too (a loss holds no per-sample state until its first call: cheap)."""
    from fastclip.losses import UnknownLossOptions, build_loss, config_option_names

    try:
        return build_loss(cfg.loss.name, data_size=data_size, **loss_options(cfg, embed_dim))
    except UnknownLossOptions as e:  # in config keys (the library's message lists its own arguments)
        keys = {f.name for f in dataclasses.fields(LossConfig)} - {"name", "extra_options"}
        extra = cfg.loss.extra_options or {}
        key = lambda k: f"loss.extra_options.{k}" if k in extra else f"loss.{k}"  # noqa: E731
        why = "".join(f"; {key}: {reason}" for key, reason in e.why.items())
        named, them = ("config keys", "them") if len(e.unknown) > 1 else ("config key", "it")
        takes = [f"loss.{k}" for k in sorted(e.accepted & keys)]
        if cfg.loss.name not in LOSS_NAMES:  # a loss of the user's own: its other options are extra_options'
            takes += [f"loss.extra_options.{k}" for k in sorted(config_option_names(e.name) - keys)]
        raise ConfigError(
            f"{named} {', '.join(key(k) for k in e.unknown)}: loss {e.name} does not take {them} (it takes "
            f"{', '.join(takes)}); drop {them} or set {them} to null{why}"
        ) from None
    except Exception as e:  # a value the options refuse; any error of a user's own options class, said as such
        raise loss_section_error(cfg.loss.name, e) from None


def check_loss(cfg: Config, data_size: int):
    """make_loss before any tower exists (the temperature network's embed_dim from the architecture's config):
    `--check`, `--print-config` and the ranks at start refuse what the run would. Returns the loss (a resume compares
    its parameters with the checkpoint's)."""
    takes_embed_dim = "embed_dim" in option_names(cfg.loss.name)
    return make_loss(cfg, data_size, arch_embed_dim(cfg.model.arch) if takes_embed_dim else None)


def arch_embed_dim(arch: str) -> int | None:
    """The towers' embed_dim from the architecture's config, without building them."""
    from fastclip.compat import import_open_clip
    from fastclip.models import resolve_arch

    name, config = resolve_arch(arch)
    config = config or import_open_clip().get_model_config(name) or {}
    return config.get("embed_dim")


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def temperature_to_towers(model: torch.nn.Module, loss_fn) -> None:
    """Keep the towers' own (frozen) logit_scale equal to the loss's learned temperature: open_clip reads it."""
    tau = loss_fn.temperature()
    with torch.no_grad():
        if tau is not None:
            model.logit_scale.copy_(-torch.log(tau.to(model.logit_scale)))


@dataclass
class Net:
    built: object  # fastclip.models.BuiltModel: arch, model config, preprocessing, tokenizer
    model: torch.nn.Module  # the towers (open_clip)
    loss_fn: torch.nn.Module
    engine: object  # DDPEngine or DeepSpeedEngine (fastclip/train/engine.py)
    speedups: list[str]  # GPU choices applied, for the start-up line
    loaded: object = None  # what build_net's `load` returned (the trainer: where a resume continues)
    momentum_towers: MomentumTowers | None = None  # model.ema_momentum's EMA copy of the towers
    locks: str | None = None  # the locked towers (model.lock_image, model.lock_text), as the start line says them


def build_towers(cfg: Config, device: str = "cpu"):
    """The run's BuiltModel: cfg.model.arch's towers, or in an ssl run its image tower + projector with two views
    per image (fastclip/train/ssl.py). The one place both the run and `--check` (on the meta device) build them."""
    from fastclip.models import build_model

    # ssl: data.aug makes the views, not open_clip's transform, which is replaced
    built = build_model(cfg.model.arch, device=device, aug_cfg=None if cfg.ssl.enabled else aug_options(cfg.data.aug))
    if cfg.ssl.enabled:
        from fastclip.train.ssl import ssl_built

        built = ssl_built(built, cfg)
    return built


def lock_towers(model: torch.nn.Module, cfg: Config) -> str | None:
    """model.lock_image / model.lock_text (LiT) by the model's own lock methods (fastclip/models/locks.py), in place:
    the locked parameters stop requiring gradients, so the optimizer holds no state for them. Returns the start
    line's words for them (None without a lock); what the towers cannot take is a ConfigError naming the key."""
    from fastclip.models.locks import LockError, LockSettings, apply_locks

    try:
        return apply_locks(model, LockSettings.of(cfg.model), cfg.model.arch)
    except LockError as e:
        raise ConfigError(f"config key 'model.{e.key}': {e.why}") from None


def build_net(
    cfg: Config,
    info: DistInfo,
    data_size: int,
    *,
    load: Callable[[torch.nn.Module, torch.nn.Module], None] | None = None,
    momentum_state: dict | None = None,
) -> Net:
    """Towers (seeded by train.seed: the same init on every rank) + loss + the engine of train.distributed.
    `load(model, loss_fn)` runs before the engine wraps them (resume, pretrained towers), so DDP broadcasts
    identical tensors."""
    from fastclip.train.engine import build_engine
    from fastclip.train.gpu import apply_backend_flags, to_channels_last, wants_channels_last

    device = info.device
    seed_all(cfg.train.seed)
    built = build_towers(cfg)
    # before the weights are loaded: freezing BatchNorm statistics replaces modules, which a resume or
    # model.pretrained must load into as the run saves them
    locks = lock_towers(built.model, cfg)
    model = built.model.to(device)
    speedups = apply_backend_flags(cfg, device)  # CUDA: TF32, cudnn.benchmark (fastclip/train/gpu.py)
    if wants_channels_last(cfg, model, device):  # convolutional towers on CUDA
        to_channels_last(model)
        speedups.append("channels_last")
    model.logit_scale.requires_grad_(False)  # the loss owns the temperature
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    loss_fn = make_loss(cfg, data_size, built.config.get("embed_dim")).to(device)
    loaded = load(model, loss_fn) if load is not None else None
    momentum = None
    if cfg.model.ema_momentum is not None:  # from the loaded towers, or as the checkpoint saved it
        momentum = MomentumTowers(model, cfg.model.ema_momentum)
        if momentum_state is not None:
            momentum.load_state_dict(momentum_state)
    if cfg.model.compile and cfg.model.grad_checkpointing and info.distributed:
        torch._dynamo.config.optimize_ddp = False  # DDP's graph splitting does not support checkpointed graphs
    net = TowersWithLoss(
        model, loss_fn, precision=cfg.train.precision, compile=cfg.model.compile, momentum_towers=momentum
    )
    return Net(built, model, loss_fn, build_engine(net, cfg, info), speedups, loaded, momentum, locks)


__all__ = ["TowersWithLoss", "Net", "build_net", "lock_towers", "loss_options", "seed_all", "temperature_to_towers"]
