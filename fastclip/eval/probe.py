"""Linear probe and weighted kNN on frozen image features: how well the image tower alone separates the classes.

Features: the image tower's output before its projection to the joint embedding where the tower has one as a
plain matrix (open_clip's ViT: `visual.proj`, the CLIP paper's convention for its ViT probes), else its output
embedding (ResNet attention pooling, timm towers); a tower trained alone (ssl) is probed on its whole output, as
its kNN and export see it; `feature_kind` says which, and the results record it.

- Linear probe (Radford et al. 2021): multinomial logistic regression (scikit-learn, L-BFGS) on standardised
  features; the L2 strength is chosen on a seeded 80/20 split of the training features over a log-spaced grid of
  C = 1/λ, then the probe is refitted on all of them with the best C.
- Weighted kNN (Wu et al. 2018; DINO, Caron et al. 2021): cosine similarity of L2-normalised features, each of the
  k nearest training features votes for its class with weight exp(sim / 0.07).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fastclip.eval.samples import EvalDataError

KNN_TEMPERATURE = 0.07  # InstDisc / DINO
PROBE_C_GRID = tuple(float(c) for c in np.logspace(-6, 4, 11))  # C = 1/λ, log-spaced (the CLIP paper: 1e-6..1e6)
SWEEP_PATIENCE = 2  # the sweep stops after this many C values in a row not above the best one
PLATEAU_PATIENCE = 5  # ... or this many while the best is the majority class's share (the smallest C's plateau)
PROBE_HOLDOUT = 0.2  # share of the training features that chooses C
DEFAULT_KS = (20, 200)


class ProbeDataError(EvalDataError):
    """Features a probe cannot be fitted or scored on (one class, k above the training features); names the
    dataset and says what to pass instead."""


@dataclass
class LabelledFeatures:
    features: np.ndarray  # [n, d] float32
    labels: np.ndarray  # [n] int64

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class ProbeResult:
    """One dataset's probe numbers: linear-probe top-1 (None when not asked for) and kNN top-1 per k."""

    train_samples: int
    test_samples: int
    linear_top1: float | None = None
    linear_c: float | None = None  # the C = 1/λ the held-out split chose
    knn_top1: dict[int, float] | None = None
    feature_kind: str = "embedding"
    seconds: float = 0.0


# ----------------------------------------------------------------------------- features
def feature_kind(model) -> str:
    """'tower' for a tower trained alone (fastclip/models/ssl.py: there is no joint embedding to stop short of),
    'pre-projection' where the image tower's output is `pooled @ visual.proj` (split cheaply), else 'embedding'."""
    if getattr(model, "image_only", False):
        return "tower"
    visual = getattr(model, "visual", None)
    proj = getattr(visual, "proj", None)
    if isinstance(proj, torch.nn.Parameter) and not getattr(visual, "output_tokens", False):
        return "pre-projection"
    return "embedding"


