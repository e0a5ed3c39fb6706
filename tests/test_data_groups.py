"""Multi-positive groups in the shard format: json "group" travels with its sample through the stream (also from a
worker process and across a resume), a bad one is skipped and counted like any bad sample (at run time and by
scan), and writers and scan record `groups: true` in the manifest, which the catalog hands to the trainer."""

from __future__ import annotations

import json

import pytest
import torch

from fastclip.data import ManifestError, ShardWriter, resolve_catalog
from fastclip.data.manifest import Manifest, ShardInfo, read_manifest, write_manifest
from fastclip.data.sources.scan import scan_shards
from fastclip.data.sources.synthetic import synthetic_caption, synthetic_image
from fastclip.data.tario import write_tar

from helpers import make_stream

N = 14
# samples 0-8: three images with 3 captions each (the group is the first one's index); 9-13: no "group"
GROUPS = {i: i - i % 3 for i in range(9)} | {i: i for i in range(9, N)}
BAD = {3: "x", 6: -1, 9: True, 12: 1.5}  # sample index -> a json "group" that is not an integer >= 0


def write_grouped(folder) -> None:
    writer = ShardWriter(folder, shard_size=5)
    for i in range(N):
        writer.write(i, synthetic_image(i), "png", synthetic_caption(i), group=GROUPS[i] if i < 9 else None)
    writer.close(N)


def served(stream, epoch: int = 0) -> dict[int, int]:
    """index -> group of every sample the epoch served (each batch's rows checked to line up)."""
    out = {}
    for _, texts, indices, groups in stream.epoch(epoch):
        assert groups.dtype == torch.int64 and groups.shape == indices.shape == (texts.shape[0],)
        out.update(zip(indices.tolist(), groups.tolist()))
    return out


@pytest.mark.parametrize("workers", [0, 1])
def test_each_sample_arrives_with_its_group(model_fns, tmp_path, workers):
    write_grouped(tmp_path)
    assert read_manifest(tmp_path).groups and json.loads((tmp_path / "manifest.json").read_text())["groups"] is True
    stream = make_stream(model_fns, tmp_path, batch_size=4, workers=workers, shuffle_buffer=8)
    assert stream.grouped
    assert served(stream) == GROUPS  # every sample, with its own json group (or its index)
    assert sum(stream.counters.values()) == 2  # 14 samples in 4 batches of 4: 2 served twice, none skipped
    assert stream.counters["wrapped"] == 2


