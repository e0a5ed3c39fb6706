"""Zero-shot ImageNet (OpenCLIP's ``--imagenet-val DIR``): the 1,000-class validation set as an ImageFolder,
scored with the standard class names and OpenAI's 80 prompt templates, both taken from open_clip so that the
numbers compare with OpenCLIP's; images are decoded and preprocessed in DataLoader workers.

The folder is the usual ``val/`` layout: one subfolder per synset (``n01440764/`` ... ``n15075141/``), which in
sorted order are the class indices of the names list. Variants read the same way: ImageNet-Sketch (1,000 synset
folders), ImageNet-V2 (folders 0..999, class numbers), ImageNet-R and -A (200 synset folders: scored among their
200 classes, with a note); a folder that is not an ImageNet class is refused. ObjectNet (its own class folder
names, mapped to ImageNet's by a file of its own) is not read. A corrupt image is skipped and counted, as in
every eval.
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


def imagenet_synsets() -> list[str]:
    """ImageNet-1k's 1,000 synset ids in class-index order (the sorted WordNet ids, kept beside this file)."""
    return Path(__file__).with_name("imagenet_synsets.txt").read_text().split()


def class_indices(folders: list[str]) -> list[int]:
    """The ImageNet class index of each class folder (a synset id, or a class number as ImageNet-V2 names them)."""
    if all(f.isdigit() for f in folders):
        return [int(f) for f in folders]
    if len(folders) == NUM_CLASSES:  # the whole set (class_folders): sorted, the folders are the class order
        return list(range(NUM_CLASSES))
    position = {synset: i for i, synset in enumerate(imagenet_synsets())}
    return [position[f] for f in folders]


def imagenet_spec(templates: str = "openai", folders: list[str] | None = None) -> ZeroShotSpec:
    """The class names of `folders` (class_folders' order; None: all 1,000 in class-index order) and the chosen
    template set, as open_clip ships them. A variant with a subset of the classes (ImageNet-R, -A: 200) is scored
    among its own classes only, as their papers do."""
    if templates not in TEMPLATE_SETS:
        raise ValueError(f"ImageNet templates {templates!r}: not one of {', '.join(TEMPLATE_SETS)}")
    from fastclip.compat import import_open_clip

    import_open_clip()
    from open_clip import zero_shot_metadata as meta

    chosen = meta.OPENAI_IMAGENET_TEMPLATES if templates == "openai" else meta.SIMPLE_IMAGENET_TEMPLATES
    names = meta.IMAGENET_CLASSNAMES
    if folders is not None:
        names = [names[i] for i in class_indices(folders)]
    # open_clip's templates are functions of the class name; ours are "{}" strings
    return ZeroShotSpec(NAME, tuple(names), tuple(t("{}") for t in chosen))


def subset_note(root, folders: list[str]) -> str | None:
    """What to say of a folder with fewer than the 1,000 classes (a variant, or a quick check); None for all."""
    if len(folders) == NUM_CLASSES:
        return None
    return (
        f"{root}: {len(folders)} of ImageNet's {NUM_CLASSES:,} classes (a subset, as ImageNet-R and -A have 200): "
        f"zero-shot chooses among those {len(folders)}, so its accuracy does not compare with a 1,000-class one"
    )


def class_folders(root: str | os.PathLike) -> list[str]:
    """The class folders of an ImageNet validation folder or variant (-V2, -R, -A, -Sketch), sorted (the label
    order): the 1,000 synsets or class numbers, or a subset of them; ValueError naming what is off."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: not a folder (an ImageNet validation ImageFolder: one subfolder per class)")
    folders = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not folders or len(folders) > NUM_CLASSES:
        raise ValueError(
            f"{root}: {len(folders)} class folders; an ImageNet validation folder has {NUM_CLASSES}, one per synset "
            f"(n01440764/ ...: the val images sorted into class folders, as torchvision's ImageFolder reads them), "
            "a variant such as ImageNet-R or -A a subset of them"
        )
    if all(f.isdigit() for f in folders):  # class numbers: ImageNet-V2's 0..999, or zero-padded
        odd = next((f for f in folders if int(f) >= NUM_CLASSES), None)
        if odd is None and len({int(f) for f in folders}) == len(folders):
            return folders
    elif len(folders) == NUM_CLASSES and all(_SYNSET.fullmatch(f) for f in folders):
        return folders  # the whole set: sorted, its folders are the class order, whatever their ids
    else:  # a subset: each folder must be a synset of ImageNet's, to know its class
        known = set(imagenet_synsets())
        odd = next((f for f in folders if f not in known), None)
        if odd is None:
            return folders
    raise ValueError(
        f"{root}: class folder {odd!r} is not one of ImageNet's {NUM_CLASSES:,} synset ids (n01440764 ...) nor a "
        "class number below 1000; an ImageNet folder or variant has one folder per class, named so"
    )


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
