"""Options of each loss, as dataclasses: ``build_loss`` maps its keyword arguments onto one of these, so an
option a version does not take is a TypeError naming it, and every value is checked here once.

These dataclasses are also the schema of the trainer's `loss` section (fastclip/train/config.py makes a key of
every field, with its type, null meaning the default here), so a field's comment is its help there too; a field
marked LIBRARY_ONLY is not a key."""

from __future__ import annotations

import math
import numbers
import typing
from dataclasses import dataclass, field
from typing import Literal

import torch

from .schedules import GAMMA_SCHEDULES, GammaSchedule, GammaScheduleKind

Compat = Literal["faithful", "reference"]
Impl = Literal["fused", "autograd"]  # the hand-written backward, or the objective as autograd code (objective.py)
Similarity = Literal["cosine", "atanh"]  # logits s·cos, or s·2·atanh(cos) (temperature-free; similarity.py)
COMPAT_MODES, IMPLS, SIMILARITIES = typing.get_args(Compat), typing.get_args(Impl), typing.get_args(Similarity)
# A field that is no key of the trainer's loss section: a Python object, or a value the trainer derives from its
# other sections (fastclip/train/net.py: data_size, lr_tau, embed_dim, unimodal).
LIBRARY_ONLY = {"config_key": False}


class LossOptionError(ValueError):
    """One option's value breaks its rule: ``option``, ``rule`` and ``value`` let a caller name it in its own terms
    (the trainer: "config key 'loss.gamma_min': must be in (0, 1] (got 0.0)")."""

    def __init__(self, option: str, rule: str, value):
        self.option, self.rule, self.value = option, rule, value
        super().__init__(f"loss option {option} {rule}, got {value!r}")


def _is_number(value) -> bool:
    """A finite real number; not a bool (True is 1 to Python, a typo here) nor text ("0.2" is not a number)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _positive(name: str, value: float) -> None:
    if not (_is_number(value) and value > 0):
        raise LossOptionError(name, "must be a positive number", value)


def _finite(name: str, value: float) -> None:
    if not _is_number(value):
        raise LossOptionError(name, "must be a finite number", value)


def _is_count(value, least: int) -> bool:
    """An integer >= least (a numpy one too); not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


def _count(name: str, value, least: int) -> None:
    if not _is_count(value, least):
        raise LossOptionError(name, f"must be an integer >= {least}", value)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise LossOptionError(name, "must be true or false", value)


def _check_similarity(options) -> None:
    if options.similarity not in SIMILARITIES:
        raise LossOptionError("similarity", f"must be one of {SIMILARITIES}", options.similarity)
    if not (_is_number(options.similarity_clamp) and 0 < options.similarity_clamp < 1):
        raise LossOptionError("similarity_clamp", "must be in (0, 1)", options.similarity_clamp)


def _check_queue(options) -> None:
    if options.queue_size is not None:
        _count("queue_size", options.queue_size, 1)
        object.__setattr__(options, "queue_size", int(options.queue_size))


@dataclass(frozen=True)
class CommonOptions:
    # process group; None = the default (WORLD) when torch.distributed is initialised
    group: object | None = field(default=None, metadata=LIBRARY_ONLY)
    # input checks that raise the same LossInputError on all ranks (validation.py): True/"eager", "deferred",
    # False/"off"
    validate: bool | str = True
    # eager validation on several ranks: raise where a rank's τ or heads are not rank 0's (gradients not averaged);
    # false for local SGD / periodic model averaging, where they differ on purpose between the averaging rounds
    check_parameters: bool = field(default=True, metadata=LIBRARY_ONLY)
    # "fused": the hand-written backward (pairwise.py); "autograd": the objective written as autograd code over the
    # global batch (objective.py); None: fused where the loss has it and it implements every option given
    impl: Impl | None = None
    # [w_i2t, w_t2i]: loss = (w_i2t·L_i2t + w_t2i·L_t2i)/(w_i2t + w_t2i); None: the symmetric loss (equal weights)
    direction_weights: tuple[float, float] | None = None
    # self-supervised images: image and text features are two augmented views of the same images, every view an
    # anchor against all 2N views (objective.py); autograd objectives only
    unimodal: bool = field(default=False, metadata=LIBRARY_ONLY)  # the trainer's ssl.enabled

    def __post_init__(self):
        _check_bool("check_parameters", self.check_parameters)
        _check_bool("unimodal", self.unimodal)
        if self.unimodal:
            for name in ("queue_size", "distill_alpha", "separate_temperatures"):
                if getattr(self, name, None):
                    raise ValueError(
                        f"loss option {name} is not implemented for the unimodal form (two views of one image "
                        "have no modalities to queue, distil or give a temperature each); drop it, or the option "
                        "unimodal (the trainer's ssl.enabled)"
                    )
        if self.impl is not None and self.impl not in IMPLS:
            raise LossOptionError("impl", f"must be one of {IMPLS}", self.impl)
        weights = self.direction_weights
        if weights is not None:
            pair = isinstance(weights, (tuple, list)) and len(weights) == 2
            if not pair or not all(_is_number(w) and w >= 0 for w in weights) or sum(weights) <= 0:
                rule = "must be two numbers >= 0 with a positive sum ([w_i2t, w_t2i])"
                raise LossOptionError("direction_weights", rule, weights)
            object.__setattr__(self, "direction_weights", (float(weights[0]), float(weights[1])))
        if getattr(self, "fused_kernels", False) and self.impl == "autograd":
            raise ValueError("loss option fused_kernels compiles the fused backward's passes: it needs impl fused")
        if getattr(self, "compat", "faithful") == "reference" and self.impl == "autograd":
            raise ValueError(
                "loss option compat='reference' reproduces the reference code's deviations from the objective's "
                "gradient, which no autograd objective has: use impl fused (or compat faithful)"
            )

    def autograd_only(self) -> list[str]:
        """The options given that only the autograd implementation has (build_loss picks it for them)."""
        names = []
        if self.direction_weights is not None and self.direction_weights[0] != self.direction_weights[1]:
            names.append("direction_weights")
        if self.unimodal:
            names.append("unimodal")
        for name in ("hard_negative_topk", "hard_negative_beta", "queue_size", "distill_alpha"):
            if getattr(self, name, None) is not None:
                names.append(name)
        return names


