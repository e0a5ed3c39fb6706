"""`fastclip eval CKPT --data PATH`: zero-shot classification and image-text retrieval, printed as a table
and appended to a JSONL file.

PATH is the folder written by `fastclip data embedded` (its val/ split and zeroshot.json are used), a
labelled shard folder / tar / glob, or an image folder with one subfolder per class. Class names and
templates come from --classnames (zeroshot.json, a single-dataset JSON, a .txt with --templates, or `imagenet`
for an ImageNet validation folder or variant: the standard class names and OpenAI's 80 templates; ObjectNet's
folder through its mapping, see fastclip/eval/imagenet.py), else
from a zeroshot.json beside the data, else (image folders) from the class folder names.

--linear-probe and --knn K... score the frozen image features of PATH's labelled samples (fastclip/eval/probe.py)
against training features from --probe-train: by default the train/ split of an embedded root (or the train/
folder beside --data), else a seeded 80/20 split of each class of PATH itself. They alone score an image tower
trained alone (an ssl run, or its export with --arch).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastclip.cli import OneLineParser, plural, unwritable
from fastclip.data.format import MANIFEST_NAME, ZEROSHOT_NAME
from fastclip.data.tario import one_line
from fastclip.eval import records
from fastclip.eval.evaluate import (
    EvalResults,
    LabelOutOfRange,
    MixedDatasets,
    default_zeroshot_file,
    evaluate,
    one_list_for_all,
    unscorable,
)
from fastclip.eval.probe import (
    KNN_TEMPERATURE,
    ProbeDataError,
    ProbeResult,
    feature_kind,
    run_probe,
    split_for_probe,
)
from fastclip.eval.retrieval import DEFAULT_KS, DIRECTIONS, recall_name
from fastclip.eval.samples import (
    EvalDataError,
    held_out_folder,
    image_folder_classes,
    is_image_folder,
    is_pattern,
    iter_image_folder,
    shard_paths,
    shard_subfolders,
)
from fastclip.eval.spec import ZeroShotSpec, load_zeroshot_spec, spec_from_class_folders
from fastclip.progress import Progress
from fastclip.stopping import Stopped, signals_deferred, stopped_by_signals


def embedded_split(root: Path, split: str) -> Path | None:
    """root/split where root is a data set written by `fastclip data embedded` (its splits beside zeroshot.json)."""
    return root / split if (root / split).is_dir() and (root / ZEROSHOT_NAME).is_file() else None


def resolve_data(path: Path) -> tuple[Path, Path | None]:
    """(samples source, default class names file) for an embedded root or a plain source."""
    if (val := embedded_split(path, "val")) is not None:
        return val, path / ZEROSHOT_NAME
    if is_image_folder(path):
        shard_folders = shard_subfolders(path)
        if shard_folders:  # read as classes, train/ and val/ would give 0 samples and a 2-class "accuracy"
            hint = (
                f"a data root without {ZEROSHOT_NAME}: pass --data {path / 'val'}"
                if "val" in shard_folders
                else f"pass one of them as --data, e.g. --data {path / shard_folders[0]}"
            )
            raise EvalDataError(
                f"--data {path}: its subfolders {', '.join(shard_folders)} are shard folders ({MANIFEST_NAME} or "
                f".tar), not one folder of images per class; {hint} (and --classnames FILE for zero-shot)"
            )
        return path, None  # a zeroshot.json inside would look like a class folder's sibling, not ours
    return path, default_zeroshot_file(path)  # (a .tar or a pattern: beside its shards' folder)


class _OneLineWarnings(logging.Filter):
    """Holds the skip warnings back, one line each (a tar's open error spans lines): said under the table, or, when
    nothing was readable, the first of them in the one error line."""

    SHOWN = 10

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        self.count = 0

    @property
    def first(self) -> str | None:
        return self.lines[0] if self.lines else None

    def filter(self, record: logging.LogRecord) -> bool:
        self.count += 1
        if len(self.lines) < self.SHOWN:
            self.lines.append(one_line(record.getMessage()))
        return False

    def said(self) -> str:
        more = f"\n... and {self.count - len(self.lines)} more" if self.count > len(self.lines) else ""
        return "\n".join(self.lines) + more


def _norm(name: str) -> str:
    return name.replace("_", " ").strip().lower()


def image_folder_source(root: Path, spec: ZeroShotSpec, names_file):
    """Samples of an image folder labelled by `spec`'s class order: folders matched to class names by name,
    else taken in sorted order when the counts agree (torchvision ImageFolder's convention)."""
    folders = image_folder_classes(root)
    position = {_norm(c): i for i, c in enumerate(spec.classnames)}
    if all(_norm(f) in position for f in folders):
        mapping = [position[_norm(f)] for f in folders]
    elif len(folders) == len(spec.classnames):
        mapping = list(range(len(folders)))
    else:
        raise ValueError(
            f"{root}: {len(folders)} class folders, but {names_file} lists {len(spec.classnames)} class names "
            f"for {spec.name!r} and the folder names do not match them"
        )

    def source(rank, world_size, skipped):
        for sample in iter_image_folder(root, rank, world_size, dataset=spec.name, skipped=skipped):
            sample.label = mapping[sample.label]
            yield sample

    return source


def imagenet_asked(args) -> bool:
    return args.classnames is not None and str(args.classnames) == "imagenet" and not args.classnames.exists()


def load_specs(args, data: Path, default_names: Path | None) -> tuple[dict[str, ZeroShotSpec], str | None]:
    if imagenet_asked(args):
        from fastclip.eval.imagenet import read_variant, with_templates

        # ImageNet's class folders (all 1,000 or a variant's subset) or ObjectNet's mapping, or a one-line error
        # naming the odd folder or the missing file
        spec, note = read_variant(data)
        if args.templates:
            from fastclip.eval.spec import load_templates

            spec = with_templates(spec, tuple(load_templates(args.templates)))
        if note:
            print(f"fastclip eval: note: {note}", file=sys.stderr)
        which = "ImageNet's" if spec.prompted is None else f"ObjectNet's ({len(spec.prompted):,} ImageNet classes')"
        return {spec.name: spec}, f"{which} class names ({len(spec.classnames):,}, open_clip's), " + (
            f"templates {args.templates}" if args.templates else "OpenAI's 80 templates"
        )
    names_file = args.classnames or default_names
    if names_file is not None:
        return load_zeroshot_spec(names_file, args.templates), str(names_file)
    if is_image_folder(data):
        templates = None
        if args.templates:
            from fastclip.eval.spec import load_templates

            templates = load_templates(args.templates)
        return spec_from_class_folders(data.name, image_folder_classes(data), templates), "class folder names"
    return {}, None


def retrieval_meaningful(results: EvalResults) -> bool:
    return records.retrieval_reported(results.retrieval_distinct_captions, results.retrieval_samples)


def format_table(results: EvalResults, per_class: bool) -> str:
    lines = []
    if results.zeroshot:
        lines.append(f"{'zero-shot':<24} {'samples':>8} {'top-1':>7} {'top-5':>7} {'mean/class':>10}")
        for name, r in results.zeroshot.items():
            lines.append(
                f"{name:<24} {r.num_samples:>8} {100 * r.top1:>7.2f} {100 * r.top5:>7.2f} "
                f"{100 * r.mean_per_class_recall:>10.2f}"
            )
        for name, r in results.zeroshot.items():
            if per_class or len(r.classnames) <= 20:
                lines.append(f"\n{name}: top-1 accuracy per class")
                for classname, acc in r.per_class.items():
                    lines.append(f"  {classname:<22} {'-' if acc is None else f'{100 * acc:.2f}':>7}")
    if results.retrieval and not retrieval_meaningful(results):
        lines.append(
            f"\nretrieval omitted: {results.retrieval_samples} images share "
            f"{results.retrieval_distinct_captions} distinct captions (class templates), so a caption cannot "
            f"single out its image; data with distinct captions: fastclip data embedded --source scenes"
        )
    elif results.retrieval:
        if results.retrieval_images is None:
            lines.append(f"\nretrieval over {results.retrieval_samples} image-caption pairs")
        else:  # the COCO/Flickr protocol (fastclip/eval/retrieval.py)
            lines.append(
                f"\nretrieval over {results.retrieval_samples} captions of {results.retrieval_images} images "
                f"(image->text: a hit when any of its captions is in the top k)"
            )
        lines.append(f"{'':<14} " + " ".join(f"{f'R@{k}':>7}" for k in DEFAULT_KS))
        for direction in DIRECTIONS:
            values = [results.retrieval[recall_name(direction, k)] for k in DEFAULT_KS]
            lines.append(f"{direction.replace('_to_', '->'):<14} " + " ".join(f"{100 * v:>7.2f}" for v in values))
        repeated = results.retrieval_samples - results.retrieval_distinct_captions
        if results.retrieval_distinct_captions and repeated > 0:
            repeats = "repeats" if repeated == 1 else "repeat"
            lines.append(f"({repeated} of the captions {repeats} another; tied captions count against the pair)")
    if results.skipped or results.cut_shards:
        lines.append(f"\n{skipped_words(results)} (listed on stderr)")
    return "\n".join(lines) if lines else "nothing to report: no labelled samples with class names, no captions"


def nothing_scored(args, specs: dict, names_from: str | None, results: EvalResults | None = None) -> str | None:
    """Why neither zero-shot nor retrieval can give a number (a usage error: an empty table read as a result);
    None when something is scored. Before the evaluation (`results` None) only the flags can tell."""
    if probe_asked(args):  # the probe scores the labels, or says in one line why it cannot
        return None
    if results is None:
        if specs or not args.no_retrieval:
            return None
    elif results.zeroshot or (results.retrieval_samples and retrieval_meaningful(results)):
        return None
    if not specs:
        zeroshot = "no class names for zero-shot (no zeroshot.json beside it: pass --classnames FILE)"
    elif results.unmatched:
        zeroshot = f"its {results.unmatched} labelled samples belong to no dataset of {names_from}"
    else:
        zeroshot = "no labelled samples for zero-shot"
    if args.no_retrieval:
        retrieval = "--no-retrieval is set"
    elif not results.retrieval_samples:
        retrieval = "no captions for retrieval"
    else:
        n, distinct = results.retrieval_samples, results.retrieval_distinct_captions
        retrieval = (
            f"its {n} captions are only {distinct} distinct class templates, so retrieval cannot single out an image"
        )
    return f"--data {args.data}: nothing to score: {zeroshot}, and {retrieval}"


def result_records(results: EvalResults, common: dict, probes: dict[str, ProbeResult] | None = None) -> list[dict]:
    """One JSON object per zero-shot dataset, one for retrieval, and per probed dataset one for the linear probe
    and one per kNN k (DataComp-style rows; the trainer's names: <task>/<dataset>/top1)."""
    rows = []
    for name, r in results.zeroshot.items():
        rows.append(
            {
                **common,
                "task": records.ZEROSHOT,
                "dataset": name,
                "num_samples": r.num_samples,
                "top1": r.top1,
                "top5": r.top5,
                "mean_per_class_recall": r.mean_per_class_recall,
                "per_class": r.per_class,
            }
        )
    if results.retrieval:
        rows.append(
            {
                **common,
                "task": records.RETRIEVAL,
                "num_samples": results.retrieval_samples,
                "distinct_captions": results.retrieval_distinct_captions,
                **({} if results.retrieval_images is None else {"num_images": results.retrieval_images}),
                **results.retrieval,
            }
        )
    for name, probe in (probes or {}).items():
        shared = {
            **common,
            "dataset": name,
            "num_samples": probe.test_samples,
            "train_samples": probe.train_samples,
            "features": probe.feature_kind,
        }
        if probe.linear_top1 is not None:
            rows.append({**shared, "task": records.LINEAR_PROBE, "top1": probe.linear_top1, "C": probe.linear_c})
        for k, top1 in (probe.knn_top1 or {}).items():
            rows.append({**shared, "task": records.KNN, "k": k, "temperature": KNN_TEMPERATURE, "top1": top1})
    for row in rows:
        row["skipped_samples"] = results.skipped
    return rows


def default_results_file(model_file: Path) -> Path:
    """<run>/checkpoints/results.jsonl for a training checkpoint (OpenCLIP's place), else beside the file."""
    if model_file.parent.name.startswith("step_"):
        return model_file.parent.parent / "results.jsonl"
    return model_file.parent / "results.jsonl"


def _count_samples(source, max_samples: int | None) -> int | None:
    """Samples to evaluate, for the progress bar: from a shard folder's manifest (else unknown: no bar)."""
    if not isinstance(source, Path) or not (source / MANIFEST_NAME).is_file():
        return None
    from fastclip.data.manifest import read_manifest

    count = read_manifest(source).num_samples
    return count if max_samples is None else min(count, max_samples)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fastclip eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="run dir, checkpoints dir, step dir, model.pt, or an exported file")
    parser.add_argument(
        "--data", required=True, type=Path, help="embedded root, shard folder/tar/glob, or image folder"
    )
    parser.add_argument("--arch", help="architecture of an exported file (open_clip name or <arch>.json path)")
    parser.add_argument(
        "--classnames",
        "--zeroshot",
        dest="classnames",
        type=Path,
        help="zeroshot.json, single-dataset JSON, or classnames .txt; 'imagenet': an ImageNet val folder's 1,000 "
        "standard class names with OpenAI's 80 templates (a variant's subset; ObjectNet's folder: its mapping)",
    )
    parser.add_argument("--templates", type=Path, help="templates .txt (one per line) or JSON list; '{}' = class")
    parser.add_argument("--no-retrieval", action="store_true", help="skip image-text retrieval")
    parser.add_argument("--per-class", action="store_true", help="print per-class accuracy for any class count")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-samples", type=int, help="evaluate only the first N samples")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--linear-probe", action="store_true", help="logistic-regression probe on the frozen image features"
    )
    parser.add_argument(
        "--knn", type=int, nargs="+", metavar="K", help="weighted kNN on the frozen image features (e.g. --knn 20 200)"
    )
    parser.add_argument(
        "--probe-train",
        type=Path,
        help="labelled training data of the probe and kNN (shards or image folder); default: the train/ split "
        "beside --data, else a seeded 80/20 split of --data",
    )
    parser.add_argument(
        "--probe-max-train", type=int, default=10000, help="training samples read for the probe (default 10000)"
    )
    parser.add_argument(
        "--results",
        type=Path,
        help="JSONL file to append to (default: checkpoints/results.jsonl "
        "of a run, else results.jsonl beside the model file)",
    )
    return parser


