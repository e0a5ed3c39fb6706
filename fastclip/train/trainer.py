"""The trainer: `train(cfg)` runs the same way as one process, under torchrun and under srun; every loss goes
through the same code. Top to bottom: checks -> processes -> `Run(...)`: the catalog and its checks
(catalog_checks.py), towers + loss + engine (net.py), data, resume (fastclip/checkpoint), logging -> `Run.train()`: the
loop, one `train_step` per batch, then logging, evaluation (evaluation.py) and checkpoints when due.
"""

from __future__ import annotations

import math
import time
import traceback
from pathlib import Path

import torch

from fastclip import faults
from fastclip.checkpoint import MODEL_FILE
from fastclip.checkpoint.manager import CheckpointManager, SavedCheckpoint
from fastclip.checkpoint.parts import DataPosition, LossParameters, LossState, Record, RNGStates, Value
from fastclip.data import StreamConfig
from fastclip.data.pixels import on_device
from fastclip.data.plan import Layout, num_batches
from fastclip.data.views import split_views
from fastclip.distributed import DistInfo, barrier, broadcast_flag, cleanup, init_distributed
from fastclip.losses import LossInputError, NonFiniteFeaturesError
from fastclip.optim import ThresholdRule, get_lr, get_tau_lr
from fastclip.train import preflight
from fastclip.train.catalog_checks import check_inputs, shared_catalog
from fastclip.train.config import Config, ConfigError, dump_config, note
from fastclip.train.errors import DataFailure, TrainingError
from fastclip.train.evaluation import Evaluation
from fastclip.train.guards import CollectiveTimeouts, DataSkipReport, NonFiniteGuard
from fastclip.train.metrics import STEP_LINE, MetricsLogger
from fastclip.train.net import build_net, seed_all
from fastclip.train.parts import Optimizer, Towers
from fastclip.train.preemption import EXIT_PREEMPTED, StopSignals

# ----------------------------------------------------------------------------- helpers
PRECISION_WORDS = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast with loss scaling"}


def stream_config(cfg: Config, data_size: int, device: torch.device) -> StreamConfig:
    """The data section (its stream keys are StreamConfig's) plus what the trainer decides: seed, data_size,
    pinning; rank 0 logs every rank's skips, once per epoch (DataSkipReport)."""
    pin_memory = device.type == "cuda" and cfg.data.pin_memory is not False
    decided = {"seed": preflight.data_seed(cfg), "data_size": data_size, "pin_memory": pin_memory}
    return StreamConfig.from_any(cfg.data, **decided, log_skips_per_reason=0)


def train_pixels(cfg: Config, preprocess):
    """(the data workers' transform, the device's Normalize): uint8 batches, normalised on the device, unless
    data.device_normalize is false or the transform cannot be split (timm's erasing): then (preprocess, None)."""
    split = on_device(preprocess) if cfg.data.device_normalize is not False else None
    if split is None and cfg.data.device_normalize:
        raise ConfigError(
            "config key 'data.device_normalize': the training transform does not end in ToTensor + Normalize, so "
            "its pixels cannot be normalised on the device: set it null or false"
        )
    return split or (preprocess, None)


def scalar_metrics(loss_fn, loss: torch.Tensor) -> dict:
    """Host values of the loss's metrics (call on logging steps only: .item() waits for the device)."""
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
    return out


