"""Where do FastCLIP's learned and individual temperatures help? FastCLIP-v1 (one constant τ, tuned), v3 (one τ
learned through ρ) and v2 (a τ per sample, learned through ρ) on balanced and on long-tailed training data. All
three keep the same u (γ 0.8): they differ by how τ is set, which is what this compares.

    python benchmarks/bench_tau_regimes.py          # -> results/tau_regimes.{json,md,png}; resumes (out/tau_regimes)
    python benchmarks/bench_tau_regimes.py --quick  # CI smoke (tiny sizes) -> benchmarks/out/tau_regimes_quick

The regime the theory names: iSogCLR gives each sample its own τ because data with imbalanced semantics wants
different temperatures for frequent and rare content. The proxy of bench_u_regimes.py (the study's scenes-semantic
scenes at 32 px, captions as multi-hot vectors, MLP towers, fastclip's losses in a plain loop, global batch 32,
one process) with N = 4,000 training pairs drawn from 64,000 scenes, 64,000 samples per run (16 visits per
sample):
- balanced: the first 4,000 scenes (every glyph class about equally often);
- long-tailed: 4,000 scenes drawn without replacement with weights from a Zipf law over the 20 classes (weight
  1/(rank + 1)^ZIPF_S of a scene's rarest class, the classes ranked by a fixed random order), as many scenes of
  1, 2 and 3 objects as the balanced draw has (so the regime changes which classes are seen, not how crowded the
  scenes are): a few classes fill most scenes and ten are rare.
Held-out scenes, the same balanced 2,000 for both: the first 1,000 are val (the choice), the other 1,000 test (the
tables). R@1 is the mean of both directions; tail R@1 the same over the test scenes whose classes are all among the
ten rarest of the long-tailed draw (queries among them, candidates all 1,000).

Protocol: per (regime, objective) 12 settings (v1: τ {0.07, 0.1, 0.14, 0.2}; v3 and v2: ρ = {0.1, 0.2, 0.4,
0.6}·ln(B − 1), τ from 0.07) x lr {1e-4, 3e-4, 1e-3}, chosen on val R@1 by the mean of 2 tuning seeds (the study's
rule; a choice on a grid's edge is marked); then 10 test seeds, paired by seed (same towers' init and data order)
against v1: two-sided Wilcoxon signed-rank (scipy), Holm over the table. The grids were set after a first pass
whose narrower ones (τ up to 0.1, ρ down to 0.4·ln(B − 1), lr down to 3e-4) put every objective's best on an
edge, v2 then starting from τ 0.03."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.study: its choice rule and statistics

from bench_u_regimes import EMBED, HIDDEN, Towers, get_lr, make_data

from benchmarks.study.plan import choose
from benchmarks.study.stats import holm, mean_std, paired, wilcoxon_p

from common import p_cells, proxy_main, save_figure

BATCH = 32
GAMMA = 0.8  # the study's γ_min (LAION's recipe); constant schedule: γ 1 in the first epoch, then 0.8
ZIPF_S = 2.0
CLASSES, CLASS_COLUMNS = 20, 10  # multi-hot captions: 2 sizes + 8 colours, then 20 classes x 4 cells
TAIL = 10  # the rarest classes of the long-tailed draw
WORKERS = int(os.environ.get("BENCH_WORKERS", "1"))  # runs at a time, one core each


@dataclass(frozen=True)
class Grid:
    n: int = 4_000
    samples: int = 64_000
    val: int = 2_000
    pool: int = 64_000  # enough scenes of the frequent classes alone for a strong skew at N = 4,000
    regimes: tuple[str, ...] = ("balanced", "long-tailed")
    lrs: tuple[float, ...] = (1e-4, 3e-4, 1e-3)
    taus: tuple[float, ...] = (0.07, 0.1, 0.14, 0.2)  # v1's knob
    rho_fracs: tuple[float, ...] = (0.1, 0.2, 0.4, 0.6)  # v3's and v2's: ρ = frac·ln(B − 1)
    tune_seeds: tuple[int, ...] = (100, 101)
    test_seeds: tuple[int, ...] = tuple(range(1, 11))


QUICK = Grid(n=256, samples=2_048, val=256, pool=1_024, lrs=(1e-3,), taus=(0.07,), rho_fracs=(0.6,), test_seeds=(1, 2))
OBJECTIVES = ("fastclip-v1", "fastclip-v3", "fastclip-v2")


def settings(grid: Grid, objective: str) -> list[dict]:
    knob = [{"tau": t} for t in grid.taus] if objective == "fastclip-v1" else [{"rho_frac": f} for f in grid.rho_fracs]
    return [{"lr": lr, **k} for lr in grid.lrs for k in knob]


# ----------------------------------------------------------------------------- data
def classes_of(texts: torch.Tensor) -> torch.Tensor:
    """[n, 20] bool: the glyph classes a multi-hot caption names (in any cell)."""
    return texts[:, CLASS_COLUMNS:].reshape(len(texts), CLASSES, -1).amax(-1) > 0


def class_ranks() -> torch.Tensor:
    """Each class's rank in the long tail (0: the most frequent), a fixed random order."""
    return torch.argsort(torch.randperm(CLASSES, generator=torch.Generator().manual_seed(0)))


