"""Input checks that fail the same way on every rank, without a collective or a host sync of their own.

Two kinds of check:

* **Structure** (shapes and dtypes of the features, indices, momentum features and groups; agreement of B, d,
  dtype, data_size, which optional inputs are given and the loss's train/eval mode across ranks). Each rank
  describes its inputs in a small header, the headers are all_gathered and every rank runs the same checks over
  all of them in the same order, so all ranks raise the same error and none is left waiting in a later
  collective. This handshake runs
  on the first call and again when an input signature changes; shapes are host metadata, so telling "unchanged"
  costs nothing. The other ranks cannot see one rank's change without a collective of their own. In eager mode
  (multi-rank) that rank joins the feature all_gather with a stand-in of the agreed shapes and a flag in its
  words (SIGNATURE_CHANGED), which every rank reads with the value words: all then run the handshake, which
  raises alike where the ranks disagree (an uneven last batch on one rank), and the call is made again where
  they changed together. In deferred mode nothing is read per call, so the ranks must change their shapes
  together (every rank's last batch smaller, or dropped): a rank whose signature changed sends the stand-in the
  same way and reads the flags (that call only); where every rank changed, all make the handshake, else that
  rank makes the call's collectives with the stand-in (its indices data_size: no state is read or written for
  them) and raises, naming the change, and the others stop in their next collective (without the stand-in a
  change on one rank alone aborted inside the all_gather, or hung).
* **Values** (non-finite features, an index outside [0, data_size)). Every call, five int64 words per rank
  (first non-finite row of image and of text, first bad index position and its value, and in eager mode the
  loss parameters' sum) are computed on the device and ride at the end of the feature all_gather's buffer
  (comm.gather_batch): every rank then holds
  every rank's words, on the device, and decides the same. ``validate="eager"`` reads them back before the loss
  touches its state, every call (a host sync: ``InputChecks.check_now``). ``"deferred"`` keeps them on the device
  (``record``: no op per call, a fold every FOLD_EVERY calls) and leaves the read to the caller:
  ``raise_if_bad()`` (the trainer: on logging steps and before a checkpoint is written) raises the first bad
  index's error, else the first non-finite features', naming call, rank, row or index.
  In deferred mode an out-of-range index is simply owned by no rank (it reads and writes no state).
* **Parameters agree** (eager mode, several ranks, option ``check_parameters``): a rank whose τ or heads are not
  rank 0's (their float64 sums differ) gets the same error on every rank, naming average_grads_(): in a user's
  own loop that forgot it, each rank would otherwise optimise its own loss without a word. The check is exact
  (averaged steps agree bitwise) and sees a difference once one exists: the next call after an SGD step, after
  tens of steps where Adam at a small learning rate keeps a float32 τ bitwise equal meanwhile.

``validate=False`` ("off") skips both; an out-of-range index then trips a device-side assert.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from .comm import Comm
from .errors import FeaturesNotNormalisedError, LossInputError, NonFiniteFeaturesError

FEATURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32)
# Code 0: not a tensor (or absent); every dtype not listed: OTHER.
_DTYPE_CODES = {
    dt: code
    for code, dt in enumerate(
        (
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
        ),
        start=1,
    )
}
_OTHER = 99
_NAMES = {code: str(dt).replace("torch.", "") for dt, code in _DTYPE_CODES.items()} | {0: "none", _OTHER: "other"}
_FEATURE_CODES = {_DTYPE_CODES[dt] for dt in FEATURE_DTYPES}
_INDEX_CODES = {_DTYPE_CODES[dt] for dt in INDEX_DTYPES}
_INTEGER_CODES = {_DTYPE_CODES[dt] for dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)}
_DESCRIPTOR = 4  # (ndim, size0, size1, dtype code) of one input
_ABSENT = -2  # a descriptor's ndim for an optional input not given (None); -1: given, not a tensor
# described inputs, in header order: the features and indices, then the optional momentum features and groups
_INPUTS = ("image", "text", "indices", "momentum_image", "momentum_text", "groups")


@dataclass(frozen=True)
class _Header:
    """One rank's header (float64 on the wire: every int here is far below 2**53)."""

    rank: int
    image: tuple[int, ...]
    text: tuple[int, ...]
    indices: tuple[int, ...]
    momentum_image: tuple[int, ...]
    momentum_text: tuple[int, ...]
    groups: tuple[int, ...]
    image_sum: float
    text_sum: float
    index_min: float
    index_max: float
    data_size: float  # -1: none (a loss without per-sample indices)
    training: float  # 1: the loss is in train mode (it writes its state), 0: eval

    @classmethod
    def parse(cls, rank: int, values: list[float]) -> _Header:
        d, n = _DESCRIPTOR, len(_INPUTS)
        desc = [tuple(int(v) for v in values[i * d : (i + 1) * d]) for i in range(n)]
        return cls(rank, *desc, *values[n * d :])


