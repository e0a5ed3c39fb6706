"""GPU speed defaults (fastclip/train/gpu.py): what CPU can check runs here (channels_last numerics and a
training run, convolutional-tower detection, DDP and DeepSpeed options, flags left alone on CPU); the CUDA
paths run only where CUDA is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastclip.models import build_model
from fastclip.train import gpu
from fastclip.train.cli import main
from fastclip.train.config import load_config
from fastclip.train.engine import deepspeed_config

from helpers import EMBEDDED, fault_overrides, train_records

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TINY_RN = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "patch_size": None},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="module")
def tiny_rn(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rn") / "tiny-rn.json"
    path.write_text(json.dumps(TINY_RN))
    return path


def cfg(*args: str):
    return load_config(EMBEDDED, list(args))


def test_convolutional_towers_are_told_apart(tiny_rn):
    assert gpu.is_convolutional(build_model(str(tiny_rn)).model)
    assert not gpu.is_convolutional(build_model("tiny-vit").model)  # one conv: the patch embedding


def test_channels_last_defaults(tiny_rn):
    rn, vit = build_model(str(tiny_rn)).model, build_model("tiny-vit").model
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not gpu.wants_channels_last(cfg(), rn, cpu)  # off on CPU
    assert gpu.wants_channels_last(cfg(), rn, cuda) and not gpu.wants_channels_last(cfg(), vit, cuda)
    assert gpu.wants_channels_last(cfg("--model.channels_last", "true"), vit, cpu)
    assert not gpu.wants_channels_last(cfg("--model.channels_last", "false"), rn, cuda)


def test_channels_last_tower_computes_the_same_features(tiny_rn):
    built = build_model(str(tiny_rn))
    model = built.model.eval()
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model.encode_image(images)
        gpu.to_channels_last(model)
        after = model.encode_image(images)  # a contiguous NCHW input, converted by the tower's pre-hook
    assert model.visual.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(before, after, rtol=1e-5, atol=1e-6), (before - after).abs().max()


def test_training_with_channels_last_follows_the_nchw_run(tiny_embedded, tiny_rn, tmp_path):
    """One process, tiny RN tower, 3 steps with and without channels_last: same steps, losses equal to
    float32 rounding of the different convolution kernels."""
    runs = {}
    for flag in ("false", "true"):
        run = tmp_path / flag
        assert (
            main(
                [
                    "--config",
                    str(EMBEDDED),
                    *fault_overrides(
                        tiny_embedded,
                        run,
                        "fastclip-v3",
                        **{"model.arch": tiny_rn, "model.channels_last": flag, "train.max_steps": 3},
                    ),
                ]
            )
            == 0
        )
        runs[flag] = train_records(run)
    assert [r["step"] for r in runs["true"]] == [r["step"] for r in runs["false"]] == [1, 2, 3]
    for a, b in zip(runs["false"], runs["true"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a["loss"], b["loss"])


def test_cpu_flags_are_left_alone():
    before = (torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision())
    assert gpu.apply_backend_flags(cfg(), torch.device("cpu")) == []
    assert (torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision()) == before


def test_ddp_options_where_valid():
    assert gpu.ddp_options(cfg()) == {"gradient_as_bucket_view": True, "static_graph": True}
    assert gpu.ddp_options(cfg("--optim.accum_steps", "2"))["static_graph"] is False  # GradCache's extra forwards
    assert gpu.ddp_options(cfg("--model.compile", "true"))["static_graph"] is False
    assert gpu.ddp_options(cfg("--train.ddp_static_graph", "false", "--train.ddp_bucket_view", "false")) == {
        "gradient_as_bucket_view": False,
        "static_graph": False,
    }


def test_deepspeed_overlap_comm_on_for_cuda_only():
    base = ["--train.distributed", "deepspeed"]
    assert deepspeed_config(cfg(*base), 2, "cpu")["zero_optimization"]["overlap_comm"] is False
    assert deepspeed_config(cfg(*base), 2, "cuda")["zero_optimization"]["overlap_comm"] is True
    assert (
        deepspeed_config(cfg(*base, "--deepspeed.overlap_comm", "false"), 2, "cuda")["zero_optimization"][
            "overlap_comm"
        ]
        is False
    )


@CUDA
def test_cuda_gets_tf32_and_cudnn_benchmark():
    assert gpu.apply_backend_flags(cfg(), torch.device("cuda", 0)) == ["TF32", "cudnn.benchmark"]
    assert torch.backends.cudnn.benchmark
    assert torch.backends.cuda.matmul.fp32_precision == "tf32" and torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert (
        gpu.apply_backend_flags(
            cfg("--train.tf32", "false", "--train.cudnn_benchmark", "false"), torch.device("cuda", 0)
        )
        == []
    )
    assert torch.backends.cuda.matmul.fp32_precision == "ieee" and not torch.backends.cudnn.benchmark


@CUDA
def test_cuda_rn_tower_trains_channels_last(tiny_rn):
    built = build_model(str(tiny_rn))
    model = built.model.cuda()
    device = torch.device("cuda", torch.cuda.current_device())
    assert gpu.wants_channels_last(cfg(), model, device)
    gpu.to_channels_last(model)
    images = torch.randn(4, 3, 32, 32, device=device)
    features = model.encode_image(images)
    features.sum().backward()
    assert model.visual.conv1.weight.grad.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("setting, cuda, cpu", [(None, True, False), (True, True, False), (False, False, False)])
def test_batches_are_pinned_for_cuda_unless_turned_off(setting, cuda, cpu):
    """data.pin_memory: on by default for CUDA (async copies, 6 % samples/s on an H100), off by request (3.2 GB
    of page-locked host memory per process there: RESULTS.md 1g); never on the CPU, where it would do nothing."""
    from fastclip.train.data import stream_config

    cfg = load_config(None, [] if setting is None else ["--data.pin_memory", str(setting).lower()])
    assert stream_config(cfg, 10, torch.device("cuda", 0)).pin_memory is cuda
    assert stream_config(cfg, 10, torch.device("cpu")).pin_memory is cpu