def draw(data: dict, regime: str, n: int) -> torch.Tensor:
    """The indices (into the pool) of a regime's n training scenes: the first n; or (long-tailed) as many scenes of
    each object count as those have, each count's drawn by the Zipf weight of its rarest class."""
    balanced = torch.arange(n)
    if regime == "balanced":
        return balanced
    present = classes_of(data["t_train"])
    weight = (class_ranks().double() + 1) ** -ZIPF_S  # per class
    rarest = torch.where(present, weight, torch.inf).amin(1)  # a scene is as rare as its rarest class
    objects, gen, rows = present.sum(1), torch.Generator().manual_seed(0), []
    for count in objects[balanced].unique().tolist():
        among = torch.nonzero(objects == count).flatten()
        wanted = int((objects[balanced] == count).sum())
        rows.append(among[torch.multinomial(rarest[among], wanted, replacement=False, generator=gen)])
    return torch.cat(rows)


def tail_mask(texts: torch.Tensor) -> torch.Tensor:
    """The scenes whose classes are all among the TAIL rarest."""
    tail = class_ranks() >= CLASSES - TAIL
    present = classes_of(texts)
    return (present & ~tail).sum(1) == 0


# ----------------------------------------------------------------------------- one run
def recall(img: torch.Tensor, txt: torch.Tensor, rows: torch.Tensor | None = None) -> float:
    """Mean of both directions' R@1, over the queries `rows` (default all), candidates all."""
    sim = img @ txt.T
    target = torch.arange(len(img))
    hit_i2t, hit_t2i = sim.argmax(1) == target, sim.argmax(0) == target
    if rows is not None:
        hit_i2t, hit_t2i = hit_i2t[rows], hit_t2i[rows]
    return 0.5 * float(hit_i2t.double().mean() + hit_t2i.double().mean())


def build(objective: str, setting: dict, n: int):
    from fastclip.losses import build_loss

    common = {"data_size": n, "gamma_min": GAMMA, "gamma_schedule": "constant"}
    if objective == "fastclip-v1":
        return build_loss(objective, temperature=setting["tau"], **common)
    rho = setting["rho_frac"] * math.log(BATCH - 1)
    if objective == "fastclip-v3":  # τ0 0.07, learned at lr_tau 1e-3 (the study's v3)
        return build_loss(objective, temperature=0.07, rho=rho, **common)
    # v2: every τ_i from v3's 0.07 (the reference's 0.03 sits far below the τ the others settle at, 0.1-0.2, and
    # a τ_i moves at most about lr_τ per visit), at the reference's lr_τ
    return build_loss(objective, temperature=0.07, rho=rho, lr_tau=0.0133, **common)


def final_taus(loss_fn) -> torch.Tensor:
    """The temperatures at the end: v1's and v3's one τ, v2's τ_i of every sample and both modalities."""
    tau = loss_fn.temperature()
    if tau is None:  # v2: per sample, in its sharded state (one process: all of it)
        fields = loss_fn.state_dict()["_extra_state"]["fields"]
        return torch.cat([fields["tau_img"], fields["tau_txt"]]).float()
    return (tau if torch.is_tensor(tau) else torch.tensor(float(tau))).detach().float().reshape(-1)


