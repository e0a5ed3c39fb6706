"""Why the global estimator pays off on one data set and not on another: the error of the mini-batch estimate of
each anchor's negative mass, measured on trained towers.

    python benchmarks/bench_estimator_bias.py --seeds 1,4  # trains 4 runs per seed (~10 min on 2 cores), measures
    python benchmarks/bench_estimator_bias.py --measure    # measures the runs already trained
    python benchmarks/bench_estimator_bias.py --during --seeds 1  # the same towers at epochs 1, 2, 4, 8 and 16

For anchor i and the temperature τ the towers ended with, g_i = mean_{k≠i} exp((S_ik − S_ii)/τ) over the whole
training set is what FastCLIP's moving average u_i tracks; mini-batch InfoNCE sees instead ĝ_i, the same mean over
the B − 1 negatives its batch happens to hold. log is concave, so E[log ĝ_i] < log g_i: that gap (and the spread
of log ĝ_i over batches) is the error the moving average removes. It is large when a few hard negatives carry g_i
(a batch rarely holds them), small when g_i is spread over many negatives every batch samples alike.

Towers: the statistical-efficiency study's chosen setting of openclip and of fastclip-v3 at global batch 64 on each
data set (benchmarks/bench_stat_eff.py's STUDY and results; the seeds given, one process each, the study's command),
trained here once with their final checkpoint kept. Seed 1 is one of the seeds on which v3 barely leads openclip on
the scenes at batch 64, seed 4 one on which it leads by 12 points: the measure should not hang on one of them.
Measured on the 6,000 training pairs, both directions (image anchors against all texts, text anchors against all
images), 64 random partitions into batches per batch size. Reported per data set, towers and batch size (means over
anchors): E[log ĝ] − log g, std(log ĝ), and the share of g_i that the anchor's 60 hardest negatives (1 % of the
data) carry.

During training (``--during``): the same runs trained again in their own folder with every epoch's checkpoint
kept, and measured at the checkpoints nearest to epochs 1, 2, 4, 8 and at the end (its own table and figure,
``estimator_bias_during``): whether the error the end-of-training towers show is there while they learn.

False negatives: a negative with the anchor's very caption (the glyphs have 100 distinct captions for 6,000 pairs),
or of its class (glyphs: 20 classes), is no real negative. Their share of g_i, and the same error measured over the
anchor's other-class negatives alone (g and ĝ both leave the same-class ones out), say how much of what the moving
average corrects is the weight of false negatives.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_stat_eff as study_mod

from common import RESULTS, SMOKE_OUT, check_out, machine_info, publish, save_figure

DATASETS = ("scenes", "glyphs")
LOSSES = ("openclip", "fastclip-v3")
GLOBAL_BATCH = 64
BATCHES = (32, 64, 128)
PARTITIONS = 64
HARD = 0.01  # the hardest 1 % of an anchor's negatives
WORK = SMOKE_OUT / "estimator_bias"
DURING_WORK = WORK / "during"  # runs with every epoch's checkpoint kept
DURING_EPOCHS = (1, 2, 4, 8)  # and the end of training


def chosen_run(dataset: str, loss: str, seed: int) -> study_mod.Run:
    best = study_mod.chosen(study_mod.STUDY, RESULTS / "stat_eff", dataset, GLOBAL_BATCH, loss)
    if best is None:
        raise SystemExit(
            f"the study has not chosen {loss}'s setting on {dataset} at global batch {GLOBAL_BATCH} yet: run "
            f"python benchmarks/bench_stat_eff.py first"
        )
    return dataclasses.replace(best, seed=seed, phase="seed")


def train(runs: list[tuple[study_mod.Run, Path, Path]], work: Path = WORK, keep_last: int = 1) -> None:
    """Each run started as the study starts it (its command, one core, resumed if stopped), two at a time; the
    checkpoints stay (the study's finish() would delete them): the last ``keep_last`` epochs' ones."""
    todo = [(r, d, data) for r, d, data in runs if not (d / "done").is_file()]
    active: list[study_mod.Active] = []
    while todo or active:
        while todo and len(active) < 2:
            run, _, data = todo.pop(0)
            active.append(study_mod.start(run, study_mod.STUDY, data, work, keep_last))
        time.sleep(5)
        for a in [a for a in active if a.proc.poll() is not None]:
            active.remove(a)
            if a.proc.returncode != 0:
                raise SystemExit(f"training failed (rc {a.proc.returncode}); see {a.run_dir / 'stdout.log'}")
            (a.run_dir / "done").write_text("")


def embed(run_dir: Path, data: Path):
    """``run_dir``: a run (its latest checkpoint) or one of its step folders. (image features, text features) of the
    training pairs, L2-normalised, the towers' final τ, and each pair's caption id and class id ([n] int64: equal
    ids, equal caption or class; the class id is -1 where there is none)."""
    import torch
    import torch.nn.functional as F

    from fastclip.eval.checkpoint import load_model
    from fastclip.eval.samples import iter_samples

    built = load_model(run_dir).built
    model = built.model
    images, texts = [], []
    samples = list(iter_samples(data / "train"))
    with torch.no_grad():
        for i in range(0, len(samples), 500):
            chunk = samples[i : i + 500]
            pixels = torch.stack([built.preprocess_val(s.image) for s in chunk])
            images.append(F.normalize(model.encode_image(pixels).float(), dim=-1))
            texts.append(F.normalize(model.encode_text(built.tokenizer([s.caption for s in chunk])).float(), dim=-1))
    tau = float(torch.exp(-model.logit_scale.detach()).reshape(-1)[0])
    ids = {"caption": _ids([s.caption for s in samples])}
    ids["class"] = _ids([None if s.label is None else (s.dataset, s.label) for s in samples])
    indices = torch.tensor([s.index for s in samples], dtype=torch.int64)
    return torch.cat(images).double(), torch.cat(texts).double(), tau, ids, indices


def sample_state(towers: Path) -> dict | None:
    """The per-sample state the towers' loss kept, every rank's shard as one (``[data_size]`` per field, by data
    index: ``log_u_img``, ``log_u_txt``, ``seen``), or None for a loss without one (openclip)."""
    import torch

    from fastclip import checkpoint as ckpt
    from fastclip.losses import reshard_for_rank

    step_dir = ckpt.find_model_file(towers).parent
    states = [torch.load(f, weights_only=True)["loss_state"] for f in sorted(step_dir.glob("rank_*.pt"))]
    if not states or "_extra_state" not in states[0]:
        return None
    whole = reshard_for_rank(states, 1, 0)["_extra_state"]
    return {**whole["fields"], "seen": whole["seen"]}


def _ids(keys: list):
    """Equal keys get equal ids; None (no class) gets -1."""
    import torch

    table: dict = {}
    return torch.tensor([-1 if k is None else table.setdefault(k, len(table)) for k in keys], dtype=torch.int64)


def estimator_errors(anchors, candidates, tau: float, seed: int = 0, ids: dict | None = None, log_u=None) -> dict:
    """For each batch size: mean over anchors of E[log ĝ] − log g and std(log ĝ) over PARTITIONS random partitions,
    and the share of g carried by each anchor's hardest HARD fraction of negatives. With ``ids`` ({"caption": [n],
    "class": [n]} int64, -1 for none): the share of g carried by negatives of the anchor's caption and of its class,
    and (with classes) the error over the other-class negatives alone ("true_batches"), both averaged over the
    anchors that have an id ("<kind>_anchors" of them)."""
    import torch

    n = anchors.shape[0]
    # d_ik = (S_ik − S_ii)/τ, the positive excluded; exponentials shifted per anchor (float64)
    d = (anchors @ candidates.T - (anchors * candidates).sum(dim=1, keepdim=True)) / tau
    d.fill_diagonal_(float("-inf"))
    shift = d.max(dim=1, keepdim=True).values
    w = torch.exp(d - shift)  # [n, n], 0 on the diagonal
    hard = max(1, int(HARD * n))
    top_share = (w.topk(hard, dim=1).values.sum(dim=1) / w.sum(dim=1)).mean().item()
    out = {"hard_share": top_share, "batches": _partition_errors(w, shift.squeeze(1), seed)}
    if log_u is not None:
        error = log_u - (torch.log(w.sum(dim=1) / (n - 1)) + shift.squeeze(1))
        error = error[~torch.isnan(error)]
        out["u"] = {"bias": error.mean().item(), "rmse": error.square().mean().sqrt().item(), "anchors": error.numel()}
    for kind, key in (ids or {}).items():
        if bool((key < 0).all()):
            continue
        has = key >= 0
        same = (key[:, None] == key[None, :]) & has[:, None]  # the diagonal's w is 0 already
        out[f"{kind}_share"] = ((w * same).sum(dim=1) / w.sum(dim=1))[has].mean().item()
        out[f"{kind}_anchors"] = int(has.sum())
        if kind == "class":
            out["true_batches"] = _partition_errors(w.masked_fill(same, 0.0), shift.squeeze(1), seed, ~same, has)
    return out


def _partition_errors(w, shift, seed: int, counted=None, anchors=None) -> dict:
    """E[log ĝ] − log g and the spread of log ĝ for each batch size, averaged over ``anchors`` ([n] bool; default:
    all); ĝ and g average over the negatives ``counted`` marks ([n, n] bool; default: all but the positive), w
    already 0 elsewhere."""
    import torch

    n = w.shape[0]
    if counted is None:
        counted = ~torch.eye(n, dtype=torch.bool)
    counted = counted.clone().fill_diagonal_(False)
    log_g = torch.log(w.sum(dim=1) / counted.sum(dim=1)) + shift
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for b in BATCHES:
        estimates = []
        for _ in range(PARTITIONS):
            order = torch.randperm(n, generator=gen)[: n // b * b].view(-1, b)  # [n/b, b] batches of anchors
            pick = (order[:, :, None], order[:, None, :])
            # each anchor's row within its batch; a batch without a counted negative for an anchor gives nan
            ghat = w[pick].sum(dim=2) / counted[pick].sum(dim=2)
            est = torch.full((n,), float("nan"), dtype=w.dtype)
            est[order.reshape(-1)] = (torch.log(ghat) + shift[order]).reshape(-1)
            estimates.append(est)
        est = torch.stack(estimates)  # [PARTITIONS, n]; nan for the few anchors a partition leaves out
        if anchors is not None:
            est, log_g_kept = est[:, anchors], log_g[anchors]
        else:
            log_g_kept = log_g
        bias = (est.nanmean(dim=0) - log_g_kept).nanmean().item()
        std = torch.sqrt(((est - est.nanmean(dim=0)) ** 2).nanmean(dim=0)).nanmean().item()
        rmse = ((est - log_g_kept) ** 2).nanmean().sqrt().item()
        out[b] = {"bias": bias, "std": std, "rmse": rmse}
    return out


def _rows(run: study_mod.Run, towers: Path, data: Path, **extra) -> list[dict]:
    """The measured rows of one set of towers: both directions, every batch size."""
    import torch

    image, text, tau, ids, indices = embed(towers, data)
    state = sample_state(towers)
    rows = []
    for direction, (a, c), field in (
        ("image anchors", (image, text), "log_u_img"),
        ("text anchors", (text, image), "log_u_txt"),
    ):
        log_u = None
        if state is not None:
            log_u = torch.where(state["seen"][indices], state[field][indices].double(), float("nan"))
        err = estimator_errors(a, c, tau, ids=ids, log_u=log_u)
        for b, e in err["batches"].items():
            true = err.get("true_batches", {}).get(b, {})
            rows.append(
                {
                    "dataset": run.dataset,
                    "towers": f"{run.loss} ({towers.name})",
                    "loss": run.loss,
                    "seed": run.seed,
                    "tau": tau,
                    "direction": direction,
                    "batch": b,
                    "bias": e["bias"],
                    "std": e["std"],
                    "rmse": e["rmse"],
                    "u_bias": err.get("u", {}).get("bias"),
                    "u_rmse": err.get("u", {}).get("rmse"),
                    "u_anchors": err.get("u", {}).get("anchors"),
                    "hard_share": err["hard_share"],
                    "caption_share": err.get("caption_share"),
                    "class_share": err.get("class_share"),
                    "class_anchors": err.get("class_anchors"),
                    "true_bias": true.get("bias"),
                    "true_std": true.get("std"),
                    **extra,
                }
            )
    print(f"measured {run.id} ({towers.name}): τ {tau:.4f}", flush=True)
    return rows


def measure(runs: list[tuple[study_mod.Run, Path, Path]]) -> dict:
    rows = [row for run, run_dir, data in runs for row in _rows(run, run_dir, data)]
    return {"machine": machine_info(), "rows": rows, "partitions": PARTITIONS, "hard_fraction": HARD}


def checkpoints_at(run_dir: Path, epochs: int) -> list[tuple[float, int, Path]]:
    """(epoch, step, folder) of the kept checkpoints nearest to DURING_EPOCHS, and the last one. An epoch is the
    final step / ``epochs`` steps (the checkpoints every ``n // B`` steps fall one step short of its end)."""
    steps = sorted((int(p.name.split("_")[1]), p) for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    if not steps:
        raise SystemExit(f"{run_dir}: no checkpoints (train it first: run without --measure)")
    per_epoch = steps[-1][0] / epochs
    picked = [min(steps, key=lambda sp: abs(sp[0] - e * per_epoch)) for e in DURING_EPOCHS] + [steps[-1]]
    return [(step / per_epoch, step, path) for step, path in dict.fromkeys(picked)]


def measure_during(runs: list[tuple[study_mod.Run, Path, Path]]) -> dict:
    rows = []
    epochs = study_mod.STUDY["epochs"]
    for run, run_dir, data in runs:
        for epoch, step, path in checkpoints_at(run_dir, epochs):
            rows += _rows(run, path, data, epoch=epoch, step=step, samples=step * run.global_batch)
    return {"machine": machine_info(), "rows": rows, "partitions": PARTITIONS, "hard_fraction": HARD}


def markdown_during(result: dict) -> str:
    seeds = ", ".join(str(x) for x in sorted({r["seed"] for r in result["rows"]}))
    lines = [
        "The error of the mini-batch estimate during training (`python benchmarks/bench_estimator_bias.py --during "
        f"--seeds {seeds}`): the study's chosen setting at global batch {GLOBAL_BATCH}, towers of seed {seeds} at "
        f"the checkpoints nearest to epochs {', '.join(map(str, DURING_EPOCHS))} and at the end, "
        f"{result['partitions']} random partitions per batch size. Columns as in estimator_bias.md; rmse: the root "
        "mean square of log ĝ − log g over batches and anchors; u: the loss's own moving average at that checkpoint "
        "(its per-sample state) against the same log g, mean / rmse of log u − log g (FastCLIP towers only; u was "
        "last updated when its sample was last in a batch, at most one epoch earlier); other-class: g and ĝ over "
        "the anchor's other-class negatives alone (glyphs).",
        "",
        "| data | towers (seed) | anchors | epoch | samples seen | τ | hard share | "
        + " | ".join(f"bias / spread at B = {b}" for b in BATCHES)
        + f" | rmse of log ĝ at B = {GLOBAL_BATCH} | log u − log g: mean / rmse "
        f"| other-class bias at B = {GLOBAL_BATCH} |",
        "|---|---|---|---:|---:|---:|---:|" + "---:|" * (len(BATCHES) + 3),
    ]
    keyed: dict[tuple, dict] = {}
    for r in result["rows"]:
        keyed.setdefault((r["dataset"], r["loss"], r["seed"], r["direction"], r["step"]), {})[r["batch"]] = r
    for (dataset, loss, seed, direction, _), per_batch in keyed.items():
        first = per_batch[BATCHES[0]]
        cells = " | ".join(f"{per_batch[b]['bias']:+.2f} / {per_batch[b]['std']:.2f}" for b in BATCHES)
        at = per_batch[GLOBAL_BATCH]
        u = "-" if at["u_bias"] is None else f"{at['u_bias']:+.2f} / {at['u_rmse']:.2f}"
        true = "-" if at["true_bias"] is None else f"{at['true_bias']:+.2f}"
        lines.append(
            f"| {dataset} | {loss} ({seed}) | {direction} | {first['epoch']:.1f} | {first['samples']:,} | "
            f"{first['tau']:.3f} | {100 * first['hard_share']:.0f} % | {cells} | {at['rmse']:.2f} | {u} | "
            f"{true} |"
        )
    return "\n".join(lines)


def plot_during(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    lines: dict[tuple, list[dict]] = {}
    for r in result["rows"]:
        if r["batch"] == GLOBAL_BATCH:
            lines.setdefault((r["dataset"], r["loss"], r["seed"], r["direction"]), []).append(r)
    for (dataset, loss, seed, direction), rows in lines.items():
        rows.sort(key=lambda r: r["samples"])
        x = [r["samples"] for r in rows]
        style = "-" if dataset == "scenes" else "--"
        label = f"{dataset}, {loss} (seed {seed}), {direction}"
        drawn = axes[0].plot(x, [r["bias"] for r in rows], style, marker="o", label=label)[0]
        axes[1].plot(x, [r["rmse"] for r in rows], style, marker="o", color=drawn.get_color())
        axes[2].plot(x, [100 * r["hard_share"] for r in rows], style, marker="o", color=drawn.get_color())
        if rows[0]["u_bias"] is not None:  # the loss's moving average: same colour, hollow markers, dotted
            for ax, key in ((axes[0], "u_bias"), (axes[1], "u_rmse")):
                ax.plot(x, [r[key] for r in rows], ":", marker="o", mfc="none", color=drawn.get_color())
    names = (
        f"E[log ĝ] − log g at B = {GLOBAL_BATCH} (nats; dotted: log u − log g)",
        "root mean square error of log ĝ (dotted: of log u)",
        "share of g in the hardest 1 % (%)",
    )
    for ax, name in zip(axes, names):
        ax.set_xlabel("samples seen")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    save_figure(fig, path, result["machine"], "Mini-batch estimate of the negative mass during training")


def _keyed(rows: list[dict]) -> dict[tuple, dict]:
    """{(data set, loss, seed, direction): {batch: row}} (a row written before seeds were kept is seed 1's)."""
    keyed: dict[tuple, dict] = {}
    for r in rows:
        keyed.setdefault((r["dataset"], r["loss"], r.get("seed", 1), r["direction"]), {})[r["batch"]] = r
    return keyed


def markdown(result: dict) -> str:
    lines = [
        "Error of the mini-batch estimate of each anchor's negative mass on trained towers "
        "(`python benchmarks/bench_estimator_bias.py`; the study's chosen setting at global batch 64, towers of seed "
        f"{', '.join(str(x) for x in sorted({r.get('seed', 1) for r in result['rows']}))}, "
        f"6,000 training pairs, {result['partitions']} random partitions per batch size). "
        "bias = mean over anchors of E[log ĝ] − log g (nats), spread = std of log ĝ over batches; "
        f"hard share = the part of g carried by the hardest {100 * result['hard_fraction']:g} % of negatives.",
        "",
        "| data | towers (seed) | final τ | anchors | hard share | "
        + " | ".join(f"bias / spread at B = {b}" for b in BATCHES)
        + " |",
        "|---|---|---:|---|---:|" + "---:|" * len(BATCHES),
    ]
    keyed = _keyed(result["rows"])
    for (dataset, loss, seed, direction), per_batch in keyed.items():
        first = next(iter(per_batch.values()))
        cells = " | ".join(f"{per_batch[b]['bias']:+.2f} / {per_batch[b]['std']:.2f}" for b in BATCHES)
        lines.append(
            f"| {dataset} | {loss} ({seed}) | {first['tau']:.3f} | {direction} | {100 * first['hard_share']:.0f} % | "
            f"{cells} |"
        )
    lines += [
        "",
        "False negatives: the share of g carried by negatives with the anchor's very caption and by negatives of its "
        "class (the glyphs' 20 classes; of the scenes only the single-object ones carry a class), and the error "
        "of the estimate when g and ĝ both average over the other-class negatives alone; the class columns average "
        "over the anchors that have a class (their number in brackets).",
        "",
        "| data | towers (seed) | anchors | same-caption share | same-class share | "
        + " | ".join(f"bias all / other-class at B = {b}" for b in BATCHES)
        + " |",
        "|---|---|---|---:|---:|" + "---:|" * len(BATCHES),
    ]

    def pct(x):
        return "-" if x is None else f"{100 * x:.0f} %"

    for (dataset, loss, seed, direction), per_batch in keyed.items():
        first = next(iter(per_batch.values()))
        if first.get("caption_share") is None:  # a result written before these columns
            continue
        cells = " | ".join(
            f"{per_batch[b]['bias']:+.2f} / "
            + ("-" if per_batch[b]["true_bias"] is None else f"{per_batch[b]['true_bias']:+.2f}")
            for b in BATCHES
        )
        lines.append(
            f"| {dataset} | {loss} ({seed}) | {direction} | {pct(first['caption_share'])} | "
            f"{pct(first['class_share'])} ({first.get('class_anchors')}) | {cells} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for (dataset, loss, seed, direction), per_batch in _keyed(result["rows"]).items():
        style = "-" if dataset == "scenes" else "--"
        label = f"{dataset}, {loss} (seed {seed}), {direction}"
        axes[0].plot(BATCHES, [per_batch[b]["bias"] for b in BATCHES], style, marker="o", label=label)
        axes[1].plot(BATCHES, [per_batch[b]["std"] for b in BATCHES], style, marker="o", label=label)
    for ax, name in zip(axes, ("E[log ĝ] − log g (nats)", "std of log ĝ over batches (nats)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
        ax.set_xlabel("batch size B")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    save_figure(fig, path, result["machine"], "Mini-batch estimate of each anchor's negative mass vs the global one")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="only measure the runs already trained")
    parser.add_argument(
        "--during", action="store_true", help="keep every epoch's checkpoint and measure at epochs 1, 2, 4, 8, end"
    )
    parser.add_argument("--seeds", default="1,4", help="comma list of the towers' seeds (study seeds, default 1,4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: a comma list of integers, got {args.seeds!r}")
    work = DURING_WORK if args.during else WORK
    runs = []
    for dataset in DATASETS:
        data = study_mod.ensure_data(study_mod.STUDY, dataset, SMOKE_OUT / "stat_eff_work")
        for loss in LOSSES:
            for seed in seeds:
                run = chosen_run(dataset, loss, seed)
                runs.append((run, work / "runs" / run.id, data))  # study_mod.start's folder
    if not args.measure:
        # --during keeps every epoch's checkpoint (the study writes one per epoch, and one at the end)
        train(runs, work, keep_last=study_mod.STUDY["epochs"] + 1 if args.during else 1)
    missing = [str(d) for _, d, _ in runs if not (d / "done").is_file()]
    if missing:
        raise SystemExit(f"not trained yet: {', '.join(missing)} (run without --measure)")
    if args.during:
        publish(args.out, "estimator_bias_during", measure_during(runs), markdown_during, plot_during)
    else:
        publish(args.out, "estimator_bias", measure(runs), markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
