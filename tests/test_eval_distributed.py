"""Evaluation inside a 2-process gloo job: every rank takes part, all finish, all agree, and the numbers are
those of a 1-process run (OpenCLIP #1121 hung with rank 0 evaluating alone behind a barrier)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch
import torch.distributed as dist

from fastclip.compat import import_open_clip
from fastclip.eval import EvalDataError, run_evals

from dist_utils import run_distributed
from probe import (
    caption_probe,
    colour_samples,
    fruit_probe,
    fruit_samples,
    image_with_rank,
    probe_preprocess,
    write_caption_shards,
    write_labelled_shards,
    zeroshot_json,
)

WORLD = 2
DEADLINE_S = 150


def evaluations(root, weights) -> dict:
    """What the 1-process reference and every rank run, with identical arguments."""
    from fastclip.models import build_model

    tokenizer = import_open_clip().get_tokenizer("ViT-B-32")
    out = {
        "probe": run_evals(
            fruit_probe(tokenizer),
            tokenizer=tokenizer,
            preprocess=probe_preprocess,
            val_dir=root / "val",
            device="cpu",
            batch_size=4,
            per_class=True,
        )
    }
    built = build_model("tiny-vit")
    built.model.load_state_dict(torch.load(weights, weights_only=True))
    model = built.model
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)  # run_evals must look through the wrapper
    model.train()
    # batch size 1: each sample is computed alone, so its features are bitwise those of the 1-process run
    out["tiny-vit"] = run_evals(
        model,
        tokenizer=built.tokenizer,
        preprocess=built.preprocess_val,
        val_dir=root / "val",
        device="cpu",
        batch_size=1,
    )
    out["train_mode_restored"] = model.training and built.model.training
    # the probe and kNN (every rank's features gathered, rank 0 fits) and the validation loss in global batches
    # of 4 (2 per rank at 2 ranks): the training features are the held-out ones themselves, all that matters here
    from fastclip.eval.training_probe import TrainingProbe
    from fastclip.losses import build_loss

    world = dist.get_world_size() if dist.is_initialized() else 1
    probe = TrainingProbe(str(root / "val"), linear=True, ks=(3, 5), max_train=100, unnamed="val")
    out["probed"] = run_evals(
        model,
        tokenizer=built.tokenizer,
        preprocess=built.preprocess_val,
        val_dir=root / "val",
        device="cpu",
        batch_size=1,
        loss_fn=build_loss("openclip"),
        loss_batch_size=4 // world,
        probe=probe,
    )
    # several captions per image (json "group"): the captions' groups gathered with their features
    out["grouped"] = run_evals(
        caption_probe(tokenizer),
        tokenizer=tokenizer,
        preprocess=probe_preprocess,
        val_dir=root / "grouped" / "val",
        device="cpu",
        batch_size=2,
        loss_fn=build_loss("openclip"),
        loss_batch_size=6 // world,
    )
    return out


def bad_data_evaluation(root, name, preprocess=probe_preprocess, zeroshot_file="zeroshot.json"):
    tokenizer = import_open_clip().get_tokenizer("ViT-B-32")
    try:
        return run_evals(
            fruit_probe(tokenizer),
            tokenizer=tokenizer,
            preprocess=preprocess,
            val_dir=root / name,
            zeroshot_file=root / zeroshot_file,
            device="cpu",
        )
    except (EvalDataError, ValueError) as err:
        return f"{type(err).__name__}: {err}"


def refuse_17_pixel_images(image):
    if image.size[0] == 17:
        raise ValueError("preprocess refuses 17-pixel images")
    return probe_preprocess(image)


def worker(rank, world_size, root, weights):
    out = evaluations(root, weights)
    # bad data that only rank 1 sees (position 1): the ranks must agree, and neither may hang
    out["bad_label"] = bad_data_evaluation(root, "bad_label")
    out["bad_image"] = bad_data_evaluation(root, "bad_image")
    out["preprocess_error"] = bad_data_evaluation(root, "odd_size", refuse_17_pixel_images)
    # one class list, a fruit at rank 0 and a colour at rank 1: each rank alone sees one dataset
    out["mixed"] = bad_data_evaluation(root, "mixed", zeroshot_file="names.txt")
    return out


def write_bad_image_shard(folder):
    """Two samples; the second's PNG bytes are garbage."""
    folder.mkdir()
    with tarfile.open(folder / "bad-000000.tar", "w") as tar:
        good = io.BytesIO()
        image_with_rank(0, 1, 8).save(good, format="PNG")
        for key, png in (("000000000", good.getvalue()), ("000000001", b"not a png")):
            for ext, payload in (
                ("png", png),
                ("txt", b"a photo of a apple."),
                ("json", json.dumps({"index": int(key), "label": 0, "dataset": "fruits"}).encode()),
            ):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from fastclip.models import build_model

    root = tmp_path_factory.mktemp("dist")
    # 29 samples, an odd count: the ranks get 15 and 14 (unequal slices, as in real held-out sets)
    write_labelled_shards(root / "val", fruit_samples()[:23] + colour_samples(), shard_size=8)
    (root / "zeroshot.json").write_text(json.dumps(zeroshot_json()))
    apple = (image_with_rank(0, 1, 8), "a photo of a apple.", "fruits", 0)
    write_labelled_shards(root / "bad_label", [apple, apple[:3] + (99,)])
    write_bad_image_shard(root / "bad_image")
    write_labelled_shards(root / "odd_size", [apple, (image_with_rank(0, 1, 8).resize((17, 17)),) + apple[1:]])
    write_labelled_shards(root / "mixed", [apple, colour_samples()[0]])
    write_caption_shards(root / "grouped" / "val")
    (root / "names.txt").write_text("\n".join(zeroshot_json()["datasets"]["fruits"]["classnames"]))
    torch.manual_seed(0)
    weights = root / "tiny-vit.pt"
    torch.save(build_model("tiny-vit").model.state_dict(), weights)
    return root, weights


