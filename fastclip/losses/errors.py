"""Exceptions raised by the losses for bad input.

Both are raised on EVERY rank of the group whenever any rank detects the problem (see validation.py), so a
bad batch on one rank never leaves the other ranks waiting in a collective.
"""

from __future__ import annotations


class LossInputError(ValueError):
    """Bad input to a loss call: wrong shape or dtype, sizes differing across ranks, index out of range."""


class NonFiniteFeaturesError(LossInputError):
    """NaN or Inf in the image or text features given to a loss call."""


class FeaturesNotNormalisedError(LossInputError):
    """A finite feature row whose L2 norm is not 1 (F.normalize forgotten, or a tower that output zeros)."""
