"""`fastclip data embedded --source scenes-semantic`: scenes whose captions can only be matched by glyph identity.

The classic scenes (scenes.py) give every object its own colour, size and one of 9 cells, and name the
background and texture: a matcher blind to glyph classes finds the right caption from those alone (96.9 % test
R@1), so models learn colours and positions and stay at chance on the glyph classes. Here:
  - every object of a scene shares one colour and one size; 1-3 objects in distinct cells of a 2x2 grid, glyphs
    22 or 30 pixels wide (legible to a 16-pixel-patch ViT), on a background of one colour and texture;
  - the caption names the size and colour once and each object by its class and cell, in a random order, e.g.
        "in large red: a sandal top left, a digit seven bottom right and a bag top right."
    Background and texture are drawn but never named (nuisance), so captions carry 224 class-blind
    descriptions (2 sizes x 8 colours x 14 cell layouts) and the rest is the glyph classes;
  - held-out splits (val, test, novel) come in minimal pairs: scenes 2g and 2g+1 of a split are the same
    picture (colour, size, cells, background, texture, glyph images) except that one glyph is replaced by a
    glyph of another class, so only that glyph's identity tells their captions apart;
  - `novel`: the scene's colour is held out of training for at least one of its glyph classes (train never
    shows such a (class, colour) pair), as in the classic scenes.
Captions fit a 32-token context (the longest is 29 tokens with open_clip's tokenizer, start and end included;
tests/test_data_scenes_semantic.py measures every caption the grammar can produce).

The shard layout, splits, labels (single-object scenes) and determinism are the classic scenes' (build_scenes
writes both variants); this module draws the scenes, words and reads the captions, and renders.
"""

from __future__ import annotations

import re

import numpy as np

from fastclip.data.sources.scenes import (
    BACKGROUNDS,
    COLOURS,
    SPLITS,
    TEXTURES,
    Scene,
    SceneObject,
    Vocabulary,
    background_canvas,
    draw_glyph,
)

CELLS = {"top left": (16, 16), "top right": (48, 16), "bottom left": (16, 48), "bottom right": (48, 48)}
SIDES = {"small": 22, "large": 30}  # glyph side in pixels; one per scene
OBJECT_COUNTS = (1, 2, 3)
OBJECT_COUNT_PROBS = (0.2, 0.4, 0.4)  # one-object scenes repeat captions most (20 x 4 x 16 x 3): fewer of them
PHRASINGS = ("{size} {colour} glyphs: {objects}.", "in {size} {colour}: {objects}.", "{objects}, all {size} {colour}.")
PAIRED_SPLITS = ("val", "test", "novel")  # minimal pairs; train is i.i.d. (the loader shuffles pairs apart)


def _held_out_classes(vocab: Vocabulary, colour: str) -> list[int]:
    return sorted(k for k, c in vocab.held_out if c == colour)


def _allowed(vocab: Vocabulary, split: str, colour: str, classes: list[int]) -> bool:
    """The split's rule on held-out (class, colour) pairs: none in train, at least one in novel."""
    held = [(k, colour) in vocab.held_out for k in classes]
    return not any(held) if split == "train" else any(held) if split == "novel" else True


def sample_scene(rng: np.random.Generator, vocab: Vocabulary, pool_sizes: list[int], split: str) -> Scene:
    """One scene drawn from `rng`: colour, size, cells, classes, glyph rows, background, texture, phrasing."""
    n_classes, colours = len(vocab.nouns), list(COLOURS)
    count = int(rng.choice(OBJECT_COUNTS, p=OBJECT_COUNT_PROBS))
    colour = colours[int(rng.integers(len(colours)))]
    size = list(SIDES)[int(rng.integers(len(SIDES)))]
    cells = [list(CELLS)[int(i)] for i in rng.permutation(len(CELLS))[:count]]
    classes = [int(rng.integers(n_classes)) for _ in range(count)]
    if split == "novel":  # the first object shows a held-out pair
        options = _held_out_classes(vocab, colour)
        classes[0] = options[int(rng.integers(len(options)))]
    for j in range(count):
        while split == "train" and (classes[j], colour) in vocab.held_out:
            classes[j] = int(rng.integers(n_classes))
    glyphs = tuple(int(rng.integers(pool_sizes[k])) for k in classes)
    background = list(BACKGROUNDS)[int(rng.integers(len(BACKGROUNDS)))]
    texture = TEXTURES[int(rng.integers(len(TEXTURES)))]
    objects = tuple(SceneObject(k, colour, size, cell) for k, cell in zip(classes, cells))
    return Scene(objects, background, texture, int(rng.integers(len(PHRASINGS))), glyphs)


