"""Self-supervised training on images alone (config section ``ssl``, fastclip/train/ssl.py): two seeded views
per image, the image tower + projector, the losses' unimodal form. A 2-process iSogCLR run stopped and resumed
equals the uninterrupted one bitwise; the export is the image tower, loaded strictly by open_clip's
``model.visual``; images without captions train; every caption-dependent option is one line, exit 2; the kNN
evaluation is its formula."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from fastclip.train.cli import main as train_main

from helpers import (
    Job,
    assert_same_training_state,
    image_only_shards,
    load,
    one_line_error,
    overrides,
    step_dir,
    train_records,
)

SSL = {
    "ssl.enabled": "true",
    "ssl.projector_hidden": 32,
    "ssl.projector_dim": 16,
    "data.zeroshot": "null",
    "data.val": "null",
}


NO_GAMMA = {"loss.gamma_min": "null", "loss.gamma_decay_epochs": "null", "loss.gamma_schedule": "null"}


def ssl_args(data: Path, run: Path, mode: str = "fastclip-v2", **extra) -> list[str]:
    return overrides(data, run, mode, **{**SSL, **extra})


# ----------------------------------------------------------------------------- views
def test_the_two_views_differ_and_repeat_under_the_batch_seed():
    from fastclip.data.views import Augment, TwoViews, split_views
    from fastclip.data.worker import _seeded_rngs

    views = TwoViews(32, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), Augment())
    image = Image.frombytes("L", (28, 28), bytes(range(256)) * 3 + bytes(28 * 28 - 768)).convert("RGB")
    draws = []
    for _ in range(2):
        with _seeded_rngs(7, 0, 1, 0, 0, 3):
            draws.append(torch.stack([views(image), views(image)]))
    assert draws[0].shape == (2, 2, 3, 32, 32)
    assert torch.equal(draws[0], draws[1])  # a function of the seed: a resumed run sees the same views
    first, second = split_views(draws[0][0][None])
    assert not torch.equal(first, second)  # two independent draws of the augmentation
    assert not torch.equal(draws[0][0], draws[0][1])  # the next sample draws anew


# ----------------------------------------------------------------------------- configs
SSL_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "ssl").glob("*.yaml"))


@pytest.mark.parametrize("path", SSL_CONFIGS, ids=lambda p: p.stem)
def test_every_ssl_config_starts_with_its_command_and_passes_the_checks(path, tiny_embedded, tmp_path, capsys):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and f"fastclip train --config configs/ssl/{path.name}" in first
    data = ["--data.train", str(tiny_embedded / "train"), "--data.val", str(tiny_embedded / "val")]
    assert train_main(["--config", str(path), *data, "--train.run_dir", str(tmp_path / "run"), "--check"]) == 0, (
        capsys.readouterr().err
    )


def test_the_shipped_ssl_configs_cover_every_method():
    names = {p.stem for p in SSL_CONFIGS}
    assert names >= {f"{m}-embedded" for m in ("simclr", "dcl", "sogclr", "isogclr", "rgclg", "tempnet")}


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"data.zeroshot": "ZS"}, ["data.zeroshot", "zero-shot", "set data.zeroshot null"]),
        ({"eval.imagenet_val": "ZS"}, ["eval.imagenet_val", "zero-shot"]),
        ({"model.arch": "tiny-vit-hf"}, ["model.arch", "Hugging Face text tower"]),
        ({"mode": "openclip"}, ["openclip", "no unimodal form", "ntxent"]),
        ({"mode": "siglip", **NO_GAMMA}, ["siglip", "no unimodal form"]),
        ({"loss.impl": "fused"}, ["unimodal", "autograd"]),
        ({"model.ema_momentum": 0.99}, ["model.ema_momentum"]),
        ({"ssl.blur_p": 1.5}, ["ssl.blur_p", "probability"]),
        ({"data.aug.use_timm": "true"}, ["data.aug.use_timm", "means nothing for ssl views", "gray_scale_prob"]),
        ({"data.aug.re_prob": 0.25}, ["data.aug.re_prob", "means nothing for ssl views"]),
        ({"data.aug.gray_scale_prob": 1.5}, ["data.aug.gray_scale_prob", "probability"]),
    ],
)
def test_a_caption_dependent_or_bad_option_is_one_line_exit_2(tiny_embedded, tmp_path, capsys, extra, words):
    extra = {k: (str(tiny_embedded / "zeroshot.json") if v == "ZS" else v) for k, v in extra.items()}
    if "eval.imagenet_val" in extra:
        extra["eval.imagenet_val"] = str(tmp_path)
    mode = extra.pop("mode", "fastclip-v2")
    args = ssl_args(tiny_embedded, tmp_path / "run", mode, **extra)
    one_line_error(capsys, train_main, [*args, "--check"], *words)


# ----------------------------------------------------------------------------- stop, resume, export
@pytest.fixture(scope="module")
def runs(tiny_embedded, tmp_path_factory):
    """iSogCLR (per-image u and τ) on 2 processes: 6 steps straight; 3 steps, then resumed to 6."""
    root = tmp_path_factory.mktemp("ssl")
    straight = Job(ssl_args(tiny_embedded, root / "straight", **{"train.max_steps": 6}), 2, root / "logs_straight")
    codes = straight.wait(300)
    assert codes == [0, 0], straight.outputs()
    first = Job(ssl_args(tiny_embedded, root / "stopped", **{"train.max_steps": 3}), 2, root / "logs_first")
    assert first.wait(300) == [0, 0], first.outputs()
    args = ssl_args(tiny_embedded, root / "stopped", **{"train.max_steps": 6, "train.resume": "latest"})
    resumed = Job(args, 2, root / "logs_resumed")
    assert resumed.wait(300) == [0, 0], resumed.outputs()
    return root


def test_a_stopped_and_resumed_two_process_run_equals_the_uninterrupted_one(runs):
    assert_same_training_state(step_dir(runs / "straight", 6), step_dir(runs / "stopped", 6), 2)
    straight, stopped = train_records(runs / "straight"), train_records(runs / "stopped")
    assert [r["step"] for r in stopped] == [1, 2, 3, 4, 5, 6]
    assert [(r["loss"], r["objective"]) for r in straight] == [(r["loss"], r["objective"]) for r in stopped]
    model = load(step_dir(runs / "straight", 6) / "model.pt")
    keys = model["state_dict"].keys()
    assert any(k.startswith("visual.") for k in keys) and any(k.startswith("projector.") for k in keys)
    assert not any(k.startswith(("transformer.", "token_embedding")) for k in keys)  # no text tower
    state = load(step_dir(runs / "straight", 6) / "rank_0.pt")["loss_state"]["_extra_state"]["fields"]
    seen = load(step_dir(runs / "straight", 6) / "rank_0.pt")["loss_state"]["_extra_state"]["seen"] > 0
    assert seen.any() and torch.equal(state["tau_img"][seen], state["tau_txt"][seen])  # one τ per image
    assert not torch.all(state["tau_img"][seen] == 0.03)  # the per-image temperatures moved


def test_check_before_a_requeued_ssl_run_accepts_its_checkpoint_and_refuses_a_clip_one(runs, tiny_embedded, capsys):
    """The launchers run `--check` before every (re)start: it must build the tower + projector the checkpoint
    holds, not the CLIP model (which refused every requeued ssl job)."""
    args = ssl_args(tiny_embedded, runs / "stopped", **{"train.max_steps": 8, "train.resume": "latest"})
    assert train_main([*args, "--check"]) == 0, capsys.readouterr()
    capsys.readouterr()
    clip = overrides(tiny_embedded, runs / "clip", "fastclip-v3", **{"train.max_steps": 1})
    assert train_main(clip) == 0
    capsys.readouterr()
    from_clip = {"model.pretrained": str(step_dir(runs / "clip", 1) / "model.pt")}
    one_line_error(
        capsys, train_main, [*ssl_args(tiny_embedded, runs / "other", **from_clip), "--check"], "does not fit"
    )
    # a resume across the two kinds names ssl.enabled (it said "does not fit architecture: 29 missing ...")
    from_ssl = overrides(
        tiny_embedded, runs / "c2", "fastclip-v2", **{"train.resume": str(step_dir(runs / "stopped", 6))}
    )
    for check in (["--check"], []):
        said = "trained an image tower + projector (ssl.enabled true); resume with --ssl.enabled true"
        one_line_error(capsys, train_main, [*from_ssl, *check], "ssl.enabled", "false but checkpoint", said)
    from_clip = ssl_args(tiny_embedded, runs / "s2", "fastclip-v3", **{"train.resume": str(step_dir(runs / "clip", 1))})
    one_line_error(
        capsys, train_main, [*from_clip, "--check"], "ssl.enabled", "trained a CLIP model (ssl.enabled false)"
    )


def test_the_export_is_the_image_tower_that_open_clip_loads(runs, tmp_path, capsys):
    from fastclip.compat import import_open_clip
    from fastclip.eval.export import main as export_main

    out = tmp_path / "tower.pt"
    assert export_main([str(runs / "straight"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "image tower" in printed and "visual.load_state_dict" in printed
    state = torch.load(out, weights_only=True)["state_dict"]
    saved = load(step_dir(runs / "straight", 6) / "model.pt")["state_dict"]
    open_clip = import_open_clip()
    open_clip.add_model_config(str(tmp_path / "tiny-vit.json"))
    visual = open_clip.create_model("tiny-vit").visual
    visual.load_state_dict(state)  # strict
    for name, value in visual.state_dict().items():
        assert torch.equal(value, saved[f"visual.{name}"]), name
    # and it is --model.pretrained's image tower file for a CLIP model of the arch (LiT's start)
    from fastclip.train.preflight import fit_pretrained, read_pretrained

    fitted = fit_pretrained(open_clip.create_model("tiny-vit"), read_pretrained(str(out)), str(out))
    assert all(torch.equal(fitted[f"visual.{name}"], value) for name, value in state.items())
    # the printed lines run as printed, in a fresh process (`import open_clip, torch` failed on this CPU torch)
    code = printed[printed.index("import torch") :] + "\nprint(type(visual).__name__)"
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert ran.returncode == 0 and ran.stdout.strip() == type(visual).__name__, ran.stderr[-2000:]


def test_fastclip_eval_of_an_ssl_run_is_one_line_exit_2(runs, tiny_embedded, capsys):
    from fastclip.eval.cli import main as eval_main

    argv = [str(runs / "straight"), "--data", str(tiny_embedded / "val")]
    one_line_error(capsys, eval_main, argv, "self-supervised run", "eval/knn_top1", "fastclip export")


# ----------------------------------------------------------------------------- images without captions
def test_images_without_captions_train(tmp_path):
    """A plain WebDataset of .png files only (no caption, no json: the index is the position)."""
    shards = image_only_shards(tmp_path / "images")
    run = tmp_path / "run"
    args = ssl_args(shards.parent, run, "ntxent", **{"data.train": str(shards), "train.epochs": 1, **NO_GAMMA})
    assert train_main(args) == 0
    records = train_records(run)
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] > 0 for r in records)
    assert json.loads((shards / "manifest.json").read_text())["num_samples"] == 24


def test_an_unlabelled_val_is_refused_for_ssl_and_undecodable_val_images_are_counted(tiny_embedded, tmp_path, capsys):
    """ssl scores data.val by kNN over its labels: images alone gave no evaluation record and no word (exit 0);
    refused now by --check and the run. And undecodable val images are counted in eval/skipped_samples, as the
    CLIP evaluation counts them (ssl said them only as warnings)."""
    import io
    import tarfile

    shards = image_only_shards(tmp_path / "images")
    args = ssl_args(
        tiny_embedded, tmp_path / "run", "ntxent", **{"data.val": str(shards), "eval.at_end": "true", **NO_GAMMA}
    )
    for check in (["--check"], []):
        one_line_error(capsys, train_main, [*args, *check], "data.val", "scores data.val by kNN over its labels",
                       "have none")  # fmt: skip
    # labelled val shards with two samples whose image bytes are no image
    val = tmp_path / "val"
    val.mkdir()
    source = next((tiny_embedded / "val").glob("*.tar"))
    with tarfile.open(source) as src, tarfile.open(val / source.name, "w") as dst:
        broken = set()
        for member in src.getmembers():
            data = src.extractfile(member).read()
            stem, ext = member.name.rsplit(".", 1)
            if ext in ("png", "jpg", "webp") and len(broken) < 2:
                broken.add(stem)
                data = b"not an image"
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    run = tmp_path / "run2"
    extra = {"data.val": str(val / source.name), "train.max_steps": 1, "eval.at_end": "true", **NO_GAMMA}
    assert train_main(ssl_args(tiny_embedded, run, "ntxent", **extra)) == 0
    (record,) = [r for r in json_lines(run / "metrics.jsonl") if "eval/knn_samples" in r]
    assert record["eval/skipped_samples"] == 2 and record["eval/knn_samples"] > 2


def json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- kNN
@pytest.mark.parametrize(("k", "temperature"), [(1, 0.07), (3, 0.07), (5, 1.0)])
def test_knn_is_the_weighted_vote_of_the_other_images(k, temperature):
    """Leave-one-out: image i's k most similar other images vote exp(cos/T) for their labels."""
    from fastclip.train.ssl import knn_accuracy

    features = torch.nn.functional.normalize(
        torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.7, 0.7], [0.8, 0.5]]), dim=1
    )
    labels = [0, 0, 1, 1, 1, 0]
    hits = 0
    for i in range(6):
        cos = {j: float(features[i] @ features[j]) for j in range(6) if j != i}
        nearest = sorted(cos, key=cos.get, reverse=True)[:k]
        votes = {c: sum(math.exp(cos[j] / temperature) for j in nearest if labels[j] == c) for c in (0, 1)}
        hits += max(votes, key=votes.get) == labels[i]
    assert knn_accuracy(features, torch.tensor(labels), k, temperature) == pytest.approx(hits / 6)
    if k == 1:  # images 4 (0.7, 0.7) and 5 (0.8, 0.5) are each other's nearest, across the labels
        assert hits == 4


