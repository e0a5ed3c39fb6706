"""What rank 0 reports: a progress bar (tqdm on a terminal, a plain line otherwise), <run_dir>/metrics.jsonl
(one JSON object per logging step and per evaluation), TensorBoard scalars when tensorboard is installed, and
Weights & Biases when train.wandb is on. Values arrive as Python numbers: the trainer reads tensors back only on
logging steps."""

from __future__ import annotations

import contextlib
import io
import json
import math
import secrets
import sys
import time
from pathlib import Path

import torch

from fastclip.errors import ConfigError, TrainingError
from fastclip.losses import individual

# The names a record's values go by where they are shown (metrics.jsonl keeps every key of a record):
TAU_QUANTILES = tuple(individual.TAU_QUANTILES)  # a per-sample τ loss's batch τ quantiles
STEP_LINE = (  # a logging step's line, in this order
    *("loss", "objective", "tau", *TAU_QUANTILES, "lr", "gamma"),
    *("samples_per_s", "samples_per_s_per_rank", "data_time"),
)
STEP_BAR = ("loss", "tau")  # beside the progress bar (and samples/s)


PRECISION_WORDS = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast with loss scaling"}


def start_line(cfg, info, net, stream, steps: tuple[int, int], resume_dir: Path | None, pretrained: str | None) -> str:
    """The run's first line: loss, towers (`pretrained`: what model.pretrained's file filled, in preflight's words),
    the locked towers and the parameters that train, processes, engine, precision, speedups (net:
    fastclip/train/net.py), batch, steps (first, last) and folders."""
    o = cfg.optim
    # open_clip's own "No pretrained weights loaded" warning is dropped (fastclip/models): said here once
    if resume_dir is not None:  # the checkpoint's weights: --model.pretrained only starts a new run
        start = "weights from the checkpoint" + (", model.pretrained not loaded" if cfg.model.pretrained else "")
    else:
        start = pretrained or "random init"
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in net.model.parameters())  # ZeRO-3: full sizes
    return (
        f"fastclip train: {cfg.loss.name}, {net.built.arch} ({n_params / 1e6:.1f}M parameters, {start}), "
        + (f"{net.locks}, " if net.locks else "")  # model.lock_image / lock_text
        + f"{info.world_size} process(es) on {info.device.type} ({info.launcher}), {net.engine.describe()}, "
        f"{PRECISION_WORDS[cfg.train.precision]}, "
        + "".join(f"{s}, " for s in net.speedups)
        + f"global batch {cfg.data.batch_size * info.world_size}"
        + (f" in {o.accum_steps} micro-batches per process" if o.accum_steps > 1 else "")
        + ", "
        f"{stream.batches_per_epoch} steps/epoch, steps {steps[0]} -> {steps[1]}, run {Path(cfg.train.run_dir)}"
        + (f", resumed from {resume_dir}" if resume_dir else "")
    )


def scalar_metrics(loss_fn, loss: torch.Tensor, step: int) -> dict:
    """Host values of the loss's metrics (call on logging steps only: .item() waits for the device); a non-finite
    one stops the run (FloatingPointError), naming the step."""
    out = {"loss": loss.item()}
    for name, value in getattr(loss_fn, "metrics", {}).items():
        if not torch.is_tensor(value):
            continue
        if value.numel() == 1:  # (a per-sample τ loss's "tau_quantiles" [3] also comes as tau_q05, ...: those)
            out[name] = value.item()
    tau = loss_fn.temperature()
    if tau is not None:
        out["tau"] = float(tau)
    comm = getattr(loss_fn, "comm_bytes", None) or {}
    if "total" in comm:
        out["comm_bytes"] = int(comm["total"])
    if not all(math.isfinite(v) for v in out.values()):
        raise FloatingPointError(f"non-finite metrics at step {step}: {out}")
    return out


