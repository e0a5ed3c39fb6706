"""Errors that stop a training run on purpose, each with a message that says what happened and what to do.

`fastclip train` prints them as one line (no traceback) and exits with status 1; configuration errors
(ConfigError, fastclip/errors.py) exit with status 2 before anything is built.
"""

from __future__ import annotations

import errno
from pathlib import Path

from fastclip.errors import CheckpointError, CheckpointFileMissing, CollectiveFailure, TrainingError


class DataFailure(TrainingError):
    """A rank has no usable training sample left (every shard of its share is bad)."""


class NonFiniteStepsError(TrainingError):
    """Too many optimizer steps in a row were skipped for NaN/Inf loss, gradients or features."""

    agreed = True  # (the skip is all-reduced: every rank counts the same steps)


class WriteFailure(TrainingError):
    """A file of the run folder could not be written while training (a full disk, a quota, a read-only remount)."""


# what a write can fail with that a full or read-only disk explains (a read error is the data's: skipped, counted)
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def write_failure(error: OSError, cfg, rank: int, step: int) -> WriteFailure:
    """One line for a write of the run folder that failed mid-run (metrics.jsonl, config.yaml, TensorBoard's
    events; a checkpoint's save says its own): the file, the step, and that the last checkpoint is intact."""
    from fastclip.checkpoint.layout import CHECKPOINTS, last_good, read_pointer

    run_dir = Path(cfg.train.run_dir)
    last = last_good(run_dir / CHECKPOINTS)
    if read_pointer(run_dir / CHECKPOINTS):
        then = "continue with --train.resume latest"
    else:
        then = "start it again with --train.resume latest (from step 0)"
    where = f" {error.filename}" if error.filename else " a file of the run folder"
    return WriteFailure(
        f"rank {rank}: cannot write{where} at step {step} ({error.strerror or error}); {last}. Free space in "
        f"{run_dir} (or make it writable), then {then}"
    )


class OutOfMemory(TrainingError):
    """A rank could not allocate what the run's settings ask for (batch, model, queue)."""


def _out_of_memory(error: BaseException) -> bool:
    import torch

    text = str(error)
    return isinstance(error, getattr(torch, "OutOfMemoryError", ())) or (
        isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())
    )


def out_of_memory(error: BaseException, cfg, rank: int, step: int, phase: str) -> OutOfMemory:
    """One line for an allocation that failed: where (step and phase), the allocator's own words, and the settings
    that size the memory there: an evaluation's batch and probe; a training step's micro-batch (optim.accum_steps
    splits data.batch_size and keeps the global batch), activations and queue (2·Q·d floats per rank)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "evaluation" in phase:
        knobs = ["lower eval.batch_size", "eval.probe_max_train (with eval.linear_probe / eval.knn)"]
    else:
        knobs = [
            "raise optim.accum_steps (the same global batch in smaller micro-batches)",
            "set model.grad_checkpointing",
            "lower data.batch_size (a smaller global batch)",
        ]
        if getattr(cfg.loss, "queue_size", None):
            knobs.insert(0, f"lower loss.queue_size ({cfg.loss.queue_size:,}: 2 x that many feature rows per rank)")
    return OutOfMemory(f"rank {rank} ran out of memory at step {step} ({phase}; {first[:200]}): {', or '.join(knobs)}")


def explain_failure(error: BaseException, timeouts, cfg=None) -> BaseException:
    """What ended a run, as `fastclip train` reports it: a rank with no training sample left -> DataFailure (its
    message names the shards); an allocation that failed -> OutOfMemory naming the settings that size memory; an
    error of the process group -> a CollectiveFailure naming rank, step and phase (guards.CollectiveTimeouts); a
    write that a full or read-only disk failed -> WriteFailure naming the file; anything else unchanged."""
    from fastclip.data.samples import DataExhausted

    if isinstance(error, DataExhausted):
        return DataFailure(str(error))
    if cfg is not None and not isinstance(error, TrainingError) and _out_of_memory(error):
        phase = timeouts.failed_in[0] if timeouts.failed_in else timeouts.phase
        return out_of_memory(error, cfg, timeouts.info.rank, timeouts.step, phase)
    if cfg is not None and isinstance(error, OSError) and error.errno in WRITE_ERRNOS:
        return write_failure(error, cfg, timeouts.info.rank, timeouts.step)
    return timeouts.explain(error)


__all__ = [
    "TrainingError",
    "CheckpointError",
    "CheckpointFileMissing",
    "CollectiveFailure",
    "DataFailure",
    "NonFiniteStepsError",
    "OutOfMemory",
    "WriteFailure",
    "explain_failure",
]
