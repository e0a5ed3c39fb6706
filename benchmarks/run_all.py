"""Every benchmark that fits this machine, then benchmarks/RESULTS.md with the tables and plots.

    python benchmarks/run_all.py                 # the full set (long: ~30 min on 2 cores), -> benchmarks/RESULTS.md
    python benchmarks/run_all.py --smoke         # every program in its --quick form (CI), -> benchmarks/out/RESULTS.md
    python benchmarks/run_all.py --only e2e,scaling     # some items; the others' last results are reused
    python benchmarks/run_all.py --report-only   # rebuild RESULTS.md from the results already there

Items (each its own program, run in a fresh process, writing <name>.{json,md,png} to benchmarks/results/):
  e2e          bench_e2e.py           end to end against OpenCLIP's own trainer (throughput, memory, accuracy)
  loss         bench_loss.py          the loss alone: time and bytes per step, fastclip-v3 vs ClipLoss
  state        bench_state_memory.py  per-rank bytes of the per-sample state, measured and at LAION scale
  scaling      bench_scaling.py       compute/communication split at 1 and 2 processes + a scaling MODEL
  stat_eff     bench_stat_eff.py      tuned study: zero-shot and retrieval against samples seen (hours)
  (estimator_bias  bench_estimator_bias.py  the mini-batch estimate's error on the study's towers: run after it)
  (estimator_bias_during  bench_estimator_bias.py --during --seeds 1  the same, and the moving average's, in training)
  (u_regimes   bench_u_regimes.py     DCL against FastCLIP-v1 as revisits per sample and γ change, MLP proxy (1 h))
  (tau_regimes bench_tau_regimes.py   v1's tuned τ against v3's learned and v2's per-sample τ, balanced and long-tailed)
  engines      bench_engines.py       DDP vs DeepSpeed ZeRO-1/2/3 and gradient accumulation: throughput, memory
  tempfree     bench_tempfree.py      zero-shot of the temperature-free (atanh) loss against tuned temperatures
  scenes       bench_scenes.py        the scenes data at 100k: generation time, distinct captions, held-out pairs
  scenes_semantic  bench_scenes_semantic.py  both scenes variants: class-blind oracle R@1, captions cut, time
  longrun      bench_longrun.py       2 processes killed (-9) and resumed again and again: final state, disk, memory
  scan         bench_scan.py          fastclip data scan: shards/s, samples/s, bytes per sample, projected to 400M
  ssl          bench_ssl.py           images alone: SogCLR at batch 64 against SimCLR at 64 and 512, iSogCLR (70 min)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS, SMOKE_OUT, machine_info, stamp

HERE = REPO / "benchmarks"
ITEMS = {  # name -> (program, result stem, title)
    "e2e": ("bench_e2e.py", "e2e", "1. End to end against OpenCLIP's own trainer"),
    "loss": ("bench_loss.py", "loss_bench", "2. Loss and communication"),
    "state": ("bench_state_memory.py", "state_memory", "3. Per-sample state memory"),
    "stat_eff": ("bench_stat_eff.py", "stat_eff", "4. Statistical efficiency at small batch"),
    # (not in ORDER: it measures towers trained with the study's chosen settings; run it after the study)
    "estimator_bias": (
        "bench_estimator_bias.py",
        "estimator_bias",
        "4b. The mini-batch estimate's error on trained towers, by data set and batch size",
    ),
    "estimator_bias_during": (
        "bench_estimator_bias.py",
        "estimator_bias_during",
        "4c. The mini-batch estimate's error during training, and the moving average's",
    ),
    # (not in ORDER either: 192 short runs, about an hour of one core)
    "u_regimes": (
        "bench_u_regimes.py",
        "u_regimes",
        "4d. Where u helps: DCL against FastCLIP-v1 as revisits per sample and γ change (a proxy)",
    ),
    # (not in ORDER either: 132 short runs, about an hour of one core)
    "tau_regimes": (
        "bench_tau_regimes.py",
        "tau_regimes",
        "4e. Where a learned or per-sample τ helps: balanced and long-tailed data (a proxy)",
    ),
    "scaling": ("bench_scaling.py", "scaling", "5. Scaling: compute vs communication, and a model to 256 GPUs"),
    "engines": ("bench_engines.py", "engines_bench", "6. DDP vs DeepSpeed ZeRO, and gradient accumulation"),
    "tempfree": ("bench_tempfree.py", "tempfree_bench", "7. Temperature-free loss against tuned temperatures"),
    "scenes": ("bench_scenes.py", "scenes", "8. The scenes data: generation time and distinct captions"),
    "scenes_semantic": (
        "bench_scenes_semantic.py",
        "scenes_semantic",
        "8b. Scenes that need the glyphs: the class-blind oracle and the text context, both variants",
    ),
    "scan": ("bench_scan.py", "scan", "9. Preparing data at scale: fastclip data scan"),
    "longrun": ("bench_longrun.py", "longrun", "10. Killed and resumed: a long run under kill -9"),
    "ssl": ("bench_ssl.py", "ssl/ssl", "11. Images alone: SogCLR at a small batch against SimCLR at a large one"),
}
ORDER = (
    "e2e",
    "loss",
    "state",
    "scaling",
    "engines",
    "tempfree",
    "scenes",
    "scenes_semantic",
    "scan",
    "longrun",
    "stat_eff",
    "ssl",
)  # the most important first, the longest last

ARGS = {"estimator_bias_during": ["--during", "--seeds", "1"]}  # the program's arguments, when it takes some

GPU_COMMANDS = """\
# item 1 on one GPU node (nccl, bf16 autocast in ours, amp_bf16 in OpenCLIP's trainer), ViT-B-32, 256 per GPU:
python benchmarks/bench_e2e.py --arch ViT-B-32 --batch 256 --precision bf16 --device cuda --nproc 8 \\
    --workers 6 --samples 204800 --reps 2 --out benchmarks/results/gpu
