"""Helpers shared by the tests: tiny embedded data, the shrunk recipe as command-line overrides, run records and
checkpoints, bitwise comparison, whole jobs as real process groups, data streams, and loss gradients."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]
EMBEDDED = REPO / "configs" / "embedded.yaml"
BATCH = 8  # per process; 80 training samples: 5 steps per epoch at 2 processes, 10 at 1
# each loss with the options that make it differ from its neighbours on a small batch (v2/v3: ρ within reach)
LOSS_OPTIONS = {
    "openclip": {},
    "fastclip-v0": {},
    "fastclip-v1": {},
    "fastclip-v2": {"rho": 3.0},
    "fastclip-v3": {"rho": 3.0},
    "siglip": {},
    "dcl": {},
}


def make_embedded(out: Path) -> Path:
    from fastclip.data.cli import main as data_main

    assert (
        data_main(
            [
                "embedded",
                "--out",
                str(out),
                "--max-per-class",
                "4",
                "--max-val-per-class",
                "1",
                "--shard-size",
                "30",
                "--seed",
                "0",
            ]
        )
        == 0
    )
    return out


def removed_unless_failed(request, root: Path, value=None):
    """Yield `value` (default: `root`); once the fixture's tests are done, delete `root` unless one failed.

    For fixtures whose runs keep many checkpoints (1-5 GB): left to pytest, they would stay on disk to the end of
    the session, and after it. A failure keeps them for a look."""
    failed_before = request.session.testsfailed
    yield root if value is None else value
    if request.session.testsfailed == failed_before:
        shutil.rmtree(root, ignore_errors=True)


_UNSET = object()  # an override value that leaves the key to the config file


def overrides(data: Path, run_dir: Path, mode: str = "fastclip-v3", **extra) -> list[str]:
    """The embedded recipe, shrunk: tiny data, a few steps, frequent logs and checkpoints, no evaluation."""
    opts = {
        "data.train": data / "train",
        "data.val": data / "val",
        "data.zeroshot": data / "zeroshot.json",
        "data.batch_size": BATCH,
        "data.workers": 0,
        "optim.lr": 1e-3,  # pinned: tests check the lr schedule against it, whatever the config's default
        "train.run_dir": run_dir,
        "train.epochs": 3,
        "train.log_every": 1,
        "train.progress": False,
        "train.tensorboard": False,
        "optim.warmup_steps": 2,
        "loss.name": mode,
        "loss.gamma_decay_epochs": 2,
        "loss.gamma_min": 0.2,  # pinned as the lr: gamma's schedule is checked against it
        "checkpoint.every_steps": 2,
        "checkpoint.every_minutes": 0,
        "checkpoint.keep_last": 10,
        "checkpoint.fsync": False,  # what these tests check is the rename protocol, not durability on power loss
        "eval.every_steps": 0,
        "eval.at_end": False,
    }
    if mode != "fastclip-v3":  # the recipe's v3 knobs: keep those the mode takes
        opts["loss.rho"] = "null" if mode not in ("fastclip-v2", "fastclip-tempnet") else 7.0
        if mode in ("openclip", "dcl"):
            opts.update({"loss.gamma_min": "null", "loss.gamma_decay_epochs": "null", "loss.gamma_schedule": "null"})
        if mode == "fastclip-v2":
            opts.update({"loss.temperature": 0.03, "optim.lr_tau": 0.0133, "optim.lr_tau_schedule": "const"})
        if mode == "fastclip-tempnet":
            opts.update(
                {
                    "loss.temperature": 0.03,
                    "loss.tempnet_hidden": 16,
                    "optim.lr_tau": 1e-3,
                    "optim.lr_tau_schedule": "const",
                }
            )
    opts.update(extra)
    return [x for k, v in opts.items() if v is not _UNSET for x in (f"--{k}", str(v))]


def fault_overrides(data: Path, run_dir: Path, mode: str = "fastclip-v2", **extra) -> list[str]:
    """`overrides` for the fault and operator tests: v2 by default, no held-out data, 20 checkpoints kept."""
    return overrides(
        data, run_dir, mode, **{"data.val": "null", "data.zeroshot": "null", "checkpoint.keep_last": 20, **extra}
    )


def records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "loss" in r]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def latest(run_dir: Path) -> str:
    return (Path(run_dir) / "checkpoints" / "latest").read_text().strip()


def assert_same(a, b, where: str = "") -> None:
    """Bitwise equality of nested checkpoint contents."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_training_state(a: Path, b: Path, world_size: int, *, rank_keys=("loss_state", "data", "rng")) -> None:
    """Two step folders hold the same parameters, optimizer, scaler, position and per-sample state, bitwise."""
    ma, mb = load(a / "model.pt"), load(b / "model.pt")
    for key in ("state_dict", "loss", "optimizer", "scaler", "step", "epoch", "samples_seen"):
        assert_same(ma[key], mb[key], key)
    for r in range(world_size):
        ra, rb = load(a / f"rank_{r}.pt"), load(b / f"rank_{r}.pt")
        for key in rank_keys:
            assert_same(ra[key], rb[key], f"rank {r} {key}")


