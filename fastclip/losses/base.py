"""What every loss shares: the call sequence (validate, gather, compute), the temperature parameter, metrics,
byte counts, and (for the FastCLIP versions) the sharded per-sample state kept in ``get_extra_state``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from .batch import GlobalBatch
from .comm import Comm
from .errors import LossInputError
from .options import CommonOptions, SampleStateOptions
from .pairwise import exact_float32
from .sharded_state import ShardedSampleState, StateFieldsMismatch
from .validation import (
    NEEDS_MOMENTUM,
    NO_ROW,
    SIGNATURE_CHANGED,
    InputChecks,
    header_device,
    parameter_fingerprint,
    validate_mode,
    value_words,
)

LOGIT_SCALE_MAX = math.log(100.0)  # OpenCLIP's clamp: τ >= 0.01


class ContrastiveLoss(nn.Module):
    """Base of all losses: ``loss_fn(image_features, text_features, indices, *, epoch=None) -> scalar``."""

    name = ""
    impl = "fused"  # the hand-written backward; "autograd" for the objectives of objective.py
    uses_sample_state = False
    needs_momentum = False  # the call must pass momentum= (distill_alpha)
    needs_indices = False
    min_global_batch = 1
    # a training batch needs a negative for each anchor: at one sample InfoNCE is 0 with no gradient, and the
    # others have nothing to average (the trainer refuses it before a step; siglip's lone positive still trains)
    min_training_batch = 2

    @property
    def uses_momentum_features(self) -> bool:
        """Whether a call reads momentum= features: distillation's targets, or a queue's entries (MoCo)."""
        return self.needs_momentum or getattr(self, "queue", None) is not None

    def __init__(self, options: CommonOptions):
        super().__init__()
        self.options = options
        self.group = options.group
        self.epoch = 0
        self._metrics: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]] = {}
        self.comm_bytes: dict[str, int] = {}
        self.validate = validate_mode(options.validate)  # "eager", "deferred" or "off" (validation.py)
        self.input_checks = InputChecks(getattr(options, "data_size", None))
        # set at the first call: a loss outside DDP whose ranks initialised it differently (the temperature
        # network's heads, seeded per rank) would otherwise train a different loss on each rank
        self._parameters_shared = False
        self._step_begun = False  # begin_step() until commit_step() or rollback()

    # -- per call ---------------------------------------------------------------------------------------------
    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        indices: torch.Tensor | None = None,
        *,
        epoch: int | None = None,
        momentum: tuple[torch.Tensor, torch.Tensor] | None = None,
        groups: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-rank surrogate loss; backward it on every rank and average parameter gradients over ranks.

        ``momentum``: the (image, text) features of the same rows from a momentum (EMA) copy of the towers, without
        autograd: a feature queue then holds them (MoCo), and ``distill_alpha`` mixes their softmax into the
        targets (ALBEF). They travel in the features' all_gather.

        ``groups``: int64 ``[B]`` group ids (several captions of one image, identical captions): rows of one group
        are positives of each other and never negatives (they leave the denominators, as copies of one sample do;
        siglip labels them +1). Without groups each sample is its own group.

        Safe inside ``torch.autocast`` and with TF32 enabled: autocast is off in here, similarities are computed
        in float32 (or float64) whatever the features' dtype, and float32 matmuls run in IEEE precision on CUDA,
        since a bf16 (or TF32) matmul with 1/τ = 100 applied is off by several %.
        """
        device_type = image_features.device.type if isinstance(image_features, torch.Tensor) else "cpu"
        with exact_float32(device_type):
            return self._forward(image_features, text_features, indices, epoch, momentum=momentum, groups=groups)

    def _forward(
        self, image_features, text_features, indices, epoch, comm: Comm | None = None, momentum=None, groups=None
    ):
        if epoch is not None:
            self.set_epoch(epoch)
        comm = comm or Comm.resolve(self.group)
        if isinstance(indices, torch.Tensor) and isinstance(image_features, torch.Tensor):
            indices = indices.to(image_features.device, non_blocking=True)  # data loaders hand them over on CPU
        checks = self.input_checks
        given = (image_features, text_features, indices)  # (a redo is made with what the caller gave)
        given_momentum, given_groups = momentum, groups
        need_momentum = self.needs_momentum and self.training  # (eval mode: the in-batch objective)
        change = None
        if self.validate != "off" and comm.world_size > 1:
            change = checks.changed(comm, *given, momentum, groups, need_momentum, self.training)
        stand_in = change is not None
        if stand_in:  # the other ranks cannot know: join their all_gather with the agreed shapes and say so
            # (deferred mode may compute with it: its indices data_size, owned by no rank, read and write no state)
            image_features, text_features, indices, momentum, groups = checks.stand_in(
                header_device(comm, *given), getattr(self.options, "data_size", None) or 0
            )
        else:  # momentum and groups are checked here too: a rank alone refusing them would leave the others waiting
            self._check_structure(comm, image_features, text_features, indices, momentum, groups, need_momentum)
        groups = self._checked_groups(groups, image_features)
        if not self._parameters_shared and comm.world_size > 1:  # rank 0's τ and heads (DDP does this for models)
            comm.broadcast_from_first_(list(self.parameters()), header_device(comm, *given))
            self._parameters_shared = True
        # not needed (whatever was passed): not shipped
        indices = indices.to(torch.int64) if self.needs_indices and indices is not None else None
        if momentum is not None:
            momentum = tuple(m.detach().to(image_features.device) for m in momentum)
        words = self._value_words(comm, image_features, text_features, indices, stand_in, momentum)
        batch = comm.gather_batch(
            image_features, text_features, indices, header=words, momentum=momentum, groups=groups
        )
        if words is not None:
            if self.validate == "eager":  # before the loss writes its state
                # a rank's shapes changed (every rank sees its stand-in's flag): the handshake, then the call
                redo = checks.check_now(batch.header, batch.all_ids if self._negatives_from_batch() else None)
            elif stand_in:  # deferred: only this rank knows, so it reads the flags now (this call only)
                redo = checks.all_changed(batch.header)
                if not redo:
                    # the others compute with the stand-in: this call's collectives with them (in the mode they
                    # agreed on: an objective's collectives may differ between modes), then the error
                    was = self.training
                    self.train(checks.agreed_training())
                    try:
                        self._compute(comm, batch)
                    finally:
                        self.train(was)
                    raise LossInputError(
                        f"rank {comm.rank}: {self.name}'s inputs changed on this rank alone ({change}); with "
                        "validate='deferred' the ranks must change them at the same call (drop each epoch's last "
                        "partial batch, switch train()/eval() on every rank), or build the loss with "
                        "validate='eager', which checks every call on every rank; the other ranks stop in their "
                        "next collective"
                    )
            else:
                checks.record(batch.header)
                redo = False
            if redo:  # every rank changed at this call, or learnt of a change: the handshake together, then the call
                return self._forward(*given, None, comm, momentum=given_momentum, groups=given_groups)
        loss, metrics = self._compute(comm, batch)
        # a loss may hand its metrics over as a function of detached tensors: computed when first read (the
        # trainer reads them on logging steps only), so the other steps do not pay their small device ops
        self._metrics = metrics if callable(metrics) else {name: value.detach() for name, value in metrics.items()}
        self.comm_bytes = comm.bytes_moved()
        return loss

    def _negatives_from_batch(self) -> bool:
        """Whether a row's negatives come from the global batch alone, so a batch of one sample has none (checked in
        eager mode): not with a feature queue (its entries are negatives), nor in eval mode (a validation batch may
        be one image and its captions), nor for siglip (its sigmoid loss is defined over positives alone)."""
        return self.training and getattr(self, "queue", None) is None and self.name != "siglip"

    def _checked_groups(self, groups, image_features):
        """``groups`` as int64 on the features' device, or None; anything but integer ids ``[B]`` is refused (here
        only with validate off: the handshake refused it on every rank)."""
        if groups is None:
            return None
        rows = image_features.shape[0] if isinstance(image_features, torch.Tensor) else None
        if not isinstance(groups, torch.Tensor) or groups.shape != (rows,) or groups.is_floating_point():
            shape = tuple(groups.shape) if isinstance(groups, torch.Tensor) else type(groups).__name__
            raise LossInputError(f"{self.name}: groups must be integer ids [B] = [{rows}], got {shape}")
        return groups.to(image_features.device, torch.int64)

    def _check_structure(
        self, comm: Comm, image_features, text_features, indices, momentum, groups, need_momentum: bool
    ) -> None:
        """The structure handshake (first call, or this rank's inputs changed); with validate off, only the indices
        and momentum features a loss needs."""
        if self.validate != "off":
            self.input_checks.structure(
                comm,
                image_features,
                text_features,
                indices,
                momentum,
                groups,
                data_size=getattr(self.options, "data_size", None),
                need_indices=self.needs_indices,
                min_global_batch=self.min_global_batch,
                need_momentum=need_momentum,
                training=self.training,
            )
        elif self.needs_indices and indices is None:
            raise LossInputError(f"{self.name} needs indices (int64 [B] global data indices)")
        elif need_momentum and momentum is None:
            raise LossInputError(f"{self.name}: {NEEDS_MOMENTUM}")

    def _value_words(self, comm: Comm, image_features, text_features, indices, stand_in: bool, momentum=None):
        """The value checks' words, which ride in the feature all_gather's buffer (None with validate off)."""
        if self.validate == "off":
            return None
        # the parameters' sum, where eager mode reads it (deferred reads no words per call); else a zero word
        fingerprint = None
        if self.validate == "eager" and comm.world_size > 1 and self.options.check_parameters:
            fingerprint = parameter_fingerprint(list(self.parameters()))
        if fingerprint is None:
            fingerprint = self.input_checks.zero_word(image_features.device)
        data_size = getattr(self.options, "data_size", None)
        words = value_words(image_features, text_features, indices, data_size, fingerprint, momentum)
        if stand_in:  # the flag alone: the stand-in's zeros and indices are no input error of the caller's
            words = torch.cat([words.new_full((1,), SIGNATURE_CHANGED), words.new_full((2,), NO_ROW), words[3:]])
        return words

    def _compute(self, comm: Comm, batch: GlobalBatch) -> tuple[torch.Tensor, dict | Callable[[], dict]]:
        raise NotImplementedError

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        """The last call's metrics (detached 0-d tensors, a few losses add small vectors)."""
        if callable(self._metrics):
            try:
                with torch.no_grad():
                    self._metrics = self._metrics()
            except AttributeError as e:  # nn.Module.__getattr__ would report it as "no attribute 'metrics'"
                raise RuntimeError(f"{self.name}: computing the metrics failed: {e}") from e
        return self._metrics

    def __getstate__(self):
        _ = self.metrics  # computed now: a function cannot be pickled
        return super().__getstate__()

    def check_inputs(self, *, features: bool = True) -> None:
        """Raise the input error of the first bad call since the last check (validate="deferred"; one host read,
        the same error on every rank; not a collective). ``features=False``: forget non-finite features (a NaN
        guard skipped those steps) and raise only for an out-of-range index."""
        self.input_checks.raise_if_bad(features=features, call_number=True)

    @property
    def _assert_indices(self) -> bool:
        """Assert on the device that indices are in range (only when nothing else checks them)."""
        return self.validate != "deferred"

    def extra_repr(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in vars(self.options).items() if k != "group")
        return f"name={self.name!r}, {options}"

    # -- one training step's writes, undone when the step is not taken (the trainer's NaN guard) ---------------
    def journaled_parts(self, device=None) -> list:
        """The state the calls write (the per-sample shard, a feature queue); each has ``journal`` and
        ``rollback(undo)``."""
        return []

    def begin_step(self, device=None) -> None:
        """Journal what the calls write from now on, until ``commit_step()`` or ``rollback()`` ends the step."""
        parts = self.journaled_parts(device)
        if any(part.journal for part in parts):  # (journaling on would keep every write since, unbounded)
            raise RuntimeError(
                f"{self.name}: begin_step() while the last step's writes are journaled: end that step first, "
                "commit_step() to keep them or rollback() to undo them"
            )
        for part in parts:
            part.journal = []
        self._step_begun = True

    def rollback(self, undo: torch.Tensor | None = None) -> None:
        """Undo the journaled writes (with ``undo``, a 0-d bool on the device: only where it is true, no host read)
        and end the step."""
        if not self._step_begun:  # (it undid nothing, silently)
            raise RuntimeError(
                f"{self.name}: rollback() without begin_step(): nothing was journaled; call loss_fn.begin_step() "
                "before the forward of a step you may undo"
            )
        for part in self.journaled_parts():
            part.rollback(undo)
            part.journal = None
        self._step_begun = False

    def commit_step(self) -> None:
        """Keep the journaled writes (the step was taken) and end the step: the calls after it journal nothing."""
        for part in self.journaled_parts():
            part.journal = None
        self._step_begun = False

    # -- schedule and temperature -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _init_logit_scale(self, temperature: float, learnable: bool, count: int = 0) -> None:
        """``logit_scale`` = log(1/τ): 0-d, or ``[count]`` (one τ per modality's anchors)."""
        value = torch.full((count,), math.log(1.0 / temperature)) if count else torch.tensor(math.log(1 / temperature))
        self.logit_scale = nn.Parameter(value, requires_grad=learnable)

    def temperature(self) -> torch.Tensor | None:
        """The global τ (detached) for logging (with one τ per modality: their geometric mean); None when τ is
        per sample."""
        scale = getattr(self, "logit_scale", None)
        return None if scale is None else torch.exp(-scale.detach().mean())

    def logit_scale_max(self) -> float:
        """The clamp of logit_scale: log(1/τ0) with τ0 the loss's tau_min where it has one, else ln 100."""
        tau_min = getattr(self.options, "tau_min", None)
        return LOGIT_SCALE_MAX if tau_min is None or self.name == "fastclip-v2" else math.log(1.0 / tau_min)

    def tau_param_names(self) -> list[str]:
        """Names of the learnable temperature parameters (all of this module's trainable parameters)."""
        return [name for name, param in self.named_parameters() if param.requires_grad]

    def clamp_(self) -> None:
        """Keep logit_scale in [0, log 1/τ0] (τ in [τ0, 1], τ0 = 0.01 by default as OpenCLIP's cap of 100); call
        after each optimizer step."""
        scale = getattr(self, "logit_scale", None)
        if scale is not None and scale.requires_grad:
            with torch.no_grad():
                scale.clamp_(0.0, self.logit_scale_max())

    def average_grads_(self) -> None:
        """Average this module's parameter gradients over the group (if the loss is not inside DDP)."""
        Comm.resolve(self.group).average_grads_(self.parameters())

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        """s = exp(logit_scale) = 1/τ in the compute dtype (autograd into logit_scale when it is learnable)."""
        return torch.exp(self.logit_scale.to(dtype))


