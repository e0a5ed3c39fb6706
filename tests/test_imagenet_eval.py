"""Zero-shot ImageNet (eval.imagenet_val, OpenCLIP's --imagenet-val): the class list and templates are open_clip's,
the folder is checked before training, images are decoded in loader workers, 2 ranks give the 1-rank numbers,
and the trainer logs the result.

The known answers come from the probe CLIP (tests/probe.py): 8 ImageNet classes whose names are one token embed
to one-hot vectors, every other class name to zero, so each image's rank of its true class is drawn with it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fastclip.compat import import_open_clip
from fastclip.eval.evaluate import evaluate
from fastclip.eval.imagenet import ImageNetSource, class_folders, imagenet_spec, list_images, prepared
from fastclip.train.cli import main
from fastclip.train.config import load_config

from dist_utils import run_distributed
from helpers import EMBEDDED, overrides, records
from probe import FRUIT_RANKS, ProbeCLIP, image_with_rank, probe_preprocess

# ImageNet class indices with one-token names (goldfish, stingray, ostrich, magpie, chameleon, scorpion, koala,
# flamingo): probe class i is ImageNet class PROBED[i]
PROBED = (1, 6, 9, 18, 47, 71, 105, 130)
# FRUIT_RANKS over 8 classes: top-1 hits 15 of 24, top-5 hits 20 of 24 (tests/test_eval_metrics.py)
TOP1, TOP5, IMAGES = 15 / 24, 20 / 24, 24


@pytest.fixture(scope="module")
def tokenizer():
    return import_open_clip().get_tokenizer("ViT-B-32")


def probe_model(tokenizer) -> ProbeCLIP:
    names = imagenet_spec().classnames
    return ProbeCLIP(tokenizer, {names[c]: torch.eye(8)[i] for i, c in enumerate(PROBED)})


def write_folder(root: Path, *, classes: int = 1000, corrupt: bool = True) -> Path:
    """An ImageNet val layout: `classes` synset-named folders, the probe's 24 images in 8 of them, one corrupt."""
    for c in range(classes):
        (root / f"n{c:08d}").mkdir(parents=True)
    for i, ranks in FRUIT_RANKS.items():
        for j, rank in enumerate(ranks):
            image_with_rank(i, rank, 8).save(root / f"n{PROBED[i]:08d}" / f"ILSVRC2012_val_{i:03d}{j}.png")
    if corrupt:
        (root / f"n{PROBED[2]:08d}" / "broken.JPEG").write_bytes(b"not an image")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("imagenet") / "val")


def test_class_names_and_templates_are_open_clips():
    spec = imagenet_spec()
    assert len(spec.classnames) == 1000
    # two names stand for two classes each in OpenAI's list (scored by index, so they stay as they are)
    repeated = sorted({n for n in spec.classnames if spec.classnames.count(n) > 1})
    assert repeated == ["missile", "sunglasses"] and len(set(spec.classnames)) == 998
    assert spec.classnames[:2] == ("tench", "goldfish") and spec.classnames[-1] == "toilet paper"
    assert len(spec.templates) == 80 and all("{}" in t for t in spec.templates)
    assert spec.prompts("koala")[0] == "a bad photo of a koala."
    assert len(imagenet_spec("simple").templates) == 7
    with pytest.raises(ValueError, match="templates 'laion': not one of openai, simple"):
        imagenet_spec("laion")


def test_folder_checks_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        class_folders(tmp_path / "missing")
    few = tmp_path / "few"
    for c in range(999):
        (few / f"n{c:08d}").mkdir(parents=True)
    with pytest.raises(ValueError, match="class folder 'n00000000' is not one of ImageNet's 1,000 synset ids"):
        class_folders(few)  # fewer than 1,000: a subset, whose folders must be ImageNet's synsets
    (few / "cats").mkdir()
    with pytest.raises(ValueError, match="class folder 'cats' is not one of ImageNet's 1,000 synset ids"):
        class_folders(few)
    (few / "dogs").mkdir()
    with pytest.raises(ValueError, match="1001 class folders; an ImageNet validation folder has 1000"):
        class_folders(few)
    numbered = tmp_path / "numbered"
    for c in range(1000):
        (numbered / f"{c:03d}").mkdir(parents=True)
    assert class_folders(numbered)[:3] == ["000", "001", "002"]
    # class folders without an image: refused (a run evaluated nothing, with no word, and logged no ImageNet key)
    from fastclip.eval.imagenet import read_variant

    with pytest.raises(ValueError, match=r"numbered: no image \(\.png.*\) in its 1,000 class folders"):
        read_variant(numbered)
    (numbered / "517" / "notes.txt").write_text("x")
    (numbered / "999" / "ILSVRC2012_val_00000001.JPEG").write_bytes(b"")  # found (decoding is the evaluation's)
    assert len(read_variant(numbered)[0].classnames) == 1000


