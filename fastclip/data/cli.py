"""`fastclip data ...`: write shards with global indices, scan existing shards, inspect a data spec.

  fastclip data embedded --out data/embedded [--datasets auto|fashion-mnist,mnist|mnist,animal-mnist]
                         [--max-per-class N] [--max-val-per-class N] [--val-fraction 0.2] [--shard-size 2000]
                         [--seed 0] [--index-offset 0]
  fastclip data embedded --source scenes|scenes-semantic --out data/scenes [--num-train 100000] [--num-val 2000]
                         [--num-test 5000] [--num-novel 2000] [--workers N] [--seed 0] [--shard-size 2000]
                         [--captions-per-scene 1]
  fastclip data folder --captions caps.csv --out DIR [--images ROOT] [--csv-img-key filepath]
                       [--csv-caption-key title] [--csv-separator ","] [--shard-size 2000] [--index-offset 0]
  fastclip data scan DIR|DIR/manifest.json|PATTERN [--data-size N] [--strict] [--workers N] [--from-tars]
                     [--samples-per-shard N] [--index-offset N] [--manifest FILE.json]
  fastclip data info "DIR::/other/train-{000..009}.tar" [--batch-size 64 --world-size 8]

Exit status: 0 on success, 1 when `scan --strict` finds problems, 2 on a usage or data-spec error; `embedded` and
`folder` stopped by SIGTERM or SIGHUP (a job's time limit, a closed terminal) remove what they wrote, as on Ctrl-C,
and exit 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fastclip.cli import OneLineParser, plural, whole_number
from fastclip.data.catalog import DataSpecError, global_batch_too_large
from fastclip.data.format import MANIFEST_NAME, ZEROSHOT_NAME
from fastclip.stopping import Stopped, stopped_by_signals


def _count(text: str) -> int:
    """argparse type of a count that must be >= 1: 0 divides by zero, a negative one misreports."""
    return whole_number(text, 1)


def _nonneg(text: str) -> int:
    """argparse type of an index, seed or count that may be 0: a negative one fails deep inside, unnamed."""
    return whole_number(text, 0)


def _fraction(text: str) -> float:
    """argparse type of a share strictly between 0 and 1 (NaN fails the comparison too)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be between 0 and 1 (exclusive)")
    return value


def out_folder_problem(flag: str, out: str | Path) -> str | None:
    """Why `out` cannot be the folder written to (it or a parent is a file), said before anything is built."""
    for path in (Path(out), *Path(out).parents):
        if path.exists():
            if path.is_dir():
                return None
            where = "is a file" if path == Path(out) else f"is under {path}, a file"
            return f"{flag} {out}: {where}; pass a folder (it is created if missing)"
    return None


def _data_set_in(out: Path) -> Path | None:
    """The first file of a `fastclip data embedded` (either source) or of any shards under `out`, or None."""
    if not out.is_dir():
        return None
    marks = [out / ZEROSHOT_NAME, out / "embedded.json", out / "scenes.json"]
    marks += sorted(p / MANIFEST_NAME for p in out.iterdir() if p.is_dir())
    # and shards without a manifest (a build stopped before the end, or someone's own): writing would replace them
    marks += sorted(out.glob("*.tar")) + sorted(out.glob("*/*.tar"))
    return next((p for p in marks if p.is_file()), None)


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="fastclip data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    _embedded_arguments(sub)
    _folder_arguments(sub)
    _scan_arguments(sub)
    _info_arguments(sub)
    return p


