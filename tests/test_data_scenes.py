"""`fastclip data embedded --source scenes`: deterministic generation, captions that parse back into their
scenes, disjoint splits, held-out attribute combinations, and shards the trainer and eval read."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from fastclip.data.cli import main as data_main
from fastclip.data.sources.scenes import (
    COLOURS,
    SPLITS,
    SceneObject,
    build_scenes,
    glyph_pools,
    sample_scene,
    scene_rng,
)

from helpers import one_line_error

SIZES = dict(num_train=120, num_val=40, num_test=40, num_novel=40, shard_size=50)


def read_split(root: Path, split: str) -> list[dict]:
    manifest = json.loads((root / split / "manifest.json").read_text())
    samples = []
    for shard in manifest["shards"]:
        with tarfile.open(root / split / shard["path"]) as tar:
            files: dict[str, dict[str, bytes]] = {}
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                files.setdefault(key, {})[ext] = tar.extractfile(member).read()
        for key, group in files.items():
            samples.append(
                {"key": key, "meta": json.loads(group["json"]), "png": group["png"], "txt": group["txt"].decode()}
            )
    return samples


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("scenes")
    return root, build_scenes(root, workers=2, seed=3, **SIZES)


def test_generation_is_deterministic_whatever_the_workers(scenes, tmp_path):
    root, _ = scenes
    build_scenes(tmp_path / "serial", workers=1, seed=3, **SIZES)
    assert digest(tmp_path / "serial") == digest(root)
    build_scenes(tmp_path / "other", workers=1, seed=4, **SIZES)
    assert digest(tmp_path / "other") != digest(root)


def test_every_caption_parses_back_into_its_scene(scenes):
    root, summary = scenes
    vocab, _ = glyph_pools(summary["datasets"], "/usr/share/datasets/fashion-mnist", 3)
    for split in SPLITS:
        for s in read_split(root, split):
            objects, background, texture = vocab.parse_caption(s["txt"])
            scene = s["meta"]["scene"]
            want = {
                SceneObject(vocab.nouns.index(noun), colour, size, position)
                for noun, colour, size, position in scene["objects"]
            }
            assert objects == want and len(objects) == len(scene["objects"])
            assert (background, texture) == (scene["background"], scene["texture"])
            assert s["meta"]["caption"] == s["txt"]


def test_splits_are_disjoint_and_held_out_pairs_stay_out_of_training(scenes):
    root, summary = scenes
    held = {tuple(p) for p in summary["held_out_pairs"]}
    assert len(held) == len(summary["classes"])  # one colour per class
    indices = {split: [s["meta"]["index"] for s in read_split(root, split)] for split in SPLITS}
    everything = [i for split in SPLITS for i in indices[split]]
    assert sorted(everything) == list(range(summary["data_size"]))  # disjoint and dense
    for split in SPLITS:
        manifest = json.loads((root / split / "manifest.json").read_text())
        assert manifest["data_size"] == summary["data_size"] == 240
    pairs = {
        split: [
            {(noun, colour) for noun, colour, _, _ in s["meta"]["scene"]["objects"]} for s in read_split(root, split)
        ]
        for split in SPLITS
    }
    assert not any(p & held for p in pairs["train"])
    assert all(p & held for p in pairs["novel"])
    # held-out splits draw their glyphs from the held-out pools: no training glyph image appears there
    train_png = {s["png"] for s in read_split(root, "train")}
    assert not train_png & {s["png"] for s in read_split(root, "test")}


def test_captions_are_nearly_all_distinct_and_single_objects_are_labelled(scenes):
    root, summary = scenes
    for split in SPLITS:
        info = summary["splits"][split]
        assert info["distinct_captions"] >= 0.97 * info["num_samples"]
        labelled = [s for s in read_split(root, split) if "label" in s["meta"]]
        assert len(labelled) == info["labelled_single_object"]
        for s in labelled:
            assert len(s["meta"]["scene"]["objects"]) == 1 and s["meta"]["dataset"] == "scenes"
            assert summary["classes"][s["meta"]["label"]] == s["meta"]["scene"]["objects"][0][0]
    zeroshot = json.loads((root / "zeroshot.json").read_text())["datasets"]["scenes"]
    assert zeroshot["classnames"] == summary["classes"] and all("{}" in t for t in zeroshot["templates"])


def test_render_puts_each_colour_in_its_cell_on_the_background():
    """A solid glyph drawn at each object's cell shows exactly that colour there; elsewhere the background."""
    from fastclip.data.sources.scenes import BACKGROUNDS, POSITIONS, Scene, render

    solid = [np.full((1, 28, 28), 255, np.uint8) for _ in range(3)]
    scene = Scene(
        (
            SceneObject(0, "red", "small", "top left"),
            SceneObject(1, "cyan", "large", "centre"),
            SceneObject(2, "yellow", "small", "bottom right"),
        ),
        "navy",
        "plain",
        0,
        (0, 0, 0),
    )
    image = render(scene, solid)
    for obj in scene.objects:
        (cx, cy), _ = POSITIONS[obj.position]
        assert tuple(image[cy, cx]) == COLOURS[obj.colour]
    assert tuple(image[12, 52]) == BACKGROUNDS["navy"]  # top right: no object


