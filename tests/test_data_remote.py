"""Remote shards (`pipe:CMD`, `http(s)://`): streamed, the manifest read beside them by the same transport, and
training from them equal to training from the local folder; a failing shard is named in one line."""

from __future__ import annotations

import functools
import http.server
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fastclip.data import DataSpecError, build_train_stream, resolve_catalog
from fastclip.data.catalog import expand_braces
from fastclip.data.remote import RemoteError, StreamFile, read_bytes, shard_basename, sibling
from fastclip.data.samples import DataExhausted
from fastclip.data.sources.synthetic import write_synthetic
from fastclip.data.stream import describe_skip
from fastclip.data.tario import ShardReader, TarBroken, iter_shard
from fastclip.train.cli import main as train_main

from helpers import fault_overrides, records

REPO = Path(__file__).resolve().parents[1]
SIZES = [7, 5, 9]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture(scope="module")
def http_root(tmp_path_factory):
    """(served folder, base URL): python's http.server on 127.0.0.1 in a thread."""
    root = tmp_path_factory.mktemp("served")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def synth(http_root) -> Path:
    folder = http_root[0] / "synth"
    write_synthetic(folder, SIZES)
    return folder


def names(folder: Path) -> list[str]:
    return [s["path"] for s in json.loads((folder / "manifest.json").read_text())["shards"]]


def pattern(prefix: str, folder_part: str, folder: Path) -> str:
    """A brace pattern naming the folder's shards in manifest order."""
    return f"{prefix}{folder_part}/{{{','.join(names(folder))}}}"


def test_locations():
    assert (
        sibling("pipe:aws s3 cp s3://b/cc3m/00001.tar -", "manifest.json")
        == "pipe:aws s3 cp s3://b/cc3m/manifest.json -"
    )
    assert sibling("pipe:cat '/x y/0.tar'", "manifest.json") == "pipe:cat '/x y/manifest.json'"
    assert sibling("https://h:8/a/b/00001.tar", "manifest.json") == "https://h:8/a/b/manifest.json"
    assert sibling("s3://b/c/0.tar.gz", "manifest.json") == "s3://b/c/manifest.json"
    assert shard_basename("pipe:aws s3 cp s3://b/cc3m/00001.tar -") == "00001.tar"
    with pytest.raises(RemoteError, match="no argument ends in .tar"):
        sibling("pipe:cat shards", "manifest.json")


def test_stream_file_reads_forward_and_seeks_back_within_its_window(tmp_path):
    blob = bytes(range(256)) * 2000  # 512,000 bytes
    (tmp_path / "b.tar").write_bytes(blob)
    f = StreamFile(f"pipe:cat {tmp_path}/b.tar")
    assert f.read(1000) == blob[:1000] and f.tell() == 1000
    f.seek(488)  # back 512 bytes: tarfile's re-read of a header block
    assert f.read(600) == blob[488:1088]
    f.seek(300_000)  # forward: read and discarded
    assert f.read(10) == blob[300_000:300_010]
    with pytest.raises(RemoteError, match="cannot seek back"):
        f.seek(0)
    assert f.read() == blob[300_010:] and f.read(5) == b""
    f.close()


