"""Temperature-free loss (logits 2·atanh(cos), ``similarity="atanh"``) against tuned temperatures: zero-shot
accuracy after the same short training, for the OpenCLIP loss and FastCLIP-v1 (the GCL).

    python benchmarks/bench_tempfree.py          # writes benchmarks/results/tempfree_bench.{json,md}
    python benchmarks/bench_tempfree.py --quick  # every run a few steps (CI smoke) -> benchmarks/out/

A small self-contained loop, one process, one CPU thread (the trainer's ``loss.name`` list does not know the
new option yet; the losses are exact across world sizes, so one process trains the same model as K ranks on
the same global batches): tiny-vit from ``fastclip.models``, the training split of ``fastclip data embedded
--max-per-class 150`` read once through ``fastclip.data``'s stream (one augmented pass, cached; every epoch
re-shuffles it with the same seeded order for every run), AdamW (lr 1e-3, wd 0.1 on matrices, betas 0.9/0.98,
eps 1e-6, linear warmup 10% then cosine), the loss's parameters in their own group (same lr, no wd), logit_scale
clamped after each step. Every run starts from the same initial weights and sees the same batches. At the end:
``fastclip.eval.run_evals`` on the held-out split (zero-shot top-1 per dataset and their mean, retrieval R@1).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, SMOKE_OUT, check_out, count, ensure_embedded, machine_info, stamp, write_json

# label -> (loss name, options). τ "learnable" = OpenCLIP's default; the others are fixed.
RUNS = {
    "openclip τ=0.07 learnable": ("openclip", dict(temperature=0.07, learn_temperature=True)),
    "openclip τ=0.03 fixed": ("openclip", dict(temperature=0.03, learn_temperature=False)),
    "openclip atanh (no τ)": ("openclip", dict(similarity="atanh")),
    "fastclip-v1 τ=0.07": ("fastclip-v1", dict(temperature=0.07)),
    "fastclip-v1 τ=0.03": ("fastclip-v1", dict(temperature=0.03)),
    "fastclip-v1 atanh (no τ)": ("fastclip-v1", dict(similarity="atanh")),
}
GCL_OPTIONS = dict(gamma_min=0.2, gamma_schedule="cosine")  # the CC3M recipe's γ_min
FULL = dict(max_per_class=150, batch=128, steps=150, eval_max=760, seed=2024)
QUICK = dict(max_per_class=16, batch=32, steps=3, eval_max=40, seed=2024)


def load_training_set(train_dir: Path, built, batch: int, seed: int):
    """All training samples as tensors (one augmented pass through the data layer's stream)."""
    from fastclip.data import build_train_stream

    stream = build_train_stream(
        {"train": str(train_dir), "batch_size": batch, "workers": 0, "seed": seed},
        preprocess=built.preprocess_train,
        tokenizer=built.tokenizer,
    )
    images, texts, indices, _ = zip(*stream.epoch(0))
    return torch.cat(images), torch.cat(texts), torch.cat(indices), stream.data_size


def lr_at(step: int, total: int, base: float) -> float:
    warmup = max(1, total // 10)
    if step < warmup:
        return base * (step + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train_and_eval(label, data_dir: Path, data, init_state, p) -> dict:
    from fastclip.eval import run_evals
    from fastclip.losses import build_loss
    from fastclip.models import build_model

    name, options = RUNS[label]
    images, texts, indices, data_size = data
    steps_per_epoch = images.shape[0] // p["batch"]
    options = dict(options)
    if name.startswith("fastclip"):
        options.update(GCL_OPTIONS, gamma_decay_epochs=max(1, p["steps"] // steps_per_epoch // 2))
    built = build_model("tiny-vit")
    model = built.model
    model.load_state_dict(init_state)
    model.logit_scale.requires_grad_(False)  # the loss owns the temperature
    loss_fn = build_loss(name, data_size=data_size, **options)
    decay = [q for q in model.parameters() if q.requires_grad and q.ndim >= 2]
    no_decay = [q for q in model.parameters() if q.requires_grad and q.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if any(q.requires_grad for q in loss_fn.parameters()):
        groups.append({"params": [q for q in loss_fn.parameters() if q.requires_grad], "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    order = torch.Generator().manual_seed(p["seed"])
    model.train()
    start, losses, step, epoch = time.perf_counter(), [], 0, 0
    while step < p["steps"]:
        perm = torch.randperm(images.shape[0], generator=order)
        for b in range(steps_per_epoch):
            if step >= p["steps"]:
                break
            rows = perm[b * p["batch"] : (b + 1) * p["batch"]]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, p["steps"], 1e-3)
            image_features, text_features, _ = model(images[rows], texts[rows])
            loss = loss_fn(image_features, text_features, indices[rows], epoch=epoch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_fn.clamp_()
            losses.append(float(loss_fn.metrics["objective"]))
            step += 1
        epoch += 1
    train_s = time.perf_counter() - start
    results = run_evals(
        model,
        tokenizer=built.tokenizer,
        preprocess=built.preprocess_val,
        val_dir=data_dir / "val",
        zeroshot_file=data_dir / "zeroshot.json",
        device=torch.device("cpu"),
        max_samples=p["eval_max"],
    )
    tau = loss_fn.temperature()
    out = {
        "label": label,
        "loss": name,
        "options": {k: v for k, v in options.items()},
        "steps": step,
        "epochs": epoch,
        "train_s": round(train_s, 1),
        "final_objective": sum(losses[-10:]) / len(losses[-10:]),
        "final_tau": None if tau is None else float(tau),
        "eval": results,
    }
    top1 = results.get("zeroshot/mean_top1")
    print(f"  {label:28s} mean top1 {top1:.4f}  ({train_s:.0f} s train)", flush=True)
    return out


def table(runs: list[dict], info: dict, p: dict) -> str:
    datasets = sorted(
        {
            k.split("/")[1]
            for r in runs
            for k in r["eval"]
            if k.startswith("zeroshot/") and k.endswith("/top1") and k != "zeroshot/mean_top1"
        }
    )
    head = ["run", "mean top-1", *[f"{d} top-1" for d in datasets], "final τ", "train s"]
    lines = [
        f"# Temperature-free loss vs tuned temperatures ({stamp(info)})",
        "",
        f"tiny-vit, embedded data (max {p['max_per_class']} per class), global batch {p['batch']}, "
        f"{p['steps']} steps, one process, zero-shot on {p['eval_max']} held-out samples; seed {p['seed']}. "
        "One seed: differences of a point or two are within run-to-run noise at this size.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in runs:
        e = r["eval"]
        cells = [
            r["label"],
            f"{e.get('zeroshot/mean_top1', float('nan')):.4f}",
            *[f"{e.get(f'zeroshot/{d}/top1', float('nan')):.4f}" for d in datasets],
            "—" if r["final_tau"] is None else f"{r['final_tau']:.4f}",
            f"{r['train_s']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "atanh runs: logits 2·atanh(cos) (cos clamped to ±(1−1e-6)), τ = 1 fixed (their 'final τ' is that "
        "constant scale). fastclip-v1: γ_min 0.2, cosine γ decay over half the epochs. Retrieval (in the json) is "
        "left out: the captions are per-class templates, so instance retrieval is mostly ties. "
        "'train s': wall time on a shared, loaded machine (not a speed comparison).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps per run (CI smoke), output to benchmarks/out")
    parser.add_argument(
        "--data", type=Path, help="a `fastclip data embedded` folder (default: built under benchmarks/out)"
    )
    parser.add_argument("--steps", type=count())
    parser.add_argument("--runs", nargs="*", choices=list(RUNS), help="a subset of the runs")
    parser.add_argument("--out", type=Path, help="folder for the results (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    p = dict(QUICK if args.quick else FULL)
    if args.steps:
        p["steps"] = args.steps
    torch.set_num_threads(1)  # a shared 2-core machine: one thread per process is the fastest and the steadiest
    data_dir = args.data or ensure_embedded(
        SMOKE_OUT / f"embedded_mpc{p['max_per_class']}", max_per_class=p["max_per_class"]
    )
    from fastclip.models import build_model

    torch.manual_seed(p["seed"])
    built = build_model("tiny-vit")
    init_state = {k: v.clone() for k, v in built.model.state_dict().items()}
    data = load_training_set(data_dir / "train", built, p["batch"], p["seed"])
    print(f"{data[0].shape[0]} training samples, {len(args.runs or RUNS)} runs of {p['steps']} steps", flush=True)
    info = machine_info()
    runs = [train_and_eval(label, data_dir, data, init_state, p) for label in (args.runs or RUNS)]
    out_dir = args.out or (SMOKE_OUT if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "tempfree_bench"
    write_json(out_dir / f"{stem}.json", {"machine": info, "params": p, "data": str(data_dir), "runs": runs})
    (out_dir / f"{stem}.md").write_text(table(runs, info, p))
    print(table(runs, info, p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
