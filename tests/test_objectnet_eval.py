"""ObjectNet from its download's layout (images/<folder>/*.png, mappings/*): a synthetic copy with 4 classes that
overlap ImageNet and one that does not, scored by the probe CLIP (tests/probe.py), whose image embedding is the
first pixel row's red channel, so every answer is known.

The convention checked is the CLIP paper's (Taori et al.'s testbed): the ImageNet classes the mapping names are
prompted, and an image is a hit when the best of them is one of its class's; the 1-pixel red border is cropped
first (left in, it would be the first row: every class would tie).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from fastclip.compat import import_open_clip
from fastclip.eval.evaluate import evaluate
from fastclip.eval.imagenet import (
    ImageNetSource,
    crop_border,
    imagenet_spec,
    prepared,
    read_objectnet,
    read_variant,
)

from probe import ProbeCLIP, probe_preprocess

# the probe's 8 dimensions: ImageNet classes with one-token names (goldfish, stingray, ostrich, magpie, chameleon,
# scorpion, koala, flamingo)
PROBED = (1, 6, 9, 18, 47, 71, 105, 130)
GOLDFISH, STINGRAY, OSTRICH, MAGPIE, CHAMELEON, SCORPION, KOALA, FLAMINGO = range(8)
# ImageNet's label lines (imagenet_to_label_2012_v2) name them so; the ObjectNet mapping uses these names
LINES = {
    1: "goldfish, Carassius auratus",
    6: "stingray",
    9: "ostrich, Struthio camelus",
    18: "magpie",
    47: "African chameleon, Chamaeleo chamaeleon",
    71: "scorpion",
    105: "koala, koala bear, kangaroo bear, native bear, Phascolarctos cinereus",
    130: "flamingo",
}
FOLDERS = {
    "fish_toy": "Fish toy",
    "bird_figurine": "Bird figurine",
    "lizard": "Lizard",
    "bug": "Bug",
    "air_freshener": "Air freshener",  # not an ImageNet class: its images are left out
}
TO_IMAGENET = {
    "Fish toy": f"{LINES[1]}; {LINES[6]}",
    "Bird figurine": f"{LINES[9]}; {LINES[18]}; {LINES[130]}",
    "Lizard": LINES[47],
    "Bug": LINES[71],
}
# folder -> images, each {probe dimension: score}; the comment says the rank of the best of its class's ImageNet
# classes among the 7 prompted (koala is in no class's list, so it is not prompted)
IMAGES = {
    "fish_toy": [
        {GOLDFISH: 200, STINGRAY: 10, OSTRICH: 10},  # goldfish first: hit
        {STINGRAY: 200, GOLDFISH: 100},  # stingray first, the other fish class: hit
        {OSTRICH: 200, STINGRAY: 150},  # ostrich first, stingray 2nd: top-5 only
    ],
    "bird_figurine": [
        {FLAMINGO: 250},  # hit
        {KOALA: 255, MAGPIE: 100},  # koala is not prompted: magpie is first, hit
        {CHAMELEON: 200, SCORPION: 190, GOLDFISH: 180, STINGRAY: 170, MAGPIE: 160},  # 5th: top-5 only
    ],
    "lizard": [
        {CHAMELEON: 100},  # hit
        {SCORPION: 240, GOLDFISH: 230, STINGRAY: 220, OSTRICH: 210, MAGPIE: 200, FLAMINGO: 190, CHAMELEON: 180},  # 7th
    ],
    "bug": [{SCORPION: 50, OSTRICH: 40}],  # hit
    "air_freshener": [{GOLDFISH: 255}],  # left out
}
TOP1, TOP5, SCORED = 6 / 9, 8 / 9, 9
PER_CLASS = {"Bird figurine": 2 / 3, "Bug": 1.0, "Fish toy": 2 / 3, "Lizard": 1 / 2}


def bordered_image(scores: dict[int, int], size: int = 16) -> Image.Image:
    """A probe image (row 0 holds the scores) inside ObjectNet's 1-pixel red frame."""
    pixels = np.zeros((size + 2, size + 2, 3), dtype=np.uint8)
    pixels[0, :, 0] = pixels[-1, :, 0] = pixels[:, 0, 0] = pixels[:, -1, 0] = 255
    for dim, score in scores.items():
        pixels[1, 1 + dim, 0] = score
    return Image.fromarray(pixels)