def probe_asked(args) -> bool:
    return bool(args.linear_probe or args.knn)


def probe_train_path(args, source) -> Path | None:
    """The probe's training data: --probe-train (an embedded root: its train/), else the train/ folder beside
    the evaluated one (an embedded root's split, ImageNet's train/ beside val/), else None: a split of the data."""
    if args.probe_train is not None:
        given = args.probe_train
        return embedded_split(given, "train") or given
    folder = held_out_folder(source) if isinstance(source, Path) else None  # (a .tar or pattern: its folder)
    if folder is not None and folder.name != "train" and (folder.parent / "train").is_dir():
        return folder.parent / "train"
    return None


def run_probes(args, built, test: EvalResults, train_path, train_source, default_name, bar_total):
    """(probe results per dataset, where their training features came from, training samples skipped)."""
    kind = feature_kind(built.model)
    if train_path is None:
        pairs = {name: split_for_probe(features) for name, features in test.features.items()}
        where, skipped = "a seeded 80/20 split of each class of --data (no train/ beside it; --probe-train)", 0
    else:
        with Progress(bar_total, "probe features", unit="sample") if bar_total else contextlib.nullcontext() as bar:
            train = evaluate(
                built.model,
                tokenizer=built.tokenizer,
                preprocess=built.preprocess_val,
                source=train_source,
                specs={},
                device=args.device,
                batch_size=args.batch_size,
                max_samples=args.probe_max_train,
                retrieval=False,
                progress=bar.update if bar is not None else None,
                collect_features=default_name,
            )
        missing = sorted(set(test.features) - set(train.features))
        if missing:
            raise ProbeDataError(
                f"probe on {missing[0]!r}: no labelled sample of it in the first {args.probe_max_train} of "
                f"{train_path}; pass --probe-train with its training data (or a larger --probe-max-train)"
            )
        pairs = {name: (train.features[name], test.features[name]) for name in test.features}
        where, skipped = f"{train_path} (first {args.probe_max_train} samples read)", train.skipped
    if not pairs:
        raise ProbeDataError(f"--data {args.data}: no labelled sample for the probe; pass labelled data")
    ks = tuple(sorted(set(args.knn or ())))
    probes = {
        name: run_probe(name, tr, te, linear=args.linear_probe, ks=ks, kind=kind) for name, (tr, te) in pairs.items()
    }
    return probes, where, skipped