# (--nproc 1 on a single-GPU machine; same shards: fastclip data embedded --out data/embedded)
# item 5's model with a measured GPU compute time: run bench_scaling.py there (it is CPU/gloo-only today)
# on a lent machine that reaches no registry: the CUDA-only tests and item 1 on one GPU, prepared here, in one call
bash benchmarks/gpu_check.sh prepare   # then, there: bash benchmarks/gpu_check.sh run"""


def run_item(name: str, smoke: bool, out: Path) -> dict:
    program = HERE / ITEMS[name][0]
    cmd = [sys.executable, str(program), *ARGS.get(name, [])] + (["--quick"] if smoke else [])
    if out != RESULTS:  # each program's default for a full run is benchmarks/results/
        cmd += ["--out", str(out)]
    start = time.perf_counter()
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO)
    seconds = time.perf_counter() - start
    print(f"== {name}: rc {proc.returncode} in {seconds:.0f} s", flush=True)
    finished = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = " ".join(["python", str(program.relative_to(REPO))] + cmd[2:])
    return {"item": name, "rc": proc.returncode, "seconds": seconds, "command": command, "finished": finished}


def _section(name: str, out: Path, runs: dict) -> list[str]:
    program, stem, title = ITEMS[name]
    lines = [f"## {title}", ""]
    md, png, js = out / f"{stem}.md", out / f"{stem}.png", out / f"{stem}.json"
    if not md.is_file():
        return lines + ["Not run (no results yet).", ""]
    when = ""
    if js.is_file():
        data = json.loads(js.read_text())
        machine = data.get("machine", {})
        if isinstance(machine, dict) and "date" in machine:
            load = lambda v: "/".join(f"{x:.1f}" for x in v) if isinstance(v, list) else "-"  # noqa: E731
            when = (
                f"Run {machine['date']}; load average (1/5/15 min) before {load(machine.get('loadavg'))}, "
                f"after {load(machine.get('loadavg_after'))}. "
            )
    run = runs.get(name)
    lines.append(
        f"{when}Program: `{' '.join(['python', f'benchmarks/{program}', *ARGS.get(name, [])])}`"
        + (f"; its last run from run_all took {run['seconds']:.0f} s (finished {run['finished']})." if run else ".")
    )
    lines.append("")
    body = md.read_text().strip()
    if body.startswith("# "):  # bench_loss's own title
        body = body.split("\n", 1)[1].strip()
    lines += [body, ""]
    if png.is_file():
        lines += [f"![{title}]({png.relative_to(out.parent if out.name == 'results' else out).as_posix()})", ""]
    return lines


