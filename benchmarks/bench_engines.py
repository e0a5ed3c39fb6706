"""Training-step throughput of the trainer's data-parallel backends: DDP vs DeepSpeed ZeRO-1/2/3, and gradient
accumulation (optim.accum_steps 1 vs 2 at the same global batch), in 2 real processes (gloo, one CPU thread
each), tiny-vit + fastclip-v3, fp32, the same synthetic batches for every configuration.

    python benchmarks/bench_engines.py            # writes benchmarks/results/engines_bench.{md,json}
    python benchmarks/bench_engines.py --quick    # CI smoke (few steps), writes benchmarks/out/

Every configuration is built in the same two processes (its own towers, loss and optimizer, same seed) and
the configurations run interleaved, one step each in turn, after warm-up steps, so machine load hits them
alike. A step is the trainer's (fastclip/train/engine.py): forward, backward, gradient norm, optimizer step,
clamp; its time is the slowest rank's, the table shows the median. Data loading is not included. After the
timed steps every configuration has trained on the same batches: the last column is its largest parameter
difference to DDP (ZeRO: the same arithmetic; accumulation: another float summation order).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastclip.distributed import destroy_process_group

from common import RESULTS, SMOKE_OUT, check_out, free_port, machine_info, write_json  # noqa: E402

WORLD_SIZE = 2
PER_RANK = 64  # samples per process per step (the embedded recipe's batch)
DATA_SIZE = 10_000
CONFIGS = [  # label, train.distributed, deepspeed.stage, accum_steps
    ("DDP", "ddp", 0, 1),
    ("ZeRO-1", "deepspeed", 1, 1),
    ("ZeRO-2", "deepspeed", 2, 1),
    ("ZeRO-3", "deepspeed", 3, 1),
    ("DDP, accum 2", "ddp", 0, 2),
    ("ZeRO-2, accum 2", "deepspeed", 2, 2),
]
FULL = dict(steps=20, warmup=3)
QUICK = dict(steps=3, warmup=1)


def _build(label: str, distributed: str, stage: int, accum: int, rank: int):
    from fastclip.distributed import DistInfo
    from fastclip.train.config import load_config
    from fastclip.train.net import build_net

    cfg = load_config(
        None,
        [
            "--train.distributed",
            distributed,
            "--deepspeed.stage",
            str(stage or 2),
            "--data.batch_size",
            str(PER_RANK),
            "--optim.accum_steps",
            str(accum),
            "--loss.rho",
            "6.5",
            "--loss.gamma_min",
            "0.2",
            "--loss.temperature",
            "0.07",
            # stage 3: shard every tensor (the tiny model has none above the default threshold
            # of 1e5 elements but the token embedding)
            "--deepspeed.param_persistence_threshold",
            "0",
            "--train.seed",
            "0",
        ],
    )  # the towers' init the published numbers were measured with
    engine = build_net(cfg, DistInfo(rank, WORLD_SIZE, rank, torch.device("cpu"), "bench", False), DATA_SIZE).engine
    for g in engine.param_groups:
        g["lr"] = 2e-4 if g["name"] == "temperature" else 1e-3
    return engine


def _memory(engine) -> dict:
    """Elements this rank holds: parameters, and optimizer state (Adam moments + any separate fp32 master)."""
    params = sum(getattr(p, "ds_tensor", p).numel() for p in engine.model.parameters())
    if engine.name == "ddp":
        opt, master = engine.optimizer, 0
    else:
        zero = engine.optimizer
        opt = getattr(zero, "optimizer", zero)  # ZeRO's wrapped torch AdamW
        flat = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(
            zero, "fp32_partitioned_groups_flat", []
        )
        master = sum(t.numel() for t in flat)  # ZeRO-1/2 / ZeRO-3 fp32 master partitions
    moments = sum(t.numel() for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    return {"params_held": params, "optimizer_state": moments + master}


def _step(engine, batch, epoch: int) -> None:
    images, texts, indices = batch
    loss = engine.forward(images, texts, indices, epoch)
    engine.backward(loss)
    engine.grad_norm(None)
    engine.step()
    engine.loss_fn.clamp_()


def _worker(rank: int, port: int, out: str, steps: int, warmup: int):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(minutes=10),
    )
    _measure(rank, out, steps, warmup)  # its engines are gone when it returns: none may outlive the group
    dist.barrier()
    destroy_process_group()


def _measure(rank: int, out: str, steps: int, warmup: int) -> None:
    gen = torch.Generator().manual_seed(123)
    batches = []
    for _ in range(warmup + steps):  # the same global batches for every configuration; this rank's rows
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        batches.append(
            (
                torch.randn(WORLD_SIZE * PER_RANK, 3, 32, 32, generator=gen)[rows],
                torch.randint(0, 49408, (WORLD_SIZE * PER_RANK, 32), generator=gen)[rows],
                torch.randperm(DATA_SIZE, generator=gen)[: WORLD_SIZE * PER_RANK][rows],
            )
        )
    engines = [_build(*config, rank) for config in CONFIGS]
    times = [[] for _ in CONFIGS]
    for i, batch in enumerate(batches):
        for c, engine in enumerate(engines):
            dist.barrier()
            start = time.perf_counter()
            _step(engine, batch, epoch=0)
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times[c].append(float(elapsed))
    states = [engine.model_state_dict() for engine in engines]  # collective (ZeRO-3 gathers)
    memory = [_memory(engine) for engine in engines]
    if rank == 0:
        ref = states[0]
        diffs = [max((s[k].float() - ref[k].float()).abs().max().item() for k in ref) for s in states]
        torch.save({"times": times, "memory": memory, "param_diff": diffs}, Path(out) / "result.pt")


def _table(result: dict, info: dict, steps: int, warmup: int) -> tuple[str, list[dict]]:
    rows, ddp_rate = [], None
    for (label, distributed, stage, accum), times, memory, diff in zip(
        CONFIGS, result["times"], result["memory"], result["param_diff"]
    ):
        median = statistics.median(times)
        rate = WORLD_SIZE * PER_RANK / median
        if label == "DDP":
            ddp_rate = rate
        rows.append(
            {
                "config": label,
                "distributed": distributed,
                "stage": stage if distributed == "deepspeed" else None,
                "accum_steps": accum,
                "micro_batch_per_rank": PER_RANK // accum,
                "global_batch": WORLD_SIZE * PER_RANK,
                "step_ms_median": 1000 * median,
                "step_ms_min": 1000 * min(times),
                "samples_per_s": rate,
                "vs_ddp": rate / ddp_rate,
                "params_held_per_rank": memory["params_held"],
                "optimizer_state_per_rank": memory["optimizer_state"],
                "max_param_diff_vs_ddp": diff,
            }
        )
    head = (
        f"# Backend benchmark: DDP vs DeepSpeed ZeRO-1/2/3, gradient accumulation\n\n"
        f"{info['date']} - {info['cpu']}, {info['cores']} cores - torch {info['torch']}, deepspeed "
        f"{info.get('deepspeed')} - gloo (CPU), {WORLD_SIZE} processes x 1 thread - tiny-vit (7.2M parameters) + "
        f"fastclip-v3, fp32, global batch {WORLD_SIZE * PER_RANK} - median of {steps} steps after {warmup} warm-up "
        f"steps, configurations interleaved step by step. 1-min load average before/after: "
        f"{info['loadavg'][0]:.2f}/{info['loadavg_after'][0]:.2f} (other jobs on the machine inflate absolute "
        f"times; interleaving keeps the comparison fair).\n\n"
        "Step = forward + backward + gradient norm + optimizer step (the trainer's, fastclip/train/engine.py), "
        "no data loading. Params held / optimizer state: elements on one rank (optimizer state = Adam moments "
        "plus ZeRO's separate fp32 master partition). Last column: largest parameter difference to DDP after "
        "all steps (the same batches for every configuration).\n\n"
    )
    lines = [
        "| config | micro-batch/rank | step ms (median) | samples/s | vs DDP | params held/rank (M) | "
        "optimizer state/rank (M) | max abs param diff vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['micro_batch_per_rank']} | {r['step_ms_median']:.0f} | "
            f"{r['samples_per_s']:.0f} | {r['vs_ddp']:.2f} | {r['params_held_per_rank'] / 1e6:.2f} | "
            f"{r['optimizer_state_per_rank'] / 1e6:.2f} | {r['max_param_diff_vs_ddp']:.1e} |"
        )
    notes = (
        "\nReading: with K ranks and P trainable elements, DDP holds P parameters and 2P Adam moments per rank; "
        "ZeRO-1/2 hold P parameters plus 3P/K (moments and an fp32 master partition, which fp32 training does "
        "not need but ZeRO keeps), ZeRO-3 P/K parameters plus 3P/K. ZeRO-2 also frees the full gradient after "
        "its reduce-scatter (not counted here). On 2 CPU processes over gloo ZeRO's extra collectives and "
        "copies cost time; its point is memory at scale. Accumulation (GradCache) runs the towers' forward "
        "twice: the price of activation memory for batch/k samples; the estimator is unchanged.\n"
    )
    return head + "\n".join(lines) + "\n" + notes, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps (CI smoke); results to benchmarks/out/")
    parser.add_argument("--out", type=Path, help="folder for engines_bench.{md,json} (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    plan = QUICK if args.quick else FULL
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    info = machine_info()
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        print("bench_engines: deepspeed is not installed (pip install deepspeed==0.19.8)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as out:
        mp.spawn(_worker, args=(free_port(), out, plan["steps"], plan["warmup"]), nprocs=WORLD_SIZE, join=True)
        result = torch.load(Path(out) / "result.pt", weights_only=True)
    info["loadavg_after"] = list(os.getloadavg())
    text, rows = _table(result, info, plan["steps"], plan["warmup"])
    folder = args.out or (SMOKE_OUT if args.quick else RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "engines_bench.md").write_text(text)
    write_json(
        folder / "engines_bench.json",
        {"machine": info, "plan": plan, "world_size": WORLD_SIZE, "per_rank_batch": PER_RANK, "rows": rows},
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
