"""`fastclip data embedded --source scenes`: compositional scenes with distinct captions, from offline glyphs.

Each scene is a 64x64 RGB canvas with 1-3 glyphs (Fashion-MNIST items and MNIST digits by default, the same
offline datasets as the plain embedded source), each with a colour, a size and a cell of a 3x3 grid, on a
background of one colour and texture. Its caption names every object with its attributes and position, in
one of several phrasings and in a random object order, e.g.
    "a small red digit seven on the left, a large blue sandal at the top, on a plain grey background."
so nearly every caption is distinct and image<->text retrieval is meaningful (no ties between identical
captions). `parse_caption` reads a caption back into the scene it describes (the tests check every one).

Splits (one global index space; every manifest carries the same data_size):
  train   scenes from the training glyphs; no object ever has a held-out (class, colour) pair
  val     i.i.d. scenes from held-out glyphs (for choosing hyperparameters)
  test    i.i.d. scenes from held-out glyphs (for reporting)
  novel   held-out glyphs, each scene with at least one held-out (class, colour) pair: attribute combinations
          never seen in training
Single-object scenes carry the glyph's class as `label` (dataset "scenes", 20 classes) so zero-shot
classification of glyph classes runs on them; zeroshot.json holds the class names and prompt templates.

Everything is a function of (seed, split, scene number): shards are generated in parallel and the result is
byte-identical whatever the number of workers.

`captions_per_scene` K > 1 (`--captions-per-scene`): each scene becomes K samples, its image with K distinct
captions (caption c in phrasing (p + c) mod 3 and its own object order; caption 0 is the K = 1 caption), K
consecutive global indices sharing one json "group" (the first one's index), in one shard; only the first is
labelled, so zero-shot and the kNN probe see each image once. K = 1 writes exactly the former bytes.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image

from fastclip.data.format import ZEROSHOT_NAME, sample_key
from fastclip.data.manifest import Manifest, ShardInfo, write_manifest
from fastclip.data.sources.embedded import FASHION_MNIST_ROOT, choose_datasets, load_dataset
from fastclip.data.tario import TarWriter
from fastclip.data.writer import removed_on_failure

CANVAS = 64
COLOURS = {
    "red": (235, 50, 45),
    "green": (50, 205, 70),
    "blue": (60, 110, 250),
    "yellow": (245, 225, 45),
    "purple": (170, 70, 215),
    "orange": (250, 145, 35),
    "cyan": (45, 215, 225),
    "white": (250, 250, 250),
}
SIZES = {"small": 16, "large": 24}  # glyph side in pixels on the 64-pixel canvas
POSITIONS = {  # cell centre (x, y) and the caption phrase
    "top left": ((12, 12), "in the top left corner"),
    "top": ((32, 12), "at the top"),
    "top right": ((52, 12), "in the top right corner"),
    "left": ((12, 32), "on the left"),
    "centre": ((32, 32), "in the centre"),
    "right": ((52, 32), "on the right"),
    "bottom left": ((12, 52), "in the bottom left corner"),
    "bottom": ((32, 52), "at the bottom"),
    "bottom right": ((52, 52), "in the bottom right corner"),
}
BACKGROUNDS = {"black": (12, 12, 12), "grey": (95, 95, 95), "navy": (20, 28, 85), "brown": (80, 50, 25)}
TEXTURES = ("plain", "striped", "dotted")
NOUNS = {"fashion-mnist": "{}", "mnist": "digit {}", "animal-mnist": "{} silhouette"}
OBJECT_COUNTS = (1, 2, 3)
OBJECT_COUNT_PROBS = (0.2, 0.35, 0.45)
SPLITS = ("train", "val", "test", "novel")
SOURCE_NAMES = {"classic": "scenes", "semantic": "scenes-semantic"}  # `fastclip data embedded --source`
PHRASINGS = (
    "{objects}, on a {texture} {background} background.",
    "on a {texture} {background} background: {objects}.",
    "a picture with {objects}, on a {texture} {background} background.",
)


@dataclass(frozen=True)
class SceneObject:
    cls: int  # class id over all glyph datasets (see Vocabulary.nouns)
    colour: str
    size: str
    position: str


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]
    background: str
    texture: str
    phrasing: int
    glyphs: tuple[int, ...] = ()  # row of each object's glyph in its class pool (not in the caption)


class Vocabulary:
    """The glyph classes of the chosen datasets: nouns, held-out (class, colour) pairs, caption parsing."""

    def __init__(self, datasets: list[tuple[str, tuple[str, ...]]]):
        self.nouns: list[str] = [NOUNS[name].format(c) for name, classnames in datasets for c in classnames]
        if len(set(self.nouns)) != len(self.nouns):
            raise ValueError(f"glyph nouns are not distinct: {self.nouns}")
        colours = list(COLOURS)
        # one colour per class never appears with it in training: 20 of 160 pairs at 20 classes
        self.held_out = {(k, colours[(3 * k + 1) % len(colours)]) for k in range(len(self.nouns))}
        alt = lambda words: "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))  # noqa: E731
        phrase_to_pos = {phrase: name for name, (_, phrase) in POSITIONS.items()}
        self._phrase_to_pos = phrase_to_pos
        self._object_re = re.compile(rf"a ({alt(SIZES)}) ({alt(COLOURS)}) ({alt(self.nouns)}) ({alt(phrase_to_pos)})")
        self._background_re = re.compile(rf"on a ({alt(TEXTURES)}) ({alt(BACKGROUNDS)}) background")

    def caption(self, scene: Scene, order: list[int]) -> str:
        mentions = [
            f"a {o.size} {o.colour} {self.nouns[o.cls]} {POSITIONS[o.position][1]}"
            for o in (scene.objects[i] for i in order)
        ]
        objects = mentions[0] if len(mentions) == 1 else ", ".join(mentions[:-1]) + " and " + mentions[-1]
        return PHRASINGS[scene.phrasing].format(objects=objects, texture=scene.texture, background=scene.background)

    def parse_caption(self, caption: str) -> tuple[frozenset[SceneObject], str, str]:
        """(objects, background, texture) named by `caption`; raises ValueError on text it cannot read."""
        found = [
            SceneObject(self.nouns.index(noun), colour, size, self._phrase_to_pos[phrase])
            for size, colour, noun, phrase in self._object_re.findall(caption)
        ]
        background = self._background_re.search(caption)
        if not found or background is None:
            raise ValueError(f"cannot read caption {caption!r}")
        return frozenset(found), background.group(2), background.group(1)


# ---------------------------------------------------------------------- drawing
def background_canvas(name: str, texture: str) -> np.ndarray:
    """A float32 [64, 64, 3] canvas of the background, the caller's to draw on."""
    return _background(name, texture).copy()