def test_remote_shards_read_like_local_ones(synth, http_root):
    local = [[(r.key, r.files) for r in iter_shard(synth / n)] for n in names(synth)]
    for loc in (f"pipe:cat {synth}/{{n}}", f"{http_root[1]}/synth/{{n}}"):
        got = [[(r.key, r.files) for r in iter_shard(loc.format(n=n))] for n in names(synth)]
        assert got == local
    # a reader that starts mid-shard skips by reading (no seek on a stream)
    with ShardReader(f"{http_root[1]}/synth/{names(synth)[2]}") as reader:
        assert reader.skip_to(6) and reader.next_group().key == local[2][6][0]


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_batches_equal_local(synth, http_root, model_fns, workers):
    preprocess, tokenizer = model_fns

    def batches(spec):
        stream = build_train_stream(
            {"train": spec, "batch_size": 4, "workers": workers, "shuffle_buffer": 8, "seed": 3},
            rank=0,
            world_size=1,
            preprocess=preprocess,
            tokenizer=tokenizer,
        )
        out = [b for e in range(2) for b in stream.epoch(e)]
        assert stream.counters["unreadable_shard"] == 0 and stream.catalog.data_size == 21
        return out

    local = batches(str(synth))
    for spec in (
        pattern("pipe:cat ", str(synth), synth),
        pattern("", f"{http_root[1]}/synth", synth),
        f"{http_root[1]}/synth/manifest.json",
    ):
        remote = batches(spec)
        assert len(remote) == len(local) == 2 * 6
        for a, b in zip(local, remote):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_s3_urls_stream_through_the_aws_cli(synth, http_root, model_fns, tmp_path, monkeypatch):
    """s3://bucket/key is read as `aws s3 cp s3://bucket/key -` (what OpenCLIP users pipe by hand): here an `aws`
    on PATH that serves the bucket from a local folder and logs each call."""
    preprocess, tokenizer = model_fns
    bin_dir, calls = tmp_path / "bin", tmp_path / "aws-calls"
    bin_dir.mkdir()
    aws = bin_dir / "aws"
    aws.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        '[ "$1 $2 $4" = "s3 cp -" ] || exit 3\n'
        f'exec cat "{http_root[0]}/${{3#s3://bucket/}}"\n'
    )
    aws.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    def batches(spec):
        stream = build_train_stream(
            {"train": spec, "batch_size": 4, "workers": 0, "shuffle_buffer": 8, "seed": 3},
            rank=0,
            world_size=1,
            preprocess=preprocess,
            tokenizer=tokenizer,
        )
        return stream, [b for b in stream.epoch(0)]

    _, local = batches(str(synth))
    stream, remote = batches(pattern("s3://bucket/", "synth", synth))
    assert stream.catalog.data_size == 21 and stream.counters["unreadable_shard"] == 0
    assert len(remote) == len(local) == 6
    for a, b in zip(local, remote):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    logged = calls.read_text().splitlines()
    assert "s3 cp s3://bucket/synth/manifest.json -" in logged  # the manifest beside the shards, same transport
    assert any(line.startswith(f"s3 cp s3://bucket/synth/{names(synth)[0]} ") for line in logged)


def test_training_from_pipe_and_http_equals_local(tiny_embedded, http_root, tmp_path):
    """The tiny model, 4 steps from each source: the same losses, to the bit."""
    served = http_root[0] / "embedded"
    if not served.exists():
        served.symlink_to(tiny_embedded / "train", target_is_directory=True)
    train = tiny_embedded / "train"
    specs = {
        "local": str(train),
        "pipe": pattern("pipe:cat ", str(train), train),
        "http": pattern("", f"{http_root[1]}/embedded", train),
    }
    losses = {}
    for name, spec in specs.items():
        args = fault_overrides(
            tiny_embedded,
            tmp_path / name,
            "fastclip-v3",
            **{"data.train": spec, "train.max_steps": 4, "checkpoint.every_steps": 0},
        )
        assert train_main(["--config", str(REPO / "configs" / "embedded.yaml"), *args]) == 0
        losses[name] = [r["loss"] for r in records(tmp_path / name) if "loss" in r]
    assert len(losses["local"]) == 4 and np.isfinite(losses["local"]).all()
    assert losses["pipe"] == losses["local"] and losses["http"] == losses["local"]