def _embedded_arguments(sub) -> None:
    """`fastclip data embedded`: glyphs (one image a sample) or scenes, and their splits."""
    p = sub.add_parser("embedded", help="shards from the offline datasets (Fashion-MNIST + MNIST-5k by default)")
    p.add_argument(
        "--out",
        required=True,
        help=f"writes OUT/train, OUT/val, OUT/{ZEROSHOT_NAME}, OUT/embedded.json "
        "(scenes: also OUT/test, OUT/novel and OUT/scenes.json)",
    )
    p.add_argument(
        "--source",
        choices=("glyphs", "scenes", "scenes-semantic"),
        default="glyphs",
        help="glyphs: one 28x28 image per sample, templated class captions (default); scenes: 64x64 "
        "compositional scenes of 1-3 coloured glyphs with distinct captions; scenes-semantic: scenes whose "
        "captions only the glyphs' classes tell apart (shared colour, minimal pairs in val/test/novel)",
    )
    # (the defaults of one source's own flags are set after parsing: given with the other source they are refused)
    p.add_argument("--num-train", type=_count, help="scenes: training pairs (default 100,000)")
    p.add_argument("--num-val", type=_nonneg, help="scenes: i.i.d. held-out pairs for tuning (default 2,000)")
    p.add_argument("--num-test", type=_nonneg, help="scenes: i.i.d. held-out pairs for reporting (default 5,000)")
    p.add_argument(
        "--num-novel",
        type=_nonneg,
        help="scenes: held-out pairs with (class, colour) combinations never seen in training (default 2,000)",
    )
    p.add_argument("--workers", type=_count, default=None, help="scenes: generating processes (default: all cores)")
    p.add_argument(
        "--captions-per-scene",
        type=_count,
        help="scenes: samples per scene (at most 3), its image with distinct phrasings of its caption, sharing a "
        "json 'group' (positives of each other in training, one image in retrieval)",
    )
    p.add_argument(
        "--datasets",
        default="auto",
        help="auto (Fashion-MNIST + MNIST-5k, or MNIST-5k + Animal-MNIST without the Debian files), "
        "or a comma list of fashion-mnist, mnist, animal-mnist",
    )
    p.add_argument("--max-per-class", type=int, help="glyphs: cap on training samples per class and dataset")
    p.add_argument(
        "--max-val-per-class",
        type=int,
        default=None,
        help="glyphs: cap on held-out samples per class (default with --max-per-class: its val_fraction share)",
    )
    p.add_argument(
        "--val-fraction", type=_fraction, help="glyphs: held out per class where no official split (default 0.2)"
    )
    p.add_argument("--shard-size", type=_count, default=2000)
    p.add_argument("--seed", type=_nonneg, default=0)
    p.add_argument("--index-offset", type=_nonneg, default=0, help="first global index (to join with other sources)")
    p.add_argument("--fashion-mnist-root", default=None, help="folder of the Fashion-MNIST .gz files")