@functools.cache  # 12 backgrounds: drawing one took half of a scene's render time
def _background(name: str, texture: str) -> np.ndarray:
    base = np.array(BACKGROUNDS[name], np.float32)
    canvas = np.broadcast_to(base, (CANVAS, CANVAS, 3)).copy()
    light = np.minimum(base + 70, 255)
    if texture == "striped":
        canvas[(np.arange(CANVAS) // 4) % 2 == 1, :, :] = light
    elif texture == "dotted":
        yy, xx = np.mgrid[0:CANVAS, 0:CANVAS]
        canvas[(yy % 8 == 3) & (xx % 8 == 3)] = light
        canvas[(yy % 8 == 4) & (xx % 8 == 4)] = light
    return canvas


def draw_glyph(canvas: np.ndarray, glyph: np.ndarray, side: int, centre: tuple[int, int], colour) -> None:
    """Blend `glyph` (28x28 grey, its alpha), resized to side x side and centred at `centre`, in `colour`."""
    alpha = np.asarray(Image.fromarray(glyph).resize((side, side), Image.BILINEAR), np.float32) / 255.0
    cx, cy = centre
    x0, y0 = cx - side // 2, cy - side // 2
    xs, ys = slice(max(x0, 0), min(x0 + side, CANVAS)), slice(max(y0, 0), min(y0 + side, CANVAS))
    a = alpha[ys.start - y0 : ys.stop - y0, xs.start - x0 : xs.stop - x0, None]
    canvas[ys, xs] = canvas[ys, xs] * (1 - a) + np.array(colour, np.float32) * a


def render(scene: Scene, pools: list[np.ndarray]) -> np.ndarray:
    """The scene as a uint8 [64, 64, 3] image; pools[k] holds class k's glyphs (n, 28, 28)."""
    canvas = background_canvas(scene.background, scene.texture)
    for obj, row in zip(scene.objects, scene.glyphs):
        draw_glyph(canvas, pools[obj.cls][row], SIZES[obj.size], POSITIONS[obj.position][0], COLOURS[obj.colour])
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------- sampling
def sample_scene(
    rng: np.random.Generator, vocab: Vocabulary, pool_sizes: list[int], split: str, single: bool = False
) -> Scene:
    """One scene: attributes, glyph rows and phrasing drawn from `rng`, respecting the split's rule on held-out
    (class, colour) pairs (never in train; at least one, the first object, in novel)."""
    n_classes, colours = len(vocab.nouns), list(COLOURS)
    count = 1 if single else int(rng.choice(OBJECT_COUNTS, p=OBJECT_COUNT_PROBS))
    cells = rng.permutation(len(POSITIONS))[:count]
    objects, glyphs = [], []
    for j in range(count):
        cls = int(rng.integers(n_classes))
        if split == "novel" and j == 0:
            colour = next(c for k, c in sorted(vocab.held_out) if k == cls)
        else:
            colour = colours[int(rng.integers(len(colours)))]
            while split == "train" and (cls, colour) in vocab.held_out:
                colour = colours[int(rng.integers(len(colours)))]
        size = list(SIZES)[int(rng.integers(len(SIZES)))]
        objects.append(SceneObject(cls, colour, size, list(POSITIONS)[int(cells[j])]))
        glyphs.append(int(rng.integers(pool_sizes[cls])))
    background = list(BACKGROUNDS)[int(rng.integers(len(BACKGROUNDS)))]
    texture = TEXTURES[int(rng.integers(len(TEXTURES)))]
    return Scene(tuple(objects), background, texture, int(rng.integers(len(PHRASINGS))), tuple(glyphs))


# ---------------------------------------------------------------------- glyph pools
def glyph_pools(names: list[str], fashion_root, seed: int):
    """(vocabulary, {"train": pools, "heldout": pools}): per class, the glyph images of each part. Datasets
    with an official split keep it; the others hold out a seeded 20 % of each class."""
    rng = np.random.default_rng([seed, 7])
    specs, pools = [], {"train": [], "heldout": []}
    for name in names:
        spec, parts, _ = load_dataset(name, fashion_root)
        specs.append((name, spec.classnames))
        for label in range(len(spec.classnames)):
            if len(parts) == 2:
                train, held = (p[0][p[1] == label] for p in parts)
            else:
                rows = parts[0][0][parts[0][1] == label]
                rows = rows[rng.permutation(len(rows))]
                n_held = len(rows) // 5
                train, held = rows[n_held:], rows[:n_held]
            pools["train"].append(train)
            pools["heldout"].append(held)
    return Vocabulary(specs), pools


# ---------------------------------------------------------------------- writing
@dataclass(frozen=True)
class ShardJob:
    split: str
    shard: int
    first: int  # scene number within the split of the shard's first scene
    count: int  # scenes
    first_index: int  # global index of the shard's first sample
    captions: int = 1  # samples per scene (captions_per_scene)


_WORKER: dict = {}


def _init_worker(names, fashion_root, seed, variant="classic"):
    _WORKER["vocab"], _WORKER["pools"] = glyph_pools(names, fashion_root, seed)
    _WORKER["seed"], _WORKER["variant"] = seed, variant


def _init_pool_worker(names, fashion_root, seed, variant):
    """A pool worker leaves Ctrl-C, SIGTERM and SIGHUP (sent to the whole process group) to the parent, which starts
    no further shard and removes what was written; a worker stopped by them would print its own traceback."""
    for kind in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(kind, signal.SIG_IGN)
    _init_worker(names, fashion_root, seed, variant)


def scene_rng(seed: int, split: str, number: int) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS.index(split), number])


