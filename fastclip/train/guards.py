"""What keeps a run going, or stops it cleanly, when something goes wrong (the trainer's fault handling).

NonFiniteGuard   A step whose loss or gradient norm is NaN/Inf on any rank (one all_reduce of two flags, so
                 every rank decides the same; a third carries the stop-signal request, preemption.py), or
                 whose features the loss refused (NonFiniteFeaturesError, raised alike on every rank before
                 the loss touches its state), is skipped: no optimizer
                 step, and the per-sample state rows the forward already wrote are put back, so the step
                 leaves the model, optimizer and per-sample state as they were. Skips are counted and logged;
                 after train.max_nonfinite_steps in a row the run stops (NonFiniteStepsError) without saving,
                 so the last checkpoint stays the last good one.
CollectiveTimeouts  Collectives get train.dist_timeout_minutes while the job starts and during checkpoint
                 saves and evaluations, and the short train.collective_timeout_seconds once the first step
                 is done (as torchtitan does): a rank that dies or hangs makes the others fail within that
                 time instead of waiting for half an hour. The failure is re-raised as CollectiveFailure,
                 naming the rank, step and phase.
DataSkipReport   On logging steps: the data stream's skip counters summed over ranks, and the skipped
                 samples (rank, shard, key, reason) since the last report, for metrics.jsonl and the log
                 (rank 0 logs each bad sample, and each broken shard, once per epoch); at the end of each
                 epoch and of the run, one line with the per-reason totals.
"""

from __future__ import annotations

import contextlib
import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from fastclip.distributed import DistInfo
from fastclip.losses.comm import all_gather_single
from fastclip.train.errors import CollectiveFailure, NonFiniteStepsError, TrainingError