def replace_one_glyph(
    rng: np.random.Generator, scene: Scene, vocab: Vocabulary, pool_sizes: list[int], split: str
) -> Scene:
    """`scene` with one object's class (and glyph image) replaced by another class's, within the split's rule."""
    j = int(rng.integers(len(scene.objects)))
    classes = [o.cls for o in scene.objects]
    colour = scene.objects[0].colour
    while True:
        new = int(rng.integers(len(vocab.nouns) - 1))
        new += new >= classes[j]  # uniform over the other classes
        trial = classes[:j] + [new] + classes[j + 1 :]
        if _allowed(vocab, split, colour, trial):
            break
    objects = list(scene.objects)
    objects[j] = SceneObject(new, colour, objects[j].size, objects[j].position)
    glyphs = list(scene.glyphs)
    glyphs[j] = int(rng.integers(pool_sizes[new]))
    return Scene(tuple(objects), scene.background, scene.texture, scene.phrasing, tuple(glyphs))


def caption(vocab: Vocabulary, scene: Scene, order: list[int]) -> str:
    mentions = [f"a {vocab.nouns[o.cls]} {o.position}" for o in (scene.objects[i] for i in order)]
    objects = mentions[0] if len(mentions) == 1 else ", ".join(mentions[:-1]) + " and " + mentions[-1]
    first = scene.objects[0]
    return PHRASINGS[scene.phrasing].format(size=first.size, colour=first.colour, objects=objects)


def scene_and_caption(seed: int, split: str, number: int, vocab: Vocabulary, pool_sizes: list[int]):
    """(Scene, caption) of scene `number` of `split`: a function of (seed, split, number) alone. In a paired split
    the odd scene is its even partner with one glyph replaced; each words its caption in its own object order."""
    split_id = SPLITS.index(split)
    pair = split in PAIRED_SPLITS
    rng = np.random.default_rng([seed, 1000 + split_id, number // 2 if pair else number])
    scene = sample_scene(rng, vocab, pool_sizes, split)
    if pair and number % 2 == 1:
        scene = replace_one_glyph(rng, scene, vocab, pool_sizes, split)
    order = np.random.default_rng([seed, 2000 + split_id, number]).permutation(len(scene.objects))
    return scene, caption(vocab, scene, [int(i) for i in order])


def render(scene: Scene, pools: list[np.ndarray]) -> np.ndarray:
    """The scene as a uint8 [64, 64, 3] image; pools[k] holds class k's glyphs (n, 28, 28)."""
    canvas = background_canvas(scene.background, scene.texture)
    for obj, row in zip(scene.objects, scene.glyphs):
        draw_glyph(canvas, pools[obj.cls][row], SIDES[obj.size], CELLS[obj.position], COLOURS[obj.colour])
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)


def zeroshot_prompts() -> list[str]:
    """Prompt templates for the glyph classes: a one-object caption over every colour and cell."""
    return [
        PHRASINGS[0].format(size=size, colour=colour, objects=f"a {{}} {cell}")
        for size in SIDES
        for colour in COLOURS
        for cell in CELLS
    ]


class CaptionReader:
    """Reads a caption back into (size, colour, {(class, cell)}); no glyph noun contains a size or colour word."""

    def __init__(self, vocab: Vocabulary):
        alt = lambda words: "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))  # noqa: E731
        self.vocab = vocab
        self._object_re = re.compile(rf"a ({alt(vocab.nouns)}) ({alt(CELLS)})(?=,| and |\.$)")
        self._size_colour_re = re.compile(rf"\b({alt(SIDES)}) ({alt(COLOURS)})\b")

    def parse(self, text: str) -> tuple[str, str, frozenset[tuple[int, str]]]:
        attributes = self._size_colour_re.findall(text)
        found = self._object_re.findall(text)
        if len(attributes) != 1 or not found:
            raise ValueError(f"cannot read caption {text!r}")
        size, colour = attributes[0]
        return size, colour, frozenset((self.vocab.nouns.index(noun), cell) for noun, cell in found)
