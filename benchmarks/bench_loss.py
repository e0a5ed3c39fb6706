"""Forward + backward + communication time and bytes per step: fastclip-v3 vs open_clip's ClipLoss
(local_loss=True, gather_with_grad=True), in 2 real processes (gloo, one CPU thread each).

    python benchmarks/bench_loss.py            # B in {64, 256, 1024} x d in {64, 512}, writes benchmarks/results/
    python benchmarks/bench_loss.py --quick    # one tiny configuration (CI smoke), writes benchmarks/out/
    python benchmarks/bench_loss.py --against HEAD~1   # also v3 as committed at a revision, paired step by step

The losses run interleaved inside each configuration (one step of each, in an order that rotates every
repetition) on the same features, after warm-up steps; a step's time is the slowest rank's. Small steps are
repeated more (reps x 1024/B: a few ms each, they are the noisiest); the table shows medians. Bytes are per
rank per step, by ring formulas (all_gather (K-1)/K·output, all_reduce 2(K-1)/K, reduce-scatter/all-to-all
(K-1)/K·input): fastclip's from ``loss_fn.comm_bytes``; ClipLoss's measured by wrapping the torch.distributed
calls it makes (forward all_gathers, backward scatters on gloo).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fastclip.compat import import_open_clip
from fastclip.distributed import destroy_process_group

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastclip.losses import build_loss
from fastclip.losses.byte_counter import CollectiveByteCounter

from common import REPO, check_out, count, slowest_rank_seconds  # noqa: E402

WORLD_SIZE = 2  # the default; --world-size changes it (plan["world_size"])
DATA_SIZE = 10**6
FULL = dict(batch_sizes=(64, 256, 1024), dims=(64, 512), reps=31, warmup=3)
QUICK = dict(batch_sizes=(64,), dims=(64,), reps=3, warmup=1)
MODES = ("deferred", "eager", "off")  # the loss option validate (fastclip/losses/validation.py)
FUSED = "fused"  # deferred checks and the loss option fused_kernels (fastclip/losses/kernels.py)
SPLIT = {
    "fastclip-v3-deferred": "fastclip-v3 (deferred)",
    f"fastclip-v3-{FUSED}": "fastclip-v3 (fused)",
    "openclip": "ClipLoss",
}
MALLOC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
PREVIOUS = "fastclip-v3-previous"  # v3 (deferred) at the revision --against names
READ_EVERY = 10  # deferred checks are read back every 10 calls: the trainer reads them on logging steps (log_every 10)


def _features(batch: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(batch, dim, generator=gen), dim=1).requires_grad_()
    text = F.normalize(torch.randn(batch, dim, generator=gen), dim=1).requires_grad_()
    indices = torch.randint(0, DATA_SIZE, (batch,), generator=gen)
    return image, text, indices


def _bench_config(rank: int, batch: int, dim: int, reps: int, warmup: int, previous=None) -> dict:
    """One configuration; ``previous``: the build_loss of fastclip at another revision (--against), whose v3
    (deferred checks) runs interleaved with the others."""
    open_clip = import_open_clip()
    world_size = dist.get_world_size()
    clip = open_clip.loss.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world_size)
    modes = {mode: build_loss("fastclip-v3", data_size=DATA_SIZE, validate=mode) for mode in MODES}
    # the exponentials as compiled kernels (loss option fused_kernels), deferred checks
    modes[FUSED] = build_loss("fastclip-v3", data_size=DATA_SIZE, validate="deferred", fused_kernels=True)
    fast = modes["deferred"]
    logit_scale = torch.nn.Parameter(fast.logit_scale.detach().clone())
    image, text, indices = _features(batch, dim, seed=1000 * rank + batch + dim)

    calls = {mode: 0 for mode in modes}

    def v3_step(mode):
        loss_fn = modes[mode]
        loss_fn(image, text, indices, epoch=1).backward()
        calls[mode] += 1
        if loss_fn.validate == "deferred" and calls[mode] % READ_EVERY == 0:  # as the trainer: logging steps
            loss_fn.check_inputs()

    # epoch 1: γ < 1, the u update proper (the first visit of a sample is the same work)
    steps = {f"fastclip-v3-{mode}": (lambda m=mode: v3_step(m)) for mode in modes}
    steps["openclip"] = lambda: clip(image, text, logit_scale.exp()).backward()
    # each loss with both implementations (fastclip/losses/objective.py), deferred checks; dcl has autograd only
    impls = {f"{name} {impl}": _impl_loss(name, impl) for name, impl in IMPLS}
    for label, loss_fn in impls.items():
        steps[label] = lambda f=loss_fn: _deferred_step(f, image, text, indices, calls)
    if previous is not None:
        before = previous("fastclip-v3", data_size=DATA_SIZE, validate="deferred")
        calls["previous"] = 0

        def previous_step():
            before(image, text, indices, epoch=1).backward()
            calls["previous"] += 1
            if calls["previous"] % READ_EVERY == 0:
                before.check_inputs()

        steps[PREVIOUS] = previous_step
    times = {name: [] for name in steps}
    names = list(steps)
    for rep in range(warmup + reps):
        # the order rotates every repetition: no loss always runs right after another one (cache, allocator)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            elapsed = slowest_rank_seconds(steps[name])
            if rep >= warmup:
                times[name].append(elapsed)
    with CollectiveByteCounter() as counter:
        steps["openclip"]()
    split = {name: _time_split(steps[name], reps) for name in SPLIT}
    # one call each (a deferred read every 10th call is not in it)
    ops = {"fastclip-v3-deferred": dispatched_ops(lambda: fast(image, text, indices, epoch=1).backward())}
    ops["openclip"] = dispatched_ops(steps["openclip"])
    return {
        "B": batch,
        "d": dim,
        "reps": reps,
        **{f"fastclip_{mode}_ms": 1e3 * statistics.median(times[f"fastclip-v3-{mode}"]) for mode in modes},
        # each v3 step against the ClipLoss step next to it in time (a slow moment of the machine hits both)
        **{
            f"paired_ratio_{mode}": statistics.median(
                v / c for v, c in zip(times[f"fastclip-v3-{mode}"], times["openclip"])
            )
            for mode in modes
        },
        "openclip_ms": 1e3 * statistics.median(times["openclip"]),
        **(
            {
                "previous_ms": 1e3 * statistics.median(times[PREVIOUS]),
                # this revision's v3 over the other's, step by step (both deferred)
                "paired_ratio_vs_previous": statistics.median(
                    v / p for v, p in zip(times["fastclip-v3-deferred"], times[PREVIOUS])
                ),
            }
            if PREVIOUS in times
            else {}
        ),
        "impl_ms": {label: 1e3 * statistics.median(times[label]) for label in impls},
        # autograd over fused, step by step (each pair runs in the same repetition)
        "impl_ratio": {
            name: statistics.median(a / f for a, f in zip(times[f"{name} autograd"], times[f"{name} fused"]))
            for name, impl in IMPLS
            if impl == "fused"
        },
        "split": split,
        "fastclip_ops": ops["fastclip-v3-deferred"],
        "openclip_ops": ops["openclip"],
        "fastclip_bytes": dict(fast.comm_bytes),
        "openclip_bytes": counter.total,
        "openclip_bytes_by_call": dict(counter.bytes),
    }


IMPLS = [(name, impl) for name in ("fastclip-v3", "openclip") for impl in ("fused", "autograd")] + [("dcl", "autograd")]


def _impl_loss(name: str, impl: str):
    options = {"data_size": DATA_SIZE} if name.startswith("fastclip") else {}
    return build_loss(name, impl=impl, validate="deferred", **options)


def _deferred_step(loss_fn, image, text, indices, calls: dict) -> None:
    loss_fn(image, text, indices, epoch=1).backward()
    calls[loss_fn] = calls.get(loss_fn, 0) + 1
    if calls[loss_fn] % READ_EVERY == 0:  # as the trainer: on logging steps
        loss_fn.check_inputs()


def _impl_table(rows: list[dict]) -> str:
    names = [f"{name} {impl}" for name, impl in IMPLS]
    ratios = [name for name, impl in IMPLS if impl == "fused"]
    lines = [
        "| B | d | "
        + " | ".join(f"{n} ms" for n in names)
        + " | "
        + " | ".join(f"{n} autograd/fused" for n in ratios)
        + " |",  # fmt: skip
        "|---:|---:|" + "---:|" * (len(names) + len(ratios)),
    ]
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['d']} | "
            + " | ".join(f"{r['impl_ms'][n]:.2f}" for n in names)
            + " | "
            + " | ".join(f"{r['impl_ratio'][n]:.2f}" for n in ratios)
            + " |"
        )
    return "\n".join(lines)


def _time_split(step, reps: int) -> dict:
    """This rank's step time split into the time inside collectives (blocking on gloo: the wait for the other rank
    and the transfer) and the rest (the loss's own work), over ``reps`` steps. The wait is heavy-tailed on a small
    VM (a blocked process is sometimes woken a scheduler tick late), so its mean and 90th percentile are kept."""
    steps, waits, calls = [], [], 0
    for _ in range(reps):
        dist.barrier()
        with CollectiveByteCounter() as counter:
            start = time.perf_counter()
            step()
            steps.append(time.perf_counter() - start)
        waits.append(sum(counter.seconds.values()))
        calls = sum(counter.calls.values())
    local = [s - w for s, w in zip(steps, waits)]
    return {
        "collectives_per_step": calls,
        "local_ms": 1e3 * statistics.median(local),
        "collective_ms_median": 1e3 * statistics.median(waits),
        "collective_ms_mean": 1e3 * statistics.fmean(waits),
        "collective_ms_p90": 1e3 * statistics.quantiles(waits, n=10)[-1] if len(waits) > 1 else 1e3 * waits[0],
    }


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops one step dispatches (forward, backward, collectives): at small shapes each costs a few
    microseconds whatever its size, so their number is what a step pays beyond its arithmetic."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops(step) -> int:
    with _OpCounter() as counter:
        step()
    return counter.count


def _worker(rank: int, port: int, plan: dict, out_file: str) -> None:
    torch.set_num_threads(1)
    previous = None
    if plan.get("against"):  # the other revision's fastclip, extracted under another package name
        sys.path.insert(0, plan["against"]["path"])
        previous = importlib.import_module(f"{PREVIOUS_PACKAGE}.losses").build_loss
    # open_clip's ClipLoss calls the autograd all_gather that torch 2.13 marks deprecated, every step
    warnings.filterwarnings("ignore", message=r".*all_gather.* is deprecated", category=FutureWarning)
    world_size = plan.get("world_size", WORLD_SIZE)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    rows = [
        _bench_config(rank, b, d, plan["reps"] * max(1, 1024 // b), plan["warmup"], previous)
        for b in plan["batch_sizes"]
        for d in plan["dims"]
    ]
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    destroy_process_group()


PREVIOUS_PACKAGE = "fastclip_previous"


def _extract_revision(rev: str, into: Path) -> str:
    """``fastclip/`` as committed at ``rev``, as the package PREVIOUS_PACKAGE under ``into``; its short hash."""

    def git(*args, **kw):
        return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, **kw).stdout

    try:
        short = git("rev-parse", "--short", f"{rev}^{{commit}}", text=True).strip()
    except subprocess.CalledProcessError:
        raise ValueError(f"--against {rev!r} is not a revision of this repository (git rev-parse failed)") from None
    archive = git("archive", "--format=tar", short, "fastclip")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "fastclip").rename(into / PREVIOUS_PACKAGE)
    return short


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _table(rows: list[dict], against: str | None = None) -> str:
    extra = bool(against)
    lines = [
        "| B | d | v3 deferred ms | v3 eager ms | v3 off ms | v3 fused ms | ClipLoss ms | deferred/Clip | eager/Clip | "
        "off/Clip | fused/Clip | v3 feature bytes | v3 total bytes | ClipLoss bytes | feature bytes v3/Clip | "
        "total bytes v3/Clip | ops per call v3 / Clip |" + (f" deferred v3 / at {against} |" if extra else ""),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|" if extra else ""),
    ]
    for r in rows:
        fb, tb, cb = r["fastclip_bytes"]["features"], r["fastclip_bytes"]["total"], r["openclip_bytes"]
        ms = [r[f"fastclip_{mode}_ms"] for mode in (*MODES, FUSED)]
        clip = r["openclip_ms"]
        ratios = [r[f"paired_ratio_{mode}"] for mode in (*MODES, FUSED)]
        lines.append(
            f"| {r['B']} | {r['d']} | {' | '.join(f'{t:.2f}' for t in ms)} | {clip:.2f} | "
            f"{' | '.join(f'{x:.2f}' for x in ratios)} | {fb:,} | {tb:,} | {cb:,} | {_ratio(fb, cb)} | "
            f"{_ratio(tb, cb)} | "
            f"{r['fastclip_ops']} / {r['openclip_ops']} |"
            + (f" {r['paired_ratio_vs_previous']:.3f} |" if extra else "")
        )
    return "\n".join(lines)


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.3f}" if b else "–"  # (one process moves no bytes)


def _split_table(rows: list[dict]) -> str:
    lines = [
        "| B | d | loss | collectives per step | own work ms (median) | in collectives ms: median | mean | p90 |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for name, label in SPLIT.items():
            x = r["split"][name]
            lines.append(
                f"| {r['B']} | {r['d']} | {label} | {x['collectives_per_step']} | {x['local_ms']:.2f} | "
                f"{x['collective_ms_median']:.2f} | {x['collective_ms_mean']:.2f} | {x['collective_ms_p90']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tiny configuration (CI smoke run)")
    parser.add_argument("--reps", type=count(), default=None, help="measured steps per loss and configuration")
    parser.add_argument("--out", type=Path, default=None, help="folder for loss_bench.md/.json")
    parser.add_argument(
        "--against",
        metavar="REV",
        default=None,
        help="also time fastclip-v3 as committed at this git revision, step by step against this tree's",
    )
    parser.add_argument("--batch-sizes", type=count(), nargs="+", default=None, help="B per rank (default: the plan's)")
    parser.add_argument("--dims", type=count(), nargs="+", default=None, help="feature dimensions d (the plan's)")
    parser.add_argument("--world-size", type=count(), default=WORLD_SIZE, help="processes (gloo), default 2")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    plan = dict(QUICK if args.quick else FULL)
    if args.reps:
        plan["reps"] = args.reps
    if args.batch_sizes:
        plan["batch_sizes"] = tuple(args.batch_sizes)
    if args.dims:
        plan["dims"] = tuple(args.dims)
    plan["world_size"] = args.world_size
    with tempfile.TemporaryDirectory(prefix="bench_loss_") as tmp:
        if args.against:
            try:
                plan["against"] = {"rev": _extract_revision(args.against, Path(tmp)), "path": tmp}
            except ValueError as err:
                parser.error(str(err))  # exit code 2
        return _run(args, plan)


def _run(args, plan: dict) -> int:
    out_dir = args.out or Path(__file__).parent / ("out" if args.quick else "results")
    against = plan.get("against", {}).get("rev")
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # glibc malloc hands large freed blocks back to the system, so a call's [B, N] temporaries page-fault fresh
    # memory on some calls and not on others, by the heap's history: the same v3 call measured 16-27 ms at
    # B = 1024, d = 64. Keeping freed memory (as a GPU's caching allocator does) times the losses' work instead;
    # the spawned workers read these at start-up.
    for name, value in MALLOC_KEEP.items():
        os.environ.setdefault(name, value)
    raw = out_dir / "loss_bench.raw.json"
    started, load_before = time.time(), os.getloadavg()[0]
    world_size = plan.get("world_size", WORLD_SIZE)
    mp.start_processes(_worker, args=(_free_port(), plan, str(raw)), nprocs=world_size, start_method="spawn")
    rows = json.loads(raw.read_text())
    raw.unlink()
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{platform.processor() or ''}".strip(", "),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "backend": "gloo (CPU)",
        "world_size": world_size,
        "threads_per_process": 1,
        "dtype": "float32",
        "plan": plan,
        "wall_s": round(time.time() - started, 1),
        # other work on the machine inflates absolute times; interleaving keeps the ratios fair
        "load_average_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "malloc": {name: os.environ[name] for name in MALLOC_KEEP},
        "against": against,
    }
    table = _table(rows, against)
    md = "\n".join(
        [
            "# Loss benchmark: fastclip-v3 vs open_clip ClipLoss(local_loss=True, gather_with_grad=True)",
            "",
            f"{header['date']} - {header['machine']} - torch {header['torch']} - {header['backend']}, "
            f"{world_size} process(es) x 1 thread, float32 features, median of {plan['reps']} x 1024/B steps after "
            f"{plan['warmup']} warm-up steps, interleaved. 1-min load average before/after: "
            f"{header['load_average_1min']['before']}/{header['load_average_1min']['after']} "
            "(other jobs on the machine inflate absolute times; the interleaving keeps the ratios comparable). "
            "glibc malloc keeps freed memory (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), as a GPU's caching "
            "allocator does: otherwise a call's large temporaries page-fault fresh memory on some calls and not on "
            "others, by the heap's history.",
            "",
            "Time: forward + backward + communication of the loss alone (features are leaf tensors), slowest rank. "
            "Ratios: the median over repetitions of each v3 step's time over the ClipLoss step next to it. "
            "v3 with each value of the loss option `validate`: `deferred` (the trainer's default: the input checks "
            f"ride in the feature all_gather, no extra collective; read back every {READ_EVERY}th call here, as the "
            "trainer reads them on its logging steps at the default train.log_every), `eager` (the library "
            "default: the same words, read back in every call before the state is written: a host sync) and `off`; "
            "`fused`: deferred, with the loss option `fused_kernels` (the exponentials' passes as torch.compile'd "
            "kernels, compiled during the warm-up). "
            "Bytes: per rank per step, ring formulas; ClipLoss counted by wrapping its torch.distributed calls "
            "(2 all_gathers forward, 2 x K scatters backward on gloo). v3 total (deferred) = features + indices + "
            "5 check words + state all_reduce (the warm-up's first call adds the one-time structure handshake "
            "and the broadcast of logit_scale from rank 0). "
            "Ops per call: aten ops one call dispatches on rank 0 (forward, backward, collectives; each costs a few "
            "microseconds whatever its size, which is what decides at small B and d)."
            + (
                f" Last column: this tree's v3 (deferred) over v3 (deferred) as committed at {against}, the median "
                "of their step-by-step ratios (both run interleaved with the others, `--against`)."
                if against
                else ""
            ),
            "",
            table,
            "",
            "Where a step's time goes, on rank 0 (a second pass of the same number of steps, deferred v3 and "
            "ClipLoss): the wall time inside torch.distributed calls (blocking on gloo: the wait for the other rank "
            "plus the transfer) and the rest, the loss's own work. ClipLoss's backward collectives run inside "
            "autograd and count too.",
            "",
            _split_table(rows),
            "",
            "Each loss's two implementations (the loss option `impl`, fastclip/losses/objective.py), deferred checks, "
            "interleaved with the rest: `fused`, the hand-written backward over this rank's B x N blocks; `autograd`, "
            "the objective as autograd code over this rank's B x N rows, whose backward hands each rank the gradient "
            "columns of its own rows in one all_to_all. Ratio: the median of each autograd step's time over its fused "
            "twin's in the same repetition.",
            "",
            _impl_table(rows),
            "",
        ]
    )
    (out_dir / "loss_bench.md").write_text(md)
    (out_dir / "loss_bench.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
