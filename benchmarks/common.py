"""Shared pieces of the benchmark programs: machine description, a process-tree memory monitor, launching
torchrun jobs, free ports, and the stamp every figure carries (machine + date). Nothing of fastclip or torch is
imported at the top: bench_quickstart.py runs before the set-up."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SMOKE_OUT = REPO / "benchmarks" / "out"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine_info() -> dict:
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "gpu": gpu_name(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg": list(os.getloadavg()),
    }


def stamp(info: dict) -> str:
    """One line naming the machine and the date, for figure captions."""
    device = info["gpu"] or f"{info['cores']}-core {info['cpu']} (CPU only)"
    return f"{device}, torch {info['torch']}, {info['date'][:16].replace('T', ' ')} UTC"


def save_figure(fig, path: Path, info: dict, title: str, *, top: float = 0.95) -> None:
    """Title the figure, stamp it with the machine and date, lay it out below the title (`top`), save, close."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=11)
    fig.text(0.99, 0.005, stamp(info), ha="right", va="bottom", fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


def publish(out: Path, stem: str, result: dict, markdown, plot) -> None:
    """`<stem>.json`, `<stem>.md` and `<stem>.png` in `out`, and the table on stdout."""
    write_json(out / f"{stem}.json", result)
    text = markdown(result)
    (out / f"{stem}.md").write_text(text + "\n")
    plot(result, out / f"{stem}.png")
    print(text)


# ----------------------------------------------------------------------------- memory of a process tree
def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after the "(comm)" that may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    return children


def _tree(root: int) -> list[int]:
    children, out, todo = _children_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _kb(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeMemoryMonitor:
    """Samples /proc every `interval` s and keeps the peak of the SUMS over a process and all its descendants
    (torchrun, the ranks, their data-loader workers) of RSS (VmRSS: shared pages counted once per process) and
    of PSS (smaps_rollup: shared pages split between the processes that map them, so the sum is not inflated)."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.peak_rss_kb = self.peak_pss_kb = self.max_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = _tree(self.pid)
            rss = sum(_kb(f"/proc/{p}/status", "VmRSS:") for p in pids)
            pss = sum(_kb(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)
            self.peak_rss_kb, self.peak_pss_kb = max(self.peak_rss_kb, rss), max(self.peak_pss_kb, pss)
            self.max_processes = max(self.max_processes, len(pids))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def result(self) -> dict:
        return {
            "peak_rss_sum_mb": self.peak_rss_kb / 1024,
            "peak_pss_sum_mb": self.peak_pss_kb / 1024,
            "max_processes": self.max_processes,
        }


def run_monitored(cmd: list[str], log_file: Path, *, env: dict | None = None, timeout: float | None = None) -> dict:
    """Run `cmd` (output to `log_file`) under the memory monitor; raise with the log's tail if it fails."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("TORCH_LOGS", None)
    start = time.perf_counter()
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        with TreeMemoryMonitor(proc.pid) as monitor:
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    wall = time.perf_counter() - start
    if rc != 0:
        tail = log_file.read_text()[-3000:]
        raise RuntimeError(f"command failed (rc {rc}): {' '.join(cmd)}\nlog {log_file}:\n{tail}")
    return {"wall_s": wall, **monitor.result()}


def torchrun(nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]


def ensure_embedded(
    root: Path, *, max_per_class: int | None = None, max_val_per_class: int | None = None, shard_size: int | None = None
) -> Path:
    """`fastclip data embedded --out root` unless it is already there."""
    from fastclip.data.format import MANIFEST_NAME  # (nothing of fastclip at the top: see the module's note)

    if (root / "train" / MANIFEST_NAME).is_file() and (root / "zeroshot.json").is_file():
        return root
    cmd = [sys.executable, "-m", "fastclip", "data", "embedded", "--out", str(root)]
    if max_per_class:
        cmd += ["--max-per-class", str(max_per_class)]
    if max_val_per_class:
        cmd += ["--max-val-per-class", str(max_val_per_class)]
    if shard_size:
        cmd += ["--shard-size", str(shard_size)]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return root


def shard_pattern(split_dir: Path) -> tuple[str, int]:
    """OpenCLIP's brace pattern for a shard folder written by fastclip data, and its sample count."""
    from fastclip.data.format import MANIFEST_NAME
    from fastclip.data.manifest import read_manifest

    manifest = read_manifest(split_dir)
    paths = [s.path for s in manifest.shards]
    stem, ext = paths[0].rsplit("-", 1)[0], ".tar"
    numbers = sorted(int(p.rsplit("-", 1)[1].split(".")[0]) for p in paths)
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        raise ValueError(f"{split_dir / MANIFEST_NAME}: shard numbers are not contiguous")
    width = len(paths[0].rsplit("-", 1)[1].split(".")[0])
    if len(numbers) == 1:
        return str(split_dir / paths[0]), manifest.num_samples
    return (f"{split_dir}/{stem}-{{{numbers[0]:0{width}d}..{numbers[-1]:0{width}d}}}{ext}", manifest.num_samples)


def loss_overrides(name: str, *, gamma_decay_epochs: int | None = None) -> list[str]:
    """The config file's loss settings for another loss (the trainer leaves out the file's options that the
    loss does not take: openclip keeps only the temperature, v0/v1 drop rho); γ's horizon where the loss has γ."""
    out = ["--loss.name", name]
    if name != "openclip" and gamma_decay_epochs is not None:
        out += ["--loss.gamma_decay_epochs", str(gamma_decay_epochs)]
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluate_checkpoint(
    path: Path,
    data_root: Path,
    *,
    arch: str | None = None,
    max_samples: int | None = None,
    batch_size: int = 256,
    device: str = "cpu",
) -> dict:
    """Zero-shot accuracy of a checkpoint (ours or OpenCLIP's epoch_N.pt, whose "module." prefixes
    fastclip.eval strips) on the held-out split, through fastclip.eval like `fastclip eval` does."""
    from fastclip.eval import run_evals
    from fastclip.eval.checkpoint import load_model

    loaded = load_model(path, arch=arch, device=device)
    built = loaded.built
    return run_evals(
        built.model,
        tokenizer=built.tokenizer,
        preprocess=built.preprocess_val,
        val_dir=str(data_root / "val"),
        zeroshot_file=str(data_root / "zeroshot.json"),
        device=device,
        batch_size=batch_size,
        max_samples=max_samples,
        retrieval=False,
    )


def slowest_rank_seconds(fn) -> float:
    """Wall time of fn() on this rank, started together with the other ranks; returns the slowest rank's."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def count(minimum: int = 1):
    """argparse type: an integer >= minimum (a negative --reps or --shards is the parser's usage error, not a
    crash or an empty table later)."""
    from fastclip.cli import whole_number

    def parse(text: str) -> int:
        return whole_number(text, minimum)

    parse.__name__ = "count"  # (argparse names the type in its message)
    return parse


def check_out(parser, out) -> None:
    """An --out that cannot be written: the parser's usage error now, not a traceback once the work is done."""
    from fastclip.cli import create_error

    if out is None:
        return
    out = Path(out).absolute()
    folder, error = create_error(out)
    if isinstance(error, NotADirectoryError):
        parser.error(f"--out {out}: {folder} is not a folder")
    if error is not None:
        parser.error(f"--out {out}: cannot write in {folder} ({error.strerror or error}); choose another --out")


def proxy_main(argv, doc: str, name: str, grids: tuple, results_of, markdown, plot) -> int:
    """The command line of a proxy benchmark (bench_u_regimes.py, bench_tau_regimes.py): `--quick` (the second of
    `grids`, for CI) or the full grid, runs appended to benchmarks/out/<name>[_quick]/runs.jsonl (it resumes), the
    tables from `results_of(grid, work)` published as <name>.{json,md,png} with every run beside them."""
    import argparse
    import shutil

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"tiny sizes for CI (-> benchmarks/out/{name}_quick)")
    parser.add_argument("--out", type=Path, help="where the tables go (default: results/, or out/ with --quick)")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    grid = grids[1] if args.quick else grids[0]
    work = SMOKE_OUT / (f"{name}_quick" if args.quick else name)
    out = args.out or (SMOKE_OUT if args.quick else RESULTS)
    from benchmarks.study.records import code_version

    work.mkdir(parents=True, exist_ok=True)
    result = {**results_of(grid, work), "machine": machine_info(), "commit": code_version()["commit"]}
    publish(out, name, result, markdown, plot)
    shutil.copyfile(work / "runs.jsonl", out / f"{name}_runs.jsonl")  # every run, the tables' and any other
    return 0


def p_cells(test: dict) -> str:
    """A paired test's p and Holm-adjusted p as two markdown cells ("–": not tested)."""
    return " | ".join("–" if test[k] is None else f"{test[k]:.4f}" for k in ("p", "p_holm"))
