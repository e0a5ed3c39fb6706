"""Bad data is skipped, logged with shard and key, counted (also from worker processes), and training goes on."""
from __future__ import annotations

import json
import logging

import pytest

from fastclip.data import DataSpecError, build_train_stream, iter_labelled_samples
from fastclip.data.manifest import Manifest, ShardInfo, read_manifest, write_manifest
from fastclip.data.sources.scan import scan_shards
from fastclip.data.tario import ShardReader, TarBroken
from fastclip.data.testing import synthetic_image, truncate_file, write_tar

DATA_SIZE = 40
# key -> (reason) of the broken samples in a.tar; the rest of a.tar, b.tar (truncated) and c.tar are fine
BROKEN = {"000000002": "undecodable_image", "000000004": "missing_caption", "000000006": "missing_index",
          "000000008": "index_out_of_range", "000000010": "duplicate_index", "000000011": "missing_image"}


def sample(i: int, **override) -> dict:
    meta = {"index": i, "key": f"{i:09d}", "caption": f"caption {i}", "label": i % 10, "dataset": "synthetic"}
    files = {"png": synthetic_image(i), "txt": f"caption {i}".encode()}
    for name, value in override.items():
        if name in ("png", "txt"):
            files[name] = value
        else:
            meta[name] = value
    files["json"] = json.dumps({k: v for k, v in meta.items() if v is not None}).encode()
    if files.get("png") is None:
        del files["png"]
    return files


