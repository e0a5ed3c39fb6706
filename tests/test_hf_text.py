"""Hugging Face text towers (`hf_model_name` in a model config): configs/models/tiny-vit-hf.json names a tiny
BERT folder shipped in the repo (config.json, vocab.txt); built with random weights and nothing downloaded,
trained, checkpointed, evaluated, and exported so that a plain open_clip loads it."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastclip.eval.checkpoint import load_model
from fastclip.eval.export import export_model
from fastclip.models import REPO_MODEL_CONFIGS, build_model

from helpers import full_disk_after

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = ["a photo of a coat.", "a handwritten digit seven.", "a small red sandal in the top left corner"]


def test_builds_offline_with_its_own_tokenizer_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the folder is found from the config file, not the working directory
    built = build_model("tiny-vit-hf")
    assert type(built.model.text).__name__ == "HFTextEncoder" and type(built.tokenizer).__name__ == "HFTokenizer"
    assert built.config["text_cfg"]["hf_model_name"] == str(REPO_MODEL_CONFIGS / "hf" / "tiny-bert")
    ids = built.tokenizer(CAPTIONS[:1])
    # [CLS] a photo of a coat . [SEP], then [PAD] up to the context length: words of the shipped vocab.txt
    assert ids.shape == (1, 32) and ids[0, :9].tolist() == [2, 18, 137, 132, 18, 106, 5, 3, 0]
    ids = built.tokenizer(["zebra xylophone"])[0]
    pieces = built.tokenizer.tokenizer.convert_ids_to_tokens(ids[ids != 0].tolist())
    assert pieces == [
        "[CLS]",
        "zebra",
        "x",
        "##y",
        "##l",
        "##o",
        "##p",
        "##h",
        "##o",
        "##n",
        "##e",
        "[SEP]",
    ]  # no [UNK]
    assert built.model.encode_text(built.tokenizer(CAPTIONS)).shape == (3, 64)


def test_a_missing_folder_is_named(tmp_path):
    config = json.loads((REPO_MODEL_CONFIGS / "tiny-vit-hf.json").read_text())
    config["text_cfg"]["hf_model_name"] = "roberta-base"  # a hub id: not fetched
    path = tmp_path / "hub-bert.json"
    path.write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match=r"text_cfg.hf_model_name 'roberta-base' is not a folder"):
        build_model(str(path))


@pytest.fixture(scope="module")
def run_dir(tiny_embedded, tmp_path_factory):
    """3 steps of fastclip-v3 on the tiny embedded shards, one process, a data worker (the tokenizer is pickled)."""
    from fastclip.train.config import load_config
    from fastclip.train.trainer import train

    run = tmp_path_factory.mktemp("hf") / "run"
    opts = {
        "model.arch": "tiny-vit-hf",
        "data.train": tiny_embedded / "train",
        "data.val": tiny_embedded / "val",
        "data.zeroshot": tiny_embedded / "zeroshot.json",
        "data.batch_size": 16,
        "data.workers": 1,
        "train.run_dir": run,
        "train.max_steps": 3,
        "train.log_every": 1,
        "train.progress": False,
        "train.tensorboard": False,
        "optim.warmup_steps": 1,
        "eval.every_steps": 0,
        "eval.at_end": True,
        "checkpoint.every_steps": 0,
        "checkpoint.every_minutes": 0,
    }
    result = train(
        load_config(REPO / "configs" / "embedded.yaml", [x for k, v in opts.items() for x in (f"--{k}", str(v))])
    )
    assert result["step"] == 3
    return run


def test_trains_checkpoints_and_evaluates(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert 0.0 <= records[-1]["eval/zeroshot/mean_top1"] <= 1.0
    saved = torch.load(run_dir / "checkpoints" / "step_00000003" / "model.pt", weights_only=True)
    assert (
        saved["arch"] == "tiny-vit-hf" and "text.transformer.encoder.layer.1.output.dense.weight" in saved["state_dict"]
    )
    loaded = load_model(run_dir).built
    assert torch.equal(loaded.model.state_dict()["text.proj.weight"], saved["state_dict"]["text.proj.weight"])


OPEN_CLIP_LOAD = """
import json, sys, torch
from fastclip.compat import import_open_clip
open_clip = import_open_clip()
config, weights, captions = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
open_clip.add_model_config(config)
model, _, _ = open_clip.create_model_and_transforms("tiny-vit-hf", pretrained=weights)
model.eval()
with torch.no_grad():
    print(json.dumps(model.encode_text(open_clip.get_tokenizer("tiny-vit-hf")(captions)).tolist()))
