"""`fastclip summary RUN [--export FILE] [--plots DIR] [--train-seconds S]`: what a run did, readable at a glance.

From the run folder alone: its resolved config.yaml (loss, model, data, batch), metrics.jsonl (steps, samples,
speed) and checkpoints/results.jsonl (what `fastclip eval` appended: zero-shot per dataset, retrieval, shown only
where the captions are distinct). The quickstart ends with it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from fastclip.cli import OneLineParser


def _rows(path: Path, unreadable: list[str]) -> list[dict]:
    """The JSON objects of a .jsonl file; lines that are not one are left out and named in `unreadable`, except
    a cut last line (a run still being written, as `fastclip plot` reads it)."""
    if not path.is_file():
        return []
    rows, bad = [], []
    text = path.read_text()
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif not (number == len(lines) and number > 1 and not text.endswith("\n")):
            bad.append(number)
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
        unreadable.append(f"{path.name}: {len(bad)} unreadable line{'s' if len(bad) > 1 else ''} skipped ({shown})")
    return rows


def _data_line(rows: list[dict]) -> str | None:
    """The loader's running totals in the last record holding them: samples skipped (by reason) and re-served."""
    last = next((r for r in reversed(rows) if "data_skipped" in r), None)
    if last is None or not (last.get("data_skipped") or last.get("data_wrapped")):
        return None
    reasons = ", ".join(f"{k.split('/', 1)[1]} {v:,}" for k, v in sorted(last.items()) if k.startswith("data_skipped/"))
    return (
        f"  data       {last.get('data_skipped', 0):,} samples skipped"
        + (f" ({reasons})" if reasons else "")
        + f", {last.get('data_wrapped', 0):,} served again to fill batches (counted in samples and epochs above)"
    )


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


def summarize(
    run: str | Path,
    *,
    export: str | Path | None = None,
    plots: str | Path | None = None,
    train_seconds: float | None = None,
) -> str:
    from fastclip.eval.cli import MIN_DISTINCT_CAPTIONS

    run = Path(run)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"{run}: no config.yaml (not a fastclip run folder)")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    unreadable: list[str] = []
    rows = _rows(run / "metrics.jsonl", unreadable)
    train_rows = [r for r in rows if "loss" in r and "step" in r]
    if not train_rows:
        raise ValueError(f"{run}/metrics.jsonl: no training steps logged")
    last = train_rows[-1]
    speeds = sorted(r["samples_per_s"] for r in train_rows if r.get("samples_per_s"))
    per_rank = [r["samples_per_s"] / r["samples_per_s_per_rank"] for r in train_rows if r.get("samples_per_s_per_rank")]
    processes = round(per_rank[-1]) if per_rank else None
    data = cfg["data"]
    pairs = _num_samples(data["train"])

    lines = [f"summary of {run}"]
    start = f"from {cfg['model']['pretrained']}" if cfg["model"].get("pretrained") else "random init"
    what = f"{cfg['loss']['name']} on {cfg['model']['arch']} ({start}), {data['train']}" + (
        f" ({pairs:,} pairs)" if pairs else ""
    )
    lines.append(f"  trained    {what}")
    epochs = last["samples_seen"] / pairs if pairs else None
    lines.append(
        f"             {last['step']} steps, {last['samples_seen']:,} samples"
        + (f" ({epochs:.1f} epochs)" if epochs else "")
        + f", batch {data['batch_size']} per process"
        + (f" x {processes} process{'es' if processes > 1 else ''}" if processes else "")
    )
    if (data_line := _data_line(rows)) is not None:
        lines.append(data_line)
    seconds = train_seconds if train_seconds is not None else _training_seconds(train_rows)
    lines.append(
        f"  time       {_duration(seconds)} training"
        + (f", median {speeds[len(speeds) // 2]:.0f} samples/s" if speeds else "")
    )

    results = _rows(run / "checkpoints" / "results.jsonl", unreadable)
    if results:
        newest = max(r.get("step") or 0 for r in results)
        latest = {}
        for r in results:  # the last evaluation of the newest checkpoint, one record per task and dataset
            if (r.get("step") or 0) == newest:
                latest[(r["task"], r.get("dataset"))] = r
        zeroshot = [r for (task, _), r in latest.items() if task == "zeroshot_classification"]
        width = max((len(r["dataset"]) for r in zeroshot), default=0)
        for i, r in enumerate(zeroshot):
            lines.append(
                f"  {'zero-shot' if i == 0 else '':<10} {r['dataset']:<{width}}  {100 * r['top1']:5.1f}% top-1"
                f"  ({r['num_samples']:,} held-out images, step {newest})"
            )
        retrieval = latest.get(("retrieval", None))
        if retrieval is not None:
            distinct = retrieval.get("distinct_captions")
            if distinct is not None and distinct < MIN_DISTINCT_CAPTIONS * retrieval["num_samples"]:
                lines.append(
                    f"  retrieval  not reported: {distinct} distinct captions for {retrieval['num_samples']:,}"
                    f" images (templated)"
                )
            else:
                values = {
                    d: "/".join(f"{100 * retrieval[f'{d}_R@{k}']:.1f}" for k in (1, 5, 10))
                    for d in ("image_to_text", "text_to_image")
                }
                lines.append(
                    f"  retrieval  R@1/5/10 image->text {values['image_to_text']}%, text->image "
                    f"{values['text_to_image']}%  ({retrieval['num_samples']:,} pairs)"
                )
    else:
        lines.append(f"  zero-shot  not evaluated yet: fastclip eval {run} --data DIR")

    contents = [
        name
        for name in ("config.yaml", "metrics.jsonl", "checkpoints/", "tensorboard/")
        if (run / name.rstrip("/")).exists()
    ]
    lines.append(f"  run        {run}/ ({', '.join(contents)})")
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
    lines += [f"  note       {line}" for line in unreadable]
    return "\n".join(lines)


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
            err = f"{Path(args.run) / 'config.yaml'}: not valid YAML ({getattr(err, 'problem', None) or err})"
        print(f"fastclip summary: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
