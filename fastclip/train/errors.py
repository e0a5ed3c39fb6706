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


__all__ = [
    "TrainingError",
    "CheckpointError",
    "CheckpointFileMissing",
    "CollectiveFailure",
    "DataFailure",
    "NonFiniteStepsError",
]
