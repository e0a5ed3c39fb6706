"""Self-supervised training on images alone (config section ``ssl``): SimCLR's recipe on the trainer's machinery.

* data: any training shards (the embedded images, an image-only WebDataset: a caption is not needed and not
  read); each sample becomes two augmented views (fastclip/data/views.py: data.aug's crop, jitter and grayscale,
  SimCLR's where unset), seeded per batch as every transform, so a resumed run sees the same views;
* network: the architecture's image tower plus a projector MLP (fastclip/models/ssl.py); the text tower is
  not built into the run. Its two encoders are the same function, so the trainer, DDP/DeepSpeed, accumulation,
  checkpoints, resume and resharding run unchanged with view 1 as "image" and view 2 as "text";
* loss: the loss section's loss in its unimodal form (option ``unimodal``: ntxent = SimCLR, fastclip-v1 = SogCLR,
  fastclip-v2 = iSogCLR, dcl, v0, v3, tempnet), per-image state keyed by the data index;
* evaluation: weighted kNN (DINO's vote) on data.val's labels with the tower's features (the projector dropped),
  leave-one-out over the held-out images; eval.linear_probe and eval.knn as in CLIP mode, on the same features
  (`fastclip eval RUN --linear-probe --knn K` too); zero-shot and retrieval need captions, refused at config time;
* export (`fastclip export`, fastclip/eval/export_ssl.py): the image tower alone, as open_clip's ``model.visual`` state
  dict.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from fastclip.train.config import Config, ConfigError


def check_ssl_config(cfg: Config) -> None:
    """The options that need captions, refused in one line each (ConfigError: exit 2)."""
    s = cfg.ssl

    def need(ok: bool, key: str, why: str):
        if not ok:
            raise ConfigError(f"config key '{key}': {why}")

    image_only = "ssl.enabled trains on images alone (no text tower, no captions)"
    need(
        cfg.data.zeroshot is None,
        "data.zeroshot",
        f"zero-shot classification needs a text tower and prompts; {image_only}: set data.zeroshot null "
        "(data.val is scored by kNN)",
    )
    need(
        cfg.eval.imagenet_val is None,
        "eval.imagenet_val",
        f"ImageNet is scored zero-shot, which needs a text tower; {image_only}: set it null",
    )
    need(
        not hf_text_tower(cfg.model.arch),
        "model.arch",
        f"{cfg.model.arch} has a Hugging Face text tower; {image_only}: use an architecture without one "
        "(its image tower is what trains)",
    )
    need(cfg.model.ema_momentum is None, "model.ema_momentum", f"feeds a queue or distillation, which {image_only} "
         "does not implement: set it null")  # fmt: skip
    need(not cfg.model.lock_text, "model.lock_text", f"locks a text tower; {image_only}: drop it")
    need(not cfg.model.lock_image, "model.lock_image", f"would leave only the projector to train; {image_only}, and "
         "its image tower is what ssl.enabled trains: drop it")  # fmt: skip
    need(s.projector_hidden >= 1, "ssl.projector_hidden", "must be >= 1")
    need(s.projector_dim >= 1, "ssl.projector_dim", "must be >= 1")
    for key in ("flip_p", "blur_p"):
        need(0 <= getattr(s, key) <= 1, f"ssl.{key}", "must be a probability in [0, 1]")
    need(s.knn_k >= 1, "ssl.knn_k", "must be >= 1")
    need(s.knn_temperature > 0, "ssl.knn_temperature", "must be > 0")


def hf_text_tower(arch: str) -> bool:
    """Whether the architecture's config (a repo config or a .json) names a Hugging Face text tower; read from the
    file, without building anything (open_clip's built-in names have none)."""
    from fastclip.models import HF_FOLDER_KEYS, REPO_MODEL_CONFIGS

    path = Path(arch) if arch.endswith(".json") else REPO_MODEL_CONFIGS / f"{arch}.json"
    try:
        text = json.loads(path.read_text()).get("text_cfg", {})
    except (OSError, ValueError, AttributeError):
        return False  # a built-in name, or a file check_arch reports
    return any(text.get(key) for key in HF_FOLDER_KEYS)


def ssl_built(built, cfg: Config):
    """The BuiltModel of an ssl run: the image tower + projector as the model, two views as the training
    preprocessing, no tokenizer; the evaluation preprocessing stays the tower's."""
    from fastclip.data.views import TwoViews
    from fastclip.models.ssl import ImageTowerWithProjector

    s, visual = cfg.ssl, built.model.visual
    model = ImageTowerWithProjector(visual, built.config["embed_dim"], s.projector_hidden, s.projector_dim)
    size = visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    views = TwoViews(int(size), visual.image_mean, visual.image_std, view_augment(cfg))
    return dataclasses.replace(built, model=model, preprocess_train=views, tokenizer=None)


def view_augment(cfg: Config):
    """The views' augmentation: data.aug's keys that have a meaning for a view (the others are refused at config
    time), SimCLR's value where unset; flip and blur, which data.aug lacks, from ssl."""
    from fastclip.data.views import Augment
    from fastclip.train.config import VIEW_AUG

    given = {key: getattr(cfg.data.aug, key) for key in VIEW_AUG}
    given = {key: tuple(v) if isinstance(v, list) else v for key, v in given.items() if v is not None}
    return Augment(**given, flip_p=cfg.ssl.flip_p, blur_p=cfg.ssl.blur_p)


# ----------------------------------------------------------------------------- kNN evaluation
@torch.no_grad()
def knn_accuracy(features: torch.Tensor, labels: torch.Tensor, k: int, temperature: float) -> float:
    """Leave-one-out weighted kNN top-1 (Wu et al. 2018, DINO): each image's k most similar other images
    (cosine) vote exp(sim/T) for their labels."""
    n = features.shape[0]
    sim = features @ features.T
    sim.fill_diagonal_(-float("inf"))
    k = min(k, n - 1)
    top, idx = sim.topk(k, dim=1)
    votes = torch.zeros(n, int(labels.max()) + 1, dtype=features.dtype, device=features.device)
    votes.scatter_add_(1, labels[idx], torch.exp(top / temperature))
    return float((votes.argmax(dim=1) == labels).double().mean())


@torch.no_grad()
def knn_evaluate(model, preprocess, source: str, device, cfg: Config) -> dict[str, float]:
    """The tower's L2-normalised features of data.val (each rank its slice, then gathered) scored by
    leave-one-out kNN over the classes (dataset, label); samples without a label are left out."""
    from fastclip.eval.collectives import all_gather_rows, rank_and_world
    from fastclip.eval.evaluate import unwrap_model
    from fastclip.eval.samples import Skipped, iter_samples

    visual = unwrap_model(model).visual
    was_training = visual.training
    visual.eval()
    rank, world = rank_and_world()
    feats, labels, batch, skipped = [], [], [], Skipped()  # (samples lost, a cut shard's counted by its manifest)
    limit = cfg.eval.max_samples

    def flush():
        if batch:
            images = torch.stack([preprocess(s.image) for s in batch]).to(device)
            feats.append(F.normalize(visual(images).float(), dim=-1))
            # a class is (dataset, label): the embedded glyphs' Fashion-MNIST 0 is no MNIST 0
            labels.extend(zlib.crc32((s.dataset or "").encode()) * 1_000_003 + s.label for s in batch)
            batch.clear()

    for i, sample in enumerate(iter_samples(source, rank, world, skipped)):
        if limit is not None and i * world + rank >= limit:
            break
        if sample.label is not None:
            batch.append(sample)
        if len(batch) == cfg.eval.batch_size:
            flush()
    flush()
    visual.train(was_training)
    dim = unwrap_model(model).projector[0].in_features
    local = torch.cat(feats) if feats else torch.zeros(0, dim, device=device)
    features = all_gather_rows(local)
    keys = all_gather_rows(torch.tensor(labels, dtype=torch.int64, device=device))
    # undecodable samples, counted over the ranks as the CLIP evaluation counts them
    lost = all_gather_rows(torch.tensor([[skipped.samples, skipped.cut_shards]], dtype=torch.int64, device=device))
    counts = {"knn_samples": int(features.shape[0]), "skipped_samples": int(lost[:, 0].sum())}
    if int(lost[:, 1].sum()):
        counts["cut_shards"] = int(lost[:, 1].sum())
    if features.shape[0] < 2:
        return counts
    classes = torch.unique(keys, return_inverse=True)[1]  # the same numbering on every rank (the same keys)
    return {"knn_top1": knn_accuracy(features, classes, cfg.ssl.knn_k, cfg.ssl.knn_temperature), **counts}


@torch.no_grad()
def probe_evaluate(model, preprocess, probe, device, cfg: Config) -> dict[str, float]:
    """eval.linear_probe / eval.knn (a TrainingProbe) on the tower's output: data.val's labelled images against the
    probe's training data, under CLIP mode's metric names (fastclip/eval/training_probe.py)."""
    from fastclip.eval.evaluate import evaluate

    test = evaluate(
        model,
        tokenizer=None,
        preprocess=preprocess,
        source=cfg.data.val,
        specs={},
        device=device,
        batch_size=cfg.eval.batch_size,
        max_samples=cfg.eval.max_samples,
        retrieval=False,
        collect_features=probe.unnamed,
    ).features
    return probe.scores(model, preprocess, test, device, None, cfg.eval.batch_size)
