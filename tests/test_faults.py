"""Faults, with real processes: a job killed at a random step and resumed, a kill in the middle of a checkpoint
write, one rank dying or hanging mid-step, NaN/Inf steps, a resume at another world size, rotten shards,
checkpoints carrying pickled objects, bad configuration. Faults are injected through FASTCLIP_FAULTS
(fastclip/faults.py) into the real code paths, or by signals sent from here.

Process launches are kept few (each imports torch + open_clip): one 2-process spawn runs the reference run,
the world-size change, the NaN runs and the rotten-data run one after the other; the killed job, its resume
and the dying/hanging ranks are real process groups started here (as a cluster would run them).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from fastclip.losses import reshard_states
from fastclip.train.cli import main

from dist_utils import run_distributed
from helpers import (
    EMBEDDED,
    Job,
    assert_same,
    assert_same_training_state,
    fault_overrides,
    latest,
    load,
    records,
    removed_unless_failed,
    step_dir,
    train_records,
    wait_for,
)

STEPS = 8  # of the killed job and its reference: 5 steps per epoch at 2 x 8, so it crosses into epoch 1


# ----------------------------------------------------------------------------- rotten shards
def _sample(i: int, **override) -> dict:
    from fastclip.data.sources.synthetic import synthetic_image

    meta = {"index": i, "key": f"{i:09d}", "caption": f"a picture number {i}"}
    files = {"png": synthetic_image(i), "txt": meta["caption"].encode()}
    for name, value in override.items():
        (files if name in ("png", "txt") else meta)[name] = value
    files["json"] = json.dumps({k: v for k, v in meta.items() if v is not None}).encode()
    return files


ROTTEN = {"000000003": "undecodable_image", "000000005": "missing_caption", "000000007": "index_out_of_range"}


def make_rotten(folder: Path) -> int:
    """a.tar: 12 samples, 3 of them bad (ROTTEN); b.tar: 15 samples, truncated; c.tar: 13 good ones.
    The manifest (as written before the damage) promises 40. Returns how many samples of b.tar survive."""
    from fastclip.data.manifest import Manifest, ShardInfo, write_manifest
    from fastclip.data.tario import ShardReader, TarBroken, write_tar

    from helpers import truncate_file

    folder.mkdir(parents=True)
    a = [_sample(i) for i in range(12)]
    a[3]["png"] = b"\x89PNG\r\n\x1a\n and then nothing an image decoder wants"
    a[5] = _sample(5, txt=b"", caption="")  # empty caption, in the .txt and in the json
    a[7] = _sample(7, index=10_000)  # far outside data_size
    write_tar(folder / "a.tar", [(f"{i:09d}", f) for i, f in enumerate(a)])
    write_tar(folder / "b.tar", [(f"{i:09d}", _sample(i)) for i in range(12, 27)])
    write_tar(folder / "c.tar", [(f"{i:09d}", _sample(i)) for i in range(27, 40)])
    truncate_file(folder / "b.tar", int((folder / "b.tar").stat().st_size * 0.5))
    write_manifest(
        folder,
        Manifest(40, [ShardInfo("a.tar", 12, 0, 11), ShardInfo("b.tar", 15, 12, 26), ShardInfo("c.tar", 13, 27, 39)]),
    )
    readable = 0
    with contextlib.suppress(TarBroken), ShardReader(folder / "b.tar") as reader:
        while reader.next_group() is not None:
            readable += 1
    assert 0 < readable < 15
    return readable


# ----------------------------------------------------------------------------- the 2-process batch of runs
def _runs(rank, world_size, specs):
    """Runs `fastclip train` in this process group once per spec: (args, FASTCLIP_FAULTS, log file or None).
    Returns the final step of each run, or the TrainingError it stopped with."""
    import multiprocessing

    from fastclip.train.config import load_config
    from fastclip.train.errors import TrainingError
    from fastclip.train.trainer import train

    # data workers start as under torchrun or srun (fork), not as this spawned test process was started
    multiprocessing.set_start_method("fork", force=True)
    results = []
    for args, fault_spec, log_file in specs:
        if fault_spec:
            os.environ["FASTCLIP_FAULTS"] = fault_spec
        else:
            os.environ.pop("FASTCLIP_FAULTS", None)
        out = open(f"{log_file}.rank{rank}", "w") if log_file else contextlib.nullcontext(sys.stdout)
        with out as stream, contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
            try:
                results.append(train(load_config(EMBEDDED, args))["step"])
            except TrainingError as e:
                results.append(f"{type(e).__name__}: {e}")
    os.environ.pop("FASTCLIP_FAULTS", None)
    return results


@pytest.fixture(scope="module")
def one_process_run(data, tmp_path_factory) -> Path:
    """fastclip-v2 on one process for 4 steps (batch 8): the checkpoint the 1 -> 2 resume starts from."""
    run = tmp_path_factory.mktemp("one") / "run"
    assert main(["--config", str(EMBEDDED), *fault_overrides(data, run, **{"train.max_steps": 4})]) == 0
    return run


@pytest.fixture(scope="module")
def batch(data, one_process_run, tmp_path_factory, request):
    root = tmp_path_factory.mktemp("batch")
    rotten_readable = make_rotten(root / "rotten")
    runs = {
        # the reference for the killed job: uninterrupted, with data worker processes
        "reference": (
            fault_overrides(data, root / "reference", **{"train.max_steps": STEPS, "data.workers": 1}),
            None,
            None,
        ),
        # 1 -> 2 processes: resume the one-process checkpoint without a further step, then train on to step 7
        "grow": (
            fault_overrides(
                data, root / "grow", **{"train.max_steps": 4, "train.resume": step_dir(one_process_run, 4)}
            ),
            None,
            None,
        ),
        "grow_on": (
            fault_overrides(data, root / "grow", **{"train.max_steps": 7, "train.resume": "latest"}),
            None,
            None,
        ),
        # NaN features at step 2 (rank 0's batch), NaN gradients at step 3 (rank 1 only, after backward's all-reduce)
        # (the host decision: a NaN that appears on one rank after the all-reduce is still seen by all ranks)
        "nan": (
            fault_overrides(
                data,
                root / "nan",
                **{"train.max_steps": 3, "checkpoint.every_steps": 1, "train.nonfinite_check": "host"},
            ),
            "nan@batch:step=2:rank=0; nan@grads:step=3:rank=1",
            None,
        ),
        # the same on the device (no per-step host read): NaN features at step 2 (rank 0) and 3 (rank 1)
        "nan_device": (
            fault_overrides(data, root / "nan_device", **{"train.max_steps": 3, "checkpoint.every_steps": 1}),
            "nan@batch:step=2:rank=0; nan@batch:step=3:rank=1",
            None,
        ),
        # resumed: step 4 is fine, then NaN at 5 and 6 with at most 2 in a row allowed
        **{
            f"{name}_stop": (
                fault_overrides(
                    data,
                    root / name,
                    **{
                        "train.max_steps": 9,
                        "checkpoint.every_steps": 1,
                        "train.resume": "latest",
                        "train.max_nonfinite_steps": 2,
                        "train.nonfinite_check": check,
                    },
                ),
                "nan@batch:step=5:rank=1; nan@batch:step=6:rank=0",
                None,
            )
            for name, check in (("nan", "host"), ("nan_device", "device"))
        },
        # rotten shards, 2 data workers per rank: 4 workers over 3 shards, no resampling
        "rotten": (
            fault_overrides(
                data,
                root / "rotten_run",
                **{
                    "data.train": root / "rotten",
                    "data.batch_size": 4,
                    "data.workers": 2,
                    "train.epochs": 2,
                    "data.shuffle_buffer": 8,
                },
            ),
            None,
            str(root / "rotten.log"),
        ),
    }
    started = time.monotonic()
    results = run_distributed(_runs, 2, list(runs.values()), timeout=420)
    assert results[0] == results[1], results
    summary = {
        "root": root,
        "results": dict(zip(runs, results[0])),
        "seconds": time.monotonic() - started,
        "rotten_readable": rotten_readable,
    }
    yield from removed_unless_failed(request, root, summary)


# ----------------------------------------------------------------------------- kill the whole job, resume
def test_job_killed_at_a_random_step_resumes_exactly(data, batch, tmp_path):
    """SIGKILL of the whole process group (both ranks and their data workers) at a random moment after a random
    step, then `--train.resume latest`: the end state equals the uninterrupted run's, bitwise."""
    assert batch["results"]["reference"] == STEPS
    seed = random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    kill_after, delay = rng.randint(1, STEPS - 3), rng.uniform(0.0, 0.1)
    run = tmp_path / "run"
    args = fault_overrides(data, run, **{"train.max_steps": STEPS, "data.workers": 1, "train.resume": "latest"})
    job = Job(args, 2, tmp_path / "killed")
    try:
        wait_for(
            lambda: any(r["step"] >= kill_after for r in train_records(run)),
            240,
            f"step {kill_after} of the job to be killed",
            job,
        )
        time.sleep(delay)
        os.killpg(job.pgid, signal.SIGKILL)
        codes = job.wait(30)
    finally:
        job.kill()
    where = f"(seed {seed}: killed after step {kill_after} + {delay:.2f}s)"
    assert codes == [-signal.SIGKILL] * 2, where
    done = [r["step"] for r in train_records(run)]
    assert max(done) < STEPS, f"the job finished before the kill {where}"
    pointer = run / "checkpoints" / "latest"
    resumed_from = pointer.read_text().strip() if pointer.exists() else None

    job = Job(args, 2, tmp_path / "resumed")
    codes = job.wait(240)
    assert codes == [0, 0], f"{where}\n{job.outputs()}"
    if resumed_from:
        assert f"resumed from {run / 'checkpoints' / resumed_from}" in job.output(0), where
    reference = batch["root"] / "reference"
    assert_same_training_state(step_dir(reference, STEPS), step_dir(run, STEPS), 2)
    expected, got = train_records(reference), train_records(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), where
    for x, y in zip(expected, got):
        assert (x["loss"], x["objective"], x["lr"], x["samples_seen"]) == (
            y["loss"],
            y["objective"],
            y["lr"],
            y["samples_seen"],
        ), where


