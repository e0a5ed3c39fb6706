"""Resuming the stream: exact at the same layout; at another, each sample served once and each bad one counted once
(from every old rank's state), or bounded repeats and no skips (from one old rank's state alone)."""

from __future__ import annotations

import collections
import functools
import io

import numpy as np
import pytest
import torch

from fastclip.data import state_for_new_world_size
from fastclip.data.manifest import Manifest, ShardInfo, write_manifest
from fastclip.data.sources.synthetic import synthetic_image, write_synthetic
from fastclip.data.tario import write_tar

from helpers import make_stream

UNEVEN = [37, 5, 60, 23, 41, 18, 50]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    write_synthetic(root / "clean", UNEVEN)
    # the same plus bad samples, so resuming must also keep the skip counts exact (no double counting)
    bad = root / "bad"
    write_synthetic(bad, UNEVEN)
    groups = []
    for i in range(234, 254):
        files = {"png": synthetic_image(i), "txt": f"extra {i}".encode(), "json": f'{{"index": {i}}}'.encode()}
        if i % 5 == 0:
            files["png"] = b"not a png"
        if i % 7 == 0:
            files["txt"] = b""
        groups.append((f"{i:09d}", files))
    write_tar(bad / "extra.tar", groups)
    manifest = Manifest(
        254, [ShardInfo(f"train-{k:06d}.tar", n) for k, n in enumerate(UNEVEN)] + [ShardInfo("extra.tar", 20, 234, 253)]
    )
    write_manifest(bad, manifest)
    return root


make = functools.partial(make_stream, shuffle_buffer=16)


