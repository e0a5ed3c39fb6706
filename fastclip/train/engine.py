"""The data-parallel backends of the trainer (train.distributed): DDP or DeepSpeed ZeRO, one interface.

The trainer's step, whichever backend (and with or without gradient accumulation, fastclip/train/accumulate.py):

    loss = engine.forward(images, texts, indices, epoch)   # towers + loss (k micro-batches with accum_steps = k)
    engine.backward(loss)                                   # gradients of every trainable parameter, averaged
    grad_norm = engine.grad_norm(grad_clip)                 # global norm before the step (clips when asked)
    engine.step()          or   engine.skip_step()          # one optimizer step / none (a NaN/Inf step)

                  ddp (default)                              deepspeed (ZeRO stage 1, 2 or 3)
    wraps         TowersWithLoss: towers + loss              TowerEncoders: the towers only
    temperature   a DDP parameter, averaged with the towers  outside DeepSpeed: gradient averaged by
                                                             loss_fn.average_grads_(), its own torch AdamW
    optimizer     one torch optimizer, groups decay /        torch AdamW(decay, no_decay) as DeepSpeed's client
                  no_decay / temperature                     optimizer, state sharded by ZeRO (stage 3: the
                                                             parameters too); + AdamW(temperature), replicated
    checkpoint    model.pt holds the optimizer               model.pt holds the temperature's optimizer;
                                                             <step dir>/deepspeed/ DeepSpeed's own files (module
                                                             states, one ZeRO shard per rank), written by every
                                                             rank into the temporary step folder before it is
                                                             renamed, so `latest` semantics are unchanged

Why the temperature stays outside DeepSpeed: the trainer edits it after each step (loss_fn.clamp_() to
[0, ln 100], the step_thresh lr rule of optim.ThresholdRule), and ZeRO keeps fp32 master copies that would
overwrite such edits on the next step; DeepSpeed 0.19.8 also cannot broadcast 0-d parameters at start-up
(`view(torch.uint8)` of a scalar), and one scalar gains nothing from sharding. The towers' own logit_scale
(frozen; the loss owns the temperature) becomes a buffer of the same name for the same reason: the
state_dict keys, and so open_clip loading, are unchanged.

DeepSpeed specifics: torch's AdamW (the fused kernel where available) is the client optimizer, so nothing is
compiled on CPU (DeepSpeed's own CPU Adam builds a C++ kernel, ~50 s); its shared-memory all-reduce kernel
(used only by tensor-parallel inference, minutes to compile on a small CPU machine) is switched off on CPU.
grad_clip: as under DDP, towers and temperature are clipped together by their joint norm (DeepSpeed clips the
towers in step() by their own norm; each step it is handed the bound that gives the joint coefficient, its
`clip_grad` attribute). accum_steps = k: DeepSpeed's
gradient_accumulation_steps = k with micro-batch data.batch_size / k; ZeRO-1 reduces gradients once per step,
ZeRO-2/3 after every micro-batch (they keep only their gradient partition). DeepSpeed's files are read
through torch.load(weights_only=True) with DeepSpeed's three plain classes allow-listed. fp16 (GradScaler)
and LAMB are refused by the config checks, and so is a resume at another world size or from a DDP
checkpoint (ZeRO shards are per rank: convert with DeepSpeed's ds_to_universal, or resume with ddp from
the same world size).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from fastclip.checkpoint import DEEPSPEED_TAG
from fastclip.distributed import DistInfo
from fastclip.errors import CheckpointError
from fastclip.optim import build_optimizer, param_groups
from fastclip.train.accumulate import GradCache
from fastclip.train.config import Config, ConfigError
from fastclip.train.gpu import ddp_options, overlap_comm
from fastclip.train.guards import total_grad_norm


# ----------------------------------------------------------------------------- DDP
class DDPEngine:
    """DistributedDataParallel over towers + loss (one process: the module itself), one torch optimizer."""

    name = "ddp"

    def __init__(self, net: torch.nn.Module, cfg: Config, info: DistInfo):
        o = cfg.optim
        self.info, self.model, self.loss_fn, self.towers = info, net.model, net.loss_fn, net
        self.ddp = info.distributed
        # buffers are synced from rank 0 at init and before each forward: DDP's default (its broadcast_buffers
        # argument is deprecated since torch 2.13; forward_sync_buffers does not exist before it)
        self.net = (
            DistributedDataParallel(
                net, device_ids=[info.device.index] if info.device.type == "cuda" else None, **ddp_options(cfg)
            )  # bucket views, static graph: fastclip/train/gpu.py
            if self.ddp
            else net
        )
        groups = param_groups(self.model, self.loss_fn, lr=o.lr, wd=o.wd, lr_tau=o.base_lr_tau)
        self.optimizer = build_optimizer(o.optimizer, groups, betas=o.betas, eps=o.eps)
        self.scaler = torch.amp.GradScaler(info.device.type, enabled=cfg.train.precision == "fp16")
        self.trainable = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.tau_params = [p for p in self.loss_fn.parameters() if p.requires_grad]
        self.cache = GradCache(o.accum_steps) if o.accum_steps > 1 else None

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def describe(self) -> str:
        return "DDP" if self.ddp else "one process"

    def _encode(self, images: torch.Tensor, texts: torch.Tensor):
        # through the wrapper, so DDP prepares its gradient reduction for the micro-batch's backward
        return self.net(images, texts, None, 0, features_only=True)

    def forward(self, images, texts, indices, epoch: int, groups=None) -> torch.Tensor:
        if self.cache is None:
            return self.net(images, texts, indices, epoch, groups=groups)
        return self.cache.forward(
            self._encode,
            self.loss_fn,
            images,
            texts,
            indices,
            epoch,
            encode_momentum=self.towers.encode_momentum,
            groups=groups,
        )

    def backward(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.cache is None:
            self.scaler.scale(loss).backward()
            return
        # the temperature's gradient rides in the last micro-batch's backward: DDP reduces it with the towers'
        self.cache.backward(
            loss,
            self._encode,
            tau_params=self.tau_params,
            tau_in_last_backward=True,
            run_backward=lambda surrogate, last: self.scaler.scale(surrogate).backward(),
            micro_context=lambda last: self.net.no_sync() if self.ddp and not last else contextlib.nullcontext(),
        )

    def grad_norm(self, clip: float | None) -> torch.Tensor:
        self.scaler.unscale_(self.optimizer)  # no-op unless fp16: the norm and the clip see the true gradients
        if clip is not None:
            return torch.nn.utils.clip_grad_norm_(self.trainable, clip)
        return total_grad_norm(self.trainable)

    @property
    def skips_on_device(self) -> bool:
        """Whether a NaN step can be skipped without a host read: torch's fused AdamW takes a found_inf flag (as
        GradScaler passes it) and leaves parameters, moments and step counts untouched where it is 1. Not with
        fp16 loss scaling (GradScaler owns that flag), LAMB or the per-tensor AdamW fallback."""
        return bool(self.optimizer.defaults.get("fused")) and not self.scaler.is_enabled()

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        if found_inf is not None:  # skips_on_device: no update where found_inf is 1, decided on the device
            self.optimizer.grad_scale, self.optimizer.found_inf = None, found_inf
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def skip_step(self) -> None:
        """After a backward whose step is not taken: fp16 lowers its loss scale (a no-op otherwise)."""
        if self.cache is not None:
            self.cache.discard()
        self.scaler.update()

    # -- checkpoints
    def model_state_dict(self) -> dict | None:
        return self.model.state_dict() if self.info.is_main else None

    def optimizer_state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def save_shards(self, step_dir: Path) -> None:
        """Nothing beyond model.pt and the rank files."""

    def load_optimizer(self, state: dict, step_dir: Path) -> None:
        """model.pt's "optimizer" (the checkpoint's backend was checked at start-up: fastclip/checkpoint/compat.py)."""
        self.optimizer.load_state_dict(state)

    def full_params(self):
        return contextlib.nullcontext()


# ----------------------------------------------------------------------------- DeepSpeed
class TowerEncoders(torch.nn.Module):
    """The towers of a TowersWithLoss without its loss: what DeepSpeed wraps. forward = net.encode (autocast,
    L2-normalised fp32 features); the loss module is not a submodule, so its temperature stays outside."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.model = net.model
        self._encode = net.encode  # a bound method: not registered, the loss stays out of parameters()

    def forward(self, images: torch.Tensor, texts: torch.Tensor):
        return self._encode(images, texts)


