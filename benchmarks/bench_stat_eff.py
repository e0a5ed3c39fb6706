"""Statistical efficiency at small batch: zero-shot accuracy against samples seen for openclip and fastclip-v0..v3
at global batch 64, 128 and 256, and the samples v3 needs to reach openclip's final accuracy.

    python benchmarks/bench_stat_eff.py          # writes benchmarks/results/stat_eff.{json,md,png}
    python benchmarks/bench_stat_eff.py --quick  # 2 losses, 1 batch size, a few steps (CI smoke) -> benchmarks/out/

Our trainer, 2 processes on gloo (per-rank batch = global / 2), fp32, tiny-vit, the loss settings of
configs/embedded.yaml (τ0 0.07, ρ 6.5, γ_min 0.2, cosine γ decay; options a version lacks are left out).
FastCLIP's per-sample estimators only pay off when samples come back, so each run makes `epochs` passes over a
small training set (`fastclip data embedded --max-per-class`), with γ decaying over the first epochs - 1
epochs (the recipe decays over 3 of 5). Warmup: 10% of the steps. Evaluation after every epoch on the first
`eval_max` held-out samples (`eval.max_samples`), by the trainer's own eval (every rank its slice).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO, RESULTS, SMOKE_OUT, ensure_embedded, loss_overrides, machine_info, publish, read_jsonl,
                    run_monitored, save_figure, torchrun)

LOSSES = ("openclip", "fastclip-v0", "fastclip-v1", "fastclip-v2", "fastclip-v3")
FULL = dict(losses=LOSSES, global_batches=(64, 128, 256), max_per_class=150, epochs=3, eval_max=2000)
QUICK = dict(losses=("openclip", "fastclip-v3"), global_batches=(32,), max_per_class=16, epochs=2, eval_max=100)
METRIC = "eval/zeroshot/mean_top1"


def run_one(loss: str, global_batch: int, data: Path, work: Path, p: dict) -> dict:
    manifest = json.loads((data / "train" / "manifest.json").read_text())
    steps_per_epoch = manifest["num_samples"] // global_batch
    run_dir = work / f"{loss}_gb{global_batch}"
    cmd = torchrun(2) + [
        "-m", "fastclip", "train", "--", "--config", str(REPO / "configs" / "embedded.yaml"),
        "--data.train", str(data / "train"), "--data.val", str(data / "val"),
        "--data.zeroshot", str(data / "zeroshot.json"), "--data.batch_size", str(global_batch // 2),
        "--train.epochs", str(p["epochs"]), "--optim.warmup_steps", str(max(1, steps_per_epoch * p["epochs"] // 10)),
        "--train.run_dir", str(run_dir), "--train.device", "cpu", "--train.backend", "gloo",
        "--train.log_every", str(max(1, steps_per_epoch // 2)), "--train.progress", "false",
        "--train.tensorboard", "false", "--eval.every_steps", str(steps_per_epoch), "--eval.at_end", "true",
        "--eval.max_samples", str(p["eval_max"]), "--checkpoint.every_steps", "0",
        "--checkpoint.every_minutes", "0", "--checkpoint.at_end", "false",
        *loss_overrides(loss, gamma_decay_epochs=max(1, p["epochs"] - 1)),
    ]
    if run_dir.exists():
        import shutil
        shutil.rmtree(run_dir)
    mem = run_monitored(cmd, work / f"{run_dir.name}.log")
    records = read_jsonl(run_dir / "metrics.jsonl")
    curve = []
    for rec in records:
        if METRIC in rec:
            curve.append((rec["samples_seen"], rec[METRIC]))
    curve = sorted(dict(curve).items())  # the at-end eval repeats the last epoch's step: keep one
    print(f"  stat-eff {loss} global batch {global_batch}: final top1 {curve[-1][1]:.4f} "
          f"({mem['wall_s']:.0f} s)", flush=True)
    return {"loss": loss, "global_batch": global_batch, "curve": curve, "final_top1": curve[-1][1],
            "wall_s": mem["wall_s"]}


def samples_to_reach(curve: list, target: float) -> float | None:
    """Samples seen at which `curve` first reaches `target` (linear between evaluations); None if it never does."""
    prev = (0, 0.0)
    for seen, acc in curve:
        if acc >= target:
            if prev[1] >= target or acc == prev[1]:
                return float(seen)
            return prev[0] + (target - prev[1]) / (acc - prev[1]) * (seen - prev[0])
        prev = (seen, acc)
    return None


def summarize(runs: list[dict], p: dict) -> list[dict]:
    out = []
    for gb in p["global_batches"]:
        ref = next((r for r in runs if r["loss"] == "openclip" and r["global_batch"] == gb), None)
        v3 = next((r for r in runs if r["loss"] == "fastclip-v3" and r["global_batch"] == gb), None)
        row = {"global_batch": gb, **{r["loss"]: r["final_top1"] for r in runs if r["global_batch"] == gb}}
        if ref and v3:
            total = v3["curve"][-1][0]
            need = samples_to_reach(v3["curve"], ref["final_top1"])
            row.update(openclip_final=ref["final_top1"], total_samples=total, v3_samples_to_openclip_final=need,
                       v3_fraction=None if need is None else need / ref["curve"][-1][0])
        out.append(row)
    return out


def markdown(result: dict) -> str:
    p, losses = result["params"], result["params"]["losses"]
    lines = [f"Our trainer, 2 processes (gloo, per-rank batch = global / 2), fp32, tiny-vit, "
             f"{result['train_samples']} training samples (`--max-per-class {p['max_per_class']}`) x {p['epochs']} "
             f"epochs, γ decay over {max(1, p['epochs'] - 1)} epoch(s), evaluation after every epoch on the first "
             f"{p['eval_max']} held-out samples. Final zero-shot top-1 (mean of Fashion-MNIST and MNIST):", "",
             "| global batch | " + " | ".join(losses) + " | v3 samples to reach openclip's final | of openclip's |",
             "|---:|" + "---:|" * len(losses) + "---:|---:|"]
    for row in result["summary"]:
        need = row.get("v3_samples_to_openclip_final")
        frac = row.get("v3_fraction")
        lines.append(f"| {row['global_batch']} | " + " | ".join(
            f"{100 * row[l]:.2f}%" if l in row else "-" for l in losses) + " | " +
            (f"{need:,.0f}" if need is not None else f"not reached in {row.get('total_samples', 0):,}") +
            " | " + (f"{frac:.2f}x" if frac is not None else "-") + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = result["params"]
    batches = p["global_batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.9), squeeze=False)
    colors = dict(zip(LOSSES, ("#222222", "#55a868", "#8172b2", "#4c72b0", "#dd8452")))
    for ax, gb in zip(axes[0], batches):
        for run in (r for r in result["runs"] if r["global_batch"] == gb):
            xs, ys = zip(*run["curve"])
            ax.plot(xs, [100 * y for y in ys], marker="o", ms=3, color=colors[run["loss"]], label=run["loss"],
                    lw=2 if run["loss"] in ("openclip", "fastclip-v3") else 1)
        ax.set_title(f"global batch {gb}", fontsize=9)
        ax.set_xlabel("samples seen", fontsize=8)
        ax.set_ylabel("zero-shot top-1 (%)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    title = f"Statistical efficiency: tiny-vit, 2 processes, {result['train_samples']} samples x {p['epochs']} epochs"
    save_figure(fig, path, result["machine"], title, top=0.94)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 losses, 1 batch size, tiny data (CI smoke)")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--max-per-class", type=int, help="training samples per class and dataset")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    p = dict(QUICK if args.quick else FULL)
    p.update({k: v for k, v in (("epochs", args.epochs), ("max_per_class", args.max_per_class)) if v})
    out = args.out or (SMOKE_OUT if args.quick else RESULTS)
    work = SMOKE_OUT / ("stat_eff_runs_quick" if args.quick else "stat_eff_runs")
    data = ensure_embedded(work.parent / f"embedded_mpc{p['max_per_class']}", max_per_class=p["max_per_class"],
                           shard_size=200)
    train_samples = json.loads((data / "train" / "manifest.json").read_text())["num_samples"]
    info = machine_info()
    # batch sizes in the outer loop: a run for each loss before the next batch size, so noise spreads evenly
    runs = [run_one(loss, gb, data, work, p) for gb in p["global_batches"] for loss in p["losses"]]
    result = {"machine": info, "params": p, "train_samples": train_samples, "runs": runs,
              "summary": summarize(runs, p)}
    result["machine"]["loadavg_after"] = list(os.getloadavg())
    publish(out, "stat_eff", result, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
