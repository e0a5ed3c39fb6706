"""GPU speed defaults, each a config key, applied by the trainer; none changes what runs on a CPU.

train.tf32 (true)             CUDA: fp32 matmuls and cuDNN convolutions in TF32 on Ampere and later (10-bit
                              mantissa, ~1e-3 relative error per product). This includes the loss's fp32
                              similarity matmul; set false for IEEE fp32 everywhere. Under AMP (the recipes) the
                              towers' matmuls are fp16/bf16 anyway.
train.cudnn_benchmark (true)  CUDA: cuDNN times its convolution algorithms for the first batch of each shape and
                              keeps the fastest (the batch shape is fixed, so once).
model.channels_last (null)    NHWC weights and inputs for convolutional image towers (RN50: more than the one
                              patch-embedding convolution a ViT has); null = on for CUDA, off on CPU.
train.ddp_bucket_view (true)  DDP gradient_as_bucket_view: gradients are views into the all-reduce buckets (one
                              copy less, one gradient-sized buffer less); the trainer only edits them in place.
train.ddp_static_graph (null) DDP static_graph: the reducer learns the graph in the first step and skips its
                              search afterwards. null = on where valid: one forward/backward per step
                              (optim.accum_steps 1: GradCache's extra no-grad forwards change the graph) and no
                              torch.compile (compiled DDP splits the graph itself). A step whose features are
                              refused (forward, no backward) is fine: tests/test_faults.py's skipped steps run
                              with it (and gave parameters bitwise equal to DDP without it, checked by hand).
deepspeed.overlap_comm (null) ZeRO overlaps gradient reduction with the backward; null = on for CUDA (CUDA
                              streams), off on CPU where it has nothing to overlap with.
"""

from __future__ import annotations

import torch

from fastclip.train.config import Config


def apply_backend_flags(cfg: Config, device: torch.device) -> list[str]:
    """Set TF32 and cudnn.benchmark for a CUDA run; returns what was set, for the start line."""
    if device.type != "cuda":
        return []
    tf32 = cfg.train.tf32
    matmul, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    if hasattr(matmul, "fp32_precision") and conv is not None:  # torch >= 2.9: the per-backend API
        matmul.fp32_precision = "tf32" if tf32 else "ieee"
        conv.fp32_precision = "tf32" if tf32 else "ieee"
    else:
        matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    return [name for name, on in (("TF32", tf32), ("cudnn.benchmark", cfg.train.cudnn_benchmark)) if on]


def is_convolutional(model: torch.nn.Module) -> bool:
    """An image tower with more than one Conv2d (a ViT has exactly one: its patch embedding)."""
    visual = getattr(model, "visual", model)
    return sum(isinstance(m, torch.nn.Conv2d) for m in visual.modules()) > 1


def wants_channels_last(cfg: Config, model: torch.nn.Module, device: torch.device) -> bool:
    if cfg.model.channels_last is not None:
        return cfg.model.channels_last
    return device.type == "cuda" and is_convolutional(model)


def to_channels_last(model: torch.nn.Module) -> None:
    """NHWC image tower: its 4-d weights converted in place, and its input converted by a forward pre-hook
    (so every caller, evaluation included, hands it the layout its weights have)."""
    visual = getattr(model, "visual", model)
    visual.to(memory_format=torch.channels_last)

    def nhwc(module, args):
        if args and torch.is_tensor(args[0]) and args[0].dim() == 4:
            return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])
        return None

    visual.register_forward_pre_hook(nhwc)


def ddp_options(cfg: Config) -> dict:
    static = cfg.train.ddp_static_graph
    if static is None:
        static = cfg.optim.accum_steps == 1 and not cfg.model.compile
    return {"gradient_as_bucket_view": cfg.train.ddp_bucket_view, "static_graph": static}


def overlap_comm(cfg: Config, device: torch.device) -> bool:
    value = cfg.deepspeed.overlap_comm
    return device.type == "cuda" if value is None else value


__all__ = [
    "apply_backend_flags",
    "is_convolutional",
    "wants_channels_last",
    "to_channels_last",
    "ddp_options",
    "overlap_comm",
]