def test_two_process_eval_matches_one_process(data):
    root, weights = data
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels as the 1-thread workers
    try:
        reference = evaluations(root, weights)  # no process group at all
    finally:
        torch.set_num_threads(threads)

    # one thread per process (two processes on two cores); a rank that hangs fails the run by the deadline
    ranks = run_distributed(worker, WORLD, root, weights, timeout=DEADLINE_S)

    # every rank returns the same dict, equal to the 1-process one
    for name in ("probe", "tiny-vit"):
        assert ranks[0][name] == ranks[1][name] == reference[name], name
    assert ranks[0]["train_mode_restored"] is True and ranks[1]["train_mode_restored"] is True
    # probes: the same numbers everywhere; the validation loss over the same 7 global batches, summed in
    # another order
    probed = [{k: v for k, v in r["probed"].items() if k != "val_loss"} for r in (*ranks, reference)]
    assert probed[0] == probed[1] == probed[2]
    assert {"linear_probe/fruits/top1", "knn/fruits/k3/top1", "knn/colours/k5/top1"} <= set(probed[0])
    losses = [r["probed"]["val_loss"] for r in (*ranks, reference)]
    assert losses[0] == losses[1] == pytest.approx(losses[2], rel=1e-6)
    # the known answer survives the split: the first 23 of the 24 fruit samples (the last, a plum
    # at rank 1, is left out): top-1 14 of 23, top-5 19 of 23
    probe = ranks[0]["probe"]
    assert (probe["zeroshot/fruits/top1"], probe["zeroshot/fruits/top5"]) == (14 / 23, 19 / 23)
    assert probe["zeroshot/fruits/num_samples"] == 23.0
    assert probe["zeroshot/colours/top1"] == 0.5
    assert ranks[0]["tiny-vit"]["retrieval/num_samples"] == 29.0
    assert set(reference["tiny-vit"]) >= {"zeroshot/fruits/top1", "retrieval/image_to_text_R@10"}
    # 3 images x 2 captions, one rank holding a caption of each image and the other the rest: the known answer
    grouped = [{k: v for k, v in r["grouped"].items() if k != "val_loss"} for r in (*ranks, reference)]
    assert grouped[0] == grouped[1] == grouped[2]
    assert (grouped[0]["retrieval/image_to_text_R@1"], grouped[0]["retrieval/text_to_image_R@1"]) == (1 / 3, 4 / 6)
    assert (grouped[0]["retrieval/num_samples"], grouped[0]["retrieval/num_images"]) == (6.0, 3.0)
    losses = [r["grouped"]["val_loss"] for r in (*ranks, reference)]
    assert losses[0] == losses[1] == pytest.approx(losses[2], rel=1e-6)
    # a label out of range: counted, all-reduced, raised on both ranks with the same message
    assert ranks[0]["bad_label"] == ranks[1]["bad_label"]
    assert "label outside [0, 8)" in ranks[0]["bad_label"]
    # an undecodable image on rank 1 only: skipped and counted, the same results on both ranks
    assert ranks[0]["bad_image"] == ranks[1]["bad_image"]
    assert ranks[0]["bad_image"]["skipped_samples"] == 1.0
    assert ranks[0]["bad_image"]["zeroshot/fruits/num_samples"] == 1.0
    # an exception on rank 1 only: rank 1 raises its own, rank 0 is told and raises too
    assert ranks[1]["preprocess_error"] == "ValueError: preprocess refuses 17-pixel images"
    assert ranks[0]["preprocess_error"].startswith("EvalDataError: evaluation failed on 1 other rank")
    # one list over two datasets, one per rank: found over both ranks, refused on both
    assert ranks[0]["mixed"].startswith("MixedDatasets: one class list ('names') scored labelled samples of 2+")
    assert "(here: fruits)" in ranks[0]["mixed"] and "(here: colours)" in ranks[1]["mixed"]