def headline(out: Path) -> list[str]:
    lines = []
    e2e = out / "e2e.json"
    if e2e.is_file():
        d = json.loads(e2e.read_text())
        p = d["params"]
        lines += [
            f"**End to end, {p['arch']}, {p['nproc']} processes x {p['batch']} per step, {p['device']} "
            f"{p['precision']}, {p['samples']} samples per run, {p['reps']} interleaved runs each (median):**",
            "",
            "| system | samples/s | vs OpenCLIP's trainer | peak PSS sum | zero-shot top-1 at equal samples |",
            "|---|---:|---:|---:|---:|",
        ]
        for s in d["summary"]:
            lines.append(
                f"| {s['system']} | {s['samples_per_s']:.1f} | {s.get('throughput_ratio', 1):.2f}x | "
                f"{s['peak_pss_sum_mb']:.0f} MB | {100 * s['zeroshot_mean_top1']:.1f}% |"
            )
        lines.append("")
    state = out / "state_memory.json"
    if state.is_file():
        d = json.loads(state.read_text())
        for r in d["projected"]:
            if r["ranks"] == 32:
                lines.append(
                    f"- {r['version']} per-sample state at LAION-315M on 32 ranks: "
                    f"{r['ours_per_rank_bytes'] / 2**20:.0f} MB per rank (reference, replicated: "
                    f"{r['replicated_per_process_bytes'] / 2**30:.2f} GB per process)."
                )
    stat = out / "stat_eff.json"
    if stat.is_file():
        d = json.loads(stat.read_text())
        for g in d["summary"]["groups"]:
            seeds, metric = g["seeds"], g["primary_metric"]
            for baseline, h in g.get("against", {}).items():  # openclip, and InfoNCE at a tuned constant τ
                ref, v3 = seeds[baseline][f"test_{metric}"], seeds["fastclip-v3"][f"test_{metric}"]
                speedup, paired = h["v3_speedup"], h["v3_minus_baseline_paired"]
                lines.append(
                    f"- {g['dataset']}, global batch {g['global_batch']}, test {metric}: {baseline} "
                    f"{_percent(ref, unit='%')} ({seeds[baseline]['seeds_done']} seeds), fastclip-v3 "
                    f"{_percent(v3, unit='%')} ({seeds['fastclip-v3']['seeds_done']} seeds); v3 reaches "
                    f"{baseline}'s final value "
                    + (f"with {speedup:.2f}x fewer samples" if speedup else "not within the run")
                    + (f"; paired by seed {_percent(paired, sign='+', unit=' points')}." if paired else ".")
                )
        lines.append(f"- study progress: {d['runs_done']} of {d['runs_planned']} runs done.")
    return lines


def _percent(mean_std, sign: str = "", unit: str = "") -> str:
    """'47.3 ± 5.3%' from a (mean, std) fraction; the mean alone for one seed (its std is None: undefined)."""
    mean, std = mean_std[0], mean_std[1]
    return f"{100 * mean:{sign}.1f}" + ("" if std is None else f" ± {100 * std:.1f}") + unit


def _reader(folder: Path):
    """A file of `folder` as stripped text ("" when it is not there)."""
    return lambda name: (folder / name).read_text().strip() if (folder / name).is_file() else ""


def _lent_machine_lines(folder: Path, text) -> list[str]:
    """The lent machine (env.txt, indented) and its CUDA-only tests' summary line, as gpu_check.sh wrote them."""
    lines = ["", *(f"    {line}" for line in text("env.txt").splitlines()), ""]
    tests = text("cuda_tests.log").splitlines()
    if tests:
        log = f"benchmarks/{folder.parent.name}/{folder.name}/cuda_tests.log"
        lines += [f"CUDA-only tests (`{log}`): {tests[-1].strip('= ')}.", ""]
    return lines


