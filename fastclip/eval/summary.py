"""`fastclip summary RUN [--export FILE] [--plots DIR] [--train-seconds S]`: what a run did, readable at a glance.

From the run folder alone: its resolved config.yaml (loss, model, data, batch), metrics.jsonl (steps, samples,
speed) and checkpoints/results.jsonl (what `fastclip eval` appended: zero-shot per dataset, retrieval, shown only
where the captions are distinct); without the latter, the run's own last evaluation of data.val from
metrics.jsonl. The quickstart ends with it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from fastclip.cli import OneLineParser
from fastclip.eval import records
from fastclip.eval.retrieval import DEFAULT_KS, DIRECTIONS, recall_name

RUN_FOLDER = "pass the folder fastclip train wrote"
FIX_LINE = "fix or delete that line"


def _shown(value) -> str:
    """A JSON value as the file has it, short enough for one line."""
    text = json.dumps(value)
    return text if len(text) <= 30 else text[:27] + "..."


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # NaN included: the trainer logs it


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_text(path: Path, advice: str) -> str:
    """The file's text; a binary or foreign file is named, not decoded into a codec error."""
    try:
        return path.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a text file (byte {err.start} is not UTF-8); {advice}") from None


def _rows(path: Path, unreadable: list[str], problem: Callable[[dict], str | None], advice: str) -> list[dict]:
    """The JSON objects of a .jsonl file; lines that are not one are left out and named in `unreadable`, except
    a cut last line (a run still being written, as `fastclip plot` reads it). An object that `problem` finds
    wrong (a field of the wrong type: edited or foreign, not a crash) is refused, naming its line."""
    if not path.is_file():
        return []
    rows, bad = [], []
    text = _read_text(path, advice)
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            if (wrong := problem(row)) is not None:
                raise ValueError(f"{path}:{number}: {wrong}; {FIX_LINE}")
            rows.append(row)
        elif not (number == len(lines) and number > 1 and not text.endswith("\n")):
            bad.append(number)
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
        unreadable.append(f"{path.name}: {len(bad)} unreadable line{'s' if len(bad) > 1 else ''} skipped ({shown})")
    return rows


# metrics.jsonl fields the summary reads. All optional (a record holds some of them; one missing is shown as
# "–" or left out), but where present they are what the trainer writes, or the arithmetic below breaks.
METRIC_COUNTS = (
    "step",
    "samples_seen",
    "data_skipped",
    "data_wrapped",
    "data_remote_retries",
    "data_remote_shards_skipped",
)
METRIC_NUMBERS = ("step_time", "samples_per_s", "samples_per_s_per_rank")


def _metrics_problem(row: dict) -> str | None:
    for key, value in row.items():
        if (key in METRIC_COUNTS or key.startswith("data_skipped/")) and not _is_count(value):
            return f"{key} is {_shown(value)}, not a count"
        if key in METRIC_NUMBERS and not _is_number(value):
            return f"{key} is {_shown(value)}, not a number"
    return None


COUNT, NUMBER = (_is_count, "a count"), (_is_number, "a number")


def _results_problem(row: dict) -> str | None:
    """What `fastclip eval` writes and the summary shows: the task, and per task the values printed. Rows of
    other tasks are passed over (a newer eval may add some)."""
    task = row.get("task")
    if not isinstance(task, str):
        return "no task" if task is None else f"task is {_shown(task)}, not a name"
    step = row.get("step")
    if step is not None and not _is_count(step):  # null: a model file evaluated outside a run
        return f"step is {_shown(step)}, not a count"
    if task in records.PER_DATASET:
        if not isinstance(row.get("dataset"), str):
            return f"dataset is {_shown(row.get('dataset'))}, not a name"
        fields = {"num_samples": COUNT, "top1": NUMBER, **({"k": COUNT} if task == records.KNN else {})}
    elif task == records.RETRIEVAL:
        fields = {"num_samples": COUNT, **dict.fromkeys(records.RETRIEVAL_KEYS, NUMBER)}
        if "distinct_captions" in row:  # older evaluations did not count them: shown as before
            fields["distinct_captions"] = COUNT
        if "num_images" in row:  # several captions per image (json "group"); num_samples counts the captions
            fields["num_images"] = COUNT
    else:
        return None
    for key, (fits, kind) in fields.items():
        if not fits(row.get(key)):
            return f"no {key}" if key not in row else f"{key} is {_shown(row[key])}, not {kind}"
    return None


