"""End to end against OpenCLIP's own trainer: samples/s, peak memory and zero-shot accuracy at equal samples seen.

    python benchmarks/bench_e2e.py            # writes benchmarks/results/e2e.{json,md,png}
    python benchmarks/bench_e2e.py --quick    # CI smoke (tiny data, a few steps) -> benchmarks/out/

Three systems on the same shards (`fastclip data embedded`), the same model (tiny-vit), the same per-rank batch,
2 processes on gloo, fp32, 1 loader worker per rank, resampled shards with `samples` per run and 1 epoch (so
both cosine schedules span the run), warmup 10% of the steps:
  * `OpenCLIP trainer`: open_clip_train.main, unmodified, via benchmarks/openclip_peer.py (--local-loss
    --gather-with-grad, its logit_scale trained at the model lr);
  * `fastclip openclip`: our trainer with loss.name=openclip; `fastclip fastclip-v3`: configs/embedded.yaml with the
    optimiser and loss values it had when the README's figures were measured (PINNED: lr 1e-3 as OpenCLIP's run;
    the CC3M recipe's rho, gamma_min and lr_tau), so the comparison does not move with the config's defaults.
Runs are interleaved (A, B, C, A, B, C, ...). Steady-state samples/s: each trainer's own logged windows of
10 steps after the first 20 steps (OpenCLIP: its `Batch (t)` average per window, which like ours includes the
wait for data). Memory: peak over the run of the summed RSS and PSS of torchrun + ranks + loader workers,
sampled from /proc every 0.25 s. Accuracy: each final checkpoint through fastclip.eval (same code, same
held-out samples).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    REPO,
    RESULTS,
    SMOKE_OUT,
    check_out,
    count,
    ensure_embedded,
    evaluate_checkpoint,
    loss_overrides,
    machine_info,
    publish,
    read_jsonl,
    run_monitored,
    save_figure,
    shard_pattern,
    torchrun,
)

SYSTEMS = ("OpenCLIP trainer", "fastclip openclip", "fastclip fastclip-v3")
# on request (--systems): ours without page-locked batches (--data.pin_memory false), what pinning costs and buys;
# ours with float32 batches from the workers (--data.device_normalize false), what uint8 batches buy
UNPINNED = "fastclip openclip unpinned"
FLOAT = "fastclip openclip float"
EXTRA = {UNPINNED: ("--data.pin_memory", "false"), FLOAT: ("--data.device_normalize", "false")}
ALL_SYSTEMS = (*SYSTEMS, UNPINNED, FLOAT)
RUNTIME = dict(arch="tiny-vit", nproc=2, device="cpu", precision="fp32", workers=1)
FULL = dict(samples=7680, batch=64, reps=2, eval_max=4000, skip_steps=20, log_every=10, **RUNTIME)
# one process in the smoke: it checks the program end to end (torchrun, both trainers, the evaluation); the 2-rank
# paths are the training tests' (a process costs 8-10 s of CPU in imports alone)
QUICK = dict(samples=192, batch=16, reps=1, eval_max=100, skip_steps=2, log_every=2, **dict(RUNTIME, nproc=1))
OPENCLIP_PRECISION = {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp"}
OC_LINE = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/(\d+).*?Batch \(t\): ([0-9.]+)")


def openclip_cmd(data: Path, run_dir: Path, p: dict, warmup: int) -> list[str]:
    pattern, _ = shard_pattern(data / "train")
    backend = "nccl" if p["device"] == "cuda" else "gloo"
    return torchrun(p["nproc"]) + [
        str(REPO / "benchmarks" / "openclip_peer.py"),
        "--",
        "--model",
        p["arch"],
        "--dataset-type",
        "webdataset",
        "--train-data",
        pattern,
        "--train-num-samples",
        str(p["samples"]),
        "--dataset-resampled",
        "--batch-size",
        str(p["batch"]),
        "--workers",
        str(p["workers"]),
        "--precision",
        OPENCLIP_PRECISION[p["precision"]],
        "--dist-backend",
        backend,
        "--device",
        p["device"],
        "--epochs",
        "1",
        "--lr",
        "1e-3",
        "--warmup",
        str(warmup),
        "--wd",
        "0.1",
        "--beta1",
        "0.9",
        "--beta2",
        "0.98",
        "--eps",
        "1e-6",
        "--local-loss",
        "--gather-with-grad",
        "--logs",
        str(run_dir.parent),
        "--name",
        run_dir.name,
        "--save-frequency",
        "1",
        "--log-every-n-steps",
        str(p["log_every"]),
        "--seed",
        "2024",
        "--report-to",
        "",
    ]


# configs/embedded.yaml's values of 2026-11-21 (the README's table); the config now holds the study's choice
PINNED = ["--optim.lr", "1e-3", "--optim.lr_tau", "2e-4", "--optim.lr_tau_schedule", "step_thresh"]
PINNED_V3 = ["--loss.rho", "6.5", "--loss.gamma_min", "0.2"]


def ours_cmd(loss: str, data: Path, run_dir: Path, p: dict, warmup: int, extra: tuple[str, ...] = ()) -> list[str]:
    return torchrun(p["nproc"]) + [
        "-m",
        "fastclip",
        "train",
        "--",
        "--config",
        str(REPO / "configs" / "embedded.yaml"),
        "--data.train",
        str(data / "train"),
        "--data.val",
        str(data / "val"),
        "--data.zeroshot",
        str(data / "zeroshot.json"),
        "--data.batch_size",
        str(p["batch"]),
        "--data.resampled",
        "true",
        "--data.samples_per_epoch",
        str(p["samples"]),
        "--model.arch",
        p["arch"],
        "--train.epochs",
        "1",
        "--optim.warmup_steps",
        str(warmup),
        "--train.run_dir",
        str(run_dir),
        "--train.device",
        p["device"],
        "--train.precision",
        p["precision"],
        "--data.workers",
        str(p["workers"]),
        "--train.log_every",
        str(p["log_every"]),
        "--train.progress",
        "false",
        "--train.tensorboard",
        "false",
        "--eval.every_steps",
        "0",
        "--eval.at_end",
        "false",
        "--checkpoint.every_steps",
        "0",
        "--checkpoint.every_minutes",
        "0",
        *loss_overrides(loss),
        *PINNED,
        *(PINNED_V3 if loss == "fastclip-v3" else []),
        *extra,
    ]


def steady_openclip(log: Path, global_batch: int, skip_steps: int) -> float:
    """Samples/s over OpenCLIP's logged windows that start after `skip_steps` steps."""
    windows, prev_step = [], 0
    for seen, _, batch_time in OC_LINE.findall(log.read_text()):
        step = int(seen) // global_batch
        if step - prev_step > 0 and prev_step >= skip_steps:
            windows.append((step - prev_step, float(batch_time)))
        prev_step = step
    if not windows:
        raise ValueError(f"{log}: no OpenCLIP training log lines after step {skip_steps}")
    return sum(n for n, _ in windows) * global_batch / sum(n * t for n, t in windows)


