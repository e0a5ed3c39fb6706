"""Input checks that fail the same way on every rank.

Each rank describes its inputs in a small header (shapes, dtypes, the sum of each feature tensor, the
smallest and largest index), the headers are all_gathered (one tiny collective), and every rank runs the
same checks over all headers in the same order, so all ranks raise the same error with the same message and
none is left waiting in a later collective. Only when a value check fails (a non-finite sum, an index out of
range) is a second header gathered, with the offending row / position of each rank, to name it.
The happy path costs a handful of reductions, one tiny all_gather and one host sync per call
(``validate=False`` skips it all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .comm import Comm
from .errors import LossInputError, NonFiniteFeaturesError

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
_DESCRIPTOR = 4  # (ndim, size0, size1, dtype code) of one input


@dataclass(frozen=True)
class _Header:
    """One rank's header (float64 on the wire: every int here is far below 2**53)."""

    rank: int
    image: tuple[int, ...]
    text: tuple[int, ...]
    indices: tuple[int, ...]
    image_sum: float
    text_sum: float
    index_min: float
    index_max: float

    @classmethod
    def parse(cls, rank: int, values: list[float]) -> _Header:
        d = _DESCRIPTOR
        desc = [int(v) for v in values[: 3 * d]]
        return cls(rank, tuple(desc[:d]), tuple(desc[d : 2 * d]), tuple(desc[2 * d :]), *values[3 * d :])


def _describe(x) -> list[int]:
    if not isinstance(x, torch.Tensor):
        return [-1, -1, -1, 0]
    sizes = list(x.shape[:2]) + [-1] * (2 - min(x.dim(), 2))
    return [x.dim(), *sizes, _DTYPE_CODES.get(x.dtype, _OTHER)]


def _is_features(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype in FEATURE_DTYPES and x.numel() > 0


def _is_indices(x, length: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 1 and x.dtype in INDEX_DTYPES and x.shape[0] == length > 0


def _header_device(comm: Comm, *inputs) -> torch.device:
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    if comm.backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_header(comm: Comm, image, text, indices) -> torch.Tensor:
    """``[descriptors (12), image sum, text sum, min index, max index]`` as float64, on the inputs' device.

    A tensor's sum is NaN/Inf iff it holds a NaN/Inf (L2-normalised features cannot overflow it).
    """
    device = _header_device(comm, image, text, indices)
    static = torch.tensor(_describe(image) + _describe(text) + _describe(indices), dtype=torch.float64, device=device)
    nothing = torch.zeros((), dtype=torch.float64, device=device)
    sums = [x.detach().sum(dtype=torch.float64) if _is_features(x) else nothing for x in (image, text)]
    rows = image.shape[0] if _is_features(image) else -1
    if _is_indices(indices, rows):
        low, high = torch.aminmax(indices)
        bounds = [low.to(torch.float64), high.to(torch.float64)]
    else:
        bounds = [nothing, nothing]
    return torch.cat([static, torch.stack(sums + bounds)])


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
    if ndim == -1 and code == 0:
        return "indices must be an int64 [B] tensor of global data indices, got no tensor" if need_indices else None
    if code not in _INDEX_CODES:
        return f"indices must be an integer tensor (int64), got dtype {_NAMES[code]}"
    if ndim != 1 or length != h.image[1]:
        return f"indices must be a 1-D tensor of length B={h.image[1]}, got a {_shape(h.indices)}"
    return None


def check_structure(headers: list[_Header], *, need_indices: bool, min_global_batch: int) -> None:
    """Shapes and dtypes of every rank, then agreement across ranks; raises the first problem."""
    for h in headers:
        problem = _structure_error(h, need_indices)
        if problem:
            raise LossInputError(f"rank {h.rank}: {problem}")
    for what, pick in (
        ("local batch size B", lambda h: h.image[1]),
        ("feature size d", lambda h: h.image[2]),
        ("feature dtype", lambda h: _NAMES[h.image[3]]),
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


def check_details(details: list[list[int]], *, data_size: int | None) -> None:
    for rank, (image_row, text_row, _, _) in enumerate(details):
        for name, row in (("image_features", image_row), ("text_features", text_row)):
            if row >= 0:
                raise NonFiniteFeaturesError(f"rank {rank}: {name} has non-finite values (NaN/Inf), first in row {row}")
    for rank, (_, _, pos, value) in enumerate(details):
        if pos >= 0:
            raise LossInputError(f"rank {rank}: indices[{pos}] = {value} is out of range [0, data_size={data_size})")


def validate_inputs(
    comm: Comm, image, text, indices, *, data_size: int | None, need_indices: bool, min_global_batch: int = 2
) -> None:
    """Raise the same LossInputError on every rank if any rank's inputs are bad (a collective: all ranks call it)."""
    header = build_header(comm, image, text, indices)
    headers = [_Header.parse(r, v) for r, v in enumerate(comm.all_gather(header, ledger_key="header").tolist())]
    check_structure(headers, need_indices=need_indices, min_global_batch=min_global_batch)
    if any(_values_suspect(h, data_size) for h in headers):  # the same decision on every rank
        details = comm.all_gather(_detail_header(image, text, indices, data_size), ledger_key="header")
        check_details(details.tolist(), data_size=data_size)