class SampleStateLoss(ContrastiveLoss):
    """A FastCLIP loss with per-sample state sharded by owner rank (created on first use)."""

    uses_sample_state = True
    needs_indices = True
    min_global_batch = 2  # g averages over the N-1 negatives
    state_fields: dict[str, float] = {}

    def __init__(self, options: SampleStateOptions):
        super().__init__(options)
        self.gamma_schedule = options.gamma()
        self.reference = options.compat == "reference"
        self._state: ShardedSampleState | None = None  # plain tensors, not buffers: DDP must not broadcast them

    def initial_state_values(self) -> dict[str, float]:
        return dict(self.state_fields)

    def gamma(self) -> float:
        """γ of this epoch's schedule; 1 in eval mode, where u is the batch's own estimate (see store)."""
        return self.gamma_schedule(self.epoch) if self.training else 1.0

    def journaled_parts(self, device=None) -> list:
        return [self.sample_state(device=device)]

    def store(self, state: ShardedSampleState, slots, values: torch.Tensor, *, previous: torch.Tensor) -> None:
        """The batch's new state rows, written in training mode only. In eval mode (``loss_fn.eval()``, as for a
        validation loss) a call reads the state (v2's τ_i of the samples named) and leaves it as it was, as
        BatchNorm leaves its running statistics."""
        if self.training:
            state.write(slots, values, previous=previous)

    def _state_dtype(self, feature_dtype: torch.dtype | None) -> torch.dtype:
        if self.options.state_dtype is not None:
            return self.options.state_dtype
        return torch.float64 if feature_dtype == torch.float64 else torch.float32

    def sample_state(self, comm: Comm | None = None, *, device=None, dtype=None) -> ShardedSampleState:
        """This rank's shard, created for the current group on first use, moved to ``device``/``dtype`` if given."""
        comm = comm or Comm.resolve(self.group)
        here = (comm.world_size, comm.rank)
        if self._state is not None and (self._state.world_size, self._state.rank) != here and not self._state.used():
            self._state = None  # made before the process group (a state_dict() call), never written: made anew
        if self._state is None:
            self._state = ShardedSampleState(
                data_size=self.options.data_size,
                world_size=comm.world_size,
                rank=comm.rank,
                fields=self.initial_state_values(),
                device=self.options.state_device or device or "cpu",
                dtype=dtype or self._state_dtype(None),
            )
        elif (self._state.world_size, self._state.rank) != here:
            early = self._state.world_size == 1 < comm.world_size  # made before init_process_group
            if early and self._state.loaded:
                why = (
                    "it was loaded before init_process_group: load this rank's state after init_process_group (a "
                    "one-process checkpoint: reshard it to this world size first, fastclip reshard or "
                    "reshard_for_rank)"
                )
            elif early:
                why = (
                    "a call before init_process_group wrote it: call init_process_group before the loss's first call "
                    "(or reshard its state: reshard_for_rank)"
                )
            else:
                why = "reshard the state first (reshard_for_rank)"
            raise RuntimeError(
                f"{self.name}: sample state belongs to rank {self._state.rank} of {self._state.world_size} but this "
                f"call runs as rank {comm.rank} of {comm.world_size}; {why}"
            )
        state = self._state
        want_device = torch.device(self.options.state_device or device or state.device)
        want_dtype = dtype or state.dtype
        if state.device != want_device or state.dtype != want_dtype:
            state.to_(want_device, want_dtype)
        return state

    def state_for_batch(self, comm: Comm, batch: GlobalBatch) -> ShardedSampleState:
        return self.sample_state(comm, device=batch.image.device, dtype=self._state_dtype(batch.image.dtype))

    def get_extra_state(self) -> dict:
        return self.sample_state().state_dict()

    def set_extra_state(self, state: dict) -> None:
        saved_dtype = next(iter(state["fields"].values())).dtype if state.get("fields") else None
        try:
            self.sample_state(dtype=self.options.state_dtype or saved_dtype).load_state_dict(state)
        except StateFieldsMismatch as e:  # other fields: the state of another objective
            raise KeyError(
                f"{self.name}: {e.args[0]}: it was saved by another objective; load it into the loss it trained with"
            ) from None