def _config(run: Path) -> dict:
    """config.yaml as the trainer resolves it: a mapping of sections. Anything else is not a run's config."""
    path = run / "config.yaml"
    if not os.path.lexists(run):
        raise FileNotFoundError(f"{run}: not found; {RUN_FOLDER}")
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no config.yaml (not a fastclip run folder); {RUN_FOLDER}")
    cfg = yaml.safe_load(_read_text(path, RUN_FOLDER))
    if not isinstance(cfg, dict):
        kind = "holds nothing" if cfg is None else f"holds a {'list' if isinstance(cfg, list) else 'single value'}"
        raise ValueError(f"{path}: {kind} instead of the run's settings (model, loss, data, ...); {RUN_FOLDER}")
    return cfg


def _setting(cfg: dict, dotted: str):
    """A config value the summary only shows: one missing or not a single value (a config from an older
    fastclip, or edited) is shown as "–", since the steps and results below are still worth reading."""
    value = cfg
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None


def _is_ssl(cfg: dict) -> bool:
    """Whether the run trained an image tower alone (ssl.enabled true)."""
    ssl = cfg.get("ssl")
    return isinstance(ssl, dict) and ssl.get("enabled") is True


def _shown_setting(cfg: dict, dotted: str) -> str:
    value = _setting(cfg, dotted)
    return "–" if value is None else str(value)


def _data_line(rows: list[dict]) -> str | None:
    """The loader's running totals in the last record holding them: samples skipped (by reason), re-served, and
    remote shards' retries and shards skipped as unreadable."""
    last = next((r for r in reversed(rows) if "data_skipped" in r), None)
    remote = ("data_remote_retries", "data_remote_shards_skipped")
    if last is None or not any(last.get(k) for k in ("data_skipped", "data_wrapped", *remote)):
        return None
    reasons = ", ".join(f"{k.split('/', 1)[1]} {v:,}" for k, v in sorted(last.items()) if k.startswith("data_skipped/"))
    return (
        f"  data       {last.get('data_skipped', 0):,} samples skipped"
        + (f" ({reasons})" if reasons else "")
        + f", {last.get('data_wrapped', 0):,} served again to fill batches (counted in samples and epochs above)"
        + (
            f"; remote shards: {last[remote[0]]:,} retries, {last.get(remote[1], 0):,} skipped as unreadable"
            if remote[0] in last
            else ""
        )
    )


def _rate(value) -> bool:
    """A speed worth showing: a logged window that took time (NaN where none did)."""
    return _is_number(value) and math.isfinite(value) and value > 0


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def _training_seconds(train_rows: list[dict]) -> float:
    """Steps only (evaluations and checkpoints excluded): each logged window's steps times its step_time."""
    total, previous = 0.0, 0
    for row in train_rows:
        total += (row["step"] - previous) * row.get("step_time", 0.0)
        previous = row["step"]
    return total


def _num_samples(spec: str) -> int | None:
    try:
        from fastclip.data import resolve_catalog

        return resolve_catalog(spec).num_samples
    except Exception:  # noqa: BLE001 - the data may have moved since; the summary then leaves the count out
        return None


def _probe_lines(latest: dict, step: int, where: str = "") -> list[str]:
    """Per dataset: the linear probe's and each kNN k's top-1 (fastclip eval --linear-probe --knn K)."""
    datasets = sorted({d for (task, d, _) in latest if task in (records.LINEAR_PROBE, records.KNN)})
    width = max((len(d) for d in datasets), default=0)
    lines = []
    for i, dataset in enumerate(datasets):
        parts = []
        if (linear := latest.get((records.LINEAR_PROBE, dataset, None))) is not None:
            parts.append(f"linear {100 * linear['top1']:5.1f}%")
        knn = sorted(
            (r for (task, d, _), r in latest.items() if task == records.KNN and d == dataset), key=lambda r: r["k"]
        )
        parts += [f"kNN k={r['k']} {100 * r['top1']:5.1f}%" for r in knn]
        shown = linear or knn[0]
        lines.append(
            f"  {'probes' if i == 0 else '':<10} {dataset:<{width}}  {', '.join(parts)}  ({shown['num_samples']:,} "
            f"{_kind(shown)} images{where}, frozen {shown.get('features', 'image')} features, step {step})"
        )
    return lines


