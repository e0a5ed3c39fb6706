"""Bad data is skipped, logged with shard and key, counted (also from worker processes), and training goes on."""

from __future__ import annotations

import json
import logging
import tarfile
from collections import Counter

import pytest
import torch

from fastclip.data import DataSpecError, build_train_stream
from fastclip.data.format import split_member_name
from fastclip.data.manifest import Manifest, ShardInfo, read_manifest, write_manifest
from fastclip.data.samples import SHARD_REASONS, DataExhausted
from fastclip.data.sources.scan import scan_shards
from fastclip.data.sources.synthetic import synthetic_image, write_synthetic
from fastclip.data.tario import ShardReader, TarBroken, write_tar
from fastclip.eval.samples import iter_samples

from helpers import truncate_file

DATA_SIZE = 40
# key -> (reason) of the broken samples in a.tar; the rest of a.tar, b.tar (truncated) and c.tar are fine
BROKEN = {
    "000000002": "undecodable_image",
    "000000004": "missing_caption",
    "000000006": "missing_index",
    "000000008": "index_out_of_range",
    "000000010": "duplicate_index",
    "000000011": "missing_image",
}


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
    write_manifest(
        plain,
        Manifest(
            DATA_SIZE, [ShardInfo("a.tar", 12, 0, 11), ShardInfo("b.tar", 15, 12, 26), ShardInfo("c.tar", 13, 27, 39)]
        ),
    )
    scan_shards(str(scanned), data_size=DATA_SIZE)
    valid = {0, 1, 3, 5, 7, 9} | set(range(12, 12 + readable)) | set(range(27, 40))
    return plain, scanned, readable, valid


def run_epoch(model_fns, path, workers):
    stream = build_train_stream(
        {"train": str(path), "batch_size": 8, "workers": workers, "shuffle_buffer": 16},
        preprocess=model_fns[0],
        tokenizer=model_fns[1],
    )
    batches = list(stream.epoch(0))
    return stream, batches, [i for _, _, idx, _ in batches for i in idx.tolist()]


def check_events_match_counts(stream):
    events = list(stream.recent_skips)
    for reason, n in stream.counters.items():
        if reason in SHARD_REASONS:  # one event per broken shard and epoch; the count has every lost sample
            assert (n > 0) == any(e["reason"] == reason for e in events), reason
        elif reason != "wrapped":
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
    assert stream.counters["truncated_tar"] == 15 - readable  # each lost sample once, however often re-read
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
        ("truncated_tar", "b.tar", None)
    }
    stream, batches, served = run_epoch(model_fns, scanned, workers)
    assert len(batches) == stream.batches_per_epoch and set(served) == valid
    seen = check_events_match_counts(stream)
    assert seen == {(r, "a.tar", k) for k, r in BROKEN.items()}  # undecodable found at run time, rest listed
    assert sum(v for k, v in stream.counters.items() if k != "wrapped") >= len(BROKEN)
    # b.tar's lost tail is counted by no run: the catalog carries scan's finding for the start's note
    assert stream.catalog.scan_broken == (("b.tar", "truncated_tar"),)


def test_a_run_on_shards_scan_found_broken_says_so_at_the_start(model_fns, bad, tmp_path, capsys):
    """The samples scan could not read are in no epoch and no data_skipped counter: the start says how many shards
    and which first; a pattern that leaves the broken shard out says nothing."""
    from fastclip.data.catalog import resolve_catalog
    from fastclip.train.cli import main as train_main

    from helpers import overrides

    _, scanned, _, _ = bad
    assert resolve_catalog(str(scanned / "{a,c}.tar")).scan_broken == ()
    assert resolve_catalog(str(scanned / "b.tar")).scan_broken == (("b.tar", "truncated_tar"),)
    argv = overrides(scanned.parent, tmp_path / "run", "dcl", **{"data.train": scanned, "data.val": "null"})
    argv += ["--data.zeroshot", "null", "--model.arch", "tiny-vit", "--train.max_steps", "1", "--data.batch_size", "8"]
    assert train_main(argv) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "found 1 broken shard" in line]
    assert notes == [
        "fastclip train: note: data.train: `fastclip data scan` found 1 broken shard (truncated_tar 1; the first "
        "b.tar): the samples it could not read are in no epoch and in no data_skipped counter (its manifest's "
        "problems list them)"
    ]


