"""Zero-shot ImageNet (OpenCLIP's ``--imagenet-val DIR``): the 1,000-class validation set as an ImageFolder,
scored with the standard class names and OpenAI's 80 prompt templates, both taken from open_clip so that the
numbers compare with OpenCLIP's; images are decoded and preprocessed in DataLoader workers.

The folder is the usual ``val/`` layout: one subfolder per synset (``n01440764/`` ... ``n15075141/``), which in
sorted order are the class indices of the names list. Variants read the same way: ImageNet-Sketch (1,000 synset
folders), ImageNet-V2 (folders 0..999, class numbers), ImageNet-R and -A (200 synset folders: scored among their
200 classes, with a note); a folder that is not an ImageNet class is refused. A corrupt image is skipped and
counted, as in every eval.

ObjectNet is read from its download's layout, ``images/<folder>/*.png`` beside ``mappings/`` (the four files it
ships: folder -> ObjectNet class, ObjectNet class -> ImageNet class names, ImageNet label lines, PyTorch index ->
ImageNet 2012 id). Its 113 classes that overlap ImageNet are scored as the CLIP paper's robustness numbers are
(Taori et al.'s testbed, which the paper uses): the ImageNet classes the mapping names are prompted with
open_clip's names and templates, and an image counts as correct when the predicted one of them is one of its own
class's ImageNet classes (top-5: one of them among the 5 highest). clip_benchmark instead prompts the 113
ObjectNet class names; the numbers differ. The 1-pixel red border of every image is cropped first, as the
ObjectNet authors instruct. Images of ObjectNet's other 200 classes are left out, with a note; a folder the
mapping does not name, or a missing mapping file, is refused. Results are named ``objectnet``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
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
    """(image path, label) for every image, folders in label order and files sorted within each (ObjectNet: the
    images of its classes that overlap ImageNet)."""
    root = Path(root)
    if is_objectnet(root):
        objectnet = read_objectnet(root)
        root, pairs = objectnet.root / "images", list(objectnet.folders.items())
    else:
        pairs = list(enumerate(class_folders(root)))
    out = []
    for label, folder in pairs:
        if not (root / folder).is_dir():  # an ObjectNet class without images here (a partial copy)
            continue
        names = sorted(e.name for e in os.scandir(root / folder) if _is_image(e))
        out += [(str(root / folder / name), label) for name in names]
    return out


# ----------------------------------------------------------------------------- ObjectNet
OBJECTNET = "objectnet"
FOLDER_TO_LABEL = "folder_to_objectnet_label.json"
TO_IMAGENET = "objectnet_to_imagenet_1k.json"
PYTORCH_TO_ID = "pytorch_to_imagenet_2012_id.json"
IMAGENET_LABELS = "imagenet_to_label_2012_v2"
_SHIPPED = "as the ObjectNet download ships it (objectnet-1.0/mappings/)"


def is_objectnet(root: str | os.PathLike) -> bool:
    """An ObjectNet download's layout: images/ and mappings/ (either marks it, so that a missing one is named)."""
    root = Path(root)
    return (root / "images").is_dir() or (root / "mappings").is_dir()


@dataclass(frozen=True)
class ObjectNet:
    root: Path
    classnames: tuple[str, ...]  # the ObjectNet classes that overlap ImageNet, in label order (sorted folders)
    folders: dict[int, str]  # label -> its image folder under images/
    imagenet: tuple[tuple[int, ...], ...]  # per label, the ImageNet class indices that count as it
    left_out: tuple[str, ...]  # image folders of ObjectNet classes outside ImageNet: not scored


def _mapping(root: Path, name: str):
    path = root / "mappings" / name
    if not path.is_file():
        raise ValueError(f"{path}: missing; an ObjectNet folder has mappings/{name} {_SHIPPED}")
    if not name.endswith(".json"):
        return path.read_text().splitlines()
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); restore the file {_SHIPPED}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object; restore the file {_SHIPPED}")
    return data


