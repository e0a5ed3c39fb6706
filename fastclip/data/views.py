"""Two augmented views of an image, for self-supervised training (the trainer's ``ssl`` mode).

SimCLR's augmentation (Chen et al. 2020, appendix A): a random resized crop (scale from ``crop_min_scale`` to 1),
a horizontal flip, colour jitter (brightness, contrast, saturation 0.8·s, hue 0.2·s) with probability 0.8,
grayscale with probability 0.2 and a Gaussian blur (kernel about a tenth of the image, σ in [0.1, 2]) with
probability ``blur_p``; then the tower's own tensor conversion and normalisation (the trainer's views are uint8,
normalised on the device: fastclip/data/pixels.py). Each view draws from the global RNGs, which the data worker
seeds per batch (worker.py ``_seeded_rngs``): the views of a sample are a function of the seed, epoch, rank and
batch, so a resumed run sees the same views bitwise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from fastclip.compat import ensure_torchvision_importable


@dataclass(frozen=True)
class Augment:
    """The augmentation's knobs (the trainer's ``ssl`` section)."""

    crop_min_scale: float = 0.08
    jitter_strength: float = 0.5  # s: CIFAR-sized images in SimCLR use 0.5, ImageNet 1.0
    jitter_p: float = 0.8
    grayscale_p: float = 0.2
    blur_p: float = 0.5


class TwoViews:
    """``image -> [2, C, H, W]``: two independent draws of the augmentation (picklable: data workers load it)."""

    def __init__(self, image_size: int, mean, std, augment: Augment):
        ensure_torchvision_importable(announce=False)
        from torchvision import transforms as T

        s = augment.jitter_strength
        kernel = max(3, int(0.1 * image_size) // 2 * 2 + 1)  # odd, about 10 % of the side
        self.transform = T.Compose(
            [
                T.RandomResizedCrop(image_size, scale=(augment.crop_min_scale, 1.0)),
                T.RandomHorizontalFlip(),
                T.RandomApply([T.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s)], p=augment.jitter_p),
                T.RandomGrayscale(p=augment.grayscale_p),
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