# ----------------------------------------------------------------------------- whole jobs
def clean_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC", "FASTCLIP_FAULTS")
        )
    }
    # the launch scripts call `python`: the interpreter running the tests, as in an activated venv (CI runs
    # .venv/bin/python -m pytest without activating it)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


# read once when an interpreter starts: a job whose environment differs in these is not forked from the zygote
STARTUP_ENV = ("PYTHON", "OMP_", "MKL_", "LD_", "MALLOC_")


def _startup_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_ENV)}


class _Zygote:
    """The client of tests/zygote.py: one server per test process, started at its first job (see zygote.py)."""

    _instance: _Zygote | None = None

    @classmethod
    def get(cls) -> _Zygote:
        if cls._instance is None or cls._instance.dead:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        import atexit
        import tempfile
        import threading

        request_r, self.requests = os.pipe()
        reply_r, reply_w = os.pipe()
        log = tempfile.NamedTemporaryFile(prefix="fastclip-zygote-", suffix=".log", delete=False)
        self.log = Path(log.name)
        atexit.register(self.log.unlink, missing_ok=True)
        self.env = clean_env()
        self.server = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("zygote.py")), str(request_r), str(reply_w)],
            pass_fds=(request_r, reply_w),
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        os.close(request_r)
        os.close(reply_w)
        self.replies = os.fdopen(reply_r, "rb")
        self.jobs: dict[int, list[int]] = {}  # request id -> its ranks' pids
        self.exited: dict[int, int] = {}
        self.dead = False  # the server is gone (its reply pipe closed): nothing more will be reported
        self.changed = threading.Condition()
        self.lock = threading.Lock()
        self.next_id = 0
        threading.Thread(target=self._read_replies, daemon=True).start()

    def _read_replies(self) -> None:
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # the process's signals: never this thread's
        try:
            for line in self.replies:
                reply = json.loads(line)
                with self.changed:
                    if "pids" in reply:
                        for pid in reply["pids"]:
                            self.exited.pop(pid, None)  # a pid used again
                        self.jobs[reply["id"]] = reply["pids"]
                    else:
                        self.exited[reply["exited"]] = reply["code"]
                    self.changed.notify_all()
        finally:
            with self.changed:
                self.dead = True
                self.changed.notify_all()

    def fits(self, env: dict) -> bool:
        return _startup_env(env) == _startup_env(self.env)

    def start(self, ranks: list[dict], cwd: Path) -> list[ForkedProcess]:
        """Fork a job's ranks ({"argv", "env", "log"} each) in one group; the first job waits for the imports."""
        with self.lock:
            self.next_id += 1
            job = self.next_id
            self._send({"id": job, "cwd": str(cwd), "ranks": ranks})
            with self.changed:
                if not self.changed.wait_for(lambda: job in self.jobs or self.dead, timeout=180):
                    self.server.kill()  # its late reply would belong to no one: a new server for the next job
                    self.dead = True
                if job not in self.jobs:
                    raise AssertionError(f"the zygote did not start the job: {self.log.read_text()[-3000:]}")
                pids = self.jobs.pop(job)
        return [ForkedProcess(self, pid) for pid in pids]

    def _send(self, request: dict) -> None:
        os.write(self.requests, (json.dumps(request) + "\n").encode())

    def kill(self, pid: int, sig: int) -> None:
        if not self.dead:
            self._send({"kill": pid, "signal": int(sig)})


