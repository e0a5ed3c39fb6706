"""uint8 training images, normalised on the device.

A float32 batch takes 4 bytes per pixel channel, its uint8 pixels 1: in the workers' shared memory, in the
page-locked copy (256 x 3 x 224 x 224: 154 MB against 38.5 MB) and on the way to the GPU. `on_device(transform)`
splits a torchvision pipeline that ends in ToTensor + Normalize (open_clip's train and val transforms, timm's
without random erasing, the ssl views) into what the data workers run, with PILToTensor (uint8 [C, H, W]) in
ToTensor's place, and a `Normalize` to apply to the batch once it is on the device:

    workers_transform, normalize = on_device(built.preprocess_train)
    stream = build_train_stream(cfg, preprocess=workers_transform, tokenizer=built.tokenizer)
    for images, texts, indices, groups in stream.epoch(0):
        images = normalize(images.to(device, non_blocking=True))   # float32, as built.preprocess_train's

`Normalize` makes ToTensor's and Normalize's float32 operations in their order, x.float() / 255 then
(x - mean) / std, each a correctly rounded (IEEE) division or subtraction on the CPU and on CUDA: the batches are
bitwise the float pipeline's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastclip.compat import ensure_torchvision_importable


class Normalize(torch.nn.Module):
    """uint8 images [..., C, H, W] -> float32 (x / 255 - mean) / std on their device. Move it there once
    (`.to(device)`): a copy of mean and std at each call would wait for the GPU."""

    def __init__(self, mean, std):
        super().__init__()
        # as torchvision's Normalize rounds them: float32 of the given numbers
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1), persistent=False)
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1), persistent=False)
        # 255 as a tensor on the device: CUDA divides by a host number as a product with its reciprocal, which
        # differs from ToTensor's x / 255 in the last bit for about half of the 256 values
        self.register_buffer("max_value", torch.tensor(255.0), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            raise TypeError(f"Normalize takes the uint8 images of on_device's transform, got {images.dtype}")
        max_value, mean, std = (t.to(images.device) for t in (self.max_value, self.mean, self.std))
        return images.float().div_(max_value).sub_(mean).div_(std)


def on_device(transform: Callable) -> tuple[Callable, Normalize] | None:
    """(the workers' transform, with uint8 output; the device's Normalize) of a pipeline ending in ToTensor +
    Normalize; None for another (timm's random erasing follows them: it works on normalised pixels). A transform
    that wraps such a pipeline (the ssl views) splits itself by its own `on_device()`."""
    if hasattr(transform, "on_device"):
        return transform.on_device()
    ensure_torchvision_importable(announce=False)
    from torchvision import transforms as T

    steps = list(getattr(transform, "transforms", ()))
    if len(steps) < 2 or not isinstance(steps[-2], T.ToTensor) or not isinstance(steps[-1], T.Normalize):
        return None
    norm = steps[-1]
    return T.Compose([*steps[:-2], T.PILToTensor()]), Normalize(norm.mean, norm.std)


__all__ = ["Normalize", "on_device"]