def _describe(x) -> list[int]:
    if x is None:
        return [_ABSENT, -1, -1, 0]
    if not isinstance(x, torch.Tensor):
        return [-1, -1, -1, 0]
    sizes = list(x.shape[:2]) + [-1] * (2 - min(x.dim(), 2))
    return [x.dim(), *sizes, _DTYPE_CODES.get(x.dtype, _OTHER)]


def momentum_pair(momentum) -> tuple:
    """``momentum=`` as its (image, text) pair to describe: None stays absent; anything but a pair of two is
    described as two non-tensors (refused by the handshake, not read)."""
    if momentum is None:
        return None, None
    if isinstance(momentum, (tuple, list)) and len(momentum) == 2:
        return tuple(momentum)
    return object(), object()


def _descriptors(image, text, indices, momentum, groups) -> tuple[tuple[int, ...], ...]:
    """Each of _INPUTS described (host metadata): the header's first words, and the signature's."""
    return tuple(tuple(_describe(x)) for x in (image, text, indices, *momentum_pair(momentum), groups))


def signature(
    comm: Comm, image, text, indices, momentum=None, groups=None, need_momentum: bool = False, training: bool = True
) -> tuple:
    """The inputs' host metadata that the ranks agree on in the handshake (no device op), with whether the call
    needs momentum features (a distilling loss in training mode), the loss's train/eval mode (a rank alone in
    eval mode computes another objective and writes no state: the ranks must switch together) and the world size
    last."""
    return _descriptors(image, text, indices, momentum, groups) + (need_momentum, training, comm.world_size)


def describe_change(agreed: tuple, now: tuple) -> str:
    """What differs between two signatures, in words (the first difference)."""
    for name, old, new in zip(_INPUTS, agreed, now):
        if old != new:
            return f"{name}: {_given(old) if old[0] != _ABSENT else 'not given'} -> " + (
                _given(new) if new[0] != _ABSENT else "not given"
            )
    mode = lambda training: "train" if training else "eval"  # noqa: E731
    if agreed[-2] != now[-2]:
        return f"the loss's mode: {mode(agreed[-2])}() -> {mode(now[-2])}()"
    return "momentum= (needed or not)"


