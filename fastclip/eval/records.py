"""The records `fastclip eval` appends to results.jsonl, as its writer and its readers (`fastclip summary`) name
them: the tasks, the retrieval keys, and when retrieval counts as a result."""

from __future__ import annotations

from fastclip.eval.retrieval import DEFAULT_KS, DIRECTIONS, recall_name

ZEROSHOT = "zeroshot_classification"
RETRIEVAL = "retrieval"
LINEAR_PROBE = "linear_probe"
KNN = "knn"
# tasks whose record holds one dataset's top-1 (and, for kNN, its k)
PER_DATASET = (ZEROSHOT, LINEAR_PROBE, KNN)

RETRIEVAL_KEYS = tuple(recall_name(direction, k) for direction in DIRECTIONS for k in DEFAULT_KS)

# below this share of distinct captions, image->text recall is near 0 by construction (a templated caption ties
# with every image of its class), so retrieval is not reported as a result
MIN_DISTINCT_CAPTIONS = 0.9


def retrieval_reported(distinct_captions: int, samples: int) -> bool:
    """Whether retrieval over `samples` captions, `distinct_captions` of them distinct, is a result to show."""
    return distinct_captions >= MIN_DISTINCT_CAPTIONS * samples
