"""Errors shared by the packages: raised in one (a checkpoint read, a collective) and reported by another (the
commands), so they live below all of them.

`fastclip train` prints a ConfigError as one line and exits 2 (before anything is built, where it can); a
TrainingError as one line and exits 1. `fastclip eval` and `fastclip export` turn a CheckpointError into their own
one-line refusal.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; the message names the key (and the file when there is one)."""


class TrainingError(RuntimeError):
    """A run stopped for a known reason (the message names it)."""

    # raised with the same words on every rank, from a decision the ranks agreed on: rank 0 alone says it
    agreed = False


class CheckpointError(TrainingError):
    """A checkpoint file that cannot be trusted or read: pickled objects, a torn or foreign file."""


class CheckpointFileMissing(CheckpointError, FileNotFoundError):
    """A checkpoint file that is not there (a FileNotFoundError too: a path the operator typed says so)."""


class CollectiveFailure(TrainingError):
    """A collective failed or timed out: another process of the job died, stopped or lost its network."""


__all__ = ["ConfigError", "TrainingError", "CheckpointError", "CheckpointFileMissing", "CollectiveFailure"]
