"""uint8 batches from the data workers, normalised on the device (fastclip/data/pixels.py): the same float batches
bitwise as the workers' ToTensor + Normalize, a quarter of the bytes, the same training run; on CUDA, the copy and
the normalisation wait for nothing on the host."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from PIL import Image

from fastclip.compat import import_open_clip
from fastclip.data.pixels import Normalize, on_device
from fastclip.models import build_model
from fastclip.train.cli import main
from fastclip.train.config import aug_options, load_config
from fastclip.train.data import train_pixels

from helpers import EMBEDDED, REPO, load, make_stream, one_line_error, overrides, train_records

AUGS = {
    "default": [],
    "jitter_gray": ["--aug-cfg", "scale=(0.3, 1.0)", "color_jitter=(0.4,0.4,0.4,0.1)", "color_jitter_prob=0.8"]
    + ["--aug-cfg", "gray_scale_prob=0.3"],
    "timm": ["--data.aug.use_timm", "true", "--data.aug.scale", "[0.3, 1.0]", "--data.aug.ratio", "[0.75, 1.33]"],
}


def built_with(aug: list[str], *args: str):
    cfg = load_config(EMBEDDED, [*aug, *args])
    built = build_model("tiny-vit", aug_cfg=aug_options(cfg.data.aug))
    if cfg.ssl.enabled:
        from fastclip.train.ssl import ssl_built

        built = ssl_built(built, cfg)
    return built


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits: -0.0 and NaN too


@pytest.mark.parametrize("split, aug", [*(("train", aug) for aug in AUGS), ("val", "default"), ("ssl", "default")])
def test_the_stream_serves_the_float_batches_bitwise_as_uint8(tiny_embedded, split, aug):
    """A stream over the embedded shards with the uint8 transform, normalised, gives the float stream's batches
    bit for bit (augmentations drawn under the same per-batch seeds), in a quarter of the bytes."""
    built = built_with(AUGS[aug], *(["--ssl.enabled", "true", "--data.zeroshot", "null"] if split == "ssl" else []))
    preprocess = built.preprocess_val if split == "val" else built.preprocess_train
    pixels, normalize = on_device(preprocess)
    floats = list(make_stream((preprocess, built.tokenizer), tiny_embedded / "train", shuffle_buffer=16).epoch(0))
    uint8s = list(make_stream((pixels, built.tokenizer), tiny_embedded / "train", shuffle_buffer=16).epoch(0))
    assert len(floats) == len(uint8s) == 10
    for (want, *rest), (got, *same) in zip(floats, uint8s):
        assert got.dtype == torch.uint8 and got.shape == want.shape
        assert want.nbytes == 4 * got.nbytes
        assert_bitwise(normalize(got), want)
        assert all(torch.equal(a, b) for a, b in zip(rest, same))


def photos(n: int, seed: int) -> list[Image.Image]:
    """Noise images of assorted sizes around 224 px (the resizes and crops interpolate)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [(300, 250), (180, 260), (224, 224), (640, 480)]
    return [
        Image.fromarray(torch.randint(0, 256, (*sizes[i % 4][::-1], 3), generator=gen, dtype=torch.uint8).numpy())
        for i in range(n)
    ]


def batch(transform, images, seed: int) -> torch.Tensor:
    random.seed(seed)
    torch.manual_seed(seed)  # the same draws of the crops, jitter and grayscale for both pipelines
    return torch.stack([transform(im) for im in images])


@pytest.mark.filterwarnings("ignore:Unused augmentation cfg items")  # open_clip lists the ones it applies
@pytest.mark.parametrize("aug", list(AUGS))
@pytest.mark.parametrize("is_train", [True, False])
def test_open_clips_224_px_transforms_split_bitwise(aug, is_train):
    """open_clip's own train and val transforms at ViT-B-32's 224 px and OpenAI mean/std: uint8 + Normalize equals
    ToTensor + Normalize bitwise, and the batch takes a quarter of the bytes (4 x 3 x 224 x 224: 2.4 MB vs 0.6)."""
    aug_cfg = aug_options(load_config(EMBEDDED, AUGS[aug]).data.aug)
    transform = import_open_clip().image_transform(224, is_train=is_train, aug_cfg=aug_cfg)
    pixels, normalize = on_device(transform)
    images = photos(4, seed=1)
    want, got = batch(transform, images, 7), batch(pixels, images, 7)
    assert got.dtype == torch.uint8 and want.nbytes == 4 * got.nbytes == 4 * 4 * 3 * 224 * 224
    assert_bitwise(normalize(got), want)