def write_objectnet(root: Path, *, corrupt: bool = True) -> Path:
    """ObjectNet's layout. The PyTorch index -> ImageNet 2012 id map is a permutation (id = 7p + 3 mod 1000), so
    a reader that skips it prompts the wrong ImageNet classes."""
    mappings = root / "mappings"
    mappings.mkdir(parents=True)
    pytorch_to_id = {str(p): (7 * p + 3) % 1000 for p in range(1000)}
    lines = [f"label of 2012 id {i}" for i in range(1000)]
    for index, line in LINES.items():
        lines[pytorch_to_id[str(index)]] = line
    (mappings / "pytorch_to_imagenet_2012_id.json").write_text(json.dumps(pytorch_to_id))
    (mappings / "imagenet_to_label_2012_v2").write_text("\n".join(lines) + "\n")
    (mappings / "folder_to_objectnet_label.json").write_text(json.dumps(FOLDERS))
    (mappings / "objectnet_to_imagenet_1k.json").write_text(json.dumps(TO_IMAGENET))
    for folder, images in IMAGES.items():
        (root / "images" / folder).mkdir(parents=True)
        for i, scores in enumerate(images):
            bordered_image(scores).save(root / "images" / folder / f"{i:04x}.png")
    if corrupt:
        (root / "images" / "lizard" / "broken.png").write_bytes(b"not an image")
    return root


@pytest.fixture(scope="module")
def objectnet(tmp_path_factory) -> Path:
    return write_objectnet(tmp_path_factory.mktemp("objectnet") / "objectnet-1.0")


@pytest.fixture(scope="module")
def probe_model():
    tokenizer = import_open_clip().get_tokenizer("ViT-B-32")
    names = imagenet_spec().classnames
    model = ProbeCLIP(tokenizer, {names[c]: torch.eye(8)[i] for i, c in enumerate(PROBED)})
    return model, tokenizer


def test_mapping_is_read_through_its_four_files(objectnet):
    read = read_objectnet(objectnet)
    assert read.classnames == ("Bird figurine", "Bug", "Fish toy", "Lizard")  # sorted folders: the label order
    assert read.folders == {0: "bird_figurine", 1: "bug", 2: "fish_toy", 3: "lizard"}
    assert read.imagenet == ((9, 18, 130), (71,), (1, 6), (47,))
    assert read.left_out == ("air_freshener",)
    spec, note = read_variant(objectnet)
    names = imagenet_spec().classnames
    assert spec.name == "objectnet" and spec.classnames == read.classnames and len(spec.templates) == 80
    assert spec.prompted == tuple(names[c] for c in (1, 6, 9, 18, 47, 71, 130))
    assert spec.pool == ((2, 3, 6), (5,), (0, 1), (4,))
    assert "4 classes that overlap ImageNet" in note and "its 1 other class folders are left out" in note


def test_border_is_cropped():
    image = bordered_image({GOLDFISH: 7})
    cropped = np.asarray(crop_border(image))
    assert cropped.shape == (16, 16, 3) and cropped[0, 0, 0] == 7 and cropped[:, :, 0].max() == 7


def test_known_answer_with_a_loader_worker(objectnet, probe_model):
    model, tokenizer = probe_model
    spec, _ = read_variant(objectnet)
    results = evaluate(
        model,
        tokenizer=tokenizer,
        preprocess=prepared,
        source=ImageNetSource(objectnet, probe_preprocess, workers=1, batch_size=4),
        specs={spec.name: spec},
        device="cpu",
        batch_size=5,
        retrieval=False,
    )
    r = results.zeroshot["objectnet"]
    assert r.num_samples == SCORED and results.skipped == 1  # air_freshener left out, the corrupt file counted
    assert r.top1 == pytest.approx(TOP1) and r.top5 == pytest.approx(TOP5)
    assert r.per_class == pytest.approx(PER_CLASS)
    # the border left in: row 0 is the red frame, every prompted class ties (a different answer)
    uncropped = ImageNetSource(objectnet, probe_preprocess)
    uncropped.preprocess = probe_preprocess
    tied = evaluate(
        model,
        tokenizer=tokenizer,
        preprocess=prepared,
        source=uncropped,
        specs={spec.name: spec},
        device="cpu",
        retrieval=False,
    )
    assert tied.zeroshot["objectnet"].top1 != pytest.approx(TOP1)


