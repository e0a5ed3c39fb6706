"""The SogCLR claim in miniature (issue 42 §2): small-batch SogCLR against SimCLR at small and large batch, and
iSogCLR against SogCLR, on the embedded images alone (configs/ssl/), by kNN and linear-probe accuracy.

    python benchmarks/bench_ssl.py                 # the whole comparison (core-hours: see PLAN); resumes
    python benchmarks/bench_ssl.py --report        # tables, curves and the verdict from the runs done so far
    python benchmarks/bench_ssl.py --quick         # tiny sizes (a smoke test of the pipeline) -> benchmarks/out/

Protocol (FULL below):
- data: `fastclip data embedded` capped at `max_per_class` training images per class (20 classes) and
  `max_val_per_class` held-out ones, whose shards are dealt alternately into val/ (selection, curves) and test/
  (the reported numbers): nothing reported was looked at to choose a setting;
- every arm sees the same samples (`epochs` passes over the training images) with the same network (tiny-vit image
  tower + projector), optimizer (AdamW, cosine lr, 5 % warmup) and augmentation;
- the same tuning budget: each arm runs the `lrs` grid with each of `tune_seeds`, scored by the mean of their final
  leave-one-out kNN top-1 on val/; its best lr then runs with `seeds` (other seeds), evaluated on val/ after every
  epoch (the curves) and at the end on test/ by `fastclip eval --knn 20 --linear-probe` against the training
  images' features;
- verdict: the textbook's claim (§6.5: SogCLR at a small batch ≈ SimCLR at a large one) "holds here" when
  SogCLR@64's mean test kNN top-1 is within the larger of the two arms' seed spreads of SimCLR@512's, or above
  it; the paired differences seed by seed are reported beside it, with Wilcoxon's signed-rank p (scipy).
Each run is a `fastclip train` process whose metrics.jsonl is read back; a finished run is kept and not redone, so a
stopped study costs at most the run in progress.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from study.stats import mean_std, wilcoxon_p
from study.stats import paired as paired_diffs

from common import REPO, RESULTS, SMOKE_OUT, check_out, ensure_embedded, machine_info, publish, save_figure

ARMS = {"sogclr@64": ("sogclr", 64), "simclr@64": ("simclr", 64), "simclr@512": ("simclr", 512),
        "isogclr@64": ("isogclr", 64)}  # fmt: skip
# 3,000 training images (150 of each of the 20 classes), 500 val, 500 test; 36 runs of 12,000 samples each: about
# 70 minutes on 2 cores (one run takes both: the model and its loader worker)
FULL = dict(arms=ARMS, lrs=(5e-4, 1e-3, 2e-3), tune_seeds=(0, 1), seeds=(2, 3, 4), epochs=4,
            max_per_class=150, max_val_per_class=50, shard_size=50)  # fmt: skip
QUICK = dict(arms={"sogclr@8": ("sogclr", 8), "simclr@8": ("simclr", 8), "simclr@32": ("simclr", 32)},
             lrs=(1e-3,), tune_seeds=(0,), seeds=(1,), epochs=1, max_per_class=10, max_val_per_class=6,
             shard_size=30)  # fmt: skip
CLAIM = ("sogclr@64", "simclr@512")
PAIRS = (CLAIM, ("isogclr@64", "sogclr@64"), ("sogclr@64", "simclr@64"))  # (arm, against): arm - against, seed by seed
KNN_K = 20
FINAL = '{"step": -1, "final": true}\n'  # appended to a run's metrics.jsonl once it has finished
NOTE = (
    "Mean ± std over the test seeds, in %. Test: both datasets' images, each scored among its own 10 classes "
    "(`fastclip eval --knn 20 --linear-probe`). Paired differences (points, seed by seed; with n seeds all of one "
    "sign Wilcoxon's two-sided p is 2^(1-n), 0.25 at 3):"
)


def prepare_data(root: Path, q: dict) -> Path:
    """The embedded images with the held-out shards dealt alternately into val/ and test/ (built aside, then
    renamed into place: a stop half-way leaves nothing that looks finished)."""
    from fastclip.data.format import MANIFEST_NAME
    from fastclip.data.manifest import read_manifest

    if (root / "test" / MANIFEST_NAME).is_file():
        return root
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    ensure_embedded(partial, **{k: q[k] for k in ("max_per_class", "max_val_per_class", "shard_size")})
    data_size = read_manifest(partial / "val").data_size
    (partial / "test").mkdir()
    for shard in sorted((partial / "val").glob("*.tar"))[1::2]:
        shard.rename(partial / "test" / shard.name)
    (partial / "val" / MANIFEST_NAME).unlink()
    for split in ("val", "test"):
        cmd = [sys.executable, "-m", "fastclip", "data", "scan", str(partial / split), "--data-size", str(data_size)]
        subprocess.run([*cmd, "--workers", "1", "--strict"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    return root


def run_one(root: Path, data: Path, arm: str, config: str, batch: int, lr: float, seed: int, epochs: int, *,
            test: bool, run: bool = True) -> dict | None:  # fmt: skip
    """One `fastclip train` (resumed if it was stopped; None under --report if not finished): its kNN curve on val
    [(samples_seen, top1)], final val top-1, and with `test` the final model's test kNN and linear-probe top-1 (the
    two datasets' scores weighted by their test images: `fastclip eval` scores each dataset's classes apart)."""
    from fastclip.data.manifest import read_manifest

    run_dir = root / "runs" / f"{arm}-lr{lr:g}-seed{seed}"
    metrics, scores, wall = run_dir / "metrics.jsonl", run_dir / "test.jsonl", run_dir / "wall_s"
    trained = any(r.get("final") for r in _rows(metrics))
    tested = not test or {r["task"] for r in _rows(scores)} >= {"knn", "linear_probe"}
    if not (trained and tested) and not run:
        return None
    if not trained:
        steps = read_manifest(data / "train").num_samples // batch
        config_file = REPO / "configs" / "ssl" / f"{config}-embedded.yaml"
        cmd = [sys.executable, "-m", "fastclip", "train", "--config", str(config_file)]
        cmd += ["--data.train", str(data / "train"), "--data.val", str(data / "val"), "--data.batch_size", str(batch)]
        cmd += ["--optim.lr", str(lr), "--optim.warmup_steps", str(max(1, epochs * steps // 20))]
        cmd += ["--train.seed", str(seed), "--train.epochs", str(epochs), "--train.run_dir", str(run_dir)]
        cmd += ["--train.resume", "latest", "--train.progress", "false", "--train.device", "cpu"]
        cmd += ["--eval.every_steps", str(steps), "--eval.max_samples", "null", "--checkpoint.every_steps", str(steps)]
        _timed(cmd, wall)
        with metrics.open("a") as f:
            f.write(FINAL)
    if not tested:
        scores.unlink(missing_ok=True)  # a stop during the evaluation may have left part of its rows
        cmd = [sys.executable, "-m", "fastclip", "eval", str(run_dir), "--data", str(data / "test"), "--no-retrieval"]
        cmd += ["--probe-train", str(data / "train"), "--knn", str(KNN_K), "--linear-probe", "--device", "cpu"]
        _timed([*cmd, "--results", str(scores)], wall)
    curve = [(r["samples_seen"], r["eval/knn_top1"]) for r in _rows(metrics) if "eval/knn_top1" in r]
    curve = sorted(dict(curve).items())  # a resumed run may evaluate a step twice: the last one counts
    out = {"arm": arm, "lr": lr, "seed": seed, "curve": curve, "final": curve[-1][1] if curve else math.nan}
    if test:
        rows = _rows(scores)
        for task, key in (("knn", "test_knn"), ("linear_probe", "test_linear")):
            mine = [r for r in rows if r["task"] == task]
            out[key] = sum(r["top1"] * r["num_samples"] for r in mine) / sum(r["num_samples"] for r in mine)
            out[f"{key}_by_dataset"] = {r["dataset"]: r["top1"] for r in mine}
    seconds = sum(float(x) for x in wall.read_text().split()) if wall.is_file() else 0.0
    return {**out, "seconds": seconds}


def _rows(path: Path) -> list[dict]:
    """A JSONL file's rows, without a last line cut short by a stop (none if the file is not there)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else ():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def _timed(cmd: list[str], wall: Path) -> None:
    """Run `cmd`, adding its wall seconds to the run's `wall` file (a resumed study still counts every run)."""
    started = time.monotonic()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    with wall.open("a") as f:
        f.write(f"{time.monotonic() - started:.1f}\n")