def train(data: dict, rows: torch.Tensor, objective: str, setting: dict, seed: int, grid: Grid) -> dict:
    n = len(rows)
    x, t = data["x_train"][rows], data["t_train"][rows]
    torch.manual_seed(seed)
    model = Towers(x.shape[1], t.shape[1])
    loss_fn = build(objective, setting, n)
    groups = [{"params": model.parameters(), "weight_decay": 0.1, "base": setting["lr"]}]
    if any(p.requires_grad for p in loss_fn.parameters()):  # v3's τ (v1's is a constant)
        groups.append({"params": loss_fn.parameters(), "weight_decay": 0.0, "base": 1e-3, "fixed": True})
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.98), eps=1e-6)
    steps_per_epoch, steps = n // BATCH, grid.samples // BATCH
    order_rng = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(steps):
        epoch, k = divmod(step, steps_per_epoch)
        if k == 0:
            order = torch.randperm(n, generator=order_rng)
            loss_fn.set_epoch(epoch)
        batch = order[k * BATCH : (k + 1) * BATCH]
        for group in optimizer.param_groups:
            group["lr"] = group["base"] if group.get("fixed") else get_lr(step, steps, group["base"])
        img, txt = model(x[batch], t[batch])
        loss = loss_fn(img, txt, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        loss_fn.average_grads_()  # (one process: nothing to average; the library's loop as a user writes it)
        optimizer.step()
        loss_fn.clamp_()
    half = len(data["x_val"]) // 2  # val: the first half of the held-out scenes; test: the second
    with torch.no_grad():
        img, txt = model(data["x_val"], data["t_val"])
    test_img, test_txt, test_t = img[half:], txt[half:], data["t_val"][half:]
    taus = final_taus(loss_fn)
    final = {
        "val_R1": recall(img[:half], txt[:half]),
        "test_R1": recall(test_img, test_txt),
        "tail_R1": recall(test_img, test_txt, tail_mask(test_t)),
        "tau_mean": float(taus.mean()),
        "tau_std": float(taus.std()) if taus.numel() > 1 else 0.0,
    }
    wall = round(time.perf_counter() - start, 2)
    return {"objective_name": objective, "setting": setting, "seed": seed, "final": final, "wall_s": wall}


# ----------------------------------------------------------------------------- the grid, resumable
def key(regime: str, objective: str, setting: dict, seed: int) -> str:
    return f"{regime}/{objective}/{'_'.join(f'{k}{v:g}' for k, v in setting.items())}/s{seed}"


def version(grid: Grid) -> str:
    """The study's code key (fastclip/ and configs/) and a hash of the source that decides a run's numbers."""
    from benchmarks.study.records import code_version

    parts = (make_data, Towers, get_lr, classes_of, class_ranks, draw, tail_mask, recall, build, final_taus, train)
    sizes = {k: v for k, v in asdict(grid).items() if k in ("n", "samples", "val", "pool")}
    source = "".join(inspect.getsource(p) for p in parts) + f"{BATCH} {GAMMA} {ZIPF_S} {TAIL} {HIDDEN} {EMBED} {sizes}"
    return f"{code_version()['code']}/{hashlib.sha1(source.encode()).hexdigest()[:8]}"


def load_runs(path: Path) -> dict[str, dict]:
    runs = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                runs[key(r["regime"], r["objective_name"], r["setting"], r["seed"])] = r
    return runs


def chosen(runs: dict, grid: Grid, regime: str, objective: str) -> dict:
    scores = [
        (s, [runs[key(regime, objective, s, seed)]["final"]["val_R1"] for seed in grid.tune_seeds])
        for s in settings(grid, objective)
    ]
    return choose(scores)


_SHARED: dict = {}  # the data and draws, set before the worker processes fork (read there, never copied back)


def _train_one(job: tuple) -> tuple:
    regime, objective, setting, seed, grid = job
    torch.set_num_threads(1)
    data, draws = _SHARED["data"], _SHARED["draws"]
    return job, train(data, draws[regime], objective, setting, seed, grid)


def run_grid(grid: Grid, work: Path, workers: int = WORKERS) -> tuple[dict, dict]:
    """Every tuning run, each cell's choice, every test run, `workers` runs at a time (one core each); each run
    appended to runs.jsonl as it ends (a killed grid loses only the runs in progress)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    torch.set_num_threads(1)
    code, log = version(grid), work / "runs.jsonl"
    runs = load_runs(log)
    data = make_data(grid.pool, grid.val, work)
    _SHARED.update(data=data, draws={regime: draw(data, regime, grid.n) for regime in grid.regimes})

    def run_all(jobs: list[tuple]) -> None:
        jobs = [j for j in jobs if key(*j[:4]) not in runs]
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            for done in as_completed([pool.submit(_train_one, j) for j in jobs]):
                (regime, objective, setting, seed, _), result = done.result()
                k = key(regime, objective, setting, seed)
                runs[k] = {"regime": regime, **result, "code": code}
                with log.open("a") as f:
                    f.write(json.dumps(runs[k]) + "\n")
                print(f"{k}: val R@1 {result['final']['val_R1']:.4f} ({result['wall_s']} s)", flush=True)

    run_all(
        [
            (regime, objective, setting, seed, grid)
            for regime in grid.regimes
            for objective in OBJECTIVES
            for setting in settings(grid, objective)
            for seed in grid.tune_seeds
        ]
    )
    run_all(
        [
            (regime, objective, chosen(runs, grid, regime, objective), seed, grid)
            for regime in grid.regimes
            for objective in OBJECTIVES
            for seed in grid.test_seeds
        ]
    )
    return runs, {regime: class_shares(data, rows) for regime, rows in _SHARED["draws"].items()}


def class_shares(data: dict, rows: torch.Tensor) -> dict:
    """How skewed a draw is: the share of class occurrences in its 4 most frequent classes and in the TAIL rarest."""
    counts = classes_of(data["t_train"][rows]).sum(0).double()
    order = torch.argsort(class_ranks())  # classes from the most frequent rank to the rarest
    total = counts.sum()
    return {
        "head4_share": float(counts[order[:4]].sum() / total),
        "tail_share": float(counts[order[-TAIL:]].sum() / total),
    }


# ----------------------------------------------------------------------------- tables
def summarize(runs: dict, grid: Grid, shares: dict) -> dict:
    rows, tests = [], []
    for regime in grid.regimes:
        finals = {}
        for objective in OBJECTIVES:
            setting = chosen(runs, grid, regime, objective)
            finals[objective] = {s: runs[key(regime, objective, setting, s)]["final"] for s in grid.test_seeds}
            knobs = {k: (grid.lrs if k == "lr" else grid.taus if k == "tau" else grid.rho_fracs) for k in setting}
            edge = [k for k, v in setting.items() if v in (min(knobs[k]), max(knobs[k]))]
            row = {"regime": regime, "objective_name": objective, "setting": setting, "on_edge": edge}
            for metric in ("test_R1", "tail_R1", "tau_mean", "tau_std"):
                row[metric] = dict(zip(("mean", "std"), mean_std([f[metric] for f in finals[objective].values()])))
            rows.append(row)
        for objective in OBJECTIVES[1:]:
            for metric in ("test_R1", "tail_R1"):
                _, diffs = paired(
                    {s: f[metric] for s, f in finals[objective].items()},
                    {s: f[metric] for s, f in finals["fastclip-v1"].items()},
                )
                tests.append({"regime": regime, "objective_name": objective, "metric": metric,
                              "diff_mean": float(diffs.mean()), "diff_std": mean_std(list(diffs))[1],
                              "wins": int((diffs > 0).sum()), "seeds": len(diffs), "p": wilcoxon_p(diffs)})  # fmt: skip
    for row, p in zip(tests, holm([t["p"] for t in tests])):
        row["p_holm"] = p
    codes = sorted({r.get("code", "?") for r in runs.values()})
    return {"grid": asdict(grid), "shares": shares, "rows": rows, "tests": tests, "codes": codes}


def _pct(d: dict) -> str:
    return f"{100 * d['mean']:.1f} ± {100 * (d['std'] or 0):.1f}"


def markdown(result: dict) -> str:
    grid, info, shares = result["grid"], result["machine"], result["shares"]
    lines = [
        f"Learned and individual τ against a tuned constant τ (`python benchmarks/bench_tau_regimes.py`; the MLP proxy "
        f"of bench_u_regimes.py: scenes-semantic at 32 px, captions as multi-hot vectors, N = {grid['n']:,} training "
        f"pairs, {grid['samples']:,} samples per run, global batch {BATCH}, u with γ {GAMMA} for all three; settings "
        f"chosen by the mean val R@1 of seeds {grid['tune_seeds']}; {len(grid['test_seeds'])} test seeds; "
        f"{info['date'][:10]}, commit {result['commit']}). Long-tailed draw: Zipf s = {ZIPF_S} over the classes by "
        f"a scene's rarest class, per object count; its 4 most frequent classes hold "
        f"{100 * shares.get('long-tailed', {}).get('head4_share', float('nan')):.0f} % of the class occurrences "
        f"(balanced: {100 * shares.get('balanced', {}).get('head4_share', float('nan')):.0f} %), its {TAIL} rarest "
        f"{100 * shares.get('long-tailed', {}).get('tail_share', float('nan')):.0f} %. test R@1: the second half of "
        f"the {grid['val']:,} held-out scenes (the first half chose the settings); tail R@1: its scenes whose classes "
        f"are all among those {TAIL} (queries), all of its scenes as candidates. τ: the final temperature (v2: mean "
        "± std over the samples' τ_i). (edge): the chosen value is its grid's lowest or highest.",
        "",
        f"Code of the runs: {', '.join(result['codes'])}"
        + (" — **mixed: rerun the old runs (delete them from runs.jsonl)**" if len(result["codes"]) > 1 else ""),
        "",
        "| regime | objective | chosen | test R@1 % | tail R@1 % | final τ |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        chosen_ = ", ".join(f"{k} {v:g}" + (" (edge)" if k in r["on_edge"] else "") for k, v in r["setting"].items())
        tau = f"{r['tau_mean']['mean']:.3f}" + (f" (± {r['tau_std']['mean']:.3f})" if r["tau_std"]["mean"] else "")
        lines.append(
            f"| {r['regime']} | {r['objective_name']} | {chosen_} | {_pct(r['test_R1'])} | {_pct(r['tail_R1'])} "
            f"| {tau} |"
        )
    lines += ["", "Paired by seed against fastclip-v1 (points; > 0: the learned τ better): two-sided Wilcoxon "
              "signed-rank (scipy.stats), Holm over the table.", ""]  # fmt: skip
    lines += [
        "| regime | objective | metric | Δ mean ± std | better | p | p_Holm |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for t in result["tests"]:
        lines.append(
            f"| {t['regime']} | {t['objective_name']} | {t['metric']} | {100 * t['diff_mean']:+.2f} "
            f"± {100 * (t['diff_std'] or 0):.2f} | {t['wins']}/{t['seeds']} | {p_cells(t)} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Each learned τ's paired difference from v1's tuned constant τ (mean ± std over the test seeds), by regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    regimes = result["grid"]["regimes"]
    for ax, metric, title in (
        (axes[0], "test_R1", "test R@1, minus v1's (points)"),
        (axes[1], "tail_R1", "tail R@1 (rare classes), minus v1's (points)"),
    ):
        for j, objective in enumerate(OBJECTIVES[1:]):
            rows = [
                next(
                    t
                    for t in result["tests"]
                    if (t["regime"], t["objective_name"], t["metric"]) == (g, objective, metric)
                )
                for g in regimes
            ]
            xs = [i + (j - 0.5) * 0.3 for i in range(len(regimes))]
            means, stds = [100 * t["diff_mean"] for t in rows], [100 * (t["diff_std"] or 0) for t in rows]
            ax.bar(xs, means, 0.3, yerr=stds, capsize=3, label=objective)
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xticks(range(len(regimes)), regimes)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    save_figure(fig, path, result["machine"], "Learned / per-sample τ against a tuned constant τ, paired by seed")


def results_of(grid: Grid, work: Path) -> dict:
    runs, shares = run_grid(grid, work)
    return summarize(runs, grid, shares)


def main(argv: list[str] | None = None) -> int:
    return proxy_main(argv, __doc__, "tau_regimes", (Grid(), QUICK), results_of, markdown, plot)


if __name__ == "__main__":
    sys.exit(main())