def frozen_scalars_to_buffers(model: torch.nn.Module) -> list[str]:
    """Frozen 0-d parameters (the towers' logit_scale) become buffers of the same name; returns their names."""
    moved = []
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.ndim != 0:
                continue
            full = f"{module_name}.{name}" if module_name else name
            if param.requires_grad:
                raise ConfigError(
                    f"config key 'train.distributed': deepspeed cannot hold the trainable 0-d parameter "
                    f"'{full}' of model {type(model).__name__} (DeepSpeed 0.19.8 fails to broadcast "
                    f"scalars); use ddp"
                )
            del module._parameters[name]
            module.register_buffer(name, param.detach())
            moved.append(full)
    return moved


def deepspeed_config(cfg: Config, world_size: int, device_type: str = "cpu") -> dict:
    ds, o = cfg.deepspeed, cfg.optim
    zero = {
        "stage": ds.stage,
        "reduce_bucket_size": ds.reduce_bucket_size,
        "overlap_comm": overlap_comm(cfg, torch.device(device_type)),
        "contiguous_gradients": ds.contiguous_gradients,
    }
    if ds.stage == 3:
        zero["stage3_param_persistence_threshold"] = ds.param_persistence_threshold
    else:
        zero["allgather_bucket_size"] = ds.allgather_bucket_size
    owned = {
        "train_batch_size": cfg.data.batch_size * world_size,
        "train_micro_batch_size_per_gpu": cfg.data.batch_size // o.accum_steps,
        "gradient_accumulation_steps": o.accum_steps,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},  # autocast in TowersWithLoss, fp32 master weights
    }
    config = {
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch AdamW as client optimizer
        "gradient_clipping": o.grad_clip or 0.0,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if ds.config_file:
        import json

        try:
            extra = json.loads(Path(ds.config_file).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"config key 'deepspeed.config_file': cannot read {ds.config_file}: {e}") from None
        if not isinstance(extra, dict):
            raise ConfigError(
                f"config key 'deepspeed.config_file': {ds.config_file} holds a JSON {type(extra).__name__}, not an "
                f"object of DeepSpeed settings"
            )
        clash = sorted(set(extra) & (set(owned) | {"optimizer", "scheduler"}))
        if clash:
            raise ConfigError(
                f"config key 'deepspeed.config_file': {ds.config_file} sets {clash}; the trainer sets "
                f"these (data.batch_size, optim.accum_steps, optim.*, train.precision)"
            )
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
    return {**config, **owned}


def _weights_only_checkpoint_engine(base_engine):
    """DeepSpeed's torch checkpoint engine reading with weights_only=True (it uses weights_only=False), with
    the three plain DeepSpeed classes its files hold allow-listed; anything else is refused, naming the file."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from fastclip.train.errors import CheckpointError

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            import pickle

            try:
                with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
                    return torch.load(path, map_location=map_location, weights_only=True)
            except pickle.UnpicklingError as e:
                raise CheckpointError(
                    f"{path}: refusing to load pickled objects beyond DeepSpeed's plain checkpoint "
                    f"classes ({str(e).strip().splitlines()[0][:300]})"
                ) from None

    engine = WeightsOnlyCheckpointEngine.__new__(WeightsOnlyCheckpointEngine)
    engine.__dict__.update(base_engine.__dict__)  # same settings (serialization format) as the one it replaces
    return engine


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def check_backend(cfg: Config, world_size: int) -> None:
    """DeepSpeed needs processes to shard over, its package, and deepspeed.config_file readable and free of the
    keys the trainer sets (read now: the run read it only once the towers were built)."""
    if cfg.train.distributed != "deepspeed":
        return
    if world_size == 1:
        raise ConfigError(
            "config key 'train.distributed': deepspeed shards the optimizer over processes; with one "
            "process use ddp (the same training without sharding)"
        )
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("config key 'train.distributed': deepspeed is not installed (pip install deepspeed==0.19.8)")
    deepspeed_config(cfg, world_size)


class DeepSpeedEngine:
    """DeepSpeed ZeRO over the towers; the loss (temperature, per-sample state) outside, as described above."""

    name = "deepspeed"

    def __init__(self, net: torch.nn.Module, cfg: Config, info: DistInfo):
        check_backend(cfg, info.world_size)  # (the trainer's start-up and --check said so already)
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if info.device.type == "cuda" else "cpu")
        os.environ.setdefault("LOCAL_RANK", str(info.local_rank))  # DeepSpeed asserts it is set
        try:
            import deepspeed
        except ImportError:
            raise ConfigError(
                "config key 'train.distributed': deepspeed is not installed (pip install deepspeed==0.19.8)"
            ) from None
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)  # its per-step INFO lines would drown the progress output
        if info.device.type == "cpu":
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference-only kernel, slow to build

        o = cfg.optim
        self.info, self.cfg, self.model, self.loss_fn = info, cfg, net.model, net.loss_fn
        self.stage, self.accum_steps = cfg.deepspeed.stage, o.accum_steps
        self.moved_to_buffers = frozen_scalars_to_buffers(self.model)
        self.towers = TowerEncoders(net)
        if self.stage == 3:
            # used by encode_text outside any submodule's forward: gather them with the wrapped module's forward
            for p in self.model.parameters(recurse=False):
                deepspeed.zero.register_external_parameter(self.towers, p)

        groups = param_groups(self.model, self.loss_fn, lr=o.lr, wd=o.wd, lr_tau=o.base_lr_tau)
        tower_groups = [g for g in groups if g["name"] != "temperature"]
        tau_groups = [g for g in groups if g["name"] == "temperature"]
        client = build_optimizer("adamw", tower_groups, betas=o.betas, eps=o.eps)
        self.tau_optimizer = build_optimizer("adamw", tau_groups, betas=o.betas, eps=o.eps) if tau_groups else None
        self.tau_params = [p for g in tau_groups for p in g["params"]]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.towers,
            optimizer=client,
            config=deepspeed_config(cfg, info.world_size, info.device.type),
            dist_init_required=False,
        )
        self.engine.checkpoint_engine = _weights_only_checkpoint_engine(self.engine.checkpoint_engine)
        self.scaler = torch.amp.GradScaler(info.device.type, enabled=False)  # model.pt's "scaler" entry
        self.trainable = [p for g in tower_groups for p in g["params"]] + self.tau_params
        self.cache = GradCache(o.accum_steps) if o.accum_steps > 1 else None
        self._stepped = False

    @property
    def param_groups(self) -> list[dict]:
        tau = self.tau_optimizer.param_groups if self.tau_optimizer is not None else []
        return list(self.optimizer.param_groups) + list(tau)

    def describe(self) -> str:
        return f"DeepSpeed ZeRO-{self.stage}"

    def forward(self, images, texts, indices, epoch: int, groups=None) -> torch.Tensor:
        if self.cache is None:
            image_features, text_features = self.engine(images, texts)
            return self.loss_fn(image_features, text_features, indices, epoch=epoch, groups=groups)
        return self.cache.forward(self.engine, self.loss_fn, images, texts, indices, epoch, groups=groups)

    def backward(self, loss: torch.Tensor) -> None:
        for p in self.tau_params:
            p.grad = None
        if self.cache is None:
            self.engine.backward(loss)  # the temperature's gradient lands in p.grad (not DeepSpeed's)
        else:

            def run_backward(surrogate: torch.Tensor, last: bool) -> None:
                # each surrogate already carries its full share of the gradient: no 1/k scaling
                self.engine.backward(surrogate, scale_wrt_gas=False)
                if not last:
                    self.engine.step()  # DeepSpeed counts micro-steps; it only updates at the k-th

            tau_grads = self.cache.backward(loss, self.engine, tau_params=self.tau_params, run_backward=run_backward)
            for p, g in zip(self.tau_params, tau_grads):
                p.grad = g.detach().clone()
        self.loss_fn.average_grads_()  # what DDP would do for the temperature

    def _towers_grad_norm(self) -> torch.Tensor:
        """The global norm of the towers' reduced gradients before the step (DeepSpeed computes the same one in
        step(); these are its own helpers, of 0.19.8). inf when any part is NaN/Inf."""
        from deepspeed.runtime.utils import combine_grad_norm_groups

        opt = self.optimizer
        if hasattr(opt, "scaled_global_norm"):  # ZeRO-1/2: partitions of the averaged gradients
            return opt.scaled_global_norm() / float(getattr(opt, "loss_scale", 1.0))
        return combine_grad_norm_groups(opt._get_norm_groups()) / float(getattr(opt, "loss_scale", 1.0))  # ZeRO-3

    def grad_norm(self, clip: float | None) -> torch.Tensor:
        towers = self._towers_grad_norm().float()
        tau = total_grad_norm(self.tau_params).float().to(towers.device)
        total = torch.sqrt(towers**2 + tau**2)
        if clip is not None:  # clip towers and temperature by their joint norm, with clip_grad_norm_'s coefficient
            coef = torch.clamp(clip / (total + 1e-6), max=1.0)
            for p in self.tau_params:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.device))
            # DeepSpeed clips the towers by their own norm in step(): hand it the bound that gives the joint
            # coefficient, clip * towers / total (a host read; the step's NaN/Inf check reads back anyway)
            bound = float(clip * (towers + 1e-6) / (total + 1e-6))
            if math.isfinite(bound):
                self.optimizer.clip_grad = bound
        return total

    skips_on_device = False  # DeepSpeed decides on overflow itself (with its own host read)

    def step(self) -> None:
        self.engine.step()
        if self.tau_optimizer is not None:
            self.tau_optimizer.step()

    def skip_step(self) -> None:
        """No update. DeepSpeed discards its reduced gradients itself when their norm is NaN/Inf (it skips the
        step); the temperature's optimizer does not step."""
        if self.cache is not None:
            self.cache.discard()
        self.engine.step()
        if self.engine.was_step_applied():
            logging.getLogger(__name__).warning(
                "deepspeed: the step was skipped for NaN/Inf in the loss or the temperature, but the towers' "
                "gradients were finite, so DeepSpeed applied its step to the towers"
            )

    # -- checkpoints
    def model_state_dict(self) -> dict | None:
        """The towers' full state_dict on rank 0 (None elsewhere). Collective under ZeRO-3: each parameter is
        gathered in turn (peak memory: one parameter more than the shard), the same order on every rank."""
        if self.stage < 3:
            return self.model.state_dict() if self.info.is_main else None
        import deepspeed

        out = {}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if hasattr(tensor, "ds_id"):  # a ZeRO-3 partitioned parameter
                with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                    if self.info.is_main:
                        out[name] = tensor.detach().clone()
            elif self.info.is_main:
                out[name] = tensor.detach()
        return out if self.info.is_main else None

    def optimizer_state_dict(self) -> dict:
        return {
            "backend": "deepspeed",
            "stage": self.stage,
            "deepspeed_dir": DEEPSPEED_TAG,
            "temperature": self.tau_optimizer.state_dict() if self.tau_optimizer is not None else None,
        }

    def save_shards(self, step_dir: Path) -> None:
        """Collective: DeepSpeed's files into <step_dir>/deepspeed/ (its `latest` file is not written)."""
        self.engine.save_checkpoint(str(step_dir), tag=DEEPSPEED_TAG, save_latest=False)
        # DeepSpeed also drops its zero_to_fp32.py recovery scripts into step_dir: kept, they read these files
        _fsync_tree(step_dir / DEEPSPEED_TAG)

    def load_optimizer(self, state: dict, step_dir: Path) -> None:
        """model.pt's "optimizer" (the temperature's) and DeepSpeed's shards in <step_dir>/deepspeed/ (backend, stage
        and world size were checked at start-up: fastclip/checkpoint/compat.py)."""
        path, _ = self.engine.load_checkpoint(
            str(step_dir),
            tag=DEEPSPEED_TAG,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if path is None:
            raise CheckpointError(f"{step_dir / DEEPSPEED_TAG}: DeepSpeed found no checkpoint to load")
        if self.tau_optimizer is not None:
            self.tau_optimizer.load_state_dict(state["temperature"])

    def full_params(self):
        """Whole parameters on every rank for the duration (evaluation under ZeRO-3)."""
        if self.stage < 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)


def build_engine(net: torch.nn.Module, cfg: Config, info: DistInfo):
    """The backend of train.distributed around `net` (a TowersWithLoss)."""
    if cfg.train.distributed == "deepspeed":
        return DeepSpeedEngine(net, cfg, info)
    return DDPEngine(net, cfg, info)


__all__ = [
    "build_engine",
    "DDPEngine",
    "DeepSpeedEngine",
    "TowerEncoders",
    "deepspeed_config",
    "frozen_scalars_to_buffers",
    "DEEPSPEED_TAG",
]
