"""Zero-shot and retrieval numbers on constructed data whose answers are known in advance.

The probe CLIP (tests/probe.py) embeds an image as the pixel values of its first row and a prompt
"... {fruit} ..." as the fruit's one-hot vector, so the rank of the true class for each image is chosen
when the image is drawn. Everything else (shard reading, preprocessing, prompt ensembling, normalisation,
top-k, counting) is the real code.
"""

from __future__ import annotations

import json

import pytest
import torch

from fastclip.compat import import_open_clip
from fastclip.eval import (
    EvalDataError,
    ZeroShotSpec,
    evaluate,
    evaluate_zeroshot,
    load_zeroshot_spec,
    retrieval_metrics,
    run_evals,
    zeroshot_classifier,
)
from fastclip.eval.cli import image_folder_source

from probe import (
    FRUIT_TEMPLATES,
    FRUITS,
    colour_samples,
    fruit_probe,
    fruit_samples,
    image_with_rank,
    probe_preprocess,
    write_labelled_shards,
    zeroshot_json,
)

# The data set (tests/probe.py): per fruit class, the rank its score gets in each of its 3 images
#   FRUIT_RANKS = {0: [1, 1, 1], 1: [1, 1, 2], 2: [1, 2, 6], 3: [3, 1, 1], 4: [6, 7, 8], 5: [1, 1, 1],
#                  6: [5, 1, 2], 7: [1, 1, 1]}
# so top-1 hits per class are 3,2,1,2,0,3,1,3 = 15 of 24 and top-5 hits 3,3,2,3,0,3,3,3 = 20 of 24.
# Colours: COLOUR_RANKS = {0: [1, 1], 1: [1, 2], 2: [2, 3]} -> top-1 3 of 6; top-5 (= top-3) all.
EXPECTED_PER_CLASS = {
    "apple": 1.0,
    "banana": 2 / 3,
    "cherry": 1 / 3,
    "grape": 2 / 3,
    "lemon": 0.0,
    "mango": 1.0,
    "peach": 1 / 3,
    "plum": 1.0,
}
TEMPLATES = list(FRUIT_TEMPLATES)


@pytest.fixture(scope="module")
def tokenizer():
    return import_open_clip().get_tokenizer("ViT-B-32")


@pytest.fixture(scope="module")
def probe(tokenizer):
    return fruit_probe(tokenizer)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """An embedded-style root: val/ shards (both datasets interleaved, 3 shards) and zeroshot.json."""
    root = tmp_path_factory.mktemp("embedded")
    fruits, colours = fruit_samples(), colour_samples()
    mixed = fruits[:12] + colours + fruits[12:]
    write_labelled_shards(root / "val", mixed, shard_size=11, first_index=1000)
    (root / "zeroshot.json").write_text(json.dumps(zeroshot_json()))
    return root


def test_zeroshot_known_answer_per_dataset(embedded, probe, tokenizer):
    results = evaluate(
        probe,
        tokenizer=tokenizer,
        preprocess=probe_preprocess,
        source=embedded / "val",
        specs=load_zeroshot_spec(embedded / "zeroshot.json"),
        device="cpu",
        batch_size=5,
    )
    fruits = results.zeroshot["fruits"]
    assert fruits.num_samples == 24
    assert fruits.top1 == 15 / 24
    assert fruits.top5 == 20 / 24
    assert fruits.per_class == pytest.approx(EXPECTED_PER_CLASS, abs=0)
    assert fruits.mean_per_class_recall == pytest.approx(15 / 24)
    colours = results.zeroshot["colours"]
    assert (colours.num_samples, colours.top1, colours.top5) == (6, 0.5, 1.0)
    assert colours.per_class == {"red": 1.0, "green": 0.5, "blue": 0.0}
    assert results.num_samples == 30 and results.unmatched == 0


def test_run_evals_flat_dict_and_train_mode(embedded, probe, tokenizer):
    probe.train()
    flat = run_evals(
        probe,
        tokenizer=tokenizer,
        preprocess=probe_preprocess,
        val_dir=embedded / "val",
        device="cpu",
        batch_size=7,
        per_class=True,
    )  # zeroshot.json found beside val/
    assert probe.training  # restored
    assert flat["zeroshot/fruits/top1"] == 15 / 24
    assert flat["zeroshot/colours/top1"] == 0.5
    assert flat["zeroshot/mean_top1"] == (15 / 24 + 0.5) / 2
    assert flat["zeroshot/fruits/class/lemon"] == 0.0
    assert flat["retrieval/num_samples"] == 30.0
    assert all(isinstance(v, float) for v in flat.values())