# ----------------------------------------------------------------------------- the trainer
def train(cfg: Config) -> dict:
    # what the operator typed, before a process group, a tower or a data worker exists (ConfigError: exit 2)
    preflight.check_operator_input(cfg)
    info = init_distributed(cfg.train.device, cfg.train.backend, cfg.train.dist_timeout_minutes)
    timeouts = CollectiveTimeouts(
        info, start_seconds=60 * cfg.train.dist_timeout_minutes, train_seconds=cfg.train.collective_timeout_seconds
    )
    # SIGUSR1/SIGTERM: checkpoint at the next step on every rank, then stop (fastclip/train/preemption.py)
    stop, stopped, lock = StopSignals(cfg.train.stop_signals).install(), False, None
    try:
        lock = preflight.lock_run_dir(cfg, info)  # one job per run folder
        result = _train(cfg, info, timeouts, stop)
        stopped = result["preempted"]
        return result
    except BaseException as e:
        e.at_step = timeouts.step  # the step it stopped on, for `fastclip train`'s line after a Ctrl-C
        # the traceback's frames hold the DDP wrapper; cleared, it can be freed before the group goes
        traceback.clear_frames(e.__traceback__)
        from fastclip.data.samples import DataExhausted

        if isinstance(e, DataExhausted):  # this rank has nothing to train on: its message names the shards
            raise DataFailure(str(e)) from None
        explained = timeouts.explain(e)
        if explained is e:
            raise
        raise explained from e  # a failed collective becomes a CollectiveFailure naming rank, step and phase
    finally:
        cleanup(info)
        stop.release(stopped=stopped)
        if lock is not None:
            lock.close()  # releases the run folder


def _train(cfg: Config, info: DistInfo, timeouts: CollectiveTimeouts, stop: StopSignals) -> dict:
    run = Run(cfg, info, timeouts, stop)
    result = run.train()
    run.log.close()
    return result


# ----------------------------------------------------------------------------- the parts of a run
class Schedules:
    """The lr of the towers and of the temperature group. They run on samples seen, counted in global batches
    of the current run: equal to the step count, and still the right place in the schedule after a resume at
    another world size. The step_thresh rule (optim.ThresholdRule) scales the temperature's step on device."""

    def __init__(self, cfg: Config, engine, *, total_steps: int, global_batch: int):
        self.o, self.engine, self.total_steps, self.global_batch = cfg.optim, engine, total_steps, global_batch
        self.thresh = ThresholdRule(
            engine.tau_params if self.o.lr_tau_schedule == "step_thresh" else [],
            threshold=self.o.tau_threshold,
            factor=self.o.tau_threshold_factor,
        )
        self.lr, self.lr_tau = 0.0, 0.0  # the last step's values

    def apply(self, samples_seen: int) -> None:
        o, at = self.o, samples_seen // self.global_batch
        self.lr = get_lr(
            at,
            base_lr=o.lr,
            warmup_steps=o.warmup_steps,
            total_steps=self.total_steps,
            lr_min=o.lr_min,
            kind=o.lr_schedule,
        )
        self.lr_tau = get_tau_lr(
            at,
            lr_tau=o.base_lr_tau,
            kind=o.lr_tau_schedule,
            warmup_steps=o.warmup_steps,
            total_steps=self.total_steps,
            lr_tau_min=o.lr_tau_min,
        )
        for g in self.engine.param_groups:
            g["lr"] = self.lr_tau if g["name"] == "temperature" else self.lr

    def effective_lr_tau(self) -> float:
        return self.lr_tau * self.thresh.factor_now()

    def state(self) -> dict:
        """Their horizon and last values, for reading (they are pure functions of samples_seen)."""
        return {
            "total_steps": self.total_steps,
            "global_batch": self.global_batch,
            "lr": self.lr,
            "lr_tau": self.effective_lr_tau(),
        }


class Throughput:
    """Wall time between logging steps, without the pauses (evaluation, checkpoints), and the run's total."""

    def __init__(self):
        self.train_time, self.trained_steps = 0.0, 0
        self.restart()

    def restart(self) -> None:
        self.steps, self.data, self.pause, self.start = 0, 0.0, 0.0, time.perf_counter()

    def window(self) -> float:
        """Closes the window: its training seconds (added to the run's total)."""
        elapsed = time.perf_counter() - self.start - self.pause
        self.train_time, self.trained_steps = self.train_time + elapsed, self.trained_steps + self.steps
        return elapsed