def _gpu_section(folder: Path) -> list[str]:
    """Item 1 on one lent GPU: what `bash benchmarks/gpu_check.sh run` wrote there (copied into results/gpu/)."""
    text = _reader(folder)
    md = text("e2e.md")
    if not md:
        return []
    result = json.loads(text("e2e.json") or "{}")
    machine, p = result.get("machine", {}), result.get("params", {})
    steps = p["samples"] // (p["batch"] * p["nproc"]) if p else "-"
    memory = {s["system"]: s.get("pss_ratio") for s in result.get("summary", [])}.get("fastclip openclip")
    lines = [
        "## 1g. End to end on one GPU",
        "",
        f"Run {machine.get('date', '-')} by `bash benchmarks/gpu_check.sh run` on a lent machine (`prepare` here "
        "first); its files are copied into `benchmarks/results/gpu/`. One run per system: a first reading, not a "
        f"median. The zero-shot figures after {steps} steps of a randomly initialised {p.get('arch', 'model')} "
        "are near chance (10 %) for every system and compare nothing."
        + (
            f" Host memory: fastclip's peak is {memory:.2f}x OpenCLIP's here (section 1 gives the CPU's); on CUDA our "
            "loader pins its batches in page-locked host memory (uint8 images, normalised on the device), which "
            "OpenCLIP's webdataset loader does not."
            if memory
            else ""
        ),
        *_lent_machine_lines(folder, text),
    ]
    lines += [md, ""]
    if (folder / "e2e.png").is_file():
        lines += ["![1g. End to end on one GPU](results/gpu/e2e.png)", ""]
    timing = text("study_timing.md")
    if timing:
        lines += [
            "What one run of study v2 costs on the same machine (`python benchmarks/bench_study_gpu.py`: the study's "
            "own command for 40 steps, alone and 8 at once, each with one loader worker; a run's minutes are its "
            "training steps only, evaluation not counted):",
            "",
            timing.split("\n\n", 1)[-1],  # the table, without its title
            "",
        ]
    pin = text("pin_memory.md")
    if pin:
        lines += [
            "What pinning costs and buys, on the same machine (`python benchmarks/bench_e2e.py --arch ViT-B-32 "
            "--batch 256 --precision bf16 --device cuda --nproc 1 --workers 6 --samples 25600 --reps 1 --systems "
            "'fastclip openclip unpinned,fastclip openclip'`, one run each; `--data.pin_memory false` is the "
            "unpinned run):",
            "",
            pin.split("\n\n", 1)[-1],  # the table, without the parameters' paragraph
            "",
        ]
    return lines


def _gpu_loss_section(folder: Path) -> list[str]:
    """Item 2's implementations on one lent GPU: `GPU_CHECK_STEPS="cuda_tests loss_impl train_dcl_objectives ..."
    bash benchmarks/gpu_check.sh run`, its files copied into results/gpu_loss/."""
    text = _reader(folder)
    md = text("loss_impl_gpu.md")
    if not md:
        return []
    date = json.loads(text("loss_impl_gpu.json") or "{}").get("date", "-")
    trained = [line for line in text("train_dcl_objectives.log").splitlines() if line.startswith("checkpoint ")]
    lines = [
        "## 2g. Each loss's two implementations on one GPU",
        "",
        f"Run {date} by `bash benchmarks/gpu_check.sh run` on a lent machine (its `loss_impl` step is "
        "`python benchmarks/bench_loss_gpu.py`); the files are in `benchmarks/results/gpu_loss/`. One process: the "
        "gather is the identity, so this times the loss math, which is what the implementations differ in.",
        *_lent_machine_lines(folder, text),
    ]
    if trained:
        lines += [
            "The autograd-only objectives trained on CUDA in bf16 (`train_dcl_objectives.log`): dcl with a "
            "1,024-row queue of the momentum towers' features and top-32 hard negatives, 20 steps, resumed to 30; "
            f"dcl with momentum distillation (α 0.4), 20 steps: {len(trained)} checkpoints written.",
            "",
        ]
    return lines + [md.split("\n", 1)[1].strip(), ""]