def test_sampling_respects_split_rules():
    from fastclip.data.sources.scenes import Vocabulary

    vocab = Vocabulary([("mnist", tuple(str(i) for i in range(10)))])
    sizes = [10] * 10
    for number in range(300):
        train = sample_scene(scene_rng(0, "train", number), vocab, sizes, "train")
        assert not {(o.cls, o.colour) for o in train.objects} & vocab.held_out
        novel = sample_scene(scene_rng(0, "novel", number), vocab, sizes, "novel")
        assert (novel.objects[0].cls, novel.objects[0].colour) in vocab.held_out
        assert len({o.position for o in train.objects}) == len(train.objects)


def test_cli_writes_scenes_and_rejects_bad_counts(tmp_path, capsys):
    out = tmp_path / "s"
    assert (
        data_main(
            [
                "embedded",
                "--source",
                "scenes",
                "--out",
                str(out),
                "--num-train",
                "30",
                "--num-val",
                "10",
                "--num-test",
                "10",
                "--num-novel",
                "10",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "distinct captions" in text and (out / "novel" / "manifest.json").is_file()
    bad = ["embedded", "--source", "scenes", "--out", str(tmp_path / "bad"), "--num-train", "0"]
    one_line_error(capsys, data_main, bad, "argument --num-train: 0 must be >= 1")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("source", ["scenes", "scenes-semantic"])
def test_captions_per_scene_writes_one_sample_per_phrasing_sharing_a_group(source, tmp_path, capsys):
    """--captions-per-scene 3: each scene is 3 samples, its image with 3 distinct captions of the same scene (caption
    0 the one-caption data set's), one json group (the first one's index), one label; same seed, same bytes."""
    from fastclip.data.sources.scenes import variant_functions
    from fastclip.data.sources.scenes_semantic import CaptionReader

    argv = ["embedded", "--source", source, "--num-train", "6", "--num-val", "2", "--num-test", "0"]
    argv += ["--num-novel", "0", "--shard-size", "7", "--seed", "3", "--captions-per-scene", "3"]
    assert data_main([*argv, "--out", str(tmp_path / "k3"), "--workers", "2"]) == 0
    assert "train: 6 scenes x 3 captions (18 distinct captions" in capsys.readouterr().out
    build_scenes(tmp_path / "again", **SMALL, captions_per_scene=3, workers=1, variant=VARIANTS[source])
    assert digest(tmp_path / "again") == digest(tmp_path / "k3")
    variant = variant_functions(VARIANTS[source])
    summary = json.loads((tmp_path / "k3" / "scenes.json").read_text())
    vocab, pools = glyph_pools(summary["datasets"], "/usr/share/datasets/fashion-mnist", 3)
    reads = vocab.parse_caption if source == "scenes" else CaptionReader(vocab).parse
    for split, first_index in (("train", 0), ("val", 18)):
        manifest = json.loads((tmp_path / "k3" / split / "manifest.json").read_text())
        assert manifest["groups"] is True and manifest["captions_per_scene"] == 3
        assert {s["num_samples"] for s in manifest["shards"]} == {6}  # 2 whole scenes per shard of at most 7
        samples = sorted(read_split(tmp_path / "k3", split), key=lambda s: s["meta"]["index"])
        assert [s["meta"]["index"] for s in samples] == list(range(first_index, first_index + len(samples)))
        sizes = [len(p) for p in pools["train" if split == "train" else "heldout"]]
        for n, scene in enumerate(samples[i : i + 3] for i in range(0, len(samples), 3)):
            assert {s["meta"]["group"] for s in scene} == {scene[0]["meta"]["index"]}
            assert len({s["png"] for s in scene}) == 1 and len({json.dumps(s["meta"]["scene"]) for s in scene}) == 1
            assert len({s["txt"] for s in scene}) == 3  # distinct phrasings ...
            assert len({reads(s["txt"]) for s in scene}) == 1  # ... of the same scene
            assert scene[0]["txt"] == variant.scene_and_caption(3, split, n, vocab, sizes)[1]
            one_object = len(scene[0]["meta"]["scene"]["objects"]) == 1
            assert ["label" in s["meta"] for s in scene] == [one_object, False, False]  # each image labelled once
    bad = [*argv[:-1], "4", "--out", str(tmp_path / "bad")]
    one_line_error(capsys, data_main, bad, "--captions-per-scene 4: must be 1..3")
    glyphs = ["embedded", "--out", str(tmp_path / "glyphs"), "--captions-per-scene", "2"]
    one_line_error(capsys, data_main, glyphs, "--captions-per-scene: scenes sources only", "--source glyphs")
    # each source's own flags, given with the other: refused (they changed nothing, silently; a fresh-eyes run)
    for argv, words in (
        (["--num-train", "10"], ["--num-train: scenes sources only", "this is --source glyphs: drop it"]),
        (["--source", "scenes", "--max-per-class", "5"], ["--max-per-class: glyphs only", "--source scenes"]),
        (["--source", "scenes-semantic", "--val-fraction", "0.3"], ["--val-fraction: glyphs only"]),
    ):
        one_line_error(capsys, data_main, ["embedded", "--out", str(tmp_path / "x"), *argv], *words)
        assert not (tmp_path / "x").exists()


VARIANTS = {"scenes": "classic", "scenes-semantic": "semantic"}
SMALL = dict(num_train=6, num_val=2, num_test=0, num_novel=0, shard_size=7, seed=3)
