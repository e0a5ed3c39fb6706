"""Fixtures shared by the trainer-level tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import make_embedded


@pytest.fixture(scope="session")
def tiny_embedded(tmp_path_factory) -> Path:
    """Embedded shards with 4 samples per class (80 training, 20 held-out), written once and only read."""
    return make_embedded(tmp_path_factory.mktemp("embedded"))


@pytest.fixture(scope="session")
def model_fns():
    """The tiny model's train preprocess and tokenizer, for the data-stream tests."""
    from fastclip.models import build_model

    built = build_model("tiny-vit")
    return built.preprocess_train, built.tokenizer