def test_max_samples_takes_the_first_positions(embedded, probe, tokenizer):
    results = evaluate(
        probe,
        tokenizer=tokenizer,
        preprocess=probe_preprocess,
        source=embedded / "val",
        specs=load_zeroshot_spec(embedded / "zeroshot.json"),
        device="cpu",
        max_samples=6,
    )
    # the first 6 samples are apple x3 (all rank 1) and banana ranks 1, 1, 2
    assert results.zeroshot["fruits"].num_samples == 6
    assert results.zeroshot["fruits"].top1 == 5 / 6
    assert "colours" not in results.zeroshot


def test_evaluate_zeroshot_on_a_loader(probe, tokenizer):
    samples = fruit_samples()
    images = torch.stack([probe_preprocess(s[0]) for s in samples])
    labels = torch.tensor([s[3] for s in samples])
    loader = [(images[i : i + 10], labels[i : i + 10]) for i in range(0, len(samples), 10)]
    classifier = zeroshot_classifier(probe, tokenizer, FRUITS, TEMPLATES, "cpu")
    assert classifier.shape == (8, 8)
    torch.testing.assert_close(classifier, torch.eye(8))  # each prompt embeds to its fruit's one-hot
    out = evaluate_zeroshot(probe, loader, classifier, "cpu", classnames=FRUITS)
    assert (out["top1"], out["top5"], out["num_samples"]) == (15 / 24, 20 / 24, 24)
    assert out["per_class"]["cherry"] == 1 / 3


def test_label_outside_class_list_is_named(tmp_path, probe, tokenizer):
    write_labelled_shards(tmp_path / "val", [(image_with_rank(0, 1, 8), "x", "fruits", 8)])
    specs = {"fruits": ZeroShotSpec("fruits", tuple(FRUITS), tuple(TEMPLATES))}
    with pytest.raises(EvalDataError, match=r"'fruits'.*outside \[0, 8\)"):
        evaluate(
            probe, tokenizer=tokenizer, preprocess=probe_preprocess, source=tmp_path / "val", specs=specs, device="cpu"
        )


def test_image_folder_labels_follow_the_class_names_file(tmp_path, probe, tokenizer):
    """Folders are matched to class names by name, whatever the order of the names file."""
    root = tmp_path / "folder"
    for image, _, _, label in fruit_samples():
        folder = root / FRUITS[label]
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{len(list(folder.iterdir()))}.png")
    names = tmp_path / "fruits.txt"
    names.write_text("\n".join(reversed(FRUITS)) + "\n")  # not the folders' sorted order
    spec = load_zeroshot_spec(names)
    assert spec["fruits"].classnames[0] == "plum"
    source = image_folder_source(root, spec["fruits"], names)
    results = evaluate(probe, tokenizer=tokenizer, preprocess=probe_preprocess, source=source, specs=spec, device="cpu")
    # matched by name the known answer holds; taken in sorted order, "apple" images would be scored as "plum"
    assert results.zeroshot["fruits"].top1 == 15 / 24
    assert results.zeroshot["fruits"].top5 == 20 / 24
    assert results.zeroshot["fruits"].per_class == pytest.approx(EXPECTED_PER_CLASS, abs=0)
    assert results.retrieval == {}  # an image folder has no captions
    wrong = tmp_path / "three.txt"
    wrong.write_text("owl\nwren\nkite\n")
    with pytest.raises(ValueError, match=r"8 class folders, but .*three.txt lists 3 class names"):
        image_folder_source(root, load_zeroshot_spec(wrong)["three"], wrong)


def test_retrieval_known_ranks():
    """S = images @ texts.T is built by hand: the rank of each true pair is chosen, so R@k are known."""
    n = 20
    s = torch.zeros(n, n)
    s.diagonal()[:] = 1.0
    s.diagonal()[:6] = 0.5
    s[0, [6]] = 0.9  # image 0: one caption above its own -> rank 2
    s[1, 6:11] = 0.9  # image 1: five above -> rank 6
    s[2, 6:16] = 0.9  # image 2: ten above -> rank 11
    s[6:8, 4] = 0.9  # text 4: two images above its own -> rank 3
    s[6:20, 5] = 0.9  # text 5: fourteen above -> rank 15
    # other rows/columns: the 0.9s sit below their own diagonal 1.0, so nothing else moves
    metrics = retrieval_metrics(torch.eye(n), s.T.contiguous())
    assert metrics == {
        "image_to_text_R@1": 17 / 20,
        "image_to_text_R@5": 18 / 20,
        "image_to_text_R@10": 19 / 20,
        "text_to_image_R@1": 18 / 20,
        "text_to_image_R@5": 19 / 20,
        "text_to_image_R@10": 19 / 20,
    }
    # chunking the similarity matrix changes nothing
    assert retrieval_metrics(torch.eye(n), s.T.contiguous(), chunk=3) == metrics


