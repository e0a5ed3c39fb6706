"""The trainer's data: the stream of this rank's part of every global batch (fastclip/data), configured from the
data section, with uint8 images normalised on the device (fastclip/data/pixels.py)."""

from __future__ import annotations

import torch

from fastclip.data import StreamConfig
from fastclip.data.pixels import on_device
from fastclip.data.views import split_views
from fastclip.train import preflight
from fastclip.train.config import Config, ConfigError


def stream_config(cfg: Config, data_size: int, device: torch.device) -> StreamConfig:
    """The data section (its stream keys are StreamConfig's) plus what the trainer decides: seed, data_size,
    pinning; rank 0 logs every rank's skips, once per epoch (DataSkipReport)."""
    pin_memory = device.type == "cuda" and cfg.data.pin_memory is not False
    decided = {"seed": preflight.data_seed(cfg), "data_size": data_size, "pin_memory": pin_memory}
    return StreamConfig.from_any(cfg.data, **decided, log_skips_per_reason=0)


def train_pixels(cfg: Config, preprocess):
    """(the data workers' transform, the device's Normalize): uint8 batches, normalised on the device, unless
    data.device_normalize is false or the transform cannot be split (timm's erasing): then (preprocess, None)."""
    split = on_device(preprocess) if cfg.data.device_normalize is not False else None
    if split is None and cfg.data.device_normalize:
        raise ConfigError(
            "config key 'data.device_normalize': the training transform does not end in ToTensor + Normalize, so "
            "its pixels cannot be normalised on the device: set it null or false"
        )
    return split or (preprocess, None)


def build_data(cfg: Config, info, built, catalog, data_size: int):
    """(the train stream of this rank, the device's Normalize or None) for the towers `built` (their transform and
    tokenizer)."""
    from fastclip.data import build_train_stream

    preprocess, normalize = train_pixels(cfg, built.preprocess_train)
    if normalize is not None:
        normalize.to(info.device)
    stream = build_train_stream(
        stream_config(cfg, data_size, info.device),
        rank=info.rank,
        world_size=info.world_size,
        preprocess=preprocess,
        tokenizer=built.tokenizer,
        catalog=catalog,
    )
    return stream, normalize


def to_device(batch: tuple, device: torch.device, normalize, *, ssl: bool) -> tuple:
    """A loader batch on the device, its uint8 images normalised there; ssl: the two views of each image take the
    places of image and text (groups: copies of one image are positives)."""
    batch = tuple(t.to(device, non_blocking=True) for t in batch)
    if normalize is not None:  # ssl: [B, 2, C, H, W], the same per channel
        batch = (normalize(batch[0]), *batch[1:])
    if ssl:
        batch = (*split_views(batch[0]), *batch[2:])
    return batch
