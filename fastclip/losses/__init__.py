"""FastCLIP losses (v0-v3) and the OpenCLIP baseline, for one process or any torch.distributed group.

Usage in your own training loop (the model in DDP; the loss holds the temperature and the per-sample state)::

    from fastclip.losses import build_loss

    loss_fn = build_loss("fastclip-v3", data_size=len(dataset), rho=6.5, gamma_min=0.2, gamma_decay_epochs=18)
    loss_fn.to(device)
    optimizer = torch.optim.AdamW([{"params": model.parameters()},
                                   {"params": loss_fn.parameters(), "lr": 2e-4, "weight_decay": 0.0}])
    for epoch in range(epochs):
        loss_fn.set_epoch(epoch)                        # γ schedule (and v2's Adam betas)
        for images, texts, indices in loader:           # indices: int64 global data indices in [0, data_size)
            image_features, text_features = model(images, texts)   # L2-normalised, [B, d] on this rank
            loss = loss_fn(image_features, text_features, indices)
            optimizer.zero_grad()
            loss.backward()
            loss_fn.average_grads_()                     # logit_scale is outside DDP: average its gradient
            optimizer.step()
            loss_fn.clamp_()                             # logit_scale in [0, ln 100]
            log(loss_fn.metrics["objective"], loss_fn.temperature(), loss_fn.comm_bytes)
        torch.save({"loss_state": loss_fn.state_dict()}, f"rank_{rank}.pt")  # this rank's shard

Contract: every rank backpropagates its own loss; once parameter gradients are averaged over ranks (as DDP
does) they equal the single-process gradient on the rank-major concatenation of the ranks' batches, and the
per-sample state after the step is the same too. Features travel in one all_gather without autograd (no
backward collective), plus O(N) scalars; ``loss_fn.comm_bytes`` counts the bytes of the last call. (The
``impl="autograd"`` objectives add a backward all_to_all of the features' gradient columns and an all_reduce of
the value: objective.py.) The returned tensor is what to backpropagate: its value is this rank's share in the fused
implementation (the ranks' mean is the global loss) and the global value in the autograd one; for the FastCLIP
versions it is a surrogate whose value is not the objective; log ``loss_fn.metrics["objective"]``, the global
objective, the same on every rank. Towers outside DDP average their gradients over the ranks as the loss's own do.
The loss's own parameters (τ, the temperature network's heads) are set to rank 0's at the first call, as DDP does for a
model, so ranks seeded differently still train one loss.

compat (FastCLIP-v0..v3):

* ``"faithful"`` (default): the gradients of the stated objectives. GCL (v0/v1): (1/2N)Σ log(ε+g);
  RGCL-g (v3): τ·(1/2N)Σ(log(ε+g1)+log(ε+g2)) + ρτ; RGCL with individual τ (v2): (1/2N)Σ τ_i(log(ε+g_i)+ρ).
* ``"reference"``: reproduces the two deviations of the reference implementation (Optimization-AI/fast_clip),
  whose published hyper-parameters (ρ, lr_τ) were tuned with them:
  (1) v3 (and v0) differentiate the temperature through the candidates' half of the surrogate as well, so the
      g-term of the τ-gradient is counted twice: dL/dτ = mean log u + ρ + 2·τ·(1/2N)Σ(∂g/∂τ)/u (v3 also drops
      ε inside log u). For v0 this is a plain factor 2 on the τ-gradient.
  (2) v2's encoder gradient lacks the τ_i weight of RGCL: weights 1/(u_i+ε) instead of τ_i/(u_i+ε), i.e. the
      encoders follow (1/2N)Σ log g_i(τ_i).

Options (``build_loss(name, *, data_size, **options)``; an option a version does not take is a TypeError,
an option passed as None means its default): see ``options.py``. Names: ``openclip``, ``fastclip-v0``,
``fastclip-v1``, ``fastclip-v2``, ``fastclip-v3``, ``fastclip-tempnet`` (RGCL with τ_i predicted by an MLP head
per modality from the features, ``embed_dim=`` required; tempnet.py), ``siglip``, ``dcl`` (decoupled InfoNCE:
the positive left out of the denominator; dcl.py) and ``ntxent`` (SimCLR's NT-Xent over two views of images, the
unimodal mode; ntxent.py); the last two have the autograd implementation only. A name ``"module:attribute"`` is a
loss of your own: the ``LossEntry`` that module defines (``loss_entry``; the trainer's ``--loss.name``).

Numerics (beyond the reference): autocast is off inside every loss and similarities are multiplied in at least
fp32; v0/v1/v3 keep log u and shift rows by their maximum (no fp32 overflow at τ = 0.01); v2 adds the
objective's ε in its shifted scale (``compat="reference"``: the published ε·e^b); copies of one data index in a
global batch are not each other's negatives (g keeps its 1/(N-1) normalisation) and the state keeps the last
occurrence.

Eval mode (``loss_fn.eval()``, e.g. for a validation loss): the FastCLIP losses read their per-sample state and
write none of it (u is the batch's own estimate, γ = 1; v2 uses the stored τ_i of the indices given). Every rank
switches together: a rank alone in eval mode is refused like a batch of another size.

Input checks (``validate``, validation.py): ``True``/``"eager"`` (default) names a bad input in the call, before
the state is written (one host sync per call), and a batch that shrinks on one rank only (an uneven last batch)
is the same error on every rank, the loss untouched; ``"deferred"`` rides the same checks in the feature
all_gather and keeps them on the device until ``loss_fn.check_inputs()`` (no host sync, no extra collective: for
loops with a NaN guard, like the trainer's; the handshake of the first call and of a shape change checks values
too, and raises there), and needs the ranks to change batch shapes (and train/eval mode) together (drop the
last batch): a rank that changes alone raises, naming the change, after the call's collectives, and the others
stop in their next collective;
``False``/``"off"``: none, and an out-of-range index trips a device-side assert and writes nothing.

Beyond the reference:

* ``similarity="atanh"`` (openclip, fastclip-v0/v1/v3; ``similarity_clamp``, default 1e-6): the temperature-free
  loss (Kim & Kim, ICML 2025): logits 2·atanh(cos)/τ instead of cos/τ (similarity.py). For it ``temperature``
  defaults to 1 and openclip's ``learn_temperature`` to False, so ``openclip`` and ``fastclip-v1`` with it have
  no temperature at all; v0/v3 learn τ as a scale on top (see gcl.py for what that means); v2 rejects it.
* ``siglip``: the sigmoid loss (Zhai et al. 2023) with learnable scale t = 1/τ (``temperature``, init 0.1) and
  bias (``bias``, init −10; ``learn_temperature``, ``learn_bias``), OpenCLIP ``SigLipLoss``'s per-rank value
  and gradients on the same single all_gather (siglip.py). Parameters ``logit_scale`` and ``logit_bias``.

Module attributes: ``name``, ``uses_sample_state``, ``metrics`` (detached tensors of the last call: ``loss``,
``surrogate``, ``objective`` (the estimated global objective from u), ``gamma``, ``tau``; v2: ``tau_q05``,
``tau_q50``, ``tau_q95`` and ``tau_quantiles`` (shape [3]); all others 0-d), ``comm_bytes``
(``header``/``features``/``indices``/``state``/``values``/``gradients``/``total``), ``set_epoch(e)``,
``clamp_()``, ``temperature()``, ``tau_param_names()``, ``average_grads_()``. Per-sample state: ``state_dict()``
holds this rank's shard under ``_extra_state`` (``sharded_state.py``); ``reshard_states`` / ``reshard_for_rank``
change the world size.
"""

