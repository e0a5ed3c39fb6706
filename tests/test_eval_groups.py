"""Retrieval with several captions per image (json "group", the COCO/Flickr protocol) on similarities built by
hand: images counted once, text->image over every caption, image->text a hit when any of the image's captions is
in the top k; one caption per image gives the former numbers exactly."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
import torch.nn.functional as F

from fastclip.compat import import_open_clip
from fastclip.data.tario import write_tar
from fastclip.eval import evaluate, retrieval_metrics
from fastclip.eval.cli import format_table, result_records
from fastclip.eval.evaluate import caption_groups
from fastclip.losses import build_loss

from probe import (
    CAPTION_OWNER,
    CAPTION_SCORES,
    CAPTION_WORDS,
    SHARD_ORDER,
    ProbeCLIP,
    caption_probe,
    probe_image,
    probe_preprocess,
    write_caption_shards,
)

S, OWNER = CAPTION_SCORES, CAPTION_OWNER
# text->image, each caption's own image among 3: ranks 1, 3, 2, 1, 1, 1
# image->text, each image's best caption among 6 (its other caption not counted): A 1 (0.9), B 3 (0.5 and 0.45
# above its 0.4), C 2 (0.95 above its 0.85)
EXPECTED = {
    "image_to_text_R@1": 1 / 3,
    "image_to_text_R@2": 2 / 3,
    "image_to_text_R@3": 1.0,
    "text_to_image_R@1": 4 / 6,
    "text_to_image_R@2": 5 / 6,
    "text_to_image_R@3": 1.0,
}


def features(s: torch.Tensor, owner: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows per caption: its image's one-hot, and column j of s, so images @ texts.T reads s."""
    return torch.eye(s.shape[0])[owner], s.T.contiguous()


def test_several_captions_per_image_known_ranks():
    images, texts = features(S, OWNER)
    groups = torch.tensor([10, 10, 20, 20, 30, 30])  # any ids: only equality counts
    assert retrieval_metrics(images, texts, ks=(1, 2, 3), groups=groups) == EXPECTED
    assert retrieval_metrics(images, texts, ks=(1, 2, 3), groups=groups, chunk=2) == EXPECTED
    order = torch.tensor([3, 0, 5, 2, 4, 1])  # the rows' order does not matter
    assert retrieval_metrics(images[order], texts[order], ks=(1, 2, 3), groups=groups[order]) == EXPECTED
    # a tie counts against the image: C's best caption (0.85) tied by A's caption 1 still ranks 2
    tied = S.clone()
    tied[2, 1] = 0.85
    assert retrieval_metrics(*features(tied, OWNER), ks=(1, 2), groups=groups)["image_to_text_R@1"] == 1 / 3
    nan = torch.full((6, 3), float("nan"))  # NaN features rank last, not first
    assert set(retrieval_metrics(nan, nan, ks=(1,), groups=groups).values()) == {0.0}


def test_one_caption_per_image_gives_the_former_numbers_exactly():
    gen = torch.Generator().manual_seed(0)
    images = F.normalize(torch.randn(40, 8, generator=gen), dim=-1)
    texts = F.normalize(images + 0.8 * torch.randn(40, 8, generator=gen), dim=-1)
    former = retrieval_metrics(images, texts, chunk=7)
    assert 0 < former["image_to_text_R@1"] < 1 and 0 < former["text_to_image_R@1"] < 1
    own = torch.randperm(40, generator=gen) * 3  # every row its own group, in any order
    assert retrieval_metrics(images, texts, chunk=7, groups=own) == former
    assert retrieval_metrics(images, texts, groups=own) == retrieval_metrics(images, texts)
    # evaluate() keeps its former path unless some captions share a group
    assert caption_groups(torch.tensor([-1, 4, -1, 9])) is None
    assert caption_groups(torch.tensor([4, -1, 4])).tolist() == [4, -3, 4]


@pytest.fixture(scope="module")
def tokenizer():
    return import_open_clip().get_tokenizer("ViT-B-32")


@pytest.fixture(scope="module")
def probe(tokenizer) -> ProbeCLIP:
    return caption_probe(tokenizer)


def test_evaluate_reads_groups_from_the_shards(tmp_path, tokenizer, probe):
    write_caption_shards(tmp_path / "val")
    run = dict(tokenizer=tokenizer, preprocess=probe_preprocess, specs={}, device="cpu", batch_size=4)
    results = evaluate(probe, source=tmp_path / "val", **run, loss_fn=build_loss("openclip"), loss_batch_size=6)
    want = {k: v for k, v in EXPECTED.items() if k.endswith("R@1")}
    assert {k: v for k, v in results.retrieval.items() if k.endswith("R@1")} == want
    assert results.retrieval["image_to_text_R@5"] == results.retrieval["text_to_image_R@5"] == 1.0
    assert (results.retrieval_samples, results.retrieval_images) == (6, 3)
    assert results.flat()["retrieval/num_images"] == 3.0
    assert "retrieval over 6 captions of 3 images" in format_table(results, per_class=False)
    assert result_records(results, {})[0]["num_images"] == 3
    # the validation loss is the loss with the captions' groups (in data-index order, one batch of all 6)
    images = torch.eye(4)[[OWNER[j] for j in SHARD_ORDER]]
    tokens = tokenizer([f"a photo of a {CAPTION_WORDS[j]}." for j in SHARD_ORDER])
    texts = F.normalize(probe.encode_text(tokens), dim=-1)
    groups = torch.tensor([OWNER[j] for j in SHARD_ORDER])
    assert results.val_loss == pytest.approx(build_loss("openclip")(images, texts, groups=groups).item(), rel=1e-6)
    assert results.val_loss != pytest.approx(build_loss("openclip")(images, texts).item(), rel=1e-3)
    # the same shards without groups: 6 image-caption pairs, each image its own (the former protocol)
    write_caption_shards(tmp_path / "plain", groups=False)
    former = evaluate(probe, source=tmp_path / "plain", **run)
    assert former.retrieval_images is None and "retrieval/num_images" not in former.flat()
    assert former.retrieval == retrieval_metrics(*features(S, OWNER))  # A, B, C once per caption
    assert not math.isclose(former.retrieval["image_to_text_R@1"], results.retrieval["image_to_text_R@1"])


def test_a_bad_group_in_eval_data_skips_the_sample(tmp_path, tokenizer, probe):
    bad = tmp_path / "bad"
    bad.mkdir()
    buf = io.BytesIO()
    probe_image([255, 0, 0, 0]).save(buf, format="PNG")
    meta = {"index": 0, "caption": "a photo of a apple.", "group": "x"}
    write_tar(bad / "a.tar", [("000000000", {"png": buf.getvalue(), "json": json.dumps(meta).encode()})])
    results = evaluate(probe, tokenizer=tokenizer, preprocess=probe_preprocess, source=bad, specs={}, device="cpu")
    assert results.skipped == 1 and not results.retrieval