def test_a_failing_remote_shard_is_named_in_one_line(synth, http_root, model_fns, tmp_path):
    # the command fails part way: the first 3000 bytes, then exit 4 with a message on stderr
    shard = synth / names(synth)[0]
    loc = f'pipe:sh -c \'head -c 3000 "$0"; echo "access denied for bucket" >&2; exit 4\' {shard}'
    with pytest.raises(TarBroken) as e:
        list(iter_shard(loc))
    assert "command exited with status 4: access denied for bucket" in str(e.value) and loc in str(e.value)
    assert "\n" not in str(e.value)
    # HTTP 404 of a shard: the stream skips its samples and says which URL and why
    missing = f"{http_root[1]}/synth/gone.tar"
    with pytest.raises(TarBroken, match=f"^{missing}: HTTP 404 "):
        ShardReader(missing)
    gone = tmp_path / "gone"
    write_synthetic(gone, [4, 4])
    (http_root[0] / "gone").mkdir(exist_ok=True)
    (http_root[0] / "gone" / "manifest.json").write_text((gone / "manifest.json").read_text())
    (http_root[0] / "gone" / names(gone)[0]).write_bytes((gone / names(gone)[0]).read_bytes())  # 2nd not served
    stream = build_train_stream(
        {"train": pattern("", f"{http_root[1]}/gone", gone), "batch_size": 2, "workers": 0, "shuffle_buffer": 4},
        rank=0,
        world_size=1,
        preprocess=model_fns[0],
        tokenizer=model_fns[1],
    )
    assert len(list(stream.epoch(0))) == 4
    assert stream.counters["unreadable_shard"] == 4
    event = next(e for e in stream.recent_skips if e["reason"] == "unreadable_shard")
    line = describe_skip(event)
    assert f"{http_root[1]}/gone/{names(gone)[1]}: HTTP 404" in line and "\n" not in line
    # a manifest that cannot be read stops before training, naming its URL
    with pytest.raises(
        DataSpecError, match=f"cannot read its manifest: {http_root[1]}/nowhere/manifest.json: HTTP 404"
    ):
        resolve_catalog(f"{http_root[1]}/nowhere/{{0,1}}.tar")
    assert json.loads(read_bytes(f"pipe:cat {synth}/manifest.json"))["num_samples"] == sum(SIZES)


def test_a_transient_failure_is_retried_with_backoff_then_the_shard_is_skipped(synth, tmp_path, monkeypatch):
    """A command that fails before its first byte (curl's exit 22 on an HTTP 503, a dropped connection) is retried
    after each of RETRY_DELAYS_S (issue 39: skipped at once); the last failure says how many retries it had."""
    from fastclip.data import remote

    slept = []
    monkeypatch.setattr(remote.time, "sleep", slept.append)
    monkeypatch.setattr(remote, "RETRY_DELAYS_S", (0.5, 1.5, 4.5))
    shard, tries = synth / names(synth)[0], tmp_path / "tries"
    flaky = (  # fails the first two times, then serves the shard
        f"pipe:sh -c 'n=$(cat {tries} 2>/dev/null || echo 0); echo $((n + 1)) > {tries}; "
        f'[ "$n" -ge 2 ] || {{ echo "503 Service Unavailable" >&2; exit 22; }}; cat {shard}\''
    )
    assert [raw.key for raw in iter_shard(flaky)] == [raw.key for raw in iter_shard(str(shard))]
    assert tries.read_text().strip() == "3" and slept == [0.5, 1.5]
    slept.clear()
    down = "pipe:sh -c 'echo \"503 Service Unavailable\" >&2; exit 22'"
    with pytest.raises(TarBroken) as e:
        list(iter_shard(down))
    assert "command exited with status 22: 503 Service Unavailable (after 3 retries)" in str(e.value)
    assert slept == [0.5, 1.5, 4.5]


def test_a_rank_whose_remote_shards_all_fail_says_why_and_what_to_do_in_one_line(http_root, model_fns, monkeypatch):
    """The manifest is there, the shards are not: the stop line carries each shard's location and the command's
    stderr tail or the HTTP status (no batch is made, so no skip event reaches the log), and advice that works for
    a remote source (`fastclip data scan` reads local folders only)."""
    from fastclip.data import remote

    monkeypatch.setattr(remote, "RETRY_DELAYS_S", (0.0, 0.0, 0.0))  # a command's failure is retried: not waited here
    folder = http_root[0] / "vanished"
    write_synthetic(folder, [4, 4])
    shards = names(folder)
    for name in shards:
        (folder / name).unlink()
    for spec, why in (
        (pattern("pipe:cat ", str(folder), folder), f"command exited with status 1: cat: {folder}/{{}}: No such file"),
        (pattern("", f"{http_root[1]}/vanished", folder), "HTTP 404 File not found"),
    ):
        stream = build_train_stream(
            {"train": spec, "batch_size": 2, "workers": 0},
            rank=0,
            world_size=1,
            preprocess=model_fns[0],
            tokenizer=model_fns[1],
        )
        with pytest.raises(DataExhausted) as info:
            next(iter(stream.epoch(0)))
        message = str(info.value)
        assert "\n" not in message and message.startswith("rank 0: no usable sample in its share of epoch 0")
        for name, location in zip(shards, expand_braces(spec)):
            assert f"{name} (unreadable_shard: 0 of 4 samples readable: {location}: {why.format(name)}" in message
        assert message.endswith(
            "Make each remote location readable (run its command or fetch its URL by hand to see why not) or remove "
            "it from the data spec, then restart with --train.resume latest"
        )
        assert "fastclip data scan" not in message


