"""Paired comparisons by seed: Wilcoxon signed-rank and a paired permutation test from scipy.stats, Holm's
adjustment over the comparisons of a table, and samples-to-target from the curves."""

from __future__ import annotations

import math
import statistics

import numpy as np
from scipy import stats as sps


def mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n − 1); None where undefined."""
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def paired(a: dict[int, float], b: dict[int, float]) -> tuple[list[int], np.ndarray]:
    """The seeds both have, and a − b at each, rounded to 1e-9: metrics are recorded to 4 decimals, and the float
    noise of a subtraction (0.55 − 0.53 != 0.38 − 0.36) would rank equal differences apart, not as ties."""
    seeds = sorted(set(a) & set(b))
    return seeds, np.round(np.array([a[s] - b[s] for s in seeds], dtype=float), 9)


def mean_ci95(diffs: np.ndarray) -> list[float] | None:
    """The 95 % interval of the mean paired difference (scipy's one-sample t interval): how large the effect may
    be, beside the tests' p (which only say whether it is 0). None below 2 pairs or when the differences are all
    equal (no spread to estimate)."""
    if len(diffs) < 2 or np.ptp(diffs) == 0:
        return None
    ci = sps.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
    return [float(ci.low), float(ci.high)]


def wilcoxon_p(diffs: np.ndarray) -> float | None:
    """Two-sided Wilcoxon signed-rank p of the paired differences (zeros dropped, tied |d| given their mean rank):
    exact up to 12 pairs, every one of the 2^n sign flips of the ranks (scipy's PermutationMethod; its "exact" method
    assumes no ties; 0.3 s at 10 pairs, doubling per pair), beyond that scipy's own choice (exact without ties, else
    the normal approximation, close by then). None below 2 pairs or when every difference is 0.

    Why not the normal approximation at small n: 3 equal differences of one sign have exact p 0.25 (the smallest
    there is) and approximate p 0.083."""
    if len(diffs) < 2 or not np.any(diffs):
        return None
    method = sps.PermutationMethod(n_resamples=np.inf) if len(diffs) <= 12 else "auto"
    return float(sps.wilcoxon(diffs, alternative="two-sided", method=method).pvalue)


def permutation_p(diffs: np.ndarray) -> float | None:
    """Two-sided paired permutation p of the mean difference (sign flips: every one of the 2^n for n <= 16)."""
    if len(diffs) < 2 or not np.any(diffs):
        return None
    result = sps.permutation_test(
        (diffs,),
        np.mean,
        permutation_type="samples",
        alternative="two-sided",
        n_resamples=np.inf if len(diffs) <= 16 else 20_000,
        random_state=0,
    )
    return float(result.pvalue)


def holm(ps: list[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p-values (None: not tested, left out of the family):
    the k-th smallest of m gets max over j <= k of min(1, (m − j + 1)·p_(j))."""
    tested = sorted((p, i) for i, p in enumerate(ps) if p is not None)
    m, out, running = len(tested), [None] * len(ps), 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def samples_to_reach(curve: list[list[float]], target: float) -> float | None:
    """Samples from which `curve` [[samples, value], ...] reaches `target` and stays there to its end (linear between
    evaluations; an early spike that falls back does not count); the first evaluation's count if it starts there.
    None when the curve ends below `target`."""
    points = [(float(x), float(y)) for x, y in curve if y is not None]
    if not points or points[-1][1] < target:
        return None
    k = len(points) - 1
    while k > 0 and points[k - 1][1] >= target:
        k -= 1
    if k == 0:
        return points[0][0]
    (x0, y0), (x1, y1) = points[k - 1], points[k]
    return x0 + (target - y0) / (y1 - y0) * (x1 - x0)


def mean_curve(curves: list[list[list[float]]]) -> list[list[float]]:
    """The seeds' curves averaged at the sample counts they all have."""
    if not curves:
        return []
    shared = set.intersection(*({x for x, y in c if y is not None} for c in curves))
    by = [dict((x, y) for x, y in c) for c in curves]
    return [[x, statistics.fmean(d[x] for d in by)] for x in sorted(shared)]