def steady_ours(metrics: Path, skip_steps: int) -> float:
    windows, prev_step = [], 0
    for rec in read_jsonl(metrics):
        if "samples_per_s" not in rec:
            continue
        if prev_step >= skip_steps:
            windows.append((rec["step"] - prev_step, rec["samples_per_s"]))
        prev_step = rec["step"]
    if not windows:
        raise ValueError(f"{metrics}: no logged steps after step {skip_steps}")
    return sum(n for n, _ in windows) / sum(n / s for n, s in windows)


def one_run(system: str, rep: int, data: Path, work: Path, p: dict) -> dict:
    global_batch = p["nproc"] * p["batch"]
    steps = p["samples"] // global_batch
    warmup = max(1, steps // 10)
    run_dir = work / f"{system.replace(' ', '_')}_{rep}"
    shutil.rmtree(run_dir, ignore_errors=True)  # OpenCLIP refuses an existing experiment folder
    if system == "OpenCLIP trainer":
        mem = run_monitored(openclip_cmd(data, run_dir, p, warmup), work / f"{run_dir.name}.log")
        sps = steady_openclip(run_dir / "out.log", global_batch, p["skip_steps"])
        ckpt, arch = sorted((run_dir / "checkpoints").glob("epoch_*.pt"))[-1], p["arch"]
    else:
        cmd = ours_cmd(system.split()[1], data, run_dir, p, warmup, EXTRA.get(system, ()))
        mem = run_monitored(cmd, work / f"{run_dir.name}.log")
        sps = steady_ours(run_dir / "metrics.jsonl", p["skip_steps"])
        ckpt, arch = run_dir, None
    acc = evaluate_checkpoint(ckpt, data, arch=arch, max_samples=p["eval_max"], device=p["device"])
    row = {
        "system": system,
        "rep": rep,
        "samples": steps * global_batch,
        "samples_per_s": sps,
        **mem,
        "zeroshot_mean_top1": acc.get("zeroshot/mean_top1"),
        "zeroshot_fashion_mnist_top1": acc.get("zeroshot/fashion-mnist/top1"),
        "zeroshot_mnist_top1": acc.get("zeroshot/mnist/top1"),
        # what was evaluated: eval_max, or fewer where the held-out split is smaller
        "eval_samples": int(sum(v for k, v in acc.items() if k.startswith("zeroshot/") and k.endswith("/num_samples"))),
    }
    print(
        f"  e2e {system} rep {rep}: {sps:.1f} samples/s, PSS {mem['peak_pss_sum_mb']:.0f} MB, "
        f"top1 {row['zeroshot_mean_top1']}",
        flush=True,
    )
    return row


def systems_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in ALL_SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {unknown}; choose from: {', '.join(ALL_SYSTEMS)}")
    return names


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for system in dict.fromkeys(r["system"] for r in rows):  # in the order they ran
        mine = [r for r in rows if r["system"] == system]
        med = lambda k: statistics.median(r[k] for r in mine if r[k] is not None)  # noqa: E731
        out.append(
            {
                "system": system,
                "runs": len(mine),
                "samples_per_s": med("samples_per_s"),
                "samples_per_s_all": [round(r["samples_per_s"], 1) for r in mine],
                "peak_pss_sum_mb": med("peak_pss_sum_mb"),
                "peak_rss_sum_mb": med("peak_rss_sum_mb"),
                "wall_s": med("wall_s"),
                "zeroshot_mean_top1": med("zeroshot_mean_top1"),
                "zeroshot_fashion_mnist_top1": med("zeroshot_fashion_mnist_top1"),
                "zeroshot_mnist_top1": med("zeroshot_mnist_top1"),
            }
        )
    peer = next((s for s in out if s["system"] == "OpenCLIP trainer"), None)
    for s in out:
        if peer:
            s["throughput_ratio"] = s["samples_per_s"] / peer["samples_per_s"]
            s["pss_ratio"] = s["peak_pss_sum_mb"] / peer["peak_pss_sum_mb"]
            s["top1_diff"] = s["zeroshot_mean_top1"] - peer["zeroshot_mean_top1"]
    return out


def _eval_samples(result: dict) -> int:
    """The held-out samples each checkpoint was scored on (results written before rows counted them: eval_max)."""
    return max(row.get("eval_samples", result["params"]["eval_max"]) for row in result["rows"])


def _ratio(summary: dict, key: str, unit: str = "") -> str:
    """A ratio to OpenCLIP's trainer, or '-' where the run had none."""
    return f"{summary[key]:.2f}{unit}" if key in summary else "-"


def markdown(result: dict) -> str:
    p = result["params"]
    lines = [
        f"Same shards (`fastclip data embedded`), model `{p['arch']}`, {p['batch']} samples per rank "
        f"(global {p['nproc'] * p['batch']}), {p['nproc']} processes on {p['device']} "
        f"({'nccl' if p['device'] == 'cuda' else 'gloo'}), {p['precision']}, {p['samples']} samples per run "
        f"(1 epoch of resampled shards), {p['reps']} interleaved runs per system (median shown; all runs in the JSON). "
        f"Zero-shot: mean of Fashion-MNIST and MNIST top-1 on the first {_eval_samples(result)} held-out samples, "
        f"each final checkpoint evaluated by fastclip.eval. Memory: peak of the summed PSS (RSS in "
        f"brackets) of torchrun, both ranks and their loader workers, sampled from /proc every 0.25 s.",
        "",
        "| system | samples/s (steady) | runs | ratio vs OpenCLIP | peak PSS sum MB (RSS) | memory ratio | "
        "zero-shot top-1 (mean) | Fashion-MNIST | MNIST | wall s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["summary"]:
        lines.append(
            f"| {s['system']} | {s['samples_per_s']:.1f} | {s['samples_per_s_all']} | "
            f"{_ratio(s, 'throughput_ratio', 'x')} | {s['peak_pss_sum_mb']:.0f} "
            f"({s['peak_rss_sum_mb']:.0f}) | {_ratio(s, 'pss_ratio')} | "
            f"{100 * s['zeroshot_mean_top1']:.2f}% | {100 * s['zeroshot_fashion_mnist_top1']:.2f}% | "
            f"{100 * s['zeroshot_mnist_top1']:.2f}% | {s['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    names = [s["system"] for s in summary]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    colors = ["#888888", "#4c72b0", "#dd8452"][: len(names)]
    for ax, key, label, scale in (
        (axes[0], "samples_per_s", "samples/s (steady state)", 1),
        (axes[1], "peak_pss_sum_mb", "peak PSS summed over processes (MB)", 1),
        (axes[2], "zeroshot_mean_top1", "zero-shot top-1 (%), equal samples", 100),
    ):
        values = [scale * s[key] for s in summary]
        bars = ax.bar(range(len(names)), values, color=colors)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
        ax.set_ylabel(label, fontsize=8)
    p = result["params"]
    title = (
        f"End to end vs OpenCLIP's trainer: {p['arch']}, {p['nproc']} x {p['batch']} per step, "
        f"{p['device']} {p['precision']}, {p['samples']} samples per run"
    )
    save_figure(fig, path, result["machine"], title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny data, a few steps, 1 run each (CI smoke)")
    parser.add_argument("--samples", type=count(), help="samples per run")
    parser.add_argument("--reps", type=count(), help="interleaved runs per system")
    parser.add_argument("--arch", help="model (default tiny-vit; e.g. ViT-B-32 on a GPU)")
    parser.add_argument("--batch", type=count(), help="samples per process per step")
    parser.add_argument("--nproc", type=count(), help="processes (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="cuda: nccl backend")
    parser.add_argument("--precision", choices=tuple(OPENCLIP_PRECISION), help="ours; OpenCLIP gets amp_bf16 for bf16")
    parser.add_argument("--workers", type=count(0), help="data loader workers per process")
    parser.add_argument("--data", type=Path, help="embedded data root (built when missing)")
    parser.add_argument("--out", type=Path, help="folder for e2e.{json,md,png}")
    parser.add_argument(
        "--systems",
        type=systems_list,
        help=f"comma list of systems to run, in order (default: the first {len(SYSTEMS)}): {', '.join(ALL_SYSTEMS)}",
    )
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    p = dict(QUICK if args.quick else FULL)
    p.update({k: v for k, v in vars(args).items() if k in p and v is not None})
    out = args.out or (SMOKE_OUT if args.quick else RESULTS)
    work = SMOKE_OUT / ("e2e_runs_quick" if args.quick else "e2e_runs")
    data = args.data or (SMOKE_OUT / "embedded_small" if args.quick else REPO / "data" / "embedded")
    ensure_embedded(data, **(dict(max_per_class=40, shard_size=100) if args.quick else {}))
    info = machine_info()
    systems = args.systems or SYSTEMS
    rows = [one_run(system, rep, data, work, p) for rep in range(p["reps"]) for system in systems]
    result = {"machine": info, "params": p, "rows": rows, "summary": summarize(rows)}
    result["machine"]["loadavg_after"] = list(__import__("os").getloadavg())
    publish(out, "e2e", result, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
