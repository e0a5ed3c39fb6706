"""The training configuration: every knob in one place, as dataclasses, loaded from YAML plus command-line
overrides and checked before anything heavy starts.

    cfg = load_config("configs/cc3m-fastclip-v3.yaml", ["--optim.lr", "5e-4", "--batch_size", "64"])

Overrides are `--section.key value`, `--section.key=value`, or `--key value` when `key` names exactly one field.
Values are parsed as YAML scalars/lists ("1e-3", "[0.9, 0.98]", "null", "true"). Errors (ConfigError) name the
key: an unknown key, a value of the wrong type, or an impossible value (negative lr, ...). Checks that need the
data or the world size (a batch larger than the data) run in the trainer, before the model is built.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from fastclip.cli import note
from fastclip.data.stream import StreamOptions
from fastclip.errors import ConfigError
from fastclip.losses import LOSSES, config_options
from fastclip.train.preemption import signal_number

LOSS_NAMES = tuple(LOSSES)  # loss.name's choices: the losses build_loss knows


def _rules(section: Any, prefix: str):
    """need(ok, key, why): unless ok, the ConfigError "config key '<prefix><key>': <why> (got <value>)"."""

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"config key '{prefix}{key}': {why} (got {_get(section, key)!r})")

    return need


@dataclass
class AugConfig:
    """The training images' augmentation: OpenCLIP's --aug-cfg (open_clip.AugmentationCfg), applied by open_clip's
    train transform. Its draws come from the loader's per-batch seeded RNGs (fastclip/data/worker.py), so a
    resumed run sees the same augmented images. Unset (null) keys are open_clip's defaults: no jitter, no
    grayscale, no erasing. ssl mode's two views (fastclip/data/views.py) take scale, ratio, color_jitter(_prob) and
    gray_scale_prob, SimCLR's where unset (0.08-1, 3/4-4/3, (0.4, 0.4, 0.4, 0.1) at 0.8, 0.2); timm's keys: refused."""

    scale: list[float] | None = None  # RandomResizedCrop's area range; null: open_clip's 0.9-1 (ssl: SimCLR's)
    color_jitter: list[float] | None = None  # brightness, contrast, saturation, hue (with color_jitter_prob)
    color_jitter_prob: float | None = None  # probability of the jitter
    gray_scale_prob: float | None = None  # probability of a grayscale image
    use_timm: bool = False  # timm's create_transform instead (needs timm); the keys below need it
    ratio: list[float] | None = None  # the crop's aspect-ratio range (timm)
    re_prob: float | None = None  # random erasing probability (timm)
    re_count: int | None = None  # erased boxes per image (timm)


# lists of a fixed length: a scalar's hint shows the whole list, not the scalar in brackets (refused next)
LIST_EXAMPLES = {
    "data.aug.color_jitter": "'[0.4, 0.4, 0.4, 0.1]' (brightness, contrast, saturation, hue)",
    "data.aug.scale": "'[0.9, 1.0]' (the crop's area range)",
    "data.aug.ratio": "'[0.75, 1.333]' (the crop's aspect-ratio range)",
    "optim.betas": "'[0.9, 0.98]'",
}
TIMM_ONLY_AUG = ("ratio", "re_prob", "re_count")  # open_clip's own transform ignores them
VIEW_AUG = ("scale", "ratio", "color_jitter", "color_jitter_prob", "gray_scale_prob")  # what ssl views take
OPENCLIP_SCALE = [0.9, 1.0]  # open_clip's own default area range


def aug_options(aug: AugConfig) -> dict:
    """data.aug as open_clip's aug_cfg: the keys set, tuples where it wants them."""
    out = {k: v for k, v in dataclasses.asdict(aug).items() if v is not None and v is not False}
    out.setdefault("scale", OPENCLIP_SCALE)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


@dataclass
class DataConfig(StreamOptions):
    # Defaults = the embedded recipe (configs/embedded.yaml: tiny-vit, FastCLIP-v3, 2 x 64 samples), except that
    # the loss knobs default to null (the loss library's defaults) and train.device to auto. The training stream's
    # keys (train, batch_size, workers, seed, ...) are StreamOptions' (fastclip/data/stream.py): their defaults
    # and help are there; these are what the trainer alone reads.
    val: str | None = "data/embedded/val"  # labelled held-out shards for evaluation; null: no eval
    zeroshot: str | None = "data/embedded/zeroshot.json"  # class names + templates for zero-shot eval
    # uint8 images from the workers, normalised on the device (4x fewer bytes pinned and copied; bitwise the same
    # batches: fastclip/data/pixels.py); null: on unless data.aug.re_prob (timm erases normalised pixels)
    device_normalize: bool | None = None
    # training-image augmentation (OpenCLIP's --aug-cfg); unset = open_clip's, which the embedded default keeps by
    # the out-of-distribution measurement in configs/embedded.yaml (python benchmarks/bench_aug.py)
    aug: AugConfig = field(default_factory=AugConfig)

    def check(self) -> None:  # (data.aug: _check_aug, which needs ssl.enabled)
        need = _rules(self, "data.")
        for key, why in self.problems():  # the stream's knobs: their ranges are the stream's (StreamOptions)
            need(False, key, why)
        # the trainer's rule, at config time: virtual epochs and source weights only when drawing with replacement
        need(self.samples_per_epoch is None or self.resampled, "samples_per_epoch", "needs data.resampled: true "
             "(without resampling an epoch is one pass over all shards)")  # fmt: skip
        need(self.upsampling_factors is None or self.resampled, "upsampling_factors", "needs data.resampled: true")