# ----------------------------------------------------------------------------- gradient norm
def total_grad_norm(params) -> torch.Tensor:
    """L2 norm of all gradients (read only: the gradients are not touched)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None:
        return get_total_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach()) for g in grads]))


# ----------------------------------------------------------------------------- non-finite steps
class _SampleRows:
    """The per-sample state rows one global batch may write, as they were before the step."""

    def __init__(self, loss_fn, indices: torch.Tensor, info: DistInfo):
        all_indices = indices.detach().to(torch.int64).contiguous()
        if info.distributed:  # every rank owns some of the global batch's rows: it needs all ranks' indices
            gathered = all_indices.new_empty(info.world_size * all_indices.numel())
            all_gather_single(gathered, all_indices)
            all_indices = gathered
        self.state = loss_fn.sample_state(device=indices.device)
        self.where = self.state.locate(all_indices)
        self.saved = self.state.read(self.where)  # [N, fields + seen], this rank's rows only

    def restore(self) -> None:
        self.state.restore(self.where, self.saved)


class NonFiniteGuard:
    """Skip steps with NaN/Inf loss, gradients or features on any rank; stop after `max_in_a_row` in a row."""

    def __init__(self, max_in_a_row: int, info: DistInfo, *, log=None, checkpoints: Path | None = None):
        self.max_in_a_row, self.info, self.log, self.checkpoints = max_in_a_row, info, log, checkpoints
        self.skipped = 0  # steps skipped in this run (carried over by checkpoints)
        self.in_a_row = 0
        self.stop = False  # a stop signal reached some rank (combined in verdict's all_reduce)
        self._rows: list[_SampleRows] = []

    def remember(self, loss_fn, indices: torch.Tensor) -> None:
        """Before the forward: note the per-sample state rows this batch may write (one tiny all_gather)."""
        if getattr(loss_fn, "uses_sample_state", False):
            self._rows.append(_SampleRows(loss_fn, indices, self.info))

    def verdict(self, loss: torch.Tensor, grad_norm: torch.Tensor, *, stop_requested: bool = False) -> str | None:
        """None if the step may be taken, else why not; the same answer on every rank (one host sync).
        `stop_requested` (this rank got a stop signal) rides in the same all_reduce: afterwards `self.stop` says
        whether any rank asked (fastclip/train/preemption.py)."""
        device = loss.device
        bad = torch.stack(
            [
                ~torch.isfinite(loss.detach()).all(),
                ~torch.isfinite(grad_norm.detach().to(device)),
                torch.tensor(bool(stop_requested), device=device),
            ]
        )
        bad = bad.to(torch.float32)
        if self.info.distributed:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        loss_bad, grad_bad, stop = (v > 0 for v in bad.tolist())
        self.stop = self.stop or stop
        if loss_bad:
            return "non-finite loss (NaN/Inf) on at least one rank"
        if grad_bad:
            return "non-finite gradients (NaN/Inf gradient norm) on at least one rank"
        return None

    def passed(self) -> None:
        self.in_a_row = 0
        self._rows.clear()

    def skip(self, step: int, why: str, *, epoch: int, samples_seen: int) -> None:
        """The step is not taken: put the per-sample state back, count, log; raise after too many in a row."""
        for rows in reversed(self._rows):
            rows.restore()
        self._rows.clear()
        self.skipped += 1
        self.in_a_row += 1
        if self.log is not None:
            self.log.message(
                f"step {step}: skipped ({why}); no update of the model, optimizer or per-sample "
                f"state; {self.in_a_row} in a row, {self.skipped} in this run"
            )
            self.log.log(
                {
                    "step": step,
                    "epoch": epoch,
                    "samples_seen": samples_seen,
                    "skipped": why,
                    "nonfinite_skipped": self.skipped,
                    "nonfinite_in_a_row": self.in_a_row,
                }
            )
        if self.in_a_row >= self.max_in_a_row:
            latest = self.checkpoints / "latest" if self.checkpoints is not None else None
            last = (
                f"the last checkpoint, {self.checkpoints / latest.read_text().strip()}, was saved before "
                f"them and is intact"
                if latest is not None and latest.is_file()
                else "no checkpoint was saved"
            )
            raise NonFiniteStepsError(
                f"{self.in_a_row} steps in a row were skipped for NaN/Inf (steps {step - self.in_a_row + 1}..{step}; "
                f"last: {why}); stopping at train.max_nonfinite_steps = {self.max_in_a_row}. {last[0].upper()}"
                f"{last[1:]}. Check the data and the learning rate, or resume with --train.resume latest"
            )

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.skipped, self.in_a_row = int(state["skipped"]), int(state["in_a_row"])


# ----------------------------------------------------------------------------- collectives
_COLLECTIVE_SIGNS = (
    "connection closed",
    "connection reset",
    "timed out",
    "timeout",
    "pair closure",
    "nccl",
    "gloo",
    "broken pipe",
    "socket",
    "peer",
    "store",
)


def _set_pg_timeout(seconds: float) -> None:
    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.2 (what torchtitan uses)
    if setter is not None and dist.is_initialized():
        setter(datetime.timedelta(seconds=seconds))


class CollectiveTimeouts:
    """Short collective timeouts while training, long ones while starting, saving and evaluating; the
    phase and step are kept so a failed collective can say where it happened."""

    def __init__(self, info: DistInfo, *, start_seconds: float, train_seconds: float):
        self.info, self.start_seconds, self.train_seconds = info, start_seconds, train_seconds
        self.now = start_seconds
        self.step, self.phase = 0, "start-up"
        self._training = False
        self.failed_in: tuple[str, float] | None = None  # (phase, timeout) when a relaxed phase raised

    def _set(self, seconds: float) -> None:
        if self.info.distributed and seconds != self.now:
            _set_pg_timeout(seconds)
        self.now = seconds

    def at(self, step: int, phase: str = "training step") -> None:
        self.step, self.phase = step, phase

    def first_step_done(self) -> None:
        if not self._training:
            self._training = True
            self._set(self.train_seconds)

    @contextlib.contextmanager
    def relaxed(self, phase: str):
        """Long timeouts for a phase where one rank legitimately waits for another (rank 0 writing model.pt)."""
        before_phase, before = self.phase, self.now
        self.phase = phase
        self._set(max(self.start_seconds, self.train_seconds))
        try:
            yield
        except BaseException:
            # explain() runs after this block has put the training phase back: keep what applied here
            self.failed_in = (self.phase, self.now)
            raise
        finally:
            self._set(before)
            self.phase = before_phase

    def explain(self, error: BaseException) -> BaseException:
        """A CollectiveFailure naming rank, step and phase for errors of the process group; others unchanged."""
        if not self.info.distributed or isinstance(error, TrainingError) or not isinstance(error, RuntimeError):
            return error
        text = str(error)
        dist_error = getattr(dist, "DistError", ())
        if not (isinstance(error, dist_error) or any(s in text.lower() for s in _COLLECTIVE_SIGNS)):
            return error
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        phase, seconds = self.failed_in or (self.phase, self.now)
        key = "train.dist_timeout_minutes" if seconds == self.start_seconds else "train.collective_timeout_seconds"
        return CollectiveFailure(
            f"rank {self.info.rank} of {self.info.world_size}: a collective failed during the {phase} at step "
            f"{self.step}: {first[:400]}. Another process of this job most likely died, was killed or stopped "
            f"responding (in the {phase} collectives time out after {_seconds(seconds)}, set by {key}); this "
            f"process stops too. Restart the whole job with --train.resume latest to continue from the last "
            f"checkpoint"
        )


def _seconds(s: float) -> str:
    return f"{s:g} s" if s < 120 else f"{s / 60:g} min"


# ----------------------------------------------------------------------------- skipped samples
class DataSkipReport:
    """Skipped-sample counts summed over ranks, and the new skip events of every rank, on logging steps.

    A collective (every rank calls `collect` on the same steps): one all_reduce of the counters, plus an
    all_gather_object of the new events only when the global count grew.
    """

    def __init__(self, stream, info: DistInfo, reasons, *, max_events: int = 20):
        self.stream, self.info, self.max_events = stream, info, max_events
        self.reasons = [r for r in reasons if r != "wrapped"]
        self.last_total = 0
        self.logged: set = set()  # what was logged this epoch: (epoch, shard, reason) or (epoch, shard, key, reason)
        self.epoch_start: dict = {}  # the job-wide counts when the current epoch started (kept in checkpoints)

    def _counts(self) -> list[int]:
        counters = self.stream.counters
        known = [int(counters.get(r, 0)) for r in self.reasons]
        other = sum(int(v) for k, v in counters.items() if k not in self.reasons and k != "wrapped")
        return known + [other, int(counters.get("wrapped", 0))]

    def collect(self) -> tuple[dict, list[dict]]:
        """({"data_skipped": n, "data_skipped/<reason>": n, ..., "data_wrapped": n}, new events of all ranks)."""
        counts = self._counts()
        if self.info.distributed:
            t = torch.tensor(counts, dtype=torch.int64, device=self.info.device)
            dist.all_reduce(t)
            counts = t.tolist()
        *by_reason, other, wrapped = counts
        total = sum(by_reason) + other
        record = {"data_skipped": total, "data_wrapped": wrapped}
        record.update({f"data_skipped/{r}": n for r, n in zip(self.reasons, by_reason) if n})
        if other:
            record["data_skipped/other"] = other
        events: list[dict] = []
        if total > self.last_total:  # the same decision on every rank
            mine = self.stream.drain_skips()
            if self.info.distributed:
                everyone: list = [None] * self.info.world_size
                dist.all_gather_object(everyone, mine)
                mine = [e for part in everyone for e in part]
            events = mine
        self.last_total = total
        return record, events

    def describe(self, events: list[dict]) -> list[str]:
        """A line per bad sample and per broken shard not yet logged this epoch (a shard split over ranks or
        workers is reported by each of them: logged once)."""
        from fastclip.data.samples import SHARD_REASONS
        from fastclip.data.stream import describe_skip

        new = []
        for e in events:
            what = (
                (e.get("epoch"), e.get("shard"), e.get("reason"))
                if e.get("reason") in SHARD_REASONS
                else (e.get("epoch"), e.get("shard"), e.get("key"), e.get("reason"))
            )
            if what not in self.logged:
                self.logged.add(what)
                new.append(e)
        lines = [f"data: {describe_skip(e)}" for e in new[: self.max_events]]
        if len(new) > self.max_events:
            lines.append(f"data: ... and {len(new) - self.max_events} more skip events (counts in metrics.jsonl)")
        return lines

    def totals(self, record: dict, since: dict | None = None) -> str:
        """'N samples skipped (reason n, ...)' from a collect() record, minus the counts in `since`."""
        since = since or {}
        parts = {k.split("/", 1)[1]: v - since.get(k, 0) for k, v in record.items() if k.startswith("data_skipped/")}
        parts = {k: v for k, v in parts.items() if v}
        total = record.get("data_skipped", 0) - since.get("data_skipped", 0)
        wrapped = record.get("data_wrapped", 0) - since.get("data_wrapped", 0)
        return (
            f"{total} sample(s) skipped, summed over ranks"
            + (f" ({', '.join(f'{k} {v}' for k, v in sorted(parts.items()))})" if parts else "")
            + f"; {wrapped} served twice to fill the batches"
        )

    def end_of_epoch(self, epoch: int, record: dict) -> str:
        """The epoch's per-reason totals (call with a collect() record at its end, on every rank)."""
        line = f"data: epoch {epoch}: {self.totals(record, self.epoch_start)}"
        self.epoch_start = {k: v for k, v in record.items() if k.startswith("data_")}
        self.logged = {w for w in self.logged if w[0] != epoch}
        return line

    def state_dict(self) -> dict:
        return {"epoch_start": {k: int(v) for k, v in self.epoch_start.items() if not isinstance(v, list)}}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.epoch_start = dict(state.get("epoch_start", {}))

    def as_metrics(self, events: list[dict]) -> list[dict]:
        keys = ("rank", "epoch", "shard", "key", "reason", "detail", "samples")
        return [{k: e.get(k) for k in keys} for e in events[: self.max_events]]


__all__ = ["NonFiniteGuard", "CollectiveTimeouts", "DataSkipReport", "total_grad_norm"]