class Run:
    """One training run on this rank: everything built and restored by __init__, then `train()`."""

    def __init__(self, cfg: Config, info: DistInfo, timeouts: CollectiveTimeouts, stop: StopSignals):
        from fastclip.data import REASONS, build_train_stream

        self.cfg, self.info, self.timeouts, self.stop = cfg, info, timeouts, stop
        self.device, self.run_dir = info.device, Path(cfg.train.run_dir)
        # checks that need the data and the world size, before anything heavy
        catalog = shared_catalog(cfg, info)
        data_size, self.resume_dir, model_file, pretrained = check_inputs(cfg, info.world_size, catalog)
        self.pretrained = pretrained is not None

        resume = SavedCheckpoint(self.resume_dir, model_file, info) if model_file is not None else None
        # every part of the run's state, by name, added as it is built (and loaded then, resuming): fastclip/checkpoint
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints",
            info,
            keep_last=cfg.checkpoint.keep_last,
            durable=cfg.checkpoint.fsync,
            write_extra=lambda folder: self.engine.save_shards(folder),  # DeepSpeed's shards
            resume=resume,
        )

        def load(model, loss_fn):  # before the engine wraps them: DDP then broadcasts identical tensors
            what = f"checkpoint {self.resume_dir / MODEL_FILE}" if resume is not None else ""
            towers = Towers(model, gather=lambda: self.engine.model_state_dict(), what=what)
            self.checkpoints.add(shared={"state_dict": towers}, per_rank={"loss_state": LossState(loss_fn)})
            if pretrained is not None:  # strict: a partial load would train a half-random model without a word
                preflight.check_fits(model, pretrained, cfg.model.pretrained, "model.pretrained")
                model.load_state_dict(pretrained)

        momentum_state = resume.shared_state("momentum_towers") if resume is not None else None
        self.net = net = build_net(cfg, info, data_size, load=load, momentum_state=momentum_state)
        if net.momentum_towers is not None:  # (loaded by build_net, into the copy made before the engine wraps it)
            self.checkpoints.add(shared={"momentum_towers": net.momentum_towers}, load=False)
        self.model, self.loss_fn, self.engine = net.model, net.loss_fn, net.engine
        # this rank's part of every global batch; uint8 images, normalised on the device (fastclip/data/pixels.py)
        preprocess, self.normalize = train_pixels(cfg, net.built.preprocess_train)
        if self.normalize is not None:
            self.normalize.to(self.device)
        self.stream = build_train_stream(
            stream_config(cfg, data_size, self.device),
            rank=info.rank,
            world_size=info.world_size,
            preprocess=preprocess,
            tokenizer=net.built.tokenizer,
            catalog=catalog,
        )
        self.global_batch = cfg.data.batch_size * info.world_size
        self.schedules = Schedules(
            cfg,
            self.engine,
            total_steps=cfg.train.epochs * self.stream.batches_per_epoch,
            global_batch=self.global_batch,
        )
        self.step, self.samples_seen, self.epoch = 0, 0, 0
        position = DataPosition(self.stream)
        self.checkpoints.add(
            shared={
                "loss": LossParameters(self.loss_fn),  # for export and eval: the rank files restore the loss
                "optimizer": Optimizer(self.engine, self.resume_dir),  # DeepSpeed: its shards too
                "step": Value(self, "step"),
                "epoch": Value(self, "epoch"),
                "samples_seen": Value(self, "samples_seen"),
                "config": Record(cfg.to_dict),
                "schedules": Record(self.schedules.state),  # for reading: pure functions of samples_seen
                "arch": Record(lambda: net.built.arch),
                "model_config": Record(lambda: net.built.config),
            },
            per_rank={"data": position},
        )
        # the data layout the checkpoint was trained at (setting_notes: a batch size change is said with its rule)
        saved_layout = (position.loaded or {}).get("layout")
        self.resumed_layout = Layout(**saved_layout) if saved_layout else None
        self.checkpoints.finish_pruning()
        # same world size: this rank's RNG streams exactly; else (and in a new run) fresh ones
        rng = RNGStates(self.device, reseed=lambda: seed_all(cfg.train.seed + 1000 * info.rank + self.step))
        self.checkpoints.add(per_rank={"rng": rng})
        if resume is None:
            rng.reseed()
        remaining = sum(self.stream.batches_remaining(e) for e in range(self.epoch, cfg.train.epochs))
        self.last_step = self.step + remaining
        if cfg.train.max_steps is not None:
            self.last_step = min(self.last_step, cfg.train.max_steps)

        self.log = MetricsLogger(
            self.run_dir,
            enabled=info.is_main,
            total_steps=self.last_step,
            start_step=self.step,
            tensorboard=cfg.train.tensorboard,
            progress=cfg.train.progress,
            wandb=dict(project=cfg.train.wandb_project, config=cfg.to_dict()) if cfg.train.wandb else None,
        )
        self.evaluation = Evaluation(cfg, net, self.device, self.log)
        if info.is_main:
            (self.run_dir / "config.yaml").write_text(f"# resolved config of `fastclip train`\n{dump_config(cfg)}")
            self.log.message(self.describe())
            for line in self.setting_notes():
                note(line)
        # fault handling (fastclip/train/guards.py): NaN/Inf steps skipped, skipped samples reported over ranks
        self.guard = NonFiniteGuard(
            cfg.train.max_nonfinite_steps,
            info,
            log=self.log,
            checkpoints=self.run_dir / "checkpoints",
            on_device=cfg.train.nonfinite_check == "device" and self.engine.skips_on_device,
        )
        self.skips = DataSkipReport(self.stream, info, REASONS)
        self.checkpoints.add(
            shared={"scaler": self.engine.scaler, "guards": self.guard, "data_skip_report": self.skips}
        )
        # a checkpoint of this run exists at the resume step; one taken from elsewhere does not (so it is saved)
        resumed_here = (
            self.resume_dir is not None and self.resume_dir.parent.resolve() == (self.run_dir / "checkpoints").resolve()
        )
        self.last_saved, self.last_save_time = (self.step if resumed_here else -1), time.time()
        self.throughput, self.record = Throughput(), {}

    def setting_notes(self) -> list[str]:
        """Settings that are legal but rarely what was meant, said once at the start."""
        cfg, o, notes = self.cfg, self.cfg.optim, []
        if cfg.train.precision == "fp16" and self.device.type == "cpu":  # OpenCLIP's --precision amp, on a CPU
            notes.append(
                "fastclip train: note: train.precision fp16 (--precision amp) on the CPU: most CPUs have no fast "
                "float16 matmul, so this runs several times slower than fp32, which suits a CPU"
            )
        if self.resumed_layout is not None and self.resumed_layout.batch_size != cfg.data.batch_size:
            before = num_batches(self.stream.epoch_length, self.resumed_layout)
            notes.append(
                f"fastclip train: note: data.batch_size {self.resumed_layout.batch_size} -> {cfg.data.batch_size} per "
                f"process (train.resume_batch_change): {before} -> {self.stream.batches_per_epoch} steps per epoch; "
                f"the schedules now span {cfg.train.epochs} epochs x {self.stream.batches_per_epoch} = "
                f"{self.schedules.total_steps} steps and continue from step {self.step} on that new span (the lr "
                f"there is the new schedule's); the rest of the interrupted epoch is served at the new batch size"
            )
        if o.warmup_steps > self.last_step:
            notes.append(
                f"fastclip train: note: optim.warmup_steps {o.warmup_steps} > the run's {self.last_step} steps: the "
                f"learning rate never reaches optim.lr {o.lr:g}"
            )
        return notes

    def describe(self) -> str:
        cfg, info, o = self.cfg, self.info, self.cfg.optim
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())  # ZeRO-3: full sizes
        # open_clip's own "No pretrained weights loaded" warning is dropped (fastclip/models): said here once
        if self.resume_dir is not None:  # the checkpoint's weights: --model.pretrained only starts a new run
            start = "weights from the checkpoint" + (", model.pretrained not loaded" if cfg.model.pretrained else "")
        else:
            start = f"towers from {cfg.model.pretrained}" if self.pretrained else "random init"
        return (
            f"fastclip train: {cfg.loss.name}, {self.net.built.arch} ({n_params / 1e6:.1f}M parameters, {start}), "
            f"{info.world_size} process(es) on {self.device.type} ({info.launcher}), {self.engine.describe()}, "
            f"{PRECISION_WORDS[cfg.train.precision]}, "
            + "".join(f"{s}, " for s in self.net.speedups)
            + f"global batch {self.global_batch}"
            + (f" in {o.accum_steps} micro-batches per process" if o.accum_steps > 1 else "")
            + ", "
            f"{self.stream.batches_per_epoch} steps/epoch, steps {self.step} -> {self.last_step}, run {self.run_dir}"
            + (f", resumed from {self.resume_dir}" if self.resume_dir else "")
        )

    # ---- the loop: epochs of the data stream, one optimizer step per batch
    def train(self) -> dict:
        cfg, guard = self.cfg, self.guard
        self.model.train()
        while self.step < self.last_step and self.epoch < cfg.train.epochs and not guard.stop:
            batches = iter(self.stream.epoch(self.epoch))
            while self.step < self.last_step:
                t0 = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    break  # epoch done
                batch = tuple(t.to(self.device, non_blocking=True) for t in batch)
                if self.normalize is not None:  # ssl: [B, 2, C, H, W], the same per channel
                    batch = (self.normalize(batch[0]), *batch[1:])
                if cfg.ssl.enabled:  # [B, 2, C, H, W] images: view 1 takes the image's place, view 2 the text's
                    batch = (*split_views(batch[0]), *batch[2:])  # groups: copies of one image, positives
                self.throughput.data += time.perf_counter() - t0
                loss, grad_norm, skip = self.train_step(*batch)
                if guard.on_device and (self.is_logging_step() or self.checkpoint_due() or self.stop_check_due()):
                    # the device's skip counts: on these steps only; a step refused before its loss (non-finite
                    # features: no loss to log) stays skipped whatever the device read says
                    skip = self.read_skips() or skip
                save_due = self.log_step(loss, grad_norm, skip) if self.is_logging_step() else False
                if self.stream.batches_remaining(self.epoch) == 0:
                    # before a checkpoint of this step: it then resumes in the next epoch, not in this one's end
                    # (which would report this epoch's data line a second time)
                    self.end_epoch()
                self.after_step(skip, save_due)
                if guard.stop:  # every rank saw the request at this step (verdict): checkpoint here and leave
                    self.save_once("checkpoint save")
                    self.log.message(
                        f"stopped at step {self.step} by {self.stop.reason() or 'a signal to another rank'}"
                        f": checkpoint saved; exit status {EXIT_PREEMPTED}, continue with "
                        f"--train.resume latest"
                    )
                    break
            if self.stream.batches_remaining(self.epoch) == 0:  # an epoch with no batch left for this run
                self.end_epoch()
            del batches  # stops the epoch's data workers now when training stops early
        with self.timeouts.relaxed("final evaluation and checkpoint"):
            if cfg.checkpoint.at_end and self.last_saved != self.step:  # first: an evaluation error loses nothing
                self.save()
            if cfg.eval.at_end and self.step > 0 and not guard.stop:  # a stopped run evaluates when it completes
                self.evaluation.evaluate(self.step, self.samples_seen)
            barrier(self.info)
        t = self.throughput
        return {
            "step": self.step,
            "epoch": self.epoch,
            "samples_seen": self.samples_seen,
            "run_dir": str(self.run_dir),
            "last": self.record,
            "preempted": guard.stop,
            "samples_per_s": t.trained_steps * self.global_batch / t.train_time if t.train_time > 0 else float("nan"),
        }

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
        else:  # no optimizer step; the per-sample state rows are put back; stops after N in a row
            if loss is not None:
                engine.skip_step()  # fp16: lower the loss scale after the overflow; DeepSpeed: drop its gradients
            guard.skip(step, skip, epoch=self.epoch, samples_seen=self.samples_seen + self.global_batch)
        self.step, self.samples_seen = step, self.samples_seen + self.global_batch
        self.throughput.steps += 1
        self.timeouts.first_step_done()  # from now on a dead or hung rank fails collectives within the short timeout
        return loss, grad_norm, skip

    def checkpoint_due(self) -> bool:
        return bool(self.cfg.checkpoint.every_steps) and self.step % self.cfg.checkpoint.every_steps == 0

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
        values = scalar_metrics(self.loss_fn, loss) if skip is None else {}
        if not all(math.isfinite(v) for v in values.values()):
            raise FloatingPointError(f"non-finite metrics at step {self.step}: {values}")
        elapsed = t.window()
        record = {
            "step": self.step,
            "epoch": self.epoch,
            "samples_seen": self.samples_seen,
            **values,
            "lr": self.schedules.lr,
            "lr_tau": self.schedules.effective_lr_tau(),
            "samples_per_s": t.steps * self.global_batch / elapsed,
            "samples_per_s_per_rank": t.steps * cfg.data.batch_size / elapsed,
            "data_time": t.data / t.steps,
            "step_time": elapsed / t.steps,
            "nonfinite_skipped": self.guard.skipped,
        }
        if skip is None:
            record["grad_norm"] = float(grad_norm)
        data_counts, data_events = self.skips.collect()  # summed over ranks: a collective on logging steps
        record.update(data_counts)
        if data_events:
            record["data_skips"] = self.skips.as_metrics(data_events)
            for line in self.skips.describe(data_events):
                self.log.message(line)
        self.log.log(record, STEP_LINE)
        self.record = record
        due = cfg.checkpoint.every_minutes > 0 and broadcast_flag(
            time.time() - self.last_save_time >= 60 * cfg.checkpoint.every_minutes, self.info
        )
        t.restart()
        return due

    def after_step(self, skip: str | None, save_due: bool) -> None:
        """Evaluation and checkpoint when due; their time is left out of the throughput."""
        cfg, step, t_pause = self.cfg, self.step, time.perf_counter()
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step != self.last_step and not self.guard.stop:
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
        """loss.validate "deferred": the input checks of the loss calls since the last look (one host read; every
        rank holds every rank's check words, so all decide the same without a collective). Returns the
        non-finite-features error (the guard skips such a step: its loss is NaN too), raises for a bad index."""
        try:
            self.loss_fn.check_inputs()
        except NonFiniteFeaturesError as e:
            return str(e)
        except LossInputError as e:
            raise TrainingError(
                f"step {self.step}: the loss refused its inputs: {e}. The shards' global indices must lie in "
                f"[0, num_samples of the manifest): re-run `fastclip data scan` on these shards"
            ) from None
        return None

    def save(self) -> None:
        """Collective: model.pt on rank 0 and every rank's file, of every part added (fastclip/checkpoint)."""
        self.check_loss_inputs()  # never a checkpoint after an index the loss refused
        model, tau = self.model, self.loss_fn.temperature()
        with torch.no_grad():  # keep the towers' own (frozen) logit_scale equal to the learned one: open_clip reads it
            if tau is not None:
                model.logit_scale.copy_(-torch.log(tau.to(model.logit_scale)))
        path = self.checkpoints.save(self.step)
        self.last_saved, self.last_save_time = self.step, time.time()
        self.log.message(f"checkpoint {path}")