@dataclass
class ModelConfig:
    arch: str = "tiny-vit"  # open_clip name (RN50, ViT-B-32, ...), configs/models/<name>, or a .json
    grad_checkpointing: bool = False  # recompute activations in backward (less memory, ~30% more compute)
    compile: bool = False  # torch.compile the towers (not the loss: it holds collectives)
    channels_last: bool | None = None  # NHWC convolutional image towers; null: on for CUDA (fastclip/train/gpu.py)
    # MoCo/ALBEF: an EMA copy of the towers, θ_m ← m·θ_m + (1−m)·θ (0.995 as ALBEF); its features fill the loss's
    # queue (loss.queue_size) and give loss.distill_alpha's targets (fastclip/train/momentum.py)
    ema_momentum: float | None = None
    pretrained: str | None = None  # start the towers from this file (OpenCLIP's --pretrained): an
    # OpenCLIP epoch_N.pt, an open_clip state dict, a fastclip export or
    # model.pt, or an image tower's alone (the text tower then random);
    # shapes must match; fresh optimizer and per-sample state;
    # ignored when --train.resume finds a checkpoint to continue
    # LiT (OpenCLIP's --lock-image, --lock-text ...): a locked tower's parameters are frozen (requires_grad false: no
    # gradient, no optimizer state), through open_clip's lock_image_tower / lock_text_tower (fastclip/models/locks.py),
    # applied before model.pretrained or a resume loads the towers; the lock keys cannot change on resume
    lock_image: bool = False  # freeze the image tower (LiT: model.pretrained an image tower's file, text random)
    # leave the last N of the image tower's groups trainable (open_clip's ViT: stem, each block but the last, the
    # last block with ln_post, the projection: layers + 2 groups); RN towers lock whole only (0)
    lock_image_unlocked_groups: int = 0
    # the locked groups' BatchNorm layers become FrozenBatchNorm2d: statistics and affine weights fixed, also in
    # train mode (a locked BatchNorm otherwise still updates its running statistics); refused for a tower without any
    lock_image_freeze_bn_stats: bool = False
    lock_text: bool = False  # freeze the text tower
    # leave the last N of the text tower's layer groups trainable (open_clip's text transformer: the embeddings, each
    # block but the last, the last block with ln_final, the projection; a Hugging Face tower: its embeddings and layers)
    lock_text_unlocked_layers: int = 0
    # open_clip's own text tower locks its LayerNorms with the rest and needs this true; a Hugging Face tower keeps
    # its LayerNorms trainable unless it is true
    lock_text_freeze_layer_norm: bool = False

    def check(self) -> None:
        m = self.ema_momentum
        need = _rules(self, "model.")
        need(m is None or 0 < m < 1, "ema_momentum", "must be in (0, 1) or null")
        for tower, count in (("image", "lock_image_unlocked_groups"), ("text", "lock_text_unlocked_layers")):
            need(getattr(self, count) >= 0, count, "must be >= 0 (0: the whole tower is locked)")
            lock = f"lock_{tower}"
            for key in (count, "lock_image_freeze_bn_stats" if tower == "image" else "lock_text_freeze_layer_norm"):
                need(getattr(self, lock) or not getattr(self, key), key, f"applies to a locked {tower} tower only: "
                     f"set model.{lock} true (OpenCLIP's --{lock.replace('_', '-')}), or drop it")  # fmt: skip


# The loss section: `name`, the trainer's own `validate`, and a key for every loss option (fastclip/losses/options.py,
# its one schema: type, rule and help), null by default = the loss library's default. Each set value is passed to
# build_loss, which rejects an option the chosen loss does not take.
LOSS_TRAINER_KEYS = {
    # one of LOSS_NAMES, or module:attribute naming a LossEntry of your own (fastclip.losses.loss_entry)
    "name": (str, "fastclip-v3"),
    # input checks (fastclip/losses/validation.py): "deferred" rides the feature all_gather and is read on logging
    # steps and before each checkpoint (no host sync per step); "eager" raises in the step (one host sync per step)
    "validate": (Literal["deferred", "eager", "off"], "deferred"),
}
LossConfig = dataclasses.make_dataclass(
    "LossConfig",
    [("name", *LOSS_TRAINER_KEYS["name"])]
    + [
        (key, LOSS_TRAINER_KEYS[key][0], LOSS_TRAINER_KEYS[key][1])
        if key in LOSS_TRAINER_KEYS
        else (key, tp | None, None)
        for key, tp in config_options().items()
    ]
    # a loss of your own (name module:attribute): its options that no key above names, as a mapping
    # (--loss.extra_options.margin 0.2); the library's losses take every option as a key of its own
    + [("extra_options", dict | None, None)],
)
LossConfig.__module__ = __name__  # (make_dataclass names its caller's module from Python 3.12 only)


@dataclass
class OptimConfig:
    optimizer: Literal["adamw", "lamb"] = "adamw"
    lr: float = 1e-3  # peak lr of the towers
    lr_min: float = 0.0  # floor of the cosine decay
    lr_schedule: Literal["cosine", "const"] = "cosine"
    warmup_steps: int = 100  # linear warmup, in optimizer steps
    wd: float = 0.1  # AdamW/LAMB decoupled weight decay on ndim >= 2 tensors only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6
    grad_clip: float | None = None  # max global gradient norm; null: no clipping
    lr_tau: float | None = 2e-4  # temperature lr (v0/v3/openclip group; v2's per-sample update); null: lr
    lr_tau_schedule: Literal["cosine", "const", "step_thresh"] = "step_thresh"
    lr_tau_min: float = 0.0  # floor of the temperature group's cosine
    tau_threshold: float = 0.03  # step_thresh: lr_tau / tau_threshold_factor once tau <= this
    tau_threshold_factor: float = 3.0
    accum_steps: int = 1  # gradient accumulation (GradCache, fastclip/train/accumulate.py): the
    # per-process batch data.batch_size is split into this many micro-
    # batches; the loss still sees the whole global batch at once. Not
    # OpenCLIP's meaning of --accum-freq: there --batch-size is the micro-
    # batch; here data.batch_size stays the per-process batch of one step

    @property
    def base_lr_tau(self) -> float:
        """The temperature's peak lr: lr_tau, or lr when lr_tau is null."""
        return self.lr if self.lr_tau is None else self.lr_tau

    def check(self) -> None:
        need = _rules(self, "optim.")
        need(self.lr >= 0 and math.isfinite(self.lr), "lr", "must be a finite number >= 0")
        need(0 <= self.lr_min <= self.lr, "lr_min", "must be in [0, optim.lr]")
        need(self.lr_tau is None or self.lr_tau >= 0, "lr_tau", "must be >= 0")
        need(self.lr_tau_min >= 0, "lr_tau_min", "must be >= 0")
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        need(self.wd >= 0 and math.isfinite(self.wd), "wd", "must be a finite number >= 0")
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "must be two numbers in [0, 1)")
        need(self.eps > 0, "eps", "must be > 0")
        need(self.grad_clip is None or self.grad_clip > 0, "grad_clip", "must be > 0 or null")
        need(0 < self.tau_threshold, "tau_threshold", "must be > 0")
        need(self.tau_threshold_factor >= 1, "tau_threshold_factor", "must be >= 1")
        need(self.accum_steps >= 1, "accum_steps", "must be >= 1")


