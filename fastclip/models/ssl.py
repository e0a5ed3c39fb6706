"""The self-supervised network: an open_clip image tower and a projector MLP (SimCLR's g(·), discarded for
evaluation: the features downstream are the tower's). ``encode_image`` and ``encode_text`` are the same function,
so the trainer's two-tower code runs the two views of each image through it unchanged (fastclip/train/ssl.py)."""

from __future__ import annotations

import torch
from torch import nn


class Projector(nn.Sequential):
    """SimCLR's 2-layer MLP: Linear -> ReLU -> Linear."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int):
        super().__init__(nn.Linear(in_dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, out_dim))


class ImageTower(nn.Module):
    """An image tower trained alone (an ssl run's, or its export, in `fastclip eval`): the probe's features are its
    output, what the exported ``model.visual`` gives (fastclip/eval/probe.py ``feature_kind``)."""

    image_only = True

    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual

    def head(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.visual(images))


class ImageTowerWithProjector(ImageTower):
    """``visual`` (an open_clip image tower, its output ``embed_dim`` wide) followed by the projector."""

    def __init__(self, visual: nn.Module, embed_dim: int, hidden: int, out_dim: int):
        super().__init__(visual)
        self.projector = Projector(embed_dim, hidden, out_dim)
        # the trainer freezes a model's logit_scale (the loss owns the temperature); kept for that and for export
        self.logit_scale = nn.Parameter(torch.zeros(()), requires_grad=False)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        return self.projector(features)

    encode_text = ImageTower.encode_image  # the second view: the same tower

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.visual.set_grad_checkpointing(enable)