def test_a_resumed_stream_serves_the_same_groups(model_fns, tmp_path):
    write_grouped(tmp_path)
    reference = list(make_stream(model_fns, tmp_path, batch_size=4, shuffle_buffer=8).epoch(0))
    first = make_stream(model_fns, tmp_path, batch_size=4, shuffle_buffer=8)
    head = [next(iter(first.epoch(0)))]
    resumed = make_stream(model_fns, tmp_path, batch_size=4, shuffle_buffer=8)
    resumed.load_state_dict(first.state_dict())
    for a, b in zip(reference, head + list(resumed.epoch(0)), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_without_groups_the_manifest_says_nothing_and_groups_are_the_indices(model_fns, tmp_path):
    writer = ShardWriter(tmp_path, shard_size=8)
    for i in range(8):  # a group equal to the sample's own index is no group: the manifest stays as it was
        writer.write(i, synthetic_image(i), "png", synthetic_caption(i), group=i if i % 2 else None)
    writer.close(8)
    assert "groups" not in json.loads((tmp_path / "manifest.json").read_text())
    stream = make_stream(model_fns, tmp_path, batch_size=4)
    assert not stream.grouped and served(stream) == {i: i for i in range(8)}


def bad_folder(folder) -> None:
    """One tar of N samples whose BAD ones carry a json group that is not an integer >= 0."""
    samples = []
    for i in range(N):
        meta = {"index": i, "key": f"{i:09d}", "caption": synthetic_caption(i), "group": BAD.get(i, GROUPS[i])}
        samples.append((f"{i:09d}", {"png": synthetic_image(i), "json": json.dumps(meta).encode()}))
    write_tar(folder / "a.tar", samples)


def test_a_bad_group_is_skipped_and_counted_naming_shard_and_key(model_fns, tmp_path):
    plain, scanned = tmp_path / "plain", tmp_path / "scanned"
    for folder in (plain, scanned):
        folder.mkdir()
        bad_folder(folder)
    write_manifest(plain, Manifest(N, [ShardInfo("a.tar", N, 0, N - 1)], groups=True))  # checked at run time
    result = scan_shards(str(scanned), workers=1)  # listed by scan: the stream skips them by position
    problems = [(p["key"], p["ordinal"], p["reason"]) for p in result.problems]
    assert problems == [(f"{i:09d}", i, "bad_group") for i in sorted(BAD)]
    assert "json 'group' is \"x\", not an integer >= 0" in result.problems[0]["detail"]
    assert result.manifest.groups and result.usable == N - len(BAD)
    for folder in (plain, scanned):
        stream = make_stream(model_fns, folder, batch_size=4, shuffle_buffer=16)
        got = served(stream)
        assert got == {i: g for i, g in GROUPS.items() if i not in BAD}, folder.name
        skipped = {reason: n for reason, n in stream.counters.items() if n and reason != "wrapped"}
        assert skipped == {"bad_group": len(BAD)}, folder.name
        events = {(e["shard"], e["key"], e["reason"]) for e in stream.recent_skips}
        assert events == {("a.tar", f"{i:09d}", "bad_group") for i in BAD}, folder.name
        details = {e["key"]: e["detail"] for e in stream.recent_skips}  # the sample's index named too
        assert details["000000006"].startswith("index 6: json 'group' is -1, not an integer >= 0"), folder.name


def test_writer_manifest_and_catalog_checks(tmp_path):
    writer = ShardWriter(tmp_path / "w", shard_size=4)
    for bad in ("1", -2, False, 2.0):
        with pytest.raises(ValueError, match=f"sample 0: group {bad!r} is not an integer >= 0"):
            writer.write(0, synthetic_image(0), "png", "a caption", group=bad)
    write_grouped(tmp_path / "grouped")
    writer = ShardWriter(tmp_path / "plain", shard_size=4)
    for i in range(100, 104):
        writer.write(i, synthetic_image(i), "png", synthetic_caption(i))
    writer.close(104)
    # a source that has groups turns them on for the joined data
    assert resolve_catalog(f"{tmp_path / 'grouped'}::{tmp_path / 'plain'}").grouped
    assert not resolve_catalog(str(tmp_path / "plain")).grouped
    data = json.loads((tmp_path / "grouped" / "manifest.json").read_text()) | {"groups": "yes"}
    with pytest.raises(ManifestError, match="field 'groups' is 'yes', expected true or false"):
        Manifest.from_json(data, "m.json")


@pytest.mark.parametrize("offset", [0, 100])
def test_a_json_group_moves_with_the_index_offset_of_its_data_set(offset):
    """A group id is in its data set's index space (the group's first index), so `scan --index-offset` shifts it as
    it shifts the index; a sample without a group is its own (offset) index."""
    from fastclip.data.samples import check_sample
    from fastclip.data.tario import RawSample

    def raw(meta: dict) -> RawSample:
        files = {"png": synthetic_image(0), "txt": b"a caption", "json": json.dumps(meta).encode()}
        return RawSample("k", 0, files, tuple(files))

    grouped, _, _ = check_sample(raw({"index": 4, "group": 3}), 200, index_offset=offset)
    alone, _, _ = check_sample(raw({"index": 5}), 200, index_offset=offset)
    assert (grouped.index, grouped.group) == (4 + offset, 3 + offset)
    assert (alone.index, alone.group) == (5 + offset, 5 + offset)