def classic_scene_and_caption(seed: int, split: str, number: int, vocab: Vocabulary, pool_sizes: list[int]):
    """(Scene, caption) of scene `number` of `split`: a function of (seed, split, number) alone."""
    rng = scene_rng(seed, split, number)
    scene = sample_scene(rng, vocab, pool_sizes, split)
    return scene, vocab.caption(scene, [int(i) for i in rng.permutation(len(scene.objects))])


class Variant(NamedTuple):
    scene_and_caption: Callable  # (seed, split, number, vocab, pool_sizes) -> (Scene, caption)
    render: Callable  # (Scene, pools) -> uint8 [64, 64, 3]
    zeroshot_prompts: Callable  # () -> templates
    png_level: int  # zlib level of the PNGs: the classic scenes keep PIL's 6 (their shards stay byte-identical)
    caption: Callable  # (vocab, Scene, object order) -> caption in the scene's phrasing
    phrasings: int  # how many phrasings: the most distinct captions a one-object scene has


def variant_functions(variant: str) -> Variant:
    """The functions of a scenes variant: "classic" (this module) or "semantic" (scenes_semantic.py)."""
    if variant == "classic":
        return Variant(classic_scene_and_caption, render, zeroshot_prompts, 6, Vocabulary.caption, len(PHRASINGS))
    if variant == "semantic":
        from fastclip.data.sources import scenes_semantic as sem

        # level 1: 40 % less time per PNG than 6, 10 % larger files
        return Variant(sem.scene_and_caption, sem.render, sem.zeroshot_prompts, 1, sem.caption, len(sem.PHRASINGS))
    raise ValueError(f"unknown scenes variant {variant!r}: classic or semantic")


