"""`fastclip export`: open_clip loads the file (weights_only) and computes the same embeddings as our model;
`fastclip eval` gives the same numbers from the training checkpoint and from the export."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastclip.compat import import_open_clip
from fastclip.eval import export as export_cli
from fastclip.eval.checkpoint import load_model
from fastclip.eval.cli import main as eval_main
from fastclip.eval.export import export_model

from helpers import EMBEDDED
from probe import fruit_samples, write_labelled_shards, zeroshot_json

# a name open_clip does not know: only the exported <arch>.json can tell it how to build the model
ARCH = "export-test-vit"
LOSS_LOGIT_SCALE = 3.25


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A training run as the trainer leaves it (INTERFACES.md checkpoint layout), random tiny-vit weights."""
    from fastclip.models import build_model

    torch.manual_seed(0)
    built = build_model("tiny-vit")
    run = tmp_path_factory.mktemp("run")
    step_dir = run / "checkpoints" / "step_00000007"
    step_dir.mkdir(parents=True)
    torch.save(
        {
            "state_dict": built.model.state_dict(),
            "arch": ARCH,
            "model_config": built.config,
            "loss": {"logit_scale": torch.tensor(LOSS_LOGIT_SCALE)},
            "optimizer": {},
            "scaler": {},
            "step": 7,
            "epoch": 0,
            "config": {"model": {"arch": ARCH}},
        },
        step_dir / "model.pt",
    )
    (run / "checkpoints" / "latest").write_text("step_00000007\n")
    return run


@pytest.fixture(scope="module")
def images():
    from PIL import Image

    torch.manual_seed(1)
    pixels = (torch.rand(4, 40, 40, 3) * 255).to(torch.uint8).numpy()
    return [Image.fromarray(p) for p in pixels]


def embeddings(model, preprocess, tokenizer, images):
    with torch.no_grad():
        image = model.encode_image(torch.stack([preprocess(i) for i in images]))
        text = model.encode_text(tokenizer(["a photo of a cat.", "a sneaker", "a handwritten digit seven"]))
    return image, text


def test_export_loads_in_open_clip_with_the_same_embeddings(run_dir, tmp_path, images):
    written = export_model(run_dir, tmp_path / "out" / "model.pt")
    assert written["config_file"] == tmp_path / "out" / f"{ARCH}.json"
    payload = torch.load(written["file"], weights_only=True)
    assert set(payload) == {"state_dict"}
    assert all(isinstance(v, torch.Tensor) for v in payload["state_dict"].values())

    open_clip = import_open_clip()
    open_clip.add_model_config(str(written["config_file"]))
    theirs, _, preprocess = open_clip.create_model_and_transforms(ARCH, pretrained=str(written["file"]))
    theirs.eval()
    ours = load_model(run_dir).built
    assert float(theirs.logit_scale.detach()) == LOSS_LOGIT_SCALE  # the loss's temperature, not the tower's frozen one
    assert float(ours.model.logit_scale.detach()) == LOSS_LOGIT_SCALE
    ours_image, ours_text = embeddings(ours.model, ours.preprocess_val, ours.tokenizer, images)
    their_image, their_text = embeddings(theirs, preprocess, open_clip.get_tokenizer(ARCH), images)
    assert torch.equal(ours_image, their_image)
    assert torch.equal(ours_text, their_text)


def test_bf16_export(run_dir, tmp_path, images):
    written = export_model(run_dir / "checkpoints" / "step_00000007", tmp_path / "bf16.pt", precision="bf16")
    state = torch.load(written["file"], weights_only=True)["state_dict"]
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.bfloat16}
    open_clip = import_open_clip()
    open_clip.add_model_config(str(written["config_file"]))
    theirs, _, preprocess = open_clip.create_model_and_transforms(ARCH, pretrained=str(written["file"]))
    theirs.eval()
    ours = load_model(run_dir).built
    ours_image, _ = embeddings(ours.model, ours.preprocess_val, ours.tokenizer, images)
    their_image, _ = embeddings(theirs, preprocess, open_clip.get_tokenizer(ARCH), images)
    cosine = torch.nn.functional.cosine_similarity(ours_image, their_image)
    assert cosine.min() > 0.99  # bf16 weights: ~3 significant digits
    assert math.isclose(float(theirs.logit_scale.detach()), LOSS_LOGIT_SCALE, rel_tol=1e-2)


def test_export_reads_the_checkpoint_once_so_a_running_jobs_pruning_cannot_break_it(run_dir, tmp_path, monkeypatch):
    """A running job's keep_last removes old steps: the export read model.pt, then opened it again by its path and
    failed 4 times in 4 on a live run ("checkpoint not found", exit 2). Here the file goes right after its read."""
    import shutil

    from fastclip import checkpoint as ckpt

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    read = ckpt.read_model_file

    def read_then_pruned(file):
        contents = read(file)
        shutil.rmtree(Path(file).parent)  # the trainer's keep_last, between the export's read and its checks
        return contents

    monkeypatch.setattr(ckpt, "read_model_file", read_then_pruned)
    written = export_model(copy, tmp_path / "m.pt")
    assert written["file"].is_file() and not written["source"].exists()