@dataclass(frozen=True)
class InfoNCEOptions(CommonOptions):
    """The softmax losses over the global batch (openclip's InfoNCE, dcl) and their hard-negative options."""

    temperature: float = 0.07  # initial τ; logit_scale = log(1/τ)
    learn_temperature: bool = True  # false keeps τ at `temperature` (fixed-τ runs)
    similarity: Similarity = "cosine"  # "atanh": logits 2·atanh(cos)/τ (temperature-free with τ = 1, see similarity.py)
    similarity_clamp: float = 1e-6  # "atanh": the cosine is clamped to ±(1 − this)
    hard_negative_topk: int | None = None  # only each anchor's k most similar negatives in its denominator
    hard_negative_beta: float | None = None  # Robinson et al. 2021: negatives weighted ∝ exp(β·logit), mean 1
    queue_size: int | None = None  # negatives also from a FIFO of the last Q gathered features (queue.py)
    distill_alpha: float | None = None  # ALBEF: targets (1−α)·one-hot + α·the momentum model's softmax

    def __post_init__(self):
        super().__post_init__()
        _positive("temperature", self.temperature)
        _check_bool("learn_temperature", self.learn_temperature)
        _check_similarity(self)
        if self.hard_negative_topk is not None:
            _count("hard_negative_topk", self.hard_negative_topk, 1)
            object.__setattr__(self, "hard_negative_topk", int(self.hard_negative_topk))
        _check_queue(self)
        if self.distill_alpha is not None:
            if not (_is_number(self.distill_alpha) and 0 <= self.distill_alpha <= 1):
                raise LossOptionError("distill_alpha", "must be in [0, 1]", self.distill_alpha)
            if self.hard_negative_topk is not None or self.hard_negative_beta is not None:
                raise ValueError(
                    "loss options distill_alpha and hard_negative_topk/beta: the soft targets are a distribution "
                    "over every candidate, which hard-negative mining reweights or drops; use one or the other"
                )
        if self.hard_negative_beta is not None and not (
            _is_number(self.hard_negative_beta) and self.hard_negative_beta >= 0
        ):
            raise LossOptionError("hard_negative_beta", "must be a number >= 0", self.hard_negative_beta)


@dataclass(frozen=True)
class OpenCLIPOptions(InfoNCEOptions):
    # the [2, B, N] exponentials as torch.compile'd kernels (kernels.py); needs a C++ compiler (CPU) or Triton
    fused_kernels: bool = False

    def __post_init__(self):
        super().__post_init__()
        _check_bool("fused_kernels", self.fused_kernels)