def test_the_knn_evaluation_scores_the_towers_features_by_dataset_and_label(tiny_embedded):
    """knn_evaluate = knn_accuracy over the tower's normalised features of every data.val image, with one class per
    (dataset, label): the glyphs' Fashion-MNIST and MNIST labels share numbers but are different classes."""
    from fastclip.eval.samples import iter_samples
    from fastclip.models import build_model
    from fastclip.train.config import load_config
    from fastclip.train.ssl import knn_accuracy, knn_evaluate, ssl_built

    cfg = load_config(None, ["--ssl.enabled", "true", "--data.zeroshot", "null", "--ssl.knn_k", "3"])
    torch.manual_seed(0)
    built = ssl_built(build_model("tiny-vit"), cfg)
    got = knn_evaluate(built.model, built.preprocess_val, str(tiny_embedded / "val"), torch.device("cpu"), cfg)
    samples = list(iter_samples(tiny_embedded / "val"))
    with torch.no_grad():
        images = torch.stack([built.preprocess_val(s.image) for s in samples])
        features = torch.nn.functional.normalize(built.model.visual.eval()(images), dim=-1)
    names = sorted({(s.dataset, s.label) for s in samples})
    assert len(names) == 20 and len({s.label for s in samples}) == 10  # two datasets, labels 0-9 each
    classes = torch.tensor([names.index((s.dataset, s.label)) for s in samples])
    assert got["knn_samples"] == 20
    assert got["knn_top1"] == pytest.approx(knn_accuracy(features, classes, 3, cfg.ssl.knn_temperature))