def encode_image_with_features(model, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the image embedding encode_image gives, the probe's features), from one forward of the tower."""
    kind = feature_kind(model)
    if kind == "tower":
        features = model.visual(images)
        return model.head(features), features
    if kind == "embedding":
        embedding = model.encode_image(images)
        return embedding, embedding
    visual = model.visual
    proj = visual.proj
    visual.proj = None  # the tower then returns the pooled features (open_clip's own prune_head does this)
    try:
        pooled = visual(images)
    finally:
        visual.proj = proj
    return pooled @ proj, pooled


# ----------------------------------------------------------------------------- checks
def check_probe_data(name: str, train: LabelledFeatures, test: LabelledFeatures, ks: tuple[int, ...]) -> None:
    """The one-line refusals, before any fitting: each names the dataset and what to do."""
    if len(test) == 0:
        raise ProbeDataError(f"probe on {name!r}: no labelled test features; pass --data with labelled samples")
    classes = np.unique(train.labels)
    if len(classes) < 2:
        held = f"only class {int(classes[0])}" if len(classes) else "no labelled sample"
        raise ProbeDataError(
            f"probe on {name!r}: its {len(train)} training features hold {held}; a classifier needs 2 or more "
            "classes (pass --probe-train with labelled data of several classes)"
        )
    too_large = [k for k in ks if k > len(train)]
    if too_large:
        raise ProbeDataError(
            f"--knn {too_large[0]} on {name!r}: only {len(train)} training features; pass k <= {len(train)} "
            "or more training data (--probe-train, --probe-max-train)"
        )


# ----------------------------------------------------------------------------- linear probe
def linear_probe(train: LabelledFeatures, test: LabelledFeatures, *, seed: int = 0, grid=PROBE_C_GRID):
    """(top-1 on `test`, the chosen C): logistic regression with C chosen on a held-out split of `train`."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(train.features)
    x, x_test = scaler.transform(train.features), scaler.transform(test.features)
    _, counts = np.unique(train.labels, return_counts=True)
    # per class where every class can give one to each side; else a plain random split (a few samples per class)
    splittable = counts.min() >= 2 and round(PROBE_HOLDOUT * len(train)) >= len(counts)
    stratify = train.labels if splittable else None
    fit_x, val_x, fit_y, val_y = train_test_split(
        x, train.labels, test_size=PROBE_HOLDOUT, random_state=seed, stratify=stratify
    )
    best_c, best_acc, worse = grid[0], -1.0, 0
    if len(np.unique(fit_y)) >= 2:
        # ascending C, each fit starting from the last one's weights (the small C fit in a few iterations), and
        # stopped after SWEEP_PATIENCE values in a row that do not beat the best: the large C, slow to fit, only
        # overfit more. While the best is the majority class's share it waits PLATEAU_PATIENCE values: the smallest
        # C give every sample the most frequent class (the weights vanish beside the intercepts), a plateau that
        # stopped the sweep below the C that separate the classes (13 % where 1e-2 gives 100 %)
        majority = np.unique(val_y, return_counts=True)[1].max() / len(val_y)  # (labels may be any integers)
        model = LogisticRegression(max_iter=1000, warm_start=True, random_state=seed)
        for c in grid:
            model.set_params(C=c)
            model.fit(fit_x, fit_y)
            acc = float((model.predict(val_x) == val_y).mean())
            if acc > best_acc:  # ties keep the smaller C (the stronger regularisation)
                best_c, best_acc, worse = c, acc, 0
            elif (worse := worse + 1) >= (SWEEP_PATIENCE if best_acc > majority else PLATEAU_PATIENCE):
                break  # (features no C lifts above the majority share stop too, before the slow large C)
    final = LogisticRegression(C=best_c, max_iter=1000, random_state=seed).fit(x, train.labels)
    return float((final.predict(x_test) == test.labels).mean()), best_c


# ----------------------------------------------------------------------------- kNN
def knn_predictions(
    train: LabelledFeatures,
    queries: np.ndarray,
    ks: tuple[int, ...],
    *,
    temperature: float = KNN_TEMPERATURE,
    chunk: int = 1024,
) -> dict[int, np.ndarray]:
    """The class each query gets by temperature-weighted kNN voting, per k (cosine similarity; the top max(ks)
    found once; a tie of votes goes to the lower class)."""
    keys = F.normalize(torch.from_numpy(train.features).float(), dim=-1)
    queries = F.normalize(torch.from_numpy(queries).float(), dim=-1)
    train_labels = torch.from_numpy(train.labels)
    num_classes = int(train.labels.max()) + 1
    predicted = {k: [] for k in ks}
    for start in range(0, len(queries), chunk):
        sims, idx = (queries[start : start + chunk] @ keys.T).topk(max(ks), dim=1)  # sorted, most similar first
        weights, votes_for = (sims / temperature).exp(), train_labels[idx]
        for k in ks:
            votes = torch.zeros(len(idx), num_classes).scatter_add_(1, votes_for[:, :k], weights[:, :k])
            predicted[k].append(votes.argmax(dim=1))
    return {k: torch.cat(p).numpy() if p else np.zeros(0, np.int64) for k, p in predicted.items()}


def knn_top1(train: LabelledFeatures, test: LabelledFeatures, ks: tuple[int, ...], **kwargs) -> dict[int, float]:
    predicted = knn_predictions(train, test.features, ks, **kwargs)
    return {k: float((p == test.labels).mean()) for k, p in predicted.items()}


# ----------------------------------------------------------------------------- both
def run_probe(
    name: str,
    train: LabelledFeatures,
    test: LabelledFeatures,
    *,
    linear: bool,
    ks: tuple[int, ...],
    kind: str = "embedding",
    seed: int = 0,
) -> ProbeResult:
    check_probe_data(name, train, test, ks if ks else ())
    started = time.perf_counter()
    result = ProbeResult(len(train), len(test), feature_kind=kind)
    if linear:
        result.linear_top1, result.linear_c = linear_probe(train, test, seed=seed)
    if ks:
        result.knn_top1 = knn_top1(train, test, ks)
    result.seconds = time.perf_counter() - started
    return result


def split_for_probe(data: LabelledFeatures, *, test_share: float = 0.2, seed: int = 0):
    """(train, test): a seeded split of each class of `data`, for a folder without a training split of its own."""
    rng = np.random.default_rng(seed)
    test_rows = []
    for label in np.unique(data.labels):
        rows = np.flatnonzero(data.labels == label)
        take = int(round(test_share * len(rows))) if len(rows) > 1 else 0
        test_rows.extend(rng.permutation(rows)[:take])
    is_test = np.zeros(len(data), dtype=bool)
    is_test[np.asarray(test_rows, dtype=np.int64)] = True
    return (
        LabelledFeatures(data.features[~is_test], data.labels[~is_test]),
        LabelledFeatures(data.features[is_test], data.labels[is_test]),
    )