def format_probe_table(probes: dict[str, ProbeResult], where: str) -> str:
    kind = next(iter(probes.values())).feature_kind
    ks = sorted({k for p in probes.values() for k in (p.knn_top1 or {})})
    linear = any(p.linear_top1 is not None for p in probes.values())
    lines = [f"\nprobes on frozen image features ({kind}); training features from {where}"]
    header = f"{'dataset':<24} {'train':>7} {'test':>7}" + (f" {'linear':>7} {'C':>7}" if linear else "")
    lines.append(header + "".join(f" {f'kNN k={k}':>10}" for k in ks))
    for name, p in probes.items():
        row = f"{name:<24} {p.train_samples:>7} {p.test_samples:>7}"
        if linear:
            row += f" {100 * p.linear_top1:>7.2f} {p.linear_c:>7.0e}"
        lines.append(row + "".join(f" {100 * p.knn_top1[k]:>10.2f}" for k in ks))
    seconds = sum(p.seconds for p in probes.values())
    lines.append(f"(top-1 %; fitted and scored in {seconds:.1f} s)")
    return "\n".join(lines)


def _usage_problem(args) -> str | None:
    """What is wrong with the flags themselves, checked before anything is loaded."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        return f"--device {args.device}: not a device (cpu, cuda, cuda:N)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {args.device}: this torch has no usable CUDA device; pass --device cpu"
    if device.type not in ("cpu", "cuda"):
        return f"--device {args.device}: only cpu and cuda are supported"
    if args.batch_size < 1:
        return f"--batch-size {args.batch_size}: must be >= 1"
    if args.max_samples is not None and args.max_samples < 1:
        return f"--max-samples {args.max_samples}: must be >= 1"
    if args.knn and min(args.knn) < 1:
        return f"--knn {min(args.knn)}: k must be >= 1"
    if args.probe_max_train < 1:
        return f"--probe-max-train {args.probe_max_train}: must be >= 1"
    if args.probe_train is not None and not probe_asked(args):
        return f"--probe-train {args.probe_train}: given without --linear-probe or --knn K; pass one of them"
    if args.probe_train is not None and not args.probe_train.exists() and not is_pattern(args.probe_train):
        return f"--probe-train {args.probe_train}: not found; pass labelled shards or an image folder"
    if args.templates is not None and not args.templates.is_file():
        what = "a folder" if args.templates.is_dir() else "no such file"
        return f"--templates {args.templates}: {what}; pass a .txt (one template per line) or a JSON list"
    if args.results is not None and args.results.is_dir():
        return f"--results {args.results}: is a folder; pass a .jsonl file to append to"
    if args.results is not None:  # before the evaluation, not after it
        return unwritable("--results", args.results) or not_results_file(args.results)
    return None


def not_results_file(path: Path) -> str | None:
    """Why appending records to an existing `path` would damage it (a checkpoint, a config, a run's metrics.jsonl:
    each was appended to, silently), else None: a results file holds JSON lines with a "task"."""
    try:
        with open(path, "rb") as f:
            start = f.read(1 << 16)  # (a record's per_class can make its line longer: "task" comes first)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"--results {path}: cannot be read ({e.strerror or e}); choose another --results"
    first = start.split(b"\n", 1)[0].strip()
    if not start.strip():
        return None
    if first.startswith(b"{") and b'"task"' in first:
        return None
    what = "JSON lines of another kind (a run's metrics.jsonl?)" if first.startswith(b"{") else "not JSON lines"
    return (
        f"--results {path}: holds something other than fastclip eval's records ({what}); appending would damage it: "
        f"pass a new file or an earlier --results .jsonl"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _usage_problem(args)
    if problem:
        print(f"fastclip eval: {problem}", file=sys.stderr)
        return 2
    from fastclip.eval.checkpoint import load_model

    warnings = _OneLineWarnings()
    logging.getLogger("fastclip.eval.samples").addFilter(warnings)
    evaluate_log = logging.getLogger("fastclip.eval.evaluate")
    level = evaluate_log.level
    evaluate_log.setLevel(logging.ERROR)  # its warning (unscored labels) is said under the table instead
    done: dict = {}  # "appended": the results file, once the records are in it
    try:
        with stopped_by_signals():  # SIGTERM, SIGHUP: one line, as Ctrl-C's (they ended it with no word, status 143)
            return _main(args, load_model, warnings, done)
    except (Stopped, KeyboardInterrupt) as e:
        said = (
            f"after appending its records to {done['appended']}"
            if "appended" in done
            else "before its records were appended (nothing written)"
        )
        how = f"stopped by {e.name}" if isinstance(e, Stopped) else "interrupted"
        print(f"fastclip eval: {how} {said}", file=sys.stderr)
        return 128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT)
    finally:
        logging.getLogger("fastclip.eval.samples").removeFilter(warnings)
        evaluate_log.setLevel(level)


@dataclass
class _Prepared:
    """What the evaluation runs on, once the flags, the data, the class names and the model are known usable."""

    source: object  # a Path (shards), or a function of (rank, world_size, skipped) yielding samples
    preprocess: object
    specs: dict[str, ZeroShotSpec]
    names_from: str | None  # where the class names came from, as said in the header and the errors
    for_all: bool  # one class list scores every labelled sample
    loaded: object  # fastclip.eval.checkpoint.load_model's model, file and step
    train_path: Path | None  # the probe's training data (None: a split of --data)
    default_name: str  # the dataset of samples that name none
    trained_on: str | None = None  # the run's data.train where --data holds shards it trained on (not held out)
    own_names: bool = False  # --classnames names the data's own class-names file: no variant of its prompts


@dataclass
class _Scored:
    results: EvalResults
    probes: dict[str, ProbeResult] = field(default_factory=dict)
    probe_where: str = ""  # where the probe's training features came from
    probe_skipped: int = 0  # training samples of the probe skipped as unreadable


def _main(args, load_model, warnings: _OneLineWarnings, done: dict) -> int:
    try:
        run = _prepare(args, load_model)
        started = time.time()
        with _class_list_errors(run.names_from):
            scored = _score(args, run)
    except (FileNotFoundError, ValueError, EvalDataError) as err:  # a checkpoint or data named that is unusable
        print(f"fastclip eval: {err}", file=sys.stderr)
        return 2
    if problem := _unscored(args, run, scored.results, warnings):
        print(f"fastclip eval: {problem}", file=sys.stderr)
        return 2
    seconds = time.time() - started
    # first (a reader of the report that leaves, `| head`, loses nothing), and whole or not at all
    with signals_deferred():
        appended = _append_records(args, run, scored)
        if not isinstance(appended, str):
            done["appended"] = appended
    _print_report(args, run, scored, warnings, seconds=seconds)
    if isinstance(appended, str):
        print(f"fastclip eval: {appended}", file=sys.stderr)
        return 1
    print(f"\nappended to {appended}")
    return 0


def _prepare(args, load_model) -> _Prepared:
    """The data, its class names and the model, each refused in one line before anything is evaluated."""
    source, default_names = resolve_data(args.data)
    if not source.exists() and not is_pattern(source):
        raise FileNotFoundError(f"--data {source}: not found")
    specs, names_from = load_specs(args, source, default_names)
    for_all = one_list_for_all(specs, default_names)
    problem = nothing_scored(args, specs, names_from)
    if problem:  # known from the flags: refused before the model is loaded
        raise ValueError(problem)
    loaded = load_model(args.checkpoint, arch=args.arch, device=args.device, image_tower=probe_asked(args))
    if loaded.image_only:  # an ssl run or export: the probe alone scores an image tower
        if args.classnames is not None or args.templates is not None:
            given = "--classnames" if args.classnames is not None else "--templates"
            raise ValueError(
                f"{given}: {loaded.file} is an image tower alone (ssl): the probe scores it, not zero-shot; "
                f"drop {given}"
            )
        specs, names_from, for_all, args.no_retrieval = {}, None, True, True
    if args.results is None and (problem := unwritable("--results", default_results_file(loaded.file))):
        raise ValueError(f"{problem} (the default beside the model; pass --results FILE)")
    # then from the labels and captions, before the pass (after the model: an ssl tower's own refusal comes first)
    if not probe_asked(args) and not imagenet_asked(args):
        try:
            ahead = unscorable(source, specs, not args.no_retrieval, for_all, args.max_samples)
        except EvalDataError:  # shards that cannot be listed: said where they are read
            ahead = None
        if ahead is not None and (problem := nothing_scored(args, specs, names_from, ahead)):
            raise ValueError(problem)
    train_path = probe_train_path(args, source)
    trained_on = training_overlap(loaded.file, source, getattr(loaded, "data_train", None))  # (a caller's loader: none)
    if trained_on is not None:
        print(
            f"fastclip eval: note: --data {args.data} holds shards this run trained on (data.train {trained_on}): "
            f"the numbers are on training data, not held out (the results say so: held_out false)",
            file=sys.stderr,
        )
    preprocess = loaded.built.preprocess_val
    if specs and imagenet_asked(args) and next(iter(specs.values())).name == "objectnet":
        from fastclip.eval.imagenet import ImageNetSource, prepared

        # decoded here, border cropped (ObjectNet's red frame), preprocessed: the trainer's source
        source = ImageNetSource(source, preprocess, workers=0, batch_size=args.batch_size)
        preprocess = prepared
    elif is_image_folder(source) and specs:
        if len(specs) != 1:
            raise ValueError(f"{names_from}: an image folder takes one class list, the file has {sorted(specs)}")
        source = image_folder_source(source, next(iter(specs.values())), names_from)
    default_name = next(iter(specs)) if len(specs) == 1 else (held_out_folder(args.data) or Path(args.data)).name
    own_names = (
        args.classnames is not None
        and default_names is not None
        and Path(args.classnames).resolve() == Path(default_names).resolve()
    )
    return _Prepared(
        source, preprocess, specs, names_from, for_all, loaded, train_path, default_name, trained_on, own_names
    )


def training_overlap(model_file: Path, source, train: str | None = None) -> str | None:
    """The data.train a checkpoint was trained on (`train`, its own record; else its run folder's config.yaml) when
    `source` holds one of its shards, else None (an export outside a run, an image folder, data that is gone:
    nothing to compare). The checkpoint's own record holds for a model.pt copied out of its run, or into another's."""
    import yaml

    from fastclip.data.catalog import resolve_catalog
    from fastclip.data.remote import is_remote

    run = default_results_file(model_file).parent.parent  # <run>/checkpoints/results.jsonl
    try:
        evaluated = {p.resolve() for p in shard_paths(source)}  # first: an image folder has none, nothing to compare
        if train is None:
            train = yaml.safe_load((run / "config.yaml").read_text())["data"]["train"]
        if any(is_remote(part.strip()) for part in str(train).split("::")):  # not fetched for a note
            return None
        trained = {Path(s.path).resolve() for s in resolve_catalog(str(train)).shards}
    except Exception:  # noqa: BLE001 - not a run folder, a config or data that cannot be read: no claim made
        return None
    return str(train) if trained & evaluated else None


@contextlib.contextmanager
def _class_list_errors(names_from: str | None):
    """A class list that is not the data's, said naming where it came from."""
    try:
        yield
    except MixedDatasets as err:
        raise EvalDataError(
            f"--classnames {names_from}: {err}; pass a list per dataset (a zeroshot.json with "
            f'"datasets"), or name the list for the one dataset to score ("name" in a .json, <dataset>.txt)'
        ) from None
    except LabelOutOfRange as err:
        raise EvalDataError(
            f"{err}: the class names of {names_from} are not this data's; pass its own --classnames"
        ) from None


def _score(args, run: _Prepared) -> _Scored:
    """Zero-shot and retrieval over --data, then the probes on its image features."""
    built = run.loaded.built
    total = _count_samples(run.source, args.max_samples)
    with Progress(total, "eval", unit="sample") if total else contextlib.nullcontext() as bar:
        results = evaluate(
            built.model,
            tokenizer=built.tokenizer,
            preprocess=run.preprocess,
            source=run.source,
            specs=run.specs,
            device=args.device,
            batch_size=args.batch_size,
            max_samples=args.max_samples,
            retrieval=not args.no_retrieval,
            progress=bar.update if bar is not None else None,
            one_list_for_all=run.for_all,
            collect_features=run.default_name if probe_asked(args) else None,
        )
    scored = _Scored(results)
    if probe_asked(args) and results.num_samples:
        train_path, probe_source = run.train_path, run.train_path
        if train_path is not None and is_image_folder(train_path) and len(run.specs) == 1:
            probe_source = image_folder_source(train_path, next(iter(run.specs.values())), run.names_from)
        probe_total = _count_samples(train_path, args.probe_max_train) if train_path is not None else None
        scored.probes, scored.probe_where, scored.probe_skipped = run_probes(
            args, built, results, train_path, probe_source, run.default_name, probe_total
        )
    return scored


def skipped_words(results: EvalResults) -> str:
    """What the evaluation left out, as exactly as it is known."""
    words = [f"{plural(results.skipped, 'sample')} skipped as unreadable"] if results.skipped else []
    if results.cut_shards:
        words.append(f"the rest of {plural(results.cut_shards, 'broken shard')} whose size no manifest lists")
    return ", and ".join(words) or "nothing skipped"


def _unscored(args, run: _Prepared, results: EvalResults, warnings: _OneLineWarnings) -> str | None:
    """Why the evaluation gave no number to report (a table of zeros would read as a result), else None."""
    if results.num_samples == 0:  # every shard or image unreadable
        first = f"; first: {warnings.first.removeprefix('eval data: skipped ')}" if warnings.first else ""
        return (
            f"no readable sample in --data {args.data} ({skipped_words(results)}"
            f"{first}); check it with fastclip data scan (shards) or pass another --data"
        )
    return nothing_scored(args, run.specs, run.names_from, results)


def _print_report(args, run: _Prepared, scored: _Scored, warnings: _OneLineWarnings, seconds: float) -> None:
    results, probes, loaded = scored.results, scored.probes, run.loaded
    step = "" if loaded.step is None else f", step {loaded.step}"
    print(f"model {loaded.file} ({loaded.built.arch}{step}); data {args.data}; class names: {run.names_from or 'none'}")
    print(f"{results.num_samples} samples in {seconds:.1f} s")
    if results.zeroshot or results.retrieval or not probes:
        print("\n" + format_table(results, args.per_class).lstrip("\n"))  # one blank line before each table
    if probes:
        print(format_probe_table(probes, scored.probe_where))
        if scored.probe_skipped:
            print(f"({scored.probe_skipped} training samples of the probe skipped as unreadable)")
    if warnings.count:
        print(warnings.said(), file=sys.stderr)
    if run.specs and results.unmatched:
        print(f"\n{results.unmatched} labelled samples belong to no dataset of {run.names_from}: not scored")
    if not run.specs and results.unmatched and not loaded.image_only:  # retrieval was scored; the labels were not
        print(
            f"\nzero-shot skipped: no class names for the {results.unmatched} labelled samples (no zeroshot.json "
            f"beside --data {args.data}); pass --classnames FILE to score them"
        )


def _append_records(args, run: _Prepared, scored: _Scored) -> Path | str:
    """The results' JSON records appended to --results: the file, or what went wrong (the table still stands)."""
    loaded = run.loaded
    common = {
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "checkpoint": str(loaded.file),
        "arch": loaded.built.arch,
        "step": loaded.step,
        "data": str(args.data),
        **({"held_out": False} if run.trained_on is not None else {}),
        **({"max_samples": args.max_samples} if args.max_samples is not None else {}),  # a spot check, said so
        # other prompts than the data's own: a variant (summary keeps the default evaluation as the headline)
        **({"classnames": str(args.classnames)} if args.classnames is not None and not run.own_names else {}),
        **({"templates": str(args.templates)} if args.templates is not None else {}),
    }
    results_file = args.results or default_results_file(loaded.file)
    try:  # (a read-only file, a disk that filled during the evaluation: the table above still stands)
        results_file.parent.mkdir(parents=True, exist_ok=True)
        with open(results_file, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                f.write(b"\n")  # a torn last line (a killed writer) stays one bad line: ours start on their own
            for record in result_records(scored.results, common, scored.probes):
                f.write((json.dumps(record) + "\n").encode())
    except OSError as e:
        return f"--results {results_file}: cannot append ({e.strerror or e})"
    return results_file


if __name__ == "__main__":
    sys.exit(main())