def test_the_benchmark_verdict_compares_the_test_means_within_the_spread_and_pairs_the_seeds():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_ssl

    def arm(test_knn, val=0.5):
        seeds = [
            {"seed": s, "final": val, "test_knn": t, "test_linear": t / 2, "curve": []} for s, t in enumerate(test_knn)
        ]
        return {"global_batch": 64, "best_lr": 1e-3, "seeds": seeds}

    close = {"arms": {"sogclr@64": arm([0.70, 0.72, 0.74]), "simclr@512": arm([0.71, 0.73, 0.75], val=0.9)}}
    assert bench_ssl.verdict(close).startswith("the claim holds here: sogclr@64 72.0 against simclr@512 73.0")
    far = {"arms": {"sogclr@64": arm([0.60, 0.61, 0.62]), "simclr@512": arm([0.73, 0.75, 0.77])}}
    assert bench_ssl.verdict(far).startswith("the claim does not hold here")
    assert bench_ssl.verdict({"arms": {"sogclr@64": arm([0.6])}}).startswith("not decided")
    pair = bench_ssl.paired(far, "sogclr@64", "simclr@512", "test_knn")
    assert pair["seeds"] == [0, 1, 2] and pair["diffs"] == pytest.approx([-0.13, -0.14, -0.15])
    assert pair["p_wilcoxon"] == pytest.approx(0.25)  # 3 seeds, all of one sign: the smallest two-sided p there is
    assert bench_ssl.paired(far, "isogclr@64", "sogclr@64", "test_knn") is None
    close.update(
        verdict=bench_ssl.verdict(close), paired=[bench_ssl.paired(close, "sogclr@64", "simclr@512", "test_linear")]
    )
    table = bench_ssl.markdown(close)
    assert "| sogclr@64 | 64 | 0.001 | 50.0 ± 0.0 | 72.0 ± 2.0 | 36.0 ± 1.0 |" in table
    assert "- sogclr@64 − simclr@512, test_linear: -0.5, -0.5, -0.5 (Wilcoxon p = 0.25)" in table