def _is_features(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype in FEATURE_DTYPES and x.numel() > 0


def _is_indices(x, length: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 1 and x.dtype in INDEX_DTYPES and x.shape[0] == length > 0


def header_device(comm: Comm, *inputs) -> torch.device:
    """The device of the first tensor among the inputs; without one, the backend's (CUDA under NCCL)."""
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    if comm.backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_header(
    comm: Comm, image, text, indices, momentum=None, groups=None, data_size: int | None = None, training: bool = True
) -> torch.Tensor:
    """``[descriptors (6 x 4), image sum, text sum, min index, max index, data_size, training]`` as float64, on the
    inputs' device.

    A tensor's sum is NaN/Inf iff it holds a NaN/Inf (L2-normalised features cannot overflow it).
    """
    device = header_device(comm, image, text, indices)
    described = [v for desc in _descriptors(image, text, indices, momentum, groups) for v in desc]
    static = torch.tensor(described, dtype=torch.float64, device=device)
    nothing = torch.zeros((), dtype=torch.float64, device=device)
    sums = [x.detach().sum(dtype=torch.float64) if _is_features(x) else nothing for x in (image, text)]
    rows = image.shape[0] if _is_features(image) else -1
    if _is_indices(indices, rows):
        low, high = torch.aminmax(indices)
        bounds = [low.to(torch.float64), high.to(torch.float64)]
    else:
        bounds = [nothing, nothing]
    size = torch.full((), -1 if data_size is None else data_size, dtype=torch.float64, device=device)
    mode = torch.full((), float(training), dtype=torch.float64, device=device)
    return torch.cat([static, torch.stack(sums + bounds + [size, mode])])


def _detail_header(image, text, indices, data_size: int | None) -> torch.Tensor:
    """Error path only: ``[first non-finite row of image, of text, first bad index position, its value]``."""
    device = image.device
    out = torch.full((4,), -1, dtype=torch.int64, device=device)
    for slot, x in enumerate((image, text)):
        bad_rows = ~torch.isfinite(x.detach()).all(dim=1)
        if bool(bad_rows.any()):
            out[slot] = int(bad_rows.nonzero()[0, 0])
    if data_size is not None and _is_indices(indices, image.shape[0]):
        bad = ((indices < 0) | (indices >= data_size)).nonzero()
        if bad.numel():
            out[2], out[3] = int(bad[0, 0]), int(indices[bad[0, 0]])
    return out


def _shape(desc: tuple[int, ...]) -> str:
    ndim, s0, s1, _ = desc
    if ndim < 0:
        return "not a tensor"
    shown = (s0, s1)[:ndim]
    return f"{ndim}-D tensor of shape [{', '.join(map(str, shown))}{', ...' if ndim > 2 else ''}]"


def _structure_error(h: _Header, need_indices: bool) -> str | None:
    for name, desc in (("image_features", h.image), ("text_features", h.text)):
        ndim, _, _, code = desc
        if ndim != 2:
            return f"{name} must be a 2-D [B, d] tensor, got a {_shape(desc)}"
        if code not in _FEATURE_CODES:
            return f"{name} must be floating point (float16/bfloat16/float32/float64), got {_NAMES[code]}"
    if h.image[3] != h.text[3]:
        return f"image_features and text_features dtypes differ: {_NAMES[h.image[3]]} vs {_NAMES[h.text[3]]}"
    if h.image[1:3] != h.text[1:3]:
        return (
            f"image_features and text_features shapes differ: [{h.image[1]}, {h.image[2]}] vs "
            f"[{h.text[1]}, {h.text[2]}]"
        )
    ndim, length, _, code = h.indices
    if ndim in (-1, _ABSENT):
        if not need_indices:
            return None
        return "indices must be an int64 [B] tensor of global data indices, got none or not a tensor (torch.as_tensor)"
    if code not in _INDEX_CODES:
        return f"indices must be an integer tensor (int64), got dtype {_NAMES[code]}"
    if ndim != 1 or length != h.image[1]:
        return f"indices must be a 1-D tensor of length B={h.image[1]}, got a {_shape(h.indices)}"
    return None


NEEDS_MOMENTUM = (
    "distill_alpha needs the momentum model's features: loss_fn(image, text, indices, "
    "momentum=(momentum_image, momentum_text)) (the trainer: model.ema_momentum)"
)


def _optional_error(h: _Header, need_momentum: bool) -> str | None:
    """momentum= (a pair of float [B, d] tensors, any float dtype: they are cast to the features') and groups=
    (integer ids [B]); None where they are right or absent."""
    given = [desc[0] != _ABSENT for desc in (h.momentum_image, h.momentum_text)]
    if not any(given) and need_momentum:
        return NEEDS_MOMENTUM
    if any(given):
        for name, desc in (("image", h.momentum_image), ("text", h.momentum_text)):
            ndim, _, _, code = desc
            if ndim == -1:
                return "momentum must be a pair (momentum_image, momentum_text) of [B, d] tensors"
            if ndim != 2 or code not in _FEATURE_CODES or desc[1:3] != h.image[1:3]:
                return (
                    f"momentum {name} features must be a float tensor of the features' shape [{h.image[1]}, "
                    f"{h.image[2]}], got {_given(desc)}"
                )
    ndim, length, _, code = h.groups
    if ndim != _ABSENT and (ndim != 1 or length != h.image[1] or code not in _INTEGER_CODES):
        return f"groups must be integer ids [B] = [{h.image[1]}], got {_given(h.groups)}"
    return None


def _given(desc: tuple[int, ...]) -> str:
    return "something that is not a tensor" if desc[0] < 0 else f"a {_shape(desc)} of {_NAMES[desc[3]]}"


def check_structure(
    headers: list[_Header], *, need_indices: bool, min_global_batch: int, need_momentum: bool = False
) -> None:
    """Shapes and dtypes of every rank, then agreement across ranks; raises the first problem."""
    for h in headers:
        problem = _structure_error(h, need_indices) or _optional_error(h, need_momentum)
        if problem:
            raise LossInputError(f"rank {h.rank}: {problem}")
    for what, pick in (
        ("local batch size B", lambda h: h.image[1]),
        ("feature size d", lambda h: h.image[2]),
        ("feature dtype", lambda h: _NAMES[h.image[3]]),
        ("data_size", lambda h: int(h.data_size) if h.data_size >= 0 else None),
        ("momentum= (given or not)", lambda h: "given" if h.momentum_image[0] != _ABSENT else "not given"),
        ("groups= (given or not)", lambda h: "given" if h.groups[0] != _ABSENT else "not given"),
        ("the loss's mode (train() or eval(): every rank must switch)", lambda h: "train" if h.training else "eval"),
    ):
        values = [pick(h) for h in headers]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {h.rank}: {v}" for h, v in zip(headers, values))
            raise LossInputError(f"{what} differs across ranks ({per_rank}); every rank must pass the same")
    global_batch = sum(h.image[1] for h in headers)
    if global_batch < min_global_batch:
        raise LossInputError(f"global batch has {global_batch} samples; this loss needs at least {min_global_batch}")


def _values_suspect(h: _Header, data_size: int | None) -> bool:
    if not (math.isfinite(h.image_sum) and math.isfinite(h.text_sum)):
        return True
    has_indices = h.indices[0] == 1
    return data_size is not None and has_indices and (h.index_min < 0 or h.index_max >= data_size)


def check_details(details: list[list[int]], *, data_size: int | None, momentum: bool = False) -> None:
    """``momentum``: the momentum features' rows were checked with the features' (value_words)."""
    also = " (or its momentum features)" if momentum else ""
    for rank, (image_row, text_row, _, _) in enumerate(details):  # first: the trainer skips such a step
        for name, row in (("image_features", image_row), ("text_features", text_row)):
            if 0 <= row < NOT_UNIT:
                raise NonFiniteFeaturesError(
                    f"rank {rank}: {name}{also} has non-finite values (NaN/Inf), first in row {row}"
                )
    for rank, (image_row, text_row, _, _) in enumerate(details):
        for name, row in (("image_features", image_row), ("text_features", text_row)):
            if row >= NOT_UNIT:
                raise FeaturesNotNormalisedError(
                    f"rank {rank}: {name} row {row - NOT_UNIT} is not L2-normalised (its norm is not 1 within "
                    f"{UNIT_TOLERANCE}): pass F.normalize(features, dim=-1), as the towers' encode_*(normalize=True) do"
                )
    for rank, (_, _, pos, value) in enumerate(details):
        if pos >= 0:
            raise LossInputError(f"rank {rank}: indices[{pos}] = {value} is out of range [0, data_size={data_size})")


def check_parameters_agree(fingerprints: list[int]) -> None:
    """Raise where a rank's loss parameters (τ, the temperature network's heads) are not rank 0's: each rank then
    optimises another loss, what forgetting to average their gradients does, silently, in a user's own loop."""
    values = [struct.unpack("<d", struct.pack("<q", word))[0] for word in fingerprints]
    for rank, value in enumerate(values[1:], start=1):
        # exact: averaged gradients step every rank's parameters to the same bits, and a rank that steps its own
        # may stay within any tolerance for many steps (Adam at a small lr_tau)
        if value == values[0] or (math.isnan(value) and math.isnan(values[0])):  # (NaN everywhere: not this error)
            continue
        which = "are not finite" if not math.isfinite(value) else "differ from rank 0's"
        raise LossInputError(
            f"rank {rank}'s loss parameters {which} (sums {value!r} on rank {rank}, {values[0]!r} on rank 0): "
            "average the loss's gradients over the ranks after backward() (loss_fn.average_grads_(), or the "
            "loss inside DDP) so that every rank steps the same τ; where they differ on purpose (local SGD, "
            "periodic model averaging), build the loss with check_parameters=False"
        )


VALIDATE_MODES = ("eager", "deferred", "off")
# [first non-finite image row, first non-finite text row, first bad index position, its value, the loss parameters'
# fingerprint (eager mode on several ranks: float64 bits; else 0)]
HEADER_WORDS = 5
FINGERPRINT = 4  # the fingerprint's position in a rank's words
NO_ROW = 2**62  # a position word's value when nothing is wrong (above any row: "first" is a minimum)
NOT_UNIT = 2**40  # added to a feature row's position when the row is finite but not L2-normalised
UNIT_TOLERANCE = 0.05  # |norm - 1| a row may have (bf16's rounding is far inside; an unnormalised tower far outside)
FOLD_EVERY = 64  # deferred mode keeps the last calls' words as they are and folds them this often (bounded memory)
SIGNATURE_CHANGED = -2  # a rank's first word when it sent a stand-in (its inputs' signature changed)
_CODE_DTYPES = {code: dt for dt, code in _DTYPE_CODES.items()}


def validate_mode(value) -> str:
    """The loss option ``validate``: True = "eager", False = "off", or one of VALIDATE_MODES."""
    if value is True or value is None:
        return "eager"
    if value is False:
        return "off"
    if value in VALIDATE_MODES:
        return value
    raise ValueError(f"loss option validate must be true, false or one of {VALIDATE_MODES}, got {value!r}")


@torch.no_grad()
def parameter_fingerprint(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The float64 sum of the loss's parameters as one int64 word (its bits), or None for a loss without any: ranks
    whose τ and heads stepped alike send the same word."""
    if not params:
        return None
    flat = params[0].detach().reshape(-1) if len(params) == 1 else torch.cat([p.detach().reshape(-1) for p in params])
    return flat.sum(dtype=torch.float64).view(torch.int64).reshape(1)


def value_words(
    image: torch.Tensor,
    text: torch.Tensor,
    indices: torch.Tensor | None,
    data_size: int | None,
    fingerprint: torch.Tensor,
    momentum: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """``[HEADER_WORDS]`` int64 on the features' device: the three first-bad positions (NO_ROW where nothing is
    wrong), the bad index's value (meaningless unless its position is) and ``fingerprint`` (a [1] int64 word).
    ``momentum``: its rows count with the features' (a NaN in the momentum towers made the loss NaN, unnamed).
    A score of small device ops (two passes over the features: a float64 sum per row, a norm per row in float32),
    no host sync: they run at every call, so their number is what they cost at small batches."""
    # A row's float64 sum is NaN/Inf iff the row holds a NaN/Inf: one pass over the features. x − x is 0 exactly
    # for a finite x and NaN otherwise (two ops; isfinite decomposes into four).
    sums = torch.stack([image.sum(dim=1, dtype=torch.float64), text.sum(dim=1, dtype=torch.float64)])
    if momentum is not None:
        sums = sums + torch.stack([m.sum(dim=1, dtype=torch.float64) for m in momentum])
    ok = (sums - sums) == 0
    checked = data_size is not None and indices is not None
    if checked:
        ok = torch.cat([ok, (indices.clamp(0, data_size - 1) == indices)[None]])  # [3, B]
    rows = torch.arange(ok.shape[1], device=ok.device)
    first = rows.masked_fill(ok, NO_ROW).amin(dim=1)  # the first bad row of each, NO_ROW where there is none
    # a finite row that is not L2-normalised (F.normalize forgotten: the loss would be a number that means nothing),
    # its position + NOT_UNIT in the same word (a non-finite row, below NOT_UNIT, is said first)
    norms = torch.stack(
        [torch.linalg.vector_norm(f if f.dtype == torch.float64 else f.float(), dim=1) for f in (image, text)]
    )
    unit = (norms - 1).abs() <= UNIT_TOLERANCE
    off_unit = (rows + NOT_UNIT).masked_fill(unit, NO_ROW).amin(dim=1)
    first = torch.cat([torch.minimum(first[:2], off_unit), first[2:]])
    tail = fingerprint.to(first.device)
    if not checked:  # (new_full, not new_tensor from a list: that copies host -> device)
        return torch.cat([first, first.new_full((2,), NO_ROW), tail])
    # gather, not indices[t]: indexing with a 0-d tensor reads it back to the host (a sync on CUDA)
    value = indices.gather(0, first[2:].clamp(max=ok.shape[1] - 1)).to(torch.int64)  # unread when none is bad
    return torch.cat([first, value, tail])


def _details(words: list[int]) -> list[list[int]]:
    """Host words of all ranks, split per rank, a NO_ROW position read as -1 (check_details's "nothing wrong")."""
    out = []
    for i in range(0, len(words), HEADER_WORDS):
        image_row, text_row, pos, value = words[i : i + FINGERPRINT]
        out.append([-1 if w == NO_ROW else w for w in (image_row, text_row, pos)] + [value])
    return out


class InputChecks:
    """Validation state of one loss: the input signature the ranks agreed on, and the gathered value words of the
    calls since the last check (deferred mode)."""

    def __init__(self, data_size: int | None):
        self.data_size = data_size
        self.signature: tuple | None = None
        self.calls = 0  # loss calls made (host counter)
        self._pending: list[torch.Tensor] = []  # [K, HEADER_WORDS] of the last calls, not yet folded
        self._zero_word: torch.Tensor | None = None  # the fingerprint word where none is sent (no op per call)
        # folded so far, per kind ("features", "index"): (the first bad call's number or -1, its words), on the device
        self._first_bad: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def zero_word(self, device: torch.device) -> torch.Tensor:
        """A [1] int64 zero on ``device``, made once: the fingerprint word of a call that sends none."""
        if self._zero_word is None or self._zero_word.device != device:
            self._zero_word = torch.zeros(1, dtype=torch.int64, device=device)
        return self._zero_word

    def structure(self, comm: Comm, image, text, indices, momentum=None, groups=None, **checks) -> None:
        """The structure handshake, when this rank's input signature differs from the agreed one."""
        need_momentum, training = checks.get("need_momentum", False), checks.get("training", True)
        current = signature(comm, image, text, indices, momentum, groups, need_momentum, training)
        if current != self.signature:
            validate_inputs(comm, image, text, indices, momentum, groups, **checks)  # raises alike on every rank
            self.signature = current

    def changed(
        self, comm: Comm, image, text, indices, momentum=None, groups=None, need_momentum=False, training=True
    ) -> str | None:
        """What differs (describe_change's words) between this rank's inputs and the signature the ranks last
        agreed on in this group (host metadata only), or None. One agreed at another world size (a call before
        init_process_group) is no agreement: every rank then makes the handshake."""
        agreed = self.signature is not None and self.signature[-1] == comm.world_size
        now = signature(comm, image, text, indices, momentum, groups, need_momentum, training)
        return describe_change(self.signature, now) if agreed and now != self.signature else None

    def agreed_training(self) -> bool:
        """The train/eval mode of the agreed signature."""
        return bool(self.signature[-2])

    def all_changed(self, words: torch.Tensor) -> bool:
        """Deferred mode, read by a rank whose inputs changed (a host read on that call only): whether every rank
        sent a stand-in, so that all of them know and make the handshake together (then, as check_now, the
        agreement is forgotten)."""
        every = all(w == SIGNATURE_CHANGED for w in words.reshape(-1).tolist()[::HEADER_WORDS])
        if every:
            self.signature = None
        return every

    def with_momentum(self) -> bool:
        """Whether the agreed calls pass momentum features (their rows are checked with the features')."""
        return self.signature is not None and self.signature[3][0] != _ABSENT

    def stand_in(self, device, index: int = 0) -> tuple:
        """Zeros of the agreed shapes (image, text, indices, momentum, groups; None where absent), for the
        all_gather the other ranks make; its indices all ``index`` (data_size: owned by no rank)."""
        image, text, indices, momentum_image, momentum_text, groups = self.signature[: len(_INPUTS)]

        def zeros(desc, fill=0):
            ndim, s0, s1, code = desc
            return torch.full([s0, s1][:ndim], fill, dtype=_CODE_DTYPES[code], device=device) if ndim > 0 else None

        momentum = None if momentum_image[0] == _ABSENT else (zeros(momentum_image), zeros(momentum_text))
        return zeros(image), zeros(text), zeros(indices, index), momentum, zeros(groups)

    def check_now(self, words: torch.Tensor, ids: torch.Tensor | None = None) -> bool:
        """Eager mode: read this call's gathered words (a host sync) and raise if any rank's are bad. True
        (nothing raised) where a rank sent a stand-in: its shapes changed, and every rank must run the handshake.
        ``ids``: the global batch's ``[N]`` data indices or group ids, read in the same sync: all equal, no row has
        a negative (a loss would return -inf or a number that means nothing)."""
        read = words.reshape(-1)
        if ids is not None:
            read = torch.cat([read, (ids.amax() - ids.amin()).reshape(1).to(read.dtype)])
        values = read.tolist()
        span = values.pop() if ids is not None else None
        if SIGNATURE_CHANGED in values[::HEADER_WORDS]:
            self.signature = None
            return True
        self.calls += 1
        check_details(_details(values), data_size=self.data_size, momentum=self.with_momentum())
        check_parameters_agree(values[FINGERPRINT::HEADER_WORDS])
        if span == 0 and ids.numel() > 1:  # (one row: min_global_batch's to refuse or not)
            raise LossInputError(
                f"all {ids.numel()} rows of the global batch are one sample (the same index, or group, on every "
                "row): no row has a negative; pass rows of distinct samples"
            )
        return False

    def record(self, words: torch.Tensor) -> None:
        """Deferred mode: keep this call's gathered ``[K, HEADER_WORDS]`` words (no device op per call; every
        FOLD_EVERY calls they are reduced to the first bad call's, a few device ops)."""
        self.calls += 1
        self._pending.append(words)
        if len(self._pending) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """The first bad call among the pending ones and those folded before, on the device (no host read: the
        pending calls are consecutive, so their numbers are an arange; picks go through index_select). An index
        error is kept apart from a features error, so a NaN call that a guard forgives cannot hide it."""
        if not self._pending:
            return
        words = torch.stack(self._pending)  # [C, K, HEADER_WORDS] of calls self.calls - C + 1 ... self.calls
        calls = torch.arange(self.calls - len(self._pending) + 1, self.calls + 1, device=words.device)
        self._pending = []
        # features: a non-finite row (a guard may forgive it); unit: a row not L2-normalised (never forgiven)
        kinds = (
            ("features", slice(0, 2), lambda w: (w >= 0) & (w < NOT_UNIT)),  # (a stand-in's flag is negative)
            ("unit", slice(0, 2), lambda w: (w >= NOT_UNIT) & (w != NO_ROW)),
            ("index", slice(2, 3), lambda w: w != NO_ROW),
        )
        for kind, columns, is_bad in kinds:
            kind_calls, kind_words = calls, words
            if kind in self._first_bad:
                kept_call, kept_words = self._first_bad[kind]
                kind_calls, kind_words = torch.cat([kept_call[None], calls]), torch.cat([kept_words[None], words])
            bad = is_bad(kind_words[:, :, columns]).any(dim=2).any(dim=1) & (kind_calls >= 0)  # [C]
            count = len(kind_calls)
            first = torch.where(bad, torch.arange(count, device=bad.device), count).amin()
            pick = first.clamp(max=count - 1).reshape(1)
            call = torch.where(first < count, kind_calls.index_select(0, pick)[0], -1)
            self._first_bad[kind] = (call, kind_words.index_select(0, pick)[0])

    def raise_if_bad(self, *, features: bool = True, call_number: bool = False) -> None:
        """One host read: raise for the calls since the last check (the same on every rank) and forget them. An
        out-of-range index is raised first (it is fatal), then a row not L2-normalised (fatal too), else the first
        non-finite-features call.
        ``features=False``: non-finite features are forgotten without raising (the caller's NaN guard skipped those
        steps); only an index error raises."""
        self._fold()
        if not self._first_bad:
            return
        picked = [self._first_bad[kind] for kind in ("index", "unit", "features")]
        self._first_bad = {}
        size = picked[0][1].numel()
        values = torch.cat([torch.stack([call for call, _ in picked])] + [w.reshape(-1) for _, w in picked]).tolist()
        (index_call, unit_call, feature_call), rest = values[:3], values[3:]
        index_words, unit_words, feature_words = rest[:size], rest[size : 2 * size], rest[2 * size :]
        if index_call >= 0:
            call, details = index_call, [[-1, -1, pos, value] for _, _, pos, value in _details(index_words)]
        elif unit_call >= 0:  # its rows alone: a non-finite row of the same call is the features kind's
            unit = lambda row: row if row >= NOT_UNIT else -1  # noqa: E731
            call, details = unit_call, [[unit(i), unit(t), -1, 0] for i, t, _, _ in _details(unit_words)]
        elif feature_call >= 0 and features:
            finite = lambda row: row if row < NOT_UNIT else -1  # noqa: E731
            call, details = feature_call, [[finite(i), finite(t), -1, 0] for i, t, _, _ in _details(feature_words)]
        else:
            return
        where = f"loss call {call}: " if call_number else ""
        try:
            check_details(details, data_size=self.data_size, momentum=self.with_momentum())
        except (LossInputError, NonFiniteFeaturesError) as error:
            raise type(error)(where + str(error)) from None


def validate_inputs(
    comm: Comm,
    image,
    text,
    indices,
    momentum=None,
    groups=None,
    *,
    data_size: int | None,
    need_indices: bool,
    min_global_batch: int = 2,
    need_momentum: bool = False,
    training: bool = True,
) -> None:
    """Raise the same LossInputError on every rank if any rank's inputs are bad (a collective: all ranks call it)."""
    header = build_header(comm, image, text, indices, momentum, groups, data_size, training)
    headers = [_Header.parse(r, v) for r, v in enumerate(comm.all_gather(header, ledger_key="header").tolist())]
    check_structure(headers, need_indices=need_indices, min_global_batch=min_global_batch, need_momentum=need_momentum)
    if any(_values_suspect(h, data_size) for h in headers):  # the same decision on every rank
        details = comm.all_gather(_detail_header(image, text, indices, data_size), ledger_key="header")
        check_details(details.tolist(), data_size=data_size)
