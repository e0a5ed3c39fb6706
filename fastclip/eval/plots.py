"""`fastclip plot RUN_DIR [RUN_DIR ...] --out DIR`: training curves against samples seen, as PNG.

Reads each run's metrics.jsonl (training rows: step, samples_seen, loss, objective, tau, ...; eval rows:
step plus `eval/<name>` values) and draws loss, estimated objective, temperature and zero-shot top-1
accuracy, every run on the same axes so runs compare side by side; plus overview.png with all four panels.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fastclip.cli import OneLineParser

METRICS_FILE = "metrics.jsonl"


@dataclass
class Run:
    label: str
    file: Path | None = None
    rows: list[dict] = field(default_factory=list)

    def _step_to_samples(self):
        """Eval rows may carry only `step`: place them by the training rows' step -> samples_seen."""
        known = sorted(
            {(r["step"], r["samples_seen"]) for r in self.rows if _num(r.get("step")) and _num(r.get("samples_seen"))}
        )
        if not known:
            return None
        steps, samples = zip(*known)

        def convert(step):
            import numpy as np

            return float(np.interp(step, steps, samples))  # beyond the ends: clamped, fine for the last eval

        return convert

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(x, y) for `key` with x = samples seen (or step when the run logs no samples_seen)."""
        convert = self._step_to_samples()
        xs, ys = [], []
        for row in self.rows:
            y = row.get(key)
            if not _num(y):
                continue
            if _num(row.get("samples_seen")):
                x = row["samples_seen"]
            elif _num(row.get("step")):
                x = convert(row["step"]) if convert else row["step"]
            else:
                continue
            xs.append(float(x))
            ys.append(float(y))
        return xs, ys

    @property
    def x_label(self) -> str:
        return "samples seen" if any(_num(r.get("samples_seen")) for r in self.rows) else "step"

    def keys(self) -> set[str]:
        return {k for row in self.rows for k in row}

    def plottable(self) -> bool:
        """Whether any panel would draw a point of this run."""
        keys = [key for *_, key in PANELS if key is not None] + zeroshot_keys([self])
        return any(self.series(key)[0] for key in keys)


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _not_metrics(file: Path, why: str) -> ValueError:
    return ValueError(f"{file}: not a {METRICS_FILE} ({why}); pass a run directory or its {METRICS_FILE}")


def load_run(path: str | Path) -> Run:
    path = Path(path)
    file = path if path.is_file() else path / METRICS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no metrics file (pass a run directory holding {METRICS_FILE})")
    run = Run(label=(path.parent.name if path.is_file() else path.name) or str(path), file=file)
    try:
        with open(file) as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    if line_no > 1 and not line.endswith("\n"):
                        break  # a run still being written: its last line may be cut
                    if line_no == 1 and file.name != METRICS_FILE:  # not JSON from the start: some other file
                        raise _not_metrics(file, f"line 1 is not JSON: {err}") from None
                    raise ValueError(f"{file}:{line_no}: invalid JSON ({err}); fix or delete that line") from err
                if not isinstance(row, dict):
                    raise ValueError(f"{file}:{line_no}: expected a JSON object per line; fix or delete that line")
                run.rows.append(row)
    except UnicodeDecodeError as err:  # a checkpoint or other binary passed as a run
        raise _not_metrics(file, f"byte {err.start} is not text") from None
    return run


def _nothing_to_plot(run: Run) -> str:
    return f"{run.file} ({'empty' if not run.rows else 'no loss, objective, tau or eval/.../top1 values'})"


def _unique_labels(runs: list[Run], paths: list[Path]) -> None:
    labels = [r.label for r in runs]
    for run, path in zip(runs, paths):
        if labels.count(run.label) > 1:
            run.label = str(path)


def zeroshot_keys(runs: list[Run]) -> list[str]:
    keys = set().union(*(r.keys() for r in runs))
    # every held-out top-1: zero-shot per dataset, the probes', and an ssl run's leave-one-out kNN (eval/knn_top1)
    return sorted(
        k for k in keys if (k.startswith("eval/") and k.endswith("/top1") and "mean" not in k) or k == SSL_KNN
    )


SSL_KNN = "eval/knn_top1"


# (file stem, title, y label, metrics.jsonl key or None for the zero-shot panel)
PANELS = [
    ("loss", "training loss", "loss", "loss"),
    ("objective", "estimated objective", "objective", "objective"),
    ("temperature", "temperature", "tau", "tau"),
    ("zeroshot_top1", "zero-shot top-1 accuracy", "top-1 accuracy", None),
]


def panel_title(runs: list[Run], title: str, key: str | None) -> str:
    """The panel's title: the top-1 panel says "zero-shot" only when every curve in it is a zero-shot one (an ssl
    run's is leave-one-out kNN, a probe's a classifier trained on features)."""
    if key is None and any(not k.startswith("eval/zeroshot/") for k in zeroshot_keys(runs)):
        return "held-out top-1 accuracy"
    return title


def _draw(ax, runs: list[Run], key: str | None) -> bool:
    """Draw one panel; False if no run has the metric."""
    import itertools

    drew = False
    colours = [f"C{i % 10}" for i in range(len(runs))]
    if key is not None:
        for run, colour in zip(runs, colours):
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, ys, color=colour, label=run.label, linewidth=1.2)
                drew = True
    else:
        styles = itertools.cycle(["-", "--", ":", "-."])
        for metric, style in zip(zeroshot_keys(runs), styles):
            dataset = metric.removeprefix("eval/").removeprefix("zeroshot/").removesuffix("/top1")
            dataset = "kNN, leave-one-out" if metric == SSL_KNN else dataset
            for run, colour in zip(runs, colours):
                xs, ys = run.series(metric)
                if xs:
                    label = dataset if len(runs) == 1 else f"{run.label}: {dataset}"
                    colour_or_cycle = colour if len(runs) > 1 else None  # one run: a colour per dataset
                    ax.plot(xs, ys, style, color=colour_or_cycle, marker="o", markersize=3, label=label)
                    drew = True
    return drew


def _out_folder(out_dir: Path) -> None:
    """--out, created; where it cannot be (/proc, no permission) is said in the flag's words."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {out_dir}: cannot create it ({err.strerror or err}); choose another --out") from None