@dataclass(frozen=True)
class SampleStateOptions(CommonOptions):
    data_size: int = field(default=0, metadata=LIBRARY_ONLY)  # 1 + the largest index that may appear; required
    eps: float = 1e-14  # ε in the weights 1/(u+ε) (FastCLIP's --fastclip_eps)
    # γ after the decay (reference --gamma). 0.8: the reference code's default; the published recipes use 0.2. At
    # batch 64 with samples revisited once per epoch u lags g less at 0.8 (e^0.1-0.5 vs e^1-2.4) but test R@1 ties
    # (RESULTS.md §4). Kept over 1.0 (u = the batch's estimate): 1.0 wins at scenes batch 128, 0.8 at glyphs batch
    # 32, each 3 of 3 seeds
    gamma_min: float = 0.8
    gamma_decay_epochs: int = 10  # epochs of the cosine decay of γ from 1 to gamma_min
    gamma_schedule: GammaScheduleKind = "cosine"
    compat: Compat = "faithful"  # "faithful": the stated objectives; "reference": reproduce the reference's gradients
    state_device: str | torch.device | None = field(default=None, metadata=LIBRARY_ONLY)  # None: the features' device
    # None: float64 for float64 features, else float32
    state_dtype: torch.dtype | None = field(default=None, metadata=LIBRARY_ONLY)
    # the [2, B, N] exponentials as torch.compile'd kernels, one pass each instead of 3-4 (kernels.py): faster from
    # about B = 256 per rank, a few seconds of compiling at the first call; eager where the backend cannot compile
    fused_kernels: bool = False

    def __post_init__(self):
        super().__post_init__()
        _check_bool("fused_kernels", self.fused_kernels)
        if not _is_count(self.data_size, 1):
            raise LossOptionError("data_size", "must be a positive int (1 + the largest data index)", self.data_size)
        object.__setattr__(self, "data_size", int(self.data_size))  # (a numpy integer, e.g. from len of an array)
        if not (_is_number(self.eps) and self.eps >= 0):
            raise LossOptionError("eps", "must be a number >= 0", self.eps)
        _finite("gamma_min", self.gamma_min)
        if not 0 < self.gamma_min <= 1:  # γ weighs the new batch's estimate into u: 0 would never update it
            raise LossOptionError("gamma_min", "must be in (0, 1]", self.gamma_min)
        _count("gamma_decay_epochs", self.gamma_decay_epochs, 0)
        if self.gamma_schedule not in GAMMA_SCHEDULES:
            raise LossOptionError("gamma_schedule", f"must be one of {GAMMA_SCHEDULES}", self.gamma_schedule)
        if self.compat not in COMPAT_MODES:
            raise LossOptionError("compat", f"must be one of {COMPAT_MODES}", self.compat)
        if self.state_dtype is not None and not (
            isinstance(self.state_dtype, torch.dtype) and self.state_dtype.is_floating_point
        ):
            raise LossOptionError("state_dtype", "must be a floating torch.dtype", self.state_dtype)
        if self.state_device is not None:  # said now, not at the first call
            try:
                device = torch.device(self.state_device)
            except (RuntimeError, TypeError):
                raise LossOptionError("state_device", "must be a device", self.state_device) from None
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"loss option state_device is {self.state_device!r} but CUDA is not available here")

    def gamma(self) -> GammaSchedule:
        return GammaSchedule(self.gamma_schedule, float(self.gamma_min), self.gamma_decay_epochs)


@dataclass(frozen=True)
class ConstantTemperatureOptions(SampleStateOptions):
    """FastCLIP-v1 (SogCLR with the cosine γ schedule): one constant τ."""

    temperature: float = 0.07
    similarity: Similarity = "cosine"  # as OpenCLIPOptions (v1/v0/v3): "atanh" maps the cosine to 2·atanh(cos)
    similarity_clamp: float = 1e-6
    queue_size: int | None = None  # g's mean also over a FIFO of the last Q gathered features (queue.py)

    def __post_init__(self):
        super().__post_init__()
        _positive("temperature", self.temperature)
        _check_similarity(self)
        _check_queue(self)


@dataclass(frozen=True)
class GlobalTemperatureOptions(ConstantTemperatureOptions):
    """FastCLIP-v0: one learnable τ (parameter ``logit_scale`` = log 1/τ), kept in [tau_min, 1]."""

    learn_temperature: bool = True
    tau_min: float = 0.01  # τ0: the lower bound of τ (clamp_; OpenCLIP's logit-scale cap of 100)

    def __post_init__(self):
        super().__post_init__()
        _check_bool("learn_temperature", self.learn_temperature)
        if not (_is_number(self.tau_min) and 0 < self.tau_min <= min(1.0, self.temperature)):
            raise LossOptionError("tau_min", "must be in (0, min(1, temperature)]", self.tau_min)


@dataclass(frozen=True)
class RGCLOptions(GlobalTemperatureOptions):
    """FastCLIP-v3 (RGCL-g): learnable global τ with the τ·log-sum-exp objective plus ρτ."""

    # reference code default; recipes use 6.5 (CC3M), 8.5 (CC12M), 16 (LAION). At global batch 64 (above ln 63) it
    # ties with 0.6·ln 63 (statistical-efficiency study, 3 paired test seeds: +0.8 ± 2.5 points R@1; RESULTS.md §4)
    rho: float = 8.0
    # RGCL-g as the textbook writes it: τ1 for the image-anchored term, τ2 for the text-anchored one (logit_scale
    # becomes [2]); False: one shared τ, as the reference implementation (and its published ρ) has it.
    separate_temperatures: bool = False

    def __post_init__(self):
        super().__post_init__()
        _finite("rho", self.rho)
        _check_bool("separate_temperatures", self.separate_temperatures)
        if self.separate_temperatures and self.compat == "reference":
            raise ValueError(
                "loss option separate_temperatures is the textbook objective; the reference "
                "implementation has one shared τ: use compat='faithful'"
            )
        if self.separate_temperatures and self.similarity != "cosine":
            raise ValueError("loss option separate_temperatures works with similarity='cosine' only")


