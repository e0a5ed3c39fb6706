"""Scaling: a training step split into compute and communication at 1 and 2 processes (measured), and a MODEL of
the step at 8-256 GPUs built from per-collective costs (latency + bytes / bandwidth).

    python benchmarks/bench_scaling.py          # writes benchmarks/results/scaling.{json,md,png}
    python benchmarks/bench_scaling.py --quick  # fewer steps and sizes (CI smoke) -> benchmarks/out/

Measured (gloo, 1 thread per process, tiny-vit, B per rank, synthetic batches, fastclip-v3 and openclip losses
inside the trainer's own TowersWithLoss under DDP, AdamW): the full step at 1 process (= compute; nothing to
communicate), the full step at 2 processes, the same under DDP `no_sync()` (no gradient all-reduce), a
standalone all_reduce of the gradient bytes, and the loss alone (forward + backward on leaf features) at 1 and
2 processes. Variants run interleaved, the median of the repetitions is kept, a step's time is the slowest rank's.

Model (NOT a measurement): ring collectives, each costing steps·α + wire_bytes / bw, with
  all_reduce(n):  2(K-1) steps, 2(K-1)/K·n wire bytes;   all_gather(n per rank): (K-1) steps, (K-1)·n;
  reduce_scatter(n input): (K-1) steps, (K-1)/K·n.
  step(K) = compute + grad all_reduce(4·P) + loss collectives, no overlap of communication with the backward
  (DDP overlaps its buckets, so this is an upper bound on the step). Loss collectives per step (§2.7 of the
  reference notes): fastclip-v3: all_gather(2·B·d·4 + B·8) (features + indices) + all_reduce(2·K·B·4) (the
  global batch's u, owner-filled); openclip (local loss, gather with grad): 2 × all_gather(B·d·4) forward and
  2 × reduce_scatter(K·B·d·4) backward. α and bw are fitted here from an all_reduce / all_gather sweep on gloo
  (2 processes), and, as a second variant, taken from typical NCCL-over-InfiniBand figures (stated assumptions).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastclip.distributed import destroy_process_group

from common import RESULTS, SMOKE_OUT, check_out, free_port, machine_info, publish, save_figure, slowest_rank_seconds

FULL = dict(
    losses=("fastclip-v3", "openclip"),
    batch=64,
    arch="tiny-vit",
    reps=12,
    warmup=3,
    sweep_sizes=[2**k for k in range(10, 25, 2)],
    sweep_reps=7,
)
QUICK = dict(
    losses=("fastclip-v3",),
    batch=16,
    arch="tiny-vit",
    reps=2,
    warmup=1,
    sweep_sizes=[2**10, 2**16, 2**20],
    sweep_reps=2,
)
MODEL_RANKS = (1, 2, 8, 16, 32, 64, 128, 256)

# Second model variant: published / typical figures, stated as assumptions (not measured here)
NCCL_IB = {
    "name": "assumed: NCCL over InfiniBand, ViT-B-32, 256 per GPU, bf16",
    "alpha_s": 10e-6,  # per ring step: NCCL inter-node latency is typically 5-20 µs
    "bw_Bps": 20e9,  # per-GPU ring (bus) bandwidth: HDR 200 Gb/s IB = 25 GB/s line rate, ~80% achieved
    "params": 151_277_313,  # ViT-B-32 CLIP (open_clip); DDP all-reduces fp32 gradients under bf16 autocast
    "batch": 256,
    "dim": 512,
    # 3 x forward FLOPs (2 x params x tokens: image 88M x 50 patches, text 63M x 77 tokens) x 256 samples at
    # 40% of an A100's 312 TFLOP/s bf16 peak: ~0.11 s. An assumption until the GPU session measures it.
    "compute_s": 3 * 2 * (88e6 * 50 + 63e6 * 77) * 256 / (0.4 * 312e12),
}


# ----------------------------------------------------------------------------- measurement (in the workers)


def _worker(rank: int, world: int, port: int, p: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = _measure(rank, world, p)  # its DDP wrappers are gone when it returns: none may outlive the group
    if rank == 0:
        queue.put(out)
    dist.barrier()
    destroy_process_group()


def _measure(rank: int, world: int, p: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from fastclip.losses import build_loss
    from fastclip.models import build_model
    from fastclip.train.net import TowersWithLoss

    torch.manual_seed(rank)
    b = p["batch"]
    out = {"world": world, "rank": rank, "times": {}}
    for loss_name in p["losses"]:
        built = build_model(p["arch"])
        model = built.model
        model.logit_scale.requires_grad_(False)
        loss_fn = build_loss(loss_name, data_size=10**6)
        net = TowersWithLoss(model, loss_fn, precision="fp32", compile=False)
        if world > 1:
            net = DistributedDataParallel(net)
        opt = torch.optim.AdamW([q for q in net.parameters() if q.requires_grad], lr=1e-4)
        size = model.visual.image_size if hasattr(model.visual, "image_size") else 32
        size = size[0] if isinstance(size, (tuple, list)) else size
        images = torch.randn(b, 3, size, size)
        texts = torch.randint(0, 49408, (b, model.context_length if hasattr(model, "context_length") else 32))
        params = sum(q.numel() for q in net.parameters() if q.requires_grad)
        dim = model.text_projection.shape[1] if hasattr(model, "text_projection") else 64
        step_no = [0]

        def step(sync=True):
            indices = torch.arange(b) * world + rank + step_no[0] * b * world
            step_no[0] += 1
            if world > 1 and not sync:
                with net.no_sync():
                    loss = net(images, texts, indices, 1)
                    loss.backward()
            else:
                loss = net(images, texts, indices, 1)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        feats = [torch.nn.functional.normalize(torch.randn(b, dim), dim=1).requires_grad_() for _ in range(2)]
        loss_alone = build_loss(loss_name, data_size=10**6)
        grad_flat = torch.randn(params)
        variants = {
            "step": lambda: step(True),
            "loss_alone": lambda: loss_alone(feats[0], feats[1], torch.arange(b) * world + rank, epoch=1).backward(),
        }
        if world > 1:
            variants["step_no_sync"] = lambda: step(False)
            variants["grad_all_reduce"] = lambda: dist.all_reduce(grad_flat)
        times = {k: [] for k in variants}
        for rep in range(p["warmup"] + p["reps"]):
            for name, fn in variants.items():
                t = slowest_rank_seconds(fn)
                if rep >= p["warmup"]:
                    times[name].append(t)
        out["times"][loss_name] = {k: statistics.median(v) for k, v in times.items()}
        out.update(params=params, dim=dim)
    if world > 1:  # collective sweep: per-rank input bytes n (fp32)
        sweep = []
        for n in p["sweep_sizes"]:
            x = torch.randn(n // 4)
            outs = [torch.empty_like(x) for _ in range(world)]
            for op, fn in (
                ("all_reduce", lambda: dist.all_reduce(x)),
                ("all_gather", lambda: dist.all_gather(outs, x)),
            ):
                ts = [slowest_rank_seconds(fn) for _ in range(p["sweep_reps"] + 1)][1:]
                sweep.append({"op": op, "bytes": n, "seconds": statistics.median(ts)})
        out["sweep"] = sweep
    return out


def measure(world: int, p: dict) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, p, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=900)
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"scaling worker (world {world}) exited with {proc.exitcode}")
    return result


# ----------------------------------------------------------------------------- the model
def ring_cost(op: str, n: float, k: int, alpha: float, bw: float) -> float:
    if k <= 1:
        return 0.0
    steps, wire = {
        "all_reduce": (2 * (k - 1), 2 * (k - 1) / k * n),
        "all_gather": (k - 1, (k - 1) * n),
        "reduce_scatter": (k - 1, (k - 1) / k * n),
    }[op]
    return steps * alpha + wire / bw


def _fit(points: list[dict], k: int) -> dict:
    import numpy as np

    rows, ys = [], []
    for s in points:
        steps = 2 * (k - 1) if s["op"] == "all_reduce" else k - 1
        wire = 2 * (k - 1) / k * s["bytes"] if s["op"] == "all_reduce" else (k - 1) * s["bytes"]
        rows.append([steps, wire])
        ys.append(s["seconds"])
    a, rel = np.asarray(rows, dtype=float), np.asarray(ys)
    # relative least squares: small and large messages weigh alike
    coef, *_ = np.linalg.lstsq(a / rel[:, None], np.ones_like(rel), rcond=None)
    return {"alpha_s": float(max(coef[0], 1e-7)), "bw_Bps": float(1 / max(coef[1], 1e-12))}


def fit_collectives(sweep: list[dict], k: int = 2) -> dict:
    """Least-squares α (per ring step) and bw of time = steps·α + wire/bw: one pair per op (gloo's all_gather
    is slower per byte than its all_reduce; reduce_scatter is modelled with the all_gather pair) and one for all."""
    per_op = {op: _fit([s for s in sweep if s["op"] == op], k) for op in ("all_reduce", "all_gather")}
    per_op["reduce_scatter"] = per_op["all_gather"]
    return {**_fit(sweep, k), "per_op": per_op}


def cost(scenario: dict, op: str, n: float, k: int) -> float:
    params = scenario.get("per_op", {}).get(op, scenario)
    return ring_cost(op, n, k, params["alpha_s"], params["bw_Bps"])


def model_rows(s: dict) -> list[dict]:
    rows = []
    for k in MODEL_RANKS:
        b, d = s["batch"], s["dim"]
        grad = cost(s, "all_reduce", 4 * s["params"], k)
        v3 = cost(s, "all_gather", 2 * b * d * 4 + b * 8, k) + cost(s, "all_reduce", 2 * k * b * 4, k)
        oc = 2 * cost(s, "all_gather", b * d * 4, k) + 2 * cost(s, "reduce_scatter", k * b * d * 4, k)
        step_v3, step_oc = s["compute_s"] + grad + v3, s["compute_s"] + grad + oc
        rows.append(
            {
                "ranks": k,
                "compute_s": s["compute_s"],
                "grad_all_reduce_s": grad,
                "loss_comm_v3_s": v3,
                "loss_comm_openclip_s": oc,
                "step_v3_s": step_v3,
                "step_openclip_s": step_oc,
                "efficiency_v3": s["compute_s"] / step_v3,
                "efficiency_openclip": s["compute_s"] / step_oc,
                "samples_per_s_v3": k * b / step_v3,
                "samples_per_s_openclip": k * b / step_oc,
            }
        )
    return rows


def build_result(w1: dict, w2: dict, p: dict, info: dict) -> dict:
    measured = []
    for loss in p["losses"]:
        t1, t2 = w1["times"][loss], w2["times"][loss]
        grad = max(0.0, t2["step"] - t2["step_no_sync"])
        loss_comm = max(0.0, t2["loss_alone"] - t1["loss_alone"])
        measured.append(
            {
                "loss": loss,
                "step_1proc_s": t1["step"],
                "step_2proc_s": t2["step"],
                "step_2proc_no_sync_s": t2["step_no_sync"],
                "grad_sync_s": grad,
                "grad_all_reduce_alone_s": t2["grad_all_reduce"],
                "loss_alone_1proc_s": t1["loss_alone"],
                "loss_alone_2proc_s": t2["loss_alone"],
                "loss_comm_s": loss_comm,
                "other_s": t2["step"] - t1["step"] - grad - loss_comm,
            }
        )
    fit = fit_collectives(w2["sweep"])
    local = {
        "name": "fitted: gloo on this machine, tiny-vit",
        **fit,
        "params": w2["params"],
        "batch": p["batch"],
        "dim": w2["dim"],
        "compute_s": w1["times"]["fastclip-v3"]["step"],
    }
    return {
        "machine": info,
        "params": p,
        "measured": measured,
        "sweep": w2["sweep"],
        "fit": fit,
        "scenarios": [
            {"assumptions": local, "rows": model_rows(local)},
            {"assumptions": dict(NCCL_IB), "rows": model_rows(NCCL_IB)},
        ],
    }


def markdown(result: dict) -> str:
    p = result["params"]
    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    lines = [
        f"**Measured** (gloo, 1 thread per process, {p['arch']}, {p['batch']} per process, synthetic batches, "
        f"median of {p['reps']} interleaved repetitions, slowest rank), ms per step:",
        "",
        "| loss | step, 1 proc (compute) | step, 2 procs | 2 procs, DDP no_sync | gradient sync (= diff.) | "
        "grad all_reduce alone | loss alone 1 / 2 procs | loss comm (= diff.) | other (contention) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in result["measured"]:
        lines.append(
            f"| {m['loss']} | {ms(m['step_1proc_s'])} | {ms(m['step_2proc_s'])} | "
            f"{ms(m['step_2proc_no_sync_s'])} | {ms(m['grad_sync_s'])} | {ms(m['grad_all_reduce_alone_s'])} | "
            f"{ms(m['loss_alone_1proc_s'])} / {ms(m['loss_alone_2proc_s'])} | {ms(m['loss_comm_s'])} | "
            f"{ms(m['other_s'])} |"
        )
    f = result["fit"]
    fits = ", ".join(
        f"{op}: α = {1e6 * v['alpha_s']:.1f} µs per ring step, bw = {v['bw_Bps'] / 1e9:.2f} GB/s"
        for op, v in f["per_op"].items()
        if op != "reduce_scatter"
    )
    lines += [
        "",
        f"Collective sweep on gloo (2 processes, {len(result['sweep'])} points) fitted per op to "
        f"steps·α + wire/bw: **{fits}** (reduce_scatter modelled with all_gather's pair).",
        "",
        "| op | bytes per rank | measured ms | fit ms |",
        "|---|---:|---:|---:|",
    ]
    for s in result["sweep"]:
        lines.append(
            f"| {s['op']} | {s['bytes']:,} | {1000 * s['seconds']:.3f} | {1000 * cost(f, s['op'], s['bytes'], 2):.3f} |"
        )
    for sc in result["scenarios"]:
        a = sc["assumptions"]
        pair = (
            "the fitted pairs above"
            if "per_op" in a
            else f"α = {1e6 * a['alpha_s']:.1f} µs per ring step, bw = {a['bw_Bps'] / 1e9:.2f} GB/s"
        )
        lines += [
            "",
            f"**MODEL, not a measurement** - {a['name']}: {pair}, P = {a['params'] / 1e6:.1f} M parameters "
            f"(fp32 gradients), B = {a['batch']} per rank, d = {a['dim']}, compute = {ms(a['compute_s'])} ms per step; "
            f"no overlap of communication with compute (upper bound).",
            "",
            "| ranks | compute ms | grad all_reduce ms | loss comm v3 ms | loss comm openclip ms | step v3 ms | "
            "step openclip ms | efficiency v3 | efficiency openclip |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sc["rows"]:
            lines.append(
                f"| {r['ranks']} | {ms(r['compute_s'])} | {ms(r['grad_all_reduce_s'])} | "
                f"{ms(r['loss_comm_v3_s'])} | {ms(r['loss_comm_openclip_s'])} | {ms(r['step_v3_s'])} | "
                f"{ms(r['step_openclip_s'])} | {r['efficiency_v3']:.2f} | {r['efficiency_openclip']:.2f} |"
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    ax = axes[0]
    for op, marker in (("all_reduce", "o"), ("all_gather", "s")):
        pts = [s for s in result["sweep"] if s["op"] == op]
        xs = [s["bytes"] for s in pts]
        dense = [xs[0] * (xs[-1] / xs[0]) ** (i / 40) for i in range(41)]
        ax.scatter(xs, [1000 * s["seconds"] for s in pts], marker=marker, label=f"{op} measured")
        ax.plot(dense, [1000 * cost(result["fit"], op, x, 2) for x in dense], ls="--", label=f"{op} fit")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank", fontsize=8)
    ax.set_ylabel("ms (2 processes, gloo)", fontsize=8)
    ax.set_title("measured collectives + fit", fontsize=9)
    ax.legend(fontsize=7)
    for ax, sc in zip(axes[1:], result["scenarios"]):
        rows = [r for r in sc["rows"] if r["ranks"] > 1]  # nothing to communicate at 1
        ks = [r["ranks"] for r in rows]
        for key, label, style in (
            ("step_openclip_s", "step, openclip loss", "-"),
            ("step_v3_s", "step, fastclip-v3", "-"),
            ("compute_s", "compute", ":"),
            ("grad_all_reduce_s", "gradient all_reduce", "--"),
            ("loss_comm_openclip_s", "loss comm, openclip", "-."),
            ("loss_comm_v3_s", "loss comm, fastclip-v3", "-."),
        ):
            ax.plot(ks, [1000 * max(r[key], 1e-9) for r in rows], ls=style, marker=".", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (GPUs / processes)", fontsize=8)
        ax.set_ylabel("ms per step", fontsize=8)
        ax.set_title("MODEL: " + sc["assumptions"]["name"], fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    save_figure(
        fig,
        path,
        result["machine"],
        "Scaling: measured collective costs (left) and a latency-bandwidth "
        "MODEL of the step (middle, right; not measurements)",
        top=0.93,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (CI smoke)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    p = dict(QUICK if args.quick else FULL)
    out = args.out or (SMOKE_OUT if args.quick else RESULTS)
    info = machine_info()
    w1, w2 = measure(1, p), measure(2, p)
    result = build_result(w1, w2, p, info)
    publish(out, "scaling", result, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