def more_captions(variant: Variant, vocab, scene: Scene, seed: int, split: str, number: int, k: int) -> list[str]:
    """Captions 1..k-1 of scene `number`: phrasing (p + c) mod the phrasings (so all k differ for k <= that), each
    in its own seeded object order (its own stream: caption 0 and the scene are drawn as before)."""
    out = []
    for c in range(1, k):
        order = np.random.default_rng([seed, 3000 + SPLITS.index(split), number, c]).permutation(len(scene.objects))
        phrased = replace(scene, phrasing=(scene.phrasing + c) % variant.phrasings)
        out.append(variant.caption(vocab, phrased, [int(i) for i in order]))
    return out


def _write_shard(job: ShardJob, out_dir: str) -> tuple[str, int, list[str], list[int]]:
    vocab, seed = _WORKER["vocab"], _WORKER["seed"]
    variant = variant_functions(_WORKER["variant"])
    pools = _WORKER["pools"]["train" if job.split == "train" else "heldout"]
    sizes = [len(p) for p in pools]
    name = f"{job.split}-{job.shard:06d}.tar"
    writer = TarWriter(Path(out_dir) / job.split / name)
    captions, labels = [], []
    for k in range(job.count):
        scene, caption = variant.scene_and_caption(seed, job.split, job.first + k, vocab, sizes)
        buf = io.BytesIO()
        Image.fromarray(variant.render(scene, pools)).save(buf, format="PNG", compress_level=variant.png_level)
        group = job.first_index + k * job.captions
        phrasings = [caption] + more_captions(variant, vocab, scene, seed, job.split, job.first + k, job.captions)
        for c, caption in enumerate(phrasings):
            index = group + c
            meta = {
                "index": index,
                "key": sample_key(index),
                "caption": caption,
                "scene": {
                    "objects": [[vocab.nouns[o.cls], o.colour, o.size, o.position] for o in scene.objects],
                    "background": scene.background,
                    "texture": scene.texture,
                },
            }
            if job.captions > 1:
                meta["group"] = group
            files = {"png": buf.getvalue(), "txt": caption.encode()}
            # zero-shot on glyph classes: single-object scenes are labelled (once per image)
            labelled = len(scene.objects) == 1 and c == 0
            if labelled:
                meta["label"], meta["dataset"] = scene.objects[0].cls, "scenes"
                files["cls"] = str(scene.objects[0].cls).encode()
            files["json"] = json.dumps(meta).encode()
            writer.add(sample_key(index), files)
            captions.append(caption)
            labels.append(scene.objects[0].cls if labelled else -1)
    writer.close()
    return name, job.count * job.captions, captions, labels


def zeroshot_prompts() -> list[str]:
    """Prompt templates for the glyph classes: the caption's object phrase over every size and colour."""
    return [
        f"a {size} {colour} {{}} in the centre, on a plain black background." for size in SIZES for colour in COLOURS
    ]


def check_captions_per_scene(variant: str, k) -> int:
    """k, if a scene has k distinct captions (ValueError naming the flag otherwise)."""
    phrasings = variant_functions(variant).phrasings
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= phrasings:
        raise ValueError(
            f"--captions-per-scene {k!r}: must be 1..{phrasings}, the distinct phrasings a one-object scene has"
        )
    return k


