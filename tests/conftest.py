"""Fixtures shared by the trainer-level tests."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

# A suite started in the background by a shell without job control (`cmd &`) inherits SIGINT ignored, and fastclip
# rightly leaves an ignored signal alone (stopping._handled): the tests that send it, in this process or to the
# commands it starts (an ignored signal stays ignored across exec), would then fail. Give the suite a terminal's
# Ctrl-C however it was launched (SIGHUP stays as it is: nohup's ignoring it is the point of nohup).
signal.signal(signal.SIGINT, signal.default_int_handler)

# Jobs and spawned ranks run with 1 thread (helpers.clean_env, dist_utils); in-process runs that are compared
# with them bit for bit must use the same CPU kernels, whichever test file runs first or alone.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

from helpers import make_embedded  # noqa: E402


@pytest.fixture(scope="session")
def tiny_embedded(tmp_path_factory) -> Path:
    """Embedded shards with 4 samples per class (80 training, 20 held-out), written once and only read."""
    return make_embedded(tmp_path_factory.mktemp("embedded"))


@pytest.fixture(scope="session")
def data(tiny_embedded) -> Path:
    """The embedded shards, under the name the training tests use (a module may define its own data)."""
    return tiny_embedded


@pytest.fixture(scope="session")
def model_fns():
    """The tiny model's train preprocess and tokenizer, for the data-stream tests."""
    from fastclip.models import build_model

    built = build_model("tiny-vit")
    return built.preprocess_train, built.tokenizer
