"""The SogCLR claim in miniature (issue 42 §2): small-batch SogCLR against SimCLR at small and large batch, and
iSogCLR against SogCLR, on the embedded images alone (configs/ssl/), by kNN accuracy on the held-out images.

    python benchmarks/bench_ssl.py                 # the whole comparison; hours on a CPU; resumes where it stopped
    python benchmarks/bench_ssl.py --report        # tables, curves and the verdict from the runs done so far
    python benchmarks/bench_ssl.py --quick         # tiny sizes (a smoke test of the pipeline) -> benchmarks/out/

Protocol (ARMS, LRS, SEEDS, EPOCHS below):
- every arm sees the same samples (EPOCHS passes over the embedded training images) with the same network
  (tiny-vit image tower + projector), optimizer (AdamW, cosine lr, 5 % warmup) and augmentation;
- the same tuning budget: each arm runs the LRS grid with seed 0, scored by its final kNN top-1 on data.val;
  its best lr then runs with SEEDS, evaluated after every epoch (the curves);
- verdict: the textbook's claim (§6.5: SogCLR at a small batch ≈ SimCLR at a large one) "holds here" when
  SogCLR@64's mean final kNN top-1 is within the larger of the two arms' seed spreads of SimCLR@512's, or above
  it; the paired difference seed by seed is reported beside it.
The kNN is leave-one-out over data.val (fastclip/train/ssl.py); tuning and scoring share that split, as the
evaluation issue's linear probe on a separate split is not on this branch. Each run is a `fastclip train` process
whose metrics.jsonl is read back; a finished run is kept and not redone.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastclip.data.manifest import read_manifest

from common import REPO, RESULTS, SMOKE_OUT, check_out, ensure_embedded, machine_info, publish, read_jsonl, save_figure

ARMS = {"sogclr@64": ("sogclr", 64), "simclr@64": ("simclr", 64), "simclr@512": ("simclr", 512),
        "isogclr@64": ("isogclr", 64)}  # fmt: skip
LRS = (5e-4, 1e-3, 2e-3)
SEEDS = (1, 2, 3)
EPOCHS = 10
QUICK = dict(arms={"sogclr@8": ("sogclr", 8), "simclr@8": ("simclr", 8), "simclr@32": ("simclr", 32)},
             lrs=(1e-3,), seeds=(0,), epochs=1, max_per_class=10)  # fmt: skip
CLAIM = ("sogclr@64", "simclr@512")


def run_one(root: Path, data: Path, arm: str, config: str, batch: int, lr: float, seed: int, epochs: int,
            run: bool = True) -> dict | None:  # fmt: skip
    """One `fastclip train` (resumed if it was stopped; None under --report if not finished): its kNN curve
    [(samples_seen, top1)] and final top-1."""
    run_dir = root / "runs" / f"{arm}-lr{lr:g}-seed{seed}"
    metrics = run_dir / "metrics.jsonl"
    done = metrics.is_file() and any(r.get("final") for r in read_jsonl(metrics))
    if not done and not run:
        return None
    if not done:
        steps = _num_samples(data / "train") // batch
        config_file = REPO / "configs" / "ssl" / f"{config}-embedded.yaml"
        cmd = [sys.executable, "-m", "fastclip", "train", "--config", str(config_file)]
        cmd += ["--data.train", str(data / "train"), "--data.val", str(data / "val"), "--data.batch_size", str(batch)]
        cmd += ["--optim.lr", str(lr), "--optim.warmup_steps", str(max(1, epochs * steps // 20))]
        cmd += ["--train.seed", str(seed), "--train.epochs", str(epochs), "--train.run_dir", str(run_dir)]
        cmd += ["--train.resume", "latest", "--train.progress", "false", "--train.device", "cpu"]
        cmd += ["--eval.every_steps", str(steps), "--eval.max_samples", "null", "--checkpoint.every_steps", str(steps)]
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        with metrics.open("a") as f:  # the marker that this run is complete
            f.write('{"step": -1, "final": true}\n')
    curve = [(r["samples_seen"], r["eval/knn_top1"]) for r in read_jsonl(metrics) if "eval/knn_top1" in r]
    curve = sorted(dict(curve).items())  # a resumed run may evaluate a step twice: the last one counts
    return {"arm": arm, "lr": lr, "seed": seed, "curve": curve, "final": curve[-1][1] if curve else math.nan}


def _num_samples(split: Path) -> int:

    return read_manifest(split).num_samples


def mean_std(xs: list[float]) -> tuple[float, float | None]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None)


def verdict(result: dict, claim=CLAIM) -> str:
    """Whether small-batch SogCLR reaches large-batch SimCLR here (module docstring), in one sentence."""
    arms = result["arms"]
    if not all(name in arms for name in claim):
        return "not decided: the runs of both arms are missing"
    (small, s_std), (large, l_std) = (mean_std([r["final"] for r in arms[n]["seeds"]]) for n in claim)
    spread = max(s_std or 0.0, l_std or 0.0)
    holds = small >= large - spread
    return (
        f"the claim {'holds' if holds else 'does not hold'} here: {claim[0]} {100 * small:.1f} against {claim[1]} "
        f"{100 * large:.1f} kNN top-1 (largest seed spread {100 * spread:.1f} points)"
    )


def study(out: Path, data: Path, arms: dict, lrs, seeds, epochs: int, run: bool = True) -> dict:
    """Tuning (seed 0, every lr), then the best lr with every seed, arm by arm; under --report only what is done."""
    result = {"machine": machine_info(), "epochs": epochs, "lrs": list(lrs), "arms": {}}
    for arm, (config, batch) in arms.items():
        tuning = [run_one(out, data, arm, config, batch, lr, 0, epochs, run) for lr in lrs]
        if None in tuning:
            continue
        best = max(tuning, key=lambda r: -1.0 if math.isnan(r["final"]) else r["final"])["lr"]
        runs = [r for r in (run_one(out, data, arm, config, batch, best, seed, epochs, run) for seed in seeds) if r]
        if runs:
            result["arms"][arm] = dict(config=config, global_batch=batch, tuning=tuning, best_lr=best, seeds=runs)
    result["verdict"] = verdict(result, CLAIM if CLAIM[0] in arms else (list(arms)[0], list(arms)[-1]))
    return result


def markdown(result: dict) -> str:
    lines = ["| arm | global batch | best lr | final kNN top-1 (mean ± std over seeds) |", "|---|---|---|---|"]
    for arm, a in result["arms"].items():
        m, s = mean_std([r["final"] for r in a["seeds"]])
        spread = "one seed" if s is None else f"± {100 * s:.1f}"
        lines.append(f"| {arm} | {a['global_batch']} | {a['best_lr']:g} | {100 * m:.1f} {spread} |")
    return "\n".join(lines + ["", result["verdict"]])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, a in result["arms"].items():
        for i, r in enumerate(a["seeds"]):
            xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
            ax.plot(xs, [100 * y for y in ys], color=f"C{list(result['arms']).index(arm)}", alpha=0.8,
                    label=arm if i == 0 else None)  # fmt: skip
    ax.set_xlabel("samples seen")
    ax.set_ylabel("kNN top-1 on data.val (%)")
    ax.legend()
    save_figure(fig, path, result["machine"], "SogCLR vs SimCLR on the embedded images")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one seed (a smoke test)")
    parser.add_argument("--report", action="store_true", help="only report the finished runs (no new run)")
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results/ssl)")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    q = QUICK if args.quick else dict(arms=ARMS, lrs=LRS, seeds=SEEDS, epochs=EPOCHS, max_per_class=None)
    out = Path(args.out) if args.out else (SMOKE_OUT / "ssl" if args.quick else RESULTS / "ssl")
    data = out / "embedded"
    if args.report and not (out / "runs").is_dir():
        print(f"bench_ssl: no runs in {out}: run without --report first", file=sys.stderr)
        return 2
    if not args.report:
        ensure_embedded(data, max_per_class=q["max_per_class"])
    result = study(out, data, q["arms"], q["lrs"], q["seeds"], q["epochs"], run=not args.report)
    publish(out, "ssl", result, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
