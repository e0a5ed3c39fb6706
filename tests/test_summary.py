"""`fastclip summary`: the quickstart's last lines, from a run folder as the trainer and `fastclip eval` leave it."""

from __future__ import annotations

import json
from pathlib import Path

from fastclip.cli import main as fastclip_main
from fastclip.train.config import dump_config, load_config

REPO = Path(__file__).resolve().parents[1]
NO_HELD_OUT = ["--data.val", "null", "--data.zeroshot", "null"]  # with data of our own: else a note


def _run_folder(root: Path, data: Path, distinct_captions: int) -> Path:
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    cfg = load_config(
        REPO / "configs" / "embedded.yaml",
        ["--data.train", str(data / "train"), "--data.batch_size", "8", *NO_HELD_OUT],
    )
    (run / "config.yaml").write_text(dump_config(cfg))
    rows = [
        {
            "step": 5,
            "samples_seen": 80,
            "loss": 0.6,
            "samples_per_s": 100.0,
            "samples_per_s_per_rank": 50.0,
            "step_time": 0.2,
        },
        {
            "step": 10,
            "samples_seen": 160,
            "loss": 0.5,
            "samples_per_s": 120.0,
            "samples_per_s_per_rank": 60.0,
            "step_time": 0.1,
        },
        {"step": 10, "samples_seen": 160, "eval/zeroshot/mean_top1": 0.5},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"step": 10, "arch": "tiny-vit"}
    results = [
        {
            **common,
            "step": 5,
            "task": "zeroshot_classification",
            "dataset": "mnist",
            "num_samples": 20,
            "top1": 0.1,
        },  # an older checkpoint's evaluation: not reported
        {**common, "task": "zeroshot_classification", "dataset": "fashion-mnist", "num_samples": 10, "top1": 0.8567},
        {**common, "task": "zeroshot_classification", "dataset": "mnist", "num_samples": 10, "top1": 0.75},
        {
            **common,
            "task": "retrieval",
            "num_samples": 20,
            "distinct_captions": distinct_captions,
            **{f"{d}_R@{k}": k / 20 for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)},
        },
    ]
    (run / "checkpoints" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    return run


def test_summary_reads_at_a_glance(tiny_embedded, tmp_path, capsys):
    run = _run_folder(tmp_path, tiny_embedded, distinct_captions=4)
    (run / "plots").mkdir()
    (run / "plots" / "overview.png").write_bytes(b"png")
    assert fastclip_main(["summary", str(run), "--plots", str(run / "plots"), "--export", str(run / "none.pt")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"summary of {run}",
        f"  trained    fastclip-v3 on tiny-vit (random init), {tiny_embedded / 'train'} (80 pairs)",
        "             10 steps, 160 samples (2.0 epochs), batch 8 per process x 2 processes",
        "  time       2 s training, median 110 samples/s",  # 5 x 0.2 s + 5 x 0.1 s, rounded (no --train-seconds);
        # the median of 100 and 120 (it said 120, the upper middle value)
        "  zero-shot  fashion-mnist   85.7% top-1  (10 held-out images, step 10)",
        "             mnist           75.0% top-1  (10 held-out images, step 10)",
        "  retrieval  not reported: 4 distinct captions for 20 images (templated)",
        f"  run        {run}/ (config.yaml, metrics.jsonl, checkpoints/)",
        f"  plots      {run / 'plots' / 'overview.png'} (loss, objective, temperature, zero-shot accuracy)",
        f"  model      not exported ({run / 'none.pt'} missing)",
    ]


def test_summary_shows_retrieval_with_distinct_captions(tiny_embedded, tmp_path, capsys):
    run = _run_folder(tmp_path, tiny_embedded, distinct_captions=20)
    assert fastclip_main(["summary", str(run), "--train-seconds", "421"]) == 0
    out = capsys.readouterr().out
    assert "  time       7 min 01 s training, median 110 samples/s" in out
    assert "  retrieval  R@1/5/10 image->text 5.0/25.0/50.0%, text->image 5.0/25.0/50.0%  (20 pairs)" in out
    # several captions per image (json "group"): the evaluation names its images
    results = run / "checkpoints" / "results.jsonl"
    grouped = json.loads(results.read_text().splitlines()[-1]) | {"num_images": 10}
    results.write_text(results.read_text() + json.dumps(grouped) + "\n")
    assert fastclip_main(["summary", str(run)]) == 0
    assert "text->image 5.0/25.0/50.0%  (20 captions of 10 images)" in capsys.readouterr().out
    assert fastclip_main(["summary", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    # resumed at another world size (its first 5 steps on 1 process): the batch line named the last layout alone
    metrics = run / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows[0]["samples_per_s_per_rank"] = rows[0]["samples_per_s"]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fastclip_main(["summary", str(run)]) == 0
    assert "batch 8 per process x 2 processes (at the end; 1, 2 over the run)" in capsys.readouterr().out
    assert fastclip_main(["summary", str(tmp_path / "nonexist")]) == 2  # (it said "no config.yaml" for it too)
    assert f"{tmp_path / 'nonexist'}: not found; pass the folder fastclip train wrote" in capsys.readouterr().err


def test_summary_names_each_data_evaluated_at_the_newest_step(tiny_embedded, tmp_path, capsys):
    """A run evaluated on two splits (the quickstart's scenes: test, then novel) shows both, each named; with one
    data the lines stay unnamed (test_summary_reads_at_a_glance)."""
    run = _run_folder(tmp_path, tiny_embedded, distinct_captions=20)
    results = run / "checkpoints" / "results.jsonl"
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    split = [
        {**r, "data": data, "top1": r.get("top1", 0) / scale}
        | ({"image_to_text_R@1": 0.5 / scale} if r["task"] == "retrieval" else {})
        for data, scale in (("d/test", 1), ("d/novel", 2))
        for r in rows
        if r["step"] == 10 and r.get("dataset") != "fashion-mnist"
    ]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows[:1] + split))
    assert fastclip_main(["summary", str(run)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith(("  zero-shot", "  retrieval"))]
    assert lines == [
        "  zero-shot  mnist   75.0% top-1  (10 held-out images of d/test, step 10)",
        "  retrieval  R@1/5/10 image->text 50.0/25.0/50.0%, text->image 5.0/25.0/50.0%  (20 pairs of d/test)",
        "  zero-shot  mnist   37.5% top-1  (10 held-out images of d/novel, step 10)",
        "  retrieval  R@1/5/10 image->text 25.0/25.0/50.0%, text->image 5.0/25.0/50.0%  (20 pairs of d/novel)",
    ]
    # the same split typed two ways is one data; rows of an older file (no data recorded) are a group of their own
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    rows = [{**r, "data": "d/test/"} if r.get("data") == "d/test" else r for r in rows]
    rows.append({k: v for k, v in split[0].items() if k != "data"})
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fastclip_main(["summary", str(run)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith(("  zero-shot", "  retrieval"))]
    assert [x.split("(")[-1] for x in lines] == [
        "10 held-out images of d/test, step 10)",
        "20 pairs of d/test)",
        "10 held-out images of d/novel, step 10)",
        "20 pairs of d/novel)",
        "10 held-out images of data not recorded, step 10)",
    ]


def test_summary_without_fastclip_eval_shows_the_runs_own_last_evaluation(tiny_embedded, tmp_path, capsys):
    """A run evaluated during training (eval.every_steps, eval.at_end) and never by `fastclip eval`: its last
    metrics.jsonl evaluation, not "not evaluated yet"."""
    run = _run_folder(tmp_path, tiny_embedded, distinct_captions=20)
    (run / "checkpoints" / "results.jsonl").unlink()
    recalls = {f"eval/retrieval/{d}_R@{k}": k / 20 for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)}
    evals = [
        {"step": 5, "samples_seen": 80, "eval/zeroshot/mnist/top1": 0.1, "eval/zeroshot/mnist/num_samples": 20.0},
        {"step": 10, "samples_seen": 160, "eval/zeroshot/mnist/top1": 0.75, "eval/zeroshot/mnist/num_samples": 20.0,
         "eval/zeroshot/fashion-mnist/top1": 0.8567, "eval/retrieval/num_samples": 20.0,
         "eval/retrieval/distinct_captions": 20.0, **recalls},
    ]  # fmt: skip
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in evals))
    assert fastclip_main(["summary", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    where = "the run's own evaluation, step 10"
    assert lines[4:7] == [
        f"  zero-shot  fashion-mnist   85.7% top-1  (held-out images, {where})",
        f"             mnist           75.0% top-1  (20 held-out images, {where})",
        f"  retrieval  R@1/5/10 image->text 5.0/25.0/50.0%, text->image 5.0/25.0/50.0%  (20 pairs, {where})",
    ]
    # templated captions (4 distinct of 20) are said as fastclip eval says them; a run that did not log the count
    # shows no retrieval (it showed the numbers whatever the captions)
    for distinct, said in ((4.0, "  retrieval  not reported: 4 distinct captions for 20 images"), (None, None)):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rows[-1]["eval/retrieval/distinct_captions"] = distinct
        if distinct is None:
            del rows[-1]["eval/retrieval/distinct_captions"]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert fastclip_main(["summary", str(run)]) == 0
        out = capsys.readouterr().out
        assert (said in out) if said else "retrieval" not in out


def test_a_spot_check_or_training_data_does_not_replace_the_held_out_headline(tiny_embedded, tmp_path, capsys):
    """`fastclip eval --max-samples 10` after the full evaluation of the same data and step became the headline (100 %
    on 4 images); an evaluation on the training shards alone hid the run's own held-out evaluation."""
    run = _run_folder(tmp_path, tiny_embedded, distinct_captions=20)
    results = run / "checkpoints" / "results.jsonl"
    full = [json.loads(x) for x in results.read_text().splitlines()]
    mnist = next(r for r in full if r.get("dataset") == "mnist" and r["step"] == 10)
    spot = {**mnist, "top1": 1.0, "num_samples": 4, "max_samples": 10}
    results.write_text(results.read_text() + json.dumps(spot) + "\n")
    assert fastclip_main(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    assert "mnist           75.0% top-1  (10 held-out images, step 10)" in out and "100.0%" not in out
    # other prompts (--templates, --classnames) after it: a variant, not the headline (it replaced it: helper-59)
    bare = {**mnist, "top1": 0.3, "templates": "/tmp/bare.json"}
    results.write_text(results.read_text() + json.dumps(bare) + "\n")
    assert fastclip_main(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    assert "mnist           75.0% top-1  (10 held-out images, step 10)" in out and "30.0%" not in out
    # where the variant is all there is, it is shown, saying so
    results.write_text("".join(json.dumps(r) + "\n" for r in full if r is not mnist) + json.dumps(bare) + "\n")
    assert fastclip_main(["summary", str(run)]) == 0
    assert "30.0% top-1  (10 held-out images, step 10, --templates /tmp/bare.json)" in capsys.readouterr().out
    # only training shards evaluated: shown as such, and the run's own held-out evaluation beside them
    results.write_text("".join(json.dumps({**r, "held_out": False}) + "\n" for r in full if r["step"] == 10))
    own = {"step": 10, "samples_seen": 160, "eval/zeroshot/mnist/top1": 0.25, "eval/zeroshot/mnist/num_samples": 20.0}
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(own) + "\n")
    assert fastclip_main(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    assert "mnist           75.0% top-1  (10 training images, step 10)" in out
    assert "mnist   25.0% top-1  (20 held-out images, the run's own evaluation, step 10)" in out
    # a held-out evaluation of an older step is not what the summary shows: the run's own still comes beside
    older = [r for r in full if r["step"] == 5]
    results.write_text("".join(json.dumps(r) + "\n" for r in older) + results.read_text())
    assert fastclip_main(["summary", str(run)]) == 0
    assert "the run's own evaluation, step 10" in capsys.readouterr().out


def test_summary_of_an_ssl_run_names_images_and_its_knn(tiny_embedded, tmp_path, capsys):
    """An ssl run (image tower alone): its data are images, not pairs; its evaluation is data.val's kNN (summary
    advised `fastclip eval RUN`, which refuses an ssl run)."""
    run = _run_folder(tmp_path, tiny_embedded, distinct_captions=20)
    (run / "checkpoints" / "results.jsonl").unlink()
    cfg = load_config(
        REPO / "configs" / "embedded.yaml",
        ["--data.train", str(tiny_embedded / "train"), "--data.batch_size", "8", *NO_HELD_OUT, "--ssl.enabled", "true"],
    )
    (run / "config.yaml").write_text(dump_config(cfg))
    assert fastclip_main(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    assert (
        f"{tiny_embedded / 'train'} (80 images)" in out
        and f"  kNN        not evaluated yet: fastclip eval {run} --data DIR --linear-probe --knn 20" in out
    )
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 10, "samples_seen": 160, "eval/knn_top1": 0.4, "eval/knn_samples": 60}) + "\n")
    assert fastclip_main(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    assert "  kNN         40.0% top-1  (60 held-out images, leave-one-out, the run's own evaluation, step 10)" in out