def summarize(
    run: str | Path,
    *,
    export: str | Path | None = None,
    plots: str | Path | None = None,
    train_seconds: float | None = None,
) -> str:
    run = Path(run)
    cfg = _config(run)
    unreadable: list[str] = []
    rows, train_rows = _logged_rows(run, unreadable)
    lines = [f"summary of {run}", *_training_lines(cfg, rows, train_rows, train_seconds)]
    results_advice = f"move it aside and run fastclip eval {run} --data DIR again"
    results = _rows(run / "checkpoints" / "results.jsonl", unreadable, _results_problem, results_advice)
    newest = max((r.get("step") or 0 for r in results), default=0)  # what _result_lines shows
    held_out = [r for r in results if (r.get("step") or 0) == newest and r.get("held_out") is not False]
    if results:
        lines += _result_lines(results)
    during = [] if held_out else _training_eval_lines(rows)  # the run's own last evaluation of data.val, where
    lines += during  # `fastclip eval` has not scored held-out data yet (none, or only shards it trained on)
    if not results and not during:
        if _is_ssl(cfg):  # an image tower alone: kNN during training, or its export's probes
            lines.append(
                f"  kNN        not evaluated yet: fastclip eval {run} --data DIR --linear-probe --knn 20 (or train "
                "with a labelled data.val and eval.at_end)"
            )
        else:
            lines.append(f"  zero-shot  not evaluated yet: fastclip eval {run} --data DIR")
    lines += _file_lines(run, plots, export)
    lines += [f"  note       {line}" for line in unreadable]
    return "\n".join(lines)


def _logged_rows(run: Path, unreadable: list[str]) -> tuple[list[dict], list[dict]]:
    """(every record of metrics.jsonl, those of training steps); a run without one step logged is refused."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        said = "not a file" if metrics.exists() else "missing"
        raise FileNotFoundError(f"{metrics}: {said}; pass a run folder that fastclip train has logged steps into")
    rows = _rows(metrics, unreadable, _metrics_problem, RUN_FOLDER)
    train_rows = [r for r in rows if "loss" in r and "step" in r]
    if not train_rows:
        raise ValueError(
            f"{metrics}: no training steps logged (no line with step and loss); summarize the run once fastclip "
            "train has logged one (every train.log_every steps)"
        )
    return rows, train_rows


def _training_lines(cfg: dict, rows: list[dict], train_rows: list[dict], train_seconds: float | None) -> list[str]:
    """What was trained on what, how far (steps, samples, epochs, batch, processes), the loader's skips, the time."""
    last = train_rows[-1]
    speeds = sorted(r["samples_per_s"] for r in train_rows if _rate(r.get("samples_per_s")))
    per_rank = [
        r["samples_per_s"] / r["samples_per_s_per_rank"]
        for r in train_rows
        if _rate(r.get("samples_per_s")) and _rate(r.get("samples_per_s_per_rank"))
    ]
    processes = round(per_rank[-1]) if per_rank else None
    layouts = sorted({round(x) for x in per_rank})  # more than one: resumed at another world size
    train_data = _setting(cfg, "data.train")
    pairs = _num_samples(train_data) if isinstance(train_data, str) else None

    pretrained = _setting(cfg, "model.pretrained")
    start = f"from {pretrained}" if pretrained else "random init"
    unit = "images" if _is_ssl(cfg) else "pairs"  # ssl: image tower + projector alone
    what = (
        f"{_shown_setting(cfg, 'loss.name')} on {_shown_setting(cfg, 'model.arch')} ({start}), "
        f"{_shown_setting(cfg, 'data.train')}" + (f" ({pairs:,} {unit})" if pairs else "")
    )
    lines = [f"  trained    {what}"]
    seen = last.get("samples_seen")  # missing (a hand-cut file): "–", and no epochs
    epochs = seen / pairs if pairs and seen is not None else None
    lines.append(
        f"             {last['step']} steps, {'–' if seen is None else f'{seen:,}'} samples"
        + (f" ({epochs:.1f} epochs)" if epochs else "")
        + f", batch {_shown_setting(cfg, 'data.batch_size')} per process"
        + (f" x {processes} process{'es' if processes > 1 else ''}" if processes else "")
        + (f" (at the end; {', '.join(map(str, layouts))} over the run)" if len(layouts) > 1 else "")
    )
    if (data_line := _data_line(rows)) is not None:
        lines.append(data_line)
    seconds = train_seconds if train_seconds is not None else _training_seconds(train_rows)
    lines.append(
        f"  time       {_duration(seconds)} training"
        + (f", median {statistics.median(speeds):.0f} samples/s" if speeds else "")
    )
    return lines


