"""Operator mistakes with `fastclip data scan`: a scan never shrinks a folder's manifest unasked, reads local shards
only, counts only samples training can use, lists duplicate keys, and says what to pass when given a file that is no
shard. Each refusal is one stderr line naming the file and what to do, exit status 2, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fastclip.data import build_train_stream
from fastclip.data.cli import main
from fastclip.data.manifest import read_manifest
from fastclip.data.sources.synthetic import synthetic_image, write_synthetic
from fastclip.data.tario import write_tar

from helpers import one_line_error


def _stream(spec: str, batch_size: int = 1):
    return build_train_stream(
        {"train": spec, "batch_size": batch_size, "workers": 0, "shuffle_buffer": 8},
        preprocess=lambda img: torch.zeros(1),  # the stream still decodes every image itself
        tokenizer=lambda captions: torch.zeros(len(captions), 2, dtype=torch.long),
    )


def _sample(index: int, **meta) -> dict[str, bytes]:
    return {
        "png": synthetic_image(index),
        "txt": f"caption {index}".encode(),
        "json": json.dumps({"index": index, **meta}).encode(),
    }


# ----------------------------------------------------------------------------- 1. and 6. the folder's manifest
def test_a_scan_of_one_shard_does_not_replace_the_folders_manifest(tmp_path, capsys):
    folder = tmp_path / "d"
    write_synthetic(folder, [4, 4])
    before = (folder / "manifest.json").read_text()
    one_line_error(
        capsys,
        main,
        ["scan", str(folder / "train-000000.tar"), "--workers", "1"],
        f"fastclip data scan: error: {folder}/manifest.json lists 2 shards, this scan reads 1: it would drop "
        f"train-000001.tar from the manifest; scan the folder itself (or a pattern naming every listed shard), or "
        f"move {folder}/manifest.json away to write a manifest of these shards only",
    )
    assert (folder / "manifest.json").read_text() == before
    # the same set again, by folder or by a pattern naming every shard: rescanned as before
    for spec in (str(folder), f"{folder}/train-{{000000..000001}}.tar"):
        assert main(["scan", spec, "--workers", "1"]) == 0
        assert capsys.readouterr().err == ""
        assert [(s.path, s.num_samples) for s in read_manifest(folder).shards] == [
            ("train-000000.tar", 4),
            ("train-000001.tar", 4),
        ]
    # a superset: shards added to the folder join the manifest
    write_tar(folder / "train-000002.tar", [(f"{i:09d}", _sample(i)) for i in range(8, 11)])
    assert main(["scan", str(folder), "--workers", "1"]) == 0
    assert capsys.readouterr().err == ""
    manifest = read_manifest(folder)
    assert [s.path for s in manifest.shards][-1] == "train-000002.tar" and manifest.num_samples == 11


def test_a_folder_of_linked_shards_rescans(tmp_path, capsys):
    """Shards linked into the folder from elsewhere: the scan reads them as the files they resolve to, and that is
    still the set its manifest lists (the rescan was refused as 'would drop' every shard)."""
    store, folder = tmp_path / "store", tmp_path / "d"
    write_synthetic(store, [4, 4])
    folder.mkdir()
    for shard in sorted(store.glob("*.tar")):
        (folder / shard.name).symlink_to(shard)
    shutil.copy(store / "manifest.json", folder / "manifest.json")  # listing them by their names in the folder
    for _ in range(2):
        assert main(["scan", str(folder), "--workers", "1"]) == 0
        assert capsys.readouterr().err == ""
        assert read_manifest(folder).num_samples == 8


def test_a_listed_shard_gone_from_the_folder_is_left_out_with_a_note(tmp_path, capsys):
    folder = tmp_path / "d"
    write_synthetic(folder, [4, 4, 4])
    (folder / "train-000002.tar").unlink()
    assert main(["scan", str(folder), "--workers", "1"]) == 0
    assert capsys.readouterr().err == (
        f"fastclip data scan: note: {folder}/manifest.json listed 1 shard no longer in {folder} (train-000002.tar): "
        f"left out of the new manifest (2 listed shards kept)\n"
        # the per-sample state of a run on the old manifest stays sized as it was
        f"fastclip data scan: note: keeping data_size 12 of {folder}/manifest.json, above the largest index found + 1 "
        f"(8): a run's per-sample state is sized by it (pass --data-size to change it)\n"
    )
    assert [s.path for s in read_manifest(folder).shards] == ["train-000000.tar", "train-000001.tar"]
    # a manifest that cannot be read is what a rescan repairs: replaced, and said
    (folder / "manifest.json").write_text("{")
    assert main(["scan", str(folder), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"fastclip data scan: note: replacing {folder}/manifest.json, which could not be read (")
    assert len(err.splitlines()) == 1 and read_manifest(folder).num_samples == 8


# ----------------------------------------------------------------------------- 2. remote sources
@pytest.mark.parametrize(
    "spec", ["pipe:cat {folder}/train-{{000000..000001}}.tar", "http://127.0.0.1:9/x/{{0..1}}.tar"]
)
def test_a_remote_source_is_not_scanned_and_the_line_says_where_its_manifest_comes_from(spec, tmp_path, capsys):
    folder = tmp_path / "d"
    write_synthetic(folder, [4, 4])
    spec = spec.format(folder=folder)
    err = one_line_error(
        capsys,
        main,
        ["scan", spec, "--workers", "1"],
        f"fastclip data scan: error: {spec}: a remote source; `fastclip data scan` reads local shards only: scan "
        f"them where they are (or a local copy) and upload the manifest.json beside them, where training reads it",
    )
    assert "does not exist" not in err


# ----------------------------------------------------------------------------- 4. samples training cannot use
def test_samples_without_image_and_caption_are_not_counted_as_usable(tmp_path, capsys):
    folder = tmp_path / "d"
    folder.mkdir()
    write_tar(folder / "a.tar", [(f"{i:04d}", {"json": json.dumps({"index": i}).encode()}) for i in range(3)])
    one_line_error(
        capsys,
        main,
        ["scan", str(folder), "--workers", "1"],
        f"fastclip data scan: error: {folder}: no usable sample in 1 file(s), no manifest written (each of the 3 "
        f"samples read has a problem listed above; WebDataset .tar shards of image + caption files are expected)",
    )
    assert not (folder / "manifest.json").exists()
    # one good sample among them: written, and the summary says how many of the samples are usable
    write_tar(folder / "b.tar", [("0003", _sample(3))])
    assert main(["scan", str(folder), "--workers", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    problems = {"missing_caption": 3, "missing_image": 3}
    assert out[0] == f"{folder}: 2 shards, 4 samples (1 usable), data_size 4, 6 problems ({problems})"
    assert [i for _, _, idx, _ in _stream(str(folder)).epoch(0) for i in idx.tolist()] == [3] * 4


# ----------------------------------------------------------------------------- 5. duplicate keys
def test_a_key_repeated_next_to_itself_is_listed_and_skipped_one_repeated_apart_is_served(tmp_path, capsys):
    folder = tmp_path / "d"
    folder.mkdir()
    # a.tar: key 0001 twice in a row (a tar reader merges them: 4 images read as 3 samples);
    # b.tar: key 0005 twice, apart, with different indices: two samples, told apart by their position
    write_tar(folder / "a.tar", [(key, _sample(i)) for i, key in enumerate(["0000", "0001", "0001", "0002"])])
    write_tar(folder / "b.tar", [(key, _sample(4 + i)) for i, key in enumerate(["0004", "0005", "0006", "0005"])])
    assert main(["scan", str(folder), "--workers", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{folder}: 2 shards, 7 samples (6 usable), data_size 8, 1 problem ({{'duplicate_key': 1}})",
        "  shard a.tar key 0001: duplicate_key (2 samples under key 0001, next to each other in the tar, read as one "
        "that keeps the last of each member: skipped; give each sample its own key)",
        f"wrote {folder}/manifest.json",
    ]
    # the stream skips exactly what the manifest lists, and counts it
    stream = _stream(str(folder))
    served = sorted(i for _, _, idx, _ in stream.epoch(0) for i in idx.tolist())
    assert set(served) == {0, 3, 4, 5, 6, 7} and stream.counters["duplicate_key"] == 1  # (a refill repeats one)


def test_problems_are_skipped_by_position_and_by_key_in_a_manifest_without_positions(tmp_path, capsys):
    """A problem names its sample's position in the tar: of two samples under one key, apart, only the listed one
    is skipped. A manifest written before problems named positions skips every sample under the key."""
    folder = tmp_path / "d"
    folder.mkdir()
    samples = [("0000", _sample(0)), ("0001", _sample(1)), ("0000", _sample(2)), ("0003", _sample(1))]
    write_tar(folder / "a.tar", samples)  # index 1 twice: the second copy (position 3) is the problem
    assert main(["scan", str(folder), "--workers", "1"]) == 0
    capsys.readouterr()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [(p["key"], p["ordinal"], p["reason"]) for p in manifest["problems"]] == [("0003", 3, "duplicate_index")]
    assert set(i for _, _, idx, _ in _stream(str(folder)).epoch(0) for i in idx.tolist()) == {0, 1, 2}
    manifest["problems"] = [dict(p, key="0000", ordinal=None) for p in manifest["problems"]]  # by key only
    (folder / "manifest.json").write_text(json.dumps(manifest))
    stream = _stream(str(folder))
    assert set(i for _, _, idx, _ in stream.epoch(0) for i in idx.tolist()) == {1}
    # both samples under key 0000 (listed), and position 3 (index 1 again: the run-time check, now unlisted)
    assert stream.counters["duplicate_index"] == 3
    for bad in (-1, "3", 1.5, True):
        manifest["problems"][0]["ordinal"] = bad
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ValueError) as e:
            _stream(str(folder))
        assert str(e.value) == (
            f"{folder / 'manifest.json'}: a problem of shard a.tar (key 0000) has ordinal {bad!r}, not a position in "
            "the tar (an integer >= 0); run `fastclip data scan` on its folder to rebuild it"
        )


# ----------------------------------------------------------------------------- 7. files that are not shards
def test_a_manifest_stands_for_its_folder_and_a_shard_list_is_refused(tmp_path, capsys):
    folder = tmp_path / "d"
    write_synthetic(folder, [4, 4])
    assert main(["scan", str(folder / "manifest.json"), "--workers", "1"]) == 0
    assert f"{folder}: 2 shards, 8 samples, data_size 8, no problems" in capsys.readouterr().out
    assert [s.path for s in read_manifest(folder).shards] == ["train-000000.tar", "train-000001.tar"]
    before = (folder / "manifest.json").read_text()
    listing = tmp_path / "list.txt"
    listing.write_text(f"{folder}/train-000000.tar\n")
    one_line_error(
        capsys,
        main,
        ["scan", str(listing)],
        f"fastclip data scan: error: {listing} is not a .tar/.tar.gz/.tgz shard; pass the shards' folder (or its "
        f"manifest.json) or a brace/glob pattern of the shard files",
    )
    one_line_error(
        capsys, main, ["scan", f"{folder}/*"], f"{folder}/manifest.json (from pattern '{folder}/*') is not a .tar"
    )
    assert (folder / "manifest.json").read_text() == before


# ----------------------------------------------------------------------------- 8. a manifest kept elsewhere
def test_a_read_only_folder_is_scanned_to_a_manifest_elsewhere_that_training_reads(tmp_path, capsys, monkeypatch):
    folder, sets = (tmp_path / "ro").resolve(), tmp_path / "sets"
    folder.mkdir()
    write_tar(folder / "a.tar", [(f"{i:04d}", _sample(i)) for i in range(4)])
    write_tar(folder / "b.tar", [(f"{i:04d}", _sample(i)) for i in range(4, 9)])
    files = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    manifest = sets / "ro.manifest.json"
    folder.chmod(0o555)
    try:
        for _ in range(2):  # a rescan to the same file: the same manifest, nothing said
            assert main(["scan", str(folder), "--manifest", str(manifest), "--workers", "1"]) == 0
            captured = capsys.readouterr()
            assert f"wrote {manifest}" in captured.out and captured.err == ""
    finally:
        folder.chmod(0o755)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == files  # nothing written beside the shards
    data = json.loads(manifest.read_text())
    assert [(s["path"], s["num_samples"]) for s in data["shards"]] == [(f"{folder}/a.tar", 4), (f"{folder}/b.tar", 5)]

    def indices(spec: str) -> list[int]:
        return sorted(i for _, _, idx, _ in _stream(spec, batch_size=3).epoch(0) for i in idx.tolist())

    assert indices(str(manifest)) == list(range(9))  # every sample, once
    # shard paths relative to the manifest's folder (not the working directory) read the same
    data["shards"] = [dict(s, path=f"../ro/{s['path'].rsplit('/', 1)[1]}") for s in data["shards"]]
    relative = sets / "relative.json"
    relative.write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)  # where "../ro/a.tar" names nothing
    assert indices(str(relative)) == list(range(9))
    # shards that are not there: one line naming the manifest and the first missing shard (exit 2 from the CLI)
    data["shards"] = [dict(s, path=f"{folder}/gone-{s['path'][-5]}.tar") for s in data["shards"]]
    manifest.write_text(json.dumps(data))
    one_line_error(
        capsys,
        main,
        ["info", str(manifest)],
        f"fastclip data info: error: shard file {folder}/gone-a.tar (listed in {manifest}) does not exist: restore "
        f"it, or rerun `fastclip data scan` with --manifest {manifest} to list the shards that are there",
    )
    # a manifest that cannot be written is said before the scan; one that is no .json, too (training would
    # take it for a shard pattern)
    (tmp_path / "file").write_text("")
    one_line_error(
        capsys,
        main,
        ["scan", str(folder), "--manifest", str(tmp_path / "file" / "x.json")],
        f"fastclip data scan: error: cannot write {tmp_path}/file/x.json: {tmp_path}/file is a file; pass --manifest "
        f"PATH in a folder you can write",
    )
    one_line_error(
        capsys,
        main,
        ["scan", str(folder), "--manifest", str(sets / "ro.txt")],
        f"fastclip data scan: error: --manifest {sets}/ro.txt: name a .json file (data.train reads FILE.json as a "
        f"manifest)",
    )


def test_a_rescan_of_embedded_train_keeps_the_data_size_its_val_split_shares(tiny_embedded, tmp_path, capsys):
    """`fastclip data embedded` numbers val after train, so train's data_size covers both; a rescan (the README's
    repair for a damaged shard) set it to train's own largest index + 1, and a resume was then refused as other
    data. It keeps the larger size, says so, and --data-size still sets it."""
    train = tmp_path / "train"
    shutil.copytree(tiny_embedded / "train", train)
    before = read_manifest(train).data_size
    largest = max(s.index_max for s in read_manifest(train).shards)
    assert before > largest + 1  # the val split's indices follow
    assert main(["scan", str(train), "--workers", "1"]) == 0
    assert read_manifest(train).data_size == before
    assert f"keeping data_size {before:,} of {train / 'manifest.json'}" in capsys.readouterr().err
    assert main(["scan", str(train), "--workers", "1", "--data-size", str(largest + 1)]) == 0
    assert read_manifest(train).data_size == largest + 1


def test_a_corrupt_manifest_says_how_to_rewrite_it(tmp_path):
    from fastclip.data.manifest import ManifestError

    folder = tmp_path / "d"
    write_synthetic(folder, [4])
    (folder / "manifest.json").write_text("{")
    with pytest.raises(ManifestError, match=f"not valid JSON .*; rewrite it with `fastclip data scan {folder}`"):
        read_manifest(folder)