# ----------------------------------------------------------------------------- world size 1 -> 2
def test_resume_one_process_checkpoint_on_two(batch, one_process_run):
    """1 -> 2 processes: every per-sample state entry lands on its new owner unchanged, weights and optimizer
    carry over, and training goes on at the new world size."""
    assert batch["results"]["grow"] == 4 and batch["results"]["grow_on"] == 7
    old, new = step_dir(one_process_run, 4), step_dir(batch["root"] / "grow", 4)
    m_old, m_new = load(old / "model.pt"), load(new / "model.pt")
    assert (m_old["world_size"], m_new["world_size"]) == (1, 2)
    for key in ("state_dict", "loss", "optimizer", "step", "samples_seen"):
        assert_same(m_old[key], m_new[key], key)
    old_state = load(old / "rank_0.pt")["loss_state"]["_extra_state"]
    new_states = [load(new / f"rank_{r}.pt")["loss_state"] for r in range(2)]
    expected = reshard_states([load(old / "rank_0.pt")["loss_state"]], 2)
    for r in range(2):
        assert_same(expected[r], new_states[r], f"rank {r} loss_state")
    # entry by entry: global index i lives on rank i % 2 at slot i // 2, with the old values
    data_size = old_state["data_size"]
    for name, column in old_state["fields"].items():
        for i in (0, 1, 2, 37, data_size - 2, data_size - 1):
            assert new_states[i % 2]["_extra_state"]["fields"][name][i // 2] == column[i], (name, i)
        rebuilt = [new_states[i % 2]["_extra_state"]["fields"][name][i // 2].item() for i in range(data_size)]
        assert rebuilt == column.tolist(), name
    assert sum(int(s["_extra_state"]["seen"].sum()) for s in new_states) == int(old_state["seen"].sum()) == 32
    recs = train_records(batch["root"] / "grow")
    assert [r["step"] for r in recs] == [5, 6, 7] and all(math.isfinite(r["loss"]) for r in recs)
    assert [r["samples_seen"] for r in recs] == [32 + 16, 32 + 32, 32 + 48]
    final = [load(step_dir(batch["root"] / "grow", 7) / f"rank_{r}.pt")["loss_state"]["_extra_state"] for r in range(2)]
    assert sum(int(s["seen"].sum()) for s in final) > 32  # the new steps update the state on both ranks


# ----------------------------------------------------------------------------- NaN / Inf
@pytest.mark.parametrize("name", ["nan", "nan_device"])
def test_nonfinite_steps_are_skipped_without_any_update(batch, name):
    """nan (host decision): NaN features (step 2, rank 0) and NaN gradients (step 3, rank 1 only, after the
    all-reduce). nan_device (decided and applied on the device): NaN features at step 2 (rank 0) and 3 (rank 1).
    Both ranks skip both steps, so the state after step 3 is the state after step 1, bitwise, per-sample state
    (v2: u, tau and its Adam moments) included."""
    assert batch["results"][name] == 3
    run = batch["root"] / name
    skipped = {r["step"]: r for r in records(run) if "skipped" in r}
    assert sorted(skipped)[:2] == [2, 3]
    assert "non-finite features" in skipped[2]["skipped"] and "rank 0" in skipped[2]["skipped"]
    if name == "nan":
        assert "non-finite gradients" in skipped[3]["skipped"]
    else:
        assert "non-finite features" in skipped[3]["skipped"] and "rank 1" in skipped[3]["skipped"]
    assert (skipped[2]["nonfinite_skipped"], skipped[3]["nonfinite_skipped"], skipped[3]["nonfinite_in_a_row"]) == (
        1,
        2,
        2,
    )
    one, three = step_dir(run, 1), step_dir(run, 3)
    assert not step_dir(run, 2).exists()  # no checkpoint on a skipped step
    m1, m3 = load(one / "model.pt"), load(three / "model.pt")
    for key in ("state_dict", "loss", "scaler"):
        assert_same(m1[key], m3[key], key)
    assert_same(m1["optimizer"]["state"], m3["optimizer"]["state"], "optimizer state")  # moments and step counts
    assert [g["lr"] for g in m3["optimizer"]["param_groups"]] != [g["lr"] for g in m1["optimizer"]["param_groups"]]
    assert (m1["step"], m3["step"]) == (1, 3) and m3["guards"] == {"skipped": 2, "in_a_row": 2}
    for r in range(2):
        assert_same(load(one / f"rank_{r}.pt")["loss_state"], load(three / f"rank_{r}.pt")["loss_state"], f"rank {r}")


@pytest.mark.parametrize("name", ["nan", "nan_device"])
def test_too_many_nonfinite_steps_in_a_row_stop_with_the_last_good_checkpoint(batch, name):
    run = batch["root"] / name
    message = batch["results"][f"{name}_stop"]
    assert isinstance(message, str) and message.startswith("NonFiniteStepsError"), message
    assert "2 steps in a row" in message and "steps 5..6" in message and "train.max_nonfinite_steps" in message
    assert str(step_dir(run, 4)) in message  # names the last (good) checkpoint
    assert latest(run) == "step_00000004" and not step_dir(run, 5).exists() and not step_dir(run, 6).exists()
    m4 = load(step_dir(run, 4) / "model.pt")
    assert m4["step"] == 4 and m4["guards"]["in_a_row"] == 0
    assert [r["step"] for r in records(run) if "skipped" in r] == [2, 3, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in train_records(run))


# ----------------------------------------------------------------------------- rotten data
def test_rotten_shards_are_skipped_counted_and_logged_with_shard_and_key(batch):
    results, root = batch["results"], batch["root"]
    assert results["rotten"] == 2 * 5  # two epochs of ceil(40 / (2 x 4)) steps: the run completes
    recs = train_records(root / "rotten_run")
    assert [r["step"] for r in recs] == list(range(1, 11)) and all(math.isfinite(r["loss"]) for r in recs)
    last = recs[-1]
    lost_in_b = 15 - batch["rotten_readable"]
    # each lost sample is counted once per epoch, summed over ranks, however often a rank re-reads it to fill
    # its batches (a re-read is not counted again)
    by_reason = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("data_skipped/")}
    assert by_reason == {**{reason: 2 for reason in ROTTEN.values()}, "truncated_tar": 2 * lost_in_b}, last
    assert last["data_skipped"] == sum(by_reason.values()), last
    assert [r["data_skipped"] for r in recs] == sorted(r["data_skipped"] for r in recs)  # running totals
    events = [e for r in recs for e in r.get("data_skips", [])]
    seen = {(e["reason"], e["shard"], e["key"]) for e in events}
    for key, reason in ROTTEN.items():
        assert (reason, "a.tar", key) in seen, (reason, key, seen)
    assert any(e["reason"] == "truncated_tar" and e["shard"] == "b.tar" and e["key"] for e in events)
    assert {e["rank"] for e in events} <= {0, 1}
    log = Path(f"{root / 'rotten.log'}.rank0").read_text()  # rank 0's log names every rank's skips
    for key, reason in ROTTEN.items():  # once per epoch
        assert log.count(f"shard a.tar key {key}: {reason}") == 2, log
    assert log.count("shard b.tar: truncated_tar after key") == 2, log
    per_epoch = 3 + lost_in_b
    for epoch in (0, 1):
        assert (
            f"data: epoch {epoch}: {per_epoch} sample(s) skipped, summed over ranks (index_out_of_range 1, "
            f"missing_caption 1, truncated_tar {lost_in_b}, undecodable_image 1)"
        ) in log, log
    rank1 = Path(f"{root / 'rotten.log'}.rank1").read_text()
    assert "a.tar" not in rank1 and "b.tar" not in rank1, rank1  # logged once: by rank 0, not by every rank
    assert batch["seconds"] < 400


# ----------------------------------------------------------------------------- a rank dies or hangs
def _one_rank_fails(data, tmp_path, action: str, timeout_s: float) -> tuple[Job, float]:
    run = tmp_path / "run"
    args = fault_overrides(data, run, **{"train.max_steps": 8, "train.collective_timeout_seconds": timeout_s})
    job = Job(args, 2, tmp_path / "job", env={"FASTCLIP_FAULTS": f"{action}@step:step=4:rank=1"})
    try:
        wait_for(lambda: f"{action} at step, step 4, rank 1" in job.output(1), 240, f"rank 1 to {action}", job)
        failed_at = time.monotonic()
        code0 = job.procs[0].wait(timeout=timeout_s + 60)
        took = time.monotonic() - failed_at
    finally:
        job.kill()
    assert code0 == 1, job.outputs()
    return job, took


def test_a_dead_rank_stops_the_others_with_a_clear_error(data, tmp_path):
    job, took = _one_rank_fails(data, tmp_path, "kill", 20.0)
    assert job.procs[1].returncode == -signal.SIGKILL
    out = job.output(0)
    assert took < 15, out
    assert "fastclip train: error: rank 0 of 2: a collective failed during the training step at step 4" in out
    assert "Another process of this job most likely died" in out and "--train.resume latest" in out
    assert "Traceback" not in out


def test_a_hung_rank_stops_the_others_after_the_collective_timeout(data, tmp_path):
    job, took = _one_rank_fails(data, tmp_path, "stop", 3.0)
    out = job.output(0)
    assert 0.5 < took < 25, (took, out)  # rank 0 may have been waiting a little before rank 1 stopped
    assert "fastclip train: error: rank 0 of 2: a collective failed during the training step at step 4" in out
    assert "collectives time out after 3 s" in out and "Traceback" not in out


# ----------------------------------------------------------------------------- kill during a checkpoint write
@pytest.fixture(scope="module")
def uninterrupted_v3(data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("v3") / "run"
    assert main(["--config", str(EMBEDDED), *fault_overrides(data, run, "fastclip-v3", **{"train.max_steps": 6})]) == 0
    return run


@pytest.mark.parametrize("stage", ["model_file", "renamed"])
def test_kill_during_a_checkpoint_write_leaves_latest_complete(data, uninterrupted_v3, tmp_path, stage):
    """The process dies inside the real writer (SIGKILL at a chosen stage of the save at step 4): `latest` still
    names the complete step-2 checkpoint, which loads. Killed after step 4's folder was renamed into place, before
    the pointer moved, the resume takes step 4 (complete, and saved after the pointer). Either way the resume ends
    exactly where an uninterrupted run ends."""
    run = tmp_path / "run"
    args = fault_overrides(data, run, "fastclip-v3", **{"train.max_steps": 6, "train.resume": "latest"})
    job = Job(args, 1, tmp_path / "job", env={"FASTCLIP_FAULTS": f"kill@checkpoint.{stage}:step=4"})
    assert job.wait(240) == [-signal.SIGKILL], job.outputs()
    assert f"kill at checkpoint.{stage}, step 4" in job.output(0)
    assert latest(run) == "step_00000002"
    two = run / "checkpoints" / latest(run)
    from fastclip.checkpoint import load_file, resolve_resume

    assert resolve_resume("latest", run) == (two if stage == "model_file" else step_dir(run, 4))
    assert load_file(two / "model.pt")["step"] == 2 and load_file(two / "rank_0.pt")["step"] == 2
    if stage == "model_file":  # the half-written folder is hidden and has no model.pt
        assert (run / "checkpoints" / ".tmp_step_00000004" / "rank_0.pt").exists()
        assert not step_dir(run, 4).exists()
    else:  # renamed into place complete, the pointer not yet moved: both are whole
        assert load_file(step_dir(run, 4) / "model.pt")["step"] == 4
    assert main(["--config", str(EMBEDDED), *args]) == 0
    assert not list((run / "checkpoints").glob(".tmp_*"))
    assert_same_training_state(step_dir(uninterrupted_v3, 6), step_dir(run, 6), 1)


# ----------------------------------------------------------------------------- untrusted checkpoints
class _Payload:
    """What a malicious checkpoint carries: unpickling it would run a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("file", ["model.pt", "rank_0.pt"])
def test_a_checkpoint_with_pickled_objects_is_refused(data, one_process_run, tmp_path, capsys, file):
    import shutil

    import torch

    ckpt = tmp_path / "untrusted" / "step_00000004"
    shutil.copytree(step_dir(one_process_run, 4), ckpt)
    marker = tmp_path / "pwned"
    torch.save({**load(ckpt / file), "extra": _Payload(marker)}, ckpt / file)
    run = tmp_path / "run"
    # both are read before anything is built (the operator's files: exit 2, as --check says)
    args = ["--config", str(EMBEDDED), *fault_overrides(data, run, **{"train.max_steps": 6, "train.resume": ckpt})]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"fastclip train: config error: config key 'train.resume': {ckpt / file}: refusing to load pickled" in err
    assert "weights_only=True" in err and "posix.system" in err
    assert not marker.exists() and not (run / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- bad configuration
@pytest.mark.parametrize(
    "extra, key, words",
    [
        ({"train.max_nonfinite_step": 3}, "train.max_nonfinite_step", "unknown config key"),  # a typo
        ({"train.max_nonfinite_steps": 0}, "train.max_nonfinite_steps", ">= 1"),
        ({"train.collective_timeout_seconds": 0}, "train.collective_timeout_seconds", "> 0"),
        ({"data.data_size": 50}, "data.data_size", "largest index 99"),  # manifests say 100
        ({"data.samples_per_epoch": 40}, "data.samples_per_epoch", "data.resampled"),
        ({"data.batch_size": 81}, "data.batch_size", "80 samples"),  # 80 training samples
        (
            {
                "loss.name": "fastclip-v3",
                "loss.rho": 6.5,
                "loss.temperature": "null",
                "optim.lr_tau_schedule": "step_thresh",
                "train.resume": "RESUME",
            },
            "loss.name",
            "was trained with 'fastclip-v2'",
        ),
    ],
)
def test_bad_configuration_is_an_error_before_training(data, one_process_run, tmp_path, capsys, extra, key, words):
    extra = {k: (step_dir(one_process_run, 4) if v == "RESUME" else v) for k, v in extra.items()}
    run = tmp_path / "run"
    assert main(["--config", str(EMBEDDED), *fault_overrides(data, run, **extra)]) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and words in err, err
    assert not (run / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- no host read per step
@pytest.mark.parametrize("loss", ["fastclip-v3", "fastclip-v2", "openclip"])
def test_a_training_step_reads_nothing_back_from_the_device(data, tmp_path, monkeypatch, loss):
    """loss.validate "deferred" and train.nonfinite_check "device" (the defaults): after the first step (the loss's
    structure handshake), a whole training step (forward, loss with its input checks, backward, the NaN decision,
    the optimizer step, the per-sample state journal) makes no host read of a tensor: .item(), .tolist(), bool()
    and float() are counted while train_step runs, and so are the ops that sync with the host on CUDA whoever
    calls them (a scalar read, as indexing with a 0-d tensor does; nonzero and masked_select, as a bool mask index
    does). The deferred input checks are folded every 2 calls here (64 by default), so folds run inside steps.
    Logging and checkpoint steps read outside train_step. The losses' look at CPU indices for repeats (free on
    the CPU, a sync on CUDA) is turned off: this runs what a CUDA step runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastclip.losses import batch as batch_module
    from fastclip.losses import validation
    from fastclip.train.config import load_config
    from fastclip.train.trainer import Run, train

    reads: list[str] = []
    syncing = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_dim"}

    class CountSyncingOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket._qualified_op_name.replace("::", ".") in syncing:
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    original_step = Run.train_step
    watched = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__")}

    def counting(name):
        def read(tensor, *args, **kwargs):
            reads.append(f"{name} of a {tuple(tensor.shape)} tensor")
            return watched[name](tensor, *args, **kwargs)

        return read

    def train_step(self, *batch):
        if self.step == 0:
            return original_step(self, *batch)
        with monkeypatch.context() as patch:
            for name in watched:
                patch.setattr(torch.Tensor, name, counting(name))
            with CountSyncingOps():
                return original_step(self, *batch)

    monkeypatch.setattr(Run, "train_step", train_step)
    monkeypatch.setattr(validation, "FOLD_EVERY", 2)
    monkeypatch.setattr(batch_module, "CHECK_REPEATS_ON_HOST", False)
    args = fault_overrides(
        data, tmp_path / "run", loss, **{"train.max_steps": 6, "train.log_every": 3, "checkpoint.every_steps": 3}
    )
    assert train(load_config(EMBEDDED, args))["step"] == 6
    assert reads == []
    assert len(train_records(tmp_path / "run")) == 2  # steps 3 and 6 were logged


def test_nonfinite_stop_suggests_resuming_only_when_a_checkpoint_exists(tmp_path):
    """With a saved checkpoint the stop names it and suggests --train.resume latest; without one, resuming "latest"
    would start over, so the message says no checkpoint was saved and to start the run again."""
    from fastclip.distributed import DistInfo
    from fastclip.train.errors import NonFiniteStepsError
    from fastclip.train.guards import NonFiniteGuard

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none", owns_group=False)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    guard = NonFiniteGuard(2, info, checkpoints=checkpoints)
    with pytest.raises(NonFiniteStepsError) as empty:
        guard._stop_error(2, "steps 1..2", "loss")
    assert "No checkpoint was saved" in str(empty.value) and "start the run again" in str(empty.value)
    assert "--train.resume" not in str(empty.value)
    (checkpoints / "step_00000004").mkdir()
    (checkpoints / "latest").write_text("step_00000004\n")
    with pytest.raises(NonFiniteStepsError) as saved:
        guard._stop_error(2, "steps 5..6", "loss")
    assert str(checkpoints / "step_00000004") in str(saved.value) and "--train.resume latest" in str(saved.value)