def paired(result: dict, arm: str, against: str, key: str) -> dict | None:
    """arm - against on `key`, seed by seed (the seeds both have), with Wilcoxon's two-sided signed-rank p (exact,
    ties included: study.stats.wilcoxon_p)."""
    arms = result["arms"]
    if arm not in arms or against not in arms:
        return None
    seeds, diffs = paired_diffs(*({r["seed"]: r[key] for r in arms[n]["seeds"]} for n in (arm, against)))
    if not seeds:
        return None
    diffs = diffs.tolist()
    mean, std = mean_std(diffs)
    return {"arm": arm, "against": against, "metric": key, "seeds": seeds, "diffs": diffs,
            "diff_mean": mean, "diff_std": std, "p_wilcoxon": wilcoxon_p(diffs)}  # fmt: skip


def verdict(result: dict, claim=CLAIM) -> str:
    """Whether small-batch SogCLR reaches large-batch SimCLR here (module docstring), in one sentence."""
    arms = result["arms"]
    if not all(name in arms for name in claim):
        return "not decided: the runs of both arms are missing"
    (small, s_std), (large, l_std) = (mean_std([r["test_knn"] for r in arms[n]["seeds"]]) for n in claim)
    spread = max(s_std or 0.0, l_std or 0.0)
    holds = small >= large - spread
    return (
        f"the claim {'holds' if holds else 'does not hold'} here: {claim[0]} {100 * small:.1f} against {claim[1]} "
        f"{100 * large:.1f} test kNN top-1 (largest seed spread {100 * spread:.1f} points)"
    )