def test_shard_unreadable_at_run_time_is_counted(model_fns, bad, tmp_path):
    folder = tmp_path / "gone"
    folder.mkdir()
    write_bad_folder(folder)
    (folder / "b.tar").unlink()  # (a folder's manifest lists every shard in it)
    write_manifest(folder, Manifest(DATA_SIZE, [ShardInfo("c.tar", 13, 27, 39), ShardInfo("a.tar", 12, 0, 11)]))
    stream = build_train_stream(
        {"train": str(folder), "batch_size": 4, "workers": 0, "shuffle_buffer": 8},
        preprocess=model_fns[0],
        tokenizer=model_fns[1],
    )
    (folder / "c.tar").write_bytes(b"garbage, not a tar")  # replaced after the checks at start
    batches = list(stream.epoch(0))
    assert len(batches) == stream.batches_per_epoch
    assert stream.counters["unreadable_shard"] == 13
    assert ("unreadable_shard", "c.tar", None) in check_events_match_counts(stream)


def test_missing_shard_file_is_an_error_before_training(model_fns, bad, tmp_path):
    folder = tmp_path / "missing"
    folder.mkdir()
    write_bad_folder(folder)
    write_manifest(folder, Manifest(DATA_SIZE, [ShardInfo("c.tar", 13, 27, 39), ShardInfo("d.tar", 3, 0, 2)]))
    with pytest.raises(DataSpecError, match="d.tar"):
        build_train_stream({"train": str(folder), "batch_size": 4}, preprocess=model_fns[0], tokenizer=model_fns[1])


def test_eval_reader_skips_and_counts_too(bad):
    """Eval keeps what it can score (no index or caption is fine for zero-shot, index checks are training's);
    an image that does not decode, a sample without one and the rest of a broken tar are skipped and listed."""
    plain, _, readable, _ = bad
    skipped = []
    got = [s for r in range(2) for s in iter_samples(plain, r, 2, skipped)]
    unscorable = {2, 11}  # undecodable_image, missing_image
    assert sorted(int(s.source.rsplit(":", 1)[1]) for s in got) == sorted(
        set(range(12)) - unscorable | set(range(12, 12 + readable)) | set(range(27, 40))
    )
    assert len(skipped) == 3 and sum("unreadable tar shard" in m and "b.tar" in m for m in skipped) == 1
    assert any("000000002.png: cannot decode" in m for m in skipped)
    assert any("000000011: no image" in m for m in skipped)
    by_key = {s.source.rsplit(":", 1)[1]: s for s in got}
    assert by_key["000000004"].caption is None and by_key["000000006"].index is None


# ----------------------------------------------------------------------------- exact skip counts
def _cheap_image(img):  # the stream decodes every image itself; a constant tensor keeps these tests fast
    return torch.zeros(1)


def _cheap_tokens(captions):
    return torch.zeros(len(captions), 2, dtype=torch.long)


SHARD, N_SHARDS = 64, 10  # 640 samples; 2 ranks x 320 positions, smaller than the default shuffle window (1000)


def _rewrite(path, edit):
    """Rewrite a tar shard with edit(key, files) -> files applied to every sample, keeping the order."""
    groups = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            key, ext = split_member_name(member.name)
            groups.setdefault(key, {})[ext] = tar.extractfile(member).read()
    write_tar(path, [(k, edit(k, f)) for k, f in groups.items()])


def _no_caption(key, files):
    meta = json.loads(files["json"])
    meta.pop("caption", None)
    return {**{e: b for e, b in files.items() if e != "txt"}, "json": json.dumps(meta).encode()}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """Ten shards of 64: shard 3 is empty (0 bytes), shard 5 truncated, shard 7 has 3 samples without caption.
    Returns (folder, {reason: samples lost per epoch}, number of good samples)."""
    root = tmp_path_factory.mktemp("faulty")
    write_synthetic(root, [SHARD] * N_SHARDS)
    shards = sorted(root.glob("*.tar"))
    shards[3].write_bytes(b"")
    truncate_file(shards[5], int(shards[5].stat().st_size * 0.5))
    readable = 0
    try:
        with ShardReader(shards[5]) as reader:
            while reader.next_group() is not None:
                readable += 1
    except TarBroken:
        pass
    broken = sorted({split_member_name(m)[0] for m in tarfile.open(shards[7]).getnames()})[:3]
    _rewrite(shards[7], lambda k, f: _no_caption(k, f) if k in broken else f)
    lost = {"unreadable_shard": SHARD, "truncated_tar": SHARD - readable, "missing_caption": 3}
    return root, lost, SHARD * N_SHARDS - sum(lost.values())


def _epochs(root, world, workers, epochs=1, shuffle_buffer=1000, batch=16):
    """Every rank's stream after `epochs` epochs and the indices each rank served per epoch."""
    streams, served = [], []
    for rank in range(world):
        stream = build_train_stream(
            {"train": str(root), "batch_size": batch, "workers": workers, "shuffle_buffer": shuffle_buffer},
            rank=rank,
            world_size=world,
            preprocess=_cheap_image,
            tokenizer=_cheap_tokens,
        )
        served.append([[i for _, _, idx, _ in stream.epoch(e) for i in idx.tolist()] for e in range(epochs)])
        streams.append(stream)
    return streams, served