# ----------------------------------------------------------------------------- retries, counted
class _Flaky(_Quiet):
    """Answers HTTP 503 to a GET of a path in `failing` while its count lasts (-1: always), then serves the file."""

    failing: dict[str, int] = {}
    lock = threading.Lock()

    def do_GET(self):
        with self.lock:
            left = self.failing.get(self.path, 0)
            if left > 0:
                self.failing[self.path] = left - 1
        if left:
            self.send_error(503, "Service Unavailable")
            return
        super().do_GET()


@pytest.fixture
def flaky(http_root):
    """(base URL of http_root's folder, the {path: failures} the server answers 503 to first)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Flaky, directory=str(http_root[0])))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Flaky.failing.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Flaky.failing
    server.shutdown()
    server.server_close()


def test_retries_and_shards_given_up_are_counted_over_workers(synth, flaky, model_fns):
    url, failing = flaky
    shards = names(synth)

    def epoch(workers: int, delays: list[float]):
        stream = build_train_stream(
            {"train": pattern("", f"{url}/synth", synth), "batch_size": 4, "workers": workers, "shuffle_buffer": 8}
            | {"remote_retry_delays": delays},  # the config's knob: no waiting here
            rank=0,
            world_size=1,
            preprocess=model_fns[0],
            tokenizer=model_fns[1],
        )
        assert len(list(stream.epoch(0))) == 6
        return stream.counters

    # a shard that fails 3 times, then is served: 3 retries, whichever of the 2 worker processes made them
    failing[f"/synth/{shards[1]}"] = 3
    counters = epoch(2, [0.0, 0.0, 0.0])
    assert failing[f"/synth/{shards[1]}"] == 0
    assert (counters["remote_retries"], counters["remote_shards_skipped"], counters["unreadable_shard"]) == (3, 0, 0)
    # one that always fails: as many retries as delays configured, then the shard is skipped (its 7 samples)
    failing[f"/synth/{shards[0]}"] = -1
    counters = epoch(0, [0.0, 0.0])
    assert (counters["remote_retries"], counters["remote_shards_skipped"], counters["unreadable_shard"]) == (2, 1, 7)
    assert sum(counters.values()) == 2 + 1 + 7 + counters["wrapped"]  # nothing else counted


def test_a_run_reports_its_remote_retries_in_its_records_and_epoch_line(
    tiny_embedded, http_root, flaky, tmp_path, capsys
):
    url, failing = flaky
    served = http_root[0] / "embedded"
    if not served.exists():
        served.symlink_to(tiny_embedded / "train", target_is_directory=True)
    train = tiny_embedded / "train"
    failing[f"/embedded/{names(train)[0]}"] = 2
    run = tmp_path / "run"
    args = fault_overrides(
        tiny_embedded,
        run,
        "fastclip-v3",
        **{
            "data.train": pattern("", f"{url}/embedded", train),
            "data.batch_size": 16,  # 80 samples: one epoch in 5 steps
            "train.max_steps": 5,
            "checkpoint.every_steps": 0,
            "data.remote_retry_delays": "[0, 0, 0]",
        },
    )
    assert train_main(["--config", str(REPO / "configs" / "embedded.yaml"), *args]) == 0
    last = [r for r in records(run) if "data_skipped" in r][-1]
    assert (last["data_remote_retries"], last["data_remote_shards_skipped"], last["data_skipped"]) == (2, 0, 0)
    assert (
        "data: epoch 0: 0 sample(s) skipped, summed over ranks; 0 served twice to fill the batches; remote shards: "
        "2 retries, 0 skipped as unreadable"
    ) in capsys.readouterr().out.splitlines()
