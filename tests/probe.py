"""Fixtures of the evaluation tests: labelled shards, and a "probe" CLIP whose embeddings are set by the inputs,
so a test knows every similarity (and so every answer) exactly."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fastclip.data.writer import ShardWriter


def write_labelled_shards(out_dir, samples, *, shard_size: int = 16, prefix: str = "val", first_index: int = 0) -> Path:
    """Write `samples` = [(PIL image, caption, dataset, label), ...] as shards plus manifest.json."""
    writer = ShardWriter(out_dir, prefix=prefix, shard_size=shard_size)
    for index, (image, caption, dataset, label) in enumerate(samples, start=first_index):
        png = io.BytesIO()
        image.save(png, format="PNG")
        writer.write(index, png.getvalue(), "png", caption, label=label, dataset=dataset)
    writer.close(first_index + len(samples))
    return Path(out_dir)


# ----------------------------------------------------------------------------- the probe CLIP
def probe_image(scores, size: int = 16) -> Image.Image:
    """An RGB image whose first row's red channel holds `scores` (0..255): the probe's image embedding."""
    pixels = np.zeros((size, size, 3), dtype=np.uint8)
    pixels[0, : len(scores), 0] = scores
    return Image.fromarray(pixels)


def probe_preprocess(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)


class ProbeCLIP(torch.nn.Module):
    """A CLIP-shaped model with known embeddings.

    Image: the red channel of the first `dim` pixels of row 0 (see `probe_image`). Text: the sum of per-token
    vectors; `word_vectors` maps a word to its vector, every other token (template words, start/end) is 0.
    So the prompt "a photo of a {word}." embeds to exactly `word_vectors[word]`.
    """

    def __init__(self, tokenizer, word_vectors: dict[str, torch.Tensor], vocab_size: int = 49408):
        super().__init__()
        self.dim = len(next(iter(word_vectors.values())))
        self.token_vectors = torch.nn.Embedding(vocab_size, self.dim)
        torch.nn.init.zeros_(self.token_vectors.weight)
        encode = getattr(tokenizer, "encode", None) or tokenizer.tokenizer.encode
        with torch.no_grad():
            for word, vector in word_vectors.items():
                ids = encode(word)
                if len(ids) != 1:
                    raise ValueError(f"probe word {word!r} is {len(ids)} tokens; pick a one-token word")
                self.token_vectors.weight[ids[0]] = torch.as_tensor(vector, dtype=torch.float32)

    def encode_image(self, images: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        return images[:, 0, 0, : self.dim]

    def encode_text(self, tokens: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        return self.token_vectors(tokens).sum(dim=1)


# ----------------------------------------------------------------------------- a data set with known answers
FRUITS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum")
COLOURS = ("red", "green", "blue")
FRUIT_TEMPLATES = ("a photo of a {}.", "a blurry picture of {c}.")
RANK_SCORES = (240, 210, 180, 150, 120, 90, 60, 30)  # distinct, so no two classes tie
# true class -> the rank its score gets in each of its images
FRUIT_RANKS = {
    0: [1, 1, 1],
    1: [1, 1, 2],
    2: [1, 2, 6],
    3: [3, 1, 1],
    4: [6, 7, 8],
    5: [1, 1, 1],
    6: [5, 1, 2],
    7: [1, 1, 1],
}
COLOUR_RANKS = {0: [1, 1], 1: [1, 2], 2: [2, 3]}


def image_with_rank(true_class: int, rank: int, num_classes: int) -> Image.Image:
    """A probe image over `num_classes` classes in which `true_class` comes `rank`-th (1-based)."""
    values = RANK_SCORES[:num_classes]
    scores = [0] * num_classes
    scores[true_class] = values[rank - 1]
    rest = [v for i, v in enumerate(values) if i != rank - 1]
    for cls, value in zip([c for c in range(num_classes) if c != true_class], rest):
        scores[cls] = value
    return probe_image(scores)


def fruit_samples() -> list:
    """24 (image, caption, dataset, label) samples, three per fruit, in FRUIT_RANKS order."""
    return [
        (image_with_rank(c, r, 8), f"a photo of a {FRUITS[c]}.", "fruits", c)
        for c, ranks in FRUIT_RANKS.items()
        for r in ranks
    ]


def colour_samples() -> list:
    return [
        (image_with_rank(c, r, 3), f"something {COLOURS[c]}", "colours", c)
        for c, ranks in COLOUR_RANKS.items()
        for r in ranks
    ]


def fruit_probe(tokenizer) -> ProbeCLIP:
    """The probe for both data sets: fruit i and colour i both embed to the one-hot e_i."""
    vectors = {w: torch.eye(8)[i] for i, w in enumerate(FRUITS)}
    vectors.update({w: torch.eye(8)[i] for i, w in enumerate(COLOURS)})
    return ProbeCLIP(tokenizer, vectors)


def zeroshot_json() -> dict:
    return {
        "datasets": {
            "fruits": {"classnames": list(FRUITS), "templates": list(FRUIT_TEMPLATES)},
            "colours": {"classnames": list(COLOURS), "templates": ["{}"]},
        }
    }


# ----------------------------------------------------------------------------- several captions per image
# CAPTION_SCORES[image, caption]: images A, B, C; captions 0-1 are A's, 2-3 B's, 4-5 C's (CAPTION_OWNER)
CAPTION_SCORES = torch.tensor(
    [
        [0.9, 0.1, 0.8, 0.0, 0.2, 0.3],
        [0.5, 0.2, 0.3, 0.4, 0.1, 0.45],
        [0.3, 0.95, 0.2, 0.1, 0.85, 0.5],
    ]
)
CAPTION_OWNER = [0, 0, 1, 1, 2, 2]
CAPTION_WORDS = ("apple", "banana", "cherry", "grape", "lemon", "mango")  # one token each: caption j's embedding
SHARD_ORDER = [0, 2, 4, 1, 3, 5]  # data index -> caption: the first captions of A, B, C, then their second


def caption_probe(tokenizer) -> ProbeCLIP:
    """Image g embeds to e_g; caption j to column j of CAPTION_SCORES / 2 completed to unit length by a 4th
    component, so the normalised similarities are CAPTION_SCORES / 2 exactly (the same ranks)."""
    half = CAPTION_SCORES / 2
    pad = (1 - (half**2).sum(dim=0)).sqrt()
    model = ProbeCLIP(tokenizer, dict(zip(CAPTION_WORDS, torch.cat([half, pad[None]]).T)))
    model.text_projection = torch.zeros(4, 4)  # (tells evaluate the embedding width: no class names here)
    return model


def write_caption_shards(out_dir, groups: bool = True) -> Path:
    """The 6 captions as samples (SHARD_ORDER), each with its image; groups: json "group" = the image's number."""
    writer = ShardWriter(out_dir, shard_size=4)
    for index, j in enumerate(SHARD_ORDER):
        g = CAPTION_OWNER[j]
        png = io.BytesIO()
        probe_image([255 if i == g else 0 for i in range(4)]).save(png, format="PNG")
        writer.write(index, png.getvalue(), "png", f"a photo of a {CAPTION_WORDS[j]}.", group=g if groups else None)
    writer.close(len(SHARD_ORDER))
    return Path(out_dir)
