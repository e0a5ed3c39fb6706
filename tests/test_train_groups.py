"""Grouped data through the trainer (scenes written with 2 captions per scene: 16 samples, 8 groups of 2): the
loss of a training step is the loss called on that batch with its groups, in the CLIP and in the ssl mode; 1
process equals 2 processes, and 2 micro-batches (GradCache) equal one batch.

One global batch of 16 is the whole epoch, whatever the number of processes, and the crop takes the whole image
(data.aug.scale [1, 1]), so every layout steps on the same images."""

from __future__ import annotations

import pytest
import torch

from fastclip.data.sources.scenes import build_scenes
from fastclip.losses import reshard_states
from fastclip.train.config import load_config

from dist_utils import run_distributed
from helpers import EMBEDDED, load, overrides, removed_unless_failed, step_dir, train_records

STEPS = 2  # two epochs of one step each


def run_args(data, run, world_size: int = 1, **extra) -> list[str]:
    return overrides(
        data,
        run,
        "fastclip-v3",
        **{
            "data.train": data / "train",
            "data.val": "null",
            "data.zeroshot": "null",
            "data.batch_size": 16 // world_size,
            "data.aug.scale": "[1.0, 1.0]",
            "optim.eps": 1e-4,  # zero-gradient parameters must not turn rounding noise into +-lr steps
            "train.max_steps": STEPS,
            **extra,
        },
    )


def _train(rank, world_size, args):
    from fastclip.train.trainer import train

    return train(load_config(EMBEDDED, args))["step"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    from fastclip.train.trainer import train

    root = tmp_path_factory.mktemp("grouped")
    build_scenes(root / "data", num_train=8, num_val=0, num_test=0, num_novel=0, workers=1, captions_per_scene=2)
    data = root / "data"
    for name, extra in (("one", {}), ("accum", {"optim.accum_steps": 2})):
        assert train(load_config(EMBEDDED, run_args(data, root / name, **extra)))["step"] == STEPS
    assert run_distributed(_train, 2, run_args(data, root / "two", 2), timeout=300) == [STEPS, STEPS]
    yield from removed_unless_failed(request, root)


def first_step_loss(args: list[str], groups: bool) -> float:
    """The loss of the run's first batch, from towers built as the trainer builds them, called here."""
    from fastclip.data import build_train_stream
    from fastclip.data.views import split_views
    from fastclip.distributed import DistInfo
    from fastclip.train.data import stream_config
    from fastclip.train.net import build_net

    cfg = load_config(EMBEDDED, args)
    info = DistInfo(0, 1, 0, torch.device("cpu"), "none", False)
    net = build_net(cfg, info, data_size=16)
    stream = build_train_stream(
        stream_config(cfg, 16, info.device), preprocess=net.built.preprocess_train, tokenizer=net.built.tokenizer
    )
    assert stream.grouped
    images, texts, indices, group_ids = next(iter(stream.epoch(0)))
    if cfg.ssl.enabled:
        images, texts = split_views(images)
    assert len(set(group_ids.tolist())) == 8 and not torch.equal(group_ids, indices)
    image_features, text_features = net.engine.towers.encode(images, texts)
    loss = net.loss_fn(image_features, text_features, indices, epoch=0, groups=group_ids if groups else None)
    return loss.item()


@pytest.mark.parametrize("mode", ["clip", "ssl"])
def test_a_step_on_grouped_data_is_the_loss_with_its_groups(runs, mode, tmp_path):
    """The first step's logged loss is the loss called on that batch with the shards' groups, and not without."""
    run = runs / "one"
    if mode == "ssl":  # two views of each image; the groups make the views of a scene's two samples positives
        ssl = {"ssl.enabled": "true", "ssl.projector_hidden": 32, "ssl.projector_dim": 16, "train.max_steps": 1}
        run = tmp_path / "ssl"
        args = run_args(runs / "data", run, **ssl)
        assert _train(0, 1, args) == 1
    else:
        args = run_args(runs / "data", run)
    logged = train_records(run)[0]["loss"]
    assert logged == pytest.approx(first_step_loss(args, groups=True), rel=1e-6)
    assert logged != pytest.approx(first_step_loss(args, groups=False), rel=1e-3)


def assert_same_training(got, ref, where: str) -> None:
    a, b = load(step_dir(got, STEPS) / "model.pt"), load(step_dir(ref, STEPS) / "model.pt")
    for name, value in b["state_dict"].items():
        torch.testing.assert_close(
            a["state_dict"][name], value, rtol=1e-4, atol=2e-6, msg=lambda m: f"{where} {name}: {m}"
        )
    torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-5, atol=1e-7)  # the temperature
    world = [len(list(step_dir(run, STEPS).glob("rank_*.pt"))) for run in (got, ref)]
    states = [
        reshard_states([load(step_dir(run, STEPS) / f"rank_{r}.pt")["loss_state"] for r in range(w)], 1)[0]
        for run, w in zip((got, ref), world)
    ]
    fields_a, fields_b = (s["_extra_state"]["fields"] for s in states)
    assert int(states[1]["_extra_state"]["seen"].sum()) == 16
    for field, value in fields_b.items():  # per-sample u: an absolute error in log u is u's relative error
        torch.testing.assert_close(fields_a[field], value, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} {field}: {m}")


def test_one_process_equals_two_on_grouped_data(runs):
    assert_same_training(runs / "two", runs / "one", "2 processes vs 1")


def test_two_micro_batches_equal_one_batch_on_grouped_data(runs):
    assert_same_training(runs / "accum", runs / "one", "accum_steps 2 vs 1")