from __future__ import annotations

import dataclasses
import typing

from torch import nn

from .base import ContrastiveLoss, SampleStateLoss
from .dcl import DCLLoss, DCLOptions
from .errors import FeaturesNotNormalisedError, LossInputError, NonFiniteFeaturesError
from .gcl import (
    FastCLIPV0Autograd,
    FastCLIPV0Loss,
    FastCLIPV1Autograd,
    FastCLIPV1Loss,
    FastCLIPV3Autograd,
    FastCLIPV3Loss,
)
from .individual import FastCLIPV2Autograd, FastCLIPV2Loss
from .ntxent import NTXentLoss, NTXentOptions
from .openclip import OpenCLIPAutograd, OpenCLIPLoss
from .options import (
    ConstantTemperatureOptions,
    GlobalTemperatureOptions,
    IndividualTemperatureOptions,
    LossOptionError,
    OpenCLIPOptions,
    RGCLOptions,
    SigLIPOptions,
    TempNetOptions,
)
from .schedules import GammaSchedule
from .sharded_state import ShardedSampleState, reshard_for_rank, reshard_states
from .siglip import SigLIPAutograd, SigLIPLoss
from .tempnet import TempNetAutograd, TempNetLoss


@dataclasses.dataclass(frozen=True)
class LossEntry:
    """A loss's options dataclass and its implementations: ``fused`` (a hand-written backward, pairwise.py) and/or
    ``autograd`` (an objective written as autograd code, objective.py)."""

    options: type
    fused: type | None = None
    autograd: type | None = None