def test_variants_with_a_subset_of_the_classes_or_unpadded_numbers(tmp_path, capsys):
    """ImageNet-R/-A: 200 synset folders, scored among their own 200 names (with a note); ImageNet-V2: folders
    0..999, whose sorted (string) order is not the class order: each folder gets its own class's name."""
    from fastclip.eval.imagenet import imagenet_synsets, subset_note

    synsets, names = imagenet_synsets(), imagenet_spec().classnames
    assert len(synsets) == 1000 == len(set(synsets)) and synsets == sorted(synsets) and synsets[1] == "n01443537"
    variant = tmp_path / "imagenet-r"
    for c in range(0, 1000, 5):
        (variant / synsets[c]).mkdir(parents=True)
    folders = class_folders(variant)
    assert len(folders) == 200
    assert imagenet_spec(folders=folders).classnames == tuple(names[c] for c in range(0, 1000, 5))
    assert "200 of ImageNet's 1,000 classes" in subset_note(variant, folders)
    assert subset_note(variant, synsets) is None
    v2 = tmp_path / "imagenet-v2"
    for c in range(1000):
        (v2 / str(c)).mkdir(parents=True)
    folders = class_folders(v2)
    assert folders[:3] == ["0", "1", "10"]
    assert imagenet_spec(folders=folders).classnames[:3] == (names[0], names[1], names[10])
    (variant / "n99999999").mkdir()
    from fastclip.eval.cli import main as eval_main

    argv = [str(tmp_path / "none.pt"), "--data", str(variant), "--classnames", "imagenet", "--device", "cpu"]
    assert eval_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"fastclip eval: {variant}: class folder 'n99999999' is not one of ImageNet's 1,000 synset ids "
        "(n01440764 ...) nor a class number below 1000; an ImageNet folder or variant has one folder per class, "
        "named so"
    )


def _score(model, tokenizer, source, preprocess):
    spec = imagenet_spec()
    return evaluate(
        model,
        tokenizer=tokenizer,
        preprocess=preprocess,
        source=source,
        specs={spec.name: spec},
        device="cpu",
        batch_size=5,
        retrieval=False,
    )


def test_known_answer_with_a_loader_worker(folder, tokenizer):
    model = probe_model(tokenizer)
    results = _score(model, tokenizer, ImageNetSource(folder, probe_preprocess, workers=1, batch_size=4), prepared)
    imagenet = results.zeroshot["imagenet"]
    assert imagenet.num_samples == IMAGES and results.skipped == 1  # the corrupt file, counted
    assert imagenet.top1 == pytest.approx(TOP1) and imagenet.top5 == pytest.approx(TOP5)
    # the same numbers as `fastclip eval --classnames imagenet` (decoded in the main process, folder order)
    from fastclip.eval.cli import image_folder_source

    in_process = _score(model, tokenizer, image_folder_source(folder, imagenet_spec(), "imagenet"), probe_preprocess)
    assert in_process.zeroshot["imagenet"].top1 == imagenet.top1
    assert in_process.zeroshot["imagenet"].top5 == imagenet.top5
    # two ranks' slices are disjoint and cover every image
    files = list_images(folder)
    mine = [[s.source for s in ImageNetSource(folder, probe_preprocess)(r, 2, [])] for r in (0, 1)]
    assert sorted(mine[0] + mine[1]) == sorted(p for p, _ in files if not p.endswith("broken.JPEG"))
    assert not set(mine[0]) & set(mine[1])


def _two_ranks(rank, world_size, folder):
    tokenizer = import_open_clip().get_tokenizer("ViT-B-32")
    results = _score(
        probe_model(tokenizer), tokenizer, ImageNetSource(folder, probe_preprocess, workers=0, batch_size=3), prepared
    )
    r = results.zeroshot["imagenet"]
    return r.num_samples, r.top1, r.top5, results.skipped


def test_two_ranks_give_the_one_rank_numbers(folder):
    assert run_distributed(_two_ranks, 2, str(folder)) == [(IMAGES, TOP1, TOP5, 1)] * 2


def test_trainer_scores_imagenet_at_its_evaluations(tiny_embedded, folder, tmp_path, capsys):
    run = tmp_path / "run"
    base = overrides(
        tiny_embedded,
        run,
        "fastclip-v3",
        **{"train.max_steps": 2, "data.batch_size": 16, "data.workers": 1, "train.precision": "bf16"},
    )
    bad = write_folder(tmp_path / "few", classes=999, corrupt=False)
    assert main(["--config", str(EMBEDDED), *base, "--imagenet-val", str(bad), "--eval.at_end", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config key 'eval.imagenet_val'" in err
    assert "class folder 'n00000000' is not one of ImageNet's 1,000 synset ids" in err  # 999 folders: a subset
    assert not (run / "metrics.jsonl").exists()
    args = ["--imagenet-val", str(folder), "--eval.imagenet_templates", "simple", "--eval.at_end", "true"]
    assert main(["--config", str(EMBEDDED), *base, *args]) == 0
    (ev,) = [r for r in records(run) if any(k.startswith("eval/") for k in r)]
    assert ev["step"] == 2
    assert ev["eval/zeroshot/imagenet/num_samples"] == IMAGES and ev["eval/zeroshot/imagenet/skipped_samples"] == 1
    assert 0.0 <= ev["eval/zeroshot/imagenet/top1"] <= ev["eval/zeroshot/imagenet/top5"] <= 1.0
    assert math.isfinite(ev["eval/zeroshot/fashion-mnist/top1"])  # data.val is still evaluated beside it
    assert load_config(run / "config.yaml").eval.imagenet_val == str(folder)
    # and `fastclip eval --classnames imagenet` on the run's checkpoint (one template: 1,000 prompts)
    from fastclip.eval.cli import main as eval_main

    templates = tmp_path / "templates.txt"
    templates.write_text("a photo of a {}.\n")
    common = ["--classnames", "imagenet", "--templates", str(templates), "--results", str(tmp_path / "r.jsonl")]
    assert eval_main([str(run), "--data", str(bad), *common]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "class folder 'n00000000' is not one of ImageNet's 1,000 synset ids" in err
    assert eval_main([str(run), "--data", str(folder), *common]) == 0
    out = capsys.readouterr().out
    assert "class names: ImageNet's class names (1,000, open_clip's)" in out and f"{IMAGES} samples" in out
