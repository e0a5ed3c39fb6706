"""Checking raw samples and keeping count of the ones skipped.

A sample is skipped, logged with shard and key, and counted under one reason:
  unreadable_shard   the shard file cannot be opened as a tar (samples its manifest promised are lost)
  truncated_tar      the tar ends early or breaks (samples after the break are lost)
  missing_index      no json["index"] and no integer json["key"] (or no/invalid .json)
  index_out_of_range index < 0 or >= data_size
  index_outside_shard an index outside its shard's index_min..index_max in the manifest: the shard is not the one
                     scanned (a copy or a rename since; img2dataset shards counted from _stats.json take their
                     range from the key scheme, unread), so its indices would collide with another shard's
  bad_group          json["group"] present but not an integer >= 0 (format.py)
  duplicate_index    listed as such by `fastclip data scan` (authoritative: it sees the whole data set), or at
                     run time an index this worker already read this epoch from another (shard, key); the
                     run-time check sees one worker's share only, and after a mid-epoch resume it no longer
                     knows the samples read before the resume point
  duplicate_key      listed by `fastclip data scan` only: samples of one shard under one key next to each other,
                     which a reader merges into one (the same key further apart is two samples, both served)
  missing_caption    no non-empty utf-8 .txt and no json["caption"]
  missing_image      no .png/.jpg/.jpeg/.webp member
  undecodable_image  PIL cannot decode the image (found when the batch is made)
and a manifest `problems` entry's own reason when scan listed the sample.
"""

from __future__ import annotations

import io
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from fastclip.data.format import caption_of, group_of, image_of, parse_meta, sample_index
from fastclip.data.tario import RawSample

MANIFEST_MISMATCH = "manifest_mismatch"  # a tar holding more or fewer samples than its manifest entry (rewritten)
REASONS = (
    "unreadable_shard",
    "truncated_tar",
    MANIFEST_MISMATCH,
    "missing_index",
    "index_out_of_range",
    "index_outside_shard",
    "bad_group",
    "duplicate_index",
    "duplicate_key",
    "missing_caption",
    "missing_image",
    "undecodable_image",
)
# one problem of a shard, many samples lost (one event per shard and epoch)
SHARD_REASONS = frozenset({"unreadable_shard", "truncated_tar", MANIFEST_MISMATCH})


class DataExhausted(RuntimeError):
    """A rank found no usable sample in its whole share of an epoch; the message names the rank and shards."""


@dataclass
class Candidate:
    """A sample that passed the cheap checks; its image is decoded only when it goes into a batch."""

    index: int
    caption: str | None  # None only where captions are not needed
    image: bytes
    shard: str  # shard name, for messages
    key: str
    wrapped: bool
    meta: dict
    group: int = -1  # json["group"], else the index (format.py)
    offset: int = -1  # position in its worker's shuffle window (which samples of a window were served)


def check_sample(
    raw: RawSample,
    data_size: int,
    index_base: int | None = None,
    need_caption: bool = True,
    index_offset: int = 0,
    index_span: tuple[int, int] | None = None,
) -> tuple[Candidate | None, str, str]:
    """(candidate, "", "") or (None, reason, detail). index_base: the shard's (plain WebDataset, from the
    manifest): a sample without a .json member gets index index_base + its position in the tar. index_offset:
    the manifest's (scan --index-offset), added to the index either way. need_caption False (image-only
    training, fastclip/train/ssl.py): a sample without a caption is kept (caption None). index_span: the shard's
    index_min, index_max in the manifest (offset included), None where it lists none."""
    meta, why = parse_meta(raw.files.get("json"))
    index = sample_index(meta, raw.exts, raw.ordinal, index_base, index_offset)
    if index is None:
        return None, "missing_index", why or "json has no integer 'index' and no integer 'key'"
    if not 0 <= index < data_size:
        return None, "index_out_of_range", f"index {index} not in [0, {data_size})"
    if index_span is not None and not index_span[0] <= index <= index_span[1]:
        lo, hi = index_span
        detail = (
            f"index {index} outside the shard's {lo}..{hi} in the manifest (copied or renamed since the scan?): "
            f"run `fastclip data scan` on the folder again (--from-tars for img2dataset shards)"
        )
        return None, "index_outside_shard", detail
    group, why = group_of(meta, index)
    if group is None:
        return None, "bad_group", f"index {index}: {why}"
    if meta is not None and "group" in meta:  # a json group is in its data set's own index space, as the index is
        group += index_offset
    caption = caption_of(raw.files, meta)
    if caption is None and need_caption:
        return None, "missing_caption", "no non-empty .txt and no json 'caption'"
    image = image_of(raw.files)
    if image is None:
        return None, "missing_image", f"members present: {', '.join(raw.exts) or 'none'}"
    return Candidate(index, caption, image[0], "", raw.key, False, meta, group), "", ""


_BUFFER_REPR = re.compile(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


_EXIF_ORIENTATION = 0x0112
_WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # 16-bit grey PNG/TIFF: convert() clips them to white


def decode_image(data: bytes) -> Image.Image:
    """Fully decoded RGB image as a viewer shows it; raises on a truncated or corrupt file (PIL decodes lazily, so
    load() here). A camera's EXIF orientation is applied (phone photos would train sideways) and 16-bit grey is
    scaled to 8 bits. PIL names an unknown format by the buffer's repr, a memory address that differs from run to
    run in the skip records: it is said as "the image bytes" instead, in an error of the same type."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            turned = img.getexif().get(_EXIF_ORIENTATION, 1) != 1
            image = ImageOps.exif_transpose(img) if turned else img
            if image.mode in _WIDE_MODES:
                wide = np.asarray(image, dtype=np.float64)  # mode I holds 16-bit PNGs as int32, or 8-bit values
                if image.mode.startswith("I;16") or wide.max(initial=0) > 255:
                    wide = wide / 257.0  # 0..65535 -> 0..255
                image = Image.fromarray(np.clip(np.rint(wide), 0, 255).astype(np.uint8))
            return image.convert("RGB")
    except Exception as e:
        if not _BUFFER_REPR.search(str(e)):
            raise
        said = without_buffer_repr(str(e))
        try:
            clean = type(e)(said)
        except Exception:  # a type that wants other arguments
            clean = ValueError(f"{type(e).__name__}: {said}")
        raise clean from None


def without_buffer_repr(text: str) -> str:
    """PIL's error text with its buffer's repr (a memory address) said as "the image bytes"."""
    return _BUFFER_REPR.sub("the image bytes", text)


class SkipLog:
    """Counts skips by reason and keeps the first few events for the log (counts stay exact)."""

    def __init__(self, max_events: int = 32):
        self.max_events = max_events
        self.counts: Counter = Counter()
        self.events: list[dict] = []

    def add(self, reason: str, shard: str, key: str | None, detail: str = "", n: int = 1, event: bool = True) -> None:
        self.counts[reason] += n
        if event and len(self.events) < self.max_events:
            self.events.append({"shard": shard, "key": key, "reason": reason, "detail": detail, "samples": n})

    def take(self) -> tuple[dict, list[dict]]:
        counts, events = dict(self.counts), self.events
        self.counts, self.events = Counter(), []
        return counts, events