def write_report(out: Path, smoke: bool, runs: dict, command: str) -> Path:
    info = machine_info()
    gpu = _gpu_section(out / "gpu")  # item 1 on a lent GPU, where its results are
    report = (out.parent if out.name == "results" else out) / "RESULTS.md"
    prose = "" if report.parent == HERE else "../"  # the hand-written NOTES.md and STUDY_V1.md live in benchmarks/
    lines = [
        "# fastclip benchmarks against OpenCLIP",
        "",
        f"Machine: {stamp(info)}; {info['platform']}, Python {info['python']}. Assembled by `{command}` "
        f"from each item's latest results (every section gives its run's date; the table at the end lists "
        f"the runs)" + (" - SMOKE run: tiny sizes, not measurements." if smoke else "."),
        "",
        f"The prose that reads these tables is hand-written in benchmarks/, not generated: [NOTES.md]({prose}NOTES.md) "
        f"(end to end, loss alone, state memory, long run, GPU) and [STUDY_V1.md]({prose}STUDY_V1.md) (the "
        "statistical-efficiency study of section 4 and its caveats).",
        "",
        "**No GPU was available for this run**: everything below ran on CPU (gloo), 2 processes with "
        "OMP_NUM_THREADS=1 on a 2-core machine that other jobs were using at the same time (load averages "
        "are given per item; runs are interleaved and ratios are what to read, not absolute numbers). "
        + (
            "Item 1 ran once on one lent GPU (section 1g); its multi-GPU run and item 2 on a GPU are left for "
            "a session with GPUs:"
            if gpu
            else "The GPU runs of items 1 and 2 are left for a session with a GPU:"
        )
        if not info["gpu"]
        else f"GPU: {info['gpu']}.",
        "",
    ]
    if not info["gpu"]:
        lines += ["```bash", GPU_COMMANDS, "```", ""]
    lines += ["## Headline", ""] + headline(out) + [""]
    for name in ITEMS:
        lines += _section(name, out, runs)
        if name == "e2e":
            lines += gpu
        if name == "loss":
            lines += _gpu_loss_section(out / "gpu_loss")
    loader = out / "loader_bench.md"
    if loader.is_file():
        lines += [
            "## Data loader (earlier run of benchmarks/bench_loader.py)",
            "",
            loader.read_text().split("\n", 1)[1].strip(),
            "",
        ]
    if runs:
        lines += ["## Runs", "", "| item | command | finished | rc | seconds |", "|---|---|---|---:|---:|"]
        lines += [
            f"| {r['item']} | `{r['command']}` | {r.get('finished', '-')} | {r['rc']} | {r['seconds']:.0f} |"
            for r in runs.values()
        ]
    report.write_text("\n".join(lines) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every program with --quick, into benchmarks/out/")
    parser.add_argument("--only", help=f"comma list of items to run ({', '.join(ORDER)})")
    parser.add_argument("--skip", default="", help="comma list of items not to run")
    parser.add_argument("--report-only", action="store_true", help="only rebuild RESULTS.md")
    args = parser.parse_args(argv)
    out = SMOKE_OUT if args.smoke else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    chosen = [n for n in ORDER if (not args.only or n in args.only.split(",")) and n not in args.skip.split(",")]
    unknown = set((args.only or "").split(",") + args.skip.split(",")) - set(ORDER) - {""}
    if unknown:
        parser.error(f"unknown item(s) {sorted(unknown)}; items: {', '.join(ORDER)}")
    log_file = out / "run_all_log.json"  # the last run of each item, kept across partial runs (--only)
    runs = json.loads(log_file.read_text()) if log_file.is_file() else {}
    for name in [] if args.report_only else chosen:
        runs[name] = run_item(name, args.smoke, out)
        log_file.write_text(json.dumps(runs, indent=1))
    command = "python benchmarks/run_all.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    report = write_report(out, args.smoke, runs, command.strip())
    print(f"wrote {report}")
    failed = [n for n in ([] if args.report_only else chosen) if runs[n]["rc"] != 0]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
