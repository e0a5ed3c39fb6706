"""Linear probe and kNN on frozen features (fastclip/eval/probe.py): kNN against a brute-force numpy reference,
the probe's accuracy on constructed features whose answer is known, and the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest

from fastclip.eval.probe import (
    KNN_TEMPERATURE,
    LabelledFeatures,
    ProbeDataError,
    check_probe_data,
    knn_predictions,
    knn_top1,
    linear_probe,
    run_probe,
    split_for_probe,
)


def _reference_knn(train: LabelledFeatures, queries: np.ndarray, k: int) -> np.ndarray:
    """Every query against every training feature in float64, one at a time."""
    keys = train.features / np.linalg.norm(train.features, axis=1, keepdims=True)
    predictions = []
    for query in queries.astype(np.float64):
        sims = keys.astype(np.float64) @ (query / np.linalg.norm(query))
        nearest = np.argsort(-sims)[:k]
        votes = np.bincount(
            train.labels[nearest], weights=np.exp(sims[nearest] / KNN_TEMPERATURE), minlength=train.labels.max() + 1
        )
        predictions.append(int(np.argmax(votes)))
    return np.array(predictions)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_knn_matches_a_brute_force_reference(seed):
    rng = np.random.default_rng(seed)
    train = LabelledFeatures(rng.standard_normal((90, 12)).astype(np.float32), rng.integers(0, 5, 90))
    queries = rng.standard_normal((37, 12)).astype(np.float32)
    ks = (1, 7, 20, 90)
    got = knn_predictions(train, queries, ks, chunk=8)  # chunks of 8 queries: the last one short
    for k in ks:
        want = _reference_knn(train, queries, k)
        np.testing.assert_array_equal(got[k], want, err_msg=f"k={k}")
    assert len(set(map(tuple, got.values()))) > 1  # the k matter: a test that a constant vote would fail
    labels = rng.integers(0, 5, 37)
    top1 = knn_top1(train, LabelledFeatures(queries, labels), ks)
    assert top1 == {k: float((_reference_knn(train, queries, k) == labels).mean()) for k in ks}


def _clusters(per_class: int, classes: int, dim: int, rng, spread: float = 0.05) -> LabelledFeatures:
    centres = np.eye(classes, dim, dtype=np.float32) * 3.0
    labels = np.repeat(np.arange(classes), per_class)
    features = centres[labels] + spread * rng.standard_normal((len(labels), dim)).astype(np.float32)
    return LabelledFeatures(features, labels)


def test_probe_and_knn_reach_the_known_accuracy_of_separable_features():
    """Four well-separated clusters: every test feature is classified as its cluster, so with 6 of the 40 test
    labels changed to another class the accuracy is exactly 34/40, for the probe and for kNN alike."""
    rng = np.random.default_rng(0)
    train, test = _clusters(50, 4, 16, rng), _clusters(10, 4, 16, rng)
    test.labels = test.labels.copy()
    test.labels[[0, 5, 12, 21, 30, 39]] = (test.labels[[0, 5, 12, 21, 30, 39]] + 1) % 4
    top1, c = linear_probe(train, test)
    assert top1 == pytest.approx(34 / 40) and c > 0
    assert knn_top1(train, test, (20, 200)) == {20: 34 / 40, 200: 34 / 40}
    result = run_probe("clusters", train, test, linear=True, ks=(20,), kind="pre-projection")
    assert (result.linear_top1, result.knn_top1, result.train_samples, result.test_samples) == (
        34 / 40,
        {20: 34 / 40},
        200,
        40,
    )


def test_probe_accuracy_is_at_chance_when_labels_carry_nothing():
    """Labels drawn independently of the features: the probe must not find structure that is not there."""
    rng = np.random.default_rng(3)
    train = LabelledFeatures(rng.standard_normal((400, 8)).astype(np.float32), rng.integers(0, 4, 400))
    test = LabelledFeatures(rng.standard_normal((400, 8)).astype(np.float32), rng.integers(0, 4, 400))
    top1, _ = linear_probe(train, test)
    assert 0.15 < top1 < 0.35


def test_the_probe_refuses_one_class_and_k_above_the_training_features():
    rng = np.random.default_rng(0)
    two = _clusters(3, 2, 4, rng)
    one = LabelledFeatures(two.features, np.zeros(6, dtype=np.int64))
    with pytest.raises(ProbeDataError, match=r"probe on 'digits': its 6 training features hold only class 0; a "):
        check_probe_data("digits", one, two, ())
    with pytest.raises(ProbeDataError, match=r"--knn 7 on 'digits': only 6 training features; pass k <= 6"):
        check_probe_data("digits", two, two, (2, 7))
    check_probe_data("digits", two, two, (6,))  # k equal to the training features: fine


def test_split_for_probe_holds_out_a_fifth_of_each_class():
    rng = np.random.default_rng(0)
    data = LabelledFeatures(rng.standard_normal((35, 3)).astype(np.float32), np.repeat([0, 1, 2], [10, 20, 5]))
    train, test = split_for_probe(data)
    assert np.bincount(test.labels).tolist() == [2, 4, 1] and np.bincount(train.labels).tolist() == [8, 16, 4]
    rows = {tuple(r) for r in np.concatenate([train.features, test.features]).tolist()}
    assert len(rows) == 35  # disjoint and complete


def test_the_probe_sweeps_past_the_small_c_that_give_every_sample_the_majority_class():
    """Ten tight clusters 0.25 apart: C up to 1e-4 predicts the majority class alone (13.7 % of the training
    features), 1e-2 and above separate them all. The sweep used to count that plateau's equal accuracies as
    worse and stop at 1e-4, choosing 1e-6: 13.3 % test top-1."""
    rng = np.random.default_rng(0)
    means = np.random.default_rng(1234).standard_normal((10, 16)).astype(np.float32) / 4

    def clusters(n):
        labels = rng.integers(0, 10, n)
        return LabelledFeatures(means[labels] + 0.025 * rng.standard_normal((n, 16)).astype(np.float32), labels)

    train, test = clusters(300), clusters(60)
    top1, c = linear_probe(train, test)
    assert top1 == 1.0 and c >= 1e-2
    # labels are any integers (negative, or hashed ids far apart): the same answer (np.bincount refused -1)
    shifted = [LabelledFeatures(d.features, d.labels * 1_000_003 - 5) for d in (train, test)]
    assert linear_probe(*shifted) == (top1, c)
