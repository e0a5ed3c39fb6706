"""The linear probe and kNN of CLIP mode (eval.linear_probe, eval.knn; `fastclip eval --linear-probe --knn K`) in
ssl mode: a tiny ssl run logs them under CLIP mode's names, and they are fastclip.eval.probe's numbers on the image
tower's output; `fastclip eval` of the run and of its export gives the same; what cannot be scored is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_train_ssl import NO_GAMMA, ssl_args

from helpers import image_only_shards, load, one_line_error, records, step_dir

DATASETS = ("fashion-mnist", "mnist")  # the tiny embedded data: 40 training and 10 held-out images of each
STEPS = 3


@pytest.fixture(scope="module")
def probed(tiny_embedded, tmp_path_factory):
    from fastclip.train.cli import main as train_main

    run = tmp_path_factory.mktemp("ssl_probe") / "run"
    extra = {"train.max_steps": STEPS, "data.val": str(tiny_embedded / "val"), "eval.at_end": "true"}
    extra.update({"eval.linear_probe": "true", "eval.knn": "[3]", **NO_GAMMA})
    assert train_main(ssl_args(tiny_embedded, run, "ntxent", **extra)) == 0
    return run


def tower_features(run, split) -> dict:
    """Per dataset, the saved tower's output on the split's images (one batch, in data-index order)."""
    from fastclip.eval.probe import LabelledFeatures
    from fastclip.eval.samples import iter_samples
    from fastclip.models import build_model

    built = build_model("tiny-vit")
    visual = built.model.visual
    saved = load(step_dir(run, STEPS) / "model.pt")["state_dict"]
    visual.load_state_dict({k[len("visual.") :]: v for k, v in saved.items() if k.startswith("visual.")})
    samples = list(iter_samples(split))
    with torch.no_grad():
        features = visual.eval()(torch.stack([built.preprocess_val(s.image) for s in samples])).numpy()
    out = {}
    for name in DATASETS:
        rows = sorted((s.index, i) for i, s in enumerate(samples) if s.dataset == name)
        rows = [i for _, i in rows]
        out[name] = LabelledFeatures(features[rows], np.array([samples[i].label for i in rows], dtype=np.int64))
    return out


def test_the_logged_probe_is_fastclip_eval_probe_on_the_towers_output(probed, tiny_embedded):
    from fastclip.eval.probe import knn_top1, linear_probe

    (logged,) = [r for r in records(probed) if "eval/knn_top1" in r]
    assert logged["step"] == STEPS
    train, test = tower_features(probed, tiny_embedded / "train"), tower_features(probed, tiny_embedded / "val")
    for name in DATASETS:
        assert len(train[name]) == 40 and len(test[name]) == 10
        assert logged[f"eval/linear_probe/{name}/top1"] == linear_probe(train[name], test[name])[0]
        assert logged[f"eval/knn/{name}/top1"] == knn_top1(train[name], test[name], (3,))[3]


def eval_rows(argv, results) -> dict:
    """`fastclip eval` appending to `results` (a file that holds no other rows): {(task, dataset): top1}."""
    from fastclip.eval.cli import main as eval_main

    assert eval_main([*argv, "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert {r["features"] for r in rows} == {"tower"}
    return {(r["task"], r["dataset"]): r["top1"] for r in rows}


def test_fastclip_eval_of_the_run_and_of_its_export_gives_the_logged_numbers(probed, tiny_embedded, tmp_path, capsys):
    from fastclip.eval.export import main as export_main
    from fastclip.eval.summary import main as summary_main

    (logged,) = [r for r in records(probed) if "eval/knn_top1" in r]
    want = {(task, name): logged[f"eval/{task}/{name}/top1"] for task in ("linear_probe", "knn") for name in DATASETS}
    probe = ["--data", str(tiny_embedded), "--linear-probe", "--knn", "3"]
    assert eval_rows([str(probed), *probe], probed / "checkpoints" / "results.jsonl") == want
    out = capsys.readouterr().out
    assert "(tower)" in out and "zero-shot" not in out and "\n\n\n" not in out  # no empty table, one blank line
    assert summary_main([str(probed)]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if "kNN k=3" in line]
    assert (
        len(lines) == 2
        and lines[0][:3] == ["probes", "fashion-mnist", "linear"]
        and lines[1][:2] == ["mnist", "linear"]
    )
    tower = tmp_path / "export" / "tower.pt"
    assert export_main([str(probed), "--out", str(tower)]) == 0
    argv = [str(tower), "--arch", str(tower.parent / "tiny-vit.json"), *probe]
    assert eval_rows(argv, tower.parent / "results.jsonl") == want
    assert "\n\n\n" not in capsys.readouterr().out


def test_what_a_tower_cannot_be_scored_on_is_one_line_exit_2(probed, tiny_embedded, tmp_path, capsys):
    from fastclip.eval.cli import main as eval_main
    from fastclip.eval.export import main as export_main

    base = [str(probed), "--device", "cpu", "--results", str(tmp_path / "r.jsonl")]
    data = ["--data", str(tiny_embedded)]
    names = ["--classnames", str(tiny_embedded / "zeroshot.json")]
    one_line_error(capsys, eval_main, [*base, *data, *names, "--knn", "3"], "--classnames", "image tower alone")
    unlabelled = image_only_shards(tmp_path / "unlabelled")
    capsys.readouterr()
    assert eval_main([*base, "--data", str(unlabelled), "--linear-probe"]) == 2
    *progress, err = capsys.readouterr().err.strip().splitlines()  # the pass's progress line, then the error
    assert [line.split(":")[0] for line in progress] == ["eval"], progress
    assert err == f"fastclip eval: --data {unlabelled}: no labelled sample for the probe; pass labelled data"
    tower = tmp_path / "tower.pt"
    assert export_main([str(probed), "--out", str(tower)]) == 0
    assert "replaces" not in capsys.readouterr().out
    assert export_main([str(probed), "--out", str(tower)]) == 0  # again: an earlier export replaced, and said so
    assert f"wrote {tower} " in (out := capsys.readouterr().out) and "(it replaces the earlier export there)" in out
    argv = [str(tower), "--arch", str(tmp_path / "tiny-vit.json"), *data, "--device", "cpu"]
    one_line_error(capsys, eval_main, argv, "image tower alone", "--linear-probe or --knn K")
    # data with nothing to score for a CLIP model: the run is an image tower, said first (the look ahead's
    # "pass --classnames" led to the ssl refusal on the next try)
    from probe import fruit_samples, write_labelled_shards

    fruits = write_labelled_shards(tmp_path / "fruits", fruit_samples())
    argv = [str(probed), "--data", str(fruits), "--device", "cpu"]
    one_line_error(capsys, eval_main, argv, "a self-supervised run (ssl.enabled) has no text tower")
    assert not (tmp_path / "r.jsonl").exists()