"""


def test_export_loads_in_plain_open_clip_and_survives_a_move(run_dir, tmp_path):
    written = export_model(run_dir, tmp_path / "export" / "model.pt")
    copied = tmp_path / "export" / "tiny-bert"
    assert sorted(p.name for p in copied.iterdir()) == ["config.json", "tokenizer_config.json", "vocab.txt"]
    assert json.loads(written["config_file"].read_text())["text_cfg"]["hf_model_name"] == str(copied)

    ours = load_model(run_dir).built
    with torch.no_grad():
        expected = ours.model.encode_text(ours.tokenizer(CAPTIONS))
    # a fresh interpreter elsewhere, open_clip alone, no offline switch set: builds from the copied folder
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", OPEN_CLIP_LOAD, str(written["config_file"]), str(written["file"]), json.dumps(CAPTIONS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert torch.allclose(torch.tensor(json.loads(out.stdout)), expected, atol=1e-5, rtol=0)

    moved = tmp_path / "moved"
    shutil.move(tmp_path / "export", moved)  # the config still names the old absolute folder
    again = load_model(moved / "model.pt", arch=str(moved / "tiny-vit-hf.json")).built
    with torch.no_grad():
        assert torch.allclose(again.model.encode_text(again.tokenizer(CAPTIONS)), expected, atol=1e-6, rtol=0)


def test_export_refuses_what_its_text_tower_copy_would_replace_before_writing_anything(run_dir, tmp_path, monkeypatch):
    """The copied Hugging Face folder lands beside the export: a file in its place, or a fifo where one of its files
    goes (copying into it would block), is refused with nothing written; a failure later leaves nothing either."""
    out = tmp_path / "a" / "model.pt"
    out.parent.mkdir()
    (out.parent / "tiny-bert").write_text("the operator's")
    with pytest.raises(ValueError, match=r"tiny-bert, the copy of the text tower's folder .* is not a folder"):
        export_model(run_dir, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny-bert"]

    out = tmp_path / "b" / "model.pt"
    (out.parent / "tiny-bert").mkdir(parents=True)
    os.mkfifo(out.parent / "tiny-bert" / "vocab.txt")
    with pytest.raises(ValueError, match=r"tiny-bert/vocab.txt, written beside it, exists and is a fifo"):
        export_model(run_dir, out)
    assert [p.name for p in out.parent.iterdir()] == ["tiny-bert"]

    out = tmp_path / "c" / "model.pt"  # passes the checks, then the disk fills while the folder is copied
    import fastclip.models

    monkeypatch.setattr(fastclip.models.shutil, "copyfile", full_disk_after(0, fastclip.models.shutil.copyfile))
    with pytest.raises(OSError, match="No space left"):
        export_model(run_dir, out)
    assert list(out.parent.iterdir()) == []  # no model, config, folder copy or staging folder


def test_copying_a_text_tower_folder_onto_itself_copies_nothing(tmp_path):
    """Exported into the folder that holds the Hugging Face folder: it is used as it is (copyfile onto the same
    file would raise SameFileError)."""
    from fastclip.models import copy_hf_folders

    shutil.copytree(REPO_MODEL_CONFIGS / "hf" / "tiny-bert", tmp_path / "tiny-bert")
    files = {p.name: p.read_bytes() for p in (tmp_path / "tiny-bert").iterdir()}
    config = {
        "text_cfg": {"hf_model_name": str(tmp_path / "tiny-bert"), "hf_tokenizer_name": str(tmp_path / "tiny-bert")}
    }
    assert copy_hf_folders(config, tmp_path) == config
    assert {p.name: p.read_bytes() for p in (tmp_path / "tiny-bert").iterdir()} == files


def test_a_failed_re_export_leaves_the_earlier_export_as_it_was(run_dir, tmp_path, monkeypatch):
    """Everything is staged and verified before it takes its final name: a re-export that fails (here open_clip
    builds another tower) changes none of the earlier export's files and leaves no staging folder."""
    import fastclip.eval.export as export

    written = export_model(run_dir, tmp_path / "model.pt")
    config = json.loads(written["config_file"].read_text())
    written["config_file"].write_text(json.dumps({**config, "from": "an earlier run"}))  # what a re-export replaces
    (tmp_path / "tiny-bert" / "vocab.txt").write_text("an earlier run's vocabulary")
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def builds_another(file, arch, config_file, state):
        assert config_file.parent != tmp_path  # verified from the staging folder, not the final place
        raise ValueError(f"the export of {arch!r} does not load back in open_clip (shape mismatch); nothing written")

    monkeypatch.setattr(export, "_verify_in_open_clip", builds_another)
    with pytest.raises(ValueError, match="nothing written"):
        export_model(run_dir, tmp_path / "model.pt", precision="bf16")
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_two_text_tower_folders_of_the_same_name_get_two_copies(tmp_path):
    from fastclip.models import copy_hf_folders

    for side in ("a", "b"):
        shutil.copytree(REPO_MODEL_CONFIGS / "hf" / "tiny-bert", tmp_path / side / "tok")
        (tmp_path / side / "tok" / "which.txt").write_text(side)
    config = {
        "text_cfg": {"hf_model_name": str(tmp_path / "a" / "tok"), "hf_tokenizer_name": str(tmp_path / "b" / "tok")}
    }
    dest = tmp_path / "export"
    dest.mkdir()
    copied = copy_hf_folders(config, dest)["text_cfg"]
    assert copied == {"hf_model_name": str(dest / "tok"), "hf_tokenizer_name": str(dest / "tok-2")}
    assert [(dest / n / "which.txt").read_text() for n in ("tok", "tok-2")] == ["a", "b"]