LOSSES = {
    "openclip": LossEntry(OpenCLIPOptions, OpenCLIPLoss, OpenCLIPAutograd),
    "fastclip-v0": LossEntry(GlobalTemperatureOptions, FastCLIPV0Loss, FastCLIPV0Autograd),
    "fastclip-v1": LossEntry(ConstantTemperatureOptions, FastCLIPV1Loss, FastCLIPV1Autograd),
    "fastclip-v2": LossEntry(IndividualTemperatureOptions, FastCLIPV2Loss, FastCLIPV2Autograd),
    "fastclip-v3": LossEntry(RGCLOptions, FastCLIPV3Loss, FastCLIPV3Autograd),
    "fastclip-tempnet": LossEntry(TempNetOptions, TempNetLoss, TempNetAutograd),
    "siglip": LossEntry(SigLIPOptions, SigLIPLoss, SigLIPAutograd),
    "dcl": LossEntry(DCLOptions, autograd=DCLLoss),
    "ntxent": LossEntry(NTXentOptions, autograd=NTXentLoss),
}

# Options a loss rejects on purpose, with the reason (added to the TypeError).
QUEUE_WHY_NOT = (
    "not implemented for per-sample temperatures: queued features would enter each sample's τ update and "
    "running bound; use dcl, openclip, fastclip-v0, v1 or v3"
)
WHY_NOT = {
    "fastclip-v2": {
        "queue_size": QUEUE_WHY_NOT,
        "similarity": "the temperature-free map replaces a temperature, and v2's per-sample τ_i "
        "exist to adapt exactly that; use openclip or fastclip-v0/v1/v3",
    },
    "fastclip-tempnet": {
        "similarity": "the temperature network predicts exactly what the map replaces",
        "queue_size": QUEUE_WHY_NOT,
    },
    "siglip": {
        "similarity": "not implemented for the sigmoid loss",
        "queue_size": "not implemented for the sigmoid loss",
    },
}
# similarity="atanh" is the temperature-free loss: no temperature unless one is given (then it scales 2·atanh).
TEMPERATURE_FREE_DEFAULTS = {"temperature": 1.0, "learn_temperature": False}


class UnknownLossError(ValueError):
    """A loss name that is neither in LOSSES nor an importable ``module:attribute`` naming a LossEntry."""


_IMPORTED: dict[str, LossEntry] = {}  # "module:attribute" -> its LossEntry, imported once per process


def loss_entry(name: str) -> LossEntry:
    """``LOSSES[name]``, or for ``"module:attribute"`` (a colon) the LossEntry that a user's module defines: their
    own objective, built, checked, trained and resharded as the library's own. The module is imported from
    sys.path (PYTHONPATH); raises UnknownLossError naming what is wrong."""
    if not isinstance(name, str):
        raise UnknownLossError(f"a loss name is text, got {type(name).__name__} {name!r}")
    if name in LOSSES:
        return LOSSES[name]
    if not is_import_name(name):
        raise UnknownLossError(
            f"unknown loss {name!r}; choose one of {sorted(LOSSES)}, or name your own as module:attribute "
            "(a fastclip.losses.LossEntry)"
        )
    if name not in _IMPORTED:
        from .user import import_entry

        _IMPORTED[name] = import_entry(name)
    return _IMPORTED[name]


def is_import_name(name: str) -> bool:
    """Whether ``name`` has the form of ``package.module:attribute`` (Python identifiers around one colon)."""
    module_name, colon, attribute = name.partition(":")
    return bool(colon) and attribute.isidentifier() and all(part.isidentifier() for part in module_name.split("."))


def option_names(name: str) -> set[str]:
    """The options build_loss(name, ...) takes."""
    return {f.name for f in dataclasses.fields(loss_entry(name).options)}


def config_option_names(name: str) -> set[str]:
    """The options of ``name`` that a config sets (not LIBRARY_ONLY: data_size, unimodal, ... are the caller's)."""
    return {f.name for f in dataclasses.fields(loss_entry(name).options) if f.metadata.get("config_key", True)}


def config_options() -> dict[str, object]:
    """Every loss's options but the LIBRARY_ONLY ones (options.py), in LOSSES order, each with its type: the keys
    of the trainer's loss section. One name has one type in every loss that takes it."""
    types: dict[str, object] = {}
    for entry in LOSSES.values():
        hints = typing.get_type_hints(entry.options)
        for f in dataclasses.fields(entry.options):
            if f.metadata.get("config_key", True) and types.setdefault(f.name, hints[f.name]) != hints[f.name]:
                raise TypeError(f"loss option {f.name} is {types[f.name]} in one loss, {hints[f.name]} in another")
    return types


