"""The one elementwise pass every loss makes over its ``[2, B, N]`` similarity blocks, ``exp((S − offset)·a)``
with its row sums, as plain PyTorch or as one ``torch.compile``'d kernel (``fused=True``: the loss option
``fused_kernels``).

Eager PyTorch reads and writes the blocks once per operation (subtract, scale, exp, sum: 3-4 passes); the compiled
kernel makes one, and inductor's vectorised exp is faster than ATen's on CPU. Measured on one CPU thread at
``[2, 1024, 2048]``: the row pass 10.1 → 2.8 ms, the column pass 8.7 → 2.0 ms; at ``[2, 64, 128]`` the
kernel's guards cost 10-20 µs more than they save (``benchmarks/bench_loss.py`` has the end-to-end figures). Compiling
takes a few seconds per variant (row sums, moments, a scale), once per process; inductor needs a C++ compiler on
CPU and Triton on CUDA. Where it cannot compile, the eager form runs and one warning says why."""

from __future__ import annotations

import warnings

import torch


def _differences(sim, offset, scale, in_place: bool):
    diff = sim.sub_(offset) if in_place else sim - offset
    return diff if scale is None else diff.mul_(scale)


# Three kernels, not one with flags: dynamo keeps at most 8 compiled variants per function (dtype, scale shape).
def _exp(sim, offset, scale, in_place: bool = False):
    """``exp(d)``, ``d = (sim − offset)·scale`` (``scale`` None: ``sim − offset``); ``in_place``: into ``sim``."""
    return _differences(sim, offset, scale, in_place).exp_()


def _exp_row_sums(sim, offset, scale, in_place: bool = False):
    """``(exp(d), Σ_row exp(d))``."""
    exp = _differences(sim, offset, scale, in_place).exp_()
    return exp, exp.sum(dim=-1)


def _exp_row_sums_moments(sim, offset, scale, in_place: bool = False):
    """``(exp(d), Σ_row exp(d), Σ_row d·exp(d))``."""
    diff = _differences(sim, offset, scale, in_place)
    exp = diff.exp()
    return exp, exp.sum(dim=-1), diff.mul_(exp).sum(dim=-1)


_compile_failure: str | None = None  # why torch.compile could not build a kernel in this process (then: eager)


class _Compiled:
    """``torch.compile(fn)`` built on first use; once the backend has failed to compile any kernel (no C++
    compiler, no Triton), the plain functions from then on, after one warning."""

    def __init__(self, fn):
        self.fn, self.compiled = fn, None

    def __call__(self, *args):
        global _compile_failure
        if _compile_failure is None:
            if self.compiled is None:
                # dynamic: one kernel for every B and N (a last, smaller batch compiles nothing new)
                self.compiled = torch.compile(self.fn, dynamic=True)
            try:
                return self.compiled(*args)
            except torch._dynamo.exc.BackendCompilerFailed as err:  # before anything ran: the eager form is safe
                _compile_failure = str(err).strip().splitlines()[0]
                warnings.warn(
                    f"loss option fused_kernels: torch.compile failed ({_compile_failure}); the loss runs its "
                    "eager kernels (same results, slower; set fused_kernels false to silence this)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return self.fn(*args)


def compile_failure() -> str | None:
    """Why the fused kernels run eagerly in this process, or None (not tried yet, or compiled)."""
    return _compile_failure


_EAGER = {(False, False): _exp, (True, False): _exp_row_sums, (True, True): _exp_row_sums_moments}
_FUSED = {key: _Compiled(kernel) for key, kernel in _EAGER.items()}


def shifted_exp(
    sim: torch.Tensor,
    offset: torch.Tensor,
    scale: torch.Tensor | None,
    *,
    row_sums: bool = False,
    moment: bool = False,
    in_place: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(exp(d), Σ_row exp(d) or None, Σ_row d·exp(d) or None)`` for ``d = (sim − offset)·scale`` (``offset``
    and ``scale`` broadcast over ``sim``; a moment comes with the row sums). ``in_place``: the eager form writes
    into ``sim`` (one ``[2, B, N]`` buffer fewer); the fused kernel always writes a new tensor, in one pass."""
    row_sums = row_sums or moment
    with torch.no_grad():
        if fused:
            # contiguous row/column values (a caller's may be strided views): inductor vectorises the inner
            # dimension only over contiguous loads (a strided [2, 1, N] offset made the column pass slower than eager)
            offset = offset.contiguous()
            scale = None if scale is None else scale.contiguous()
            out = _FUSED[row_sums, moment](sim.contiguous(), offset, scale)
        else:
            out = _EAGER[row_sums, moment](sim, offset, scale, in_place)
    if not row_sums:
        return out, None, None
    return out if moment else (*out, None)