def test_export_cli_prints_the_loading_code(run_dir, tmp_path, capsys):
    assert export_cli.main([str(run_dir), "--out", str(tmp_path / "m.pt")]) == 0
    out = capsys.readouterr().out
    assert f"open_clip.add_model_config('{tmp_path / (ARCH + '.json')}')" in out
    assert f"create_model_and_transforms('{ARCH}', pretrained='{tmp_path / 'm.pt'}')" in out
    assert "logit_scale = 3.2500" in out and "as written" not in out  # (3.25: exact in every precision)
    assert "note:" not in out and "logit_bias" not in out  # (the note on a loss without a scale followed it)
    # bf16 rounds the loss's learned value: it printed the rounded one as what the loss learned
    learned = tmp_path / "learned"
    shutil.copytree(run_dir, learned)
    model_file = learned / "checkpoints" / "step_00000007" / "model.pt"
    contents = torch.load(model_file, weights_only=True)
    contents["loss"]["logit_scale"] = torch.tensor(2.6988)
    torch.save(contents, model_file)
    assert export_cli.main([str(learned), "--out", str(tmp_path / "bf16.pt"), "--precision", "bf16"]) == 0
    assert "logit_scale = 2.6988 (tau = 0.0673) from the loss (2.7031 as written in bf16)" in capsys.readouterr().out
    # the lines run as printed, in a fresh process (a bare `import open_clip` failed there on this CPU torch)
    code = out.split("load it with:\n", 1)[1] + "\nprint(type(model).__name__, len(tokenizer(['a cat'])[0]))"
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert ran.returncode == 0 and ran.stdout.split()[0] in ("CLIP", "CustomTextCLIP"), ran.stderr[-2000:]
    # an exported file is not a training checkpoint: say what is missing
    assert export_cli.main([str(tmp_path / "m.pt"), "--out", str(tmp_path / "again.pt")]) == 2
    assert "no 'arch'" in capsys.readouterr().err


def test_eval_cli_same_numbers_from_checkpoint_and_export(run_dir, tmp_path, capsys):
    data = tmp_path / "embedded"
    write_labelled_shards(data / "val", fruit_samples(), shard_size=10)
    (data / "zeroshot.json").write_text(json.dumps(zeroshot_json()))
    exported = export_model(run_dir, tmp_path / "export" / "model.pt")["file"]
    results = tmp_path / "results.jsonl"

    assert eval_main([str(run_dir), "--data", str(data), "--results", str(results)]) == 0
    printed = capsys.readouterr()
    table = printed.out
    assert printed.err.splitlines()[-1].startswith("eval: 24/24 samples (")  # progress: a line when not a terminal
    assert "fruits" in table and "apple" in table  # per-class rows for <= 20 classes
    # one caption per fruit: retrieval is written to the results file but not shown as a result
    assert "retrieval omitted: 24 images share 8 distinct captions" in table and "image->text" not in table
    # the export's architecture is found from the <arch>.json written beside it
    assert eval_main([str(exported), "--data", str(data), "--results", str(results)]) == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    expected = [("zeroshot_classification", "fruits"), ("retrieval", None)] * 2
    assert [(r["task"], r.get("dataset")) for r in rows] == expected
    assert rows[0]["step"] == 7 and rows[0]["num_samples"] == 24 and rows[1]["num_samples"] == 24
    assert rows[1]["distinct_captions"] == 8
    strip = lambda r: {k: v for k, v in r.items() if k not in ("time", "checkpoint", "step")}  # noqa: E731
    assert [strip(r) for r in rows[:2]] == [strip(r) for r in rows[2:]]
    assert set(rows[0]["per_class"]) == {"apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum"}
    assert "max_samples" not in rows[0]  # a spot check says so in its records (summary keeps the full one first)
    assert eval_main([str(exported), "--data", str(data), "--results", str(results), "--max-samples", "10"]) == 0
    spot = [json.loads(line) for line in results.read_text().splitlines()][4:]
    assert [(r["max_samples"], r["num_samples"]) for r in spot] == [(10, 10), (10, 10)]


