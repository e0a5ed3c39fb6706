"""ssl mode's two views follow data.aug (fastclip/train/ssl.py view_augment, fastclip/data/views.py): SimCLR's
augmentation where a key is unset, a function of the batch seed, and a setting does what it says: no crop, jitter,
grayscale, flip or blur leaves two views bitwise equal to a plain resize."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from fastclip.train.config import load_config

SSL = ["--ssl.enabled", "true", "--data.zeroshot", "null"]
COLOURED = Image.frombytes("RGB", (28, 28), bytes((i * 37) % 256 for i in range(28 * 28 * 3)))


def views_of(argv):
    """The training preprocessing of an ssl run configured by argv (the tiny ViT: 32 x 32)."""
    from fastclip.models import build_model
    from fastclip.train.ssl import ssl_built

    return ssl_built(build_model("tiny-vit"), load_config(None, [*SSL, *argv])).preprocess_train


def drawn(views, seed: int) -> torch.Tensor:
    from fastclip.data.worker import _seeded_rngs

    with _seeded_rngs(seed, 0, 1, 0, 0, 3):
        return views(COLOURED)


def test_unset_keys_are_simclrs_and_set_ones_are_taken():
    from fastclip.data.views import Augment
    from fastclip.train.ssl import view_augment

    assert view_augment(load_config(None, SSL)) == Augment()  # SimCLR's: 0.08-1, 3/4-4/3, jitter 0.8, gray 0.2
    assert Augment().color_jitter == (0.4, 0.4, 0.4, 0.1)  # s = 0.5
    argv = ["--aug-cfg", "scale=(0.5, 1.0)", "ratio=(0.9, 1.1)", "color_jitter_prob=0.3", "--ssl.flip_p", "0"]
    assert view_augment(load_config(None, [*SSL, *argv])) == Augment(
        scale=(0.5, 1.0), ratio=(0.9, 1.1), color_jitter_prob=0.3, flip_p=0.0
    )  # ratio without use_timm and a jitter probability alone: a view's, so accepted in ssl mode


def test_the_views_are_a_function_of_the_batch_seed():
    views = views_of(["--aug-cfg", "scale=(0.2, 1.0)", "gray_scale_prob=0.5"])
    first = drawn(views, 7)
    assert first.shape == (2, 3, 32, 32)
    assert torch.equal(first, drawn(views, 7))  # a resumed run sees the same views
    assert not torch.equal(first[0], first[1])  # two independent draws
    assert not torch.equal(first, drawn(views, 8))


def test_no_crop_jitter_grayscale_flip_or_blur_is_a_plain_resize():
    from torchvision import transforms as T

    argv = ["--aug-cfg", "scale=(1.0, 1.0)", "color_jitter_prob=0", "gray_scale_prob=0"]
    views = views_of([*argv, "--ssl.flip_p", "0", "--ssl.blur_p", "0"])
    got = drawn(views, 7)
    from fastclip.models import build_model

    visual = build_model("tiny-vit").model.visual
    resize = T.Compose([T.Resize((32, 32)), T.ToTensor(), T.Normalize(visual.image_mean, visual.image_std)])
    assert torch.equal(got[0], resize(COLOURED)) and torch.equal(got[1], got[0])
    assert not torch.equal(drawn(views_of([]), 7)[0], got[0])  # SimCLR's views are not


@pytest.mark.parametrize(("prob", "gray"), [(1.0, True), (0.0, False)])
def test_gray_scale_prob_makes_the_views_gray(prob, gray):
    """Grey views have three equal channels (with the same mean and std for each channel)."""
    from fastclip.data.views import TwoViews
    from fastclip.train.ssl import view_augment

    augment = view_augment(load_config(None, [*SSL, "--aug-cfg", f"gray_scale_prob={prob}"]))
    views = TwoViews(32, (0.5,) * 3, (0.25,) * 3, augment)
    for view in drawn(views, 7):
        assert (torch.equal(view[0], view[1]) and torch.equal(view[1], view[2])) == gray