class ForkedProcess:
    """What Job uses of subprocess.Popen, for a process forked by the zygote (whose exit the zygote reports)."""

    def __init__(self, zygote: _Zygote, pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exited.get(self.pid)
            if self.returncode is None and self.zygote.dead and not Path(f"/proc/{self.pid}").exists():
                self.returncode = -255  # gone with no one left to report how: not a status any test expects
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.zygote.changed:
            while self.poll() is None:
                left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
                if left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
                self.zygote.changed.wait(left)
        return self.returncode

    def kill(self) -> None:
        import signal

        if self.poll() is None:
            self.zygote.kill(self.pid, signal.SIGKILL)


class Job:
    """`fastclip train` as N processes with torchrun's variables, all in one new process group (as a cluster
    job is: killing the group kills every rank and its data workers). Output goes to files (no pipe stalls).

    Each rank is a `python -m fastclip train` of its own, forked from tests/zygote.py, which has done the imports once
    (2.6x faster test_preemption), unless the job's environment differs from its in what an interpreter reads at
    start-up. FASTCLIP_TEST_ZYGOTE=0 starts every rank as `python -m fastclip` instead."""

    def __init__(self, args: list[str], nprocs: int, log_dir: Path, *, env: dict | None = None, rank_env=None):
        """rank_env(rank, port) -> a rank's launcher variables (default: torchrun's RANK, WORLD_SIZE, ...)."""
        self.log_dir = Path(log_dir).resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.started = time.monotonic()
        argv = ["train", "--config", str(EMBEDDED), *args]
        ranks = []
        for rank in range(nprocs):
            rank_vars = clean_env(**(env or {}))
            if rank_env is not None:
                rank_vars.update(rank_env(rank, port))
            elif nprocs > 1:
                rank_vars.update(
                    RANK=str(rank),
                    WORLD_SIZE=str(nprocs),
                    LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            log = self.log_dir / f"rank_{rank}.log"
            log.write_text("")  # there from the start, as with Popen: a test may read it at once
            ranks.append({"argv": argv, "env": rank_vars, "log": str(log)})
        zygote = _Zygote.get() if os.environ.get("FASTCLIP_TEST_ZYGOTE", "1") == "1" else None
        if zygote is not None and all(zygote.fits(r["env"]) for r in ranks):
            self.procs: list[subprocess.Popen | ForkedProcess] = zygote.start(ranks, self.log_dir)
            return
        self.procs = []
        for r in ranks:
            group = self.procs[0].pid if self.procs else 0  # rank 0 leads a new group; the others join it
            with open(r["log"], "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "fastclip", *r["argv"]],
                        cwd=self.log_dir,
                        env=r["env"],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        process_group=group,
                    )
                )

    @property
    def pgid(self) -> int:
        return self.procs[0].pid

    def output(self, rank: int) -> str:
        return (self.log_dir / f"rank_{rank}.log").read_text()

    def outputs(self) -> str:
        return "\n".join(f"--- rank {r}:\n{self.output(r)[-4000:]}" for r in range(len(self.procs)))

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"job did not finish within {timeout:.0f}s\n{self.outputs()}") from None
        return [p.returncode for p in self.procs]

    def kill(self) -> None:
        import signal

        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=60)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def wait_for(predicate, timeout: float, what: str, job: Job | None = None, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job is not None and all(p.poll() is not None for p in job.procs):
            break
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{job.outputs()}" if job else ""))


def feed_fifo(fifo: Path, text: str, procs, timeout: float = 60) -> None:
    """Write `text` to the FIFO `fifo` once a reader has opened it. A plain open() waits for that reader for ever:
    if the command that should read it died first, the test hung until CI's limit. Fails instead, naming it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no reader has it open
            break
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        if all(p.poll() is not None for p in procs):
            raise AssertionError(f"{fifo}: its reader ended (status {[p.returncode for p in procs]}) before opening it")
        if time.monotonic() > deadline:
            raise AssertionError(f"{fifo}: no reader opened it in {timeout:.0f} s")
        time.sleep(0.02)
    os.set_blocking(fd, True)
    with os.fdopen(fd, "w") as f:
        f.write(text)


# ----------------------------------------------------------------------------- data streams
def make_stream(model_fns, path, rank: int = 0, world_size: int = 1, **kw):
    """A training stream over `path` with the tiny model's preprocess and tokenizer (fixture `model_fns`)."""
    from fastclip.data import build_train_stream

    cfg = {"train": str(path), "batch_size": 8, "workers": 0} | kw
    return build_train_stream(cfg, rank=rank, world_size=world_size, preprocess=model_fns[0], tokenizer=model_fns[1])


def one_line_error(capsys, fn, argv, *words, code=2, stdout_empty=False) -> str:
    """fn(argv) (a command's main) ends with `code` and one stderr line holding every word; argparse's exit counts
    too. stdout_empty: nothing was printed to stdout either. Returns the line."""
    try:
        status = fn(argv)
    except SystemExit as e:
        status = e.code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert status == code, (status, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not stdout_empty or captured.out == "", captured.out
    for w in words:
        assert w in err, (w, err)
    return err


def the_error_line(err: str, notes: str = "fastclip train: note:") -> str:
    """The one line of a stderr text besides the notes (lines starting with ``notes``); no traceback."""
    lines = [x for x in err.strip().splitlines() if not x.startswith(notes)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def truncate_file(path, keep_bytes: int) -> None:
    Path(path).write_bytes(Path(path).read_bytes()[:keep_bytes])


# ----------------------------------------------------------------------------- loss gradients
def features(n, d, seed, *, clamped_pair=None):
    """Paired unit features (float64, requiring grad); ``clamped_pair=(i, k)``: text k := image i, a negative
    pair with cosine 1."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    e1 = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1)
    e2 = F.normalize(e1 + 0.7 * torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1)
    if clamped_pair is not None:
        i, k = clamped_pair
        e2[k] = e1[i]
    return e1.requires_grad_(), e2.requires_grad_()


def grads(value, *tensors):
    return torch.autograd.grad(value, tensors)


def run_loss(loss_fn, e1, e2, idx, epoch=0):
    """(value, image grad, text grad, {parameter name: grad}) of one call, with fresh gradients."""
    e1 = e1.detach().clone().requires_grad_()
    e2 = e2.detach().clone().requires_grad_()
    for p in loss_fn.parameters():
        p.grad = None
    loss = loss_fn(e1, e2, idx, epoch=epoch)
    loss.backward()
    return loss.detach(), e1.grad, e2.grad, {n: p.grad for n, p in loss_fn.named_parameters() if p.requires_grad}


def full_disk_after(calls: int, real):
    """`real`, failing as a full disk does from its (calls + 1)-th call on."""
    count = [0]

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    return wrapped


def randomize_tempnet_heads(loss_fn, seed: int = 5) -> None:
    """Non-constant temperature heads (the output layer starts at zero), the same wherever the seed is."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (p for head in (loss_fn.tempnet_img, loss_fn.tempnet_txt) if head for p in head.parameters()):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def assert_value_and_grads(got, want, wrt, retain_graph: bool = False, **tol) -> None:
    """``got`` equals ``want`` and so do their gradients with respect to the tensors ``wrt``."""
    got_grads = torch.autograd.grad(got, wrt, retain_graph=retain_graph)
    want_grads = torch.autograd.grad(want, wrt, retain_graph=retain_graph)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **tol)


def image_only_shards(folder, n: int = 24):
    """A plain WebDataset of .png files only (no caption, no label: the index is the position), scanned."""
    import io
    import tarfile

    from PIL import Image

    from fastclip.data.cli import main as data_main

    folder.mkdir()
    with tarfile.open(folder / "images-000000.tar", "w") as tar:
        for i in range(n):
            buffer = io.BytesIO()
            Image.new("RGB", (20, 20), (10 * i, 255 - 10 * i, 3 * i)).save(buffer, format="PNG")
            info = tarfile.TarInfo(f"{i:06d}.png")
            info.size = buffer.tell()
            buffer.seek(0)
            tar.addfile(info, buffer)
    assert data_main(["scan", str(folder), "--images-only"]) == 0
    return folder
