"""The trainer: `train(cfg)` runs the same way as one process, under torchrun and under srun; every loss goes
through the same code. Top to bottom: checks -> processes -> `Run(...)`: the catalog and its checks
(catalog_checks.py), towers + loss + engine (net.py), data (data.py), resume (fastclip/checkpoint), reporting
(metrics.py) -> `Run.train()`: the loop, one `train_step` per batch (loader -> towers -> gathered features -> loss
with its sharded state -> optimizer), then logging, evaluation (evaluation.py) and checkpoints when due.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import torch

from fastclip import faults
from fastclip.checkpoint import MODEL_FILE
from fastclip.checkpoint.manager import SavedCheckpoint
from fastclip.checkpoint.parts import DataPosition, LossState, RNGStates
from fastclip.checkpoint.records import saved_config
from fastclip.data.plan import Layout
from fastclip.distributed import DistInfo, barrier, broadcast_flag, cleanup, frozen_heap, init_distributed
from fastclip.losses import NonFiniteFeaturesError
from fastclip.train import metrics, preflight
from fastclip.train.catalog_checks import check_inputs, shared_catalog
from fastclip.train.config import Config, dump_config, note
from fastclip.train.data import build_data, to_device
from fastclip.train.errors import DataFailure, explain_failure
from fastclip.train.evaluation import Evaluation
from fastclip.train.guards import CollectiveTimeouts, build_guards, check_loss_inputs
from fastclip.train.metrics import STEP_LINE, Throughput, scalar_metrics
from fastclip.train.net import build_net, seed_all, temperature_to_towers
from fastclip.train.parts import Towers, run_checkpoints, run_parts
from fastclip.train.preemption import StopSignals, stopped_line
from fastclip.train.schedules import Schedules


# ----------------------------------------------------------------------------- the trainer
def train(cfg: Config) -> dict:
    # what the operator typed, before a process group, a tower or a data worker exists (ConfigError: exit 2)
    fresh = not os.path.lexists(cfg.train.run_dir)  # made by this run: removed if it fails before writing
    preflight.check_operator_input(cfg)
    with frozen_heap():  # the end's collection scans only the run's objects (0.4 s less if open_clip came first)
        return _train_in_group(cfg, fresh)


def _train_in_group(cfg: Config, fresh: bool = False) -> dict:
    try:
        info = init_distributed(cfg.train.device, cfg.train.backend, cfg.train.dist_timeout_minutes)
    except BaseException:  # no group, so no lock: the peers failed the same join (or a stop ended this rank's wait)
        if fresh:
            preflight.remove_if_untouched_and_free(Path(cfg.train.run_dir))
        raise
    timeouts = CollectiveTimeouts(
        info, start_seconds=60 * cfg.train.dist_timeout_minutes, train_seconds=cfg.train.collective_timeout_seconds
    )
    # SIGUSR1/SIGTERM: checkpoint at the next step on every rank, then stop (fastclip/train/preemption.py)
    stop, stopped, lock, failed = StopSignals(cfg.train.stop_signals).install(), False, None, False
    try:
        lock = preflight.lock_run_dir(cfg, info)  # one job per run folder
        result = _train(cfg, info, timeouts, stop)
        stopped = result["preempted"]
        return result
    except BaseException as e:
        failed = True
        e.at_step = timeouts.step  # the step it stopped on, for `fastclip train`'s line after a Ctrl-C
        # the traceback's frames hold the DDP wrapper; cleared, it can be freed before the group goes
        traceback.clear_frames(e.__traceback__)
        explained = explain_failure(e, timeouts, cfg)  # out of data or memory, a failed collective: one named error
        if explained is e:
            raise
        raise explained from (None if isinstance(explained, DataFailure) else e)  # DataFailure: its own words
    finally:
        cleanup(info)
        stop.release(stopped=stopped)
        if lock is not None:
            if failed and fresh:  # (rank 0: the lock's holder) a data or config error before anything was written;
                preflight.remove_if_untouched(Path(cfg.train.run_dir))  # removed while the lock is held
            lock.close()  # releases the run folder


def _train(cfg: Config, info: DistInfo, timeouts: CollectiveTimeouts, stop: StopSignals) -> dict:
    run = Run(cfg, info, timeouts, stop)
    result = run.train()
    run.log.close()
    return result


class Run:
    """One training run on this rank: everything built and restored by __init__, then `train()`."""

    def __init__(self, cfg: Config, info: DistInfo, timeouts: CollectiveTimeouts, stop: StopSignals):
        self.cfg, self.info, self.timeouts, self.stop = cfg, info, timeouts, stop
        self.device, self.run_dir = info.device, Path(cfg.train.run_dir)
        # checks that need the data and the world size, before anything heavy
        catalog = shared_catalog(cfg, info)
        data_size, self.resume_dir, model_file, pretrained = check_inputs(cfg, info.world_size, catalog)
        self.pretrained: str | None = None  # the start line's words for model.pretrained's file, once loaded
        self.saved_config = saved_config(model_file) if model_file is not None else None  # (changed_on_resume_note)
        resume = SavedCheckpoint(self.resume_dir, model_file, info) if model_file is not None else None
        # every part of the run's state, by name, added as it is built (and loaded then, resuming): fastclip/checkpoint;
        # DeepSpeed's shards are written beside
        self.checkpoints, resumed_here = run_checkpoints(
            cfg, info, resume, write_extra=lambda d: self.engine.save_shards(d)
        )
        self.net = self.build_net(data_size, resume, pretrained)
        self.model, self.loss_fn, self.engine = self.net.model, self.net.loss_fn, self.net.engine
        # this rank's part of every global batch; uint8 images, normalised on the device (fastclip/data/pixels.py)
        self.stream, self.normalize = build_data(cfg, info, self.net.built, catalog, data_size)
        self.global_batch = cfg.data.batch_size * info.world_size
        epoch_length = self.stream.epoch_length
        self.schedules = Schedules(cfg, self.engine, epoch_length=epoch_length, global_batch=self.global_batch)
        self.step, self.samples_seen, self.epoch = 0, 0, 0
        self.restore(resume)
        remaining = sum(self.stream.batches_remaining(e) for e in range(self.epoch, cfg.train.epochs))
        self.last_step = min(n for n in (self.step + remaining, cfg.train.max_steps) if n is not None)
        span = self.schedules.total_steps  # the epochs' span in schedule steps (another unit: resumed elsewhere)
        # where the schedules will be at the end
        ends_at = self.schedules.position(self.samples_seen + remaining * self.global_batch)
        stretched = ends_at > span  # resumed at another layout: its last batches of the epoch wrap to fill
        if stretched:  # (else the last batches would train at the schedule's end, lr 0)
            self.schedules.total_steps = ends_at
        self.start_reporting()
        if stretched:
            self.log.message(
                f"resumed at another data layout: the rest of the run is {remaining} batches of {self.global_batch}, "
                f"so the lr schedules now end at {ends_at} steps of {self.schedules.unit} samples, not {span}"
            )
        self.last_saved, self.last_save_time = (self.step if resumed_here else -1), time.time()
        self.throughput, self.record = Throughput(), {}

    def build_net(self, data_size: int, resume: SavedCheckpoint | None, pretrained: dict | None):
        """Towers + loss + engine (net.py), their weights from the checkpoint resumed or model.pretrained."""
        cfg = self.cfg

        def load(model, loss_fn):  # before the engine wraps them: DDP then broadcasts identical tensors
            what = f"checkpoint {self.resume_dir / MODEL_FILE}" if resume is not None else ""
            towers = Towers(model, gather=lambda: self.engine.model_state_dict(), what=what)
            self.checkpoints.add(shared={"state_dict": towers}, per_rank={"loss_state": LossState(loss_fn)})
            if pretrained is not None:  # strict: a partial load would train a half-random model without a word
                model.load_state_dict(preflight.fit_pretrained(model, pretrained, cfg.model.pretrained))
                self.pretrained = preflight.pretrained_words(model.state_dict(), pretrained, cfg.model.pretrained)

        momentum_state = resume.shared_state("momentum_towers") if resume is not None else None
        net = build_net(cfg, self.info, data_size, load=load, momentum_state=momentum_state)
        if net.momentum_towers is not None:  # (loaded by build_net, into the copy made before the engine wraps it)
            self.checkpoints.add(shared={"momentum_towers": net.momentum_towers}, load=False)
        return net

    def restore(self, resume: SavedCheckpoint | None) -> None:
        """Adds the optimizer, counters, data position and RNG streams to the checkpoints (loading them, resuming)."""
        cfg = self.cfg
        position = DataPosition(self.stream)
        self.checkpoints.add(shared=run_parts(self), per_rank={"data": position})
        # the data layout the checkpoint was trained at (setting_notes: a batch size change is said with its rule)
        saved_layout = (position.loaded or {}).get("layout")
        self.resumed_layout = Layout(**saved_layout) if saved_layout else None
        self.checkpoints.finish_pruning()
        # same world size: this rank's RNG streams exactly; else (and in a new run) fresh ones
        rng = RNGStates(self.device, reseed=lambda: seed_all(cfg.train.seed + 1000 * self.info.rank + self.step))
        self.checkpoints.add(per_rank={"rng": rng})
        if resume is None:
            rng.reseed()

    def start_reporting(self) -> None:
        """Metrics, evaluation, the start lines (rank 0) and fault handling."""
        cfg, info = self.cfg, self.info
        restart = preflight.restart_note(cfg, self.resume_dir) if info.is_main else None  # before the logger cuts
        self.log = metrics.run_logger(cfg, enabled=info.is_main, start_step=self.step, total_steps=self.last_step)
        self.evaluation = Evaluation(cfg, self.net, self.device, self.log)
        if info.is_main:
            config_file = self.run_dir / "config.yaml"
            try:
                config_file.write_text(f"# resolved config of `fastclip train`\n{dump_config(cfg)}")
            except OSError as e:  # a full disk: named, for the run's one line (train/errors.py write_failure)
                raise OSError(e.errno, e.strerror, str(config_file)) from None
            steps = (self.step, self.last_step)
            self.log.message(
                metrics.start_line(cfg, info, self.net, self.stream, steps, self.resume_dir, self.pretrained)
            )
            # (the epochs' span: where a resume's data rule stretches the schedules past it, a line says so)
            notes = preflight.setting_notes(
                cfg, self.device, self.resumed_layout, self.stream, self.schedules, steps, self.loss_fn,
                self.schedules.position(self.samples_seen + (self.last_step - self.step) * self.global_batch),
            )  # fmt: skip
            changed = preflight.changed_on_resume_note(cfg, self.saved_config)
            for line in [restart] * (restart is not None) + [changed] * (changed is not None) + notes:
                note(line)
        # fault handling (guards.py): NaN/Inf steps skipped, skipped samples reported over ranks
        self.guard, self.skips = build_guards(
            cfg, info, log=self.log, stream=self.stream, skips_on_device=self.engine.skips_on_device
        )
        self.checkpoints.add(
            shared={"scaler": self.engine.scaler, "guards": self.guard, "data_skip_report": self.skips}
        )

    # ---- the loop: epochs of the data stream, one optimizer step per batch
    def train(self) -> dict:
        cfg, guard = self.cfg, self.guard
        started_at = self.step
        if self.evaluation_owed():
            with self.timeouts.relaxed("evaluation"):
                self.evaluation.evaluate(self.step, self.samples_seen)
        self.model.train()
        while self.step < self.last_step and self.epoch < cfg.train.epochs and not guard.stop:
            self.train_epoch()
        with self.timeouts.relaxed("final evaluation and checkpoint"):
            if cfg.checkpoint.at_end and self.last_saved != self.step:  # first: an evaluation error loses nothing
                self.save()
            # a stopped run evaluates when it completes; a finished one called again has its evaluation already
            if cfg.eval.at_end and self.step > 0 and not guard.stop and not self.evaluated_before(started_at):
                self.evaluation.evaluate(self.step, self.samples_seen)
            barrier(self.info)
        return metrics.run_summary(
            self.step,
            self.epoch,
            self.samples_seen,
            run_dir=self.run_dir,
            last=self.record,
            preempted=guard.stop,
            samples_per_s=self.throughput.samples_per_s(self.global_batch),
        )

    def evaluated_before(self, started_at: int) -> bool:
        """This call resumed at the step it ends on, trained none, and the log holds that step's evaluation."""
        if self.resume_dir is None or self.step != started_at:
            return False
        return broadcast_flag(self.info.is_main and self.log.evaluated_at_start, self.info)

    def evaluation_owed(self) -> bool:
        """A stop (75) on an evaluation step checkpoints without evaluating (the signal's lead is short): the resume
        evaluates that step first, from the same state, so the run logs the curve of one never stopped."""
        step = self.step
        if not (self.resume_dir is not None and step > 0 and self.evaluates_at(step)):
            return False
        # an epoch's end: the trainer ended the epoch before the checkpoint, whose stream has not entered the next
        ended_epoch = not self.stream.entered(self.epoch) and self.epoch_evaluation()
        if not (self.evaluates_by_steps(step) or ended_epoch):
            return False
        return broadcast_flag(self.info.is_main and not self.log.evaluated_at_start, self.info)

    def evaluates_at(self, step: int) -> bool:
        """A cadence's evaluation may fall on `step`: every step but the last when eval.at_end makes that one."""
        return step != self.last_step or not self.cfg.eval.at_end

    def evaluates_by_steps(self, step: int) -> bool:
        return every_nth(step, self.cfg.eval.every_steps)

    def train_epoch(self) -> None:
        """The rest of this epoch's batches (or up to the last step, or a stop)."""
        guard, batches = self.guard, iter(self.stream.epoch(self.epoch))
        while self.step < self.last_step:
            t0 = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break  # epoch done
            batch = to_device(batch, self.device, self.normalize, ssl=self.cfg.ssl.enabled)
            self.throughput.data += time.perf_counter() - t0
            loss, grad_norm, skip = self.train_step(*batch)
            # this step ends an epoch: the epoch cadences' steps (whatever an epoch's length at this layout)
            ends_epoch = self.stream.batches_remaining(self.epoch) == 0
            save_by_epoch = ends_epoch and every_nth(self.epoch + 1, self.cfg.checkpoint.every_epochs)
            if guard.on_device and (
                self.is_logging_step() or self.checkpoint_due() or save_by_epoch or self.stop_check_due()
            ):
                # the device's skip counts: on these steps only; a step refused before its loss (non-finite
                # features: no loss to log) stays skipped whatever the device read says
                skip = self.read_skips() or skip
            save_due = self.log_step(loss, grad_norm, skip) if self.is_logging_step() else False
            if ends_epoch:
                # before a checkpoint of this step: it then resumes in the next epoch, not in this one's end
                # (which would report this epoch's data line a second time)
                self.end_epoch()
            self.after_step(skip, save_due or save_by_epoch, evaluate_by_epoch=ends_epoch and self.epoch_evaluation())
            if guard.stop:  # every rank saw the request at this step (verdict): checkpoint here and leave
                self.save_once("checkpoint save")
                self.log.message(stopped_line(self.step, self.stop.reason()))
                break
        if self.stream.batches_remaining(self.epoch) == 0:  # an epoch with no batch left for this run
            self.end_epoch()
        del batches  # stops the epoch's data workers now when training stops early

    def train_step(
        self, images, texts, indices, groups=None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, str | None]:
        """One optimizer step, or none when any rank saw NaN/Inf (skip says why); advances step and samples_seen.
        groups go to the loss only where a manifest says samples share groups (the same choice on every rank): else
        each is the sample's index, which the loss would only turn into a [B, N] mask of the pairs."""
        engine, loss_fn, guard, step, rank = self.engine, self.loss_fn, self.guard, self.step + 1, self.info.rank
        self.schedules.apply(self.samples_seen)
        self.timeouts.at(step)
        faults.hook("batch", step=step, rank=rank, tensors=(images,))  # test-only: FASTCLIP_FAULTS
        guard.remember(loss_fn, self.info.device)  # journal the per-sample state rows: a skipped step puts them back
        grad_norm = None
        try:
            groups = groups if self.stream.grouped else None
            loss = engine.forward(images, texts, indices, self.epoch, groups)  # accum_steps > 1: one loss call
        except NonFiniteFeaturesError as e:  # raised alike on every rank, before the loss writes its state
            loss, skip = None, f"non-finite features: {e}"
        bad = None  # device mode: the skip flag, never read on the host here
        if loss is not None:
            faults.hook("step", step=step, rank=rank)
            engine.backward(loss)
            faults.hook("grads", step=step, rank=rank, tensors=(p.grad for p in engine.trainable))
            grad_norm = engine.grad_norm(self.cfg.optim.grad_clip)  # fp16: unscaled first; clipped when set
            if guard.on_device:  # decided and applied on the device: no host read, no collective
                bad, skip = guard.device_verdict(loss, grad_norm), None
            else:  # NaN/Inf on any rank: the same answer on every rank; a stop signal of any rank rides along
                skip = guard.verdict(loss, grad_norm, stop_requested=self.stop.requested)
                if skip is not None:  # a rare step: worth the host read that names the cause (validate "deferred")
                    features = self.check_loss_inputs()
                    skip = f"non-finite features: {features}" if features else skip
        if skip is None:
            self.optimizer_step(bad)
        else:  # no optimizer step; the per-sample state rows are put back; stops after N in a row
            if loss is not None:
                engine.skip_step()  # fp16: lower the loss scale after the overflow; DeepSpeed: drop its gradients
            guard.skip(step, skip, epoch=self.epoch, samples_seen=self.samples_seen + self.global_batch)
        self.step, self.samples_seen = step, self.samples_seen + self.global_batch
        self.throughput.steps += 1
        self.timeouts.first_step_done()  # from now on a dead or hung rank fails collectives within the short timeout
        return loss, grad_norm, skip

    def optimizer_step(self, bad: torch.Tensor | None) -> None:
        """The update (device mode: skipped on the device where `bad`), the temperature's rules, the EMA towers."""
        engine, loss_fn, guard = self.engine, self.loss_fn, self.guard
        self.schedules.thresh.before_step(loss_fn.temperature())
        if bad is None:
            engine.step()
        else:  # the optimizer skips its update on the device where bad
            engine.step(found_inf=bad)
        self.schedules.thresh.after_step()
        loss_fn.clamp_()
        if self.net.momentum_towers is not None:  # a step skipped on the device leaves it as it was
            self.net.momentum_towers.update(self.model, skipped=bad)
        if bad is None:
            guard.passed()
        else:
            guard.settle(bad)

    def checkpoint_due(self) -> bool:
        """By step count (the epoch cadence is decided where an epoch ends: train_epoch)."""
        return every_nth(self.step, self.cfg.checkpoint.every_steps)

    def read_skips(self) -> str | None:
        """Device mode: the skips since the last read (logged; raises after too many in a row); why this step
        was skipped, or None. Stop signals are agreed here too (a tiny all_reduce), on logging steps and every
        train.stop_check_every steps."""
        skip = self.guard.read(
            self.step, epoch=self.epoch, samples_seen=self.samples_seen, explain=self.check_loss_inputs
        )
        if self.is_logging_step() or self.stop_check_due():
            self.guard.agree_stop(self.stop.requested)
        return skip

    def stop_check_due(self) -> bool:
        return self.step % self.cfg.train.stop_check_every == 0

    def is_logging_step(self) -> bool:
        return self.step % self.cfg.train.log_every == 0 or self.step == self.last_step

    def log_step(self, loss, grad_norm, skip: str | None) -> bool:
        """The step's metrics (the only host reads of a step) and the skipped samples of every rank; returns
        whether a checkpoint is due by wall clock (rank 0's decision, shared: the same on all ranks)."""
        cfg, t = self.cfg, self.throughput
        nonfinite = self.check_loss_inputs()
        if nonfinite:
            self.log.message(f"step {self.step}: {nonfinite}")
        values = scalar_metrics(self.loss_fn, loss, self.step) if skip is None else {}
        record = metrics.step_record(
            self.step,
            self.epoch,
            self.samples_seen,
            values,
            lr=self.schedules.lr,
            lr_tau=self.schedules.effective_lr_tau(),
            rates=t.window(self.global_batch, cfg.data.batch_size),
            nonfinite_skipped=self.guard.skipped,
            grad_norm=float(grad_norm) if skip is None else None,
        )
        for line in self.skips.collect_into(record):  # summed over ranks: a collective on logging steps
            self.log.message(line)
        self.log.log(record, STEP_LINE)
        self.record = record
        due = cfg.checkpoint.every_minutes > 0 and broadcast_flag(
            time.time() - self.last_save_time >= 60 * cfg.checkpoint.every_minutes, self.info
        )
        t.restart()
        return due

    def epoch_evaluation(self) -> bool:
        """Whether the epochs done so far (self.epoch, once an epoch has ended) call for eval.every_epochs'."""
        return every_nth(self.epoch, self.cfg.eval.every_epochs)

    def after_step(self, skip: str | None, save_due: bool, evaluate_by_epoch: bool = False) -> None:
        """Evaluation and checkpoint when due (`save_due`, `evaluate_by_epoch`: by the clock or the epoch); their
        time is left out of the throughput."""
        step, t_pause = self.step, time.perf_counter()
        due = self.evaluates_by_steps(step) or evaluate_by_epoch
        if due and self.evaluates_at(step) and not self.guard.stop:  # (the last step: at_end's, not twice)
            with self.timeouts.relaxed("evaluation"):
                self.evaluation.evaluate(self.step, self.samples_seen)
        # no checkpoint on a skipped step: after too many in a row the last checkpoint is a good one
        if skip is None and (save_due or self.checkpoint_due()):
            with self.timeouts.relaxed("checkpoint save"):
                self.save()
        self.throughput.pause += time.perf_counter() - t_pause

    def end_epoch(self) -> None:
        data_counts, data_events = self.skips.collect()  # collective: every rank ends the epoch here
        for line in self.skips.describe(data_events) + [self.skips.end_of_epoch(self.epoch, data_counts)]:
            self.log.message(line)
        self.epoch += 1

    def save_once(self, phase: str) -> None:
        if self.last_saved != self.step:
            with self.timeouts.relaxed(phase):
                self.save()

    def check_loss_inputs(self) -> str | None:
        return check_loss_inputs(self.loss_fn, self.step)  # a non-finite-features error, or None; raises for an index

    def save(self) -> None:
        """Collective: model.pt on rank 0 and every rank's file, of every part added (fastclip/checkpoint)."""
        self.check_loss_inputs()  # never a checkpoint after an index the loss refused
        temperature_to_towers(self.model, self.loss_fn)
        if self.net.momentum_towers is not None:  # (their logit_scale is not averaged: momentum.NOT_AVERAGED)
            temperature_to_towers(self.net.momentum_towers.towers, self.loss_fn)
        path = self.checkpoints.save(self.step)
        self.last_saved, self.last_save_time = self.step, time.time()
        self.log.message(f"checkpoint {path}")


def every_nth(count: int, every: int) -> bool:
    """Whether the count-th (step, or epoch done) is one of every `every`-th (0: none)."""
    return every > 0 and count > 0 and count % every == 0
