"""The shard format every component shares (this module is its definition).

A sample is a group of tar members with the same key (the member name up to the first dot of its basename,
as WebDataset groups them): `<key>.png|jpg|jpeg|webp`, `<key>.txt`, `<key>.json`, optionally `<key>.cls`.
Our writers use the global index zero-padded to 9 digits as the key.

json["group"] (optional, an integer >= 0): samples that share it are positives of each other, never negatives
(several captions of one image, identical captions). Without it a sample is its own group. Group ids share the
global index space: a writer gives a group the global index of its first sample, so ids stay unique across
sources joined with `::` (their index ranges are disjoint). A manifest says `"groups": true` when some samples
share a group; training passes groups to the loss only then (fastclip/data/manifest.py).
"""

from __future__ import annotations

import json
import posixpath

MANIFEST_NAME = "manifest.json"
# an embedded data set's class names and templates, beside its split folders (fastclip data embedded)
ZEROSHOT_NAME = "zeroshot.json"
MANIFEST_FORMAT = "fastclip-shards/1"
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")  # in the order a reader looks for them
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def sample_key(index: int) -> str:
    return f"{index:09d}"


def split_member_name(name: str) -> tuple[str, str]:
    """('dir/000000012', 'png') for 'dir/000000012.png'; the extension is everything after the first dot."""
    folder, base = posixpath.split(name)
    stem, dot, ext = base.partition(".")
    return posixpath.join(folder, stem) if folder else stem, ext.lower() if dot else ""


def sample_index(
    meta: dict | None, exts, ordinal: int, index_base: int | None = None, index_offset: int = 0
) -> int | None:
    """A sample's global index as its shard's manifest says to read it: index_from_meta, else (a plain WebDataset
    shard, whose samples have no .json member) index_base + the sample's position in the tar; the manifest's
    index_offset is added to an index >= 0 (a negative one stays out of range whatever the offset, as scan lists
    it). None: the sample has none. The training loader and the evaluation read indices alike through this."""
    index = index_from_meta(meta) if meta is not None else None
    if index is None and index_base is not None and "json" not in exts:
        index = index_base + ordinal
    if index is not None and index >= 0:
        index += index_offset
    return index


def index_from_meta(meta: dict) -> int | None:
    """The global index of a sample: json["index"], else int(json["key"]) (img2dataset); None if neither."""
    value = meta.get("index")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    key = meta.get("key")
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return None


def group_of(meta: dict | None, index: int | None) -> tuple[int | None, str | None]:
    """(group id, None), or (None, why not) for a json "group" that is not an integer >= 0. No "group": `index`."""
    if meta is None or "group" not in meta:
        return index, None
    group = meta["group"]
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        return None, f"json 'group' is {json.dumps(group)[:40]}, not an integer >= 0"
    return group, None


def parse_meta(data: bytes | None) -> tuple[dict | None, str | None]:
    """(json dict, None) or (None, why not) for a sample's .json member."""
    if data is None:
        return None, "no .json member"
    try:
        meta = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return None, f"invalid .json ({e})"
    if not isinstance(meta, dict):
        return None, f".json is a {type(meta).__name__}, not an object"
    return meta, None


def caption_of(files: dict[str, bytes], meta: dict | None) -> str | None:
    """The caption: the .txt member, else json["caption"]; None when absent, empty or not utf-8."""
    text = files.get("txt")
    if text is not None:
        try:
            caption = text.decode("utf-8").strip()
        except UnicodeDecodeError:
            caption = ""
        if caption:
            return caption
    if meta is not None and isinstance(meta.get("caption"), str) and meta["caption"].strip():
        return meta["caption"].strip()
    return None


def image_of(files: dict[str, bytes]) -> tuple[bytes, str] | None:
    for ext in IMAGE_EXTS:
        if ext in files:
            return files[ext], ext
    return None


def label_of(files: dict[str, bytes], meta: dict | None) -> int | None:
    """The class label: json["label"], else the .cls member; None when neither. Raises ValueError when the one
    present is not an integer."""
    label = meta.get("label") if meta else None
    if label is None and "cls" in files:
        label = files["cls"].decode("utf-8", "replace").strip()
    if label is None:
        return None
    try:
        return int(label)
    except (TypeError, ValueError):
        raise ValueError(f"label {label!r} is not an integer") from None
