"""Run OpenCLIP's own trainer (open_clip_train.main, unmodified) as the peer in end-to-end benchmarks.

Two platform shims, no change to its training logic: our tiny model configs are registered with open_clip
first (its trainer has no flag for a config file), and on CPU its `DistributedDataParallel(model,
device_ids=[device])` call gets `device_ids=None` (torch rejects a CPU device there). Launch like the original:
    torchrun --nproc_per_node 2 benchmarks/openclip_peer.py -- --model tiny-vit --train-data ... (OpenCLIP flags)
"""

import sys
from pathlib import Path

from fastclip.compat import import_open_clip

open_clip = import_open_clip()
for config in sorted((Path(__file__).resolve().parents[1] / "configs" / "models").glob("*.json")):
    open_clip.add_model_config(str(config))

import torch  # noqa: E402

_DDP = torch.nn.parallel.DistributedDataParallel


class _CPUFriendlyDDP(_DDP):
    def __init__(self, module, device_ids=None, **kwargs):
        if device_ids and all(torch.device(d).type == "cpu" for d in device_ids):
            device_ids = None
        super().__init__(module, device_ids=device_ids, **kwargs)


torch.nn.parallel.DistributedDataParallel = _CPUFriendlyDDP

from open_clip_train.main import main  # noqa: E402  (after the guard, the configs and the shim)

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    main(argv)