@dataclass
class TrainConfig:
    run_dir: str = "runs/embedded-fastclip-v3"  # metrics.jsonl, config.yaml, tensorboard/, checkpoints/
    epochs: int = 5
    max_steps: int | None = None  # stop after this many steps (smoke runs); schedules still span `epochs`
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # bf16/fp16: autocast; fp16 adds a GradScaler
    seed: int = 2024
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    resume: str | None = None  # "latest" (of run_dir), or a checkpoint step folder
    # a resume with another data.batch_size is refused (the steps per epoch change) unless this says the change is
    # intended; the start then says the new layout (the lr goes on: the schedules run on samples seen)
    resume_batch_change: bool = False
    log_every: int = 10  # steps between metric lines (the only steps that read values back)
    tensorboard: bool = True  # also write <run_dir>/tensorboard when tensorboard is installed
    wandb: bool = False  # also log to Weights & Biases (pip install 'fastclip[wandb]'; WANDB_MODE=offline works
    # without a network: files under <run_dir>/wandb, `wandb sync` them later); a resumed run continues its run
    wandb_project: str = "fastclip"
    progress: bool = True  # progress bar on rank 0 (a plain line when not a terminal)
    dist_timeout_minutes: float = 30.0  # collectives while starting, saving checkpoints and evaluating
    collective_timeout_seconds: float = 300.0  # collectives once the first step is done: a dead or hung rank
    # makes the others stop with an error within this time
    max_nonfinite_steps: int = 20  # NaN/Inf loss, gradients or features: the step is skipped; stop
    # after this many in a row (the last checkpoint is a good one)
    nonfinite_check: Literal["device", "host"] = "device"  # device: the skip is decided and applied on the device,
    # no per-step host read or collective (fused AdamW without fp16; else host); skips and stop signals are read
    # on logging steps. host: one tiny all_reduce and host read per step (fastclip/train/guards.py)
    distributed: Literal["ddp", "deepspeed"] = "ddp"  # data-parallel backend (fastclip/train/engine.py); deepspeed:
    # ZeRO sharding, knobs in the `deepspeed` section
    stop_signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])  # checkpoint on every rank
    # at the step where the ranks agree on it, then exit 75 (fastclip/train/preemption.py)
    # nonfinite_check device: the ranks agree on a stop signal every N steps and on logging steps (one tiny
    # all_reduce and host read each time), so the stop follows within N steps, well inside SLURM's 120 s warning
    # even where train.log_every is 100; host mode agrees at every step anyway
    stop_check_every: int = 10
    # GPU speed defaults (fastclip/train/gpu.py); no effect on CPU
    tf32: bool = True  # CUDA: TF32 fp32 matmuls/convolutions (also the loss's fp32 matmul)
    cudnn_benchmark: bool = True  # CUDA: cuDNN picks the fastest convolution algorithms once
    ddp_bucket_view: bool = True  # DDP gradient_as_bucket_view
    ddp_static_graph: bool | None = None  # DDP static_graph; null: on with accum_steps 1 and no compile

    def check(self) -> None:
        need = _rules(self, "train.")
        need(self.run_dir.strip() != "", "run_dir", "must name a folder (an empty one would be the working directory)")
        need(self.epochs >= 1, "epochs", "must be >= 1")
        need(self.seed >= 0, "seed", "must be >= 0")
        need(self.max_steps is None or self.max_steps >= 0, "max_steps", "must be >= 0 or null")
        need(self.log_every >= 1, "log_every", "must be >= 1")
        need(self.stop_check_every >= 1, "stop_check_every", "must be >= 1")
        need(self.dist_timeout_minutes > 0, "dist_timeout_minutes", "must be > 0")
        need(self.collective_timeout_seconds > 0, "collective_timeout_seconds", "must be > 0")
        need(self.max_nonfinite_steps >= 1, "max_nonfinite_steps", "must be >= 1")
        for name in self.stop_signals:
            try:
                signal_number(name)
            except ValueError as e:
                raise ConfigError(f"config key 'train.stop_signals': {e}") from None


@dataclass
class EvalConfig:
    every_steps: int = 200  # evaluate every N steps (0: never during training)
    every_epochs: int = 0  # also after every N-th epoch (OpenCLIP's --val-frequency/--zeroshot-frequency); 0: not
    at_end: bool = True  # evaluate after the last step
    batch_size: int = 256
    max_samples: int | None = None  # cap on evaluated val samples (fast checks); null: all
    # OpenCLIP's --imagenet-val: an ImageNet validation ImageFolder (1,000 synset folders; a variant, or ObjectNet's
    # folder: fastclip/eval/imagenet.py), scored zero-shot at every evaluation (all of it: max_samples caps data.val
    # only) with open_clip's class names and templates
    imagenet_val: str | None = None
    imagenet_templates: Literal["openai", "simple"] = "openai"  # OpenAI's 80 prompts, or open_clip's 7
    val_loss: bool = True  # the loss (in eval mode: no state written) on data.val's captioned samples
    # linear probe and weighted kNN on the frozen image features of data.val's labelled samples (fastclip/eval/
    # probe.py), off by default; training features: the first probe_max_train samples of probe_train
    linear_probe: bool = False
    knn: list[int] = field(default_factory=list)  # k values, e.g. [20, 200]; []: no kNN
    probe_train: str | None = None  # labelled shards or image folder; null: the train/ folder beside data.val
    probe_max_train: int = 5000

    def check(self) -> None:
        need = _rules(self, "eval.")
        need(self.every_steps >= 0, "every_steps", "must be >= 0")
        need(self.every_epochs >= 0, "every_epochs", "must be >= 0")
        need(self.max_samples is None or self.max_samples >= 1, "max_samples", "must be >= 1 or null (all)")
        need(self.batch_size >= 1, "batch_size", "must be >= 1")
        need(all(k >= 1 for k in self.knn), "knn", "every k must be >= 1")
        need(self.probe_max_train >= 1, "probe_max_train", "must be >= 1")


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # 0: never by step count
    every_epochs: int = 0  # also at the end of every N-th epoch (OpenCLIP's --save-frequency); 0: not by epochs
    every_minutes: float = 10.0  # 0: never by time (rank 0's clock decides, on logging steps)
    keep_last: int = 3  # completed checkpoints kept (older ones, and any after a step resumed from, are deleted)
    at_end: bool = True
    # false: no fsync of the files (scratch disks, tests); a kill still leaves the last save whole, a power loss may not
    fsync: bool = True

    def check(self) -> None:
        need = _rules(self, "checkpoint.")
        need(self.every_steps >= 0, "every_steps", "must be >= 0")
        need(self.every_epochs >= 0, "every_epochs", "must be >= 0")
        need(self.every_minutes >= 0, "every_minutes", "must be >= 0")
        need(self.keep_last >= 1, "keep_last", "must be >= 1")


