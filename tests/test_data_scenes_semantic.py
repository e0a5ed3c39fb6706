"""`fastclip data embedded --source scenes-semantic`: determinism, captions that parse back, minimal pairs that
differ in one glyph only, split rules, a class-blind oracle held to its pairs, and captions that fit the
32-token context of tiny-vit-64 with open_clip's tokenizer (the classic scenes' do not: the measure can fail)."""

from __future__ import annotations

import hashlib
import io
import itertools
import json

import numpy as np
import pytest
from PIL import Image
from test_data_scenes import digest, read_split

from fastclip.data.cli import main as data_main
from fastclip.data.sources import scenes_semantic as sem
from fastclip.data.sources.scene_checks import (
    class_blind_key,
    class_blind_oracle_r1,
    context_cut_share,
    token_lengths,
)
from fastclip.data.sources.scenes import COLOURS, SPLITS, Scene, SceneObject, build_scenes, glyph_pools

SIZES = dict(num_train=120, num_val=40, num_test=80, num_novel=40, shard_size=50)
FASHION = "/usr/share/datasets/fashion-mnist"


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    root = tmp_path_factory.mktemp("semantic")
    summary = build_scenes(root, workers=2, seed=3, variant="semantic", **SIZES)
    vocab, _ = glyph_pools(summary["datasets"], FASHION, 3)
    return root, summary, vocab


@pytest.fixture(scope="module")
def tokenizer():
    from fastclip.models import import_open_clip, resolve_arch

    name, config = resolve_arch("tiny-vit-64")
    # (None once an earlier test in this process registered it: then open_clip's registry holds it)
    config = config or import_open_clip().get_model_config(name)
    assert config["text_cfg"]["context_length"] == 32
    return import_open_clip().get_tokenizer(name)


def test_generation_is_deterministic_whatever_the_workers(scenes, tmp_path):
    root, summary, _ = scenes
    assert summary["source"] == "scenes-semantic"
    build_scenes(tmp_path / "serial", workers=1, seed=3, variant="semantic", **SIZES)
    assert digest(tmp_path / "serial") == digest(root)
    build_scenes(tmp_path / "other", workers=1, seed=4, variant="semantic", **SIZES)
    assert digest(tmp_path / "other") != digest(root)


def test_fewer_training_scenes_keep_the_other_splits_and_a_prefix_of_training(scenes, tmp_path):
    """A scene is a function of (seed, split, number), so a smaller training set (study v2-revisits: 5,000 scenes
    against v2's 50,000) is the larger one's first scenes, with the very same val, test and novel scenes: both
    studies score on one test set. Only the stored global indices move."""
    root, _, _ = scenes
    build_scenes(tmp_path / "fewer", workers=1, seed=3, variant="semantic", **{**SIZES, "num_train": 60})
    for split in ("val", "test", "novel"):
        same = [(s["png"], s["txt"]) for s in read_split(tmp_path / "fewer", split)]
        assert same == [(s["png"], s["txt"]) for s in read_split(root, split)], split
    fewer = [(s["png"], s["txt"]) for s in read_split(tmp_path / "fewer", "train")]
    assert len(fewer) == 60 and fewer == [(s["png"], s["txt"]) for s in read_split(root, "train")][:60]


def test_the_captions_of_a_seed_are_pinned():
    """The same (seed, split, number) words the same caption in every release: studies name data by seed."""
    vocab, pools = glyph_pools(["fashion-mnist", "mnist"], FASHION, 0)
    sizes = [len(p) for p in pools["heldout"]]
    captions = [sem.scene_and_caption(0, "test", n, vocab, sizes)[1] for n in range(4)]
    assert captions[0] == "in small orange: a ankle boot top right and a digit three bottom left."
    assert captions[1] == "in small orange: a sneaker bottom left and a ankle boot top right."  # its pair
    text = "\n".join(sem.scene_and_caption(0, split, n, vocab, sizes)[1] for split in SPLITS for n in range(50))
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == "edb507e66b6987e9"


def test_every_caption_parses_back_into_its_scene(scenes):
    root, _, vocab = scenes
    reader = sem.CaptionReader(vocab)
    for split in SPLITS:
        for s in read_split(root, split):
            size, colour, objects = reader.parse(s["txt"])
            scene = s["meta"]["scene"]
            want = {(vocab.nouns.index(noun), position) for noun, _, _, position in scene["objects"]}
            assert objects == want and len(objects) == len(scene["objects"])
            assert {(c, z) for _, c, z, _ in scene["objects"]} == {(colour, size)}  # one colour and size


def test_held_out_splits_come_in_pairs_that_differ_in_one_glyph_only(scenes):
    root, _, vocab = scenes
    for split in ("val", "test", "novel"):
        samples = sorted(read_split(root, split), key=lambda s: s["meta"]["index"])
        for a, b in zip(samples[::2], samples[1::2]):
            sa, sb = a["meta"]["scene"], b["meta"]["scene"]
            assert (sa["background"], sa["texture"]) == (sb["background"], sb["texture"])
            assert [o[1:] for o in sa["objects"]] == [o[1:] for o in sb["objects"]]  # colour, size, cell
            changed = [j for j, (x, y) in enumerate(zip(sa["objects"], sb["objects"])) if x[0] != y[0]]
            assert len(changed) == 1
            # the pictures differ only inside the changed glyph's cell (a quarter of the canvas)
            ia, ib = (np.asarray(Image.open(io.BytesIO(s["png"]))) for s in (a, b))
            cx, cy = sem.CELLS[sa["objects"][changed[0]][3]]
            outside = np.ones(ia.shape[:2], bool)
            outside[cy - 16 : cy + 16, cx - 16 : cx + 16] = False
            assert (ia[outside] == ib[outside]).all() and not (ia == ib).all()
            assert a["txt"] != b["txt"]


