"""Preparing data at LAION scale: `fastclip data scan` in parallel processes with per-shard summaries (the same
manifest as one process), from img2dataset's `{shard}_stats.json` / `.parquet` without opening the tars, the
compact index sets of scan and of the loader workers, and the catalog read once by rank 0 and broadcast."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastclip.data import build_train_stream, read_manifest
from fastclip.data.bits import IndexBits
from fastclip.data.cli import main as data_main
from fastclip.data.sources.scan import scan_shards
from fastclip.data.sources.synthetic import synthetic_image
from fastclip.data.tario import write_tar

from dist_utils import run_distributed

PER_SHARD = 100  # img2dataset --number_sample_per_shard: keys are shard_id * 100 + row


def img2dataset_folder(
    folder: Path,
    rows: list[int],
    failed: set[int],
    *,
    stats: bool,
    parquet: bool = False,
    dup: tuple[int, int] | None = None,
) -> None:
    """Shards as img2dataset writes them: rows that failed to download are absent from the tar; keys
    {shard:05d}{row:02d}; optionally {shard}_stats.json and {shard}.parquet beside each tar."""
    folder.mkdir(parents=True)
    for sid, count in enumerate(rows):
        groups, table = [], {"key": [], "status": [], "caption": []}
        for row in range(count):
            key = f"{sid:05d}{row:02d}"
            if dup and (sid, row) == dup:
                key = f"{0:05d}{3:02d}"  # the key (index 3) of shard 0 row 3 again
            ok = (sid * PER_SHARD + row) not in failed
            table["key"].append(key)
            table["status"].append("success" if ok else "failed_to_download")
            table["caption"].append(f"caption {key}")
            if ok:
                groups.append(
                    (
                        key,
                        {
                            "jpg": synthetic_image(row, 8, "jpg"),
                            "txt": f"caption {key}".encode(),
                            "json": json.dumps({"key": key, "status": "success"}).encode(),
                        },
                    )
                )
        write_tar(folder / f"{sid:05d}.tar", groups)
        if stats:
            (folder / f"{sid:05d}_stats.json").write_text(
                json.dumps(
                    {
                        "count": count,
                        "successes": len(groups),
                        "failed_to_download": count - len(groups),
                        "failed_to_resize": 0,
                        "duration": 1.0,
                        "status_dict": {},
                    }
                )
            )
        if parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table(table), folder / f"{sid:05d}.parquet")


def summary_of(manifest) -> list[tuple]:
    return [(s.path, s.num_samples, s.index_min, s.index_max) for s in manifest.shards]


def test_index_bits_numbers():
    bits = IndexBits()
    assert bits.add(5) and not bits.add(5) and 5 in bits and 6 not in bits
    dup = bits.add_many(np.array([7, 5, 7, 1 << 20, 9, 1 << 20]))
    assert dup.tolist() == [False, True, True, False, False, True]
    assert bits.nbytes == 2 * 8192  # two chunks of 65,536 indices touched: 8 KiB each
    many = IndexBits()
    many.add_many(np.arange(1_000_000, 1_100_000))  # 100,000 indices in chunks 15 and 16: 0.16 byte per index
    assert many.nbytes == 2 * 8192


def test_parallel_scan_equals_one_process(tmp_path):
    # 5 shards, keys with failures (gaps), a duplicate across shards, one tar truncated
    img2dataset_folder(tmp_path / "d", [10, 10, 7, 10, 10], failed={4, 103, 104, 205}, stats=False, dup=(3, 6))
    tar = tmp_path / "d" / "00004.tar"
    tar.write_bytes(tar.read_bytes()[:9000])
    one = scan_shards(str(tmp_path / "d"), workers=1, write=False)
    two = scan_shards(str(tmp_path / "d"), workers=2, write=False)
    assert one.manifest.to_json() == two.manifest.to_json()
    m = two.manifest
    assert summary_of(m)[:4] == [
        ("00000.tar", 9, 0, 9),
        ("00001.tar", 8, 100, 109),
        ("00002.tar", 6, 200, 206),
        ("00003.tar", 10, 300, 309),
    ]  # a duplicate is a sample of its tar, skipped
    assert m.shards[4].num_samples < 10 and m.data_size == 1 + m.shards[4].index_max
    dups = [p for p in m.problems if p["reason"] == "duplicate_index"]
    assert dups == [
        {
            "shard": "00003.tar",
            "key": "0000003",
            "ordinal": 6,
            "reason": "duplicate_index",
            "detail": "index 3 also at shard 00000.tar key 0000003",
            "index": 3,
        }
    ]
    assert [p["shard"] for p in m.problems if p["reason"] == "truncated_tar"] == ["00004.tar"]


def test_scan_from_img2dataset_stats_without_opening_the_tars(tmp_path, model_fns, capsys):
    folder = tmp_path / "d"
    img2dataset_folder(folder, [10, 10, 6], failed={2, 105, 205}, stats=True)
    tars = {p.name: p.read_bytes() for p in folder.glob("*.tar")}
    for p in folder.glob("*.tar"):
        p.write_bytes(b"not a tar")  # a scan that opened one would fail here
    assert data_main(["scan", str(folder), "--samples-per-shard", str(PER_SHARD), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "3 shards, 23 samples, data_size 206, no problems" in out and "0 shard(s) from .parquet" in out
    m = read_manifest(folder)
    # counts are the successes; the index range of a shard is its key range (no key read)
    assert summary_of(m) == [("00000.tar", 9, 0, 9), ("00001.tar", 9, 100, 109), ("00002.tar", 5, 200, 205)]
    assert m.extra["scanned_from"] == {"stats": 3}
    for name, data in tars.items():
        (folder / name).write_bytes(data)
    # the loader reads the samples' own keys, inside those ranges: every sample once, nothing skipped
    stream = build_train_stream(
        {"train": str(folder), "batch_size": 23, "workers": 0, "shuffle_buffer": 23},
        rank=0,
        world_size=1,
        preprocess=model_fns[0],
        tokenizer=model_fns[1],
    )
    ((_, _, indices, _),) = list(stream.epoch(0))
    assert sorted(indices.tolist()) == [
        i for s, n in enumerate([10, 10, 6]) for i in range(s * 100, s * 100 + n) if i not in {2, 105, 205}
    ]
    assert sum(stream.counters.values()) == 0
    # --from-tars reads the keys: exact ranges
    exact = scan_shards(str(folder), from_tars=True, workers=1).manifest
    assert summary_of(exact) == [("00000.tar", 9, 0, 9), ("00001.tar", 9, 100, 109), ("00002.tar", 5, 200, 204)]
    # img2dataset's default of 10,000 per shard when not told: ranges 0.., 10000.., 20000.. would be 100x too wide
    # (issue 39: "no problems", then data_size 20006): the first key of shard 1 shows the scheme, and one line says
    # which value it implies; nothing is written
    (folder / "manifest.json").unlink()
    assert data_main(["scan", str(folder), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "fastclip data scan: error: shard 00001.tar (img2dataset shard 1) starts with key 0000100, outside the range "
        "10000..19999 that --samples-per-shard 10000 gives it: pass --samples-per-shard as given to img2dataset (its "
        "keys imply --samples-per-shard 100), or --from-tars to read the indices from the tars"
    ], err
    assert not (folder / "manifest.json").exists()
    assert data_main(["scan", str(folder), "--samples-per-shard", "1000", "--workers", "1"]) == 2  # too narrow too
    assert "outside the range 1000..1999" in capsys.readouterr().err


def test_scan_from_img2dataset_parquet_checks_keys(tmp_path):
    pytest.importorskip("pyarrow")
    folder = tmp_path / "d"
    img2dataset_folder(folder, [10, 8], failed={1, 107}, stats=True, parquet=True, dup=(1, 3))
    for p in folder.glob("*.tar"):
        p.write_bytes(b"not a tar")
    m = scan_shards(str(folder), workers=2).manifest
    assert m.extra["scanned_from"] == {"parquet": 2}
    assert summary_of(m) == [("00000.tar", 9, 0, 9), ("00001.tar", 7, 100, 106)]
    assert [(p["shard"], p["key"], p["reason"], p["detail"]) for p in m.problems] == [
        ("00001.tar", "0000003", "duplicate_index", "index 3 also at shard 00000.tar key 0000003")
    ]


def test_parquet_files_left_unread_without_pyarrow_are_said(tmp_path, monkeypatch):
    """Without pyarrow the scan reads the tars (or _stats.json) instead, and its summary says so."""
    folder = tmp_path / "d"
    img2dataset_folder(folder, [10, 8], failed={1, 107}, stats=False, parquet=True)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what `import pyarrow` meets where it is not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    result = scan_shards(str(folder), workers=1, write=False)
    assert result.manifest.extra["parquet_unread"] == 2 and "scanned_from" not in result.manifest.extra
    assert "note: 2 img2dataset .parquet file(s) not read: pyarrow is not installed" in result.summary()
    assert summary_of(result.manifest) == [("00000.tar", 9, 0, 9), ("00001.tar", 7, 100, 106)]  # from the tars


def _broadcast_catalog(rank, world_size, data):
    """Rank 1 cannot read manifests at all here: it must get rank 0's catalog."""
    import fastclip.data
    from fastclip.distributed import DistInfo
    from fastclip.train.catalog_checks import shared_catalog
    from fastclip.train.config import ConfigError, load_config

    if rank == 1:

        def refuse(*a, **k):
            raise AssertionError("rank 1 read the manifests")

        fastclip.data.resolve_catalog = refuse
    info = DistInfo(rank, world_size, rank, torch.device("cpu"), "test", True)
    cfg = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "embedded.yaml",
        ["--data.train", str(data / "train"), "--data.val", "null"],  # (rank 0 checks the val data too)
    )
    catalog = shared_catalog(cfg, info)
    bad = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "embedded.yaml",
        ["--data.train", str(data / "nowhere-{0..3}.tar"), "--data.val", "null"],
    )
    try:
        shared_catalog(bad, info)
        error = None
    except ConfigError as e:
        error = str(e)
    return catalog.fingerprint, catalog.num_samples, len(catalog.shards), error