@dataclass
class DeepSpeedConfig:
    # Used when train.distributed is deepspeed (fastclip/train/engine.py; needs `pip install deepspeed`).
    stage: int = 2  # ZeRO stage: 1 shards the optimizer state, 2 also the gradients,
    # 3 also the parameters (gathered for the forward, for model.pt, eval)
    reduce_bucket_size: int = 500_000_000  # elements per gradient reduce(-scatter) bucket
    allgather_bucket_size: int = 500_000_000  # elements per parameter all-gather bucket after the step (stages 1-2)
    overlap_comm: bool | None = None  # overlap gradient reduction with the backward; null: on for CUDA
    contiguous_gradients: bool = True  # copy reduced gradients into one buffer (less fragmentation)
    param_persistence_threshold: int = 100_000  # stage 3: parameters with fewer elements stay whole on every rank
    config_file: str | None = None  # a DeepSpeed JSON merged over the generated config (for the knobs
    # not listed here); it may not set batch sizes, optimizer, fp16/bf16

    def check(self) -> None:
        need = _rules(self, "deepspeed.")
        need(
            self.stage in (1, 2, 3) and not isinstance(self.stage, bool),
            "stage",
            "must be 1, 2 or 3 (ZeRO without sharding, stage 0, is what train.distributed: ddp does)",
        )
        need(self.reduce_bucket_size >= 1, "reduce_bucket_size", "must be >= 1")
        need(self.allgather_bucket_size >= 1, "allgather_bucket_size", "must be >= 1")
        need(self.param_persistence_threshold >= 0, "param_persistence_threshold", "must be >= 0")