def _prompts(record: dict) -> str:
    """ ", --templates FILE" (and --classnames) for an evaluation with other prompts than the data's own, else ""."""
    return "".join(f", --{flag} {record[flag]}" for flag in ("classnames", "templates") if record.get(flag))


def _result_lines(results: list[dict]) -> list[str]:
    """The last evaluation of the newest checkpoint on each data it was evaluated on (named when there are several,
    e.g. a test and a novel split): zero-shot per dataset, the probes, retrieval."""
    newest = max(r.get("step") or 0 for r in results)
    by_data: dict = {}  # data -> the last record per task, dataset (and k), in the order the data were evaluated
    for r in results:
        if (r.get("step") or 0) == newest:
            data = os.path.normpath(r["data"]) if isinstance(r.get("data"), str) else None  # older files: none
            latest = by_data.setdefault(data, {})
            key = (r["task"], r.get("dataset"), r.get("k"))
            if "max_samples" in r and key in latest and "max_samples" not in latest[key]:
                continue  # a --max-samples spot check after the full evaluation: the full one stays the headline
            if _prompts(r) and key in latest and not _prompts(latest[key]):
                continue  # --templates / --classnames after the data's own prompts: the default stays the headline
            latest[key] = r
    lines = []
    for data, latest in by_data.items():
        where = "" if len(by_data) == 1 else f" of {data}" if data else " of data not recorded"
        zeroshot = [r for (task, _, _), r in latest.items() if task == records.ZEROSHOT]
        width = max((len(r["dataset"]) for r in zeroshot), default=0)
        lines += [
            f"  {'zero-shot' if i == 0 else '':<10} {r['dataset']:<{width}}  {100 * r['top1']:5.1f}% top-1"
            f"  ({r['num_samples']:,} {_kind(r)} images{where}, step {newest}{_prompts(r)})"
            for i, r in enumerate(zeroshot)
        ]
        lines += _probe_lines(latest, newest, where)
        retrieval = latest.get((records.RETRIEVAL, None, None))
        if retrieval is not None:
            lines.append(_retrieval_line(retrieval, where))
    return lines


def _training_eval_lines(rows: list[dict]) -> list[str]:
    """The run's own last evaluation (metrics.jsonl's eval/zeroshot/<dataset>/* and eval/retrieval/*, written by
    the trainer's eval.every_steps or eval.at_end), shown as fastclip eval's results are."""
    prefixes = ("eval/zeroshot/", "eval/retrieval/", "eval/knn_top1")
    last = next((r for r in reversed(rows) if any(k.startswith(prefixes) for k in r)), None)
    if last is None:
        return []
    step, where = last.get("step"), ", the run's own evaluation"
    if _is_number(knn := last.get("eval/knn_top1")):  # ssl: leave-one-out kNN over data.val's labelled images
        n = last.get("eval/knn_samples")
        images = f"{int(n):,} held-out images" if _is_number(n) else "held-out images"
        return [f"  kNN        {100 * knn:5.1f}% top-1  ({images}, leave-one-out{where}, step {step})"]
    zeroshot = sorted(
        (k.removeprefix("eval/zeroshot/").removesuffix("/top1"), v)
        for k, v in last.items()
        if k.startswith("eval/zeroshot/") and k.endswith("/top1") and _is_number(v)
    )
    width = max((len(d) for d, _ in zeroshot), default=0)
    lines = []
    for i, (dataset, top1) in enumerate(zeroshot):
        n = last.get(f"eval/zeroshot/{dataset}/num_samples")
        images = f"{int(n):,} held-out images" if _is_number(n) else "held-out images"
        lines.append(
            f"  {'zero-shot' if i == 0 else '':<10} {dataset:<{width}}  {100 * top1:5.1f}% top-1  ({images}{where}, "
            f"step {step})"
        )
    retrieval = {k.removeprefix("eval/retrieval/"): v for k, v in last.items() if k.startswith("eval/retrieval/")}
    names = [recall_name(d, k) for d in DIRECTIONS for k in DEFAULT_KS]
    # shown as fastclip eval shows it: only where the captions are known to be distinct (older runs did not log
    # their count: templated captions would give numbers that mean nothing)
    counts = ("num_samples", "distinct_captions")
    if all(_is_number(retrieval.get(n)) for n in (*names, *counts)):
        retrieval.update({n: int(retrieval[n]) for n in counts})
        lines.append(_retrieval_line(retrieval, f"{where}, step {step}"))
    return lines


