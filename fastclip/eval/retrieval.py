"""Image-text retrieval recall@k in both directions: one caption per image (pairs share a row index), or several
(rows of one group are captions of one image: the COCO/Flickr protocol)."""

from __future__ import annotations

import torch

DEFAULT_KS = (1, 5, 10)
DIRECTIONS = ("image_to_text", "text_to_image")


def recall_name(direction: str, k: int) -> str:
    """The key of R@k in one direction: image_to_text_R@1, ... (an evaluation's record prefixes retrieval/)."""
    return f"{direction}_R@{k}"


def mean_r1(values: dict, prefix: str = "retrieval/") -> float | None:
    """The mean R@1 of both directions (the studies' retrieval score) from an evaluation's record (prefix "": from
    retrieval_metrics' values); None when a direction is missing."""
    keys = [prefix + recall_name(direction, 1) for direction in DIRECTIONS]
    return sum(values[k] for k in keys) / 2 if all(k in values for k in keys) else None


def _ranks_of_positives(
    queries: torch.Tensor, keys: torch.Tensor, chunk: int, positive_of: torch.Tensor | None = None
) -> torch.Tensor:
    """1-based rank of keys[i] (keys[positive_of[i]] when given) among all keys for queries[i]. Ties count against
    the pair: any other key scoring at least as high ranks before it. So the result does not depend on the order
    the rows arrive in (ranks gathered from several processes come in rank order), and a collapsed model whose
    embeddings are all equal scores 0, not a perfect 1."""
    ranks = []
    for start in range(0, queries.shape[0], chunk):
        scores = queries[start : start + chunk] @ keys.T  # chunked: never the full N x N matrix at once
        rows = torch.arange(scores.shape[0], device=scores.device)
        positive = scores[rows, rows + start if positive_of is None else positive_of[start : start + chunk]]
        rank = (scores >= positive[:, None]).sum(dim=1)  # counts the positive itself: the +1
        ranks.append(torch.where(positive.isnan(), keys.shape[0], rank))  # NaN features: last, not first
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.int64, device=queries.device)


def images_of_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each group [G], each row's group number [N]), groups numbered in the order of their first
    rows: with no group shared that is the identity, so the image keys are the rows themselves."""
    n = groups.shape[0]
    _, inverse = torch.unique(groups, return_inverse=True)
    rows = torch.arange(n, device=groups.device)
    first = torch.full((int(inverse.max()) + 1 if n else 0,), n, dtype=torch.int64, device=groups.device)
    first.scatter_reduce_(0, inverse, rows, "amin")
    order = torch.argsort(first)
    renumber = torch.empty_like(order)
    renumber[order] = torch.arange(order.shape[0], device=groups.device)
    return first[order], renumber[inverse]


def _ranks_of_any_caption(images: torch.Tensor, texts: torch.Tensor, image_of: torch.Tensor, chunk: int):
    """1-based rank, for image g, of its best-scoring caption (rows with image_of == g) among all captions; the
    other captions of g do not count against it, any other caption scoring at least as high does."""
    ranks = []
    for start in range(0, images.shape[0], chunk):
        scores = images[start : start + chunk] @ texts.T
        own = image_of[None, :] == torch.arange(start, start + scores.shape[0], device=scores.device)[:, None]
        best = scores.masked_fill(~own, float("-inf")).amax(dim=1)
        rank = ((scores >= best[:, None]) & ~own).sum(dim=1) + 1
        ranks.append(torch.where(best.isnan(), texts.shape[0], rank))
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.int64, device=images.device)


def retrieval_metrics(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    ks=DEFAULT_KS,
    chunk: int = 1024,
    groups: torch.Tensor | None = None,
) -> dict[str, float]:
    """R@k for image->text and text->image; features are L2-normalised `[N, d]` with row i of each a pair.

    groups (`[N]` ids; None: every row its own): rows of one group are captions of one image. The images are
    counted once (the group's first row's); text->image is over all N captions (a hit: its group's image in the
    top k), image->text over the images (a hit: any of its captions in the top k). Without a shared group the
    numbers are those of groups=None exactly."""
    if image_features.shape != text_features.shape or image_features.ndim != 2:
        raise ValueError(
            f"retrieval needs paired [N, d] features, got images {tuple(image_features.shape)} "
            f"and texts {tuple(text_features.shape)}"
        )
    n = image_features.shape[0]
    if n == 0:
        return {}
    image_features, text_features = image_features.float(), text_features.float()
    if groups is None:
        ranks = {
            "image_to_text": _ranks_of_positives(image_features, text_features, chunk),
            "text_to_image": _ranks_of_positives(text_features, image_features, chunk),
        }
    else:
        first, image_of = images_of_groups(groups.to(image_features.device))
        images = image_features[first]
        ranks = {
            "image_to_text": _ranks_of_any_caption(images, text_features, image_of, chunk),
            "text_to_image": _ranks_of_positives(text_features, images, chunk, image_of),
        }
    counts = [r.shape[0] for r in ranks.values() for _ in ks]
    hits = torch.stack([(r <= k).sum() for r in ranks.values() for k in ks]).tolist()  # one device sync
    names = [recall_name(direction, k) for direction in ranks for k in ks]
    return {name: h / count for name, h, count in zip(names, hits, counts)}