def test_a_pipeline_that_erases_normalised_pixels_stays_float(capsys):
    """timm's random erasing follows Normalize: that transform is not split, data.device_normalize null keeps it
    in the workers, and true is refused in one line."""
    aug = ["--data.aug.use_timm", "true", "--data.aug.re_prob", "0.5"]
    built = built_with(aug)
    assert on_device(built.preprocess_train) is None
    assert train_pixels(load_config(EMBEDDED, aug), built.preprocess_train) == (built.preprocess_train, None)
    one_line_error(
        capsys,
        main,
        ["--config", str(EMBEDDED), "--print-config", *aug, "--data.device_normalize", "true"],
        "config key 'data.device_normalize': cannot be true with data.aug.re_prob",
    )


def test_device_normalize_is_on_unless_turned_off():
    built = built_with([])
    pixels, normalize = train_pixels(load_config(EMBEDDED, []), built.preprocess_train)
    assert isinstance(normalize, Normalize) and pixels is not built.preprocess_train
    off = load_config(EMBEDDED, ["--data.device_normalize", "false"])
    assert train_pixels(off, built.preprocess_train) == (built.preprocess_train, None)
    with pytest.raises(TypeError, match="uint8"):
        normalize(torch.zeros(1, 3, 2, 2))  # a float batch normalised twice would train on garbage


JITTER = {"data.aug.color_jitter": "[0.4, 0.4, 0.4, 0.1]", "data.aug.color_jitter_prob": 0.8}
SSL = {"ssl.enabled": "true", "ssl.projector_hidden": 32, "ssl.projector_dim": 16, "data.zeroshot": "null"}


@pytest.mark.parametrize(
    "mode, extra",
    [
        ("fastclip-v3", {"data.workers": 1, "data.aug.gray_scale_prob": 0.3, **JITTER}),
        ("ntxent", {**SSL, "data.val": "null"}),
    ],
)
def test_a_training_run_is_the_same_with_uint8_batches(tiny_embedded, tmp_path, mode, extra):
    """3 steps with uint8 batches normalised in the trainer and with float batches from the workers: the same
    losses and the same parameters, bit for bit."""
    runs = {}
    for setting in ("true", "false"):
        run = tmp_path / setting
        args = overrides(tiny_embedded, run, mode, **{"train.max_steps": 3, "data.device_normalize": setting, **extra})
        if mode == "ntxent":
            args += ["--loss.rho", "null", "--loss.gamma_min", "null", "--loss.gamma_decay_epochs", "null"]
            args += ["--loss.gamma_schedule", "null"]
        assert main(["--config", str(EMBEDDED), *args]) == 0
        runs[setting] = ([r["loss"] for r in train_records(run)], load(run / "checkpoints/step_00000003/model.pt"))
    (losses, model), (float_losses, float_model) = runs["true"], runs["false"]
    assert len(losses) == 3 and losses == float_losses
    for name, value in model["state_dict"].items():
        assert torch.equal(value, float_model["state_dict"][name]), name


def test_the_loader_benchmark_measures_the_bytes_of_a_batch(tiny_embedded):
    """bench_loader.py --pinned-bytes, on the tiny model's 32 px images: the float32 batch is 4 x the uint8."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_loader import pinned_bytes

    got = pinned_bytes(tiny_embedded / "train", build_model("tiny-vit"), 8)
    assert got["float32_bytes"] == 4 * got["uint8_bytes"] == 4 * 8 * 3 * 32 * 32 and got["ratio"] == 4.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_uint8_batch_copies_and_normalises_without_a_host_sync(tmp_path):
    """The trainer's path on CUDA: a pinned uint8 batch from the loader's workers, `.to(device, non_blocking=True)`
    and Normalize on the device (its mean and std moved there once) wait for nothing on the host (torch raises at
    any op that would), and give the float pipeline's batch bitwise, from a quarter of the pinned bytes."""
    from fastclip.data.sources.synthetic import write_synthetic

    write_synthetic(tmp_path, [16], image_size=48, fmt="jpg")  # (the GPU machine may lack the embedded sources)
    built = build_model("tiny-vit")
    pixels, normalize = on_device(built.preprocess_train)
    device = torch.device("cuda", torch.cuda.current_device())
    normalize.to(device)
    kw = {"shuffle_buffer": 16, "workers": 1, "pin_memory": True}
    want = next(iter(make_stream((built.preprocess_train, built.tokenizer), tmp_path, **kw).epoch(0)))
    got = next(iter(make_stream((pixels, built.tokenizer), tmp_path, **kw).epoch(0)))
    assert got[0].is_pinned() and want[0].is_pinned() and got[0].dtype == torch.uint8
    assert want[0].nbytes == 4 * got[0].nbytes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        images = normalize(got[0].to(device, non_blocking=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_bitwise(images.cpu(), want[0])