def write_bad_folder(folder) -> int:
    """a.tar: 12 samples (6 broken), b.tar: 15 good samples truncated, c.tar: 13 good; returns b's readable count."""
    a = [sample(i) for i in range(12)]
    a[2]["png"] = b"\x89PNG\r\n\x1a\n but not really"
    a[4] = sample(4, txt=b"", caption=None)
    a[6] = sample(6, index=None, key=None)
    a[8] = sample(8, index=500)
    a[10] = sample(10, index=3)  # same index as key 000000003
    a[11] = sample(11, png=None)
    write_tar(folder / "a.tar", [(f"{i:09d}", f) for i, f in enumerate(a)])
    write_tar(folder / "b.tar", [(f"{i:09d}", sample(i)) for i in range(12, 27)])
    write_tar(folder / "c.tar", [(f"{i:09d}", sample(i)) for i in range(27, 40)])
    truncate_file(folder / "b.tar", int((folder / "b.tar").stat().st_size * 0.6))
    readable = 0
    try:
        with ShardReader(folder / "b.tar") as reader:
            while reader.next_group() is not None:
                readable += 1
    except TarBroken:
        pass
    assert 0 < readable < 15
    return readable


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Two copies: one with a plain manifest (every check happens at run time), one scanned."""
    root = tmp_path_factory.mktemp("bad")
    plain, scanned = root / "plain", root / "scanned"
    plain.mkdir()
    scanned.mkdir()
    readable = write_bad_folder(plain)
    write_bad_folder(scanned)
    write_manifest(plain, Manifest(DATA_SIZE, [ShardInfo("a.tar", 12, 0, 11), ShardInfo("b.tar", 15, 12, 26),
                                               ShardInfo("c.tar", 13, 27, 39)]))
    scan_shards(str(scanned), data_size=DATA_SIZE)
    valid = {0, 1, 3, 5, 7, 9} | set(range(12, 12 + readable)) | set(range(27, 40))
    return plain, scanned, readable, valid


def run_epoch(model_fns, path, workers):
    stream = build_train_stream({"train_data": str(path), "batch_size": 8, "workers": workers, "shuffle_buffer": 16},
                                preprocess=model_fns[0], tokenizer=model_fns[1])
    batches = list(stream.epoch(0))
    return stream, batches, [i for _, _, idx in batches for i in idx.tolist()]


def check_events_match_counts(stream):
    events = list(stream.recent_skips)
    for reason, n in stream.counters.items():
        if reason != "wrapped":
            assert n == sum(e["samples"] for e in events if e["reason"] == reason), reason
    return {(e["reason"], e["shard"], e["key"]) for e in events}


def test_every_kind_of_bad_sample_is_skipped_logged_and_counted(model_fns, bad, caplog):
    plain, _, readable, valid = bad
    with caplog.at_level(logging.WARNING, logger="fastclip.data.stream"):
        stream, batches, served = run_epoch(model_fns, plain, workers=0)
    assert len(batches) == stream.batches_per_epoch == 5  # training goes on: the full epoch
    assert set(served) == valid  # no bad sample served, every good one served
    seen = check_events_match_counts(stream)
    expected = {(reason, "a.tar", key) for key, reason in BROKEN.items()}
    expected.add(("truncated_tar", "b.tar", f"{11 + readable:09d}"))  # the last key read before the break
    assert seen == expected
    for reason in set(BROKEN.values()) | {"truncated_tar"}:
        assert stream.counters[reason] >= 1
    lost_per_pass = 15 - readable
    assert stream.counters["truncated_tar"] % lost_per_pass == 0  # lost samples, once per pass over b.tar
    logged = caplog.text
    assert "shard a.tar key 000000002: undecodable_image" in logged
    assert "shard b.tar" in logged and "truncated_tar" in logged


@pytest.mark.parametrize("workers", [0, 2])
def test_scanned_problems_are_skipped_and_counts_come_back_from_workers(model_fns, bad, workers):
    _, scanned, readable, valid = bad
    manifest = read_manifest(scanned)
    assert [s.num_samples for s in manifest.shards] == [12, readable, 13]  # scan counts what is readable
    listed = {(p["reason"], p["shard"], p["key"]) for p in manifest.problems}
    assert listed == {(r, "a.tar", k) for k, r in BROKEN.items() if r != "undecodable_image"} | {
        ("truncated_tar", "b.tar", None)}
    stream, batches, served = run_epoch(model_fns, scanned, workers)
    assert len(batches) == stream.batches_per_epoch and set(served) == valid
    seen = check_events_match_counts(stream)
    assert seen == {(r, "a.tar", k) for k, r in BROKEN.items()}  # undecodable found at run time, rest listed
    assert sum(v for k, v in stream.counters.items() if k != "wrapped") >= len(BROKEN)


def test_shard_unreadable_at_run_time_is_counted(model_fns, bad, tmp_path):
    folder = tmp_path / "gone"
    folder.mkdir()
    write_bad_folder(folder)
    write_manifest(folder, Manifest(DATA_SIZE, [ShardInfo("c.tar", 13, 27, 39), ShardInfo("a.tar", 12, 0, 11)]))
    stream = build_train_stream({"train_data": str(folder), "batch_size": 4, "workers": 0, "shuffle_buffer": 8},
                                preprocess=model_fns[0], tokenizer=model_fns[1])
    (folder / "c.tar").write_bytes(b"garbage, not a tar")  # replaced after the checks at start
    batches = list(stream.epoch(0))
    assert len(batches) == stream.batches_per_epoch
    assert stream.counters["unreadable_shard"] >= 13
    assert ("unreadable_shard", "c.tar", None) in check_events_match_counts(stream)


def test_missing_shard_file_is_an_error_before_training(model_fns, bad, tmp_path):
    folder = tmp_path / "missing"
    folder.mkdir()
    write_bad_folder(folder)
    write_manifest(folder, Manifest(DATA_SIZE, [ShardInfo("c.tar", 13, 27, 39), ShardInfo("d.tar", 3, 0, 2)]))
    with pytest.raises(DataSpecError, match="d.tar"):
        build_train_stream({"train_data": str(folder), "batch_size": 4}, preprocess=model_fns[0],
                           tokenizer=model_fns[1])


def test_labelled_reader_skips_and_counts_too(bad):
    plain, _, readable, valid = bad
    counters = {}
    got = [s for r in range(2) for s in iter_labelled_samples(plain, r, 2, counters=counters)]
    assert sorted(s.index for s in got) == sorted(valid)
    assert counters["truncated_tar"] == 15 - readable
    assert {k: v for k, v in counters.items() if k != "truncated_tar"} == {r: 1 for r in BROKEN.values()}