@dataclass
class SSLConfig:
    # Self-supervised images (fastclip/train/ssl.py): two augmented views of each image, the image tower plus a
    # projector MLP, the loss in its unimodal form. Captions are not read; evaluation is kNN on data.val's labels.
    enabled: bool = False
    projector_hidden: int = 512  # the projector MLP's hidden width
    projector_dim: int = 128  # the features the loss sees
    # the views (fastclip/data/views.py): data.aug's crop, jitter and grayscale keys (SimCLR's where unset), and
    # these two, which data.aug lacks
    flip_p: float = 0.5  # horizontal flip probability
    blur_p: float = 0.5  # Gaussian blur probability
    knn_k: int = 20  # kNN evaluation (DINO's weighted vote): neighbours, and the vote's temperature
    knn_temperature: float = 0.07


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    ssl: SSLConfig = field(default_factory=SSLConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- values and types
YAML_BOOL_WORDS = {True: ("true", "yes", "on", "y"), False: ("false", "no", "off", "n")}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` as type `tp` or raise ConfigError naming `key`. Strict: no str->int, no float->int."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"config key '{key}': {value!r} matches none of {tp}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads off/on/no/yes as booleans: `validate: off` means "off"
            words = [c for c in choices if isinstance(c, str) and c.lower() in YAML_BOOL_WORDS[value]]
            value = words[0] if len(words) == 1 else value
        if value not in choices:
            raise ConfigError(f"config key '{key}': {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            example = LIST_EXAMPLES.get(key, f"'[{value}]'")
            raise ConfigError(
                f"config key '{key}': expected a list, got {type(value).__name__} {value!r}"
                + (f" (on the command line: --{key} {example})" if isinstance(value, (str, int, float)) else "")
            )
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}': expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}': expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"config key '{key}': expected a number, got str {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}': expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):  # no knob means "unbounded" by inf; nan passes every comparison check
            raise ConfigError(f"config key '{key}': expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}': expected a string, got {type(value).__name__} {value!r}")
        return value
    if tp is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"config key '{key}': expected a mapping of names to values, got {value!r}")
        return dict(value)
    raise TypeError(f"unsupported config type {tp} for '{key}'")


def _build(cls, data: Any, prefix: str, source: str):
    if not isinstance(data, dict):
        section = prefix.rstrip(".") or "<top>"  # (a section's prefix ends in its dot)
        raise ConfigError(f"config section '{section}'{source}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"'{prefix}{key}'"
            raise ConfigError(
                f"unknown config key {where}{source}; known keys{' in ' + prefix[:-1] if prefix else ''}: "
                f"{', '.join(sorted(names))}"
            )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name], f"{prefix}{name}.", source)
        else:
            kwargs[name] = _coerce(data[name], tp, f"{prefix}{name}")
    return cls(**kwargs)


def _deep_update(base: dict, new: dict) -> dict:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


def _field_index() -> dict[str, list[str]]:
    """field name -> the dotted keys that have it (for `--key value` without a section)."""
    index: dict[str, list[str]] = {}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(typing.get_type_hints(Config)[section.name]):
            index.setdefault(f.name, []).append(f"{section.name}.{f.name}")
    return index


def _known(flag: str, index: dict[str, list[str]]) -> bool:
    """Whether --flag (normalised: `_` for `-`) names a config key, an OpenCLIP alias of one, or --report-to."""
    if "." in flag:
        return flag in {key for keys in index.values() for key in keys}
    return flag in index or flag in FLAG_ALIASES or flag == "report_to"


def _text_keys() -> set[str]:
    """Dotted keys of the string-valued fields: their command-line values stay text (YAML would make
    2024-11-23 a date, 2024 a number, a::b: a mapping)."""
    keys = set()
    for section, cls in typing.get_type_hints(Config).items():
        for name, tp in typing.get_type_hints(cls).items():
            if tp in (str, str | None):
                keys.add(f"{section}.{name}")
    return keys


# OpenCLIP / FastCLIP-reference flag names (dashes or underscores) -> our keys, so their commands translate
FLAG_ALIASES = {
    "batch_size": "data.batch_size",
    "train_data": "data.train",
    "val_data": "data.val",
    "imagenet_val": "eval.imagenet_val",
    "dist_backend": "train.backend",
    "workers": "data.workers",
    "dataset_resampled": "data.resampled",
    "train_num_samples": "data.samples_per_epoch",
    "train_data_upsampling_factors": "data.upsampling_factors",
    "data_size": "data.data_size",
    "model": "model.arch",
    "grad_checkpointing": "model.grad_checkpointing",
    "lock_image": "model.lock_image",
    "lock_image_unlocked_groups": "model.lock_image_unlocked_groups",
    "lock_image_freeze_bn_stats": "model.lock_image_freeze_bn_stats",
    "lock_text": "model.lock_text",
    "lock_text_unlocked_layers": "model.lock_text_unlocked_layers",
    "lock_text_freeze_layer_norm": "model.lock_text_freeze_layer_norm",
    "torchcompile": "model.compile",
    "save_frequency": "checkpoint.every_epochs",
    "val_frequency": "eval.every_epochs",
    "zeroshot_frequency": "eval.every_epochs",
    "lr": "optim.lr",
    "wd": "optim.wd",
    "warmup": "optim.warmup_steps",
    "eps": "optim.eps",
    "grad_clip_norm": "optim.grad_clip",
    "lr_scheduler": "optim.lr_schedule",
    "lr_tau_scheduler": "optim.lr_tau_schedule",
    "opt": "optim.optimizer",
    "optimizer": "optim.optimizer",
    "gamma": "loss.gamma_min",
    "fastclip_eps": "loss.eps",
    "epochs": "train.epochs",
    "seed": "train.seed",
    "precision": "train.precision",
    "resume": "train.resume",
    "logs": "train.run_dir",
    "accum_freq": "optim.accum_steps",  # same key, other batch semantics: see OptimConfig.accum_steps
    "log_every_n_steps": "train.log_every",
    "wandb_project_name": "train.wandb_project",
}
# OpenCLIP's --precision values that mean what one of ours means. Its fp16/bf16 (model.half(): weights in half
# precision) and pure_fp16/pure_bf16 mean something else and are not mapped; our fp16/bf16 are its amp/amp_bf16.
PRECISION_ALIASES = {"amp": "fp16", "amp_bf16": "bf16", "amp_bfloat16": "bf16"}
# OpenCLIP flags without a value that change nothing here, and why
NO_OP_FLAGS = {
    "local_loss": "every loss gathers the features once and computes the global-batch gradient exactly",
    "gather_with_grad": "every loss gathers the features once and computes the global-batch gradient exactly",
}
REPORT_TO = ("tensorboard", "wandb")
# OpenCLIP switches (no value) that set a boolean here; "--flag true/false" works too
SWITCH_FLAGS = (
    "dataset_resampled",
    "grad_checkpointing",
    "torchcompile",
    "ddp_static_graph",
    "lock_image",
    "lock_image_freeze_bn_stats",
    "lock_text",
    "lock_text_freeze_layer_norm",
)
ONE_EVALUATION = (
    "--val-frequency and --zeroshot-frequency are one setting (eval.every_epochs): an evaluation scores data.val "
    "and zero-shot together, also every --eval.every_steps steps (0 turns it off)"
)
# OpenCLIP flags taken here with another meaning in a detail: said once, in one note at the start
OPENCLIP_DIFFERENCES = {
    "accum_freq": "--accum-freq N splits the per-process --batch-size into N micro-batches: the global batch stays "
    "batch-size x processes (OpenCLIP's is N times that)",
    "logs": "--logs DIR is the run folder itself (OpenCLIP writes DIR/<name>/)",
    "report_to": "--report-to names every logger: TensorBoard is written only when it is listed",
    "pretrained": "--pretrained takes a local file (OpenCLIP's epoch_N.pt, an open_clip state dict or a fastclip "
    "export): nothing is downloaded",
    "save_frequency": "--save-frequency N saves after every N-th epoch, and also every --checkpoint.every_steps "
    "steps and --checkpoint.every_minutes minutes (0 turns either off); the last --checkpoint.keep_last of all of "
    "them are kept",
    "val_frequency": ONE_EVALUATION,
    "zeroshot_frequency": ONE_EVALUATION,
}
# OpenCLIP options with no counterpart key here: what to use instead, or why there is none
OPENCLIP_UNSUPPORTED = {
    "siglip": "use --loss.name siglip",
    "delete_previous_checkpoint": "use --checkpoint.keep_last 1",
    "save_most_recent": "checkpoints/latest always names the newest checkpoint",
    "force_quick_gelu": "the activation comes from the architecture: use a -quickgelu one, e.g. --model.arch "
    "ViT-B-32-quickgelu",
    "horovod": "processes are started by torchrun or srun (launch/)",
    "beta1": "use --optim.betas '[BETA1, BETA2]' (both at once; default [0.9, 0.98])",
    "beta2": "use --optim.betas '[BETA1, BETA2]' (both at once; default [0.9, 0.98])",
    "imagenet_v2": "ImageNet-V2 is not evaluated during training; --imagenet-val DIR takes one folder of class "
    "subfolders, and `fastclip eval` scores an exported model on any such folder",
    "distill": "distillation is not supported",
}


def _report_to(raw: str) -> dict:
    """OpenCLIP's --report-to list -> {"tensorboard": bool, "wandb": bool} (train section)."""
    targets = [t.strip() for t in str(raw or "").split(",") if t.strip()]
    if targets == ["all"]:  # OpenCLIP: every integration it has
        targets = list(REPORT_TO)
    for t in targets:
        if t not in REPORT_TO:
            raise ConfigError(
                f"--report-to {raw}: {t!r} is not one of {', '.join(REPORT_TO)} (comma-separated, or all)"
            )
    return {name: name in targets for name in REPORT_TO}


def _aug_pair(pair: str, out: dict) -> None:
    """One of --aug-cfg's key=value pairs (values as OpenCLIP reads them: Python literals, "(0.08, 1.0)")."""
    import ast

    if "=" not in pair:
        raise ConfigError(
            f"--aug-cfg {pair}: expected key=value pairs, e.g. --aug-cfg scale='(0.08, 1.0)' gray_scale_prob=0.2"
        )
    key, raw = pair.split("=", 1)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    value = list(value) if isinstance(value, tuple) else value
    out.setdefault("data", {}).setdefault("aug", {})[key.replace("-", "_")] = value


def parse_overrides(args: list[str]) -> dict:
    """["--optim.lr", "1e-3", "--batch_size=8"] -> {"optim": {"lr": "1e-3"}, "data": {"batch_size": 8}}."""
    index, text_keys, out, i = _field_index(), _text_keys(), {}, 0
    spelled: dict[str, tuple[tuple[str, str], object]] = {}  # key -> (the flag that set it, its value)
    differences: list[str] = []  # OpenCLIP flags used whose meaning here differs in a detail
    while i < len(args):
        arg = args[i]
        i, key, raw = _next_flag(args, i, index, out)
        if key is None:  # a flag without a key of its own (done)
            continue
        key = key.replace("-", "_")
        if key in OPENCLIP_DIFFERENCES and OPENCLIP_DIFFERENCES[key] not in differences:
            differences.append(OPENCLIP_DIFFERENCES[key])
        if key == "precision" and str(raw) in ("fp16", "bf16"):  # OpenCLIP's flag, with a value of ours
            said = (
                f"--precision {raw} is autocast with fp32 weights (OpenCLIP's amp{'_bf16' * (raw == 'bf16')}); "
                f"OpenCLIP's {raw} puts the weights in half precision, which fastclip does not do"
            )
            differences += [said] * (said not in differences)
        written = (arg.split("=", 1)[0], key)  # as typed, and normalised (--batch-size and --batch_size are one flag)
        if key == "report_to":
            out.setdefault("train", {}).update(_report_to(raw))
            continue
        key = _dotted_key(key, index)
        value = _override_value(key, raw, key in text_keys)
        # The same flag twice: the last wins (a script's default, then the user's "$@"). Two spellings of one key
        # with different values (--batch-size 32 --data.batch_size 64) is a conflict, not an override.
        before = spelled.get(key)
        if before is not None and before[0][1] != written[1] and before[1] != value:
            raise ConfigError(
                f"config key '{key}' is given twice with different values: {before[0][0]} {before[1]!r} and "
                f"{written[0]} {value!r}; keep one"
            )
        spelled[key] = (written, value)
        _put(out, key, value)
    if differences:
        _config_note(f"fastclip train: note: where fastclip differs from OpenCLIP: {'; '.join(differences)}")
    return out


def _next_flag(args: list[str], i: int, index: dict[str, list[str]], out: dict) -> tuple[int, str | None, str]:
    """The flag at args[i]: (where the next one starts, its key as typed, its raw value); key None for a flag that
    sets no key of its own (an OpenCLIP no-op, --aug-cfg's pairs: put in `out` here)."""
    arg = args[i]
    if not arg.startswith("--") or arg == "--":
        raise ConfigError(f"expected --key value, got {arg!r}")
    flag = arg[2:].replace("-", "_")
    if flag in NO_OP_FLAGS:  # OpenCLIP switches: no value follows
        _config_note(f"fastclip train: note: {arg} is accepted and changes nothing: {NO_OP_FLAGS[flag]}")
        return i + 1, None, ""
    _refuse_openclip_only(flag)
    if flag == "aug_cfg":  # OpenCLIP's --aug-cfg k=v k=v ...: each pair a data.aug key
        i += 1
        while i < len(args) and not args[i].startswith("--"):
            _aug_pair(args[i], out)
            i += 1
        return i, None, ""
    if "=" in arg:
        key, raw = arg[2:].split("=", 1)
        return i + 1, key, raw
    if flag in SWITCH_FLAGS and (i + 1 >= len(args) or args[i + 1].startswith("--")):
        return i + 1, arg[2:], "true"
    switch = i + 1 >= len(args) or args[i + 1].startswith("--")  # no value follows
    if switch and not _known(flag, index):  # a switch of another trainer, or a typo: not "has no value"
        raise ConfigError(
            f"unknown option {arg}: no config key of that name (--section.key VALUE, or an OpenCLIP flag "
            f"that has one; `fastclip train --print-config` lists the keys)"
        )
    if i + 1 >= len(args):
        raise ConfigError(f"config key '{arg[2:]}' has no value")
    if args[i + 1].startswith("--"):  # a flag, not a value (negative numbers start with one '-')
        raise ConfigError(
            f"config key '{arg[2:]}' has no value (next is {args[i + 1]}): give one, or --{arg[2:]}=VALUE"
        )
    return i + 2, arg[2:], args[i + 1]


def _refuse_openclip_only(flag: str) -> None:
    """OpenCLIP's options that have no key here, or another one: what to use instead."""
    if (bare := flag.split("=", 1)[0]) in OPENCLIP_UNSUPPORTED:
        raise ConfigError(
            f"unknown option --{bare.replace('_', '-')} (an OpenCLIP option): {OPENCLIP_UNSUPPORTED[bare]}"
        )
    if flag == "name":  # OpenCLIP's run name; "name" alone would otherwise mean loss.name
        raise ConfigError(
            "--name is OpenCLIP's run name: here the run folder is --train.run_dir DIR (or --logs DIR, the "
            "folder itself, not its parent); the loss is --loss.name"
        )


def _dotted_key(key: str, index: dict[str, list[str]]) -> str:
    """section.key for a flag: itself, its OpenCLIP alias's key, or the one key of that name."""
    if "." not in key and key in FLAG_ALIASES:
        key = FLAG_ALIASES[key]
    if "." not in key:
        owners = index.get(key, [])
        if len(owners) != 1:
            hint = f"ambiguous, use one of {', '.join(owners)}" if owners else "no such field in any section"
            raise ConfigError(f"unknown config key '{key}' ({hint})")
        key = owners[0]
    return key


def _override_value(key: str, raw: str, text: bool) -> Any:
    """A typed value as YAML reads it (text keys keep the text); OpenCLIP's precision names as ours."""
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        problem = str(getattr(e, "problem", None) or type(e).__name__)
        raise ConfigError(f"config key '{key}': {raw!r} is not a valid value ({problem}); quote it") from None
    if text and value is not None and not isinstance(value, str):
        value = raw
    if key == "train.precision" and value in PRECISION_ALIASES:
        value = PRECISION_ALIASES[value]
    elif key == "train.precision" and value in ("pure_bf16", "pure_fp16"):
        raise ConfigError(
            f"config key 'train.precision': {value!r} (OpenCLIP: weights in half precision) is not "
            f"supported; amp_bf16 (bf16 autocast, fp32 weights) is 'bf16' here, amp is 'fp16'"
        )
    return value


def _put(out: dict, key: str, value: Any) -> None:
    """out[a][b] = value for key "a.b"."""
    node = out
    *parents, leaf = key.split(".")
    for depth, p in enumerate(parents):
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key '{key}': {'.'.join(parents[: depth + 1])} is a value, not a section")
    node[leaf] = value


# ----------------------------------------------------------------------------- value checks
def _check(cfg: Config) -> None:
    """Each section's own checks (its check()), then those across sections."""
    for section in (cfg.optim, cfg.data, cfg.train, cfg.model, cfg.eval, cfg.checkpoint, cfg.deepspeed):
        section.check()
    need = _rules(cfg, "")
    o, t, d, ds = cfg.optim, cfg.train, cfg.data, cfg.deepspeed
    m = cfg.model.ema_momentum
    need(not cfg.loss.distill_alpha or m is not None, "loss.distill_alpha", "needs model.ema_momentum (the "
         "momentum model whose softmax it mixes into the targets)")  # fmt: skip
    need(m is None or t.distributed == "ddp", "model.ema_momentum", "works with train.distributed ddp only")
    _check_loss(cfg.loss)
    _check_aug(d.aug, views=cfg.ssl.enabled)
    need(not (d.device_normalize and d.aug.re_prob), "data.device_normalize", "cannot be true with data.aug.re_prob: "
         "timm's random erasing works on normalised pixels, in the workers (set it null or false)")  # fmt: skip
    need(
        d.batch_size % o.accum_steps == 0,
        "optim.accum_steps",
        f"must divide data.batch_size ({d.batch_size}): each step's per-process batch is split into this many "
        f"equal micro-batches",
    )
    if t.distributed == "deepspeed":
        need(t.precision != "fp16", "train.precision", "fp16 (GradScaler) is not supported with train.distributed: "
             "deepspeed; use bf16 (autocast, fp32 master weights) or fp32")  # fmt: skip
        need(o.optimizer == "adamw", "optim.optimizer", "lamb's per-tensor trust ratio needs whole tensors; ZeRO "
             "shards flattened ones: use adamw (or ddp)")  # fmt: skip
        need(not (cfg.model.compile and ds.stage == 3), "model.compile", "torch.compile of the towers is not "
             "supported with ZeRO stage 3 (parameters gathered by hooks)")  # fmt: skip
    if cfg.ssl.enabled:
        from fastclip.train.ssl import check_ssl_config

        check_ssl_config(cfg)


def _check_loss(loss: LossConfig) -> None:
    """The loss section's values, by the loss library's own rules (fastclip/losses/options.py), so a bad one is
    refused before anything is built; an option the loss does not take is refused when it is built (make_loss)."""
    from fastclip.losses import LossOptionError, UnknownLossError, check_options, is_import_name, loss_entry

    try:
        entry = loss_entry(loss.name)
    except UnknownLossError as e:
        if is_import_name(loss.name):  # a loss of the user's own: the import said what is wrong
            raise ConfigError(f"config key 'loss.name': {e}") from None
        raise ConfigError(
            f"config key 'loss.name': {loss.name!r} is not one of {', '.join(LOSS_NAMES)}, nor module:attribute "
            "naming a loss of your own (a fastclip.losses.LossEntry)"
        ) from None
    _check_extra_options(loss, entry)
    extra = loss.extra_options or {}
    try:
        check_options(loss.name, **section_loss_options(loss))
    except LossOptionError as e:
        key = f"extra_options.{e.option}" if e.option in extra else e.option
        raise ConfigError(f"config key 'loss.{key}': {e.rule} (got {e.value!r})") from None
    except Exception as e:  # a value the options refuse; any error of a user's own options class, said as such
        raise loss_section_error(loss.name, e) from None


def loss_section_error(name: str, e: Exception) -> ConfigError:
    """The one line for an error that loss `name`'s options raised: its message, with its type where the message
    alone would not say what it is (an assert's). The library's own losses raise TypeError or ValueError for a
    value: any other error of theirs is a bug, re-raised whole."""
    if name in LOSS_NAMES and not isinstance(e, (TypeError, ValueError)):
        raise e
    words = str(e) if isinstance(e, (TypeError, ValueError)) and str(e) else f"{type(e).__name__}: {e}"
    return ConfigError(f"config section 'loss' (name {name}): {words}")


# the loss options the trainer gives (fastclip/train/net.py: loss_options), from where
TRAINER_LOSS_OPTIONS = {
    "data_size": "from the data",
    "lr_tau": "optim.lr_tau",
    "embed_dim": "the towers' embed_dim",
    "unimodal": "ssl.enabled",
}


def _check_extra_options(loss: LossConfig, entry) -> None:
    """loss.extra_options holds what a loss of the user's own takes beyond the loss.* keys, and only that."""
    if not loss.extra_options:
        return
    if loss.name in LOSS_NAMES:
        raise ConfigError(
            f"config key 'loss.extra_options': for a loss of your own (loss.name module:attribute); {loss.name}'s "
            "options are loss.* keys of their own: set those instead"
        )
    from fastclip.losses import config_option_names, option_names

    keys = {f.name for f in dataclasses.fields(LossConfig)}
    # what the trainer sets (whether this loss takes it or not), and this loss's own options no config sets
    library_only = set(TRAINER_LOSS_OPTIONS) | (option_names(loss.name) - config_option_names(loss.name))
    for key in loss.extra_options:
        if key in keys:
            raise ConfigError(f"config key 'loss.extra_options.{key}': loss.{key} is a key of its own: set it there")
        if key in library_only:
            raise ConfigError(
                f"config key 'loss.extra_options.{key}': "
                + (
                    f"the trainer sets it ({TRAINER_LOSS_OPTIONS[key]}); leave it out"
                    if key in TRAINER_LOSS_OPTIONS
                    else f"{entry.options.__name__} marks it LIBRARY_ONLY (not a config's); leave it out"
                )
            )


def section_loss_options(loss: LossConfig) -> dict:
    """The loss section as build_loss's options: every set key but the name, loss.extra_options' entries among
    them (a null is the library's default)."""
    options = {
        f.name: getattr(loss, f.name)
        for f in dataclasses.fields(loss)
        if f.name not in ("name", "extra_options") and getattr(loss, f.name) is not None
    }
    return {**options, **(loss.extra_options or {})}


def _check_aug(a: AugConfig, views: bool = False) -> None:
    """`views`: ssl mode's two views read data.aug (fastclip/data/views.py), not open_clip or timm."""

    def need(ok: bool, key: str, why: str):
        if not ok:
            raise ConfigError(f"config key 'data.aug.{key}': {why} (got {getattr(a, key)!r})")

    scale_ok = a.scale is None or (len(a.scale) == 2 and 0 < a.scale[0] <= a.scale[1] <= 1)
    need(scale_ok, "scale", "must be two numbers 0 < lo <= hi <= 1")
    need(a.ratio is None or (len(a.ratio) == 2 and 0 < a.ratio[0] <= a.ratio[1]), "ratio", "must be 0 < lo <= hi")
    need(a.color_jitter is None or len(a.color_jitter) == 4, "color_jitter", "must be 4 numbers (b, c, s, h)")
    need(a.color_jitter is None or min(a.color_jitter) >= 0, "color_jitter", "must be >= 0")
    need(a.color_jitter is None or a.color_jitter[3] <= 0.5, "color_jitter", "its hue (the 4th) must be <= 0.5")
    for key in ("color_jitter_prob", "gray_scale_prob", "re_prob"):
        need(getattr(a, key) is None or 0 <= getattr(a, key) <= 1, key, "must be a probability in [0, 1]")
    need(a.re_count is None or a.re_count >= 1, "re_count", "must be >= 1")
    if views:  # each key here a view's, or refused (a setting that would do nothing)
        for key in dataclasses.asdict(a):
            need(key in VIEW_AUG or not getattr(a, key), key, f"means nothing for ssl views ({', '.join(VIEW_AUG)})")
        return
    need(not a.color_jitter_prob or a.color_jitter is not None, "color_jitter_prob", "needs data.aug.color_jitter")
    if not a.use_timm:
        for key in TIMM_ONLY_AUG:  # open_clip would warn and drop them: a setting that does nothing
            need(getattr(a, key) is None, key, "is applied through timm only: set data.aug.use_timm true")
    else:
        import importlib.util

        need(importlib.util.find_spec("timm") is not None, "use_timm", "needs timm installed (pip install timm)")


def _get(node: Any, key: str) -> Any:
    """node.a.b for key "a.b"."""
    for part in key.split("."):
        node = getattr(node, part)
    return node


# ----------------------------------------------------------------------------- entry points
def config_from_dict(data: dict, source: str = "") -> Config:
    cfg = _build(Config, data, "", source)
    _check(cfg)
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML keeps the last one silently: a second
    `data:` section would drop the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (line {key_node.start_mark.line + 1})", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- overrides, then type and value checks."""
    data: dict = {}
    source = ""
    if path is not None:
        source = f" (in {path})"
        if Path(path).is_dir():
            raise ConfigError(f"--config {path}: is a directory; give a YAML file (e.g. configs/embedded.yaml)")
        try:
            with open(path) as f:
                data = yaml.load(f, Loader=_UniqueKeyLoader)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--config {path}: cannot read it ({e}); give a readable YAML file") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
        if data is None:  # silently training the built-in defaults would not be what was asked for
            raise ConfigError(
                f"config file {path} is empty: give the sections to set (see configs/embedded.yaml), "
                f"or leave --config out to train the built-in defaults"
            )
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a mapping of sections, got {type(data).__name__}")
        _build(Config, data, "", source)  # name unknown keys in the file before mixing in overrides
    left_out = None
    if overrides:
        parsed = parse_overrides(overrides)
        left_out = _leave_out_other_loss_options(data, parsed, path)
        data = _deep_update(data, parsed)
        followed = _held_out_follows_train(data, parsed)
        left_out = "\n".join(x for x in (left_out, followed) if x) or None
        source = " (command line)"  # the file's own keys were checked above: what is wrong now was typed
    cfg = config_from_dict(data, source)
    if left_out:  # once the config is good: a refused config is one line
        _config_note(left_out)
    return cfg


# set by the launch scripts for the run after their `train --check`, which has said the config's notes already
CONFIG_NOTES_SAID = "FASTCLIP_CONFIG_NOTES_SAID"


def _config_note(line: str) -> None:
    """A note on what the command line's config means (said by the check, not again by the run it precedes)."""
    if os.environ.get(CONFIG_NOTES_SAID) != "1":
        note(line)


def _held_out_follows_train(data: dict, overrides: dict) -> str | None:
    """Your own --data.train (OpenCLIP's --train-data) on the command line: the embedded demo's held-out data (the
    defaults, or a config file's copy of them) is not evaluated against it. Set to null (and said once) unless the
    command line sets them too."""
    given, section = overrides.get("data") or {}, data.get("data") or {}
    if "train" not in given or section.get("train") == DataConfig.train:
        return None
    demo = {"val": DataConfig.val, "zeroshot": DataConfig.zeroshot}
    dropped = [k for k, v in demo.items() if k not in given and section.get(k, v) == v]
    for key in dropped:
        data.setdefault("data", {})[key] = None
    if not dropped:
        return None
    keys = " and ".join(f"data.{k}" for k in dropped)
    return (
        f"fastclip train: note: data.train is your own data: {keys} (the embedded demo's held-out data) set to null; "
        f"set {'them' if len(dropped) > 1 else 'it'} to evaluate on held-out data of yours"
    )


def _leave_out_other_loss_options(data: dict, overrides: dict, path) -> str | None:
    """`--loss.name X` over a file written for another loss: the file's options for that loss which X does not
    take are left out; returns the note that says so (an option typed on the command line is still refused)."""
    from fastclip.losses import UnknownLossError, option_names

    new = overrides.get("loss", {}).get("name") if isinstance(overrides.get("loss"), dict) else None
    section = data.get("loss")
    if not isinstance(new, str) or not isinstance(section, dict):
        return None
    try:
        takes = option_names(new) | {"name", "validate"} | ({"extra_options"} if new not in LOSSES else set())
    except UnknownLossError:
        return None  # (a name that is no loss is refused by the check, naming the key)
    old = section.get("name", LossConfig.name)
    if old == new:
        return None
    typed = overrides["loss"]
    dropped = [k for k, v in section.items() if k not in takes and k not in typed and v not in (None, {})]
    for key in dropped:
        del section[key]
    refused = [k for k, v in typed.items() if k not in takes and v is not None]
    extra, typed_extra = section.get("extra_options"), typed.get("extra_options")
    if isinstance(extra, dict) and "extra_options" in takes:  # a loss of the user's own: its entries one by one
        typed_extra = typed_extra if isinstance(typed_extra, dict) else {}
        left_out = [k for k in extra if k not in takes and k not in typed_extra]
        for key in left_out:
            del extra[key]
        dropped += [f"extra_options.{k}" for k in left_out]
        refused += [k for k in typed_extra if k not in takes]
    if not dropped or refused:  # (a typed option X does not take is refused when the loss is built: one line)
        return None
    return (
        f"fastclip train: note: --loss.name {new}: {path} sets {', '.join('loss.' + k for k in dropped)} for "
        f"{old if 'name' in section else f'the default loss {old}'}, which {new} does not take: left out"
    )


def scheduled_evaluation(cfg: Config) -> bool:
    """Whether the run evaluates at all (by steps, by epochs or at the end)."""
    return bool(cfg.eval.every_steps or cfg.eval.every_epochs or cfg.eval.at_end)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


__all__ = [
    "Config",
    "DataConfig",
    "ModelConfig",
    "LossConfig",
    "OptimConfig",
    "TrainConfig",
    "EvalConfig",
    "CheckpointConfig",
    "DeepSpeedConfig",
    "ConfigError",
    "load_config",
    "config_from_dict",
    "parse_overrides",
    "dump_config",
    "LOSS_NAMES",
]
