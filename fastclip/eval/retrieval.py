"""Image-text retrieval recall@k in both directions, for one caption per image (pairs share a row index)."""

from __future__ import annotations

import torch

DEFAULT_KS = (1, 5, 10)


def _ranks_of_positives(queries: torch.Tensor, keys: torch.Tensor, chunk: int) -> torch.Tensor:
    """1-based rank of keys[i] among all keys for queries[i]. Ties count against the pair: any other key
    scoring at least as high ranks before it. So the result does not depend on the order the rows arrive in
    (ranks gathered from several processes come in rank order), and a collapsed model whose embeddings are
    all equal scores 0, not a perfect 1."""
    ranks = []
    for start in range(0, queries.shape[0], chunk):
        scores = queries[start : start + chunk] @ keys.T  # chunked: never the full N x N matrix at once
        rows = torch.arange(scores.shape[0], device=scores.device)
        positive = scores[rows, rows + start]
        rank = (scores >= positive[:, None]).sum(dim=1)  # counts the positive itself: the +1
        ranks.append(torch.where(positive.isnan(), keys.shape[0], rank))  # NaN features: last, not first
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.int64, device=queries.device)


def retrieval_metrics(
    image_features: torch.Tensor, text_features: torch.Tensor, ks=DEFAULT_KS, chunk: int = 1024
) -> dict[str, float]:
    """R@k for image->text and text->image; features are L2-normalised `[N, d]` with row i of each a pair."""
    if image_features.shape != text_features.shape or image_features.ndim != 2:
        raise ValueError(
            f"retrieval needs paired [N, d] features, got images {tuple(image_features.shape)} "
            f"and texts {tuple(text_features.shape)}"
        )
    n = image_features.shape[0]
    if n == 0:
        return {}
    image_features, text_features = image_features.float(), text_features.float()
    ranks = {
        "image_to_text": _ranks_of_positives(image_features, text_features, chunk),
        "text_to_image": _ranks_of_positives(text_features, image_features, chunk),
    }
    hits = torch.stack([(r <= k).sum() for r in ranks.values() for k in ks]).tolist()  # one device sync
    names = [f"{direction}_R@{k}" for direction in ranks for k in ks]
    return {name: h / n for name, h in zip(names, hits)}
