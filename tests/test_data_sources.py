"""Writing shards: embedded datasets, image folder + captions, scan of existing shards; and the CLI around them."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
from PIL import Image

from fastclip.cli import main as fastclip_main
from fastclip.data import read_manifest
from fastclip.data.sources.embedded import DATASETS, DatasetCheckError, check_arrays
from fastclip.data.sources.folder import CaptionFileError, build_folder
from fastclip.data.sources.synthetic import synthetic_image
from fastclip.data.tario import iter_shard, write_tar
from fastclip.eval.samples import iter_samples
from fastclip.eval.spec import load_zeroshot_spec

TRAIN_PER_CLASS, VAL_PER_CLASS = 6, 2


def read_all(folder):
    """(manifest, [(shard name, key, files)]) of a shard folder, checking the manifest against the tars."""
    manifest = read_manifest(folder)
    samples = []
    for shard in manifest.shards:
        group = [(shard.path, s.key, s.files) for s in iter_shard(folder / shard.path)]
        assert len(group) == shard.num_samples
        idx = [json.loads(f["json"])["index"] for _, _, f in group]
        assert (min(idx), max(idx)) == (shard.index_min, shard.index_max)
        samples += group
    return manifest, samples


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    out = tmp_path_factory.mktemp("emb") / "data"
    rc = fastclip_main(
        [
            "data",
            "embedded",
            "--out",
            str(out),
            "--max-per-class",
            str(TRAIN_PER_CLASS),
            "--max-val-per-class",
            str(VAL_PER_CLASS),
            "--shard-size",
            "50",
        ]
    )
    assert rc == 0
    return out


def test_embedded_round_trip(embedded):
    specs = load_zeroshot_spec(embedded / "zeroshot.json")
    names = list(specs)
    assert names == ["fashion-mnist", "mnist"]  # the Debian files are installed on this machine kind
    train_m, train = read_all(embedded / "train")
    val_m, val = read_all(embedded / "val")
    n_train, n_val = 2 * 10 * TRAIN_PER_CLASS, 2 * 10 * VAL_PER_CLASS
    assert (train_m.num_samples, val_m.num_samples) == (n_train, n_val)
    assert train_m.data_size == val_m.data_size == n_train + n_val  # one data_size covers both splits
    assert [s.num_samples for s in train_m.shards] == [50, 50, 20]
    per_class = {}
    for split, samples, first in (("train", train, 0), ("val", val, n_train)):
        indices = []
        for _, key, files in samples:
            meta = json.loads(files["json"])
            assert key == meta["key"] == f"{meta['index']:09d}"
            assert files["txt"].decode() == meta["caption"] and int(files["cls"]) == meta["label"]
            spec = specs[meta["dataset"]]
            assert meta["caption"] in spec.prompts(spec.classnames[meta["label"]])
            image = Image.open(io.BytesIO(files["png"]))
            assert image.size == (28, 28) and image.mode == "L"
            indices.append(meta["index"])
            per_class.setdefault((split, meta["dataset"], meta["label"]), 0)
            per_class[(split, meta["dataset"], meta["label"])] += 1
        assert sorted(indices) == list(range(first, first + len(samples)))  # unique, contiguous
    assert {v for (split, _, _), v in per_class.items() if split == "train"} == {TRAIN_PER_CLASS}
    assert {v for (split, _, _), v in per_class.items() if split == "val"} == {VAL_PER_CLASS}
    captions = {json.loads(f["json"])["caption"] for _, _, f in train}
    assert any(c.startswith("a handwritten digit") for c in captions) and any("photo" in c for c in captions)
    summary = json.loads((embedded / "embedded.json").read_text())
    assert "default" in summary["note"]


def test_embedded_is_seeded(embedded, tmp_path):
    def digest(folder):
        return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.glob("*.tar")))).hexdigest()

    again = tmp_path / "again"
    assert (
        fastclip_main(
            [
                "data",
                "embedded",
                "--out",
                str(again),
                "--max-per-class",
                str(TRAIN_PER_CLASS),
                "--max-val-per-class",
                str(VAL_PER_CLASS),
                "--shard-size",
                "50",
            ]
        )
        == 0
    )
    assert digest(again / "train") == digest(embedded / "train")
    other = tmp_path / "other"
    assert (
        fastclip_main(
            [
                "data",
                "embedded",
                "--out",
                str(other),
                "--max-per-class",
                str(TRAIN_PER_CLASS),
                "--max-val-per-class",
                str(VAL_PER_CLASS),
                "--shard-size",
                "50",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    assert digest(other / "train") != digest(embedded / "train")
    # the held-out split stays disjoint from train: no image bytes in both
    train_images = {f["png"] for _, _, f in read_all(embedded / "train")[1]}
    assert not train_images & {f["png"] for _, _, f in read_all(embedded / "val")[1]}


def test_embedded_pip_only_fallback(tmp_path, capsys, monkeypatch):
    from fastclip.data.sources import embedded

    # the default place empty (a --fashion-mnist-root named that does not hold it is an error, no fallback)
    monkeypatch.setattr(embedded, "FASHION_MNIST_ROOT", str(tmp_path / "no-such-dir"))
    out = tmp_path / "fallback"
    assert (
        fastclip_main(
            [
                "data",
                "embedded",
                "--out",
                str(out),
                "--max-per-class",
                "3",
                "--shard-size",
                "100",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "fallback" in printed and "mnist, animal-mnist" in printed
    assert list(load_zeroshot_spec(out / "zeroshot.json")) == ["mnist", "animal-mnist"]
    assert read_manifest(out / "val").num_samples == 2 * 10 * 1  # ceil(3 * 0.2 / 0.8) = 1 per class


def test_animal_mnist_loads_from_a_folder_with_its_two_files(tmp_path):
    """Set-up unpacks only the data files of the animal-mnist wheel (its metadata declares tensorflow)."""
    import shutil

    from fastclip.data.sources.embedded import ANIMAL_MNIST_SHA256, animal_mnist_folder, load_animal_mnist

    for name in ANIMAL_MNIST_SHA256:
        shutil.copy(animal_mnist_folder() / name, tmp_path / name)
    [(images, labels)], origin = load_animal_mnist(tmp_path)
    assert origin == str(tmp_path) and images.shape == (10000, 28, 28) and np.bincount(labels).tolist() == [1000] * 10
    (tmp_path / "animal_label_version_3.gz").write_bytes(b"not the pinned file")
    with pytest.raises(DatasetCheckError, match="refusing to unpickle"):
        load_animal_mnist(tmp_path)


def test_array_checks_reject_bad_data():
    spec = DATASETS["mnist"]
    images, labels = np.ones((5000, 28, 28), np.uint8), np.repeat(np.arange(10), 500)
    check_arrays(spec, [(images, labels)])
    with pytest.raises(DatasetCheckError, match="class counts"):
        check_arrays(spec, [(images, np.where(labels == 9, 8, labels))])
    with pytest.raises(DatasetCheckError, match="uint8"):
        check_arrays(spec, [(images.astype(np.float32), labels)])
    with pytest.raises(DatasetCheckError, match="28, 28"):
        check_arrays(spec, [(np.ones((5000, 28, 27), np.uint8), labels)])


def test_eval_reader_splits_over_ranks(embedded):
    everything = list(iter_samples(embedded / "val"))
    parts = [list(iter_samples(embedded / "val", r, 3)) for r in range(3)]
    assert sorted(s.index for p in parts for s in p) == sorted(s.index for s in everything)
    assert {len(p) for p in parts} <= {13, 14}  # 40 samples over 3 ranks
    sample = everything[0]
    assert sample.image.mode == "RGB" and sample.dataset in ("fashion-mnist", "mnist") and 0 <= sample.label < 10


# ------------------------------------------------------------------ folder
def make_folder(root):
    (root / "img").mkdir(parents=True)
    rows = []
    for i in range(6):
        fmt = ["png", "jpg", "bmp"][i % 3]
        Image.open(io.BytesIO(synthetic_image(i))).save(root / "img" / f"{i}.{fmt}")
        rows.append((f"img/{i}.{fmt}", f"picture {i}, with a comma"))
    rows.append(("img/missing.png", "no such file"))
    (root / "img" / "broken.png").write_bytes(b"\x89PNG broken")
    rows.append(("img/broken.png", "undecodable"))
    rows.append(("img/0.png", ""))
    return rows


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl"])
def test_folder_round_trip(tmp_path, kind):
    rows = make_folder(tmp_path)
    captions = tmp_path / f"caps.{kind}"
    if kind == "jsonl":
        captions.write_text("".join(json.dumps({"filepath": p, "title": c}) + "\n" for p, c in rows))
        args = []
    else:
        sep = "," if kind == "csv" else "\t"
        quote = (lambda s: f'"{s}"') if kind == "csv" else (lambda s: s)
        captions.write_text("filepath" + sep + "title\n" + "".join(f"{p}{sep}{quote(c)}\n" for p, c in rows))
        args = ["--csv-separator", "\\t"] if kind == "tsv" else []
    out = tmp_path / "shards"
    assert (
        fastclip_main(
            [
                "data",
                "folder",
                "--captions",
                str(captions),
                "--out",
                str(out),
                "--shard-size",
                "4",
                "--index-offset",
                "100",
            ]
            + args
        )
        == 0
    )
    manifest, samples = read_all(out)
    assert manifest.data_size == 100 + len(rows)
    got = {
        json.loads(f["json"])["index"]: (f["txt"].decode(), [e for e in f if e in ("png", "jpg")])
        for _, _, f in samples
    }
    assert sorted(got) == [100 + i for i in range(6)]  # index = row number + offset; bad rows skipped
    assert got[100] == ("picture 0, with a comma", ["png"]) and got[101][1] == ["jpg"]
    assert got[102][1] == ["png"]  # bmp re-encoded


def test_folder_reports_a_missing_column(tmp_path):
    make_folder(tmp_path)
    (tmp_path / "caps.csv").write_text("path,text\nimg/0.png,hello\n")
    with pytest.raises(CaptionFileError, match="no column 'filepath'"):
        build_folder(tmp_path / "caps.csv", tmp_path / "out")
    assert build_folder(tmp_path / "caps.csv", tmp_path / "out", img_key="path", caption_key="text")["written"] == 1


def test_folder_refuses_an_out_folder_with_a_data_set_and_a_run_that_writes_nothing(tmp_path, capsys):
    """`data folder` into a folder that has a manifest would replace it with the new shards' only: refused, the
    old manifest untouched; a captions file whose images are all missing is an error, not a 0-sample data set."""
    rows = make_folder(tmp_path)
    (tmp_path / "caps.csv").write_text("filepath,title\n" + "".join(f'{p},"{c}"\n' for p, c in rows))
    out = tmp_path / "shards"
    args = ["data", "folder", "--captions", str(tmp_path / "caps.csv"), "--out", str(out)]
    assert fastclip_main(args) == 0
    before = (out / "manifest.json").read_text()
    capsys.readouterr()
    assert fastclip_main([*args, "--prefix", "more"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--out {out}: already holds a data set" in err, err
    assert (out / "manifest.json").read_text() == before
    (tmp_path / "empty").mkdir()  # (an --images that is no folder is refused before any row)
    assert fastclip_main([*args[:-1], str(tmp_path / "other"), "--images", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no sample written (first skip: caps.csv:2: image" in err, err


def test_scan_of_files_that_are_not_shards_writes_nothing(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty.tar").write_bytes(b"")
    for target, said in (
        (tmp_path / "notes.txt", "notes.txt is not a .tar/.tar.gz/.tgz shard; pass the shards' folder"),
        (tmp_path / "empty.tar", "no usable sample in 1 file(s), no manifest written"),
    ):
        assert fastclip_main(["data", "scan", str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, err
    assert not (tmp_path / "manifest.json").exists()


# ------------------------------------------------------------------ scan
def img2dataset_shard(path, keys, indices=None):
    """Like img2dataset: .jpg, .txt, .json with "key" (no "index")."""
    groups = []
    for n, key in enumerate(keys):
        meta = {"key": key, "caption": f"caption {key}", "status": "success"}
        groups.append(
            (
                key,
                {
                    "jpg": synthetic_image(n, fmt="jpg"),
                    "txt": f"caption {key}".encode(),
                    "json": json.dumps(meta).encode(),
                },
            )
        )
    write_tar(path, groups)


def test_scan_writes_a_manifest_and_reports_problems(tmp_path, capsys):
    img2dataset_shard(tmp_path / "00000.tar", ["000000000", "000000001", "000000002"])
    img2dataset_shard(tmp_path / "00001.tar", ["000010000", "000010001", "000000001"])  # 1 is a duplicate
    assert fastclip_main(["data", "scan", str(tmp_path)]) == 0
    report = capsys.readouterr().out
    assert "shard 00001.tar key 000000001: duplicate_index (index 1 also at shard 00000.tar key 000000001)" in report
    manifest = read_manifest(tmp_path)
    assert manifest.data_size == 10002  # default: 1 + the largest index
    assert [(s.path, s.num_samples, s.index_min, s.index_max) for s in manifest.shards] == [
        ("00000.tar", 3, 0, 2),
        ("00001.tar", 3, 10000, 10001),
    ]
    assert fastclip_main(["data", "scan", f"{tmp_path}/{{00000..00001}}.tar", "--data-size", "10001"]) == 0
    report = capsys.readouterr().out
    assert "shard 00001.tar key 000010001: index_out_of_range" in report
    reasons = sorted(p["reason"] for p in read_manifest(tmp_path).problems)
    assert reasons == ["duplicate_index", "index_out_of_range"]
    (tmp_path / "manifest.json").unlink()
    assert fastclip_main(["data", "scan", str(tmp_path), "--strict"]) == 1
    assert not (tmp_path / "manifest.json").exists()
    assert fastclip_main(["data", "scan", str(tmp_path / "nothing-{0..3}.tar")]) == 2
    # a negative index without --data-size: there is no upper bound to name (it said "not in [0, None)")
    negative = tmp_path / "negative"
    negative.mkdir()
    samples = [(k, {"jpg": synthetic_image(i, fmt="jpg"), "txt": b"a cat", "json": json.dumps({"index": i * 8 - 5})})
               for i, k in enumerate(("a", "b"))]  # fmt: skip
    write_tar(negative / "00000.tar", [(k, {**m, "json": m["json"].encode()}) for k, m in samples])
    capsys.readouterr()
    assert fastclip_main(["data", "scan", str(negative)]) == 0
    assert "shard 00000.tar key a: index_out_of_range (index -5 is negative)" in capsys.readouterr().out


def test_info_resolves_a_spec(embedded, capsys):
    assert fastclip_main(["data", "info", str(embedded / "train"), "--batch-size", "16", "--world-size", "2"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_samples"] == 120 and info["data_size"] == 160 and info["batches_per_epoch"] == 4


def test_folder_rows_a_reader_would_misread_are_skipped_and_named(tmp_path):
    """A review's own-data findings: an unquoted comma cut a caption short, a stray quote swallowed the rows after
    it, Excel's byte-order mark hid the first column, a JSONL number for a path was a traceback, a caption past
    csv's field limit stopped the run. Each row is written or skipped with its line named; what pandas writes
    (OpenCLIP's CsvDataset reads with pandas) reads as pandas reads it."""
    import csv

    make_folder(tmp_path)
    huge = "a long caption " * 10_000  # 150,000 characters: past csv's default limit of 131,072
    (tmp_path / "c.csv").write_bytes(
        b"\xef\xbb\xbffilepath,title\r\n"  # Excel's "CSV UTF-8": a BOM
        b"img/0.png,a red square, on a table\r\n"  # 2: three fields
        b'img/1.jpg,"quoted, as it should be"\r\n'  # 3
        + f"img/4.jpg,{huge}\r\n".encode()  # 4
        + b"img/3.png,a trailing separator,\r\n"  # 5: an empty extra field
        + b'img/2.bmp,"an unclosed quote\r\nimg/3.png,swallowed\r\n'  # 6..7: one row to the end
    )
    report = build_folder(tmp_path / "c.csv", tmp_path / "csv")
    assert report["rows"] == 5 and report["written"] == 3 and report["data_size"] == 5
    assert report["skipped"] == [
        "c.csv:2: 3 fields, the header has 2: quote the 'title' field (it holds the separator ',')",
        "c.csv:7: one field runs over lines 6..7 and past separators: a quote mark that opened it was not closed, "
        'and the rows in it are lost; close the quote or double it ("")',
    ]
    written = {json.loads(f["json"])["index"]: f["txt"].decode() for _, _, f in read_all(tmp_path / "csv")[1]}
    assert written == {1: "quoted, as it should be", 2: huge.strip(), 3: "a trailing separator"}

    rows = [("img/0.png", 'a "quoted" word'), ("img/1.jpg", "two\nlines"), ("img/3.png", "plain")]
    with open(tmp_path / "c.tsv", "w", newline="") as f:  # as pandas' to_csv(sep="\t") quotes
        writer = csv.writer(f, delimiter="\t")
        writer.writerows([("filepath", "title"), *rows])
    report = build_folder(tmp_path / "c.tsv", tmp_path / "tsv")
    assert report["written"] == 3 and not report["skipped"]
    written = {json.loads(f["json"])["index"]: f["txt"].decode() for _, _, f in read_all(tmp_path / "tsv")[1]}
    assert written == {0: 'a "quoted" word', 1: "two\nlines", 2: "plain"}

    lines = [
        '{"filepath": 17, "title": "x"}',
        '{"filepath": "img/0.png", "title": 5}',
        '{"filepath": "img/1.jpg", "title": "ok"}',
    ]
    (tmp_path / "c.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    report = build_folder(tmp_path / "c.jsonl", tmp_path / "jsonl")
    assert report["written"] == 1 and report["skipped"] == [
        "c.jsonl:1: 'filepath' is 17, not a path",
        "c.jsonl:2: 'title' is 5, not text",
    ]


def test_an_unclosed_quote_past_the_field_limit_is_one_error_naming_the_line(tmp_path, monkeypatch):
    from fastclip.data.sources import folder

    monkeypatch.setattr(folder, "FIELD_LIMIT", 1000)  # (16 MiB: a test file that size is not needed to reach it)
    make_folder(tmp_path)
    (tmp_path / "c.csv").write_text('filepath,title\nimg/0.png,fine\nimg/1.jpg,"unclosed ' + "x" * 2000 + "\n")
    with pytest.raises(CaptionFileError, match=r"c.csv: after line 2: a field longer than 1,000 characters"):
        build_folder(tmp_path / "c.csv", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_images_decode_as_a_viewer_shows_them(tmp_path):
    """A camera's EXIF orientation is applied and a 16-bit grey PNG is scaled to 8 bits (convert() made it white);
    an 8-bit image decodes as before."""
    from fastclip.data.samples import decode_image

    wide = np.full((20, 60), 40000, dtype=np.uint16)
    wide[:, :30] = 1000
    buf = io.BytesIO()
    Image.fromarray(wide).save(buf, format="PNG")
    grey = np.asarray(decode_image(buf.getvalue()))
    assert grey.shape == (20, 60, 3) and (grey[:, :30] == 4).all() and (grey[:, 30:] == 156).all()  # 40000/257
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 4), 200, dtype=np.int32)).save(buf, format="TIFF")  # mode I holding 8-bit values
    assert (np.asarray(decode_image(buf.getvalue())) == 200).all()  # as they are, not /257

    photo = Image.new("RGB", (60, 20), (255, 0, 0))
    photo.paste((0, 0, 255), (0, 0, 10, 20))  # blue on the left as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to view": the stored left edge is the top
    buf = io.BytesIO()
    photo.save(buf, format="PNG", exif=exif)
    seen = np.asarray(decode_image(buf.getvalue()))
    assert seen.shape == (60, 20, 3)
    assert (seen[:10] == (0, 0, 255)).all() and (seen[10:] == (255, 0, 0)).all()

    plain = io.BytesIO(synthetic_image(3))
    assert np.array_equal(np.asarray(decode_image(plain.getvalue())), np.asarray(Image.open(plain).convert("RGB")))


