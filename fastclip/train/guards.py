"""What keeps a run going, or stops it cleanly, when something goes wrong (the trainer's fault handling).

NonFiniteGuard   A step whose gradient norm (or loss) is NaN/Inf on any rank, NaN features included, is
                 skipped: no optimizer step, and the per-sample state rows the forward wrote (journaled by the
                 state itself) are put back, so the step leaves the model, optimizer and per-sample state as
                 they were. By default (train.nonfinite_check "device") this is decided and applied on the
                 device with no host read or collective per step; "host" uses one tiny all_reduce and host
                 read per step (see the class). Skips are counted and logged; after
                 train.max_nonfinite_steps in a row the run stops (NonFiniteStepsError) without saving, so
                 the last checkpoint stays the last good one.
CollectiveTimeouts  Collectives get train.dist_timeout_minutes while the job starts and during checkpoint
                 saves and evaluations, and the short train.collective_timeout_seconds once the first step
                 is done (as torchtitan does): a rank that dies or hangs makes the others fail within that
                 time instead of waiting for half an hour. The failure is re-raised as CollectiveFailure,
                 naming the rank, step and phase.
DataSkipReport   On logging steps: the data stream's skip counters summed over ranks, and the skipped
                 samples (rank, shard, key, reason) since the last report, for metrics.jsonl and the log
                 (rank 0 logs each bad sample, and each broken shard, once per epoch); at the end of each
                 epoch and of the run, one line with the per-reason totals (and, for remote shards, the
                 retries and the shards skipped as unreadable).
"""

from __future__ import annotations

import contextlib
import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from fastclip.checkpoint import CHECKPOINTS, read_pointer
from fastclip.distributed import DistInfo
from fastclip.losses import FeaturesNotNormalisedError, LossInputError, NonFiniteFeaturesError
from fastclip.train.errors import CollectiveFailure, NonFiniteStepsError, TrainingError


def build_guards(cfg, info: DistInfo, *, log, stream, skips_on_device: bool):
    """(NonFiniteGuard, DataSkipReport) of a run: NaN/Inf steps skipped (on the device where the engine can:
    `skips_on_device`), skipped samples reported over ranks."""
    from fastclip.data import REASONS

    guard = NonFiniteGuard(
        cfg.train.max_nonfinite_steps,
        info,
        log=log,
        checkpoints=Path(cfg.train.run_dir) / CHECKPOINTS,
        on_device=cfg.train.nonfinite_check == "device" and skips_on_device,
    )
    return guard, DataSkipReport(stream, info, REASONS)