def test_retrieval_ties_count_against_the_pair():
    """A collapsed model (all embeddings equal) must not look perfect; NaN features rank last."""
    same = torch.nn.functional.normalize(torch.ones(12, 4), dim=-1)
    assert set(retrieval_metrics(same, same).values()) == {0.0}
    # two identical captions for two images: each image ties with the other's caption -> rank 2
    images = torch.eye(3)
    texts = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 0, 1.0]])
    images[1] = torch.tensor([1.0, 0, 0])
    metrics = retrieval_metrics(images, texts)
    assert metrics["image_to_text_R@1"] == 1 / 3 and metrics["image_to_text_R@5"] == 1.0
    nan = torch.full((3, 3), float("nan"))
    assert retrieval_metrics(nan, nan)["image_to_text_R@1"] == 0.0  # rank 3 of 3


def test_spec_files(tmp_path):
    single = tmp_path / "birds.json"
    single.write_text(json.dumps({"classnames": ["owl", "wren"], "templates": ["a {}"]}))
    assert load_zeroshot_spec(single)["birds"].prompts("owl") == ["a owl"]
    txt, templates = tmp_path / "names.txt", tmp_path / "templates.txt"
    txt.write_text("owl\nwren\n\n")
    templates.write_text("a photo of a {}.\nart of {c}\n")
    spec = load_zeroshot_spec(txt, templates)["names"]
    assert spec.classnames == ("owl", "wren") and spec.prompts("wren") == ["a photo of a wren.", "art of wren"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"datasets": {"birds": {"classnames": ["owl"], "templates": ["no placeholder"]}}}))
    with pytest.raises(ValueError, match=r"bad.json: datasets.birds: template 0"):
        load_zeroshot_spec(bad)
    bad.write_text(json.dumps({"labels": []}))
    with pytest.raises(ValueError, match="'datasets' or a 'classnames' field"):
        load_zeroshot_spec(bad)


def test_report_omits_retrieval_with_templated_captions():
    from fastclip.eval.cli import format_table
    from fastclip.eval.evaluate import EvalResults

    metrics = {f"{d}_R@{k}": 0.0 for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)}
    # templated captions: recall is ~0 by construction, so no numbers, one line saying why
    templated = format_table(
        EvalResults(retrieval=dict(metrics), retrieval_samples=10, retrieval_distinct_captions=3), per_class=False
    )
    assert templated.strip() == (
        "retrieval omitted: 10 images share 3 distinct captions (class templates), so a "
        "caption cannot single out its image; data with distinct captions: fastclip data "
        "embedded --source scenes"
    )
    # distinct captions (9 of 10 at least): the table, with the repeats counted
    for distinct, note in ((10, False), (9, True)):
        table = format_table(
            EvalResults(retrieval=dict(metrics), retrieval_samples=10, retrieval_distinct_captions=distinct),
            per_class=False,
        )
        assert "image->text       0.00    0.00    0.00" in table and "omitted" not in table
        assert ("(1 of the captions repeats another;" in table) == note


def test_mean_r1_is_the_mean_of_both_directions_or_none():
    from fastclip.eval.retrieval import mean_r1

    record = {"retrieval/image_to_text_R@1": 0.5, "retrieval/text_to_image_R@1": 0.25, "zeroshot/x/top1": 0.1}
    assert mean_r1(record) == 0.375
    assert mean_r1({"image_to_text_R@1": 1.0, "text_to_image_R@1": 0.0}, prefix="") == 0.5
    assert mean_r1({"retrieval/image_to_text_R@1": 0.5}) is None


def test_mean_zero_shot_top1_is_over_the_data_sets_top1_keys_only():
    from fastclip.eval.zeroshot import mean_top1

    record = {"zeroshot/a/top1": 0.2, "zeroshot/b/top1": 0.5, "zeroshot/a/top5": 0.9, "zeroshot/mean_top1": 0.35}
    assert mean_top1(record) == pytest.approx(0.35) and mean_top1({"retrieval/x": 1.0}) is None
    assert mean_top1({"eval/zeroshot/a/top1": 0.25}, prefix="eval/zeroshot/") == 0.25