def saved(state: dict) -> dict:
    """Through torch.save/torch.load(weights_only=True), as the trainer's checkpoint does."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert all(torch.equal(u, v) for u, v in zip(x, y))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_after", [5, 13])  # mid-window, and in the epoch's last batches
def test_resume_gives_the_uninterrupted_batches(model_fns, data, workers, stop_after):
    kw = dict(rank=1, world_size=2, workers=workers)
    full = make(model_fns, data / "bad", **kw)
    reference = [list(full.epoch(0)), list(full.epoch(1))]
    assert full.counters["undecodable_image"] > 0 and full.counters["missing_caption"] > 0

    first = make(model_fns, data / "bad", **kw)
    it = iter(first.epoch(0))
    head = [next(it) for _ in range(stop_after)]
    state = saved(first.state_dict())
    del it
    resumed = make(model_fns, data / "bad", **kw)
    resumed.load_state_dict(state)
    assert resumed.batches_remaining(0) == full.batches_per_epoch - stop_after
    tail = list(resumed.epoch(0))
    assert_same(head + tail, reference[0])
    assert_same(list(resumed.epoch(1)), reference[1])
    assert resumed.counters == full.counters  # skips counted once, wraps too
    assert resumed.samples_seen == full.samples_seen


def test_resume_at_epoch_end_starts_the_next_epoch(model_fns, data):
    a = make(model_fns, data / "clean", workers=1)
    list(a.epoch(0))
    b = make(model_fns, data / "clean", workers=1)
    b.load_state_dict(saved(a.state_dict()))
    assert list(b.epoch(0)) == [] and b.batches_remaining(1) == b.batches_per_epoch
    assert_same(list(b.epoch(1)), list(a.epoch(1)))


def test_state_from_other_data_seed_or_rank_is_refused(model_fns, data):
    a = make(model_fns, data / "clean", rank=0, world_size=2)
    next(iter(a.epoch(0)))
    state = a.state_dict()
    with pytest.raises(ValueError, match="seed"):
        make(model_fns, data / "clean", rank=0, world_size=2, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint"):
        make(model_fns, data / "bad", rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="rank 0 loaded into rank 1"):
        make(model_fns, data / "clean", rank=1, world_size=2).load_state_dict(state)
    fresh = make(model_fns, data / "clean")
    fresh.load_state_dict(None)  # no saved position: start fresh
    assert fresh.batches_remaining(0) == fresh.batches_per_epoch


@pytest.mark.parametrize("old,new", [((2, 2), (3, 1)), ((3, 1), (1, 2))])
def test_resume_at_another_world_size_skips_nothing_and_repeats_at_most_the_bound(model_fns, data, old, new):
    """The rule for one old rank's state alone: after b batches at the old layout, each old worker's fully consumed
    shuffle windows are done; the rest of the epoch is served at the new layout. Nothing is skipped; repeats are at most
    old_world * old_workers * (shuffle_buffer - 1) plus the wrap that fills the new last batches."""
    (w_old, k_old), (w_new, k_new) = old, new
    done_batches, buffer, batch = 9, 16, 8
    served, states = [], []
    for r in range(w_old):
        s = make(model_fns, data / "clean", r, w_old, workers=k_old)
        it = iter(s.epoch(0))
        served += [i for _ in range(done_batches) for i in next(it)[2].tolist()]
        states.append(saved(s.state_dict()))
        del it
    after, counts, wrapped = [], set(), 0
    for r in range(w_new):
        s = make(model_fns, data / "clean", r, w_new, workers=k_new)
        s.load_state_dict(states[min(r, w_old - 1)])  # any old rank's state gives the same plan
        remaining, wrapped_before = s.batches_remaining(0), s.counters["wrapped"]  # counters come with the state
        batches = list(s.epoch(0))
        assert len(batches) == remaining < s.batches_per_epoch
        counts.add(len(batches))
        after += [i for b in batches for i in b[2].tolist()]
        wrapped += s.counters["wrapped"] - wrapped_before
        # the next epoch is a normal one at the new layout
        assert_same(list(s.epoch(1)), list(make(model_fns, data / "clean", r, w_new, workers=k_new).epoch(1)))
    assert len(counts) == 1  # equal batch counts on the new ranks too
    assert set(served) | set(after) == set(range(234))  # nothing skipped
    twice = sum(n - 1 for n in collections.Counter(served + after).values())
    old_wrap = len(served) - len(set(served))
    bound = w_old * k_old * (buffer - 1) + (w_new * batch - 1) + old_wrap
    assert twice <= bound
    assert len(after) - len(set(after)) == wrapped  # inside the remainder, only counted wraps repeat


@pytest.mark.parametrize("w_new", [1, 3])
def test_skip_counters_and_samples_served_are_split_not_repeated_at_another_world_size(model_fns, data, w_new):
    """Each old rank's tallies go to exactly one new rank: the job-wide sums are those saved, not counted twice."""
    states = []
    for r in range(2):
        s = make(model_fns, data / "bad", r, 2)
        it = iter(s.epoch(0))
        for _ in range(12):  # the bad samples sit in the last shard: reach into it
            next(it)
        states.append(saved(s.state_dict()))
        del it
    old_skips = collections.Counter()
    for st in states:
        old_skips.update(st["counters"])
    assert sum(v for k, v in old_skips.items() if k != "wrapped") > 0  # the test needs some skips to split
    new = [make(model_fns, data / "bad", r, w_new) for r in range(w_new)]
    for r, s in enumerate(new):
        s.load_state_dict(state_for_new_world_size(states, r, w_new))
    new_skips = collections.Counter()
    for s in new:
        new_skips.update(s.counters)
    assert +new_skips == +old_skips
    assert sum(s.samples_seen for s in new) == sum(st["samples_seen"] for st in states) == 2 * 12 * 8
    # the position is the old one: the new ranks finish epoch 0 with the same, shorter, number of batches
    assert len({s.batches_remaining(0) for s in new}) == 1


def test_resume_with_fewer_samples_left_than_new_ranks(model_fns, data):
    # 29 of 30 batches at one rank with shuffle windows of 8: only 2 samples are left for 3 new ranks
    old = make(model_fns, data / "clean", shuffle_buffer=8)
    it = iter(old.epoch(0))
    served = [i for _ in range(29) for i in next(it)[2].tolist()]
    state = old.state_dict()
    del it
    after = []
    for r in range(3):
        s = make(model_fns, data / "clean", r, 3, shuffle_buffer=8)
        s.load_state_dict(state)
        batches = list(s.epoch(0))
        assert len(batches) == s.batches_remaining(0) + len(batches) == 1  # every rank still makes its batch
        after += [i for b in batches for i in b[2].tolist()]
    assert set(served) | set(after) == set(range(234)) and len(set(after)) == 2


def _epoch_part(model_fns, path, rank, world_size, workers, state=None, stop=None):
    """(indices served, the stream) for `stop` batches of epoch 0 (None: to its end), from `state`."""
    s = make(model_fns, path, rank, world_size, workers=workers)
    s.load_state_dict(state)
    it = iter(s.epoch(0))
    batches = list(it) if stop is None else [next(it) for _ in range(stop)]
    del it
    return [i for b in batches for i in b[2].tolist()], s