def test_rank_0_reads_the_catalog_and_broadcasts_it(tiny_embedded):
    results = run_distributed(_broadcast_catalog, 2, tiny_embedded)
    assert results[0] == results[1]
    assert results[0][1:3] == (80, 3)
    assert results[0][3].startswith("config key 'data.train': shard file ") and "nowhere-0.tar" in results[0][3]


def test_a_shard_copied_after_the_scan_is_skipped_and_counted_alike_at_any_world_size(tmp_path, model_fns):
    """img2dataset shards counted from _stats.json take their index range from the key scheme, unread. A copy of
    shard 0 under the name 00003 (merged outputs) holds keys 0..9, not 300..309: its samples are skipped as
    index_outside_shard on every rank (the run-time duplicate check sees one rank's share only: 2 ranks served the
    copies of the other rank's samples uncounted)."""
    import shutil

    folder = tmp_path / "d"
    img2dataset_folder(folder, [10, 10, 6], failed=set(), stats=True)
    shutil.copy(folder / "00000.tar", folder / "00003.tar")
    shutil.copy(folder / "00000_stats.json", folder / "00003_stats.json")
    assert data_main(["scan", str(folder), "--samples-per-shard", str(PER_SHARD), "--workers", "1"]) == 0
    assert summary_of(read_manifest(folder))[3] == ("00003.tar", 10, 300, 309)
    for world_size in (1, 2):
        served, counters = [], {}
        for rank in range(world_size):
            stream = build_train_stream(
                {"train": str(folder), "batch_size": 18 // world_size, "workers": 0, "shuffle_buffer": 36},
                rank=rank,
                world_size=world_size,
                preprocess=model_fns[0],
                tokenizer=model_fns[1],
            )
            served += [i for _, _, indices, _ in stream.epoch(0) for i in indices.tolist()]
            for k, v in stream.counters.items():
                counters[k] = counters.get(k, 0) + v
        assert counters["index_outside_shard"] == 10 and counters["duplicate_index"] == 0, (world_size, counters)
        # shard 3's places in the epoch are refilled from the good shards (wrapped), never with the copies
        assert set(served) == {s * 100 + r for s, n in enumerate([10, 10, 6]) for r in range(n)}, world_size


def test_one_stray_key_that_makes_data_size_huge_is_said_with_its_shard(tmp_path, capsys):
    """One sample keyed 9,999,999 among a hundred makes data_size 10**7, and per-sample state that size: scan
    says so and names the shard; data a few times sparser than its samples (failed downloads) says nothing."""

    def shard(path, keys):
        def files(k):
            return {
                "jpg": synthetic_image(k % 7, 8, "jpg"),
                "txt": b"c",
                "json": json.dumps({"key": f"{k:07d}"}).encode(),
            }

        write_tar(path, [(f"{k:07d}", files(k)) for k in keys])

    for name, keys in (("stray", [*range(99), 9_999_999]), ("gappy", range(0, 300, 3))):
        (tmp_path / name).mkdir()
        shard(tmp_path / name / "00000.tar", keys)
        assert data_main(["scan", str(tmp_path / name), "--workers", "1"]) == 0
        notes = [line for line in capsys.readouterr().err.splitlines() if "per-sample state" in line]
        if name == "gappy":  # 100 samples over 298 indices
            assert notes == []
            continue
        assert notes == [
            "fastclip data scan: note: data_size 10,000,000 for 100 usable samples (100,000x): per-sample state (u, τ) "
            "is sized by data_size; the largest index is 9,999,999 (shard 00000.tar): check its keys (a stray json "
            "'key' or 'index'?), or pass --data-size to skip the samples above it"
        ]