def test_a_text_tower_folder_already_beside_the_export_keeps_its_name(tmp_path):
    """out/tok is one of the config's folders (the run's own) and a/tok another: a/tok's copy is tok-2, so out/tok is
    never overwritten by the other folder's files."""
    from fastclip.models import copy_hf_folders, hf_folder_copies

    dest = tmp_path / "out"
    for folder in (dest / "tok", tmp_path / "a" / "tok"):
        shutil.copytree(REPO_MODEL_CONFIGS / "hf" / "tiny-bert", folder)
        (folder / "which.txt").write_text(folder.parent.name)
    config = {"text_cfg": {"hf_model_name": str(dest / "tok"), "hf_tokenizer_name": str(tmp_path / "a" / "tok")}}
    assert hf_folder_copies(config, dest) == [(tmp_path / "a" / "tok", dest / "tok-2"), (dest / "tok", dest / "tok")]
    copied = copy_hf_folders(config, dest)["text_cfg"]
    assert copied == {"hf_model_name": str(dest / "tok"), "hf_tokenizer_name": str(dest / "tok-2")}
    assert [(dest / n / "which.txt").read_text() for n in ("tok", "tok-2")] == ["out", "a"]


def test_export_beside_a_text_tower_folder_linked_to_another_disk(run_dir, tmp_path):
    """out/tiny-bert a link to a folder on another file system (here /dev/shm): the copied files cross devices, where
    a rename fails (EXDEV)."""
    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system at /dev/shm")
    import tempfile

    with tempfile.TemporaryDirectory(dir=other) as far:
        out = tmp_path / "export" / "model.pt"
        out.parent.mkdir()
        (out.parent / "tiny-bert").symlink_to(far)
        export_model(run_dir, out)
        assert sorted(p.name for p in Path(far).iterdir()) == ["config.json", "tokenizer_config.json", "vocab.txt"]
        assert out.is_file() and not list(out.parent.glob(".fastclip-export-*"))


def test_export_with_two_tower_folders_of_one_name_one_already_beside_it(run_dir, tmp_path):
    """The config names out/tok (the run's own folder, beside --out) and a/tok: out/tok keeps its files, a/tok is
    copied to out/tok-2, and the exported config names each where its files are (staged under the same names)."""
    model = torch.load(run_dir / "checkpoints" / "step_00000003" / "model.pt", weights_only=True)
    out = tmp_path / "out" / "model.pt"
    for folder in (out.parent / "tok", tmp_path / "a" / "tok"):
        shutil.copytree(REPO_MODEL_CONFIGS / "hf" / "tiny-bert", folder)
        (folder / "which.txt").write_text(folder.parent.name)
    text = model["model_config"]["text_cfg"]
    text["hf_model_name"], text["hf_tokenizer_name"] = str(out.parent / "tok"), str(tmp_path / "a" / "tok")
    source = tmp_path / "model.pt"
    torch.save(model, source)
    written = export_model(source, out)
    assert [(out.parent / n / "which.txt").read_text() for n in ("tok", "tok-2")] == ["out", "a"]
    exported = json.loads(written["config_file"].read_text())["text_cfg"]
    assert exported["hf_model_name"] == str(out.parent / "tok")
    assert exported["hf_tokenizer_name"] == str(out.parent / "tok-2")


def test_a_failed_export_leaves_no_staged_config_in_open_clips_registry(run_dir, tmp_path, monkeypatch):
    """The check registers the staged config, which names the staged text tower folder, in open_clip's
    process-wide registry. When the check fails (here the staged model file misses a tensor, so open_clip's strict
    load refuses it), open_clip in this process must still build the architecture: from folders that exist."""
    import fastclip.eval.export as export
    from fastclip.compat import import_open_clip

    open_clip = import_open_clip()
    save_file = export.ckpt.save_file

    def drops_a_tensor(obj, path):
        save_file({"state_dict": {k: v for k, v in obj["state_dict"].items() if k != "logit_scale"}}, path)

    monkeypatch.setattr(export.ckpt, "save_file", drops_a_tensor)
    with pytest.raises(ValueError, match=r"does not load back in open_clip .*Missing key.*logit_scale"):
        export_model(run_dir, tmp_path / "model.pt")
    assert not [p for p in open_clip.factory._MODEL_CONFIG_PATHS if ".fastclip-export-" in str(p)]
    text = open_clip.get_model_config("tiny-vit-hf")["text_cfg"]
    assert Path(text["hf_model_name"]).is_dir() and Path(text["hf_tokenizer_name"]).is_dir()
    assert type(open_clip.create_model("tiny-vit-hf", pretrained_hf=False).text).__name__ == "HFTextEncoder"