def _retrieval_line(retrieval: dict, where: str = "") -> str:
    n, distinct = retrieval["num_samples"], retrieval.get("distinct_captions")
    if distinct is not None and not records.retrieval_reported(distinct, n):
        return f"  retrieval  not reported: {distinct} distinct captions for {n:,} images{where} (templated)"
    values = {d: "/".join(f"{100 * retrieval[recall_name(d, k)]:.1f}" for k in DEFAULT_KS) for d in DIRECTIONS}
    images = retrieval.get("num_images")
    of = f"{n:,} pairs" if images is None else f"{n:,} captions of {images:,} images"
    trained = ", training data" if retrieval.get("held_out") is False else ""
    return (
        f"  retrieval  R@1/5/10 image->text {values['image_to_text']}%, text->image {values['text_to_image']}%  "
        f"({of}{where}{trained})"
    )


def _kind(result: dict) -> str:
    """What `fastclip eval` scored: held-out images, or (its note said so) shards the run trained on."""
    return "training" if result.get("held_out") is False else "held-out"


def _file_lines(run: Path, plots: str | Path | None, export: str | Path | None) -> list[str]:
    """Where the run's files, its plots and its exported model are."""
    contents = [
        name
        for name in ("config.yaml", "metrics.jsonl", "checkpoints/", "tensorboard/")
        if (run / name.rstrip("/")).exists()
    ]
    lines = [f"  run        {run}/ ({', '.join(contents)})"]
    if plots is not None:
        plot = Path(plots) / "overview.png"
        lines.append(
            f"  plots      {plot} (loss, objective, temperature, zero-shot accuracy)"
            if plot.is_file()
            else f"  plots      none in {plots}"
        )
    if export is not None:
        export = Path(export)
        configs = sorted(p.name for p in export.parent.glob("*.json"))
        lines.append(
            f"  model      {export}"
            + (f" + {configs[0]}" if len(configs) == 1 else "")
            + " (open_clip.create_model_and_transforms(arch, pretrained=file) loads it)"
            if export.is_file()
            else f"  model      not exported ({export} missing)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="fastclip summary", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run folder (config.yaml, metrics.jsonl)")
    parser.add_argument("--export", help="exported model file to point to")
    parser.add_argument("--plots", help="folder written by fastclip plot")
    parser.add_argument("--train-seconds", type=float, help="wall time of training (default: sum of step times)")
    args = parser.parse_args(argv)
    if args.train_seconds is not None and not 0 <= args.train_seconds < float("inf"):
        parser.error(f"argument --train-seconds: {args.train_seconds:g} must be a number of seconds >= 0")
    try:
        print(summarize(args.run, export=args.export, plots=args.plots, train_seconds=args.train_seconds))
    except BrokenPipeError:  # the reader of stdout is gone: fastclip's dispatcher ends it quietly
        raise
    except (OSError, ValueError, KeyError, yaml.YAMLError) as err:  # a run folder typed wrong: a usage error
        if isinstance(err, yaml.YAMLError):
            problem = getattr(err, "problem", None) or err
            err = f"{Path(args.run) / 'config.yaml'}: not valid YAML ({problem}); {RUN_FOLDER}"
        print(f"fastclip summary: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