def study(out: Path, data: Path, q: dict, run: bool = True) -> dict:
    """Tuning (every lr with each tuning seed), then the best lr with every test seed, arm by arm; under --report
    only what is done."""
    result = {"machine": machine_info(), **{k: q[k] for k in FULL if k != "arms"}, "arms": {}}
    for arm, (config, batch) in q["arms"].items():
        tuning = [
            run_one(out, data, arm, config, batch, lr, seed, q["epochs"], test=False, run=run)
            for lr in q["lrs"]
            for seed in q["tune_seeds"]
        ]
        if None in tuning:
            continue
        score = {lr: sum(r["final"] for r in tuning if r["lr"] == lr) / len(q["tune_seeds"]) for lr in q["lrs"]}
        best = max(q["lrs"], key=lambda lr: -1.0 if math.isnan(score[lr]) else score[lr])
        runs = [run_one(out, data, arm, config, batch, best, s, q["epochs"], test=True, run=run) for s in q["seeds"]]
        runs = [r for r in runs if r]
        if runs:
            result["arms"][arm] = dict(config=config, global_batch=batch, tuning=tuning, best_lr=best, seeds=runs)
    # wall hours of the runs and evaluations (each run keeps both cores busy: its model and its loader worker)
    result["wall_hours"] = sum(r["seconds"] for a in result["arms"].values() for r in a["tuning"] + a["seeds"]) / 3600
    claim = CLAIM if CLAIM[0] in q["arms"] else (list(q["arms"])[0], list(q["arms"])[-1])
    pairs = PAIRS if CLAIM[0] in q["arms"] else (claim,)
    result["paired"] = [p for a, b in pairs for key in ("test_knn", "test_linear") if (p := paired(result, a, b, key))]
    result["verdict"] = verdict(result, claim)
    return result


def _pct(m: float, s: float | None) -> str:
    return f"{100 * m:.1f}" + (" (one seed)" if s is None else f" ± {100 * s:.1f}")


def markdown(result: dict) -> str:
    lines = ["| arm | global batch | best lr | val kNN top-1 | test kNN top-1 | test linear probe |", "|---" * 6 + "|"]
    for arm, a in result["arms"].items():
        cells = [_pct(*mean_std([r[key] for r in a["seeds"]])) for key in ("final", "test_knn", "test_linear")]
        lines.append(f"| {arm} | {a['global_batch']} | {a['best_lr']:g} | " + " | ".join(cells) + " |")
    lines += ["", NOTE, ""]
    for p in result.get("paired", []):
        each = ", ".join(f"{100 * d:+.1f}" for d in p["diffs"])
        wilcoxon = "n/a" if p["p_wilcoxon"] is None else f"{p['p_wilcoxon']:.3g}"
        lines.append(f"- {p['arm']} − {p['against']}, {p['metric']}: {each} (Wilcoxon p = {wilcoxon})")
    hours = result.get("wall_hours", 0.0)
    return "\n".join(lines + ["", result["verdict"], f"({hours:.2f} h of runs on 2 cores, {2 * hours:.1f} core-hours)"])


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
    ax.set_ylabel("kNN top-1 on val (%)")
    ax.legend()
    save_figure(fig, path, result["machine"], "SogCLR vs SimCLR on the embedded images")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one seed (a smoke test)")
    parser.add_argument("--report", action="store_true", help="only report the finished runs (no new run)")
    parser.add_argument("--out", default=None, help="results under OUT/ssl, with its runs (default: benchmarks/results;"
                        " the runs then in benchmarks/out/ssl_work)")  # fmt: skip
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    q = QUICK if args.quick else FULL
    out = (Path(args.out) if args.out else SMOKE_OUT if args.quick else RESULTS) / "ssl"
    work = SMOKE_OUT / "ssl_work" if out.resolve() == RESULTS / "ssl" else out  # data, runs, checkpoints: not committed
    data = work / "embedded"
    if args.report and not (work / "runs").is_dir():
        print(f"bench_ssl: no runs in {work}: run without --report first", file=sys.stderr)
        return 2
    settings = json.loads(json.dumps({k: v for k, v in q.items() if k != "arms"} | {"arms": q["arms"]}))
    kept = work / "settings.json"
    if kept.is_file() and json.loads(kept.read_text()) != settings:
        print(f"bench_ssl: {work} holds runs of other settings ({kept}): move it away or pass another --out",
              file=sys.stderr)  # fmt: skip
        return 2
    if not args.report:
        work.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(settings, indent=1) + "\n")
        prepare_data(data, q)
    result = study(work, data, q, run=not args.report)
    publish(out, "ssl", result, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