class Throughput:
    """Wall time between logging steps, without the pauses (evaluation, checkpoints), and the run's total."""

    def __init__(self):
        self.train_time, self.trained_steps = 0.0, 0
        self.restart()

    def restart(self) -> None:
        self.steps, self.data, self.pause, self.start = 0, 0.0, 0.0, time.perf_counter()

    def window(self, global_batch: int, batch_size: int) -> dict:
        """Closes the window (its training seconds are added to the run's total): its rates."""
        elapsed = time.perf_counter() - self.start - self.pause
        self.train_time, self.trained_steps = self.train_time + elapsed, self.trained_steps + self.steps
        return {
            "samples_per_s": self.steps * global_batch / elapsed,
            "samples_per_s_per_rank": self.steps * batch_size / elapsed,
            "data_time": self.data / self.steps,
            "step_time": elapsed / self.steps,
        }

    def samples_per_s(self, global_batch: int) -> float:
        """The run's rate over all its windows."""
        return self.trained_steps * global_batch / self.train_time if self.train_time > 0 else float("nan")


def step_record(
    step: int,
    epoch: int,
    samples_seen: int,
    values: dict,
    *,
    lr: float,
    lr_tau: float,
    rates: dict,
    nonfinite_skipped: int,
    grad_norm: float | None,
) -> dict:
    """A logging step's record (metrics.jsonl, in this key order): where the run is, the loss's values (none on a
    skipped step), the schedules, the throughput window's rates, the guard's count; grad_norm unless skipped."""
    record = {
        "step": step,
        "epoch": epoch,
        "samples_seen": samples_seen,
        **values,
        "lr": lr,
        "lr_tau": lr_tau,
        **rates,
        "nonfinite_skipped": nonfinite_skipped,
    }
    if grad_norm is not None:
        record["grad_norm"] = grad_norm
    return record


def run_summary(
    step: int, epoch: int, samples_seen: int, *, run_dir: Path, last: dict, preempted: bool, samples_per_s: float
) -> dict:
    """What `train(cfg)` returns: where the run ended, its last logging step's record, whether a stop signal ended
    it ("preempted": `fastclip train` then exits with EXIT_PREEMPTED) and its training rate."""
    return {
        "step": step,
        "epoch": epoch,
        "samples_seen": samples_seen,
        "run_dir": str(run_dir),
        "last": last,
        "preempted": preempted,
        "samples_per_s": samples_per_s,
    }


def eval_line(record: dict) -> tuple[str, ...]:
    """An evaluation's line: its top-1 accuracies, retrieval's R@1 both ways and the validation loss (own data
    has often no class names: its evaluation would print nothing)."""
    return tuple(k for k in record if k.endswith(("top1", "_R@1", "/val_loss")))


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0 or not math.isfinite(v):
            return f"{v}"
        return f"{v:.4g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a torn last line from a crash: dropped