def build_scenes(
    out: str | os.PathLike,
    *,
    num_train: int = 100_000,
    num_val: int = 2_000,
    num_test: int = 5_000,
    num_novel: int = 2_000,
    shard_size: int = 2_000,
    seed: int = 0,
    index_offset: int = 0,
    datasets: str | list[str] = "auto",
    workers: int | None = None,
    fashion_root: str | os.PathLike = FASHION_MNIST_ROOT,
    progress=None,
    variant: str = "classic",
    captions_per_scene: int = 1,
) -> dict:
    """Write OUT/{train,val,test,novel} (shards + manifests), OUT/zeroshot.json and OUT/scenes.json; `variant`:
    "classic" (this module) or "semantic" (scenes_semantic.py: captions that need the glyphs' identity).
    shard_size counts samples (a scene's captions_per_scene samples stay in one shard)."""
    prompts = variant_functions(variant).zeroshot_prompts
    source = SOURCE_NAMES[variant]
    k = check_captions_per_scene(variant, captions_per_scene)
    counts = {"train": num_train, "val": num_val, "test": num_test, "novel": num_novel}
    _check_sizes(counts, shard_size)
    names, note = choose_datasets(datasets, fashion_root)
    vocab, _ = glyph_pools(names, fashion_root, seed)  # fails here, in the parent, if a dataset is missing
    out = Path(out)
    with removed_on_failure(out, SPLITS):  # a full disk, Ctrl-C: no half data set left to be trained on
        jobs, data_size = _shard_jobs(out, counts, max(1, shard_size // k), index_offset, k)
        pool_args = (names, str(fashion_root), seed, variant)
        results = _write_shards(jobs, out, workers or min(len(jobs), os.cpu_count() or 1), pool_args, progress)
        summary = {
            "source": source,
            "datasets": names,
            "note": note,
            "seed": seed,
            "data_size": data_size,
            "classes": vocab.nouns,
            "held_out_pairs": sorted([vocab.nouns[k], c] for k, c in vocab.held_out),
            **({"captions_per_scene": k} if k > 1 else {}),  # (K = 1: the former file, byte for byte)
            "splits": {},
        }
        start = index_offset
        for split in SPLITS:
            split_jobs = [j for j in jobs if j.split == split]
            extra = {"created_by": f"fastclip data embedded --source {source}", "split": split, "datasets": names}
            extra.update({"seed": seed, **({"captions_per_scene": k} if k > 1 else {})})
            summary["splits"][split] = _finish_split(
                out / split, split_jobs, results, counts[split], k, data_size, extra, start
            )
            start += counts[split] * k
        zeroshot = {"datasets": {"scenes": {"classnames": vocab.nouns, "templates": prompts()}}}
        (out / ZEROSHOT_NAME).write_text(json.dumps(zeroshot, indent=1) + "\n")
        (out / "scenes.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _check_sizes(counts: dict[str, int], shard_size: int) -> None:
    for split, n in counts.items():
        if n < 0 or (split == "train" and n == 0):
            raise ValueError(f"number of {split} scenes must be {'>= 1' if split == 'train' else '>= 0'}, got {n}")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")


def _shard_jobs(out: Path, counts: dict[str, int], per_shard: int, index_offset: int, k: int):
    """(the shards to write, split by split, `per_shard` scenes each, data_size); makes the split folders. Global
    indices run on over the splits from index_offset, k per scene."""
    jobs, first_index = [], index_offset
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
        for shard, first in enumerate(range(0, counts[split], per_shard)):
            n = min(per_shard, counts[split] - first)
            jobs.append(ShardJob(split, shard, first, n, first_index + first * k, k))
        first_index += counts[split] * k
    return jobs, first_index


def _write_shards(jobs: list[ShardJob], out: Path, workers: int, pool_args: tuple, progress) -> dict[ShardJob, tuple]:
    """Every job's shard, written here (workers <= 1) or in a process pool; each job's result."""
    results: dict[ShardJob, tuple] = {}
    if workers <= 1:
        _init_worker(*pool_args)
        for job in jobs:
            results[job] = _write_shard(job, str(out))
            if progress:
                progress(job.count)
        return results
    with ProcessPoolExecutor(workers, initializer=_init_pool_worker, initargs=pool_args) as pool:
        try:
            futures = {job: pool.submit(_write_shard, job, str(out)) for job in jobs}
            for job, fut in futures.items():
                results[job] = fut.result()
                if progress:
                    progress(job.count)
        except BaseException:  # Ctrl-C, a failed shard: start no further shard (the workers would)
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return results


def _finish_split(folder: Path, split_jobs, results, scenes: int, k: int, data_size: int, extra: dict, start: int):
    """Writes the split's manifest; its entry of scenes.json (`start`: its first global index)."""
    shards = []
    for j in split_jobs:
        name, n = results[j][:2]  # n: samples (scenes x captions_per_scene)
        shards.append(ShardInfo(name, n, j.first_index, j.first_index + n - 1))
    write_manifest(folder, Manifest(data_size, shards, extra=extra, groups=k > 1))
    captions = [c for j in split_jobs for c in results[j][2]]
    labels = [lab for j in split_jobs for lab in results[j][3]]
    samples = scenes * k
    return {
        "num_samples": samples,
        **({"scenes": scenes} if k > 1 else {}),
        "shards": len(shards),
        "index_range": [start, start + samples - 1],
        "distinct_captions": len(set(captions)),
        "labelled_single_object": sum(lab >= 0 for lab in labels),
    }
