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
from fastclip.data.samples import without_buffer_repr
from fastclip.data.writer import ShardWriter, removed_on_failure

FIELD_LIMIT = 16 * 2**20  # characters: csv's 131,072 stopped on a long caption; an unclosed quote still ends


class CaptionFileError(ValueError):
    """The captions file cannot be used as asked (missing column, bad JSON line); names file, line and key."""


def read_rows(captions: Path, img_key: str, caption_key: str, separator: str | None):
    """Yield (line number, image path, caption, problem) for each data row: problem is why the row cannot be used
    (its path and caption then None), else ""."""
    limit = csv.field_size_limit()
    csv.field_size_limit(FIELD_LIMIT)  # a long caption is the tokenizer's to cut, not a reason to stop
    line = 0
    try:
        for line, *values in _rows(captions, img_key, caption_key, separator):
            yield line, *values
    except csv.Error as e:  # past FIELD_LIMIT: a quote opened after the last row read and never closed
        raise CaptionFileError(
            f"{captions}: after line {line}: a field longer than {FIELD_LIMIT:,} characters ({e}): a quote mark that "
            f'opens a field and is never closed? close it or double it ("")'
        ) from None
    except UnicodeDecodeError:  # a latin-1 export, or a parquet/binary file given as --captions
        where = _first_non_utf8(captions)
        raise CaptionFileError(
            f"{captions}: not UTF-8 text ({where}); pass a UTF-8 CSV/TSV/JSONL (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    finally:
        csv.field_size_limit(limit)


def _first_non_utf8(path: Path) -> str:
    """Where the file's first byte that is no UTF-8 is (the text reader decodes ahead in chunks: its error's
    position is not the file's)."""
    offset = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):  # b"\n" is never inside a multi-byte UTF-8 character
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"line {line_no}: byte 0x{raw[e.start]:02x} at offset {offset + e.start}"
            offset += len(raw)
    return "at its end: a multi-byte character cut short"


def _checked(rel, caption, img_key: str, caption_key: str):
    """(image path, caption, problem) of a JSONL row: text, or why the row cannot be used."""
    if rel is not None and not isinstance(rel, str):
        return None, None, f"{img_key!r} is {json.dumps(rel)}, not a path"
    if caption is not None and not isinstance(caption, str):
        return None, None, f"{caption_key!r} is {json.dumps(caption)}, not text"
    return rel, caption, ""


def _rows(captions: Path, img_key: str, caption_key: str, separator: str | None):
    if captions.suffix.lower() == ".jsonl":
        with open(captions, encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Excel, Notepad) is no key
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise CaptionFileError(f"{captions}:{line_no}: not valid JSON ({e})") from None
                if not isinstance(row, dict):
                    raise CaptionFileError(f"{captions}:{line_no}: expected a JSON object per line")
                yield line_no, *_checked(row.get(img_key), row.get(caption_key), img_key, caption_key)
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
    # quoted as pandas writes (OpenCLIP's CsvDataset reads with pandas): "" inside quotes, line breaks in them
    with open(captions, encoding="utf-8-sig", newline="") as f:  # -sig: Excel's "CSV UTF-8" starts with a BOM
        reader = csv.DictReader(f, delimiter=separator)
        columns = reader.fieldnames or []
        for key in (img_key, caption_key):
            if key not in columns:
                raise CaptionFileError(
                    f"{captions}: no column {key!r} (columns: {columns}; separator "
                    f"{separator!r}; set --csv-img-key/--csv-caption-key/--csv-separator)"
                )
        last = reader.line_num
        for row in reader:
            first, last = last + 1, reader.line_num
            yield last, *_row_values(row, columns, separator, first, last, img_key, caption_key)


def _row_values(row: dict, columns: list, separator: str, first: int, last: int, img_key: str, caption_key: str):
    """(image path, caption, problem) of one parsed row."""
    extra = [v for v in row.get(None, []) if v.strip()]  # a trailing separator adds empty fields: no problem
    if extra:  # more fields than the header: a caption's unquoted separator cut it short
        why = (
            f"{len(columns) + len(row[None])} fields, the header has {len(columns)}: quote the {caption_key!r} field "
            f"(it holds the separator {separator!r})"
        )
        return None, None, why
    # a field quoted over line breaks is legal; one that runs on past a line holding the separator swallowed the
    # rows after an unclosed quote (a caption that starts with ")
    swallowed = any(separator in line for v in row.values() if isinstance(v, str) for line in v.splitlines()[1:])
    if first != last and swallowed:
        why = (
            f"one field runs over lines {first}..{last} and past separators: a quote mark that opened it was not "
            f'closed, and the rows in it are lost; close the quote or double it ("")'
        )
        return None, None, why
    return row.get(img_key), row.get(caption_key), ""


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
        for row, (line_no, rel, caption, problem) in enumerate(read_rows(captions, img_key, caption_key, separator)):
            rows += 1
            where = f"{captions.name}:{line_no}"
            if problem:
                skipped.append(f"{where}: {problem}")
                continue
            caption = caption.strip() if caption else ""
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
                skipped.append(f"{where}: image {path} undecodable ({type(e).__name__}: {without_buffer_repr(str(e))})")
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