# ----------------------------------------------------------------------------- accumulation
def ssl_steps(loss_name: str, k: int, n_steps: int = 2) -> dict:
    """n_steps of the trainer's engine in ssl mode (image tower + projector, the loss's unimodal form) with
    accum_steps = k on the same batches of two views: gradients, losses, parameters and per-image state."""
    from fastclip.distributed import DistInfo
    from fastclip.train.config import load_config
    from fastclip.train.net import build_net

    args = ["--ssl.enabled", "true", "--data.zeroshot", "null", "--loss.name", loss_name, "--data.batch_size", "8"]
    args += ["--optim.accum_steps", str(k), "--optim.eps", "1e-4", "--train.seed", "0", "--loss.rho", "0.6"]
    args += ["--loss.temperature", "0.2", "--optim.lr_tau", "1e-3", "--optim.lr_tau_schedule", "const"]
    cfg = load_config(None, args)
    net = build_net(cfg, DistInfo(0, 1, 0, torch.device("cpu"), "none", False), data_size=64)
    for g in net.engine.param_groups:
        g["lr"] = 1e-3
    data = torch.Generator().manual_seed(7)
    out = {"grads": [], "tau_grads": [], "losses": []}
    for step in range(n_steps):
        view_1, view_2 = torch.randn(2, 8, 3, 32, 32, generator=data)
        indices = torch.randperm(64, generator=data)[:8]
        loss = net.engine.forward(view_1, view_2, indices, epoch=step)
        net.engine.backward(loss)
        out["grads"].append({n: p.grad.clone() for n, p in net.model.named_parameters() if p.grad is not None})
        out["tau_grads"].append([p.grad.clone() for p in net.engine.tau_params])
        out["losses"].append(loss.detach())
        net.engine.step()
        net.loss_fn.clamp_()
    out["params"] = {n: p.detach().clone() for n, p in net.model.named_parameters()}
    out["loss_params"] = {n: p.detach().clone() for n, p in net.loss_fn.named_parameters()}
    state = net.loss_fn.sample_state().state_dict()
    out["state"], out["seen"] = state["fields"], state["seen"]
    return out


