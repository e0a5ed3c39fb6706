"""Where do FastCLIP's moving averages u help? DCL against FastCLIP-v1 (the same gradient with the mini-batch
estimate of each anchor's negative mass g replaced by u) as the theory's knobs move: revisits per sample (training
set size N at a fixed number of samples seen, so N / B steps between two visits of a sample) and γ.

    python benchmarks/bench_u_regimes.py             # -> results/u_regimes.{json,md,png}; resumes from out/u_regimes
    python benchmarks/bench_u_regimes.py --quick     # CI smoke (tiny sizes) -> benchmarks/out/u_regimes_quick

A proxy, chosen so the whole grid (162 runs) costs under an hour of one core: the study's scenes-semantic scenes
(seed 0, the first N training scenes and 2,000 val scenes, rendered in memory), images average-pooled to 32 x 32 x 3 and
captions read back into multi-hot (size, colour, class-in-cell) vectors; each tower an MLP (one hidden layer of
256) to 64 dimensions; fastclip's own losses in a plain loop (the library as a user calls it: build_loss,
set_epoch, loss(features, indices)). Global batch 32, one process, τ fixed at 0.07 for both, AdamW with warmup
and cosine. v1's γ schedule is "constant": γ = 1 in the first epoch, γ_min after it.

Protocol: per (N, objective) the lr is chosen among 4 on val (mean val R@1 of 2 tuning seeds); then 10 test seeds,
paired by seed (same towers' init and data order) against dcl. Measured at the end of each run: the global
objective over the N training pairs (GCL at τ: mean over anchors of log g, the quantity both losses' gradients
estimate; lower is better), val R@1 (mean of both directions), and each estimator's error against the exact log g
of the final towers: rmse of log u − log g (v1: its state, u last written when the sample was last seen) and of
log ĝ − log g (dcl: the mini-batch estimate, over one random partition into batches of 32)."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.study: its choice rule and statistics

from benchmarks.study.plan import choose
from benchmarks.study.stats import holm, mean_std, paired, wilcoxon_p

from common import p_cells, proxy_main, save_figure

TAU = 0.07
BATCH = 32
HIDDEN, EMBED = 256, 64


@dataclass(frozen=True)
class Grid:
    # training pairs N: 256, 64 and 16 epochs of 64,000 samples (N = 16,000, 4 epochs: 100 s a run on a shared core,
    # most of it the exact global objective over N² pairs at each evaluation; left out to fit a session)
    sizes: tuple[int, ...] = (250, 1_000, 4_000)
    samples: int = 64_000
    val: int = 2_000
    pool: int = 16_000  # training scenes rendered (the images' standardisation comes from them): N's are its first N
    gammas: tuple[float, ...] = (0.2, 0.8)  # the published recipes' γ_min (CC3M 0.2, LAION 0.8)
    lrs: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3)  # 3e-3 added where 1e-3 won on the edge (N = 250)
    tune_seeds: tuple[int, ...] = (100, 101)
    test_seeds: tuple[int, ...] = tuple(range(1, 11))
    evals: int = 4  # val R@1 and the global objective along the run (the curve)


QUICK = Grid(sizes=(256, 1_024), samples=4_096, val=256, pool=1_024, gammas=(0.5,), lrs=(1e-3, 3e-3), test_seeds=(1, 2))


def objectives(grid: Grid) -> list[str]:
    return ["dcl", *(f"fastclip-v1/g{g:g}" for g in grid.gammas)]


# ----------------------------------------------------------------------------- data
def make_data(n_train: int, n_val: int, cache: Path) -> dict[str, torch.Tensor]:
    """Images [n, 3072] (32 x 32 x 3, standardised by the training set's channel means) and captions [n, 90]
    (multi-hot: 2 sizes, 8 colours, 20 classes x 4 cells) of the first n scenes of train and val."""
    path = cache / f"scenes_semantic_{n_train}_{n_val}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    from fastclip.data.sources.embedded import FASHION_MNIST_ROOT
    from fastclip.data.sources.scenes import COLOURS, glyph_pools
    from fastclip.data.sources.scenes_semantic import CELLS, SIDES, CaptionReader, render, scene_and_caption

    vocab, pools = glyph_pools(["fashion-mnist", "mnist"], FASHION_MNIST_ROOT, 0)
    reader, cells, colours, sides = CaptionReader(vocab), list(CELLS), list(COLOURS), list(SIDES)

    def split(name: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = pools["train" if name == "train" else "heldout"]
        sizes = [len(p) for p in part]
        images = np.empty((n, 32, 32, 3), np.float32)
        texts = np.zeros((n, len(sides) + len(colours) + 4 * len(vocab.nouns)), np.float32)
        for i in range(n):
            scene, caption = scene_and_caption(0, name, i, vocab, sizes)
            images[i] = render(scene, part).reshape(32, 2, 32, 2, 3).mean(axis=(1, 3))
            size, colour, objects = reader.parse(caption)
            texts[i, sides.index(size)] = texts[i, len(sides) + colours.index(colour)] = 1
            for cls, cell in objects:
                texts[i, len(sides) + len(colours) + 4 * cls + cells.index(cell)] = 1
        return torch.from_numpy(images.reshape(n, -1) / 255.0), torch.from_numpy(texts)

    (xt, tt), (xv, tv) = split("train", n_train), split("val", n_val)
    mean, std = xt.mean(0), xt.std(0).clamp_min(1e-3)
    data = {"x_train": (xt - mean) / std, "t_train": tt, "x_val": (xv - mean) / std, "t_val": tv}
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data


# ----------------------------------------------------------------------------- model, schedule, measurements
class Towers(nn.Module):
    def __init__(self, image_dim: int, text_dim: int):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(image_dim, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, EMBED))
        self.text = nn.Sequential(nn.Linear(text_dim, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, EMBED))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.image(x), dim=-1), F.normalize(self.text(t), dim=-1)


def get_lr(step: int, steps: int, lr: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    return 0.5 * lr * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def log_g(anchors: torch.Tensor, candidates: torch.Tensor, tau: float = TAU) -> torch.Tensor:
    """Each anchor's exact log g = log mean_{j != i} exp((a_i·c_j − a_i·c_i) / τ), by row chunks (float32 products:
    |logits| <= 1/τ, so the float64 sums change nothing at these sizes)."""
    a, c, out = anchors.float(), candidates.float(), []
    n = len(a)
    for start in range(0, n, 2048):
        logits = a[start : start + 2048] @ c.T / tau
        rows = torch.arange(start, min(start + 2048, n))
        pos = logits[rows - start, rows].clone()
        logits[rows - start, rows] = -math.inf
        out.append(torch.logsumexp((logits - pos[:, None]).double(), dim=1) - math.log(n - 1))
    return torch.cat(out)


def recall_at_1(img: torch.Tensor, txt: torch.Tensor) -> float:
    sim = img @ txt.T
    target = torch.arange(len(img))
    return 0.5 * float((sim.argmax(1) == target).double().mean() + (sim.argmax(0) == target).double().mean())


@torch.no_grad()
def measure(model: Towers, data: dict, n: int) -> dict:
    img, txt = model(data["x_train"][:n], data["t_train"][:n])
    g_img, g_txt = log_g(img, txt), log_g(txt, img)
    return {
        "objective": float(0.5 * (g_img.mean() + g_txt.mean())),
        "val_R1": recall_at_1(*model(data["x_val"], data["t_val"])),
        "_log_g": (g_img, g_txt, img, txt),
    }


def estimator_rmse(objective: str, loss_fn, at_end: dict, seed: int) -> float:
    """rmse over anchors (both modalities) of the objective's estimate of log g against the exact one."""
    g_img, g_txt, img, txt = at_end["_log_g"]
    if objective == "dcl":  # the mini-batch estimate over one random partition into batches of BATCH
        order = torch.randperm(len(img), generator=torch.Generator().manual_seed(seed))
        est_img, est_txt = torch.empty_like(g_img), torch.empty_like(g_txt)
        for start in range(0, len(order) - BATCH + 1, BATCH):
            rows = order[start : start + BATCH]
            est_img[rows], est_txt[rows] = log_g(img[rows], txt[rows]), log_g(txt[rows], img[rows])
        kept = order[: len(order) // BATCH * BATCH]
        errors = torch.cat([est_img[kept] - g_img[kept], est_txt[kept] - g_txt[kept]])
    else:  # u as the state holds it (index i's entry: sample i, last written when it was last in a batch)
        fields = loss_fn.state_dict()["_extra_state"]["fields"]
        errors = torch.cat([fields["log_u_img"].double() - g_img, fields["log_u_txt"].double() - g_txt])
    return float(errors.pow(2).mean().sqrt())


# ----------------------------------------------------------------------------- one run
def train(data: dict, objective: str, n: int, lr: float, seed: int, grid: Grid) -> dict:
    from fastclip.losses import build_loss

    torch.manual_seed(seed)
    model = Towers(data["x_train"].shape[1], data["t_train"].shape[1])
    if objective == "dcl":
        loss_fn = build_loss("dcl", temperature=TAU, learn_temperature=False)
    else:
        gamma = float(objective.split("/g")[1])
        loss_fn = build_loss("fastclip-v1", data_size=n, temperature=TAU, gamma_min=gamma, gamma_schedule="constant")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1)
    steps_per_epoch = n // BATCH
    steps = grid.samples // BATCH
    order_rng = torch.Generator().manual_seed(seed)
    curve, start = [], time.perf_counter()
    eval_at = {round(steps * k / grid.evals) for k in range(1, grid.evals + 1)}
    for step in range(steps):
        epoch, k = divmod(step, steps_per_epoch)
        if k == 0:
            order = torch.randperm(n, generator=order_rng)
            loss_fn.set_epoch(epoch)
        rows = order[k * BATCH : (k + 1) * BATCH]
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step, steps, lr)
        img, txt = model(data["x_train"][rows], data["t_train"][rows])
        loss = loss_fn(img, txt, rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step + 1 in eval_at:
            at = measure(model, data, n)
            curve.append([(step + 1) * BATCH, round(at["objective"], 4), round(at["val_R1"], 4)])
    rmse = estimator_rmse(objective, loss_fn, at, seed)
    return {
        "objective_name": objective, "n": n, "lr": lr, "seed": seed,
        "final": {"objective": at["objective"], "val_R1": at["val_R1"], "estimator_rmse": rmse},
        "curve": curve, "epochs": steps / steps_per_epoch, "wall_s": round(time.perf_counter() - start, 2),
    }  # fmt: skip


# ----------------------------------------------------------------------------- the grid, resumable
def key(objective: str, n: int, lr: float, seed: int) -> str:
    return f"{objective}/n{n}/lr{lr:g}/s{seed}"


def load_runs(path: Path) -> dict[str, dict]:
    runs = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                runs[key(r["objective_name"], r["n"], r["lr"], r["seed"])] = r
    return runs


def version() -> str:
    """The code a run ran: the study's code key (fastclip/ and configs/ at HEAD, +dirty) and a hash of the source of
    what decides a run's numbers here (data, towers, schedule, training, measurements; not the grid or the tables,
    so a size added to the grid keeps the runs already made)."""
    import hashlib
    import inspect

    from benchmarks.study.records import code_version

    parts = (make_data, Towers, get_lr, log_g, recall_at_1, measure, estimator_rmse, train)
    source = "".join(inspect.getsource(p) for p in parts) + f"{TAU} {BATCH} {HIDDEN} {EMBED}"
    return f"{code_version()['code']}/{hashlib.sha1(source.encode()).hexdigest()[:8]}"


def run_grid(grid: Grid, work: Path) -> dict[str, dict]:
    """Every tuning run, the choice per (N, objective), every test run; each run appended to runs.jsonl as it ends
    (a killed grid loses only the run in progress)."""
    torch.set_num_threads(1)
    code = version()
    log = work / "runs.jsonl"
    runs = load_runs(log)
    data = make_data(grid.pool, grid.val, work)

    def ensure(objective: str, n: int, lr: float, seed: int) -> dict:
        k = key(objective, n, lr, seed)
        if k not in runs:
            runs[k] = {**train(data, objective, n, lr, seed, grid), "code": code}
            with log.open("a") as f:
                f.write(json.dumps(runs[k]) + "\n")
            f = runs[k]["final"]
            print(f"{k}: objective {f['objective']:.4f}, val R@1 {f['val_R1']:.4f} ({runs[k]['wall_s']} s)", flush=True)
        return runs[k]

    for n in grid.sizes:
        for objective in objectives(grid):
            for lr in grid.lrs:
                for seed in grid.tune_seeds:
                    ensure(objective, n, lr, seed)
    for n in grid.sizes:
        for objective in objectives(grid):
            for seed in grid.test_seeds:
                ensure(objective, n, chosen_lr(runs, grid, objective, n), seed)
    return runs


def chosen_lr(runs: dict, grid: Grid, objective: str, n: int) -> float:
    scores = [
        ({"lr": lr}, [runs[key(objective, n, lr, s)]["final"]["val_R1"] for s in grid.tune_seeds]) for lr in grid.lrs
    ]
    return choose(scores)["lr"]


# ----------------------------------------------------------------------------- tables
def summarize(runs: dict, grid: Grid) -> dict:
    rows, tests = [], {"val_R1": [], "objective": []}
    for n in grid.sizes:
        by_objective = {}
        for objective in objectives(grid):
            lr = chosen_lr(runs, grid, objective, n)
            by_objective[objective] = {s: runs[key(objective, n, lr, s)] for s in grid.test_seeds}
            rows.append(
                {
                    "n": n,
                    "objective_name": objective,
                    "lr": lr,
                    "lr_on_edge": lr in (min(grid.lrs), max(grid.lrs)),  # the optimum may lie past it
                    "visits": grid.samples / n,  # per sample, on average (an epoch drops the last partial batch)
                }
            )
            for metric in ("objective", "val_R1", "estimator_rmse"):
                mean, std = mean_std([r["final"][metric] for r in by_objective[objective].values()])
                rows[-1][metric] = {"mean": mean, "std": std}
        for objective in objectives(grid)[1:]:
            for metric in tests:
                _, diffs = paired(
                    {s: r["final"][metric] for s, r in by_objective[objective].items()},
                    {s: r["final"][metric] for s, r in by_objective["dcl"].items()},
                )
                better = diffs > 0 if metric == "val_R1" else diffs < 0
                tests[metric].append({"n": n, "objective_name": objective, "diff_mean": float(diffs.mean()),
                                      "diff_std": mean_std(list(diffs))[1], "wins": int(better.sum()),
                                      "seeds": len(diffs), "p": wilcoxon_p(diffs)})  # fmt: skip
    for family in tests.values():
        for row, p in zip(family, holm([r["p"] for r in family])):
            row["p_holm"] = p
    codes = sorted({r.get("code", "?") for r in runs.values()})
    return {"grid": asdict(grid), "rows": rows, "tests": tests, "codes": codes}


def markdown(result: dict) -> str:
    grid, info = result["grid"], result["machine"]
    lines = [
        f"DCL against FastCLIP-v1 (u) on a proxy (`python benchmarks/bench_u_regimes.py`; MLP towers on the "
        f"scenes-semantic scenes at 32 px and their captions as multi-hot vectors, τ {TAU}, global batch {BATCH}, "
        f"{grid['samples']:,} samples per run; lr chosen among {grid['lrs']} by the mean val R@1 of seeds "
        f"{grid['tune_seeds']}; {len(grid['test_seeds'])} test seeds; {info['date'][:10]}, commit {result['commit']}). "
        "objective: the global objective over the N training pairs (mean log g, lower is better); estimator rmse: "
        "of log u (v1's state) or of the mini-batch log ĝ (dcl) against the exact log g of the final towers; "
        "(edge): the chosen lr is the grid's lowest or highest.",
        "",
        f"Code of the runs: {', '.join(result['codes'])}"
        + (" — **mixed: rerun the old runs (delete them from runs.jsonl)**" if len(result["codes"]) > 1 else ""),
        "",
        "| N | visits per sample | objective | lr | global objective | val R@1 % | estimator rmse |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        o, v, e = r["objective"], r["val_R1"], r["estimator_rmse"]
        edge = " (edge)" if r["lr_on_edge"] else ""
        lines.append(
            f"| {r['n']:,} | {r['visits']:g} | {r['objective_name']} | {r['lr']:g}{edge} "
            f"| {o['mean']:.3f} ± {o['std']:.3f} "
            f"| {100 * v['mean']:.1f} ± {100 * v['std']:.1f} | {e['mean']:.2f} |"
        )
    for metric, what in (
        ("objective", "global objective (v1 − dcl; < 0: u lower)"),
        ("val_R1", "val R@1 (v1 − dcl, points)"),
    ):
        scale = 100 if metric == "val_R1" else 1
        lines += ["", f"Paired by seed, {what}: two-sided Wilcoxon signed-rank (scipy.stats), Holm over the table.", ""]
        lines += ["| N | objective | Δ mean ± std | v1 better | p | p_Holm |", "|---:|---|---:|---:|---:|---:|"]
        for t in result["tests"][metric]:
            lines.append(
                f"| {t['n']:,} | {t['objective_name']} | {scale * t['diff_mean']:+.3f} "
                f"± {scale * (t['diff_std'] or 0):.3f} "
                f"| {t['wins']}/{t['seeds']} | {p_cells(t)} |"
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """The paired differences v1 − dcl (mean ± std over the test seeds) against visits per sample."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    samples = result["grid"]["samples"]
    for ax, metric, scale, title in (
        (axes[0], "objective", 1, "global objective, v1 − dcl (nats; < 0: u optimises it better)"),
        (axes[1], "val_R1", 100, "val R@1, v1 − dcl (points; > 0: u better)"),
    ):
        names = sorted({t["objective_name"] for t in result["tests"][metric]})
        for name in names:
            rows = [t for t in result["tests"][metric] if t["objective_name"] == name]
            visits = [samples / t["n"] for t in rows]
            ax.errorbar(visits, [scale * t["diff_mean"] for t in rows], [scale * (t["diff_std"] or 0) for t in rows],
                        marker="o", capsize=3, label=name)  # fmt: skip
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("visits per sample (samples seen / training pairs N)")
        ax.set_title(title, fontsize=9)
    axes[1].legend(fontsize=8)
    save_figure(fig, path, result["machine"], "Where u helps: FastCLIP-v1 against DCL, paired by seed (test seeds)")


def main(argv: list[str] | None = None) -> int:
    return proxy_main(
        argv, __doc__, "u_regimes", (Grid(), QUICK), lambda g, w: summarize(run_grid(g, w), g), markdown, plot
    )


if __name__ == "__main__":
    sys.exit(main())