def read_objectnet(root: str | os.PathLike) -> ObjectNet:
    """ObjectNet's classes that overlap ImageNet and their ImageNet classes, from its mappings/ files; ValueError
    naming the missing file, or the image folder the mapping does not name."""
    root = Path(root)
    images = root / "images"
    if not images.is_dir():
        raise ValueError(f"{images}: missing; an ObjectNet folder has images/<class folder>/*.png beside mappings/")
    folder_to_label = _mapping(root, FOLDER_TO_LABEL)
    to_imagenet = _mapping(root, TO_IMAGENET)
    pytorch_to_id = _mapping(root, PYTORCH_TO_ID)
    labels = _mapping(root, IMAGENET_LABELS)
    where = root / "mappings"
    try:  # line i of imagenet_to_label_2012_v2 names ImageNet 2012 id i; the PyTorch index is our class index
        id_to_index = {int(i): int(p) for p, i in pytorch_to_id.items()}
    except (TypeError, ValueError):
        raise ValueError(f"{where / PYTORCH_TO_ID}: expected index -> id integers; restore it {_SHIPPED}") from None
    by_name: dict[str, list[int]] = {}
    for i, line in enumerate(labels):
        if i in id_to_index:
            by_name.setdefault(line.strip(), []).append(id_to_index[i])
    label_to_folder = {label: folder for folder, label in folder_to_label.items()}
    overlap = {}  # folder -> ImageNet class indices
    for label, names in to_imagenet.items():
        if label not in label_to_folder:
            raise ValueError(
                f"{where / TO_IMAGENET}: class {label!r} is no folder's class in {FOLDER_TO_LABEL}; restore the "
                f"mapping files {_SHIPPED}"
            )
        indices = []
        for name in str(names).split("; "):
            if name not in by_name:
                raise ValueError(
                    f"{where / TO_IMAGENET}: ImageNet class {name!r} (of {label!r}) is not a line of "
                    f"{IMAGENET_LABELS} with an id in {PYTORCH_TO_ID}; restore the mapping files {_SHIPPED}"
                )
            indices += by_name[name]
        overlap[label_to_folder[label]] = tuple(sorted(set(indices)))
    present = sorted(entry.name for entry in os.scandir(images) if entry.is_dir())
    odd = next((f for f in present if f not in folder_to_label), None)
    if odd is not None:
        raise ValueError(
            f"{images / odd}: not a folder of {where / FOLDER_TO_LABEL}; ObjectNet's images/ holds only the class "
            "folders its mapping names (move the others out)"
        )
    if not present:
        raise ValueError(f"{images}: no class folders; an ObjectNet folder has images/<class folder>/*.png")
    scored = sorted(overlap)
    return ObjectNet(
        root=root,
        classnames=tuple(folder_to_label[f] for f in scored),
        folders=dict(enumerate(scored)),
        imagenet=tuple(overlap[f] for f in scored),
        left_out=tuple(f for f in present if f not in overlap),
    )


def objectnet_spec(objectnet: ObjectNet, templates: str = "openai") -> ZeroShotSpec:
    """Scored among ObjectNet's overlapping classes, prompted with the ImageNet classes they map to."""
    imagenet = imagenet_spec(templates)
    prompted = sorted({i for group in objectnet.imagenet for i in group})
    position = {c: i for i, c in enumerate(prompted)}
    return ZeroShotSpec(
        OBJECTNET,
        objectnet.classnames,
        imagenet.templates,
        prompted=tuple(imagenet.classnames[c] for c in prompted),
        pool=tuple(tuple(position[c] for c in group) for group in objectnet.imagenet),
    )


def objectnet_note(objectnet: ObjectNet) -> str:
    left = ""
    if objectnet.left_out:
        left = f"; the images of its {len(objectnet.left_out)} other class folders are left out"
    return (
        f"{objectnet.root}: ObjectNet, scored on its {len(objectnet.classnames)} classes that overlap ImageNet "
        f"(a hit: the predicted ImageNet class is one of its class's){left}"
    )


def read_variant(root: str | os.PathLike, templates: str = "openai") -> tuple[ZeroShotSpec, str | None]:
    """The spec of an ImageNet folder, a variant of it or ObjectNet, and what to note of it (a subset, ObjectNet's
    mapping) or None; ValueError naming what is off."""
    if is_objectnet(root):
        objectnet = read_objectnet(root)
        return objectnet_spec(objectnet, templates), objectnet_note(objectnet)
    folders = class_folders(root)
    if not any(_holds_an_image(Path(root) / folder) for folder in folders):  # stops at the first image found
        raise ValueError(
            f"{root}: no image ({', '.join('.' + e for e in IMAGE_EXTS)}) in its {len(folders):,} class folders: "
            f"the validation images go inside them"
        )
    return imagenet_spec(templates, folders), subset_note(root, folders)


def _holds_an_image(folder: Path) -> bool:
    with os.scandir(folder) as entries:
        return any(_is_image(e) for e in entries)


def _is_image(entry: os.DirEntry) -> bool:
    """A file named as an image the evaluation reads (.png, .jpg, ...: IMAGE_EXTS)."""
    return entry.is_file() and entry.name.rsplit(".", 1)[-1].lower() in IMAGE_EXTS


def with_templates(spec: ZeroShotSpec, templates: tuple[str, ...]) -> ZeroShotSpec:
    return replace(spec, templates=templates)


def crop_border(image):
    """ObjectNet's images carry a 1-pixel red border, which its authors say to remove before testing."""
    width, height = image.size
    return image.crop((1, 1, width - 1, height - 1))


class _BorderCropped:
    """The preprocess after crop_border (a class: DataLoader workers unpickle it)."""

    def __init__(self, preprocess: Callable):
        self.preprocess = preprocess

    def __call__(self, image):
        return self.preprocess(crop_border(image))


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
    """An `evaluate` source over an ImageNet validation folder, a variant or ObjectNet. The file list is made once
    (50,000 names) and kept for the run's later evaluations; samples come out preprocessed, so `evaluate` takes
    ``preprocess=prepared`` (identity) with it."""

    def __init__(self, root: str | os.PathLike, preprocess: Callable, *, workers: int = 0, batch_size: int = 64):
        self.root, self.preprocess, self.workers, self.batch_size = Path(root), preprocess, workers, batch_size
        self._files: list[tuple[str, int]] | None = None
        self.name = NAME
        if is_objectnet(self.root):  # its images lose their red border first
            self.preprocess, self.name = _BorderCropped(preprocess), OBJECTNET

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
                yield EvalSample(image, None, None, self.name, label, path)


def prepared(image):
    """The preprocess of samples that arrive preprocessed (ImageNetSource)."""
    return image