def test_eval_reads_a_plain_shards_indices_as_training_does(tmp_path):
    """Plain WebDataset shards (no .json) take their indices from the manifest scan writes (index_base + position,
    plus --index-offset): evaluation reads the same indices as training (it had none: no validation loss), and
    json indices get the offset too."""
    from fastclip.data.samples import check_sample
    from fastclip.data.tario import ShardReader

    plain = tmp_path / "plain"
    plain.mkdir()
    for shard in range(2):
        groups = [(f"s{shard}_{k}", {"png": synthetic_image(3 * shard + k), "txt": b"a caption"}) for k in range(3)]
        write_tar(plain / f"{shard:05d}.tar", groups)
    img2dataset_shard(tmp_path / "00000.tar", ["000000000", "000000001", "000000002"])
    keyed = tmp_path / "keyed"
    keyed.mkdir()
    (tmp_path / "00000.tar").rename(keyed / "00000.tar")
    for folder in (plain, keyed):
        assert fastclip_main(["data", "scan", str(folder), "--from-tars", "--index-offset", "1000"]) == 0
        manifest = read_manifest(folder)
        trained = []
        for shard in manifest.shards:
            with ShardReader(folder / shard.path) as reader:
                while (raw := reader.next_group()) is not None:
                    cand, _, _ = check_sample(raw, manifest.data_size, shard.index_base, True, manifest.index_offset)
                    trained.append(cand.index)
        assert [s.index for s in iter_samples(folder)] == trained
        assert sorted(trained) == list(range(1000, 1000 + len(trained))) and len(trained) in (3, 6)
