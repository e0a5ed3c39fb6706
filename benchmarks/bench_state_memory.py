"""Per-rank memory of the per-sample state: measured shards on 2 processes, then the formula at LAION-315M scale.

    python benchmarks/bench_state_memory.py          # data_size 1e5..1e7, writes benchmarks/results/state_memory.*
    python benchmarks/bench_state_memory.py --quick  # data_size up to 1e6 (CI smoke) -> benchmarks/out/

Each of 2 processes (gloo) builds fastclip-v3 and fastclip-v2 at each data_size, creates its state shard
(`loss_fn.sample_state()`, what the first training step does) and reports (a) the bytes of the tensors of its
shard (`get_extra_state()`: one value per field and a `seen` flag per owned sample) and (b) its RSS growth
(VmRSS after minus before; the allocator may reuse freed pages, so sizes run in increasing order in a fresh
process per version). The measured bytes per owned sample then give the per-rank bytes at LAION-315M
(data_size 414,080,000, the reference's --data_size) on 32 ranks, beside the reference implementation's
replicated design: every process holds 8 bytes (v3: u_im, u_tt fp32) or 40 bytes (v2: + τ, Adam m, v and a
bound per image and text) per sample of the whole data set.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastclip.distributed import destroy_process_group

from common import RESULTS, SMOKE_OUT, check_out, free_port, machine_info, publish, save_figure

WORLD = 2
LAION_DATA_SIZE, LAION_RANKS = 414_080_000, 32
REPLICATED_BYTES_PER_SAMPLE = {"fastclip-v3": 8, "fastclip-v2": 40}  # reference §3: per process, whole data set
FULL_SIZES = (10**5, 10**6, 10**7)
QUICK_SIZES = (10**4, 10**6)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _worker(rank: int, port: int, sizes: tuple[int, ...], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from fastclip.losses import build_loss

    for version in REPLICATED_BYTES_PER_SAMPLE:  # first-use costs (lazy imports, allocator pools) outside the deltas
        build_loss(version, data_size=64).sample_state()
    rows = []
    for version in REPLICATED_BYTES_PER_SAMPLE:
        for data_size in sizes:
            gc.collect()
            before = _rss_bytes()
            loss_fn = build_loss(version, data_size=data_size)
            shard = loss_fn.sample_state()  # what the first step creates: this rank's shard only
            rss_delta = _rss_bytes() - before
            state = loss_fn.get_extra_state()
            rows.append(
                {
                    "version": version,
                    "data_size": data_size,
                    "rank": rank,
                    "world_size": WORLD,
                    "owned_samples": shard.num_slots,
                    "shard_tensor_bytes": _tensor_bytes(state),
                    "fields": list(state["fields"]),
                    "rss_delta_bytes": rss_delta,
                }
            )
            del loss_fn, shard, state
            dist.barrier()
    queue.put(rows)
    destroy_process_group()


def measure(sizes: tuple[int, ...]) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, sizes, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = [row for _ in procs for row in queue.get(timeout=600)]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"state-memory worker exited with {p.exitcode}")
    return sorted(rows, key=lambda r: (r["version"], r["data_size"], r["rank"]))


def project(rows: list[dict]) -> list[dict]:
    """Per-rank bytes from the measured bytes per owned sample, at data sizes up to LAION and 2..32 ranks."""
    out = []
    for version, replicated in REPLICATED_BYTES_PER_SAMPLE.items():
        largest = max((r for r in rows if r["version"] == version), key=lambda r: r["data_size"])
        per_sample = largest["shard_tensor_bytes"] / largest["owned_samples"]
        for data_size, ranks in (
            (largest["data_size"], WORLD),
            (LAION_DATA_SIZE, WORLD),
            (LAION_DATA_SIZE, 8),
            (LAION_DATA_SIZE, LAION_RANKS),
        ):
            ours = per_sample * -(-data_size // ranks)
            out.append(
                {
                    "version": version,
                    "data_size": data_size,
                    "ranks": ranks,
                    "bytes_per_owned_sample": per_sample,
                    "ours_per_rank_bytes": ours,
                    "replicated_per_process_bytes": replicated * data_size,
                    "ratio_replicated_over_ours": replicated * data_size / ours,
                }
            )
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return str(n)


def markdown(result: dict) -> str:
    lines = [
        "Measured on 2 processes (gloo): this rank's shard after `loss_fn.sample_state()`.",
        "",
        "| version | data_size | rank | owned samples | shard tensor bytes | bytes/owned sample | RSS delta | "
        "replicated design (reference) per process |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["measured"]:
        rep = REPLICATED_BYTES_PER_SAMPLE[r["version"]] * r["data_size"]
        lines.append(
            f"| {r['version']} | {r['data_size']:,} | {r['rank']} | {r['owned_samples']:,} | "
            f"{r['shard_tensor_bytes']:,} ({_fmt_bytes(r['shard_tensor_bytes'])}) | "
            f"{r['shard_tensor_bytes'] / r['owned_samples']:.2f} | {_fmt_bytes(r['rss_delta_bytes'])} | "
            f"{_fmt_bytes(rep)} |"
        )
    lines += [
        "",
        "Projected per rank (measured bytes per owned sample x ceil(data_size / ranks)); the reference "
        "replicates the whole table in every process:",
        "",
        "| version | data_size | ranks | ours per rank | reference per process | reference / ours |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["projected"]:
        lines.append(
            f"| {r['version']} | {r['data_size']:,} | {r['ranks']} | {_fmt_bytes(r['ours_per_rank_bytes'])} "
            f"| {_fmt_bytes(r['replicated_per_process_bytes'])} | {r['ratio_replicated_over_ours']:.1f}x |"
        )
    lines.append(
        "\nOur shard stores one `seen` byte per owned sample besides the fp32 fields (hence 9 and 41 "
        "bytes per owned sample against the reference's 8 and 40 per sample of the whole data set)."
    )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    sizes = np.logspace(4, np.log10(LAION_DATA_SIZE), 50)
    colors = {"fastclip-v3": "#dd8452", "fastclip-v2": "#4c72b0"}
    for version, color in colors.items():
        per = next(r for r in result["projected"] if r["version"] == version)["bytes_per_owned_sample"]
        rep = REPLICATED_BYTES_PER_SAMPLE[version]
        ax.plot(
            sizes, rep * sizes, color=color, ls=":", label=f"{version}: reference, replicated ({rep}·N per process)"
        )
        ax.plot(sizes, per * np.ceil(sizes / 2), color=color, ls="--", label=f"{version}: ours, 2 ranks (formula)")
        ax.plot(sizes, per * np.ceil(sizes / 32), color=color, ls="-", label=f"{version}: ours, 32 ranks (formula)")
        measured = [r for r in result["measured"] if r["version"] == version and r["rank"] == 0]
        ax.scatter(
            [r["data_size"] for r in measured],
            [r["shard_tensor_bytes"] for r in measured],
            color=color,
            marker="o",
            zorder=3,
            label=f"{version}: measured shard, 2 ranks",
        )
        grown = [r for r in measured if r["rss_delta_bytes"] > 0]  # the allocator may reuse freed pages: 0
        ax.scatter(
            [r["data_size"] for r in grown],
            [r["rss_delta_bytes"] for r in grown],
            color=color,
            marker="x",
            s=60,
            zorder=3,
            label=f"{version}: measured RSS delta, 2 ranks",
        )
    ax.set_ylim(1e4, 1e11)
    ax.axvline(LAION_DATA_SIZE, color="0.5", lw=0.8)
    ax.text(LAION_DATA_SIZE, 3e4, "LAION-315M (414M ids) ", fontsize=7, ha="right")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("data_size N (ids the state covers)")
    ax.set_ylabel("per-sample state bytes per rank / process")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left")
    save_figure(fig, path, result["machine"], "Per-sample state memory: sharded (ours) vs replicated (reference)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small data sizes (CI smoke)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    out = args.out or (SMOKE_OUT if args.quick else RESULTS)
    measured = measure(QUICK_SIZES if args.quick else FULL_SIZES)
    result = {"machine": machine_info(), "measured": measured, "projected": project(measured)}
    publish(out, "state_memory", result, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