def _probe_loader(probe_model, file: Path):
    model, tokenizer = probe_model
    built = SimpleNamespace(model=model, tokenizer=tokenizer, preprocess_val=probe_preprocess, arch="probe")

    def load_model(path, **_):
        return SimpleNamespace(built=built, file=file, step=None, image_only=False)

    return load_model


def test_eval_cli_scores_objectnet_into_results(objectnet, probe_model, tmp_path, monkeypatch, capsys):
    from fastclip.eval import checkpoint
    from fastclip.eval.cli import main as eval_main

    monkeypatch.setattr(checkpoint, "load_model", _probe_loader(probe_model, tmp_path / "model.pt"))
    results = tmp_path / "results.jsonl"
    argv = ["model.pt", "--data", str(objectnet), "--classnames", "imagenet", "--device", "cpu"]
    assert eval_main([*argv, "--results", str(results), "--no-retrieval"]) == 0
    out, err = capsys.readouterr()
    assert "class names: ObjectNet's (7 ImageNet classes') class names (4, open_clip's)" in out
    assert f"{SCORED} samples" in out
    assert "4 classes that overlap ImageNet" in err
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["task"] == "zeroshot_classification" and record["dataset"] == "objectnet"
    assert record["num_samples"] == SCORED and record["skipped_samples"] == 1
    assert record["top1"] == pytest.approx(TOP1) and record["top5"] == pytest.approx(TOP5)
    assert record["per_class"] == pytest.approx(PER_CLASS)


def test_bad_input_is_one_line_naming_the_file_or_folder(tmp_path, probe_model, monkeypatch, capsys):
    from fastclip.eval import checkpoint
    from fastclip.eval.cli import main as eval_main

    monkeypatch.setattr(checkpoint, "load_model", _probe_loader(probe_model, tmp_path / "model.pt"))

    def refused(root: Path) -> str:
        argv = ["model.pt", "--data", str(root), "--classnames", "imagenet", "--results", str(tmp_path / "r.jsonl")]
        assert eval_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and not (tmp_path / "r.jsonl").exists()
        return err

    missing = write_objectnet(tmp_path / "missing", corrupt=False)
    (missing / "mappings" / "objectnet_to_imagenet_1k.json").unlink()
    assert refused(missing) == (
        f"fastclip eval: {missing / 'mappings' / 'objectnet_to_imagenet_1k.json'}: missing; an ObjectNet folder has "
        "mappings/objectnet_to_imagenet_1k.json as the ObjectNet download ships it (objectnet-1.0/mappings/)"
    )
    unknown = write_objectnet(tmp_path / "unknown", corrupt=False)
    (unknown / "images" / "teapot").mkdir()
    assert refused(unknown) == (
        f"fastclip eval: {unknown / 'images' / 'teapot'}: not a folder of "
        f"{unknown / 'mappings' / 'folder_to_objectnet_label.json'}; ObjectNet's images/ holds only the class folders "
        "its mapping names (move the others out)"
    )
    no_images = tmp_path / "no_images"
    (no_images / "mappings").mkdir(parents=True)
    assert "no_images/images: missing" in refused(no_images)
    unmapped = write_objectnet(tmp_path / "unmapped", corrupt=False)
    (unmapped / "mappings" / "objectnet_to_imagenet_1k.json").write_text(json.dumps({"Bug": "weevil"}))
    assert "ImageNet class 'weevil' (of 'Bug') is not a line of imagenet_to_label_2012_v2" in refused(unmapped)


def test_trainer_refuses_a_bad_objectnet_before_training(tiny_embedded, tmp_path, capsys):
    from fastclip.train.cli import main

    from helpers import EMBEDDED, overrides

    run = tmp_path / "run"
    base = overrides(tiny_embedded, run, "fastclip-v3", **{"train.max_steps": 2, "data.batch_size": 16})
    bad = write_objectnet(tmp_path / "objectnet", corrupt=False)
    (bad / "mappings" / "folder_to_objectnet_label.json").unlink()
    assert main(["--config", str(EMBEDDED), *base, "--imagenet-val", str(bad), "--eval.at_end", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config key 'eval.imagenet_val'" in err
    assert "folder_to_objectnet_label.json: missing" in err
    assert not (run / "metrics.jsonl").exists()