@pytest.mark.parametrize("world,workers,shuffle_buffer", [(2, 0, 1000), (2, 2, 1000), (1, 0, 1000), (2, 2, 48)])
def test_each_lost_sample_is_counted_once_per_epoch_summed_over_ranks(faulty, world, workers, shuffle_buffer):
    # before the fix: a refill window larger than a rank's range wrapped over it and re-counted the same
    # positions (truncated 32 -> 96, empty shard 64 -> 192, 3 missing captions -> 6 at these sizes)
    root, lost, good = faulty
    streams, served = _epochs(root, world, workers, epochs=2, shuffle_buffer=shuffle_buffer)
    total = {reason: sum(s.counters[reason] for s in streams) for reason in lost}
    assert total == {reason: 2 * n for reason, n in lost.items()}  # two epochs, each sample once per epoch
    others = {k: v for s in streams for k, v in s.counters.items() if k not in lost and k != "wrapped" and v}
    assert others == {}
    per_rank_batches = streams[0].batches_per_epoch
    for epochs in served:
        for indices in epochs:
            assert len(indices) == per_rank_batches * 16
            # a repeat only fills a batch that lost samples (or rounding) left short: never three times
            assert max(Counter(indices).values()) <= 2
    # the ranks together serve every good sample each epoch; repeats are exactly what fills the batches
    for e in range(2):
        union = set().union(*(set(s[e]) for s in served))
        assert len(union) == good
        repeats = sum(len(s[e]) - len(set(s[e])) for s in served)
        assert repeats == world * per_rank_batches * 16 - good
        assert repeats == sum(st.counters["wrapped"] for st in streams) // 2


def test_each_bad_sample_and_shard_is_logged_once_per_epoch(faulty, caplog):
    root, lost, _ = faulty
    with caplog.at_level(logging.WARNING, logger="fastclip.data.stream"):
        streams, _ = _epochs(root, 2, 2, epochs=1)
    lines = [r.getMessage() for r in caplog.records]
    assert len([x for x in lines if "unreadable_shard" in x]) == 1
    assert len([x for x in lines if "truncated_tar" in x]) == 1
    assert len([x for x in lines if "missing_caption" in x]) == 3
    assert len(lines) == 5
    assert any(
        "train-000005.tar" in x and f"{SHARD - lost['truncated_tar']} of {SHARD} samples readable" in x for x in lines
    )


def test_a_rank_whose_every_shard_is_bad_stops_with_one_line(tmp_path):
    write_synthetic(tmp_path, [SHARD] * 4)
    shards = sorted(tmp_path.glob("*.tar"))
    stream = build_train_stream(
        {"train": str(tmp_path), "batch_size": 16, "workers": 0},
        rank=1,
        world_size=2,
        preprocess=_cheap_image,
        tokenizer=_cheap_tokens,
    )
    seq = stream._sequence(0)
    mine = [shards[int(s)] for s in seq.slots[2:]]  # rank 1's range: the second half of the epoch order
    mine[0].write_bytes(b"")
    _rewrite(mine[1], _no_caption)
    for workers in (0, 2):
        stream = build_train_stream(
            {"train": str(tmp_path), "batch_size": 16, "workers": workers},
            rank=1,
            world_size=2,
            preprocess=_cheap_image,
            tokenizer=_cheap_tokens,
        )
        with pytest.raises(DataExhausted) as info:
            next(iter(stream.epoch(0)))
        message = str(info.value)
        assert "\n" not in message and message.startswith("rank 1: no usable sample")
        assert f"{mine[0].name} (unreadable_shard: 0 of {SHARD} samples readable: cannot open as tar" in message
        assert f"{mine[1].name} (missing_caption)" in message  # a sample's problem: its reason, no detail
        assert message.endswith(
            "Replace or remove the local shards (`fastclip data scan` lists what is wrong in each), then restart "
            "with --train.resume latest"
        )
    # rank 0's shards are fine: it trains (and its collective then fails when rank 1 exits)
    stream = build_train_stream(
        {"train": str(tmp_path), "batch_size": 16, "workers": 0},
        rank=0,
        world_size=2,
        preprocess=_cheap_image,
        tokenizer=_cheap_tokens,
    )
    assert len(list(stream.epoch(0))) == stream.batches_per_epoch


def test_an_undecodable_image_is_said_without_a_memory_address():
    """PIL names an unknown format by the buffer's repr (`<_io.BytesIO object at 0x7f...>`), so the skip records
    of metrics.jsonl differed from run to run; the error keeps its type and says "the image bytes"."""
    from PIL import UnidentifiedImageError

    from fastclip.data.samples import decode_image

    with pytest.raises(UnidentifiedImageError) as caught:
        decode_image(b"not an image")
    assert str(caught.value) == "cannot identify image file the image bytes"
