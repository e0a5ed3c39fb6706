"""Operator mistakes in `fastclip data ...` and launch/single_node.sh: one line naming the flag, file or shard and
what to do, exit 2; a failed run leaves nothing that blocks its rerun; counters say exactly what happened."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from fastclip.data.cli import main
from fastclip.data.sources.synthetic import write_synthetic

from helpers import REPO, full_disk_after, one_line_error, truncate_file


# ----------------------------------------------------------------------------- 1. a failed `data folder`
def test_folder_that_writes_nothing_leaves_nothing_and_its_fixed_rerun_succeeds(tmp_path, capsys):
    captions, out = tmp_path / "c.csv", tmp_path / "o"
    captions.write_text("filepath,title\nmissing.png,a cat\n")
    argv = ["folder", "--captions", str(captions), "--out", str(out)]
    one_line_error(capsys, main, argv, "no sample written (first skip: c.csv:2: image", "missing.png not found")
    assert not out.exists()  # no 0-sample manifest.json that would refuse the rerun
    Image.new("RGB", (8, 8)).save(tmp_path / "missing.png")  # the operator fixes the data, runs the same command
    assert main(argv) == 0
    assert json.loads((out / "manifest.json").read_text())["num_samples"] == 1
    assert "o: 1 of 1 row written in 1 shard (0 skipped), data_size 1" in capsys.readouterr().out


def test_folder_refuses_an_out_holding_shards_without_a_manifest(tmp_path, capsys):
    """Shards of an earlier run that stopped before writing its manifest: overwriting them would lose them."""
    Image.new("RGB", (8, 8)).save(tmp_path / "0.png")
    captions, out = tmp_path / "c.csv", tmp_path / "o"
    captions.write_text("filepath,title\n0.png,a cat\n")
    out.mkdir()
    (out / "train-000000.tar").write_bytes(b"an earlier run's shard")
    argv = ["folder", "--captions", str(captions), "--out", str(out)]
    one_line_error(capsys, main, argv, f"--out {out}: already holds 1 shard named train-*.tar (train-000000.tar, ...)")
    assert (out / "train-000000.tar").read_bytes() == b"an earlier run's shard"
    assert sorted(x.name for x in out.iterdir()) == ["train-000000.tar"]
    assert main([*argv, "--prefix", "more"]) == 0  # other names do not collide


def test_folder_that_fails_midway_removes_what_it_wrote_and_nothing_else(tmp_path, capsys):
    for i in range(3):
        Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / f"{i}.png")
    captions = tmp_path / "c.jsonl"
    captions.write_text(
        "".join(json.dumps({"filepath": f"{i}.png", "title": f"t{i}"}) + "\n" for i in range(3)) + "{\n"
    )
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("the operator's")
    for out in (kept, tmp_path / "new" / "sub"):
        argv = ["folder", "--captions", str(captions), "--out", str(out), "--shard-size", "1"]
        one_line_error(capsys, main, argv, f"{captions}:4: not valid JSON")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.png", "1.png", "2.png", "c.jsonl", "kept"]
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]  # its 3 shards gone, the file that was there kept


@pytest.mark.parametrize("source", ["glyphs", "scenes"])
@pytest.mark.parametrize("phase", ["shards", "manifests"])
def test_embedded_that_fails_midway_removes_what_it_wrote_and_its_rerun_succeeds(
    tmp_path, capsys, monkeypatch, source, phase
):
    """A full disk part-way: while val's shards are written, or after train's manifest, before val's. No half data
    set is left to train on, the folders of the operator stay, and the same command then succeeds."""
    import fastclip.data.sources.embedded as embedded
    import fastclip.data.sources.scenes as scenes
    import fastclip.data.writer as writer

    out = tmp_path / "kept"
    (out / "train").mkdir(parents=True)  # a split folder that was there: kept, with what it held
    (out / "train" / "notes.txt").write_text("the operator's")
    if source == "glyphs":  # 10 classes x 2 train + 1 val each, in shards of 4: the 26th image is val's 6th
        argv = ["embedded", "--out", str(out), "--datasets", "mnist", "--max-per-class", "2", "--max-val-per-class"]
        argv += ["1", "--shard-size", "4"]
        fails = (embedded, "_png", 25) if phase == "shards" else (writer, "write_manifest", 1)
    else:  # shards of 5: train's 2, val's 1, then test's fails
        argv = ["embedded", "--source", "scenes", "--out", str(out), "--num-train", "10", "--num-val", "5"]
        argv += ["--num-test", "5", "--num-novel", "5", "--shard-size", "5", "--workers", "1"]
        fails = (scenes, "_write_shard", 3) if phase == "shards" else (scenes, "write_manifest", 1)
    module, name, calls = fails
    monkeypatch.setattr(module, name, full_disk_after(calls, getattr(module, name)))
    assert main(argv) == 2
    err = capsys.readouterr().err  # (the progress line of the finished shards before it, in the manifests phase)
    assert err.strip().splitlines()[-1].endswith("No space left on device") and "Traceback" not in err, err
    assert [p.relative_to(out).as_posix() for p in out.rglob("*")] == ["train", "train/notes.txt"]
    monkeypatch.undo()  # the operator frees space and runs the same command
    assert main(argv) == 0
    assert (out / "zeroshot.json").is_file() and (out / "train" / "manifest.json").is_file()
    assert (out / "train" / "notes.txt").read_text() == "the operator's"


def test_a_split_folder_linked_elsewhere_is_cleaned_through_the_link(tmp_path):
    """out/train a symbolic link to another disk: the shards written through it are removed, the link stays."""
    from fastclip.data.writer import removed_on_failure

    elsewhere, out = tmp_path / "big_disk", tmp_path / "out"
    elsewhere.mkdir()
    (elsewhere / "old.txt").write_text("kept")
    out.mkdir()
    (out / "train").symlink_to(elsewhere)
    with pytest.raises(OSError), removed_on_failure(out, ("train", "val")):
        (out / "train" / "train-000000.tar").write_bytes(b"x")
        (out / "train" / "manifest.json").write_text("{}")
        (out / "val").mkdir()
        (out / "val" / "val-000000.tar").write_bytes(b"x")
        raise OSError(28, "No space left on device")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["old.txt"]
    assert sorted(p.name for p in out.iterdir()) == ["train"] and (out / "train").is_symlink()


def test_embedded_refuses_an_out_holding_a_data_set_and_leaves_it(tmp_path, capsys, tiny_embedded):
    """New shards under the same indices would change what a resumed run's per-sample state refers to."""
    out = tmp_path / "o"
    shutil.copytree(tiny_embedded, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    one_line_error(
        capsys, main, ["embedded", "--out", str(out), *SMALL], f"--out {out}: already holds a data set ({out}/"
    )
    for name in ("zeroshot.json", "embedded.json"):  # a split's manifest alone is enough
        (out / name).unlink()
        del before[Path(name)]
    one_line_error(
        capsys, main, ["embedded", "--out", str(out), *SMALL], f"({out}/train/manifest.json); write to a new folder"
    )
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    mine = tmp_path / "mine"  # shards without a manifest (someone's own, or a build stopped before the end)
    (mine / "train").mkdir(parents=True)
    (mine / "train" / "train-000000.tar").write_text("mine")
    one_line_error(capsys, main, ["embedded", "--out", str(mine), *SMALL], f"({mine}/train/train-000000.tar)")
    assert (mine / "train" / "train-000000.tar").read_text() == "mine"


def test_embedded_refuses_a_dataset_named_twice(tmp_path, capsys):
    args = ["embedded", "--out", str(tmp_path / "o"), *SMALL, "--datasets", "mnist,mnist"]
    one_line_error(capsys, main, args, "--datasets mnist,mnist: mnist named twice; name each once")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- 2, 3. numeric flags out of range
SMALL = ["--datasets", "mnist", "--max-per-class", "1"]  # should a check be missing: a tiny build, not a long one


@pytest.mark.parametrize(
    "argv, words",
    [
        (["folder", "--captions", "c.csv", "--out", "o", "--index-offset", "-5"], ["argument --index-offset: -5 must"]),
        (["folder", "--captions", "c.csv", "--out", "o", "--shard-size", "0"], ["argument --shard-size: 0 must be >="]),
        (["scan", "d", "--samples-per-shard", "-1"], ["data scan", "argument --samples-per-shard: -1 must be >= 1"]),
        (["scan", "d", "--samples-per-shard", "0"], ["argument --samples-per-shard: 0 must be >= 1"]),
        (["embedded", "--out", "o", "--shard-size", "0", *SMALL], ["argument --shard-size: 0 must be >= 1"]),
        (["embedded", "--out", "o", "--index-offset", "-1", *SMALL], ["argument --index-offset: -1 must be >= 0"]),
        (["embedded", "--out", "o", "--seed", "-1", *SMALL], ["argument --seed: -1 must be >= 0"]),
        (["embedded", "--out", "o", "--val-fraction", "1.5", *SMALL], ["argument --val-fraction: 1.5 must be between"]),
        (["embedded", "--out", "o", "--max-val-per-class", "-1", *SMALL], ["--max-val-per-class -1: must be >= 1"]),
        (["embedded", "--source", "scenes", "--out", "o", "--num-val", "-1"], ["argument --num-val: -1 must be >= 0"]),
        (
            ["embedded", "--source", "scenes", "--out", "o", "--num-train", "0"],
            ["argument --num-train: 0 must be >= 1"],
        ),
    ],
)
def test_data_numbers_out_of_range_name_the_flag(argv, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.csv").write_text("filepath,title\nx.png,a cat\n")
    (tmp_path / "d").mkdir()
    one_line_error(capsys, main, argv, *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.csv", "d"]  # nothing written


# ----------------------------------------------------------------------------- 4. `data info` agrees with train
def test_data_info_refuses_a_global_batch_larger_than_the_data_as_train_does(tmp_path, capsys):
    write_synthetic(tmp_path / "d", [6, 6])
    spec = str(tmp_path / "d")
    one_line_error(
        capsys,
        main,
        ["info", spec, "--batch-size", "7", "--world-size", "2"],
        f"--batch-size 7 per process x 2 process(es) = 14 is larger than the data (12 samples per epoch in {spec})",
        "pass a smaller --batch-size",
    )
    assert main(["info", spec, "--batch-size", "6", "--world-size", "2"]) == 0  # exactly the data: one step
    assert json.loads(capsys.readouterr().out)["batches_per_epoch"] == 1


# ----------------------------------------------------------------------------- 5. scan of a truncated tar
def _truncated(folder, cut_in: str):
    """Two shards of 6 samples, the second cut inside the data of member `cut_in` or at its header."""
    write_synthetic(folder, [6, 6])
    (folder / "manifest.json").unlink()
    shard = folder / "train-000001.tar"
    with tarfile.open(shard) as tar:
        member = tar.getmember("000000011.png")
    truncate_file(shard, member.offset_data + 10 if cut_in == "data" else member.offset)
    return member.offset


@pytest.mark.parametrize(
    "cut_in, where, complete",
    [
        ("data", "unexpected end of data in member '000000011.png' at byte {at}, after key '000000010'", 5),
        ("header", "tar ends without an end-of-archive block at byte {at}, after key '000000009'", 4),
    ],
)
def test_scan_of_a_truncated_tar_names_the_shard_and_where_it_broke(cut_in, where, complete, tmp_path, capsys):
    folder = tmp_path / "d"
    at = _truncated(folder, cut_in)
    assert main(["scan", str(folder), "--workers", "1", "--strict"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"{folder}: 2 shards, {6 + complete} samples, data_size {6 + complete}, 1 problem ({{'truncated_tar': 1}})",
        f"  shard train-000001.tar: truncated_tar ({where.format(at=at)}; manifest counts the {complete} complete "
        f"samples)",
    ]
    assert captured.err == f"fastclip data scan: error: --strict: 1 problem found in {folder}, no manifest written\n"


# ----------------------------------------------------------------------------- 6. launch/single_node.sh
def _bare_path(tmp_path, **scripts) -> str:
    """A PATH with the tools the script needs and no python, unless given here (name -> shell script text)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "nproc"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def _launch(script, path: str, *args) -> subprocess.CompletedProcess:
    # (multi_node.sh asks for NNODES and MASTER_ADDR before anything else)
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "OMP_NUM_THREADS": "1", "NNODES": "1"}
    env["MASTER_ADDR"] = "127.0.0.1"
    return subprocess.run(
        [shutil.which("bash"), str(script), *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("script", ["single_node.sh", "multi_node.sh"])
def test_a_launcher_without_a_python_with_torch_says_to_run_setup_first(tmp_path, script):
    (tmp_path / "launch").mkdir()
    for name in (script, "python.sh"):  # a checkout without .venv
        shutil.copy(REPO / "launch" / name, tmp_path / "launch")
    no_torch = "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n"  # a system python
    out = _launch(
        tmp_path / "launch" / script,
        _bare_path(tmp_path, python=no_torch, python3=no_torch),
        "c.yaml",
        *(["2"] if script == "single_node.sh" else []),
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"launch/{script}: error: found no python with torch and fastclip")
    assert f"{tmp_path}/.venv/bin/python" in out.stderr and "run `bash launch/setup.sh` first" in out.stderr


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="no .venv (launch/setup.sh not run)")
def test_single_node_uses_the_project_venv_without_activation(tmp_path):
    out = _launch(REPO / "launch" / "single_node.sh", _bare_path(tmp_path), str(tmp_path / "no.yaml"), "2")
    # past the interpreter: train's own check of the config, one line, exit 2 (not `python: command not found`)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == f"fastclip train: config error: config file not found: {tmp_path / 'no.yaml'}"


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="no .venv (launch/setup.sh not run)")
@pytest.mark.parametrize(
    "script, args, env, said",
    [
        ("single_node.sh", [], {}, "usage: bash launch/single_node.sh CONFIG [NPROC]"),
        ("single_node.sh", ["c.yaml", "0"], {}, "launch/single_node.sh: error: NPROC '0' is not a number >= 1"),
        ("single_node.sh", ["c.yaml", "abc"], {}, "launch/single_node.sh: error: NPROC 'abc' is not a number >= 1"),
        ("multi_node.sh", ["c.yaml"], {"NNODES": "x"}, "launch/multi_node.sh: error: NNODES 'x' is not a number >= 1"),
        ("multi_node.sh", ["c.yaml"], {"MASTER_ADDR": ""}, "usage: NNODES=N MASTER_ADDR=host bash"),
        ("slurm.sbatch", ["c.yaml"], {}, "launch/slurm.sbatch: error: not inside a SLURM job; submit it with sbatch"),
    ],
)
def test_launcher_arguments_that_cannot_start_a_job_are_one_line(tmp_path, script, args, env, said):
    """(bash's own `unbound variable` or `division by 0` lines before)"""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "NNODES": "1", "MASTER_ADDR": "h"}
    out = subprocess.run(
        ["bash", str(REPO / "launch" / script), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and out.stdout == "", out
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith(said), out.stderr


def test_a_data_build_under_nohup_keeps_sighup_ignored(tmp_path, monkeypatch):
    """nohup ignores SIGHUP so that the build outlives a logout: the cleanup handler is not put in its place (SIGTERM
    gets it), and both are as they were afterwards."""
    import signal

    import fastclip.data.cli as cli
    from fastclip.stopping import _raise_stopped

    seen = {}

    def record(args):
        seen.update({kind: signal.getsignal(kind) for kind in (signal.SIGHUP, signal.SIGTERM)})
        return 0

    monkeypatch.setattr(cli, "_run", record)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert main(["embedded", "--out", str(tmp_path / "o")]) == 0
        assert seen == {signal.SIGHUP: signal.SIG_IGN, signal.SIGTERM: _raise_stopped}
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) != _raise_stopped
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize(
    "separator, text, said",
    [
        (";;", "filepath,title\na.png,cat\n", "--csv-separator ';;': must be one character"),
        ("\\", "filepath,title\na.png,cat\n", "must be one character"),
        (None, "filepath,title\na.png,caf\xe9\n", "not UTF-8 text (line 2: byte 0xe9 at offset 24); pass a UTF-8"),
    ],
)
def test_folder_separator_and_encoding_mistakes_are_one_line(tmp_path, capsys, separator, text, said):
    (tmp_path / "c.csv").write_bytes(text.encode("latin-1"))
    argv = ["folder", "--captions", str(tmp_path / "c.csv"), "--out", str(tmp_path / "o")]
    one_line_error(capsys, main, argv + (["--csv-separator", separator] if separator else []), said)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--images", "/nonexistent"], "--images /nonexistent: not a folder"),
        (["--prefix", "../escaped"], "--prefix '../escaped': must be a file name start without '/'"),
        (["--prefix", ""], "--prefix '': must be a file name start"),
    ],
)
def test_folder_flags_that_would_write_elsewhere_or_skip_every_row_are_one_line(tmp_path, capsys, extra, said):
    (tmp_path / "c.csv").write_text("filepath,title\na.png,cat\n")
    one_line_error(
        capsys, main, ["folder", "--captions", str(tmp_path / "c.csv"), "--out", str(tmp_path / "o"), *extra], said
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.csv"]
