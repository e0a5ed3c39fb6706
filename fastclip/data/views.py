"""Two augmented views of an image, for self-supervised training (the trainer's ``ssl`` mode).

SimCLR's augmentation (Chen et al. 2020, appendix A): a random resized crop (area 0.08-1, aspect 3/4-4/3), a
horizontal flip, colour jitter (brightness, contrast, saturation 0.8·s, hue 0.2·s; s = 0.5) with probability 0.8,
grayscale with probability 0.2 and a Gaussian blur (kernel about a tenth of the image, σ in [0.1, 2]) with
probability 0.5; then the tower's own tensor conversion and normalisation (the trainer's views are uint8,
normalised on the device: fastclip/data/pixels.py). The trainer takes the crop, jitter and grayscale from data.aug's
keys of those names, flip and blur from ssl (fastclip/train/ssl.py view_augment). Each view draws from the global
RNGs, which the data worker seeds per batch (worker.py ``_seeded_rngs``): the views of a sample are a function of
the seed, epoch, rank and batch, so a resumed run sees the same views bitwise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from fastclip.compat import ensure_torchvision_importable


@dataclass(frozen=True)
class Augment:
    """The augmentation's knobs, SimCLR's by default (data.aug's names where it has them)."""

    scale: tuple[float, float] = (0.08, 1.0)  # the crop's area range
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # the crop's aspect-ratio range
    color_jitter: tuple[float, ...] = (0.4, 0.4, 0.4, 0.1)  # 0.8·s, 0.8·s, 0.8·s, 0.2·s: s = 0.5 (CIFAR; ImageNet 1)
    color_jitter_prob: float = 0.8
    gray_scale_prob: float = 0.2
    flip_p: float = 0.5
    blur_p: float = 0.5


class TwoViews:
    """``image -> [2, C, H, W]``: two independent draws of the augmentation (picklable: data workers load it)."""

    def __init__(self, image_size: int, mean, std, augment: Augment):
        ensure_torchvision_importable(announce=False)
        from torchvision import transforms as T

        kernel = max(3, int(0.1 * image_size) // 2 * 2 + 1)  # odd, about 10 % of the side
        self.transform = T.Compose(
            [
                T.RandomResizedCrop(image_size, scale=augment.scale, ratio=augment.ratio),
                T.RandomHorizontalFlip(p=augment.flip_p),
                T.RandomApply([T.ColorJitter(*augment.color_jitter)], p=augment.color_jitter_prob),
                T.RandomGrayscale(p=augment.gray_scale_prob),
                T.RandomApply([T.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=augment.blur_p),
                T.ToTensor(),
                T.Normalize(mean, std),
            ]
        )

    def __call__(self, image) -> torch.Tensor:
        image = image.convert("RGB")
        return torch.stack([self.transform(image), self.transform(image)])

    def on_device(self):
        """(views of uint8 pixels, the device's Normalize): fastclip.data.pixels.on_device of the ssl views."""
        from fastclip.data.pixels import on_device

        transform, normalize = on_device(self.transform)
        views = copy.copy(self)
        views.transform = transform
        return views, normalize


def split_views(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``[B, 2, C, H, W]`` as its two views ``[B, C, H, W]`` each."""
    return images[:, 0], images[:, 1]
