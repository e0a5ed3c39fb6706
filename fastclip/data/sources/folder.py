"""`fastclip data folder`: a folder of images plus a CSV/TSV/JSONL of captions -> shards + manifest; or, without
captions (`--images DIR` alone), the folder's images alone, for self-supervised training (ssl.enabled).

OpenCLIP's CSV habits: `--csv-img-key filepath --csv-caption-key title --csv-separator "\\t"`; a .jsonl file
uses the same key names per line. The separator defaults by extension (.tsv: tab, .csv: comma). Image paths
are relative to --images (default: the captions file's folder).

The global index of a sample is its row number in the captions file (0-based, data rows only) plus
--index-offset, so it stays tied to the metadata even when rows are skipped (as img2dataset's keys do);
data_size = offset + number of rows. Rows whose image is missing or undecodable or whose caption is empty are
skipped and reported with their line number. png/jpg/jpeg/webp bytes are stored as they are; other formats are
re-encoded as PNG.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from PIL import Image

from fastclip.data.format import IMAGE_EXTS
from fastclip.data.writer import ShardWriter, removed_on_failure


class CaptionFileError(ValueError):
    """The captions file cannot be used as asked (missing column, bad JSON line); names file, line and key."""


def read_rows(captions: Path, img_key: str, caption_key: str, separator: str | None):
    """Yield (line number, image path string or None, caption or None) for each data row."""
    try:
        yield from _rows(captions, img_key, caption_key, separator)
    except UnicodeDecodeError as e:  # a latin-1 export, or a parquet/binary file given as --captions
        raise CaptionFileError(
            f"{captions}: not UTF-8 text (byte {e.start}); pass a UTF-8 CSV/TSV/JSONL (e.g. iconv -t utf-8)"
        ) from None


def _rows(captions: Path, img_key: str, caption_key: str, separator: str | None):
    if captions.suffix.lower() == ".jsonl":
        with open(captions, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise CaptionFileError(f"{captions}:{line_no}: not valid JSON ({e})") from None
                if not isinstance(row, dict):
                    raise CaptionFileError(f"{captions}:{line_no}: expected a JSON object per line")
                yield line_no, row.get(img_key), row.get(caption_key)
        return
    if separator is None:
        separator = "\t" if captions.suffix.lower() == ".tsv" else ","
    given = separator
    try:
        separator = separator.encode().decode("unicode_escape")  # a literal "\t" from the shell
    except UnicodeDecodeError:
        separator = None
    if separator is None or len(separator) != 1:
        raise CaptionFileError(f"--csv-separator {given!r}: must be one character (e.g. ',', ';' or '\\t')")
    with open(captions, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter=separator)
        columns = reader.fieldnames or []
        for key in (img_key, caption_key):
            if key not in columns:
                raise CaptionFileError(
                    f"{captions}: no column {key!r} (columns: {columns}; separator "
                    f"{separator!r}; set --csv-img-key/--csv-caption-key/--csv-separator)"
                )
        for row in reader:
            yield reader.line_num, row.get(img_key), row.get(caption_key)


def _image_bytes(path: Path) -> tuple[bytes, str]:
    """(bytes, ext); raises on a missing or undecodable file."""
    data = path.read_bytes()
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # full decode: catch truncated files now rather than in every epoch
        ext = (img.format or "").lower().replace("jpeg", "jpg")
        if ext in IMAGE_EXTS:
            return data, ext
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue(), "png"


def build_folder(
    captions: str | os.PathLike,
    out: str | os.PathLike,
    *,
    images: str | os.PathLike | None = None,
    img_key: str = "filepath",
    caption_key: str = "title",
    separator: str | None = None,
    shard_size: int = 2000,
    index_offset: int = 0,
    prefix: str = "train",
) -> dict:
    captions, out = Path(captions), Path(out)
    root = Path(images) if images is not None else captions.parent
    skipped, rows = [], 0
    with removed_on_failure(out):  # a bad line, a full disk, Ctrl-C: leave --out as it was, for the rerun
        writer = ShardWriter(out, prefix=prefix, shard_size=shard_size)
        for row, (line_no, rel, caption) in enumerate(read_rows(captions, img_key, caption_key, separator)):
            rows += 1
            where = f"{captions.name}:{line_no}"
            caption = caption.strip() if isinstance(caption, str) else ""
            if not rel:
                skipped.append(f"{where}: empty {img_key!r}")
                continue
            if not caption:
                skipped.append(f"{where}: empty {caption_key!r} for {rel}")
                continue
            path = root / rel
            try:
                data, ext = _image_bytes(path)
            except FileNotFoundError:
                skipped.append(f"{where}: image {path} not found")
                continue
            except Exception as e:  # PIL raises many kinds for bad files
                skipped.append(f"{where}: image {path} undecodable ({type(e).__name__}: {e})")
                continue
            writer.write(index_offset + row, data, ext, caption)
        if rows == 0:
            raise CaptionFileError(f"{captions}: no data rows")
        written = sum(s.num_samples for s in writer.shards)
        if written:  # no manifest of 0 samples: it would be no data set, yet refuse a rerun into --out
            writer.close(index_offset + rows, extra={"created_by": "fastclip data folder", "captions": str(captions)})
    return {
        "rows": rows,
        "written": written,
        "skipped": skipped,
        "data_size": index_offset + rows,
        "shards": len(writer.shards),
    }


def build_image_folder(
    images: str | os.PathLike, out: str | os.PathLike, *, shard_size: int = 2000, index_offset: int = 0,
    prefix: str = "train",
) -> dict:  # fmt: skip
    """Every image file under ``images`` (recursively, in sorted path order) as a sample without a caption: its
    index is --index-offset + its position in that order; undecodable files are skipped and reported."""
    root, out = Path(images), Path(out)
    paths = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in PICTURE_SUFFIXES)
    skipped = []
    with removed_on_failure(out):
        writer = ShardWriter(out, prefix=prefix, shard_size=shard_size)
        for row, path in enumerate(paths):
            try:
                data, ext = _image_bytes(path)
            except Exception as e:  # PIL raises many kinds for bad files
                skipped.append(f"{path.relative_to(root)}: undecodable ({type(e).__name__}: {e})")
                continue
            writer.write(index_offset + row, data, ext, None)
        written = sum(s.num_samples for s in writer.shards)
        if written:
            writer.close(index_offset + len(paths), extra={"created_by": "fastclip data folder", "images": str(root)})
    return {
        "rows": len(paths),
        "written": written,
        "skipped": skipped,
        "data_size": index_offset + len(paths),
        "shards": len(writer.shards),
    }


# the files an image folder's walk takes (others, such as a README or labels file, are not images)
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
