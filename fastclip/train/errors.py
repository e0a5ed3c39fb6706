"""Errors that stop a training run on purpose, each with a message that says what happened and what to do.

`fastclip train` prints them as one line (no traceback) and exits with status 1; configuration errors
(ConfigError, fastclip/train/config.py) exit with status 2 before anything is built.
"""

from __future__ import annotations


class TrainingError(RuntimeError):
    """A run stopped for a known reason (the message names it)."""


class CheckpointError(TrainingError):
    """A checkpoint file that cannot be trusted or read: pickled objects, a torn or foreign file."""


class CheckpointFileMissing(CheckpointError, FileNotFoundError):
    """A checkpoint file that is not there (a FileNotFoundError too: a path the operator typed says so)."""


class CollectiveFailure(TrainingError):
    """A collective failed or timed out: another process of the job died, stopped or lost its network."""


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