class UnknownLossOptions(TypeError):
    """build_loss given options the loss does not take; ``unknown``, ``accepted`` and ``why`` (key -> reason) let a
    caller name them in its own terms (the trainer: config keys)."""

    def __init__(self, name: str, unknown: list[str], accepted: set[str]):
        self.name, self.unknown, self.accepted = name, unknown, accepted
        self.why = {key: reason for key, reason in WHY_NOT.get(name, {}).items() if key in unknown}
        why = "".join(f"; {key}: {reason}" for key, reason in self.why.items())
        super().__init__(f"loss {name!r} does not take option(s) {unknown}; it takes {sorted(accepted)}{why}")


def build_loss(name: str, *, data_size: int | None = None, **options) -> nn.Module:
    """The loss ``name`` with its options; ``data_size`` is required by the FastCLIP versions, ignored by openclip."""
    built = _options(name, data_size, options)
    return implementation(name, loss_entry(name), built)(built)


def check_options(name: str, **options) -> None:
    """The value checks build_loss makes of the options ``name`` takes, before the run's data and towers exist (a
    config check): what is not known yet (data_size, embed_dim) stands in as 1, and options the loss does not take
    are left to build_loss, whose error names them. Raises LossOptionError (one option) or ValueError."""
    taken = {key: value for key, value in options.items() if key in option_names(name)}
    if "embed_dim" in option_names(name) and taken.get("embed_dim") is None:
        taken["embed_dim"] = 1
    _options(name, taken.pop("data_size", None) or 1, taken)


def resolved_options(name: str, **options) -> dict:
    """The options build_loss(name, ...) would use, defaults filled in (None: the default; data_size stands in as
    1): two configs that differ only in spelling a default out resolve equal. Options the loss does not take are
    left out."""
    taken = {key: value for key, value in options.items() if key in option_names(name) and key != "data_size"}
    return dataclasses.asdict(_options(name, 1, taken))


def _options(name: str, data_size: int | None, options: dict):
    """``options`` (None: the default) as the loss's options dataclass, which checks every value."""
    entry = loss_entry(name)
    accepted = option_names(name)
    given = {key: value for key, value in options.items() if value is not None}
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise UnknownLossOptions(name, unknown, accepted)
    if given.get("similarity") == "atanh":
        for key, value in TEMPERATURE_FREE_DEFAULTS.items():
            if key in accepted and (key != "learn_temperature" or name == "openclip"):  # v0/v3 learn τ on top
                given.setdefault(key, value)
    if "data_size" in accepted:
        if data_size is None:
            raise TypeError(f"loss {name!r} needs data_size= (1 + the largest data index)")
        given["data_size"] = data_size
    return entry.options(**given)


def implementation(name: str, entry: LossEntry, options) -> type:
    """The class that runs ``options``: the one ``impl`` names, else fused where the loss has it and it implements
    every option given, else autograd."""
    autograd_only = options.autograd_only()
    if options.impl == "fused" or (options.impl is None and entry.fused is not None and not autograd_only):
        if entry.fused is None:
            raise ValueError(f"loss {name!r} has no fused implementation (impl 'fused'); use impl 'autograd'")
        if autograd_only:
            raise ValueError(
                f"loss {name!r}: option(s) {autograd_only} exist in the autograd implementation only; "
                "use impl 'autograd' (or leave impl unset)"
            )
        return entry.fused
    if entry.autograd is None:
        raise ValueError(f"loss {name!r} has no autograd implementation yet; use impl 'fused'")
    return entry.autograd


__all__ = [
    "build_loss",
    "check_options",
    "config_options",
    "option_names",
    "config_option_names",
    "LossOptionError",
    "UnknownLossOptions",
    "LOSSES",
    "LossEntry",
    "UnknownLossError",
    "is_import_name",
    "loss_entry",
    "DCLLoss",
    "NTXentLoss",
    "ContrastiveLoss",
    "SampleStateLoss",
    "OpenCLIPLoss",
    "FastCLIPV0Loss",
    "FastCLIPV1Loss",
    "FastCLIPV2Loss",
    "FastCLIPV3Loss",
    "TempNetLoss",
    "SigLIPLoss",
    "LossInputError",
    "NonFiniteFeaturesError",
    "FeaturesNotNormalisedError",
    "GammaSchedule",
    "ShardedSampleState",
    "reshard_states",
    "reshard_for_rank",
]