@pytest.mark.parametrize("old,new", [((2, 2), (3, 1)), ((3, 1), (1, 2)), ((2, 1), (2, 2))])
def test_resume_at_another_layout_serves_each_sample_once_and_counts_each_bad_one_once(model_fns, data, old, new):
    """With every old rank's state (state_for_new_world_size), the interrupted epoch is finished exactly: every good
    sample is served once, repeats are only the counted wraps, and each bad sample is counted once, wherever the
    stop falls (here: at every other batch of the epoch)."""
    (w_old, k_old), (w_new, k_new) = old, new
    path = data / "bad"
    whole, ref = _epoch_part(model_fns, path, 0, 1, 1)
    good = set(whole)
    skips = {k: v for k, v in ref.counters.items() if k != "wrapped"}
    assert skips["undecodable_image"] == 3 and skips["missing_caption"] == 3  # counted when served, when read
    n_batches = ref.batches_per_epoch // w_old
    miscounted_by_the_old_rule = 0
    for stop in range(1, n_batches, 2):
        served, states = [], []
        for r in range(w_old):
            part, s = _epoch_part(model_fns, path, r, w_old, k_old, stop=stop)
            served += part
            states.append(saved(s.state_dict()))
        after, counters = [], collections.Counter()
        for r in range(w_new):
            part, s = _epoch_part(model_fns, path, r, w_new, k_new, state=state_for_new_world_size(states, r, w_new))
            after += part
            counters.update(s.counters)
        assert set(served) | set(after) == good, stop
        assert len(served) + len(after) - len(good) == counters["wrapped"], stop  # every repeat is a counted wrap
        assert {k: counters[k] for k in skips} == skips, stop
        # the rule for states without the served samples (one old rank's state) re-reads partly served windows
        again = collections.Counter()
        for r in range(w_new):
            again.update(_epoch_part(model_fns, path, r, w_new, k_new, state=states[0])[1].counters)
        miscounted_by_the_old_rule += {k: again[k] for k in skips} != {k: v * w_old for k, v in skips.items()}
    assert miscounted_by_the_old_rule  # the stops reach partly read windows holding bad samples


def test_a_second_resume_at_another_layout_within_the_finished_epoch_is_exact_too(model_fns, data):
    """2 ranks x 2 workers -> 3 x 1 (stopped again inside the rest of the epoch) -> 1 x 2: the rest of the rest is
    what no rank served, and the positions read but unserved before the first resume stay quiet (their bad samples
    counted once)."""
    path = data / "bad"
    whole, ref = _epoch_part(model_fns, path, 0, 1, 1)
    skips = {k: v for k, v in ref.counters.items() if k != "wrapped"}
    for first_stop, second_stop in ((3, 1), (5, 2), (9, 1)):
        served, states = [], []
        for r in range(2):
            part, s = _epoch_part(model_fns, path, r, 2, 2, stop=first_stop)
            served += part
            states.append(saved(s.state_dict()))
        again = []
        for r in range(3):
            part, s = _epoch_part(
                model_fns, path, r, 3, 1, state=state_for_new_world_size(states, r, 3), stop=second_stop
            )
            served += part
            again.append(saved(s.state_dict()))
        part, s = _epoch_part(model_fns, path, 0, 1, 2, state=state_for_new_world_size(again, 0, 1))
        served += part
        where = (first_stop, second_stop)
        assert set(served) == set(whole), where
        assert len(served) - len(set(whole)) == s.counters["wrapped"], where
        assert {k: s.counters[k] for k in skips} == skips, where


def _shards(root, n: int, caption_of, index_of=lambda i: i):
    """One shard of n samples, sample i's caption caption_of(i) ("" is a bad sample) and index index_of(i)."""
    from fastclip.data.sources.synthetic import synthetic_image

    root.mkdir(parents=True, exist_ok=True)
    png = synthetic_image(0)
    groups = [
        (f"{i:09d}", {"png": png, "txt": caption_of(i).encode(), "json": f'{{"index": {index_of(i)}}}'.encode()})
        for i in range(n)
    ]
    write_tar(root / "a.tar", groups)
    write_manifest(root, Manifest(n, [ShardInfo("a.tar", n, 0, n - 1)]))
    return root


