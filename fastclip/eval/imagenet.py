"""Zero-shot ImageNet (OpenCLIP's ``--imagenet-val DIR``): the 1,000-class validation set as an ImageFolder,
scored with the standard class names and OpenAI's 80 prompt templates, both taken from open_clip so that the
numbers compare with OpenCLIP's; images are decoded and preprocessed in DataLoader workers.

The folder is the usual ``val/`` layout: one subfolder per synset (``n01440764/`` ... ``n15075141/``), which in
sorted order are the class indices of the names list. A corrupt image is skipped and counted, as in every eval.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

# A spawned DataLoader worker unpickles the preprocess (torchvision objects) right after importing this module:
# the CPU-torch guard must run first (see fastclip/data/worker.py).
from fastclip.compat import ensure_torchvision_importable  # noqa: E402
from fastclip.data.format import IMAGE_EXTS
from fastclip.data.samples import decode_image
from fastclip.eval.samples import EvalSample
from fastclip.eval.spec import ZeroShotSpec

ensure_torchvision_importable(announce=False)
log = logging.getLogger(__name__)

NUM_CLASSES = 1000
NAME = "imagenet"
TEMPLATE_SETS = ("openai", "simple")  # open_clip's OPENAI_IMAGENET_TEMPLATES (80) and SIMPLE_... (7)
_SYNSET = re.compile(r"n\d{8}")


def imagenet_spec(templates: str = "openai") -> ZeroShotSpec:
    """The 1,000 class names in class-index order and the chosen template set, as open_clip ships them."""
    if templates not in TEMPLATE_SETS:
        raise ValueError(f"ImageNet templates {templates!r}: not one of {', '.join(TEMPLATE_SETS)}")
    from fastclip.compat import import_open_clip

    import_open_clip()
    from open_clip import zero_shot_metadata as meta

    chosen = meta.OPENAI_IMAGENET_TEMPLATES if templates == "openai" else meta.SIMPLE_IMAGENET_TEMPLATES
    # open_clip's templates are functions of the class name; ours are "{}" strings
    return ZeroShotSpec(NAME, tuple(meta.IMAGENET_CLASSNAMES), tuple(t("{}") for t in chosen))


def class_folders(root: str | os.PathLike) -> list[str]:
    """The 1,000 class folders of an ImageNet validation folder in label order; ValueError naming what is off."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: not a folder (an ImageNet validation ImageFolder: one subfolder per class)")
    folders = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if len(folders) != NUM_CLASSES:
        raise ValueError(
            f"{root}: {len(folders)} class folders; an ImageNet validation folder has {NUM_CLASSES}, one per synset "
            f"(n01440764/ ...: the val images sorted into class folders, as torchvision's ImageFolder reads them)"
        )
    # sorted synset ids (or zero-padded class numbers) are the class-index order of the names list
    padded = all(f.isdigit() for f in folders) and len({len(f) for f in folders}) == 1
    if not (padded or all(_SYNSET.fullmatch(f) for f in folders)):
        odd = next(f for f in folders if not _SYNSET.fullmatch(f))
        raise ValueError(
            f"{root}: class folder {odd!r} is neither a synset id (n01440764) nor a zero-padded class number; "
            f"the labels follow the sorted folder names, which must be in ImageNet's class order"
        )
    return folders


def list_images(root: str | os.PathLike) -> list[tuple[str, int]]:
    """(image path, label) for every image, folders in label order and files sorted within each."""
    root = Path(root)
    out = []
    for label, folder in enumerate(class_folders(root)):
        names = sorted(
            e.name for e in os.scandir(root / folder) if e.is_file() and e.name.rsplit(".", 1)[-1].lower() in IMAGE_EXTS
        )
        out += [(str(root / folder / name), label) for name in names]
    return out


class _Images(torch.utils.data.Dataset):
    """One rank's slice of the images; a worker decodes and preprocesses, or reports why it could not."""

    def __init__(self, files: list[tuple[str, int]], preprocess: Callable):
        self.files, self.preprocess = files, preprocess

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path, label = self.files[i]
        try:
            with open(path, "rb") as f:
                image = self.preprocess(decode_image(f.read()))
        except Exception as err:  # noqa: BLE001 - PIL and the transforms raise many types on a corrupt file
            return None, label, path, f"{path}: cannot decode image ({type(err).__name__}: {err})"
        return image, label, path, None


def _as_list(batch):
    return batch


class ImageNetSource:
    """An `evaluate` source over an ImageNet validation folder. The file list is made once (50,000 names) and
    kept for the run's later evaluations; samples come out preprocessed, so `evaluate` takes ``preprocess=None``
    (identity) with it."""

    def __init__(self, root: str | os.PathLike, preprocess: Callable, *, workers: int = 0, batch_size: int = 64):
        self.root, self.preprocess, self.workers, self.batch_size = Path(root), preprocess, workers, batch_size
        self._files: list[tuple[str, int]] | None = None

    def __call__(self, rank: int, world_size: int, skipped: list[str]) -> Iterator[EvalSample]:
        if self._files is None:
            self._files = list_images(self.root)
        mine = self._files[rank::world_size]
        loader = torch.utils.data.DataLoader(
            _Images(mine, self.preprocess),
            batch_size=self.batch_size,
            num_workers=self.workers,
            collate_fn=_as_list,
        )
        for batch in loader:
            for image, label, path, error in batch:
                if error is not None:
                    log.warning("eval data: skipped %s", error)
                    skipped.append(error)
                    continue
                yield EvalSample(image, None, None, NAME, label, path)


def prepared(image):
    """The preprocess of samples that arrive preprocessed (ImageNetSource)."""
    return image
