"""Importing open_clip on a CPU-only torch.

PyPI's x86_64 torchvision wheels are CUDA builds; with a CPU torch their C extension cannot load, and
torchvision then fails at import while registering fake kernels for `torchvision::nms`/`qnms`. open_clip
imports torchvision, so it fails too. Declaring the two operator schemas first lets the import go through;
only the C++ ops (nms, roi_align, video/image decoding in torchvision.io) stay unusable, and open_clip uses
none of them: its transforms work on PIL images.
"""

from __future__ import annotations

import importlib.util
import logging
import os

log = logging.getLogger(__name__)
_applied = False


def _torchvision_extension_loads() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True  # not installed: nothing to guard, the real import error will speak for itself
    import torch

    for location in spec.submodule_search_locations:
        for name in os.listdir(location):
            if name.startswith("_C") and name.endswith((".so", ".pyd")):
                try:
                    torch.ops.load_library(os.path.join(location, name))
                    return True
                except (OSError, RuntimeError):
                    return False
    return False


def ensure_torchvision_importable(*, announce: bool = True) -> bool:
    """Make `import torchvision` (and so `import open_clip`) work; returns True if the guard was needed.

    ``announce=False`` keeps quiet (data-loader worker processes: the parent has said it once)."""
    global _applied
    if _applied:
        return True
    import sys

    if "torchvision" in sys.modules or _torchvision_extension_loads():
        return False
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    ensure_torchvision_importable._lib = lib  # keep the registration alive
    _applied = True
    # nothing for the user to act on (open_clip uses none of the C++ ops): logged, not printed
    (log.info if announce else log.debug)(
        "torchvision's C extension does not load with this torch build (CPU torch with a CUDA torchvision "
        "wheel); declared torchvision::nms/qnms so open_clip imports. torchvision's C++ ops are unavailable."
    )
    return True


def import_open_clip():
    ensure_torchvision_importable()
    import sys

    if "open_clip" in sys.modules:
        return sys.modules["open_clip"]
    # timm.utils imports wandb when it is installed, for a summary logger of its own that open_clip never calls:
    # 0.9 s and two temporary folders in every process. Hidden during the import only, so `train.wandb` still
    # imports the real package afterwards.
    hide_wandb = "wandb" not in sys.modules
    if hide_wandb:
        sys.modules["wandb"] = None
    try:
        import open_clip
    finally:
        if hide_wandb:
            del sys.modules["wandb"]
    return open_clip
