"""What rank 0 reports: a progress bar (tqdm on a terminal, a plain line otherwise), <run_dir>/metrics.jsonl
(one JSON object per logging step and per evaluation), TensorBoard scalars when tensorboard is installed, and
Weights & Biases when train.wandb is on. Values arrive as Python numbers: the trainer reads tensors back only on
logging steps."""

from __future__ import annotations

import json
import math
import secrets
import sys
import time
from pathlib import Path

# The names a record's values go by where they are shown (metrics.jsonl keeps every key of a record):
TAU_QUANTILES = ("tau_q05", "tau_q50", "tau_q95")  # a per-sample τ loss's batch τ quantiles (losses/individual.py)
STEP_LINE = (  # a logging step's line, in this order
    *("loss", "objective", "tau", *TAU_QUANTILES, "lr", "gamma"),
    *("samples_per_s", "samples_per_s_per_rank", "data_time"),
)
STEP_BAR = ("loss", "tau")  # beside the progress bar (and samples/s)


def eval_line(record: dict) -> tuple[str, ...]:
    """An evaluation's line: its top-1 accuracies."""
    return tuple(k for k in record if k.endswith("top1"))


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
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
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


def start_wandb(run_dir: Path, *, project: str, config: dict):
    """A W&B run for this run folder; its id is kept in <run_dir>/wandb_id, so a resumed job continues it."""
    import wandb

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    run = wandb.init(
        project=project,
        name=run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        config=config,
        settings=wandb.Settings(console="off", quiet=True),
    )
    return run
