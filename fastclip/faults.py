"""Test-only fault injection: make the real code paths fail at a chosen step, rank and place.

Set by the environment variable FASTCLIP_FAULTS (unset in normal runs: every hook is then one dict lookup):

    FASTCLIP_FAULTS="nan@batch:step=3:rank=0; kill@step:step=5:rank=1; kill@checkpoint.model_file:step=4"

Each entry is `action@point` with optional `step=N` (the step being computed, 1-based; for checkpoint points the
step being saved) and `rank=R` (default: every rank). Actions:
    nan    fill the tensors handed to the hook with NaN (point `batch`: this rank's images, so the features and
           the loss see NaN; point `grads`: this rank's gradients, after the all-reduce of backward)
    kill   SIGKILL this process (as the OOM killer or a node failure would)
    stop   SIGSTOP this process (a hung rank: alive, holding its connections, never answering)
    usr1   SIGUSR1 to this process only (SLURM's warning before the time limit, reaching one rank first)
    term   SIGTERM to this process only (preemption)
    enospc raise OSError(ENOSPC) here (the disk filled up while a checkpoint was written)
Points the trainer calls: `batch` (before the forward), `step` (between forward and backward: mid-step, after
the loss's collectives), `grads` (after backward); the checkpoint writer calls `checkpoint.<stage>` with stage
`rank_files` (this rank's file written into the temporary folder), `model_file` (before rank 0 writes
model.pt), `renamed` (the folder renamed into place, `latest` not yet rewritten).
"""

from __future__ import annotations

import functools
import os
import signal
from dataclasses import dataclass

ENV = "FASTCLIP_FAULTS"
ACTIONS = ("nan", "kill", "stop", "usr1", "term", "enospc")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "usr1": signal.SIGUSR1, "term": signal.SIGTERM}


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    step: int | None = None
    rank: int | None = None

    def matches(self, point: str, step: int | None, rank: int | None) -> bool:
        return (
            self.point == point
            and (self.step is None or self.step == step)
            and (self.rank is None or self.rank == rank)
        )


@functools.lru_cache(maxsize=8)
def parse(spec: str) -> tuple[Fault, ...]:
    faults = []
    for entry in (e.strip() for e in spec.replace(",", ";").split(";")):
        if not entry:
            continue
        head, *options = entry.split(":")
        action, _, point = head.partition("@")
        if action not in ACTIONS or not point:
            raise ValueError(f"{ENV}: bad entry {entry!r}: expected action@point with action in {ACTIONS}")
        values = {}
        for option in options:
            key, _, value = option.partition("=")
            if key not in ("step", "rank") or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"{ENV}: bad option {option!r} in {entry!r}: expected step=N or rank=R")
            values[key] = int(value)
        faults.append(Fault(action, point, **values))
    return tuple(faults)


def active() -> tuple[Fault, ...]:
    spec = os.environ.get(ENV)
    return parse(spec) if spec else ()


def hook(point: str, *, step: int | None = None, rank: int | None = None, tensors=()) -> None:
    """Run the faults set for this point, step and rank (nothing when FASTCLIP_FAULTS is unset)."""
    for fault in active():
        if not fault.matches(point, step, rank):
            continue
        if fault.action == "nan":
            import torch

            with torch.no_grad():
                for t in tensors:
                    if t is not None and t.is_floating_point():
                        t.fill_(float("nan"))
        elif fault.action == "enospc":
            import errno

            print(f"{ENV}: {fault.action} at {point}, step {step}, rank {rank}", flush=True)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        else:
            print(f"{ENV}: {fault.action} at {point}, step {step}, rank {rank}", flush=True)
            os.kill(os.getpid(), SIGNALS[fault.action])


__all__ = ["ENV", "Fault", "parse", "active", "hook"]