def test_a_resume_where_only_bad_samples_are_left_ends_the_epoch_not_the_run(model_fns, tmp_path):
    """24 samples, every 4th with an empty caption, 3 batches of 6 at one rank: every good sample is served and the
    window's rest is 2 bad ones. Resumed at 2 ranks the rest is nothing (the bad ones are known): the epoch ends.
    (The rest held the 2 bad samples, every new rank's share was all bad, and each stopped with DataExhausted, again
    at every restart: helper-58.)"""
    path = _shards(tmp_path / "d", 24, lambda i: "" if i % 4 == 0 else f"c {i}")
    old = make(model_fns, path, 0, 1, batch_size=6, shuffle_buffer=8)
    it = iter(old.epoch(0))
    served = [i for _ in range(3) for i in next(it)[2].tolist()]
    state = saved(old.state_dict())
    del it
    assert sorted(served) == [i for i in range(24) if i % 4]
    for r in range(2):
        s = make(model_fns, path, r, 2, batch_size=6, shuffle_buffer=8)
        s.load_state_dict(state_for_new_world_size([state], r, 2))
        assert s.batches_remaining(0) == 0 and list(s.epoch(0)) == []
        assert sum(s.counters.values()) == (6 if r == 0 else 0)  # the 6 bad ones, counted once, by old rank 0's heir


def test_unscanned_duplicate_indices_and_a_short_state_list_fall_back_not_fail(model_fns, tmp_path):
    """Sample 10 repeats sample 2's index (data not scanned): a resume at the same layout, then at another, is not
    refused by a consistency check (it raised a ValueError traceback); fewer saved states than old ranks take the
    batch-count rule (an IndexError)."""
    path = _shards(tmp_path / "d", 24, lambda i: f"c {i}", lambda i: 2 if i == 10 else i)
    first = make(model_fns, path, 0, 1, batch_size=4, shuffle_buffer=8)
    it = iter(first.epoch(0))
    served = [i for _ in range(3) for i in next(it)[2].tolist()]
    del it
    again = make(model_fns, path, 0, 1, batch_size=4, shuffle_buffer=8)
    again.load_state_dict(saved(first.state_dict()))
    it = iter(again.epoch(0))
    served += next(it)[2].tolist()
    state = saved(again.state_dict())
    del it
    for r in range(2):
        s = make(model_fns, path, r, 2, batch_size=4, shuffle_buffer=8)
        s.load_state_dict(state_for_new_world_size([state], r, 2))
        served += [i for b in s.epoch(0) for i in b[2].tolist()]
    assert set(served) == set(range(24)) - {10}  # index 10 is nowhere: sample 10 carries index 2
    states = []
    for r in range(2):
        s = make(model_fns, path, r, 2, batch_size=4, shuffle_buffer=8)
        it = iter(s.epoch(0))
        next(it)
        states.append(saved(s.state_dict()))
        del it
    s = make(model_fns, path, 0, 3, batch_size=4, shuffle_buffer=8)
    s.load_state_dict(state_for_new_world_size(states[:1], 0, 3))  # one of the two old ranks' states
    assert s.batches_remaining(0) > 0


def test_a_long_segment_is_saved_as_a_tensor_and_loads_with_weights_only():
    """After an exact resume the rest of an epoch has up to ~window/2 intervals per old worker (384k for 8 ranks of
    6 workers with 32,000-sample windows): saved as an int64 tensor, not a list of lists (13.8 MB, 5 s to load)."""
    from fastclip.data.plan import Segment
    from fastclip.data.stream import _intervals_state, _segment_of

    lo = np.arange(0, 4_000_000, 10, dtype=np.int64)
    segment = Segment(np.stack([lo, lo + 3], axis=1))
    state = _intervals_state(segment)
    assert torch.is_tensor(state) and state.dtype == torch.int64 and tuple(state.shape) == (400_000, 2)
    back = _segment_of(saved({"segment": state})["segment"])
    assert back == segment and back.length == 1_200_000
    assert back.to_epoch(1_199_999) == (3_999_992, 1) and back.find(15) == (False, 5)
    assert _intervals_state(Segment(((0, 5), (7, 9)))) == [[0, 5], [7, 9]]  # a short one stays readable