class MetricsLogger:
    """Rank 0 writes; on other ranks every method is a no-op."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        tensorboard: bool,
        progress: bool,
        wandb: dict | None = None,
    ):
        self.enabled = enabled
        self.evaluated_at_start = False  # metrics.jsonl holds an evaluation record ("eval/...") of start_step
        self.file = None
        self.tb = None
        self.bar = None
        self.wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        if path.exists():  # a resumed run continues the file; records past the checkpoint will be written again
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= start_step]
            path.write_text("".join(line + "\n" for line in kept))
            self.evaluated_at_start = any(
                _step_of(line) == start_step and any(k.startswith("eval/") for k in json.loads(line)) for line in kept
            )
        self.file = open(path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step or None)
            except ImportError:  # tensorboard is optional
                self.tb = None
        if wandb is not None:
            self.wandb = start_wandb(run_dir, **wandb)
            self.wandb_step = int(getattr(self.wandb, "step", 0) or 0)  # where a resumed W&B run stands
        if progress and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, unit="step", desc="train")
            except ImportError:
                self.bar = None
        self.plain = progress and self.bar is None
        self.total_steps, self.start_step = total_steps, start_step
        self.last_time = self.start_time = time.time()

    def _eta(self, step: int) -> str:
        """Time left at the pace since this run (re)started, pauses for evaluation and checkpoints included."""
        done, elapsed = step - self.start_step, time.time() - self.start_time
        if done <= 0 or step >= self.total_steps:
            return ""
        left = (self.total_steps - step) * elapsed / done
        return f" eta {int(left) // 60}:{int(left) % 60:02d}"

    def log(self, record: dict, line_keys: tuple[str, ...] = ()) -> None:
        if not self.enabled:
            return
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: named, for the run's one line (train/errors.py write_failure)
            raise OSError(e.errno, e.strerror, self.file.name) from None
        step = record["step"]
        scalars = {
            k if "/" in k else f"train/{k}": v
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None and step >= self.wandb_step:  # W&B steps only increase: a resumed run's
            self.wandb.log(scalars, step=step)  # re-done steps are in metrics.jsonl, not sent twice
            self.wandb_step = step
        shown = {k: record[k] for k in line_keys if k in record}
        if not shown and "loss" not in record:  # nothing to show (a skipped step's counters): no bare "step N" line
            return
        if self.bar is not None:
            if "loss" in record:  # the bar itself gives steps, elapsed and ETA; beside it what one reads at a glance
                brief = {k: _fmt(record[k]) for k in STEP_BAR if k in record}
                if "samples_per_s" in record:
                    brief["samples/s"] = f"{record['samples_per_s']:.0f}"
                self.bar.n = step
                self.bar.set_postfix(brief, refresh=True)
            else:  # evaluation and other records: a line above the bar
                self.bar.write(f"step {step} " + " ".join(f"{k}={_fmt(v)}" for k, v in shown.items()))
        elif self.plain:
            print(
                f"step {step}/{self.total_steps} "
                + " ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
                + (self._eta(step) if "loss" in record else ""),
                flush=True,
            )

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()


def run_logger(cfg, *, enabled: bool, start_step: int, total_steps: int) -> MetricsLogger:
    """The logger of a run of `cfg` (train.run_dir, train.tensorboard, train.progress, train.wandb)."""
    t = cfg.train
    return MetricsLogger(
        Path(t.run_dir),
        enabled=enabled,
        total_steps=total_steps,
        start_step=start_step,
        tensorboard=t.tensorboard,
        progress=t.progress,
        wandb=dict(project=t.wandb_project, config=cfg.to_dict()) if t.wandb else None,
    )


def start_wandb(run_dir: Path, *, project: str, config: dict):
    """A W&B run for this run folder; its id is kept in <run_dir>/wandb_id, so a resumed job continues it."""
    import wandb

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    import logging

    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)  # wandb's telemetry export errors, at exit
    said = io.StringIO()  # wandb's own lines ("Loaded credentials ..."): the run says what it does itself
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            return wandb.init(
                project=project,
                name=run_dir.name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=config,
                settings=wandb.Settings(console="off", quiet=True, silent=True),
            )
    except Exception as e:  # wandb's own words, in the run's one line
        if not type(e).__module__.startswith("wandb"):
            raise
        from fastclip.train.preflight import wandb_says

        advice = "set WANDB_MODE=offline to keep the logs under the run folder (`wandb sync` them later)"
        refused = any(f"error {code}" in str(e) for code in (401, 403))  # the server refused the key: no retry helps
        if type(e).__name__ in ("UsageError", "AuthenticationError") or refused:  # the operator's: the key, a project
            raise ConfigError(f"config key 'train.wandb': {wandb_says(e)}; {advice}, or --train.wandb false") from None
        # the server's (unreachable, a timeout): not a usage error, so a requeued job is retried
        raise TrainingError(f"W&B could not start the run ({wandb_says(e)}); {advice}, or retry") from None