def _save(figure, file: Path, dpi: int) -> None:
    try:
        figure.savefig(file, dpi=dpi)
    except OSError as err:  # a folder it may not write to, or a full disk
        raise ValueError(
            f"--out {file.parent}: cannot write {file.name} ({err.strerror or err}); choose another --out"
        ) from None


def plot_runs(run_paths: list[str | Path], out_dir: str | Path, notes: list[str] | None = None) -> list[Path]:
    """The PNG files written; runs with nothing to draw are left out and named in `notes`, unless all are."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    paths = [Path(p) for p in run_paths]
    runs = [load_run(p) for p in paths]
    _unique_labels(runs, paths)
    drawn, empty = [], []
    for run in runs:
        (drawn if run.plottable() else empty).append(run)
    if not drawn:  # a blank overview.png would look like a plot of a run that went nowhere
        raise ValueError(
            f"nothing to plot in {', '.join(map(_nothing_to_plot, empty))}; plot the run once fastclip train has "
            "logged a step (every train.log_every steps)"
        )
    if notes is not None:
        notes += [f"nothing to plot in {_nothing_to_plot(run)}: left out" for run in empty]
    runs = drawn
    x_label = runs[0].x_label if all(r.x_label == runs[0].x_label for r in runs) else "samples seen (or step)"
    out_dir = Path(out_dir)
    _out_folder(out_dir)
    written = []

    overview, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    for (stem, title, y_label, key), ax_overview in zip(PANELS, axes.flat):
        title = panel_title(runs, title, key)
        fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
        for axis in (ax, ax_overview):
            if _draw(axis, runs, key):
                axis.set(title=title, xlabel=x_label, ylabel=y_label)
                axis.grid(alpha=0.3)
                axis.legend(fontsize=8)
            else:
                axis.set_title(f"{title}: not logged")
                axis.set_axis_off()
        if ax.has_data():
            _save(fig, out_dir / f"{stem}.png", dpi=120)
            written.append(out_dir / f"{stem}.png")
        plt.close(fig)
    overview.suptitle(", ".join(r.label for r in runs))
    _save(overview, out_dir / "overview.png", dpi=100)
    plt.close(overview)
    written.append(out_dir / "overview.png")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="fastclip plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl) or metrics.jsonl files")
    parser.add_argument("--out", required=True, help="folder for the PNG files")
    args = parser.parse_args(argv)
    if not args.out:  # Path("") is the current directory: the PNGs would land wherever the shell stands
        parser.error("argument --out: empty; pass the folder for the PNG files")
    from fastclip.data.cli import out_folder_problem

    if problem := out_folder_problem("--out", args.out):
        print(f"fastclip plot: {problem}", file=sys.stderr)
        return 2
    notes: list[str] = []
    try:
        written = plot_runs(args.runs, args.out, notes)
    except BrokenPipeError:  # the reader of stdout is gone: fastclip's dispatcher ends it quietly
        raise
    except (OSError, ValueError) as err:  # a run folder or --out typed wrong: a usage error
        print(f"fastclip plot: {err}", file=sys.stderr)
        return 2
    missing = {stem for stem, *_ in PANELS} - {p.stem for p in written}
    for path in written:
        print(f"wrote {path}")
    if missing:
        print(f"not logged by any run: {', '.join(sorted(missing))}")
    for note in notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
