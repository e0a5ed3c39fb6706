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


class ImageTowerWithProjector(nn.Module):
    """``visual`` (an open_clip image tower, its output ``embed_dim`` wide) followed by the projector."""

    def __init__(self, visual: nn.Module, embed_dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.visual = visual
        self.projector = Projector(embed_dim, hidden, out_dim)
        # the trainer freezes a model's logit_scale (the loss owns the temperature); kept for that and for export
        self.logit_scale = nn.Parameter(torch.zeros(()), requires_grad=False)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.projector(self.visual(images))

    encode_text = encode_image  # the second view: the same tower

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.visual.set_grad_checkpointing(enable)