def check_loss_inputs(loss_fn, step: int) -> str | None:
    """loss.validate "deferred": the input checks of the loss calls since the last look (one host read; every
    rank holds every rank's check words, so all decide the same without a collective). Returns the
    non-finite-features error (the guard skips such a step: its loss is NaN too), raises for a bad index."""
    try:
        loss_fn.check_inputs()
    except NonFiniteFeaturesError as e:
        return str(e)
    except FeaturesNotNormalisedError as e:  # the towers normalise: zero rows from a collapsed tower
        raise TrainingError(f"step {step}: the loss refused its inputs: {e}") from None
    except LossInputError as e:
        raise TrainingError(
            f"step {step}: the loss refused its inputs: {e}. The shards' global indices must lie in "
            f"[0, num_samples of the manifest): re-run `fastclip data scan` on these shards"
        ) from None
    return None


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
class NonFiniteGuard:
    """Skip steps with NaN/Inf loss, gradients or features on any rank; stop after `max_in_a_row` in a row.

    Two ways to decide, the same steps skipped and the same state after them:
    host    `verdict`: one all_reduce of the flags (loss, gradient norm, stop signal) and one host read per step.
    device  (`on_device`; fused AdamW without fp16 loss scaling) `device_verdict` + `settle`: no collective and no
            host read per step. The flag comes from the gradient norm after the gradients were averaged over
            ranks, which is the same on every rank; the fused optimizer skips its update on the device
            (found_inf, as torch's GradScaler uses it), the journal's state rows are put back on the device,
            and the skips are counted there. `read` brings the counts to the host on logging steps and before
            a checkpoint (it logs the skips, raises after `max_in_a_row` in a row); stop signals are agreed on
            logging steps (`agree_stop`).
    """

    def __init__(
        self, max_in_a_row: int, info: DistInfo, *, log=None, checkpoints: Path | None = None, on_device=False
    ):
        self.max_in_a_row, self.info, self.log, self.checkpoints = max_in_a_row, info, log, checkpoints
        self.on_device = on_device
        self.skipped = 0  # steps skipped in this run (carried over by checkpoints)
        self.in_a_row = 0
        self.stop = False  # a stop signal reached some rank (combined in verdict's all_reduce / agree_stop)
        self._loss = None  # the loss: it journals this step's writes (per-sample state, queue), undone on a skip
        self._counts: torch.Tensor | None = None  # device mode: [skipped, in a row, longest run, last was skipped]
        self._read_step = 0  # device mode: the step of the last read

    def remember(self, loss_fn, device: torch.device) -> None:
        """Before the forward: the loss journals what it writes this step (the per-sample state rows it reads anyway,
        a feature queue's overwritten slots: no collective, no extra pass)."""
        loss_fn.begin_step(device)
        self._loss = loss_fn

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

    def device_verdict(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Device mode: 0-d float32, 1 where the step must not be taken; no collective, no host read. Decided on
        the all-reduced gradients' norm (the same bits on every rank: every rank decides alike); one process also
        looks at its loss."""
        bad = ~torch.isfinite(grad_norm.detach())
        if not self.info.distributed:
            bad = bad | ~torch.isfinite(loss.detach()).all()
        return bad.to(torch.float32)

    def settle(self, bad: torch.Tensor) -> None:
        """Device mode, after the step (which the optimizer skipped on the device where `bad`): put the journal's
        state rows back where bad and count, on the device."""
        if self._loss is not None:
            self._loss.rollback(undo=bad > 0)
        b = bad.to(torch.int64)
        if self._counts is None:
            self._counts = torch.tensor([0, self.in_a_row, self.in_a_row, 0], device=bad.device)
        skipped, row, longest, _ = self._counts.unbind()
        row = (row + 1) * b
        self._counts = torch.stack([skipped + b, row, torch.maximum(longest, row), b])

    def read(self, step: int, *, epoch: int, samples_seen: int, explain=None) -> str | None:
        """Device mode, on logging steps and before a checkpoint: one host read of the counts since the last
        read. Logs the skips, raises after `max_in_a_row` in a row; returns why step `step` was skipped, or None.
        `explain()` names non-finite features from the loss's input checks (None if there were none)."""
        if self._counts is None:
            return None
        skipped, row, longest, last = self._counts.tolist()
        self._counts = torch.tensor([0, row, row, last], device=self._counts.device)
        since, self._read_step = self._read_step, step
        self.in_a_row = row
        if not skipped:
            return None
        features = explain() if explain is not None else None
        why = (
            f"non-finite features: {features}"
            if features
            else "non-finite gradients (NaN/Inf gradient norm) on at least one rank"
            if self.info.distributed
            else "non-finite loss or gradients (NaN/Inf)"
        )
        self.skipped += skipped
        what = "skipped" if skipped == 1 and last else f"{skipped} step(s) of steps {since + 1}..{step} skipped"
        self._report(step, what, why, epoch=epoch, samples_seen=samples_seen, last=bool(last))
        if longest >= self.max_in_a_row:
            where = f"steps {step - row + 1}..{step}" if row == longest else f"within steps {since + 1}..{step}"
            self._stop_error(longest, where, why)
        return why if last else None

    def agree_stop(self, requested: bool) -> bool:
        """Device mode, on logging and stop-check steps: whether a stop signal reached any rank (a tiny all_reduce)."""
        flag = torch.tensor([float(requested)], device=self.info.device)
        if self.info.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stop = self.stop or bool(flag.item() > 0)
        return self.stop

    def passed(self) -> None:
        self.in_a_row = 0
        if self._loss is not None:
            self._loss.commit_step()

    def skip(self, step: int, why: str, *, epoch: int, samples_seen: int) -> None:
        """The step is not taken: put the per-sample state back, count, log; raise after too many in a row."""
        if self._loss is not None:
            self._loss.rollback()
        self.skipped += 1
        self.in_a_row += 1
        self._report(step, "skipped", why, epoch=epoch, samples_seen=samples_seen, last=True)
        if self.in_a_row >= self.max_in_a_row:
            self._stop_error(self.in_a_row, f"steps {step - self.in_a_row + 1}..{step}", why)

    def _report(self, step: int, what: str, why: str, *, epoch: int, samples_seen: int, last: bool) -> None:
        if self.log is None:
            return
        self.log.message(
            f"step {step}: {what} ({why}); no update of the model, optimizer or per-sample "
            f"state; {self.in_a_row} in a row, {self.skipped} in this run"
        )
        record = {
            "step": step,
            "epoch": epoch,
            "samples_seen": samples_seen,
            "nonfinite_skipped": self.skipped,
            "nonfinite_in_a_row": self.in_a_row,
        }
        if last:  # this step itself was skipped
            record["skipped"] = why
        self.log.log(record)

    def _stop_error(self, in_a_row: int, where: str, why: str):
        named = read_pointer(self.checkpoints) if self.checkpoints is not None else None
        if named is not None:
            last = (
                f"The last checkpoint, {self.checkpoints / named}, was saved before them and is "
                "intact. Check the data and the learning rate, then resume with --train.resume latest"
            )
        else:  # resuming "latest" would start over: say so instead of suggesting it
            last = "No checkpoint was saved: check the data and the learning rate, then start the run again"
        raise NonFiniteStepsError(
            f"{in_a_row} steps in a row were skipped for NaN/Inf ({where}; last: {why}); stopping at "
            f"train.max_nonfinite_steps = {self.max_in_a_row}. {last}"
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
        from fastclip.data.remote import is_remote

        self.stream, self.info, self.max_events = stream, info, max_events
        self.reasons = [r for r in reasons if r != "wrapped"]
        # remote reads' counters are reported (records and the epoch line) where the data has remote shards
        self.remote = any(is_remote(s.path) for s in stream.catalog.shards)
        self.last_total = 0
        self.logged: set = set()  # what was logged this epoch: (epoch, shard, reason) or (epoch, shard, key, reason)
        self.epoch_start: dict = {}  # the job-wide counts when the current epoch started (kept in checkpoints)

    def _counts(self) -> list[int]:
        from fastclip.data.remote import REMOTE_COUNTERS

        counters = self.stream.counters
        known = [int(counters.get(r, 0)) for r in self.reasons]
        not_samples = {"wrapped", *REMOTE_COUNTERS}
        other = sum(int(v) for k, v in counters.items() if k not in self.reasons and k not in not_samples)
        remote = [int(counters.get(k, 0)) for k in REMOTE_COUNTERS]
        return known + [other, int(counters.get("wrapped", 0))] + remote

    def collect(self) -> tuple[dict, list[dict]]:
        """({"data_skipped": n, "data_skipped/<reason>": n, ..., "data_wrapped": n, and with remote shards
        "data_remote_retries": n, "data_remote_shards_skipped": n}, new events of all ranks)."""
        counts = self._counts()
        if self.info.distributed:
            t = torch.tensor(counts, dtype=torch.int64, device=self.info.device)
            dist.all_reduce(t)
            counts = t.tolist()
        *by_reason, other, wrapped, retries, given_up = counts
        total = sum(by_reason) + other
        record = {"data_skipped": total, "data_wrapped": wrapped}
        if self.remote or retries or given_up:
            record.update({"data_remote_retries": retries, "data_remote_shards_skipped": given_up})
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

    def collect_into(self, record: dict) -> list[str]:
        """`collect` on a logging step: its counts (and "data_skips", the new events, if any) added to the step's
        record; returns the lines to log (describe)."""
        counts, events = self.collect()
        record.update(counts)
        if not events:
            return []
        record["data_skips"] = self.as_metrics(events)
        return self.describe(events)

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
        line = (
            f"{total} sample(s) skipped, summed over ranks"
            + (f" ({', '.join(f'{k} {v}' for k, v in sorted(parts.items()))})" if parts else "")
            + f"; {wrapped} served twice to fill the batches"
        )
        if "data_remote_retries" in record:
            retries = record["data_remote_retries"] - since.get("data_remote_retries", 0)
            given_up = record["data_remote_shards_skipped"] - since.get("data_remote_shards_skipped", 0)
            line += f"; remote shards: {retries} retries, {given_up} skipped as unreadable"
        return line

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