@pytest.mark.parametrize("loss_name", ["fastclip-v2", "fastclip-v3"])
def test_k_micro_batches_equal_one_batch_in_ssl_mode(loss_name):
    from test_accumulate import assert_equivalent

    ref = ssl_steps(loss_name, 1)
    assert any(n.startswith("projector.") for n in ref["grads"][0])
    assert_equivalent(ssl_steps(loss_name, 2), ref, f"ssl {loss_name} k=2")


# ----------------------------------------------------------------------------- DeepSpeed
def test_deepspeed_zero2_trains_the_same_as_ddp(runs, tiny_embedded, tmp_path):
    """The 2-process iSogCLR run under ZeRO-2 (sharded optimizer and gradients): the tower, projector and per-image
    state of DDP's run to float rounding (another reduction order)."""
    pytest.importorskip("deepspeed")
    extra = {"train.max_steps": 6, "train.distributed": "deepspeed", "deepspeed.stage": 2}
    job = Job(ssl_args(tiny_embedded, tmp_path / "zero2", **extra), 2, tmp_path / "logs")
    assert job.wait(300) == [0, 0], job.outputs()
    ref, got = runs / "straight", tmp_path / "zero2"
    ddp, zero = (load(step_dir(run, 6) / "model.pt") for run in (ref, got))
    assert ddp["state_dict"].keys() == zero["state_dict"].keys()
    for key, value in ddp["state_dict"].items():
        torch.testing.assert_close(zero["state_dict"][key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    for r in range(2):
        a, b = (load(step_dir(run, 6) / f"rank_{r}.pt")["loss_state"]["_extra_state"] for run in (ref, got))
        assert torch.equal(a["seen"], b["seen"])
        for field, value in a["fields"].items():
            torch.testing.assert_close(b["fields"][field], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{field}: {m}")


def test_an_image_folder_without_captions_becomes_shards_that_train(tmp_path, capsys):
    """`fastclip data folder --images DIR` alone: every image under DIR (sorted, recursively; other files left
    out, an undecodable one skipped and said), no caption member, then an ssl run on the shards."""
    from fastclip.data.cli import main as data_main
    from fastclip.eval.samples import iter_samples

    images = tmp_path / "pictures"
    for i in range(18):
        folder = images / f"class_{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (24, 24), (12 * i, 200 - 9 * i, 5 * i)).save(folder / f"{i:03d}.jpg")
    (images / "README.txt").write_text("not an image")
    (images / "broken.png").write_bytes(b"not a png")
    shards = tmp_path / "shards"
    assert data_main(["folder", "--images", str(images), "--out", str(shards), "--shard-size", "10"]) == 0
    out = capsys.readouterr().out
    assert "broken.png: undecodable" in out and "18 of 19" in out
    samples = list(iter_samples(shards))
    assert len(samples) == 18 and all(s.caption is None for s in samples)
    assert sorted(s.index for s in samples) == [i for i in range(19) if i != 0]  # broken.png sorts first
    run = tmp_path / "run"
    args = ssl_args(tmp_path, run, "dcl", **{"data.train": str(shards), "train.epochs": 1, **NO_GAMMA})
    assert train_main(args) == 0
    assert [r["step"] for r in train_records(run)] == [1, 2, 3]  # 18 images, batches of 8: the last one filled
    capsys.readouterr()
    one_line_error(capsys, data_main, ["folder", "--out", str(tmp_path / "x")], "pass --captions FILE", "--images DIR")


def test_the_benchmark_deals_the_held_out_shards_into_disjoint_val_and_test_splits(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_ssl

    from fastclip.data.manifest import read_manifest
    from fastclip.eval.samples import iter_samples

    root = bench_ssl.prepare_data(tmp_path / "embedded", bench_ssl.QUICK)
    assert not (tmp_path / "embedded.partial").exists()
    train, val, test = (read_manifest(root / split) for split in ("train", "val", "test"))
    assert train.num_samples == 200 and val.num_samples == test.num_samples == 60  # 20 classes x (10, 6 held out)
    assert train.data_size == val.data_size == test.data_size == 320  # one per-sample table covers every split
    indices = {split: {s.index for s in iter_samples(root / split)} for split in ("train", "val", "test")}
    assert not indices["val"] & indices["test"] and not indices["train"] & (indices["val"] | indices["test"])
    assert indices["val"] | indices["test"] == set(range(200, 320))
    assert bench_ssl.prepare_data(root, bench_ssl.QUICK) == root  # done once: a second call keeps it


def test_the_benchmark_weights_each_datasets_test_score_by_its_images_and_skips_a_torn_line(tmp_path):
    """`fastclip eval` scores each dataset's classes apart (a row per dataset and task): the run's test score is
    their mean weighted by test images; a line cut short by a stop does not count (the run is redone)."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_ssl

    run_dir = tmp_path / "runs" / "sogclr@64-lr0.001-seed2"
    run_dir.mkdir(parents=True)
    evals = [
        {"step": 10, "samples_seen": 640, "eval/knn_top1": 0.3},
        {"step": 20, "samples_seen": 1280, "eval/knn_top1": 0.5},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals) + bench_ssl.FINAL)
    rows = [
        {"task": "knn", "dataset": "fashion-mnist", "num_samples": 300, "top1": 0.8},
        {"task": "knn", "dataset": "mnist", "num_samples": 100, "top1": 0.4},
        {"task": "linear_probe", "dataset": "fashion-mnist", "num_samples": 300, "top1": 0.6},
        {"task": "linear_probe", "dataset": "mnist", "num_samples": 100, "top1": 1.0},
    ]
    scores = run_dir / "test.jsonl"
    scores.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "wall_s").write_text("100.0\n20.5\n")
    got = bench_ssl.run_one(tmp_path, tmp_path, "sogclr@64", "sogclr", 64, 1e-3, 2, 4, test=True, run=False)
    assert got["curve"] == [(640, 0.3), (1280, 0.5)] and got["final"] == 0.5 and got["seconds"] == 120.5
    assert got["test_knn"] == pytest.approx(0.7) and got["test_linear"] == pytest.approx(0.7)
    assert got["test_knn_by_dataset"] == {"fashion-mnist": 0.8, "mnist": 0.4}
    scores.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[2])[:30])  # the eval stopped while writing
    assert bench_ssl.run_one(tmp_path, tmp_path, "sogclr@64", "sogclr", 64, 1e-3, 2, 4, test=True, run=False) is None


def test_the_benchmark_refuses_a_folder_of_runs_made_with_other_settings(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_ssl

    kept = tmp_path / "ssl" / "settings.json"
    kept.parent.mkdir()
    kept.write_text('{"epochs": 6}\n')  # runs of an earlier protocol: resuming them at another length mixes the two
    assert bench_ssl.main(["--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"bench_ssl: {tmp_path / 'ssl'} holds runs of other settings ({kept}): move it away or pass another --out"
    )
    assert sorted(p.name for p in kept.parent.iterdir()) == ["settings.json"]  # nothing else written