@dataclass(frozen=True)
class IndividualTemperatureOptions(SampleStateOptions):
    """FastCLIP-v2 (iSogCLR-style RGCL): a τ per sample and modality, updated by a per-sample Adam."""

    temperature: float = 0.03  # initial τ of every sample
    rho: float = 7.0
    lr_tau: float = field(default=0.0133, metadata=LIBRARY_ONLY)  # the trainer's optim.lr_tau
    # Adam betas of the per-sample τ update, used from epoch 1 on (epoch 0 uses (0, 0))
    tau_betas: tuple[float, float] = (0.9, 0.98)
    tau_eps: float = 1e-6  # Adam eps of the per-sample τ update
    tau_min: float = 0.01  # per-sample τ bounds
    tau_max: float = 1.0
    tau_grad_clamp: float = 5.0  # clamp of the per-sample τ gradient

    def __post_init__(self):
        super().__post_init__()
        for name in ("temperature", "lr_tau", "tau_eps", "tau_min", "tau_max", "tau_grad_clamp"):
            _positive(name, getattr(self, name))
        _finite("rho", self.rho)
        if self.tau_min > self.tau_max:
            raise ValueError(f"loss option tau_min={self.tau_min} is above tau_max={self.tau_max}")
        if not self.tau_min <= self.temperature <= self.tau_max:
            raise ValueError(
                f"loss option temperature={self.temperature} is outside [tau_min, tau_max] = "
                f"[{self.tau_min}, {self.tau_max}]"
            )
        betas = self.tau_betas
        pair = isinstance(betas, (tuple, list)) and len(betas) == 2
        if not pair or not all(_is_number(b) and 0 <= b < 1 for b in betas):
            raise LossOptionError("tau_betas", "must be two numbers in [0, 1)", self.tau_betas)


@dataclass(frozen=True)
class TempNetOptions(SampleStateOptions):
    """FastCLIP with a temperature network: RGCL with τ_i predicted from the features by a small MLP per
    modality (tempnet.py)."""

    embed_dim: int = field(default=0, metadata=LIBRARY_ONLY)  # feature dimension (the towers' embed_dim); required
    tempnet_hidden: int = 256  # hidden width of each head
    temperature: float = 0.03  # the heads' initial τ (output layer starts at zero)
    rho: float = 7.0
    tau_min: float = 0.01
    tau_max: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if type(self.embed_dim) is int and self.embed_dim == 0:  # the default: not given
            raise ValueError("loss option embed_dim is required: the towers' feature dimension d (embed_dim)")
        _finite("rho", self.rho)
        for name in ("embed_dim", "tempnet_hidden"):
            value = getattr(self, name)
            if not _is_count(value, 1):
                raise LossOptionError(name, "must be a positive int", value)
            object.__setattr__(self, name, int(value))
        for name in ("temperature", "tau_min", "tau_max"):
            _positive(name, getattr(self, name))
        if self.tau_min >= self.tau_max:
            raise ValueError(f"loss option tau_min={self.tau_min} must be below tau_max={self.tau_max}")
        if not self.tau_min < self.temperature < self.tau_max:
            raise ValueError(
                f"loss option temperature={self.temperature} must lie strictly inside "
                f"(tau_min, tau_max) = ({self.tau_min}, {self.tau_max})"
            )


@dataclass(frozen=True)
class SigLIPOptions(CommonOptions):
    """SigLIP: sigmoid loss with a learnable scale t = 1/τ (init 10) and bias b (init −10), as Zhai et al. 2023."""

    temperature: float = 0.1  # initial 1/t; logit_scale = log t = log(1/τ)
    bias: float = -10.0  # initial logit_bias
    learn_temperature: bool = True
    learn_bias: bool = field(default=True, metadata=LIBRARY_ONLY)  # the trainer learns the bias always

    def __post_init__(self):
        super().__post_init__()
        if self.direction_weights is not None:
            raise ValueError(
                "loss option direction_weights: the sigmoid loss has no directions (each pair is one term)"
            )
        _positive("temperature", self.temperature)
        _finite("bias", self.bias)
        _check_bool("learn_temperature", self.learn_temperature)
        _check_bool("learn_bias", self.learn_bias)
