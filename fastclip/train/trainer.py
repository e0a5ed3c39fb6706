"""The trainer, top to bottom: processes -> data checks -> towers + loss -> DDP -> optimizer -> resume -> loop
(step, log, evaluate, checkpoint). One function, `train(cfg)`, runs the same way as one process, under
torchrun and under srun; every mode (openclip, fastclip-v0..v3) goes through the same code but the loss.
"""
from __future__ import annotations

import math
import random
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fastclip.distributed import DistInfo, barrier, broadcast_flag, cleanup, init_distributed
from fastclip.optim import ThresholdRule, get_lr, get_tau_lr
from fastclip.train import checkpoint as ckpt
from fastclip.train import faults, preflight
from fastclip.train.config import Config, ConfigError, dump_config
from fastclip.train.engine import build_engine
from fastclip.train.gpu import apply_backend_flags, to_channels_last, wants_channels_last
from fastclip.train.errors import DataFailure
from fastclip.train.guards import CollectiveTimeouts, DataSkipReport, NonFiniteGuard
from fastclip.train.metrics import MetricsLogger
from fastclip.train.preemption import EXIT_PREEMPTED, StopSignals

CHECKPOINT_FORMAT = "fastclip-checkpoint/1"


class TowersWithLoss(torch.nn.Module):
    """What DDP wraps: the towers and the loss in one module, so the loss's temperature is a DDP parameter and
    its gradient is averaged with the towers'. forward: encode under autocast, L2-normalise in fp32, loss in fp32
    (the loss gathers features itself; its per-sample state is plain tensors, so DDP never broadcasts it)."""

    def __init__(self, model: torch.nn.Module, loss_fn: torch.nn.Module, *, precision: str, compile: bool):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        # compile the towers' encoders only: the loss holds collectives and data-dependent state updates
        self.encode_image = torch.compile(model.encode_image) if compile else model.encode_image
        self.encode_text = torch.compile(model.encode_text) if compile else model.encode_text

    def encode(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(images.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None):
            image_features = self.encode_image(images)
            text_features = self.encode_text(texts)
        return F.normalize(image_features.float(), dim=-1), F.normalize(text_features.float(), dim=-1)

    def forward(self, images: torch.Tensor, texts: torch.Tensor, indices: torch.Tensor | None, epoch: int,
                features_only: bool = False):
        image_features, text_features = self.encode(images, texts)
        if features_only:  # gradient accumulation calls the loss itself, once per step (fastclip/train/accumulate.py)
            return image_features, text_features
        return self.loss_fn(image_features, text_features, indices, epoch=epoch)


# ----------------------------------------------------------------------------- helpers
def check_data(cfg: Config, world_size: int) -> int:
    """Checks that need the data and the world size, before anything heavy is built; returns data_size."""
    from fastclip.data import DataSpecError, ManifestError, resolve_catalog

    try:
        catalog = resolve_catalog(cfg.data.train, cfg.data.data_size)
    except (DataSpecError, ManifestError, FileNotFoundError) as e:
        key = "data.data_size" if "data_size" in str(e) and cfg.data.data_size is not None else "data.train"
        raise ConfigError(f"config key '{key}': {e}") from None
    per_epoch = cfg.data.samples_per_epoch if cfg.data.resampled and cfg.data.samples_per_epoch else catalog.num_samples
    global_batch = cfg.data.batch_size * world_size
    if global_batch > per_epoch:
        raise ConfigError(f"config key 'data.batch_size': {cfg.data.batch_size} per process x {world_size} "
                          f"process(es) = {global_batch} is larger than the data ({per_epoch} samples per epoch "
                          f"in {cfg.data.train})")
    for key in ("val", "zeroshot"):
        path = getattr(cfg.data, key)
        evaluating = cfg.data.val is not None and (cfg.eval.every_steps or cfg.eval.at_end)
        if path is not None and evaluating and not Path(path).exists():
            raise ConfigError(f"config key 'data.{key}': {path!r} does not exist (set it to null to skip eval)")
    return catalog.data_size


def check_inputs(cfg: Config, world_size: int) -> tuple[int, Path | None, dict | None, dict | None]:
    """Everything checkable before a tower is built: the data for this world size, the resume (a foreign file,
    another seed or data) and --model.pretrained. Returns (data_size, resume_dir, its model.pt, pretrained
    tensors); raises ConfigError. `fastclip train --check` runs it before a launcher starts the processes."""
    data_size = check_data(cfg, world_size)
    if cfg.train.resume and cfg.train.resume != "latest" and Path(cfg.train.resume).is_file():
        raise preflight.describe_resume_file(Path(cfg.train.resume))  # an OpenCLIP epoch_N.pt, a state dict, ...
    try:
        resume_dir = ckpt.resolve_resume(cfg.train.resume, Path(cfg.train.run_dir)) if cfg.train.resume else None
    except FileNotFoundError as e:
        raise ConfigError(f"config key 'train.resume': {e}") from None
    model_file, pretrained = None, None
    if resume_dir is not None:  # same model, loss, data, seed and epoch length, or a one-line error now
        from fastclip.data import resolve_catalog

        model_file = preflight.read_resume(resume_dir, cfg.train.resume)
        catalog = resolve_catalog(cfg.data.train, cfg.data.data_size)
        preflight.check_resume(cfg, resume_dir, model_file, fingerprint=catalog.fingerprint,
                               num_samples=catalog.num_samples, data_size=data_size)
    elif cfg.model.pretrained:
        pretrained = preflight.read_pretrained(cfg.model.pretrained)
    return data_size, resume_dir, model_file, pretrained


def stream_config(cfg: Config, data_size: int, device: torch.device) -> dict:
    d = cfg.data
    return {"train_data": d.train, "batch_size": d.batch_size, "seed": cfg.train.seed if d.seed is None else d.seed,
            "workers": d.workers, "shuffle_buffer": d.shuffle_buffer, "dataset_resampled": d.resampled,
            "train_num_samples": d.samples_per_epoch, "train_data_upsampling_factors": d.upsampling_factors,
            "data_size": data_size, "pin_memory": device.type == "cuda",
            "log_skips_per_reason": 0}  # rank 0 logs every rank's skips, once per epoch (DataSkipReport)


def loss_options(cfg: Config, embed_dim: int | None = None) -> dict:
    """The loss section's set values, passed to build_loss (which rejects options a version lacks); the
    temperature network also gets the towers' embed_dim."""
    names = ("temperature", "rho", "eps", "gamma_min", "gamma_decay_epochs", "gamma_schedule", "compat",
             "tau_betas", "tau_eps", "tau_min", "tau_max", "tau_grad_clamp", "similarity", "similarity_clamp", "bias",
             "separate_temperatures", "tempnet_hidden")
    opts = {k: getattr(cfg.loss, k) for k in names if getattr(cfg.loss, k) is not None}
    if "tau_betas" in opts:
        opts["tau_betas"] = tuple(opts["tau_betas"])
    if cfg.loss.name == "fastclip-v2":  # v2 updates its per-sample tau itself, at lr_tau
        opts["lr_tau"] = cfg.optim.lr_tau if cfg.optim.lr_tau is not None else cfg.optim.lr
    if cfg.loss.name == "fastclip-tempnet" and embed_dim is not None:
        opts["embed_dim"] = embed_dim
    return opts


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def scalar_metrics(loss_fn, loss: torch.Tensor) -> dict:
    """Host values of the loss's metrics (call on logging steps only: .item() waits for the device)."""
    out = {"loss": loss.item()}
    for name, value in getattr(loss_fn, "metrics", {}).items():
        if not torch.is_tensor(value):
            continue
        if value.numel() == 1:
            out[name] = value.item()
        elif name == "tau_quantiles":  # v2: 5/50/95 % of the batch's per-sample tau
            for q, v in zip(("q05", "q50", "q95"), value.flatten().tolist()):
                out[f"tau_{q}"] = v
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
    preflight.check_device(cfg)
    preflight.check_arch(cfg)
    preflight.check_run_dir(cfg)
    info = init_distributed(cfg.train.device, cfg.train.backend, cfg.train.dist_timeout_minutes)
    timeouts = CollectiveTimeouts(info, start_seconds=60 * cfg.train.dist_timeout_minutes,
                                  train_seconds=cfg.train.collective_timeout_seconds)
    # SIGUSR1/SIGTERM: checkpoint at the next step on every rank, then stop (fastclip/train/preemption.py)
    stop, stopped = StopSignals(cfg.train.stop_signals).install(), False
    try:
        result = _train(cfg, info, timeouts, stop)
        stopped = result["preempted"]
        return result
    except BaseException as e:
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


def _train(cfg: Config, info: DistInfo, timeouts: CollectiveTimeouts, stop: StopSignals) -> dict:
    from fastclip.data import REASONS, build_train_stream, state_for_new_world_size
    from fastclip.losses import NonFiniteFeaturesError, build_loss, reshard_for_rank
    from fastclip.models import build_model

    device, run_dir, o = info.device, Path(cfg.train.run_dir), cfg.optim

    # ---- checks that need the data and the world size, before anything heavy
    data_size, resume_dir, model_file, pretrained = check_inputs(cfg, info.world_size)

    # ---- towers and loss (same seed on every rank: identical init; DDP also broadcasts rank 0's)
    seed_all(cfg.train.seed)
    built = build_model(cfg.model.arch)
    model = built.model.to(device)
    speedups = apply_backend_flags(cfg, device)  # CUDA: TF32, cudnn.benchmark (fastclip/train/gpu.py)
    if wants_channels_last(cfg, model, device):  # convolutional towers on CUDA
        to_channels_last(model)
        speedups.append("channels_last")
    if model_file is not None:
        preflight.check_fits(model, preflight.strip_module(model_file["state_dict"]),
                             f"checkpoint {resume_dir / 'model.pt'}", "train.resume")
    if pretrained is not None:  # strict: a partial load would train a half-random model without a word
        preflight.check_fits(model, pretrained, cfg.model.pretrained, "model.pretrained")
        model.load_state_dict(pretrained)
    model.logit_scale.requires_grad_(False)  # the loss owns the temperature
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    try:
        loss_fn = build_loss(cfg.loss.name, data_size=data_size,
                             **loss_options(cfg, built.config.get("embed_dim"))).to(device)
    except (TypeError, ValueError) as e:  # an option this loss version does not take, or a bad value
        raise ConfigError(f"config section 'loss' (name {cfg.loss.name}): {e}") from None

    # ---- data: this rank's part of every global batch
    stream = build_train_stream(stream_config(cfg, data_size, device), rank=info.rank, world_size=info.world_size,
                                preprocess=built.preprocess_train, tokenizer=built.tokenizer)
    global_batch = cfg.data.batch_size * info.world_size
    total_steps = cfg.train.epochs * stream.batches_per_epoch  # horizon of the lr schedules

    # ---- resume: weights and per-sample state before DDP (DDP then broadcasts identical tensors)
    step, samples_seen, epoch, rank_file = 0, 0, 0, None
    if resume_dir is not None:  # model_file was read and checked above
        model.load_state_dict(preflight.strip_module(model_file["state_dict"]))
        saved_world = int(model_file["world_size"])
        if saved_world == info.world_size:
            rank_file = ckpt.load_file(resume_dir / f"rank_{info.rank}.pt")
            loss_fn.load_state_dict(rank_file["loss_state"])
        else:  # another world size: rebuild this rank's shard of the per-sample state, one old file at a time
            old_data = []  # every old rank's data stream state (small), read on the way

            def old_loss_states():
                for f in ckpt.iter_rank_files(resume_dir, saved_world):
                    old_data.append(f["data"])
                    yield f["loss_state"]

            if getattr(loss_fn, "uses_sample_state", False):
                loss_fn.load_state_dict(reshard_for_rank(old_loss_states(), info.world_size, info.rank))
            else:
                old_data.extend(f["data"] for f in ckpt.iter_rank_files(resume_dir, saved_world))
                loss_fn.load_state_dict(model_file["loss"])
            # the data layer finishes the interrupted epoch from the old position and splits the old ranks' skip
            # counters over the new ranks (fastclip/data/stream.py)
            rank_file = {"data": state_for_new_world_size(old_data, info.rank, info.world_size)}
        step, samples_seen, epoch = int(model_file["step"]), int(model_file["samples_seen"]), int(model_file["epoch"])

    if cfg.model.compile and cfg.model.grad_checkpointing and info.distributed:
        torch._dynamo.config.optimize_ddp = False  # DDP's graph splitting does not support checkpointed graphs
    net = TowersWithLoss(model, loss_fn, precision=cfg.train.precision, compile=cfg.model.compile)
    # ---- DDP or DeepSpeed ZeRO around it, with its optimizer(s) and scaler (fastclip/train/engine.py)
    engine = build_engine(net, cfg, info)

    # ---- schedules
    lr_tau_base = o.lr_tau if o.lr_tau is not None else o.lr
    thresh = ThresholdRule(engine.tau_params if o.lr_tau_schedule == "step_thresh" else [],
                           threshold=o.tau_threshold, factor=o.tau_threshold_factor)
    scaler, trainable = engine.scaler, engine.trainable

    lr_now = [0.0, 0.0]  # the last step's lr of the towers and of the temperature group

    def set_lrs(samples_seen: int) -> tuple[float, float]:
        # the schedules run on samples seen, counted in global batches of the current run: equal to the step
        # count, and still the right place in the schedule after a resume at another world size
        at = samples_seen // global_batch
        lr = get_lr(at, base_lr=o.lr, warmup_steps=o.warmup_steps, total_steps=total_steps, lr_min=o.lr_min,
                    kind=o.lr_schedule)
        lr_tau = get_tau_lr(at, lr_tau=lr_tau_base, kind=o.lr_tau_schedule, warmup_steps=o.warmup_steps,
                            total_steps=total_steps, lr_tau_min=o.lr_tau_min)
        for g in engine.param_groups:
            g["lr"] = lr_tau if g["name"] == "temperature" else lr
        lr_now[:] = lr, lr_tau
        return lr, lr_tau

    if model_file is not None:
        engine.load_checkpoint(model_file, resume_dir)  # the optimizer(s); DeepSpeed: its shards too
        scaler.load_state_dict(model_file["scaler"])
        stream.load_state_dict(rank_file["data"])
    # RNG streams of this rank: restored exactly when the world size is unchanged
    if rank_file is not None and int(model_file["world_size"]) == info.world_size:
        ckpt.set_rng_state(rank_file["rng"], device)
    else:
        seed_all(cfg.train.seed + 1000 * info.rank + step)

    max_steps = cfg.train.max_steps
    remaining = sum(stream.batches_remaining(e) for e in range(epoch, cfg.train.epochs))
    last_step = step + remaining if max_steps is None else min(step + remaining, max_steps)

    # ---- logging
    log = MetricsLogger(run_dir, enabled=info.is_main, total_steps=last_step, start_step=step,
                        tensorboard=cfg.train.tensorboard, progress=cfg.train.progress)
    if info.is_main:
        (run_dir / "config.yaml").write_text(f"# resolved config of `fastclip train`\n{dump_config(cfg)}")
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: full sizes
        # open_clip's own "No pretrained weights loaded" warning is dropped (fastclip/models): said here once
        log.message(f"fastclip train: {cfg.loss.name}, {built.arch} ({n_params / 1e6:.1f}M parameters, "
                    f"{'towers from ' + cfg.model.pretrained if pretrained is not None else 'random init'}), "
                    f"{info.world_size} process(es) on {device.type} ({info.launcher}), {engine.describe()}, "
                    + "".join(f"{s}, " for s in speedups)
                    + f"global batch {global_batch}"
                    + (f" in {o.accum_steps} micro-batches per process" if o.accum_steps > 1 else "") + ", "
                    f"{stream.batches_per_epoch} steps/epoch, steps {step} -> {last_step}, run {run_dir}"
                    + (f", resumed from {resume_dir}" if resume_dir else ""))
    # fault handling (fastclip/train/guards.py): NaN/Inf steps skipped, skipped samples reported over ranks
    guard = NonFiniteGuard(cfg.train.max_nonfinite_steps, info, log=log, checkpoints=run_dir / "checkpoints")
    skips = DataSkipReport(stream, info, REASONS)
    if model_file is not None:
        guard.load_state_dict(model_file.get("guards"))
        skips.load_state_dict(model_file.get("data_skip_report"))

    def save(step: int) -> None:
        with torch.no_grad():  # keep the towers' own (frozen) logit_scale equal to the learned one: open_clip reads it
            tau = loss_fn.temperature()
            if tau is not None:
                model.logit_scale.copy_(-torch.log(tau.to(model.logit_scale)))
        model_state, state_dict = None, engine.model_state_dict()  # collective under ZeRO-3 (gathers)
        if info.is_main:
            model_state = {
                "format": CHECKPOINT_FORMAT, "state_dict": state_dict,
                "loss": {k: v for k, v in loss_fn.state_dict().items() if not k.endswith("_extra_state")},
                "optimizer": engine.optimizer_state_dict(), "scaler": scaler.state_dict(), "step": step, "epoch": epoch,
                "samples_seen": samples_seen, "world_size": info.world_size, "config": cfg.to_dict(),
                # the schedules are pure functions of samples_seen; their horizon and last values, for reading
                "schedules": {"total_steps": total_steps, "global_batch": global_batch, "lr": lr_now[0],
                              "lr_tau": lr_now[1] * thresh.factor_now()},
                "arch": built.arch, "model_config": built.config, "guards": guard.state_dict(),
                "data_skip_report": skips.state_dict(),
            }
        rank_state = {"rank": info.rank, "world_size": info.world_size, "step": step,
                      "loss_state": loss_fn.state_dict(), "data": stream.state_dict(), "rng": ckpt.rng_state(device)}
        path = ckpt.save_checkpoint(run_dir / "checkpoints", step, info, model_file=model_state,
                                    rank_file=rank_state, keep_last=cfg.checkpoint.keep_last,
                                    write_extra=engine.save_shards)
        log.message(f"checkpoint {path}")

    def evaluate(step: int) -> None:
        from fastclip.eval import run_evals

        if cfg.data.val is None:
            return
        with engine.full_params():  # ZeRO-3: whole parameters for the evaluation
            results = run_evals(model, tokenizer=built.tokenizer, preprocess=built.preprocess_val, val_dir=cfg.data.val,
                                zeroshot_file=cfg.data.zeroshot, device=device, batch_size=cfg.eval.batch_size,
                                max_samples=cfg.eval.max_samples)
        record = {"step": step, "samples_seen": samples_seen}
        record.update({f"eval/{k}": v for k, v in results.items() if isinstance(v, (int, float))})
        log.log(record, tuple(k for k in record if k.endswith("top1")))

    # ---- the loop: epochs of the data stream, one optimizer step per batch
    model.train()
    # a checkpoint of this run exists at the resume step; one taken from elsewhere does not (so it is saved here)
    resumed_here = resume_dir is not None and resume_dir.parent.resolve() == (run_dir / "checkpoints").resolve()
    last_saved, last_save_time = (step if resumed_here else -1), time.time()
    window_steps, window_data, window_pause, window_start = 0, 0.0, 0.0, time.perf_counter()
    train_time, trained_steps, record = 0.0, 0, {}
    while step < last_step and epoch < cfg.train.epochs and not guard.stop:
        batches = iter(stream.epoch(epoch))
        while step < last_step:
            t0 = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break  # epoch done
            images, texts, indices = (t.to(device, non_blocking=True) for t in batch)
            window_data += time.perf_counter() - t0

            lr, lr_tau = set_lrs(samples_seen)
            timeouts.at(step + 1)
            faults.hook("batch", step=step + 1, rank=info.rank, tensors=(images,))  # test-only: FASTCLIP_FAULTS
            guard.remember(loss_fn, indices)  # the per-sample state rows a skipped step puts back
            try:
                loss = engine.forward(images, texts, indices, epoch)  # accum_steps > 1: one loss call, k micro-batches
            except NonFiniteFeaturesError as e:  # raised alike on every rank, before the loss writes its state
                loss, skip = None, f"non-finite features: {e}"
            if loss is not None:
                faults.hook("step", step=step + 1, rank=info.rank)
                engine.backward(loss)
                faults.hook("grads", step=step + 1, rank=info.rank, tensors=(p.grad for p in trainable))
                grad_norm = engine.grad_norm(o.grad_clip)  # fp16: unscaled first; clipped when optim.grad_clip is set
                # NaN/Inf on any rank: the same answer on every rank; a stop signal of any rank rides along
                skip = guard.verdict(loss, grad_norm, stop_requested=stop.requested)
            if skip is None:
                thresh.before_step(loss_fn.temperature())
                engine.step()
                thresh.after_step()
                loss_fn.clamp_()
                guard.passed()
            else:  # no optimizer step; the per-sample state rows are put back; stops after N in a row
                if loss is not None:
                    engine.skip_step()  # fp16: lower the loss scale after the overflow; DeepSpeed: drop its gradients
                guard.skip(step + 1, skip, epoch=epoch, samples_seen=samples_seen + global_batch)
            step, samples_seen, window_steps = step + 1, samples_seen + global_batch, window_steps + 1
            timeouts.first_step_done()  # from now on a dead or hung rank fails collectives within the short timeout

            due = False
            if step % cfg.train.log_every == 0 or step == last_step:
                values = scalar_metrics(loss_fn, loss) if skip is None else {}  # the only host reads of the step
                if not all(math.isfinite(v) for v in values.values()):
                    raise FloatingPointError(f"non-finite metrics at step {step}: {values}")
                elapsed = time.perf_counter() - window_start - window_pause
                train_time, trained_steps = train_time + elapsed, trained_steps + window_steps
                record = {"step": step, "epoch": epoch, "samples_seen": samples_seen, **values, "lr": lr,
                          "lr_tau": lr_tau * thresh.factor_now(),
                          "samples_per_s": window_steps * global_batch / elapsed,
                          "samples_per_s_per_rank": window_steps * cfg.data.batch_size / elapsed,
                          "data_time": window_data / window_steps, "step_time": elapsed / window_steps,
                          "nonfinite_skipped": guard.skipped}
                if skip is None:
                    record["grad_norm"] = float(grad_norm)
                data_counts, data_events = skips.collect()  # summed over ranks: a collective on logging steps
                record.update(data_counts)
                if data_events:
                    record["data_skips"] = skips.as_metrics(data_events)
                    for line in skips.describe(data_events):
                        log.message(line)
                log.log(record, ("loss", "objective", "tau", "tau_q05", "tau_q50", "tau_q95", "lr", "gamma",
                                 "samples_per_s", "samples_per_s_per_rank", "data_time"))
                # the wall-clock trigger is rank 0's decision, shared on logging steps (the same on all ranks)
                due = cfg.checkpoint.every_minutes > 0 and broadcast_flag(
                    time.time() - last_save_time >= 60 * cfg.checkpoint.every_minutes, info)
                window_steps, window_data, window_pause, window_start = 0, 0.0, 0.0, time.perf_counter()

            t_pause = time.perf_counter()
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step != last_step and not guard.stop:
                with timeouts.relaxed("evaluation"):
                    evaluate(step)
            # no checkpoint on a skipped step: after too many in a row the last checkpoint is a good one
            if skip is None and (due or (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0)):
                with timeouts.relaxed("checkpoint save"):
                    save(step)
                last_saved, last_save_time = step, time.time()
            window_pause += time.perf_counter() - t_pause
            if guard.stop:  # every rank saw the request at this step (verdict): checkpoint here and leave
                if last_saved != step:
                    with timeouts.relaxed("checkpoint save"):
                        save(step)
                    last_saved = step
                log.message(f"stopped at step {step} by {stop.received or 'a signal to another rank'}: checkpoint "
                            f"saved; exit status {EXIT_PREEMPTED}, continue with --train.resume latest")
                break
        if stream.batches_remaining(epoch) == 0:
            data_counts, data_events = skips.collect()  # collective: every rank ends the epoch here
            for line in skips.describe(data_events) + [skips.end_of_epoch(epoch, data_counts)]:
                log.message(line)
            epoch += 1
        del batches  # stops the epoch's data workers now when training stops early

    # ---- the end
    with timeouts.relaxed("final evaluation and checkpoint"):
        if cfg.eval.at_end and step > 0 and not guard.stop:  # a stopped run evaluates when it completes
            evaluate(step)
        if cfg.checkpoint.at_end and last_saved != step:
            save(step)
        barrier(info)
    log.close()
    return {"step": step, "epoch": epoch, "samples_seen": samples_seen, "run_dir": str(run_dir), "last": record,
            "preempted": guard.stop,
            "samples_per_s": trained_steps * global_batch / train_time if train_time > 0 else float("nan")}
