"""The trainer with the losses beyond the reference: SigLIP and the temperature-free (atanh) similarity.

One process, in-process, a few steps on tiny embedded shards: the config reaches build_loss, the loss's own
parameters (SigLIP's scale and bias) are trained in the temperature group, and what is learnt is checkpointed.
The losses' numerics are pinned in tests/test_losses_tempfree_siglip.py; this checks the wiring.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastclip.train.config import ConfigError, load_config
from fastclip.train.trainer import train

from helpers import EMBEDDED, overrides, records

STEPS = 4


@pytest.fixture(scope="session")
def tiny(tiny_embedded):
    return tiny_embedded


def run(tiny, tmp_path, name, **extra):
    args = overrides(
        tiny,
        tmp_path / name,
        name.split(":")[0],
        **{"train.max_steps": STEPS, "loss.rho": "null", "loss.temperature": "null", **extra},
    )
    result = train(load_config(EMBEDDED, args))
    recs = records(tmp_path / name)
    final = torch.load(tmp_path / name / "checkpoints" / f"step_{STEPS:08d}" / "model.pt", weights_only=True)
    return result, recs, final


def test_siglip_trains_scale_and_bias(tiny, tmp_path):
    result, recs, final = run(
        tiny,
        tmp_path,
        "siglip",
        **{
            "loss.gamma_min": "null",
            "loss.gamma_decay_epochs": "null",
            "loss.gamma_schedule": "null",
            "loss.bias": -10.0,
            "optim.lr_tau": 1e-2,
            "optim.lr_tau_schedule": "const",
        },
    )
    assert result["step"] == STEPS and all(math.isfinite(r["loss"]) for r in recs)
    loss_params = final["loss"]
    assert set(loss_params) == {"logit_scale", "logit_bias"}
    # both moved away from their initial values (log 10 and -10): they are in the optimizer
    assert abs(float(loss_params["logit_scale"]) - math.log(10.0)) > 1e-4
    assert abs(float(loss_params["logit_bias"]) + 10.0) > 1e-4


@pytest.mark.parametrize("name", ["openclip", "fastclip-v1"])
def test_temperature_free_similarity(tiny, tmp_path, name):
    extra = {"loss.similarity": "atanh"}
    if name == "openclip":
        extra.update({"loss.gamma_min": "null", "loss.gamma_decay_epochs": "null", "loss.gamma_schedule": "null"})
    result, recs, final = run(tiny, tmp_path, name, **extra)
    assert result["step"] == STEPS and all(math.isfinite(r["loss"]) for r in recs)
    assert final["config"]["loss"]["similarity"] == "atanh"
    # no temperature to learn: tau stays exactly 1 (the mapping replaces cos/tau)
    assert all(r["tau"] == pytest.approx(1.0, abs=0) for r in recs)


def test_temperature_free_is_rejected_for_individual_temperatures(tiny, tmp_path):
    with pytest.raises(ConfigError, match="similarity"):
        run(tiny, tmp_path, "fastclip-v2", **{"loss.similarity": "atanh", "loss.temperature": 0.03})
