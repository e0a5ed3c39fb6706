"""Operator mistakes in the data, eval, summary and config commands: one line on stderr naming the flag, key, file
or shard and what to do, exit 2; counters and summaries say exactly what happened."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from helpers import one_line_error

_one_line = one_line_error


# ----------------------------------------------------------------------------- 1. counts that must be >= 1
@pytest.mark.parametrize(
    "argv, words",
    [
        (["info", "x", "--batch-size", "8", "--world-size", "0"], ["data info", "--world-size", "0 must be >= 1"]),
        (["info", "x", "--batch-size", "8", "--world-size", "-1"], ["--world-size", "-1 must be >= 1"]),
        (["info", "x", "--batch-size", "0"], ["--batch-size", "0 must be >= 1"]),
        (["scan", "x", "--workers", "-3"], ["data scan", "--workers", "-3 must be >= 1"]),
        (["embedded", "--source", "scenes", "--out", "x", "--workers", "0"], ["--workers", "0 must be >= 1"]),
    ],
)
def test_data_counts_below_one_are_refused_before_reading(argv, words, capsys, tmp_path, monkeypatch):
    from fastclip.data.cli import main

    monkeypatch.chdir(tmp_path)
    _one_line(capsys, main, argv, *words)
    assert not list(tmp_path.iterdir())  # nothing written


def test_data_info_counts_batches_per_epoch(tiny_embedded, capsys):
    import json

    from fastclip.data.cli import main

    assert main(["info", str(tiny_embedded / "train"), "--batch-size", "8", "--world-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["batches_per_epoch"] == 5  # 80 samples, 16 a step


# ----------------------------------------------------------------------------- 2. a key whose value is missing
@pytest.mark.parametrize(
    "argv, key, following",
    [
        (["--train.run_dir", "--local-loss"], "train.run_dir", "--local-loss"),
        (["--optim.lr", "--train.max_steps", "1"], "optim.lr", "--train.max_steps"),
    ],
)
def test_a_key_without_its_value_does_not_take_the_next_flag(argv, key, following, capsys):
    from fastclip.train.cli import main

    _one_line(capsys, main, ["--print-config", *argv], f"config key '{key}' has no value (next is {following})")


def test_negative_values_and_openclip_switches_still_parse(capsys):
    from fastclip.train.config import parse_overrides

    got = parse_overrides(["--local-loss", "--optim.wd", "-0.5", "--gather-with-grad", "--torchcompile"])
    assert got == {"optim": {"wd": -0.5}, "model": {"compile": True}}, got
    assert parse_overrides(["--train.run_dir", "runs/a", "--local-loss"]) == {"train": {"run_dir": "runs/a"}}


# ----------------------------------------------------------------------------- 3. eval that read nothing
@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """A tiny-vit at initialisation, as a {'state_dict': ...} file (eval with --arch tiny-vit)."""
    import torch

    from fastclip.models import build_model

    path = tmp_path_factory.mktemp("model") / "model.pt"
    torch.save({"state_dict": build_model("tiny-vit").model.state_dict()}, path)
    return path


def test_eval_whose_every_shard_is_unreadable_exits_2(untrained, tmp_path, capsys):
    """One line (the skip, held back, is named in it), no results written."""
    from fastclip.eval.cli import main

    val = tmp_path / "val"
    val.mkdir()
    (val / "val-000000.tar").write_bytes(b"not a tar\n" * 300)
    args = [str(untrained), "--arch", "tiny-vit", "--data", str(val), "--device", "cpu"]
    _one_line(
        capsys,
        main,
        args,
        f"no readable sample in --data {val}",
        "the rest of 1 broken shard whose size no manifest lists",
        "val-000000.tar",
        "not a tar",
    )
    assert not (tmp_path / "results.jsonl").exists() and not (untrained.parent / "results.jsonl").exists()


def test_eval_refuses_a_templates_file_that_is_empty_or_lacks_the_placeholder_naming_it(
    untrained, tiny_embedded, tmp_path, capsys
):
    """An empty --templates file fell back to zeroshot.json's own templates (exit 0); a template without '{}' was
    said naming the class names file."""
    from fastclip.eval.cli import main

    args = [str(untrained), "--arch", "tiny-vit", "--data", str(tiny_embedded), "--device", "cpu", "--no-retrieval"]
    empty, no_name = tmp_path / "empty.txt", tmp_path / "no_name.txt"
    empty.write_text("\n \n")
    no_name.write_text("a photo of a {}.\na photo\n")
    names = tmp_path / "names.txt"
    names.write_text("\n".join(f"class {i}" for i in range(10)) + "\n")
    _one_line(capsys, main, [*args, "--templates", str(empty)], f"{empty}: no templates in it")
    _one_line(capsys, main, [*args, "--classnames", str(names), "--templates", str(no_name)],
              f"{no_name}: template 1 ('a photo') has no '{{}}' placeholder")  # fmt: skip
    # a template that cannot take one name, a bad JSON list, a file that is not UTF-8, a folder: each was a traceback
    # (KeyError, IndexError, after the model was loaded) or a bare parser message without the file's name
    for text, words in (
        ("a photo of a {} in {style}.", ["template 0 ('a photo of a {} in {style}.') cannot take", "field 'style'"]),
        ("a {c} photo of a {}.", ["template 0", "cannot take the class name", "double a literal brace"]),
        ("a photo of a {}. }", ["template 0", "Single '}'"]),
        ("{.foo} photo of a {}", ["template 0", "cannot take the class name", "no attribute 'foo'"]),
        ("{[a]} photo of a {}", ["template 0", "cannot take the class name"]),
        ("a photo of a {{}}.", ["template 0", "leaves the class name out", "a doubled brace is a literal one"]),
    ):
        bad = tmp_path / "bad.txt"
        bad.write_text(text + "\n")
        _one_line(capsys, main, [*args, "--templates", str(bad)], f"{bad}: ", *words)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("[bad")
    _one_line(capsys, main, [*args, "--templates", str(bad_json)], f"{bad_json}: invalid JSON")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"t-shirt\ncaf\xe9\n")
    _one_line(
        capsys, main, [*args, "--classnames", str(latin)], f"{latin}: not UTF-8 text (byte 11", "save it as UTF-8"
    )
    _one_line(capsys, main, [*args, "--templates", str(tmp_path)], f"--templates {tmp_path}: a folder; pass a .txt")


def test_eval_refuses_a_results_file_it_could_not_write_before_evaluating(untrained, tiny_embedded, tmp_path, capsys):
    import json

    from fastclip.eval.cli import main, not_results_file

    (tmp_path / "a_file").write_text("")
    args = [str(untrained), "--arch", "tiny-vit", "--data", str(tiny_embedded), "--device", "cpu"]
    results = tmp_path / "a_file" / "r.jsonl"
    _one_line(capsys, main, [*args, "--results", str(results)], f"--results {results}:", "is not a folder")
    assert capsys.readouterr().out == ""  # refused before the evaluation, not after it
    # a file that holds something else: records were appended to a checkpoint, a config, a metrics.jsonl (exit 0)
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
    config = tmp_path / "config.yaml"
    config.write_text("# resolved config\ndata:\n  batch_size: 8\n")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 0.5}\n')
    for path, what in ((checkpoint, "not JSON lines"), (config, "not JSON lines"), (metrics, "of another kind")):
        before = path.read_bytes()
        _one_line(capsys, main, [*args, "--results", str(path)], f"--results {path}: holds something other", what)
        assert path.read_bytes() == before
    earlier = tmp_path / "r.jsonl"  # an earlier results file, and an empty one, are appended to
    earlier.write_text('{"task": "zeroshot", "dataset": "mnist"}\n')
    assert not_results_file(earlier) is None and not_results_file(tmp_path / "new.jsonl") is None
    # a record of 3,000 classes' per_class is a line over 64 KiB: still a results file (it was refused)
    per_class = {f"class number {i}": 0.123456789 for i in range(3000)}
    earlier.write_text(json.dumps({"time": "t", "task": "zeroshot_classification", "per_class": per_class}) + "\n")
    assert earlier.stat().st_size > 1 << 16 and not_results_file(earlier) is None


def test_one_class_list_for_data_of_several_datasets_scores_its_own_or_is_refused(
    untrained, tiny_embedded, tmp_path, capsys
):
    """The embedded data holds fashion-mnist and mnist: one list named for neither would score both against it
    (refused, at the first batch that shows it); a list named fashion-mnist scores the fashion-mnist samples only
    and says the others were not scored; and a folder of fashion-mnist samples alone, under the same root, is
    scored by a list of any name, as before."""
    import json
    import tarfile

    from fastclip.eval.cli import main

    fashion = json.loads((tiny_embedded / "zeroshot.json").read_text())["datasets"]["fashion-mnist"]
    common = [str(untrained), "--arch", "tiny-vit", "--device", "cpu", "--no-retrieval"]
    args = [*common, "--data", str(tiny_embedded)]
    (tmp_path / "clothes.txt").write_text("\n".join(fashion["classnames"]))
    assert main([*args, "--classnames", str(tmp_path / "clothes.txt"), "--results", str(tmp_path / "no.jsonl")]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("eval: ")]  # (progress)
    assert len(said) == 1 and "one class list ('clothes') scored labelled samples of 2+ datasets" in said[0], said
    assert "(here: fashion-mnist, mnist)" in said[0] and "<dataset>.txt" in said[0]
    assert not (tmp_path / "no.jsonl").exists()
    (tmp_path / "fashion-mnist.txt").write_text("\n".join(fashion["classnames"]))
    results = tmp_path / "r.jsonl"
    assert main([*args, "--classnames", str(tmp_path / "fashion-mnist.txt"), "--results", str(results)]) == 0
    out = capsys.readouterr().out
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert row["dataset"] == "fashion-mnist" and row["num_samples"] == 10, row  # 1 held-out sample per class
    assert "10 labelled samples belong to no dataset of" in out

    only = tiny_embedded / f"fashion-only-{tmp_path.name}"  # beside val/, under the root's zeroshot.json
    only.mkdir()
    try:
        members = {}
        for shard in sorted((tiny_embedded / "val").glob("*.tar")):
            with tarfile.open(shard) as tar:
                for m in tar.getmembers():
                    members.setdefault(m.name.split(".")[0], {})[m.name] = tar.extractfile(m).read()
        with tarfile.open(only / "fashion-000000.tar", "w") as out_tar:
            for files in members.values():
                meta = next(json.loads(v) for k, v in files.items() if k.endswith(".json"))
                if meta.get("dataset") != "fashion-mnist":
                    continue
                for name, data in files.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    out_tar.addfile(info, io.BytesIO(data))
        results = tmp_path / "only.jsonl"
        only_args = [*common, "--data", str(only), "--classnames", str(tmp_path / "clothes.txt")]
        assert main([*only_args, "--results", str(results)]) == 0
        (row,) = [json.loads(line) for line in results.read_text().splitlines()]
        assert row["dataset"] == "clothes" and row["num_samples"] == 10, row
    finally:
        shutil.rmtree(only)


def test_a_truncated_shard_counts_the_samples_it_loses_not_one(untrained, tiny_embedded, tmp_path, capsys):
    """A shard cut after its first samples: the count is its manifest's samples after the break (before: 1, whatever
    the shard held), in the report and in results.jsonl's skipped_samples."""
    import json
    import shutil

    from fastclip.data.manifest import read_manifest
    from fastclip.data.tario import iter_shard
    from fastclip.eval.cli import main

    val = tmp_path / "val"
    shutil.copytree(tiny_embedded / "val", val)
    shard = read_manifest(val).shards[0]
    data = (val / shard.path).read_bytes()
    (val / shard.path).write_bytes(data[: len(data) // 2])
    kept = 0
    try:
        for _ in iter_shard(val / shard.path):
            kept += 1
    except Exception:  # the break itself
        pass
    total = sum(s.num_samples for s in read_manifest(val).shards)
    results = tmp_path / "r.jsonl"
    classes = str(tiny_embedded / "zeroshot.json")
    args = [str(untrained), "--arch", "tiny-vit", "--data", str(val), "--device", "cpu", "--classnames", classes]
    assert main([*args, "--results", str(results)]) == 0
    out = capsys.readouterr().out
    lost = shard.num_samples - kept
    assert 0 < lost < shard.num_samples
    assert f"{total - lost} samples in" in out, out
    assert f"{lost} sample{'' if lost == 1 else 's'} skipped as unreadable" in out, out
    assert {json.loads(x)["skipped_samples"] for x in results.read_text().splitlines()} == {lost}


def test_an_unreadable_caption_in_an_image_folder_skips_its_sample(untrained, tmp_path, capsys):
    from PIL import Image

    from fastclip.eval.cli import main

    for name in ("cat", "dog"):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (16, 16), (40 * i, 80, 120)).save(tmp_path / "images" / name / f"{i}.png")
            (tmp_path / "images" / name / f"{i}.txt").write_text(f"a {name} number {i}")
    (tmp_path / "images" / "dog" / "1.txt").write_bytes(b"\xff\xfe not utf-8")
    args = [str(untrained), "--arch", "tiny-vit", "--data", str(tmp_path / "images"), "--device", "cpu"]
    assert main([*args, "--results", str(tmp_path / "r.jsonl")]) == 0
    out, err = capsys.readouterr()
    assert "3 samples in" in out and "1 sample skipped as unreadable" in out
    assert f"{tmp_path / 'images' / 'dog' / '1.txt'}: unreadable caption" in err and "Traceback" not in err


def test_eval_of_a_data_root_without_zeroshot_json_is_refused(untrained, tiny_embedded, tmp_path, capsys):
    import shutil

    from fastclip.eval.cli import main

    root = tmp_path / "data"
    for split in ("train", "val"):
        shutil.copytree(tiny_embedded / split, root / split)
    args = [str(untrained), "--arch", "tiny-vit", "--data", str(root), "--device", "cpu"]
    _one_line(capsys, main, args, f"--data {root}:", "train, val are shard folders", f"pass --data {root / 'val'}")
    # the split itself evaluates (retrieval only: no class names)
    args = [*args[:3], "--data", str(root / "val"), "--device", "cpu", "--results", str(tmp_path / "r.jsonl")]
    assert main(args) == 0
    assert "20 samples" in capsys.readouterr().out


# ----------------------------------------------------------------------------- 4. summary says what happened
def test_summary_reports_pretrained_start_data_skips_and_unreadable_lines(tiny_embedded, tmp_path, capsys):
    import json

    import yaml
    from test_summary import _run_folder

    from fastclip.eval.summary import main

    run = _run_folder(tmp_path, tiny_embedded, distinct_captions=20)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["pretrained"] = "/models/openclip.pt"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = (run / "metrics.jsonl").read_text().splitlines()
    counts = {"data_skipped": 30, "data_skipped/missing_caption": 20, "data_skipped/truncated_tar": 10}
    last = {**json.loads(rows[1]), **counts, "data_wrapped": 15}
    # line 2 is corrupt, line 4 not an object; a cut last line (a run being written) is no news
    lines = [rows[0], '{"step": 7, "lo', last, "[1, 2]", rows[2]]
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + '\n{"step": 11'
    (run / "metrics.jsonl").write_text(text)
    assert main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("  trained    fastclip-v3 on tiny-vit (from /models/openclip.pt), "), out
    assert out[3] == (
        "  data       30 samples skipped (missing_caption 20, truncated_tar 10), 15 served again to fill batches "
        "(counted in samples and epochs above)"
    ), out
    assert out[-1] == "  note       metrics.jsonl: 2 unreadable lines skipped (2, 4)", out
    # remote shards: their retries and the shards given up on, after the samples
    last |= {"data_remote_retries": 1201, "data_remote_shards_skipped": 3}
    (run / "metrics.jsonl").write_text("\n".join([rows[0], json.dumps(last)]) + "\n")
    assert main([str(run)]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[3]
        .endswith("(counted in samples and epochs above); remote shards: 1,201 retries, 3 skipped as unreadable")
    )


@pytest.mark.parametrize("seconds", ["-5", "nan", "inf"])
def test_summary_refuses_a_training_time_that_is_not_one(seconds, tmp_path, capsys):
    from fastclip.eval.summary import main

    _one_line(capsys, main, [str(tmp_path), f"--train-seconds={seconds}"], "--train-seconds", "must be a number")


# ----------------------------------------------------------------------------- 5. a manifest that disagrees
@pytest.mark.parametrize("world,workers", [(1, 0), (2, 2)])
def test_a_manifest_that_disagrees_with_its_shard_is_counted_and_named(tmp_path, world, workers):
    from test_data_bad import _epochs

    from fastclip.data.manifest import read_manifest, write_manifest
    from fastclip.data.sources.synthetic import write_synthetic

    write_synthetic(tmp_path, [30, 30, 30])
    manifest = read_manifest(tmp_path)
    manifest.shards[0].num_samples = 20  # the tar holds 10 more: never served
    manifest.shards[1].num_samples = 40  # the tar is complete with 10 fewer: not a truncated tar
    write_manifest(tmp_path, manifest)
    streams, served = _epochs(tmp_path, world, workers, epochs=2, batch=8)
    for e in range(2):
        got = {i for rank in served for i in rank[e]}
        assert got == set(range(20)) | set(range(30, 90)), sorted(set(range(90)) - got)
    counters = [s.counters for s in streams]
    assert sum(c.get("manifest_mismatch", 0) for c in counters) == 2 * (10 + 10), counters
    assert sum(c["truncated_tar"] + c["unreadable_shard"] for c in counters) == 0, counters
    details = {e["shard"]: e["detail"] for s in streams for e in s.recent_skips if e["reason"] == "manifest_mismatch"}
    names = [s.path for s in manifest.shards]
    assert "(20 listed vs 30 samples in the tar): rerun fastclip data scan" in details[names[0]], details
    assert "(40 listed vs 30 samples in the tar)" in details[names[1]], details


# ----------------------------------------------------------------------------- 6. data writers and scan
def test_a_fashion_mnist_root_named_that_does_not_hold_it_is_an_error(tmp_path, capsys):
    from fastclip.data.cli import main

    args = ["embedded", "--out", str(tmp_path / "out"), "--fashion-mnist-root", str(tmp_path / "nope")]
    _one_line(capsys, main, args, f"--fashion-mnist-root {tmp_path / 'nope'}: no Fashion-MNIST there", "omit the flag")
    assert not (tmp_path / "out").exists()  # no fallback to other data sets


def test_scan_calls_a_file_that_is_no_tar_what_the_loader_calls_it_in_one_line(tmp_path):
    from fastclip.data.sources.scan import scan_shards
    from fastclip.data.sources.synthetic import write_synthetic

    write_synthetic(tmp_path, [4])
    (tmp_path / "train-000001.tar").write_bytes(b"<html>not found</html>\n" * 40)
    result = scan_shards(str(tmp_path), write=False, workers=1)
    [problem] = result.problems
    assert problem["reason"] == "unreadable_shard" and problem["shard"] == "train-000001.tar", problem
    assert "\n" not in problem["detail"] and "not a tar file" in problem["detail"], problem
    assert len(result.summary().splitlines()) == 2 and result.manifest.num_samples == 4


# ----------------------------------------------------------------------------- 7. files named by a flag
def _a_file(tmp_path):
    path = tmp_path / "taken"
    path.write_text("x")
    return path


@pytest.mark.parametrize(
    "command, argv, words",
    [
        ("data", ["folder", "--captions", "{tmp}/no.csv", "--out", "{tmp}/o"], ["--captions {tmp}/no.csv: no such"]),
        ("data", ["folder", "--captions", "{file}", "--out", "{file}"], ["--out {file}: is a file; pass a folder"]),
        ("data", ["embedded", "--out", "{file}/sub"], ["--out {file}/sub: is under {file}, a file"]),
        ("plot", ["{tmp}", "--out", "{file}"], ["fastclip plot: --out {file}: is a file"]),
        ("eval", ["{tmp}", "--data", "{tmp}", "--templates", "{tmp}/no.txt"], ["--templates {tmp}/no.txt: no such"]),
    ],
)
def test_paths_named_by_a_flag_that_cannot_be_used_name_the_flag(command, argv, words, tmp_path, capsys):
    import importlib

    from fastclip.cli import COMMANDS

    main = importlib.import_module(COMMANDS[command][0]).main
    fill = {"tmp": str(tmp_path), "file": str(_a_file(tmp_path))}
    err = _one_line(capsys, main, [a.format(**fill) for a in argv], *[w.format(**fill) for w in words])
    assert "Errno" not in err, err


# ----------------------------------------------------------------------------- 8. export, reshard, eval: paths
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished run as the trainer leaves it (one step folder, `latest`), random tiny-vit weights: cheap to build."""
    import torch

    from fastclip.models import build_model

    built = build_model("tiny-vit")
    run = tmp_path_factory.mktemp("run")
    step = run / "checkpoints" / "step_00000007"
    step.mkdir(parents=True)
    model = {"state_dict": built.model.state_dict(), "arch": "tiny-vit", "model_config": built.config}
    torch.save({**model, "optimizer": {}, "step": 7, "epoch": 0, "config": {}}, step / "model.pt")
    (run / "checkpoints" / "latest").write_text("step_00000007\n")
    return run


def _snapshot(root):
    """Every path under root with its kind and, for regular files, its bytes."""
    return {
        p: (p.is_symlink(), p.is_file(), p.read_bytes() if p.is_file() and not p.is_symlink() else None)
        for p in sorted(root.rglob("*"))
    }


def test_export_to_a_place_that_cannot_be_written_is_one_line(tiny_run, tmp_path, capsys):
    from fastclip.eval.export import main

    notes = tmp_path / "notes.yaml"
    notes.write_text("a: 1\n")
    before = _snapshot(tmp_path)
    for out, words in (
        ("/proc/m.pt", ["--out /proc/m.pt: cannot write in /proc (", "choose another --out"]),
        (f"{notes}/m.pt", [f"--out {notes}/m.pt: {notes} is not a folder; choose another --out"]),
    ):
        err = _one_line(capsys, main, [str(tiny_run), "--out", out], *words)
        assert "Errno" not in err, err
    assert _snapshot(tmp_path) == before


def test_export_refuses_to_replace_what_is_not_an_earlier_export(tiny_run, tmp_path, capsys):
    """A file not named .pt, a device behind a link, a fifo, and a fifo where <arch>.json goes: one line, 2,
    every file as it was and none added (the atomic rename would swap even a device node for a regular file)."""
    import os

    from fastclip.eval.export import main

    victim = tmp_path / "victim.yaml"
    victim.write_text("lr: 0.1\n")
    (tmp_path / "full.pt").symlink_to("/dev/full")
    os.mkfifo(tmp_path / "fifo.pt")
    beside = tmp_path / "beside"
    beside.mkdir()
    os.mkfifo(beside / "tiny-vit.json")
    before = _snapshot(tmp_path)
    for out, words in (
        (victim, ["--out", "victim.yaml: does not end in .pt; name the .pt file to write"]),
        (tmp_path / "full.pt", ["full.pt: exists and is a device, not a regular file"]),
        (tmp_path / "fifo.pt", ["fifo.pt: exists and is a fifo, not a regular file"]),
        (beside / "m.pt", [f"{beside / 'tiny-vit.json'}, written beside it, exists and is a fifo"]),
    ):
        _one_line(capsys, main, [str(tiny_run), "--out", str(out)], *words)
    assert _snapshot(tmp_path) == before
    assert (tmp_path / "full.pt").resolve() == Path("/dev/full") and Path("/dev/full").is_char_device()


@pytest.mark.parametrize(
    "case, words",
    [
        (
            "junk",
            ["rank_0.pt is not a torch checkpoint file (it begins b'junk", "restore the file or pass another --in"],
        ),
        ("gap", ["no rank_0.pt (resharding needs the file of every old rank", "copy the missing rank files in"]),
    ],
)
def test_reshard_names_what_a_rank_file_is_not_and_which_are_missing(case, words, tmp_path, capsys):
    import torch

    from fastclip.train.reshard import main

    if case == "junk":
        (tmp_path / "rank_0.pt").write_text("junk text\n" * 10)
    else:
        torch.save({"loss_state": {}}, tmp_path / "rank_1.pt")
    _one_line(capsys, main, ["--in", str(tmp_path), "--world-size", "2"], *words)


def test_eval_that_can_score_nothing_is_a_usage_error_said_before_the_pass(tiny_run, tmp_path, capsys):
    """Labelled shards without zeroshot.json whose captions are class templates: neither zero-shot nor retrieval
    gives a number. The labels and captions are read first (no image decoded): one line before the pass (no
    progress line); it took a full pass before. After the model loads: an ssl tower's own refusal comes first."""
    import io

    from fastclip.data.writer import ShardWriter
    from fastclip.eval.cli import main

    from probe import fruit_samples, write_labelled_shards

    data = write_labelled_shards(tmp_path / "val", fruit_samples())
    args = ["--data", str(data), "--device", "cpu", "--results", str(tmp_path / "r.jsonl")]
    missing = "no class names for zero-shot (no zeroshot.json beside it: pass --classnames FILE)"
    templates = "its 24 captions are only 8 distinct class templates, so retrieval cannot single out an image"
    assert main([str(tiny_run), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fastclip eval: --data {data}: nothing to score: {missing}, and {templates}"], err
    _one_line(
        capsys, main, [str(tiny_run), *args, "--no-retrieval"], f"--data {data}: nothing to score: {missing}, and --no"
    )
    # class names, but the samples carry no label and no caption
    bare = [(image, None, None, None) for image, *_ in fruit_samples()]
    data = write_labelled_shards(tmp_path / "bare", bare)
    names = tmp_path / "fruits.txt"
    names.write_text("\n".join(f"fruit {i}" for i in range(8)) + "\n")
    argv = [str(tiny_run), "--data", str(data), "--classnames", str(names), *args[2:]]
    _one_line(
        capsys, main, argv, f"--data {data}: nothing to score: no labelled samples for zero-shot, and no captions"
    )
    # --max-samples bounds the look ahead as it bounds the pass: labels past it are not counted
    labelled_late = bare[:20] + [(image, None, None, 3) for image, *_ in fruit_samples()[20:]]
    data = write_labelled_shards(tmp_path / "late", labelled_late)
    argv = [str(tiny_run), "--data", str(data), "--classnames", str(names), *args[2:]]
    _one_line(capsys, main, [*argv, "--max-samples", "20"], f"--data {data}: nothing to score: no labelled samples")
    assert not (tmp_path / "r.jsonl").exists()
    assert main(argv) == 0  # the labels at 20..23 are scored
    # undecodable images are not counted by --max-samples (the pass skips them): the look ahead refused 4 here
    writer = ShardWriter(tmp_path / "broken", prefix="val", shard_size=16)
    for index in range(4):
        writer.write(index, b"not a png", "png", None)
    for index, (image, *_) in enumerate(fruit_samples()[:8], start=4):
        png = io.BytesIO()
        image.save(png, format="PNG")
        writer.write(index, png.getvalue(), "png", None, label=3)
    writer.close(12)
    argv = [str(tiny_run), "--data", str(tmp_path / "broken"), "--classnames", str(names), *args[2:]]
    assert main([*argv, "--max-samples", "4"]) == 0, capsys.readouterr().err
    assert "4 samples in" in capsys.readouterr().out


def test_eval_without_class_names_scores_retrieval_and_says_zero_shot_is_skipped_once(
    tiny_run, tiny_embedded, tmp_path, capsys, caplog
):
    import shutil

    from fastclip.eval.cli import main

    val = tmp_path / "val"  # distinct captions, and no zeroshot.json beside it
    shutil.copytree(tiny_embedded / "val", val)
    assert main([str(tiny_run), "--data", str(val), "--device", "cpu", "--results", str(tmp_path / "r.jsonl")]) == 0
    captured = capsys.readouterr()
    everything = captured.out + captured.err + "".join(r.getMessage() for r in caplog.records)
    assert "class names: none" in captured.out and "retrieval over 20 image-caption pairs" in captured.out
    assert everything.count("zero-shot skipped: no class names for the 20 labelled samples") == 1, everything
    assert "belong to no dataset" not in everything, everything


def test_eval_of_a_run_that_saved_no_checkpoint_says_so(tiny_embedded, tmp_path, capsys):
    from fastclip.eval.cli import main as eval_main
    from fastclip.eval.export import main as export_main

    run = tmp_path / "crashed"  # what a run stopped before its first save leaves
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("train: {}\n")
    (run / "metrics.jsonl").write_text("")
    said = f"{run}: this run has saved no checkpoint yet (no step folder in {run / 'checkpoints'}"
    _one_line(capsys, eval_main, [str(run), "--data", str(tiny_embedded), "--device", "cpu"], said)
    _one_line(capsys, export_main, [str(run), "--out", str(tmp_path / "m.pt")], said)
    # it did save (`latest` names a step), and the steps were removed since: not "saved no checkpoint yet"
    checkpoints = run / "checkpoints"
    (checkpoints / "latest").write_text("step_00000040\n")
    said = f"{checkpoints / 'latest'} names {checkpoints / 'step_00000040'}, which has no model.pt (removed, or its"
    _one_line(capsys, export_main, [str(run), "--out", str(tmp_path / "m.pt")], said, "no step folder there holds one")
    # an older step is complete: named as the fix
    older = checkpoints / "step_00000020"
    older.mkdir()
    (older / "model.pt").write_bytes(b"")
    _one_line(capsys, export_main, [str(run), "--out", str(tmp_path / "m.pt")], said, f"with one is {older}: pass it")
    # a step folder without its model.pt: said of the step folder, not of `latest`
    (checkpoints / "step_00000030").mkdir()
    said = f"{checkpoints / 'step_00000030'}: no model.pt in this step folder (removed, or its save cut short)"
    _one_line(capsys, export_main, [str(checkpoints / "step_00000030"), "--out", str(tmp_path / "m.pt")], said)


def test_eval_takes_a_bare_state_dict_with_arch_as_train_takes_it_pretrained(untrained, tiny_embedded, tmp_path):
    """open_clip's model.state_dict() saved as is: --arch builds it, and it scores as the same weights wrapped."""
    import json

    import torch

    from fastclip.eval.cli import main

    bare = tmp_path / "bare.pt"
    torch.save(torch.load(untrained, weights_only=True)["state_dict"], bare)
    rows = {}
    for name, file in (("wrapped", untrained), ("bare", bare)):
        results = tmp_path / f"{name}.jsonl"
        args = [str(file), "--arch", "tiny-vit", "--data", str(tiny_embedded), "--device", "cpu"]
        assert main([*args, "--results", str(results)]) == 0
        rows[name] = [
            {k: v for k, v in json.loads(r).items() if k not in ("time", "checkpoint")} for r in open(results)
        ]
    assert rows["bare"] == rows["wrapped"] and len(rows["bare"]) >= 2


def test_a_run_without_its_latest_pointer_or_with_only_cut_short_saves(tiny_run, tmp_path):
    """No `latest` (a copy that left it out): the newest step folder holding a model.pt, as a resume picks it; step
    folders without one: said as such, not as if the path were no run."""
    import shutil

    from fastclip.checkpoint import find_model_file

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "step_00000009").mkdir()  # a later save cut short
    assert find_model_file(run) == run / "checkpoints" / "step_00000007" / "model.pt"
    (run / "checkpoints" / "step_00000007" / "model.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"no step folder holds a model.pt \(step_00000007, step_00000009;"):
        find_model_file(run)


def test_an_empty_latest_pointer_means_the_newest_step_folder(tiny_run, tmp_path):
    """(it was read as naming the checkpoints folder itself: 'has no model.pt')"""
    import shutil

    from fastclip.checkpoint import find_model_file

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "checkpoints" / "latest").write_text("")
    assert find_model_file(run) == run / "checkpoints" / "step_00000007" / "model.pt"


def test_a_warning_is_one_line_naming_where_it_came_from(tmp_path):
    """A warning through `fastclip` (the process entry) is one line: PIL's DecompressionBombWarning for a 96-megapixel
    image came on two, the second the source line that warned."""
    import subprocess
    import sys

    from PIL import Image

    (tmp_path / "img").mkdir()
    Image.new("L", (9800, 9800)).save(tmp_path / "img" / "0.png")  # past PIL's 89.5M pixels: a warning, not an error
    (tmp_path / "c.csv").write_text("filepath,title\nimg/0.png,a huge one\n")
    argv = ["data", "folder", "--captions", str(tmp_path / "c.csv"), "--out", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, "-m", "fastclip", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    import re

    (line,) = done.stderr.splitlines()
    assert re.fullmatch(
        r"fastclip: warning: DecompressionBombWarning: Image size \(96040000 pixels\) .* \(Image\.py:\d+\)", line
    )


def test_a_run_that_fails_before_writing_leaves_no_run_folder_it_made(tmp_path, capsys):
    """A data error found once the run folder is locked (here: no shard file) left an empty folder holding the lock
    and checkpoints/; a folder the operator made stays."""
    from fastclip.train.cli import main

    made = tmp_path / "runs" / "a"
    argv = ["--data.val", "null", "--data.zeroshot", "null", "--data.train", str(tmp_path / "none.tar")]
    argv += ["--train.run_dir", str(made)]
    one_line_error(capsys, main, argv, "config key 'data.train'", "does not exist")
    assert not made.exists() and (tmp_path / "runs").is_dir()
    (tmp_path / "mine").mkdir()
    argv[-1] = str(tmp_path / "mine")
    one_line_error(capsys, main, argv, "config key 'data.train'")
    assert (tmp_path / "mine").is_dir()


def test_a_class_list_that_is_not_the_datas_is_refused_at_the_first_sample_that_shows_it(
    untrained, tiny_embedded, tmp_path, capsys, monkeypatch
):
    """`fastclip eval` is one process: a list over data of two datasets, or a 3-name mnist list for labels up to
    9, is refused in one line, status 2, at the first batch that shows it, not after the whole pass (helper-59: the
    refusal came after 15.6 s of a pass)."""
    import importlib

    from fastclip.eval.cli import main

    ev = importlib.import_module("fastclip.eval.evaluate")  # (the package's `evaluate` is the function)
    batches = []
    real_add = ev._Pass.add
    monkeypatch.setattr(ev._Pass, "add", lambda self, *a: (batches.append(len(a[3])), real_add(self, *a))[1])
    common = [str(untrained), "--arch", "tiny-vit", "--device", "cpu", "--no-retrieval", "--batch-size", "2"]
    for name, words in (("three.txt", "scored labelled samples of 2+ datasets"), ("mnist.txt", "outside [0, 3)")):
        (tmp_path / name).write_text("a\nb\nc\n")
        batches.clear()
        args = [*common, "--data", str(tiny_embedded / "train"), "--classnames", str(tmp_path / name)]
        assert main([*args, "--results", str(tmp_path / "no.jsonl")]) == 2
        said = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("eval: ")]  # (progress)
        assert len(said) == 1 and words in said[0] and name in said[0], said
        assert sum(batches) < 80 / 4, batches  # a few batches of the 80 samples, not the pass
        assert not (tmp_path / "no.jsonl").exists()


def test_eval_counts_distinct_captions_by_string_whatever_the_batch_size(untrained, tmp_path, capsys):
    """The count that decides whether retrieval is reported was torch.unique over text embeddings, which differ in
    their last bits with the batch a caption is encoded in: at --batch-size 7 it said 69 (83 in another process)
    for 68 distinct strings, 68 at 1 and 100. Now the strings are counted."""
    import json

    from fastclip.data.cli import main as data_main
    from fastclip.data.tario import iter_shard
    from fastclip.eval.cli import main
    from fastclip.eval.samples import shard_paths

    data = tmp_path / "data"
    argv = ["embedded", "--out", str(data), "--max-per-class", "2", "--max-val-per-class", "5", "--seed", "0"]
    assert data_main([*argv, "--shard-size", "100"]) == 0
    strings = {raw.files["txt"] for shard in shard_paths(data / "val") for raw in iter_shard(shard)}
    assert len(strings) < 100  # templated captions repeat
    counts = {}
    for batch in (1, 7, 100):
        results = tmp_path / f"r{batch}.jsonl"
        args = [str(untrained), "--arch", "tiny-vit", "--data", str(data / "val"), "--device", "cpu"]
        assert main([*args, "--batch-size", str(batch), "--results", str(results)]) == 0
        rows = [json.loads(line) for line in results.read_text().splitlines()]
        counts[batch] = [r["distinct_captions"] for r in rows if "distinct_captions" in r]
    capsys.readouterr()
    assert counts == {b: [len(strings)] for b in (1, 7, 100)}