def samples_ratio(winner_curves: list, baseline_curves: list) -> float | None:
    """The baseline's samples over the samples the winner needs (mean curves) to reach the baseline's final mean
    value; > 1: the winner gets there with fewer samples. None if the winner never gets there."""
    winner, baseline = mean_curve(winner_curves), mean_curve(baseline_curves)
    if not winner or not baseline:
        return None
    needed = samples_to_reach(winner, baseline[-1][1])
    return None if not needed else baseline[-1][0] / needed


def reached_at_first_evaluation(winner_curves: list, baseline_curves: list) -> bool:
    """Whether the winner's mean curve stands at the baseline's final mean value from its first evaluation on: the
    samples ratio is then the evaluation grid's bound (the baseline's samples over the first evaluation's), and the
    true one at least that."""
    winner, baseline = mean_curve(winner_curves), mean_curve(baseline_curves)
    return bool(winner and baseline) and all(y >= baseline[-1][1] for _, y in winner)


def samples_ratio_ci95(winner: dict[int, list], baseline: dict[int, list], resamples: int = 2000) -> list[float] | None:
    """A 95 % percentile interval of samples_ratio from resampling the paired seeds (each seed's two curves
    together, with replacement; the random draws are seeded, so a report is the same each time). A resample where
    the winner never reaches the baseline's final value counts as ratio 0, so a lower end of 0 says that happens in
    more than 2.5 % of them. None below 2 paired seeds. Rough at few seeds (n seeds give at most C(2n-1, n)
    distinct resamples: 3 at 2, 92,378 at 10). The report's point is samples_ratio over the same paired seeds."""
    seeds = sorted(set(winner) & set(baseline))
    if len(seeds) < 2:
        return None
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(resamples):
        draw = rng.choice(seeds, size=len(seeds), replace=True)
        ratio = samples_ratio([winner[s] for s in draw], [baseline[s] for s in draw])
        ratios.append(ratio or 0.0)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return [float(low), float(high)]


def compare(table: dict[str, dict[int, float]], baseline: str) -> list[dict]:
    """Every objective of a table against `baseline`, paired by seed: mean and std of the difference, seeds, both
    p-values, and Holm over the table's comparisons (Wilcoxon's p, the primary; the permutation p beside)."""
    rows = [
        {"objective": name, "baseline": baseline, **paired_difference(by_seed, table[baseline])}
        for name, by_seed in table.items()
        if name != baseline
    ]
    for row, p in zip(rows, holm([r["p_wilcoxon"] for r in rows])):
        row["p_holm"] = p
    for row, p in zip(rows, holm([r["p_permutation"] for r in rows])):
        row["p_holm_permutation"] = p
    return rows


def paired_difference(a: dict[int, float], b: dict[int, float]) -> dict:
    """a − b on the seeds both have: the seeds, mean and std of the differences, their 95 % interval, the seeds
    where a is ahead, and both p-values."""
    seeds, diffs = paired(a, b)
    mean, std = mean_std(list(diffs))
    return {
        "seeds": seeds,
        "diff_mean": mean,
        "diff_std": std,
        "diff_ci95": mean_ci95(diffs),
        "wins": int(np.sum(diffs > 0)),
        "p_wilcoxon": wilcoxon_p(diffs),
        "p_permutation": permutation_p(diffs),
    }


def contrast(table: dict[str, dict[int, float]], pairs: list[tuple[str, str, str]]) -> list[dict]:
    """Each (question, a, b) whose objectives both have seeds in the table: a − b paired by seed, as `compare`'s
    rows, with Holm over these contrasts (their own family: questions, not rivals of the baseline)."""
    rows = [
        {"question": question, "a": a, "b": b, **paired_difference(table[a], table[b])}
        for question, a, b in pairs
        if table.get(a) and table.get(b) and set(table[a]) & set(table[b])
    ]
    for row, p in zip(rows, holm([r["p_wilcoxon"] for r in rows])):
        row["p_holm"] = p
    return rows


def smallest_wilcoxon_p(n: int) -> float:
    """The smallest two-sided exact Wilcoxon p with n pairs (all differences one sign): 2 / 2^n."""
    return min(1.0, 2.0 / math.pow(2, n))
