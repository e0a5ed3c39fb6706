"""Counting the wire bytes of collectives made by code we do not own (e.g. open_clip's ClipLoss), with the
same ring formulas as ``comm.Comm``: for the benchmark and the tests' byte comparisons."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class CollectiveByteCounter:
    """Context manager counting the wire bytes of torch.distributed calls made inside it, by the same ring
    formulas as ``Comm`` — to measure losses we do not own (e.g. open_clip's ClipLoss, whose autograd
    all_gather backward is a reduce_scatter on NCCL and K scatters on gloo).

        with CollectiveByteCounter() as counter:
            loss = clip_loss(img, txt, scale); loss.backward()
        counter.bytes  # {"all_gather": ..., "reduce_scatter": ..., "scatter": ..., ...}
        counter.seconds  # wall time spent inside each kind of call
    """

    _FUNCTIONS = (
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "scatter",
        "all_to_all",
        "all_to_all_single",
    )

    def __init__(self, group=None):
        self.group = group
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}  # how many times each collective was called
        self.seconds: dict[str, float] = {}  # wall time inside each (the wait, for blocking calls)
        self._saved: dict[str, object] = {}

    @staticmethod
    def _nbytes(tensors) -> int:
        if isinstance(tensors, torch.Tensor):
            return tensors.numel() * tensors.element_size()
        return sum(t.numel() * t.element_size() for t in tensors)

    def _wire_bytes(self, name: str, args, kwargs) -> int:
        k, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if name in ("all_gather", "all_gather_into_tensor", "all_gather_single"):
            return (k - 1) * self._nbytes(args[0]) // k  # output: list or flat tensor
        if name == "all_reduce":
            return 2 * (k - 1) * self._nbytes(args[0]) // k
        if name in ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"):
            return (k - 1) * self._nbytes(args[1]) // k  # input: list or flat tensor
        if name == "scatter":
            src = kwargs.get("src", args[2] if len(args) > 2 else 0)
            chunks = kwargs.get("scatter_list", args[1] if len(args) > 1 else None)
            return (k - 1) * self._nbytes(chunks) // k if rank == src and chunks else 0
        return (k - 1) * self._nbytes(args[1]) // k  # all_to_all*: input

    def __enter__(self):
        for name in self._FUNCTIONS:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                self.bytes[_name] = self.bytes.get(_name, 0) + self._wire_bytes(_name, args, kwargs)
                self.calls[_name] = self.calls.get(_name, 0) + 1
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.seconds[_name] = self.seconds.get(_name, 0.0) + time.perf_counter() - start

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())
