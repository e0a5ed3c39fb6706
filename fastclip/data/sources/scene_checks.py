"""How much of a scenes split can be matched without the glyphs, and how much of its text the model reads.

class_blind_oracle_r1: an oracle that knows every attribute a caption names except the glyph classes (colour,
size, cell, background, texture, the number of objects) and matches each image to the captions whose class-blind
part equals its own. Its R@1 under random tie-breaking is the mean of 1 / (number of captions sharing the
class-blind part), the same in both directions (equal parts are an equivalence relation). Captions are read
back with each variant's parser, so the oracle sees exactly what the caption says.

context_cut_share: the share of captions longer than the text context, with the model's own tokenizer (start
and end tokens included): those captions are cut, and what they say past the cut is never read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from fastclip.data.sources.scenes import Vocabulary


def class_blind_key(variant: str, vocab: Vocabulary) -> Callable[[str], tuple]:
    """A caption -> its class-blind part, for scenes `variant` ("classic" or "semantic")."""
    if variant == "classic":

        def key(caption: str) -> tuple:
            objects, background, texture = vocab.parse_caption(caption)
            return tuple(sorted((o.colour, o.size, o.position) for o in objects)), background, texture

        return key
    if variant == "semantic":
        from fastclip.data.sources.scenes_semantic import CaptionReader

        reader = CaptionReader(vocab)

        def key(caption: str) -> tuple:
            size, colour, objects = reader.parse(caption)
            return size, colour, tuple(sorted(cell for _, cell in objects))

        return key
    raise ValueError(f"unknown scenes variant {variant!r}: classic or semantic")


def class_blind_oracle_r1(keys: Sequence) -> float:
    """Expected R@1 of matching by `keys` (one per image-caption pair) with ties broken at random."""
    if not keys:
        return float("nan")
    sizes = Counter(keys)
    return sum(1.0 / sizes[k] for k in keys) / len(keys)


def token_lengths(captions: Sequence[str], tokenizer) -> list[int]:
    """Tokens each caption needs (start and end included), measured by tokenizing with room to spare."""
    room = 512
    tokens = tokenizer(list(captions), context_length=room)
    lengths = (tokens != 0).sum(dim=1).tolist()
    if any(n >= room for n in lengths):
        raise ValueError(f"a caption needs {room} tokens or more; not a scenes caption")
    return lengths


def context_cut_share(captions: Sequence[str], tokenizer, context_length: int) -> float:
    lengths = token_lengths(captions, tokenizer)
    return sum(n > context_length for n in lengths) / len(lengths) if lengths else float("nan")
