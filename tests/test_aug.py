"""data.aug (OpenCLIP's --aug-cfg): the two spellings give one config, a wrong key is one line, the train transform
is open_clip's with those settings, and a stream stopped and resumed serves the same augmented batches."""

from __future__ import annotations

import io

import pytest
import torch

from fastclip.train.config import aug_options, load_config

from helpers import EMBEDDED, make_stream, one_line_error


def test_aug_cfg_and_data_aug_keys_are_one_setting():
    openclip = load_config(
        EMBEDDED, ["--aug-cfg", "scale=(0.5, 1.0)", "color_jitter=(0.4,0.4,0.4,0.1)", "color_jitter_prob=0.8"]
    )
    ours = load_config(
        EMBEDDED,
        [
            "--data.aug.scale",
            "[0.5, 1.0]",
            "--data.aug.color_jitter",
            "[0.4, 0.4, 0.4, 0.1]",
            "--data.aug.color_jitter_prob",
            "0.8",
        ],
    )
    assert openclip.data.aug == ours.data.aug
    assert aug_options(ours.data.aug) == {
        "scale": (0.5, 1.0),
        "color_jitter": (0.4, 0.4, 0.4, 0.1),
        "color_jitter_prob": 0.8,
    }
    assert aug_options(load_config(EMBEDDED, []).data.aug) == {"scale": (0.9, 1.0)}  # open_clip's default


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--aug-cfg", "scal=(0.5, 1.0)"],
            ["unknown config key 'data.aug.scal'", "known keys in data.aug: color_jitter"],
        ),
        (["--aug-cfg", "0.5"], ["--aug-cfg 0.5: expected key=value pairs"]),
        (["--data.aug.re_prob", "0.25"], ["'data.aug.re_prob': is applied through timm only: set data.aug.use_timm"]),
        (["--aug-cfg", "scale=(0.5, 1.5)"], ["'data.aug.scale': must be two numbers 0 < lo <= hi <= 1"]),
        (["--aug-cfg", "color_jitter_prob=0.5"], ["'data.aug.color_jitter_prob': needs data.aug.color_jitter"]),
        (  # the hint is the list to type (its 4 numbers), not the one number in brackets (refused next)
            ["--aug-cfg", "color_jitter=0.4"],
            ["expected a list, got float 0.4 (on the command line: --data.aug.color_jitter '[0.4, 0.4, 0.4, 0.1]'"],
        ),
    ],
)
def test_a_wrong_aug_setting_is_one_line_exit_2(argv, words, capsys):
    from fastclip.train.cli import main

    one_line_error(capsys, main, ["--config", str(EMBEDDED), "--print-config", *argv], *words)


def _aug_fns(argv):
    from fastclip.models import build_model

    built = build_model("tiny-vit", aug_cfg=aug_options(load_config(EMBEDDED, argv).data.aug))
    return built.preprocess_train, built.tokenizer


def test_the_train_transform_is_open_clips_with_the_settings():
    preprocess, _ = _aug_fns(["--aug-cfg", "scale=(0.3, 0.6)", "gray_scale_prob=1.0"])
    names = [type(t).__name__ for t in preprocess.transforms]
    crop = preprocess.transforms[0]
    assert type(crop).__name__ == "RandomResizedCrop" and tuple(crop.scale) == (0.3, 0.6)
    assert any("Gray" in n or "gray" in n.lower() for n in names), names
    from PIL import Image

    image = Image.new("RGB", (64, 64), (200, 30, 30))
    x = preprocess(image)
    assert torch.allclose(x[0] * 0.26862954 + 0.48145466, x[1] * 0.26130258 + 0.4578275, atol=1e-5)  # gray


def test_a_resumed_stream_serves_the_same_augmented_batches(tiny_embedded):
    fns = _aug_fns(["--aug-cfg", "scale=(0.2, 1.0)", "color_jitter=(0.4,0.4,0.4,0.1)", "color_jitter_prob=0.8"])
    full = make_stream(fns, tiny_embedded / "train", shuffle_buffer=16)
    reference = list(full.epoch(0))
    first = make_stream(fns, tiny_embedded / "train", shuffle_buffer=16)
    it = iter(first.epoch(0))
    head = [next(it) for _ in range(3)]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = make_stream(fns, tiny_embedded / "train", shuffle_buffer=16)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    batches = head + list(resumed.epoch(0))
    assert len(batches) == len(reference)
    for got, want in zip(batches, reference):
        assert all(torch.equal(u, v) for u, v in zip(got, want))
    plain = list(make_stream(_aug_fns([]), tiny_embedded / "train", shuffle_buffer=16).epoch(0))
    assert not torch.equal(plain[0][0], reference[0][0])  # the settings change the images
