"""Each loss's two implementations (the loss option `impl`) on one CUDA device: forward + backward time, and the
float64 agreement of value and gradients on the device.

    python benchmarks/bench_loss_gpu.py --out benchmarks/results/loss_impl_gpu

One process (world size 1: the gather is the identity, so this times the loss math itself, which is what the two
implementations differ in). Times are medians of CUDA-event intervals over --reps steps after a warm-up; the
ratio autograd/fused is the median of per-repetition ratios (each pair runs back to back). It stops with exit 2
on a machine without CUDA; bench_loss.py is the CPU (gloo, 2 ranks) counterpart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastclip.losses import build_loss  # noqa: E402

LOSSES = ["fastclip-v0", "fastclip-v1", "fastclip-v2", "fastclip-v3", "openclip", "siglip", "dcl"]
DATA_SIZE = 1 << 20


def _loss(name: str, impl: str, device, dtype):
    options = {"data_size": DATA_SIZE} if name.startswith("fastclip") else {}
    return build_loss(name, impl=impl, validate="deferred", **options).to(device=device, dtype=dtype)


def _inputs(batch: int, dim: int, device, dtype, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    image = F.normalize(torch.randn(batch, dim, generator=gen, dtype=torch.float64), dim=1)
    text = F.normalize(torch.randn(batch, dim, generator=gen, dtype=torch.float64), dim=1)
    indices = torch.randperm(DATA_SIZE, generator=gen)[:batch]
    to = {"device": device, "dtype": dtype}
    return image.to(**to).requires_grad_(), text.to(**to).requires_grad_(), indices.to(device)


def agreement(name: str, device, batch: int = 256, dim: int = 64) -> dict:
    """Largest relative difference between impl fused and impl autograd, float64 on the device, over 3 steps
    (the per-sample state moves between them): value, both features' gradients, the temperature's gradient."""
    worst = {"value": 0.0, "grad_features": 0.0, "grad_temperature": 0.0}
    losses = {impl: _loss(name, impl, device, torch.float64) for impl in ("fused", "autograd")}
    for step in range(3):
        out = {}
        for impl, loss_fn in losses.items():
            image, text, indices = _inputs(batch, dim, device, torch.float64, seed=step)
            value = loss_fn(image, text, indices, epoch=step)
            value.backward()
            temperature = [p.grad.clone() for p in loss_fn.parameters() if p.grad is not None]
            out[impl] = (value.detach(), torch.cat([image.grad, text.grad]), temperature)
            loss_fn.zero_grad()

        def rel(a, b):
            return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()

        (fv, fg, ft), (av, ag, at) = out["fused"], out["autograd"]
        worst["value"] = max(worst["value"], rel(av, fv))
        worst["grad_features"] = max(worst["grad_features"], rel(ag, fg))
        for a, f in zip(at, ft):
            worst["grad_temperature"] = max(worst["grad_temperature"], rel(a, f))
    return worst


def timing(names: list[str], batch: int, dim: int, reps: int, warmup: int, device) -> dict:
    steps = {}
    for name in names:
        for impl in ("fused", "autograd"):
            if name == "dcl" and impl == "fused":
                continue  # dcl is autograd only
            loss_fn = _loss(name, impl, device, torch.float32)
            image, text, indices = _inputs(batch, dim, device, torch.float32)

            def step(f=loss_fn, i=image, t=text, x=indices):
                f(i, t, x, epoch=1).backward()

            steps[f"{name} {impl}"] = step
    times = {label: [] for label in steps}
    labels = list(steps)
    for rep in range(warmup + reps):
        for label in labels:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            steps[label]()
            end.record()
            torch.cuda.synchronize()
            if rep >= warmup:
                times[label].append(start.elapsed_time(end))
    ms = {label: statistics.median(t) for label, t in times.items()}
    ratio = {
        name: statistics.median(a / f for a, f in zip(times[f"{name} autograd"], times[f"{name} fused"]))
        for name in names
        if f"{name} fused" in times
    }
    return {"B": batch, "d": dim, "reps": reps, "ms": ms, "autograd_over_fused": ratio}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--dims", type=int, nargs="+", default=[512])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/out/loss_impl_gpu")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_loss_gpu: torch sees no CUDA device: run this on a GPU machine", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # both impls in true float32: the ratio is not TF32's
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "agreement_float64": {name: agreement(name, device) for name in LOSSES if name != "dcl"},
        "timing": [timing(LOSSES, b, d, args.reps, args.warmup, device) for b in args.batch_sizes for d in args.dims],
    }
    lines = [
        f"# Loss implementations on {result['device']} (torch {result['torch']}, float32, 1 process)",
        "",
        "Forward + backward ms per step (median of CUDA-event times) and autograd/fused (median per-rep ratio).",
        "",
        "| B | d | loss | fused ms | autograd ms | autograd/fused |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["timing"]:
        for name in LOSSES:
            fused = row["ms"].get(f"{name} fused")
            lines.append(
                f"| {row['B']} | {row['d']} | {name} | {'-' if fused is None else f'{fused:.3f}'} | "
                f"{row['ms'][f'{name} autograd']:.3f} | "
                f"{row['autograd_over_fused'][name]:.2f} |"
                if name in row["autograd_over_fused"]
                else f"| {row['B']} | {row['d']} | {name} | - | {row['ms'][f'{name} autograd']:.3f} | - |"
            )
    lines += ["", "Float64 on the device, fused vs autograd, largest relative difference over 3 steps:", ""]
    lines += ["| loss | value | feature grads | temperature grads |", "|---|---|---|---|"]
    for name, worst in result["agreement_float64"].items():
        lines.append(
            f"| {name} | {worst['value']:.1e} | {worst['grad_features']:.1e} | {worst['grad_temperature']:.1e} |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_impl_gpu.md").write_text(table + "\n")
    (out / "loss_impl_gpu.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