def _folder_arguments(sub) -> None:
    """`fastclip data folder`: images and their captions file."""
    p = sub.add_parser("folder", help="shards from a folder of images and a CSV/TSV/JSONL of captions")
    p.add_argument(
        "--captions",
        default=None,
        help="CSV/TSV/JSONL file with image paths and captions (omitted: every image under --images, no captions, "
        "for ssl training)",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--images", default=None, help="root of the image paths (default: the captions file's folder)")
    p.add_argument("--csv-img-key", default="filepath")
    p.add_argument("--csv-caption-key", default="title")
    p.add_argument("--csv-separator", default=None, help="default: tab for .tsv, comma otherwise")
    p.add_argument("--shard-size", type=_count, default=2000)
    p.add_argument("--index-offset", type=_nonneg, default=0)
    p.add_argument("--prefix", default="train", help="shard name prefix")


def _scan_arguments(sub) -> None:
    """`fastclip data scan`: existing shards, their manifest."""
    p = sub.add_parser("scan", help=f"write {MANIFEST_NAME} for existing shards and check their indices")
    p.add_argument(
        "shards", help=f"local shard folder (or its {MANIFEST_NAME}) or pattern of .tar files (brace expansion, glob)"
    )
    p.add_argument("--data-size", type=int, default=None, help="default: 1 + the largest index found")
    p.add_argument("--strict", action="store_true", help="exit 1 and write nothing if any problem is found")
    p.add_argument(
        "--images-only",
        action="store_true",
        help="shards of images without captions (self-supervised training, ssl.enabled): a missing caption is fine",
    )
    p.add_argument("--workers", type=_count, default=None, help="processes reading shards (default: all cores)")
    p.add_argument(
        "--from-tars",
        action="store_true",
        help="read every tar even where img2dataset's {shard}.parquet or {shard}_stats.json is present",
    )
    p.add_argument(
        "--samples-per-shard",
        type=_count,
        default=None,
        help="img2dataset's --number_sample_per_shard (default 10000): the key range of a shard counted "
        "from its _stats.json",
    )
    p.add_argument(
        "--index-offset",
        type=_nonneg,
        default=None,
        help="added to every index (recorded in the manifest, no tar rewritten), to join this set with others by "
        "'::' (default: the old manifest's, else 0)",
    )
    p.add_argument(
        "--manifest",
        default=None,
        help=f"write the manifest to this .json file instead of {MANIFEST_NAME} beside the shards (a read-only data "
        "set); it names shards outside its folder by absolute path; train with --data.train FILE.json",
    )


def _info_arguments(sub) -> None:
    """`fastclip data info`: a training data spec."""
    p = sub.add_parser("info", help="resolve a training data spec and print what an epoch would be")
    p.add_argument("train_data", help="as data.train: folders/manifests/patterns joined with '::'")
    p.add_argument("--batch-size", type=_count, default=None)
    p.add_argument("--world-size", type=_count, default=1)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with stopped_by_signals(args.command in ("embedded", "folder")):
            return _run(args)
    except Stopped as e:  # what was written is removed on the way here
        name, out = e.name, Path(args.out)
        if (out / MANIFEST_NAME).is_file() or _data_set_in(out):  # it came once the data set was written
            said = f"stopped by {name} after the data set in {out} was written"
        else:
            said = f"stopped by {name}; what it wrote in {out} is removed"
        print(f"fastclip data {args.command}: {said}", file=sys.stderr)
        return 128 + e.signum
    except BrokenPipeError:  # the reader of stdout is gone: fastclip's dispatcher ends it quietly
        raise
    except (DataSpecError, OSError, ValueError) as e:  # OSError: --out is a file, a folder that cannot be written
        print(f"fastclip data {args.command}: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    return {"embedded": _embedded, "folder": _folder, "scan": _scan, "info": _info}[args.command](args)


# each source's own flags and their defaults: given with the other source they changed nothing, without a word
SCENES_ONLY = {"num_train": 100_000, "num_val": 2_000, "num_test": 5_000, "num_novel": 2_000, "workers": None,
               "captions_per_scene": 1}  # fmt: skip
GLYPHS_ONLY = {"max_per_class": None, "max_val_per_class": None, "val_fraction": 0.2}


def _source_flags(args) -> None:
    """Refuse a flag of the other source; then every such flag takes its default."""
    scenes = args.source in ("scenes", "scenes-semantic")
    other = GLYPHS_ONLY if scenes else SCENES_ONLY
    for name in other:
        if getattr(args, name) is not None:
            which = "glyphs only (the default --source)" if scenes else "scenes sources only (--source scenes)"
            raise ValueError(f"--{name.replace('_', '-')}: {which}; this is --source {args.source}: drop it")
    for name, default in (SCENES_ONLY | GLYPHS_ONLY).items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _check_embedded(args) -> None:
    """Flags of `embedded` that would fail late, or silently change the data set, refused before anything is built."""
    _source_flags(args)
    if problem := out_folder_problem("--out", args.out):
        raise ValueError(problem)
    if held := _data_set_in(Path(args.out)):
        # a resumed run's per-sample state is indexed by these samples: new shards would silently change them
        raise ValueError(
            f"--out {args.out}: already holds a data set ({held}); write to a new folder, or remove that one first"
        )
    if args.fashion_mnist_root is not None:
        from fastclip.data.sources.embedded import fashion_mnist_available

        if not fashion_mnist_available(args.fashion_mnist_root):  # named on purpose: no silent fallback
            raise ValueError(
                f"--fashion-mnist-root {args.fashion_mnist_root}: no Fashion-MNIST there (train-images-idx3-ubyte.gz, "
                f"train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz); pass the folder "
                f"holding them, or omit the flag"
            )
    if args.max_per_class is not None and args.max_per_class < 1:
        raise ValueError(f"--max-per-class {args.max_per_class}: must be >= 1 (omit it for every sample)")
    if args.max_val_per_class is not None and args.max_val_per_class < 1:
        raise ValueError(  # a negative one would slice from the end: all but that many, silently
            f"--max-val-per-class {args.max_val_per_class}: must be >= 1 (omit it for every held-out sample, "
            f"or --val-fraction's share of --max-per-class)"
        )


def _embedded(args) -> int:
    _check_embedded(args)
    if args.source in ("scenes", "scenes-semantic"):
        return _scenes(args)
    from fastclip.data.sources.embedded import FASHION_MNIST_ROOT, build_embedded
    from fastclip.progress import Progress

    summary = build_embedded(
        args.out,
        datasets=args.datasets,
        max_per_class=args.max_per_class,
        max_val_per_class=args.max_val_per_class,
        val_fraction=args.val_fraction,
        shard_size=args.shard_size,
        seed=args.seed,
        index_offset=args.index_offset,
        fashion_root=args.fashion_mnist_root or FASHION_MNIST_ROOT,
        progress=lambda total: Progress(total, "embedded", unit="sample"),
    )
    print(f"datasets: {', '.join(summary['datasets'])} ({summary['note']})")
    for split, info in summary["splits"].items():
        print(
            f"{args.out}/{split}: {info['num_samples']} samples in {plural(info['shards'], 'shard')}, indices "
            f"{info['index_range'][0]}..{info['index_range'][1]}"
        )
    print(f"data_size {summary['data_size']}; class names and templates in {args.out}/{ZEROSHOT_NAME}")
    return 0


def _check_folder(args) -> None:
    """Flags of `folder` that would fail late, or overwrite shards already there, refused before anything is read."""

    if problem := out_folder_problem("--out", args.out):
        raise ValueError(problem)
    if args.captions is None:
        if args.images is None or not Path(args.images).is_dir():
            raise ValueError(
                "pass --captions FILE (images with captions) or --images DIR alone (its images without captions, "
                f"for ssl training){'' if args.images is None else f'; --images {args.images} is not a folder'}"
            )
    else:
        if not Path(args.captions).is_file():
            what = "is a folder" if Path(args.captions).is_dir() else "no such file"
            raise ValueError(f"--captions {args.captions}: {what}; pass the CSV/TSV/JSONL of paths and captions")
        if args.images is not None and not Path(args.images).is_dir():  # else one skip per row, then the error
            raise ValueError(f"--images {args.images}: not a folder; pass the folder the image paths are relative to")
    if not args.prefix or "/" in args.prefix or args.prefix in (".", ".."):
        raise ValueError(f"--prefix {args.prefix!r}: must be a file name start without '/' (e.g. train)")
    if (Path(args.out) / MANIFEST_NAME).exists():
        raise ValueError(
            f"--out {args.out}: already holds a data set ({MANIFEST_NAME}), which this would replace with a "
            f"manifest of the new shards only; write to a new folder"
        )
    # shards of an earlier run without its manifest (stopped before the end): writing would overwrite them
    if existing := sorted(Path(args.out).glob(f"{args.prefix}-*.tar")):
        raise ValueError(
            f"--out {args.out}: already holds {plural(len(existing), 'shard')} named {args.prefix}-*.tar "
            f"({existing[0].name}, ...) that this would overwrite; write to a new folder or remove them"
        )


def _folder(args) -> int:
    _check_folder(args)
    from fastclip.data.sources.folder import build_folder, build_image_folder

    if args.captions is None:  # images alone (fastclip/train/ssl.py)
        summary = build_image_folder(
            args.images, args.out, shard_size=args.shard_size, index_offset=args.index_offset, prefix=args.prefix
        )
    else:
        summary = build_folder(
            args.captions,
            args.out,
            images=args.images,
            img_key=args.csv_img_key,
            caption_key=args.csv_caption_key,
            separator=args.csv_separator,
            shard_size=args.shard_size,
            index_offset=args.index_offset,
            prefix=args.prefix,
        )
    for line in summary["skipped"][:50]:
        print(f"skipped {line}")
    print(
        f"{args.out}: {summary['written']} of {plural(summary['rows'], 'row')} written in "
        f"{plural(summary['shards'], 'shard')} ({len(summary['skipped'])} skipped), "
        f"data_size {summary['data_size']}"
    )
    if summary["written"] == 0:
        first = summary["skipped"][0] if summary["skipped"] else "no row"
        print(f"fastclip data folder: error: no sample written (first skip: {first})", file=sys.stderr)
        return 2
    return 0


def _scan(args) -> int:
    from fastclip.data.manifest import write_manifest
    from fastclip.data.sources.scan import find_shards, manifest_unwritable, scan_shards

    if args.data_size is not None and args.data_size < 1:
        raise ValueError(f"--data-size {args.data_size}: must be >= 1 (or omit it: 1 + the largest index found)")
    if args.manifest is not None and not args.manifest.endswith(".json"):  # else training takes it for shards
        raise ValueError(f"--manifest {args.manifest}: name a .json file (data.train reads FILE.json as a manifest)")
    target = Path(args.manifest) if args.manifest else find_shards(args.shards)[0] / MANIFEST_NAME
    if problem := manifest_unwritable(target):
        raise ValueError(problem)
    result = scan_shards(
        args.shards,
        data_size=args.data_size,
        write=False,
        workers=args.workers,
        from_tars=args.from_tars,
        samples_per_shard=args.samples_per_shard,
        captions=not args.images_only,
        index_offset=args.index_offset,
        manifest=args.manifest,
    )
    print(result.summary())
    if not _scan_writable(args, result):
        return 1
    for note in result.notes:  # what the new manifest leaves out of the old one is said where errors are
        print(f"fastclip data scan: note: {note}", file=sys.stderr)
    write_manifest(result.path, result.manifest)
    print(f"wrote {result.path}")
    return 0


def _scan_writable(args, result) -> bool:
    """Whether the scan's manifest is to be written: not when no sample is usable (a usage error), nor under
    --strict with any problem found (exit status 1). Samples that --data-size leaves out are a note."""

    if result.usable == 0:  # a manifest of samples the stream skips, every one: training would find nothing
        read = result.manifest.num_samples
        why = f"each of the {plural(read, 'sample')} read has a problem listed above; " if read else ""
        raise ValueError(
            f"{args.shards}: no usable sample in {len(result.manifest.shards)} file(s), no manifest written "
            f"({why}WebDataset .tar shards of image + caption files are expected)"
        )
    out_of_range = sum(p.get("reason") == "index_out_of_range" for p in result.problems)
    if args.data_size is not None and out_of_range:  # allowed (a cap), but said where an operator looks
        print(
            f"fastclip data scan: note: --data-size {args.data_size} leaves {plural(out_of_range, 'sample')} "
            f"out of range: listed as problems, the loader skips them (omit --data-size to keep every sample)",
            file=sys.stderr,
        )
    sparse_note = _sparse_note(result.manifest, result.usable)
    if sparse_note:
        print(f"fastclip data scan: note: {sparse_note}", file=sys.stderr)
    if args.strict and result.problems:
        print(
            f"fastclip data scan: error: --strict: {plural(len(result.problems), 'problem')} found in "
            f"{result.folder}, no manifest written",
            file=sys.stderr,
        )
        return False
    return True


SPARSE_RATIO, SPARSE_EXTRA = 4, 100_000  # img2dataset's failed downloads leave gaps of ~2x at most


def _sparse_note(manifest, usable: int) -> str | None:
    """A data_size far above the samples (one stray key can make it 10**7 for a hundred samples): per-sample state
    is sized by it, so say where the largest index lies."""
    size = manifest.data_size
    if size < SPARSE_RATIO * usable or size - usable < SPARSE_EXTRA:
        return None
    top = max((s for s in manifest.shards if s.index_max is not None), key=lambda s: s.index_max, default=None)
    where = f" (shard {top.path})" if top is not None and top.index_max == size - 1 else ""
    return (
        f"data_size {size:,} for {plural(usable, 'usable sample')} ({size / max(usable, 1):,.0f}x): per-sample state "
        f"(u, τ) is sized by data_size; the largest index is {size - 1:,}{where}: check its keys (a stray json "
        f"'key' or 'index'?), or pass --data-size to skip the samples above it"
    )


def _info(args) -> int:
    from fastclip.data.catalog import resolve_catalog

    catalog = resolve_catalog(args.train_data)
    out = {
        "data_size": catalog.data_size,
        "num_samples": catalog.num_samples,
        "shards": len(catalog.shards),
        "groups": catalog.grouped,
        "sources": [
            {
                "spec": s.spec,
                "shards": len(s.shard_ids),
                "index_min": s.index_min,
                "index_max": s.index_max,
                "data_size": s.data_size,
            }
            for s in catalog.sources
        ],
    }
    if args.batch_size:
        # what `fastclip train` refuses (check_data), in the same words
        problem = global_batch_too_large(args.batch_size, args.world_size, catalog.num_samples, args.train_data)
        if problem:
            raise ValueError(
                f"--batch-size {problem}; `fastclip train` refuses it: pass a smaller --batch-size or --world-size"
            )
        out["batches_per_epoch"] = -(-catalog.num_samples // (args.batch_size * args.world_size))
    print(json.dumps(out, indent=1))
    return 0


def _scenes(args) -> int:
    import time

    from fastclip.data.sources.embedded import FASHION_MNIST_ROOT
    from fastclip.data.sources.scenes import build_scenes, check_captions_per_scene
    from fastclip.progress import Progress

    variant = "semantic" if args.source == "scenes-semantic" else "classic"
    check_captions_per_scene(variant, args.captions_per_scene)  # before the progress line starts
    start = time.perf_counter()
    total = args.num_train + args.num_val + args.num_test + args.num_novel
    with Progress(total, "scenes", unit="scene") as bar:
        summary = build_scenes(
            args.out,
            num_train=args.num_train,
            num_val=args.num_val,
            num_test=args.num_test,
            num_novel=args.num_novel,
            shard_size=args.shard_size,
            seed=args.seed,
            index_offset=args.index_offset,
            datasets=args.datasets,
            workers=args.workers,
            fashion_root=args.fashion_mnist_root or FASHION_MNIST_ROOT,
            progress=bar.update,
            variant=variant,
            captions_per_scene=args.captions_per_scene,
        )
    print(f"scenes of {', '.join(summary['datasets'])} glyphs ({summary['note']}), {time.perf_counter() - start:.0f} s")
    per = args.captions_per_scene
    for split, info in summary["splits"].items():
        scenes = f"{info['num_samples']} scenes" if per == 1 else f"{info['scenes']} scenes x {per} captions"
        print(
            f"{args.out}/{split}: {scenes} ({info['distinct_captions']} distinct captions, "
            f"{info['labelled_single_object']} single-object for zero-shot) in {plural(info['shards'], 'shard')}, "
            f"indices {info['index_range'][0]}..{info['index_range'][1]}"
        )
    print(
        f"data_size {summary['data_size']}; {len(summary['held_out_pairs'])} (class, colour) pairs held out of "
        f"training; class names and prompts in {args.out}/{ZEROSHOT_NAME}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
