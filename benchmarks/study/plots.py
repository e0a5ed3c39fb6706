"""The study's figures, one per table (dataset x batch x length), beside its markdown: left, each objective's mean
test curve over its seeds (band: ± one std across the seeds at each evaluation), the strongest baseline's final mean
as a dashed line and the samples at which each other objective's mean curve reaches it and stays (what the samples
ratio reads; when the winner is that baseline, the runner-up's final mean, dotted, and where the winner reaches it,
as the headline compares them); right, every objective's paired differences with the baseline, one dot per seed."""

from __future__ import annotations

import statistics
from pathlib import Path

from .spec import Spec
from .stats import mean_curve, paired, samples_to_reach


def figure_path(spec: Spec, t: dict) -> Path:
    return spec.report_md.with_name(f"{spec.report_md.stem}_{t['dataset']}_{t['global_batch']}_{t['phase']}.png")


def band(curves: list) -> list[tuple[float, float, float]]:
    """(samples, mean, std) at the sample counts every seed's curve has (std 0 with one seed)."""
    by = [dict((x, y) for x, y in c if y is not None) for c in curves]
    out = []
    for x, mean in mean_curve(curves):
        values = [d[x] for d in by]
        out.append((x, mean, statistics.stdev(values) if len(values) > 1 else 0.0))
    return out


def _final(curves: list) -> float | None:
    """The last point of the seeds' mean curve (None when they share no evaluation)."""
    mean = mean_curve(curves)
    return mean[-1][1] if mean else None


def table_figure(spec: Spec, t: dict, footer: str) -> Path:
    """Draws table `t` (report.summarize's `_tables` entry, with its seeds' curves) to figure_path."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.6, 1]})
    try:
        _draw(spec, t, left, right)
        length = "longer training" if t["phase"] == "long" else "tuned length"
        title = f"{spec.name}: {t['dataset']}, global batch {t['global_batch']}, {t['epochs']} epochs ({length})"
        fig.suptitle(title, fontsize=11)
        fig.text(0.99, 0.005, footer, ha="right", va="bottom", fontsize=7, color="0.35")
        fig.tight_layout(rect=(0, 0.03, 1, 0.95))
        path = figure_path(spec, t)
        # no date or machine in the file: the same runs give the same bytes, so a report changes no figure it redraws
        fig.savefig(path, dpi=110, metadata={"Software": None})
    finally:
        plt.close(fig)
    return path


def _draw(spec: Spec, t: dict, left, right) -> None:
    baseline = t["baseline"]
    order = sorted(t["metric"], key=lambda n: -t["means"][n])
    target = _final(t["curves"][baseline]) if baseline else None
    colour = {}
    for name in order:
        points = band(t["curves"][name])
        if not points:
            continue
        x = [p[0] for p in points]
        mean = [100 * p[1] for p in points]
        std = [100 * p[2] for p in points]
        (line,) = left.plot(x, mean, lw=2 if name in (baseline, t["winner"]) else 1.2, label=name)
        colour[name] = line.get_color()
        left.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                          color=line.get_color(), alpha=0.15, lw=0)  # fmt: skip
        curve = [[x, m] for x, m, _ in points]  # the seeds' mean curve (band's)
        reached = samples_to_reach(curve, target) if target and name != baseline else None
        if reached:
            left.plot([reached], [100 * target], "o", color=line.get_color(), ms=5)
    if target is not None:
        left.axhline(100 * target, color="0.3", ls="--", lw=1, label=f"{baseline}'s final mean")
    others_val = [n for n in order if n != baseline and n in t["val"]]
    # the headline's pair when the winner is the baseline: the winner and the runner-up on val
    runner_up = max(others_val, key=lambda n: t["val"][n]) if baseline == t["winner"] and others_val else None
    second = _final(t["curves"][runner_up]) if baseline and runner_up else None
    if second is not None:
        left.axhline(100 * second, color="0.3", ls=":", lw=1, label=f"{runner_up}'s final mean")
        reached = samples_to_reach(mean_curve(t["curves"][baseline]), second)
        if reached and baseline in colour:
            left.plot([reached], [100 * second], "o", color=colour[baseline], ms=5)
    left.set_xlabel("training samples seen")
    left.set_ylabel(f"test {spec.datasets[t['dataset']].metric} (%)")
    left.legend(fontsize=7, loc="lower right")
    left.grid(alpha=0.3)
    others = [n for n in order if n != baseline]
    for row, name in enumerate(others):
        seeds, diffs = paired(t["metric"][name], t["metric"][baseline])
        right.plot(100 * diffs, [row] * len(diffs), "o", alpha=0.6, ms=4, color=colour.get(name))
        if len(diffs):
            right.plot([100 * diffs.mean()], [row], "k|", ms=14, mew=2)
    right.axvline(0, color="0.3", lw=1)
    right.set_yticks(range(len(others)), others, fontsize=8)
    right.invert_yaxis()
    right.set_xlabel(f"Δ vs {baseline} (points): a dot per seed, bar: mean")
    right.grid(alpha=0.3, axis="x")


def write_figures(spec: Spec, tables: list[dict], commit: str | None) -> list[Path]:
    """A figure per table with a strongest baseline among its tested objectives."""
    footer = f"runs at commit {commit or '–'}; benchmarks/study/plots.py"
    return [table_figure(spec, t, footer) for t in tables if t["baseline"]]