def test_split_rules_on_held_out_class_colour_pairs(scenes):
    root, summary, _ = scenes
    held = {tuple(p) for p in summary["held_out_pairs"]}
    for split, rule in (("train", lambda p: not p & held), ("novel", lambda p: bool(p & held))):
        for s in read_split(root, split):
            assert rule({(noun, colour) for noun, colour, _, _ in s["meta"]["scene"]["objects"]})
    counts = {n: 0 for n in sem.OBJECT_COUNTS}
    for s in read_split(root, "train"):
        counts[len(s["meta"]["scene"]["objects"])] += 1
    assert all(counts.values())  # one, two and three objects all occur


def test_class_blind_oracle_counts_ties_and_fails_on_the_semantic_splits(scenes, tmp_path):
    assert class_blind_oracle_r1(["a", "a", "b"]) == pytest.approx((0.5 + 0.5 + 1) / 3)
    assert class_blind_oracle_r1(list(range(7))) == 1.0
    root, _, vocab = scenes
    key = class_blind_key("semantic", vocab)
    for split in ("test", "novel"):  # pairs alone hold the oracle to 1/2; colliding layouts lower it further
        assert class_blind_oracle_r1([key(s["txt"]) for s in read_split(root, split)]) <= 0.5
    # the classic scenes on the same sizes: their captions name enough to match nearly all without the glyphs
    classic = build_scenes(tmp_path / "classic", workers=1, seed=3, **SIZES)
    classic_vocab, _ = glyph_pools(classic["datasets"], FASHION, 3)
    classic_key = class_blind_key("classic", classic_vocab)
    assert class_blind_oracle_r1([classic_key(s["txt"]) for s in read_split(tmp_path / "classic", "test")]) > 0.9


def test_every_caption_the_grammar_can_write_fits_the_context(scenes, tokenizer, tmp_path):
    """All one-object captions, and the three-object captions of the costliest noun in every cell order,
    colour, size and phrasing (BPE splits at spaces and punctuation, so no other caption is longer)."""
    root, _, vocab = scenes
    nouns = token_lengths(vocab.nouns, tokenizer)
    worst = nouns.index(max(nouns))
    every = [
        sem.caption(vocab, Scene(tuple(SceneObject(k, c, z, cell) for cell in cells), "grey", "plain", ph, ()), order)
        for c in COLOURS
        for z in sem.SIDES
        for ph in range(len(sem.PHRASINGS))
        for k, cells, order in [(k, (cell,), [0]) for k in range(len(vocab.nouns)) for cell in sem.CELLS]
        + [(worst, cells, [0, 1, 2]) for cells in itertools.permutations(sem.CELLS, 3)]
    ]
    lengths = token_lengths(every, tokenizer)
    assert max(lengths) == 29 and len(every) == 3840 + 1152
    prompts = [t.format(noun) for t in sem.zeroshot_prompts() for noun in vocab.nouns]
    assert context_cut_share(prompts, tokenizer, 32) == 0
    written = [s["txt"] for split in SPLITS for s in read_split(root, split)]
    assert context_cut_share(written, tokenizer, 32) == 0
    classic = build_scenes(tmp_path / "classic", workers=1, seed=3, num_train=60, num_val=0, num_test=0, num_novel=0)
    assert classic["source"] == "scenes"
    assert context_cut_share([s["txt"] for s in read_split(tmp_path / "classic", "train")], tokenizer, 32) > 0.2


def test_single_object_scenes_are_labelled_for_zero_shot(scenes):
    root, summary, _ = scenes
    zeroshot = json.loads((root / "zeroshot.json").read_text())["datasets"]["scenes"]
    assert zeroshot["classnames"] == summary["classes"] and len(zeroshot["templates"]) == 2 * 8 * 4
    for split in SPLITS:
        labelled = [s for s in read_split(root, split) if "label" in s["meta"]]
        assert labelled and len(labelled) == summary["splits"][split]["labelled_single_object"]
        for s in labelled:
            assert summary["classes"][s["meta"]["label"]] == s["meta"]["scene"]["objects"][0][0]


def test_cli_writes_the_semantic_source(tmp_path, capsys):
    out = tmp_path / "s"
    argv = ["embedded", "--source", "scenes-semantic", "--out", str(out), "--num-train", "20", "--workers", "1"]
    assert data_main(argv + ["--num-val", "4", "--num-test", "4", "--num-novel", "4"]) == 0
    assert "distinct captions" in capsys.readouterr().out
    summary = json.loads((out / "scenes.json").read_text())
    manifest = json.loads((out / "test" / "manifest.json").read_text())
    assert summary["source"] == "scenes-semantic"
    assert manifest["created_by"] == "fastclip data embedded --source scenes-semantic"
