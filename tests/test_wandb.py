"""Weights & Biases logging (train.wandb, OpenCLIP's --report-to wandb), offline: no network needed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from fastclip.train.cli import main

from helpers import EMBEDDED, fault_overrides, train_records

wandb = pytest.importorskip("wandb")


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log: 32 KiB blocks of records with
    a 7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST), after its 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    raw, block, pos, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending + data))
            pending = b""
        elif kind in (2, 3):
            pending += data
    return records


def history(run_dir: Path, run_id: str) -> dict[int, dict]:
    """{step: {key: value}} of every offline W&B run with this id in the run folder (a resumed job adds one)."""
    out: dict[int, dict] = {}
    for path in sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        for rec in wandb_records(path):
            if rec.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item
                }
                out.setdefault(int(rec.history.step.num), {}).update(items)
    return out


def test_offline_wandb_run_holds_the_logged_metrics_and_a_resume_continues_it(tiny_embedded, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    args = fault_overrides(
        tiny_embedded, run, "fastclip-v3", **{"train.max_steps": 4, "train.log_every": 2, "checkpoint.every_steps": 2}
    )
    assert main(["--config", str(EMBEDDED), *args, "--report-to", "wandb", "--wandb-project-name", "t"]) == 0
    run_id = (run / "wandb_id").read_text().strip()
    logged = history(run, run_id)
    records = {r["step"]: r for r in train_records(run)}
    assert sorted(logged) == sorted(records) == [2, 4]
    for step, record in records.items():
        assert logged[step]["train/loss"] == pytest.approx(record["loss"], rel=1e-6)
        assert logged[step]["train/tau"] == pytest.approx(record["tau"], rel=1e-6)
        assert logged[step]["train/samples_seen"] == record["samples_seen"]
    [first] = (run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    [header] = [r.run for r in wandb_records(first) if r.WhichOneof("record_type") == "run"]
    assert header.project == "t" and header.run_id == run_id
    config = {item.key: json.loads(item.value_json) for item in header.config.update}
    assert config["loss"]["name"] == "fastclip-v3"  # the resolved run config travels with the run

    # a resumed job logs into the same W&B run (its id is kept in the run folder), from where it stopped
    resumed = [*args[: args.index("--train.max_steps")], "--train.max_steps", "6", "--train.resume", "latest"]
    resumed += args[args.index("--train.max_steps") + 2 :]
    assert main(["--config", str(EMBEDDED), *resumed, "--report-to", "wandb"]) == 0
    assert (run / "wandb_id").read_text().strip() == run_id
    logged = history(run, run_id)
    assert sorted(logged) == [2, 4, 6]
    assert logged[6]["train/loss"] == pytest.approx(train_records(run)[-1]["loss"], rel=1e-6)


def test_wandb_without_the_package_is_one_line_and_exit_2(tiny_embedded, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import raises ImportError
    args = fault_overrides(tiny_embedded, tmp_path / "run", "fastclip-v3", **{"train.max_steps": 1})
    assert main(["--config", str(EMBEDDED), *args, "--train.wandb", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "fastclip train: config error: config key 'train.wandb': the wandb package is not installed; "
        "pip install 'fastclip[wandb]' (or drop wandb from --report-to / set --train.wandb false)"
    ]
