"""Zero-shot classification: a classifier from class names x templates, and counts that all-reduce.

Accuracies are computed from integer counts (per class: samples, top-1 hits, top-k hits) summed over
ranks, so a K-process evaluation gives exactly the numbers of a 1-process one over the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastclip.eval.collectives import all_reduce_sum
from fastclip.eval.spec import ZeroShotSpec

TOP_K = 5


def encode_text(model, tokenizer, texts: list[str], device, batch_size: int = 256) -> torch.Tensor:
    """L2-normalised float32 text features `[len(texts), d]`."""
    out = []
    for start in range(0, len(texts), batch_size):
        tokens = tokenizer(texts[start : start + batch_size]).to(device)
        out.append(F.normalize(model.encode_text(tokens).float(), dim=-1))
    return torch.cat(out)


def zeroshot_classifier(model, tokenizer, classnames, templates, device, batch_size: int = 256) -> torch.Tensor:
    """`[d, C]`: per class, the mean of its normalised prompt embeddings, renormalised (CLIP's prompt ensemble)."""
    spec = ZeroShotSpec("", tuple(classnames), tuple(templates))
    prompts = [p for name in spec.classnames for p in spec.prompts(name)]
    features = encode_text(model, tokenizer, prompts, device, batch_size)
    per_class = features.view(len(spec.classnames), len(spec.templates), -1).mean(dim=1)
    return F.normalize(per_class, dim=-1).T.contiguous()


class ZeroShotCounts:
    """Per-class sample, top-1 and top-k counts, plus a count of labels outside the class list.

    With `pool` (per class, the indices of the prompted classes that count as it; ZeroShotSpec.pool) the logits
    are over the prompted classes: a sample is a top-k hit when one of its class's prompted classes is among the
    k highest (ObjectNet's convention: the predicted ImageNet class is one of its class's)."""

    def __init__(self, num_classes: int, device, pool: tuple[tuple[int, ...], ...] | None = None):
        self.num_classes = num_classes
        self.members = None
        if pool is not None:
            prompted = 1 + max(i for group in pool for i in group)
            self.members = torch.zeros(num_classes, prompted, dtype=torch.bool, device=device)
            for c, group in enumerate(pool):
                self.members[c, list(group)] = True
        self.k = min(TOP_K, num_classes if pool is None else self.members.shape[1])
        self.counts = torch.zeros(3, num_classes, dtype=torch.int64, device=device)  # total, top-1, top-k
        self.invalid = torch.zeros(1, dtype=torch.int64, device=device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        labels = labels.to(logits.device)
        valid = (labels >= 0) & (labels < self.num_classes)
        self.invalid += (~valid).sum()  # raised after the all-reduce, on every rank at once
        logits, labels = logits[valid], labels[valid]
        if self.members is None:
            topk = logits.topk(self.k, dim=1).indices
            hit1 = (topk[:, 0] == labels).long()
            hitk = (topk == labels[:, None]).any(dim=1).long()
        else:  # the rank of the best-scored prompted class of the sample's own class
            mine = self.members.to(logits.device)[labels]
            best = logits.masked_fill(~mine, float("-inf")).max(dim=1, keepdim=True).values
            rank = (logits > best).sum(dim=1)
            hit1, hitk = (rank == 0).long(), (rank < self.k).long()
        for row, values in enumerate((torch.ones_like(labels), hit1, hitk)):
            self.counts[row].index_add_(0, labels, values)

    def packed(self) -> torch.Tensor:
        return torch.cat([self.counts.flatten(), self.invalid])

    def unpack(self, packed: torch.Tensor) -> None:
        self.counts = packed[:-1].view(3, self.num_classes).clone()
        self.invalid = packed[-1:].clone()


@dataclass
class ZeroShotResult:
    name: str
    classnames: tuple[str, ...]
    num_samples: int
    top1: float
    top5: float  # top-min(5, C)
    mean_per_class_recall: float  # over classes that have samples (DataComp's metric for unbalanced sets)
    per_class: dict[str, float | None]  # top-1 accuracy per class; None where the class has no sample

    @classmethod
    def from_counts(cls, name: str, classnames, counts: torch.Tensor) -> ZeroShotResult:
        total, hit1, hitk = counts.tolist()
        n = sum(total)
        per_class = {c: (h / t if t else None) for c, h, t in zip(classnames, hit1, total)}
        present = [a for a in per_class.values() if a is not None]
        return cls(
            name=name,
            classnames=tuple(classnames),
            num_samples=n,
            top1=sum(hit1) / n if n else float("nan"),
            top5=sum(hitk) / n if n else float("nan"),
            mean_per_class_recall=sum(present) / len(present) if present else float("nan"),
            per_class=per_class,
        )


@torch.no_grad()
def evaluate_zeroshot(model, loader, classifier: torch.Tensor, device, group=None, classnames=None) -> dict:
    """Zero-shot accuracy of `model` on `(images, labels)` batches from `loader`, this rank's share of the data.

    Every rank of `group` must call this (each with its own slice); counts are all-reduced, so all ranks
    return the same dict: top1, top5, mean_per_class_recall, num_samples, per_class.
    """
    num_classes = classifier.shape[1]
    counts = ZeroShotCounts(num_classes, device)
    for images, labels in loader:
        features = F.normalize(model.encode_image(images.to(device)).float(), dim=-1)
        counts.update(features @ classifier, labels)
    counts.unpack(all_reduce_sum(counts.packed(), group))
    if int(counts.invalid) > 0:
        raise ValueError(f"{int(counts.invalid)} labels outside [0, {num_classes}) in the evaluation data")
    names = classnames or [str(c) for c in range(num_classes)]
    result = ZeroShotResult.from_counts("", names, counts.counts)
    return {
        "top1": result.top1,
        "top5": result.top5,
        "mean_per_class_recall": result.mean_per_class_recall,
        "num_samples": result.num_samples,
        "per_class": result.per_class,
    }


def mean_top1(values: dict, prefix: str = "zeroshot/") -> float | None:
    """The mean zero-shot top-1 over the data sets of an evaluation's record (its ``<prefix><name>/top1`` keys; the
    studies' zero-shot score); None when it has none."""
    tops = [v for k, v in values.items() if k.startswith(prefix) and k.endswith("/top1")]
    return sum(tops) / len(tops) if tops else None