def test_eval_cli_errors_name_the_file(tmp_path, run_dir, capsys):
    assert eval_main([str(tmp_path / "nope"), "--data", str(tmp_path)]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    (tmp_path / "names.json").write_text(json.dumps({"classnames": ["a"], "templates": ["no slot"]}))
    write_labelled_shards(tmp_path / "val", fruit_samples()[:2])
    assert eval_main([str(run_dir), "--data", str(tmp_path / "val"), "--classnames", str(tmp_path / "names.json")]) == 2
    assert "names.json: template 0" in capsys.readouterr().err


def test_a_disk_that_fills_while_exporting_is_one_line_status_1_and_leaves_no_file(
    run_dir, tmp_path, capsys, monkeypatch
):
    """Not a usage error (the checkpoint and --out are fine): status 1, and neither the export nor its temporary
    file is left behind."""
    from fastclip import checkpoint as ckpt

    real = ckpt.save_file

    def fills_up(obj, path):
        real(obj, path)  # the bytes land, then the disk is full before they reach it
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", fills_up)
    out = tmp_path / "e" / "model.pt"
    assert export_cli.main([str(run_dir), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"fastclip export: --out {out}: cannot write it (No space left on device); free space or choose " + (
        "another --out"
    )
    assert list(out.parent.iterdir()) == []


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_while_the_export_takes_its_final_names_acts_once_it_is_whole(
    run_dir, tmp_path, monkeypatch, capsys, name
):
    """The moves out of the staging folder are one update: SIGTERM (or Ctrl-C) in the middle of them waits until
    the export is whole and the staging folder gone, then stops the command (128 + N) saying so."""
    import os
    import signal

    number, handler = getattr(signal, name), signal.getsignal(getattr(signal, name))
    commit = export_cli._commit

    def signalled_midway(*args):
        os.kill(os.getpid(), number)
        commit(*args)

    monkeypatch.setattr(export_cli, "_commit", signalled_midway)
    out = tmp_path / "model.pt"
    assert export_cli.main([str(run_dir), "--out", str(out)]) == 128 + number
    assert capsys.readouterr().err == f"fastclip export: stopped by {name} after {out} was written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{ARCH}.json", "model.pt"]  # no staging folder
    monkeypatch.undo()
    assert export_cli.main([str(run_dir), "--out", str(tmp_path / "again.pt")]) == 0
    assert torch.load(out, weights_only=True).keys() == torch.load(tmp_path / "again.pt", weights_only=True).keys()
    assert signal.getsignal(number) == handler  # put back as it was


def test_sigterm_before_the_export_is_whole_leaves_the_earlier_one(run_dir, tmp_path, monkeypatch, capsys):
    import os
    import signal

    out = tmp_path / "model.pt"
    export_model(run_dir, out)
    before = _files(tmp_path)
    verify = export_cli._verify_in_open_clip

    def signalled_while_checking(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        verify(*args)

    monkeypatch.setattr(export_cli, "_verify_in_open_clip", signalled_while_checking)
    assert export_cli.main([str(run_dir), "--out", str(out), "--precision", "bf16"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == (
        "fastclip export: stopped by SIGTERM before anything was written (an earlier export there is as it was)\n"
    )
    assert _files(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == [f"{ARCH}.json", "model.pt"]


def test_a_stop_just_before_the_final_names_leaves_no_staging_folder(run_dir, tmp_path, monkeypatch, capsys):
    """SIGTERM after the check, before the moves begin: nothing written, the staging folder (a whole model) gone."""
    import contextlib
    import os
    import signal

    deferred = export_cli.signals_deferred

    @contextlib.contextmanager
    def signalled_on_entry():
        os.kill(os.getpid(), signal.SIGTERM)
        with deferred():
            yield

    monkeypatch.setattr(export_cli, "signals_deferred", signalled_on_entry)
    assert export_cli.main([str(run_dir), "--out", str(tmp_path / "model.pt")]) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM before anything was written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _edited(run_dir, tmp_path, **change):
    """A copy of run_dir's checkpoint with `change` applied to its model.pt (keys, or state_dict entries)."""
    checkpoint = torch.load(run_dir / "checkpoints" / "step_00000007" / "model.pt", weights_only=True)
    for key, value in change.items():
        if key in checkpoint:
            checkpoint[key] = value
        else:
            checkpoint["state_dict"][key] = value
    folder = tmp_path / "step_00000007"
    folder.mkdir(parents=True)
    torch.save(checkpoint, folder / "model.pt")
    return folder


def test_a_diverged_checkpoint_is_refused_by_export_and_eval_naming_nan(run_dir, tmp_path, capsys):
    """Weights holding NaN (issue 39: eval printed chance-level scores and exited 0; export said "other values
    for ['visual.proj']"): one line naming NaN and the tensors, status 2, nothing written."""
    proj = torch.load(run_dir / "checkpoints" / "step_00000007" / "model.pt", weights_only=True)["state_dict"]
    folder = _edited(run_dir, tmp_path, **{"visual.proj": torch.full_like(proj["visual.proj"], float("nan"))})
    said = f"{folder / 'model.pt'}: its weights hold NaN/Inf in 1 tensor(s) (e.g. visual.proj): the run diverged"
    assert export_cli.main([str(folder), "--out", str(tmp_path / "out" / "m.pt")]) == 2
    assert capsys.readouterr().err.startswith(f"fastclip export: {said}")
    assert not (tmp_path / "out").exists()
    write_labelled_shards(tmp_path / "val", fruit_samples()[:4])
    (tmp_path / "zeroshot.json").write_text(json.dumps(zeroshot_json()))
    assert (
        eval_main([str(folder), "--data", str(tmp_path / "val"), "--classnames", str(tmp_path / "zeroshot.json")]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fastclip eval: {said}") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("arch", ["tiny-vit-hf", "ViT-B-32"])
def test_a_checkpoint_whose_arch_field_is_not_what_it_trained_is_not_exported(run_dir, tmp_path, capsys, arch):
    """The export takes its name from the arch field: naming another of our architectures, or open_clip's built-in
    ViT-B-32 (whose name the written config would shadow), was exported with status 0 (issue 39)."""
    folder = _edited(run_dir, tmp_path, arch=arch)
    assert export_cli.main([str(folder), "--out", str(tmp_path / "out" / "m.pt")]) == 2
    assert capsys.readouterr().err.startswith(
        f"fastclip export: {folder / 'model.pt'}: its arch field says {arch!r} but the run trained {ARCH!r}"
    )
    if arch == "ViT-B-32":  # a file without its training config: the built-in name's shipped config tells
        folder = _edited(run_dir, tmp_path / "no-config", arch=arch, config={})
        assert export_cli.main([str(folder), "--out", str(tmp_path / "out" / "m.pt")]) == 2
        assert "its arch field says 'ViT-B-32', open_clip's built-in architecture, but its model_config is another" in (
            capsys.readouterr().err
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tower_has_bias", [False, True])
def test_a_sigmoid_losss_learned_bias_is_exported_with_its_scale(
    tmp_path, images, capsys, tower_has_bias, tiny_embedded
):
    """A SigLIP run's export dropped the loss's learned logit_bias: open_clip's model had none (or its tower's
    frozen initial one), so sigmoid(scale * sim + bias) could not be computed from the export."""
    from fastclip.models import build_model

    torch.manual_seed(0)
    built = build_model("tiny-vit")
    state, config = dict(built.model.state_dict()), dict(built.config)
    if tower_has_bias:  # a config with open_clip's init_logit_bias: the tower holds its initial value
        state["logit_bias"], config["init_logit_bias"] = torch.tensor(-10.0), -10.0
    step_dir = tmp_path / "run" / "checkpoints" / "step_00000003"
    step_dir.mkdir(parents=True)
    loss = {"logit_scale": torch.tensor(2.5), "logit_bias": torch.tensor(-7.25)}
    torch.save(
        {"state_dict": state, "arch": ARCH, "model_config": config, "loss": loss, "step": 3}, step_dir / "model.pt"
    )
    out = tmp_path / "out" / "model.pt"
    assert export_cli.main([str(step_dir), "--out", str(out)]) == 0
    assert "logit_bias = -7.2500 from the loss (model.logit_bias)" in capsys.readouterr().out
    written_config = json.loads((tmp_path / "out" / f"{ARCH}.json").read_text())
    assert written_config["init_logit_bias"] == (-10.0 if tower_has_bias else -7.25)
    assert float(torch.load(out, weights_only=True)["state_dict"]["logit_bias"]) == -7.25

    open_clip = import_open_clip()
    open_clip.add_model_config(str(tmp_path / "out" / f"{ARCH}.json"))
    theirs, _, preprocess = open_clip.create_model_and_transforms(ARCH, pretrained=str(out))
    theirs.eval()
    assert (float(theirs.logit_scale.detach()), float(theirs.logit_bias.detach())) == (2.5, -7.25)
    ours = load_model(step_dir).built
    ours_image, ours_text = embeddings(ours.model, ours.preprocess_val, ours.tokenizer, images)
    their_image, their_text = embeddings(theirs, preprocess, open_clip.get_tokenizer(ARCH), images)
    assert torch.equal(ours_image, their_image) and torch.equal(ours_text, their_text)
    # the export is still the towers' weights for fastclip, where the loss holds the bias: --model.pretrained and
    # eval --arch of the architecture trained took it before the bias was exported, and take it now
    from fastclip.train.cli import main as train_main

    data = ["--data.train", str(tiny_embedded / "train"), "--data.val", "null", "--data.zeroshot", "null"]
    given = ["--model.arch", "tiny-vit", "--model.pretrained", str(out), "--train.run_dir", str(tmp_path / "r")]
    assert train_main(["--check", "--config", str(EMBEDDED), *data, *given]) == 0, capsys.readouterr().err
    assert load_model(out, arch="tiny-vit").built.arch == "tiny-vit"
