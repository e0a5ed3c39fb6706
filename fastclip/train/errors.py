"""Errors that stop a training run on purpose, each with a message that says what happened and what to do.

`fastclip train` prints them as one line (no traceback) and exits with status 1; configuration errors
(ConfigError, fastclip/errors.py) exit with status 2 before anything is built.
"""

from __future__ import annotations

from fastclip.errors import CheckpointError, CheckpointFileMissing, CollectiveFailure, TrainingError


class DataFailure(TrainingError):
    """A rank has no usable training sample left (every shard of its share is bad)."""


class NonFiniteStepsError(TrainingError):
    """Too many optimizer steps in a row were skipped for NaN/Inf loss, gradients or features."""


def explain_failure(error: BaseException, timeouts) -> BaseException:
    """What ended a run, as `fastclip train` reports it: a rank with no training sample left -> DataFailure (its
    message names the shards); an error of the process group -> a CollectiveFailure naming rank, step and phase
    (guards.CollectiveTimeouts); anything else unchanged."""
    from fastclip.data.samples import DataExhausted

    if isinstance(error, DataExhausted):
        return DataFailure(str(error))
    return timeouts.explain(error)


__all__ = [
    "TrainingError",
    "CheckpointError",
    "CheckpointFileMissing",
    "CollectiveFailure",
    "DataFailure",
    "NonFiniteStepsError",
    "explain_failure",
]
