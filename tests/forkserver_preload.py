"""Imported once by the forkserver that dist_utils.run_distributed forks its processes from (see PRELOAD there):
the modules every distributed test process needs, open_clip through the torchvision guard."""

import gc

import torch.distributed  # noqa: F401

import fastclip.losses  # noqa: F401
import fastclip.train.trainer  # noqa: F401
from fastclip.compat import import_open_clip

import_open_clip()

# every process forked from here shares these objects' pages; frozen, no collection in a child touches them (each
# would copy the pages it touched, and a full collection scans ~380,000 objects)
gc.freeze()
