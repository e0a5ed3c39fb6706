"""fastclip: distributed CLIP pretraining with the FastCLIP global contrastive losses.

The path of a batch reads off the package tree:
    fastclip/data      shards -> batches of (images, token ids, global indices)
    fastclip/models    OpenCLIP towers built from a config (random init)
    fastclip/losses    gathered features -> loss with per-sample state sharded by owner rank
    fastclip/optim     parameter groups, optimizers, pure schedules
    fastclip/train     the trainer: launch, steps, checkpoints, logging
    fastclip/eval      zero-shot, retrieval, export to open_clip, plots
"""

__version__ = "0.1.0"
