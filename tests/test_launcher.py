"""Signals as a cluster sends them to a job started by launch/single_node.sh (torchrun through
fastclip.train.launcher, 2 ranks, one data worker each): SIGTERM to every process, a signal to the agent alone or
to one rank, the agent or one rank killed outright. Each ends in a checkpoint at the step and status 75, or in one
line per process that has something to say; never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fastclip.train.launcher import children, exit_status
from fastclip.train.preemption import EXIT_PREEMPTED

from helpers import EMBEDDED, clean_env, fault_overrides, feed_fifo, latest, train_records, wait_for

REPO = Path(__file__).resolve().parents[1]


class LaunchedJob:
    """launch/single_node.sh CONFIG 2 as its own session (as a batch job is); output to a file."""

    def __init__(self, data: Path, tmp_path: Path, **extra):
        self.run = tmp_path / "run"
        args = fault_overrides(
            data,
            self.run,
            **{"data.workers": 1, "checkpoint.every_steps": 0, "train.epochs": 100, "train.max_steps": 400, **extra},
        )
        self.log = tmp_path / "job.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                ["bash", str(REPO / "launch" / "single_node.sh"), str(EMBEDDED), "2", *args],
                cwd=tmp_path,
                env=clean_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def at_step(self, step: int) -> list[int]:
        """Wait until training passed `step`; the ranks' pids (the launcher's children), by rank."""
        wait_for(lambda: self.proc.poll() is not None or len(train_records(self.run)) >= step, 300, f"step {step}")
        assert self.proc.poll() is None, self.output()
        return sorted(children(self.proc.pid))  # started in rank order

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end within {timeout:.0f}s\n{self.output()}") from None

    def kill(self) -> None:
        for pid in [self.proc.pid, *children(self.proc.pid)]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def output(self) -> str:
        return self.log.read_text()

    def stopped_with_a_checkpoint(self, by: str) -> None:
        step = max(r["step"] for r in train_records(self.run))
        assert latest(self.run) == f"step_{step:08d}", self.output()
        assert f"stopped at step {step} by {by}: checkpoint saved; exit status 75" in self.output()
        assert "Traceback" not in self.output()


def test_the_configs_notes_are_said_once_by_the_launch_script(data, tmp_path):
    """single_node.sh runs `train --check` and then the run: a note on the command line's config (an OpenCLIP
    no-op flag here; your own data.train, ...) was printed by both."""
    args = fault_overrides(data, tmp_path / "run", **{"data.workers": 0, "train.max_steps": 2})
    done = subprocess.run(
        ["bash", str(REPO / "launch" / "single_node.sh"), str(EMBEDDED), "1", *args, "--local-loss"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = "fastclip train: note: --local-loss is accepted and changes nothing"
    assert (done.stdout + done.stderr).count(said) == 1, done.stderr[-3000:]


def test_sigterm_to_every_process_of_the_job(data, tmp_path):
    """SLURM's preemption, time limit and scancel: SIGTERM to the agent, the ranks and their data workers. The
    workers leave it to their rank, the agent forwards it: a checkpoint at the step, status 75, and nothing printed
    but the run's lines. (Before: the workers died first, every rank crashed, torchrun exited 1 after 160 lines.)"""
    job = LaunchedJob(data, tmp_path)
    try:
        ranks = job.at_step(2)
        for group in (job.proc.pid, *ranks):  # each rank leads its own process group, with its worker
            os.killpg(group, signal.SIGTERM)
        assert job.wait() == EXIT_PREEMPTED, job.output()
    finally:
        job.kill()
    job.stopped_with_a_checkpoint("SIGTERM")
    assert len(job.output().splitlines()) <= 5, job.output()  # the start line, an epoch's data line, checkpoint, stop


@pytest.mark.parametrize("target", ["agent", "rank"])
def test_a_signal_to_the_agent_alone_or_to_one_rank(data, tmp_path, target):
    """SIGUSR1 to torchrun's agent alone (`scancel --signal USR1 --batch`, a `kill`) reaches the ranks; SIGTERM to
    one rank stops both at one step. Either way the job's status is the ranks' 75, without torchrun's traceback.
    (Before: the agent died of SIGUSR1 and its orphaned ranks trained on; a stop of one rank was status 1.)"""
    job = LaunchedJob(data, tmp_path)
    try:
        ranks = job.at_step(2)
        if target == "agent":
            os.kill(job.proc.pid, signal.SIGUSR1)
        else:
            os.kill(ranks[1], signal.SIGTERM)
        assert job.wait() == EXIT_PREEMPTED, job.output()
    finally:
        job.kill()
    job.stopped_with_a_checkpoint("SIGUSR1" if target == "agent" else "a signal to another rank")


def test_the_launcher_reads_the_ranks_stop_signals_from_their_command_line(tmp_path):
    """What it forwards beyond SIGTERM, SIGUSR1 and SIGINT: SIGHUP and SIGUSR2 only where the ranks stop on them
    (forwarded to ranks that do not, they died at once without a checkpoint: SIGUSR2 ending the agent leaves them
    to stop with one) (the session's review)."""
    from torch.distributed.run import parse_args

    from fastclip.train.launcher import ranks_stop_signals

    def stops(*train_args: str) -> set[int]:
        args = parse_args(["--standalone", "--nproc_per_node", "2", "-m", "fastclip", "train", "--", *train_args])
        return ranks_stop_signals(args)

    config = ["--config", str(EMBEDDED), "--train.run_dir", str(tmp_path / "run")]
    assert stops(*config) == {signal.SIGUSR1, signal.SIGTERM}
    assert stops(*config, "--train.stop_signals", "[SIGTERM, SIGUSR2]") == {signal.SIGTERM, signal.SIGUSR2}
    assert stops(*config, "--train.bogus", "1") == {signal.SIGUSR1, signal.SIGTERM}  # (the ranks say why)
    other = parse_args(["--standalone", "--nproc_per_node", "2", "script.py", "--train.stop_signals", "[SIGHUP]"])
    assert ranks_stop_signals(other) == {signal.SIGUSR1, signal.SIGTERM}


def test_signals_while_the_launcher_reads_the_ranks_command_line(tmp_path):
    """A SIGTERM while the launcher reads the ranks' config was raised inside that read and taken for a config it
    could not read: lost, and the ranks started. Under nohup a SIGHUP the run does not name stays ignored until
    torchrun starts the ranks (the launcher made it fatal). (Third reading of the session's change.)"""
    from helpers import catches

    base = ["--standalone", "--nproc_per_node", "1", "-m", "fastclip", "train", "--", "--config", str(EMBEDDED)]
    base += ["--data.train", str(tmp_path / "none"), "--train.run_dir", str(tmp_path / "run")]
    code = (
        "import os, signal, sys; import fastclip.train.cli as cli; from fastclip.train import launcher; "
        "real = cli.read_config; "
        "cli.read_config = lambda argv: (os.kill(os.getpid(), signal.SIGTERM), real(argv))[1]; "
        "sys.exit(launcher.main(sys.argv[1:]))"
    )
    done = subprocess.run([sys.executable, "-c", code, *base], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == EXIT_PREEMPTED, done.stderr
    assert done.stderr.strip() == (
        "fastclip launcher: stopped by SIGTERM before the ranks started; exit status 75, continue with "
        "--train.resume latest"
    )
    proc = subprocess.Popen([sys.executable, "-m", "fastclip.train.launcher", *base], cwd=tmp_path, env=clean_env(),
                            stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP,
                            signal.SIG_IGN))  # fmt: skip
    wait_for(lambda: proc.poll() is not None or catches(proc.pid, signal.SIGTERM), 60, "the launcher's first handler")
    proc.send_signal(signal.SIGHUP)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 2 and "data.train" in err and "SIGHUP" not in err, err  # the ranks' config error


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR2])
def test_a_stop_signal_the_run_names_reaches_the_ranks_through_the_agent(data, tmp_path, sig):
    """--train.stop_signals with SIGHUP (the README's recipe for an ssh session that drops) or SIGUSR2: the agent
    alone gets it. Before, torchrun stopped the ranks with SIGHUP itself, and the job said 75 from the ranks and
    then exited 129; SIGUSR2 killed the agent (140) (helper-61)."""
    name = signal.Signals(sig).name
    job = LaunchedJob(data, tmp_path, **{"train.stop_signals": f"[SIGTERM, {name}]"})
    try:
        job.at_step(2)
        os.kill(job.proc.pid, sig)
        assert job.wait() == EXIT_PREEMPTED, job.output()
    finally:
        job.kill()
    job.stopped_with_a_checkpoint(name)
    assert "fastclip launcher" not in job.output()


def test_ranks_whose_agent_is_killed_stop_with_a_checkpoint(data, tmp_path):
    """kill -9 of the agent forwards nothing: each rank sees its parent gone and the job stops within seconds with a
    checkpoint, saying why. (Before: the orphaned ranks trained on to the end.)"""
    job = LaunchedJob(data, tmp_path)
    try:
        ranks = job.at_step(2)
        job.proc.kill()
        job.proc.wait()
        killed_at = time.monotonic()
        for pid in ranks:
            wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists(), 120, f"rank pid {pid} to end")
        took = time.monotonic() - killed_at
    finally:
        job.kill()
    job.stopped_with_a_checkpoint(f"the loss of its torchrun agent (pid {job.proc.pid} is gone)")
    assert took < 60, f"the ranks took {took:.0f}s to stop"


def test_one_rank_killed_outright_is_one_line_from_the_survivor_and_one_from_the_launcher(data, tmp_path):
    """kill -9 of rank 1 (the OOM killer): rank 0's collective fails, which it says in one line; the launcher names
    the killed rank. (Before: rank 0's data worker died of torchrun's SIGTERM: 87 lines.)"""
    job = LaunchedJob(data, tmp_path)
    try:
        ranks = job.at_step(2)
        os.kill(ranks[1], signal.SIGKILL)
        status = job.wait()
    finally:
        job.kill()
    lines = job.output().splitlines()
    assert status == 128 + signal.SIGKILL, job.output()
    assert "Traceback" not in job.output()
    said = [line for line in lines if "error" in line or "launcher" in line]
    assert len(said) == 2, job.output()
    assert said[0].startswith("fastclip train: error: rank 0 of 2: a collective failed"), job.output()
    assert said[1] == (
        f"fastclip launcher: rank 1 (pid {ranks[1]}) was killed by SIGKILL (out of memory, or kill -9); the other "
        f"ranks were stopped. Continue with --train.resume latest"
    )


@pytest.mark.parametrize(
    "codes, status",
    [
        ({0: 75, 1: 75}, 75),  # both stopped with a checkpoint
        ({1: 75}, 75),  # rank 1 ended first: torchrun stopped rank 0, which was leaving with 75 too
        ({0: 75, 1: 1}, 1),  # an error is not a stop to requeue
        ({0: 2}, 2),
        ({0: 1, 1: -9}, 137),  # a rank killed outright: 128 + the signal
        ({0: 2, 1: -15}, 2),  # rank 0 refused its config; torchrun then SIGTERMed rank 1: not a stop to resume
        ({0: 75, 1: -15}, 75),  # rank 0 stopped with the job's checkpoint, torchrun SIGTERMed rank 1 on its way out
        ({0: -15}, 143),  # a rank SIGTERMed on its own (before its handler): said, as a kill
        ({0: -15, 1: -9}, 137),  # rank 1 killed outright, then torchrun SIGTERMed rank 0: rank 1's is said
        # rank 0 ended (a collective timed out) and rank 1, stuck, was SIGKILLed by torchrun 30 s later: said as a
        # kill by the operator or the OOM killer before, status 137 (helper-61); now rank 0's status
        ({0: 1, 1: (-9, 31)}, 1),
        ({0: 75, 1: (-9, 31)}, 75),
    ],
)
def test_the_jobs_status_from_the_ranks(codes, status):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {}
    for rank, code in codes.items():
        code, later = code if isinstance(code, tuple) else (code, 0)
        failures[rank] = ProcessFailure(rank, 1000 + rank, code, "/nonexistent")
        failures[rank].timestamp += later  # seconds after the others' failures were recorded
    got, line = exit_status(failures)
    assert got == status
    stuck = any(isinstance(code, tuple) for code in codes.values())
    assert (line is not None) == (status > 128 or stuck)
    if status == 137:
        assert line.startswith("fastclip launcher: rank 1 (pid 1001) was killed by SIGKILL (out of memory, or kill")
    if stuck:
        assert line == (
            f"fastclip launcher: rank 1 (pid 1001) did not stop when rank 0 ended with status {status} and was "
            f"killed by torchrun (SIGKILL, 30 s after its SIGTERM: stuck, in a collective perhaps); status "
            f"{status}. Continue with --train.resume latest"
        )


def test_the_container_entrypoint_runs_fastclip_commands_and_others_as_given(tmp_path):
    """launch/docker-entrypoint.sh: `docker run IMAGE train ...` is `fastclip train ...`; torchrun or any command
    on PATH runs as given; no arguments: fastclip's help."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("fastclip", "torchrun"):
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*"\n')
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}

    def entry(*args: str) -> str:
        out = subprocess.run(
            ["bash", str(REPO / "launch" / "docker-entrypoint.sh"), *args], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert entry("train", "--config", "c.yaml") == "fastclip train --config c.yaml"
    assert entry("torchrun", "--nproc_per_node", "8", "-m", "fastclip") == "torchrun --nproc_per_node 8 -m fastclip"
    assert entry() == "fastclip --help"
    text = (REPO / "Dockerfile").read_text()
    assert "USER fastclip" in text and 'ENTRYPOINT ["/opt/fastclip/launch/docker-entrypoint.sh"]' in text
    assert "ENV PIP_CONSTRAINT=/opt/torch-constraint.txt" in text  # torch stays the image's through pip install


@pytest.mark.parametrize(
    "start",
    ["runpy.run_module('fastclip', run_name='__main__')", "from fastclip.cli import entry; entry()"],
    ids=["python -m fastclip", "the fastclip command"],
)
def test_a_stop_signal_in_a_finished_runs_last_moment_leaves_status_0(data, tmp_path, start):
    """`fastclip train` (as `python -m fastclip` and as the console script `fastclip`, pyproject's entry point) whose
    run is complete and saved gets SIGTERM while the interpreter exits (atexit: where a signal forwarded by the
    launcher to a rank in its last second lands). It exits 0: the stop signals stay ignored after the run in a
    process that ends with it. It died of the signal (status -15: the launcher said "killed by SIGTERM ... continue
    with --train.resume latest" of a finished run)."""
    code = (
        "import atexit, os, runpy, signal, sys; "
        "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM)); "
        f"sys.argv = ['fastclip', *sys.argv[1:]]; {start}"
    )
    run_dir = tmp_path / "run"
    args = fault_overrides(data, run_dir, **{"train.max_steps": 2, "checkpoint.every_steps": 0})
    done = subprocess.run(
        [sys.executable, "-c", code, "train", "--config", str(EMBEDDED), *args],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert latest(run_dir) == "step_00000002" and "Traceback" not in done.stderr


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGUSR1", "SIGHUP", "SIGUSR2"])
def test_a_signal_while_the_launcher_imports_torch_is_one_line(tmp_path, signum):
    """The launcher's first second or two import torch's elastic agent: a signal then killed it with no line
    (143, or 138 for SIGUSR1); it is held from main()'s first line and said, as one before the ranks start.
    SIGHUP and SIGUSR2 where the run's train.stop_signals name them: held too (they killed it silently, 129 or 140,
    until their handlers were set after the command line was read) (second reading of the session's change)."""
    from helpers import catches

    def torch_loaded() -> bool:
        return "libtorch_cpu" in Path(f"/proc/{proc.pid}/maps").read_text()

    argv = ["--standalone", "--nproc_per_node", "1", "-m", "fastclip", "train", "--", "--config", str(EMBEDDED)]
    if signum in ("SIGHUP", "SIGUSR2"):
        argv += ["--train.stop_signals", f"[SIGTERM, {signum}]"]
    # SIGHUP as a terminal leaves it (under nohup, as a suite may run, an ignored SIGHUP is left ignored until the
    # command line is read, by design: the launcher then does not catch it in the window this test aims at)
    proc = subprocess.Popen([sys.executable, "-m", "fastclip.train.launcher", *argv], cwd=tmp_path, env=clean_env(),
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # fmt: skip
    number = getattr(signal, signum)
    wait_for(lambda: proc.poll() is not None or catches(proc.pid, number), 60, "the launcher's first handler")
    assert not torch_loaded()  # caught before the import: the signal lands inside it
    proc.send_signal(number)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == EXIT_PREEMPTED, err
    assert err.strip().splitlines()[-1] == (
        f"fastclip launcher: stopped by {signum} before the ranks started; exit status 75, continue with "
        "--train.resume latest"
    )


def test_a_sigterm_to_the_launch_script_during_its_checks_is_one_line(data, tmp_path):
    """single_node.sh runs `train --check` first (seconds): a SIGTERM to the script then killed it with no line
    (143) and left the check running; the script waits for the check and stops with one line, 75."""
    args = fault_overrides(data, tmp_path / "run", **{"train.max_steps": 2})
    # the config is a FIFO: the check waits on it until the signal has landed (under load a check that ended first
    # let the signal land between the exec and the launcher's handler: status -15, a flaky test)
    config = tmp_path / "config.yaml"
    os.mkfifo(config)
    proc = subprocess.Popen(["bash", str(REPO / "launch" / "single_node.sh"), str(config), "2", *args], cwd=tmp_path,
                            env=clean_env(), stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip

    def checking() -> bool:  # an argument "--check" (a bash subshell's command line holds --checkpoint.keep_last:
        # taken for the check, the signal came before the script's trap and killed it, and the FIFO's open() waited
        # for ever, the likely hang of stop 61's CI)
        return any("--check" in Path(f"/proc/{pid}/cmdline").read_text().split("\0") for pid in children(proc.pid))

    wait_for(lambda: proc.poll() is not None or checking(), 60, "the checks")
    proc.send_signal(signal.SIGTERM)  # the script alone
    time.sleep(0.5)  # (bash takes the signal in its trap while it waits for the check)
    feed_fifo(config, EMBEDDED.read_text(), [proc])  # the check reads its config and passes
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == EXIT_PREEMPTED, err
    assert err.strip().splitlines()[-1] == (
        "launch/single_node.sh: stopped by SIGTERM during the checks (config ok, nothing started); exit status 75, "
        "start the job again"
    ), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_rendezvous_port_in_use_is_one_line_and_a_missing_node_is_announced(tmp_path):
    """multi_node.sh's torchrun rendezvous: a port held on this (the rendezvous) host printed C++ stack traces, then
    waited; a node that never starts was waited for in silence. One line, 2; a note, then a stop signal ends it."""
    import socket

    def launcher(port: int, nnodes: int):
        argv = ["--nnodes", str(nnodes), "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                f"127.0.0.1:{port}", "-m", "fastclip", "train", "--", "--config", str(EMBEDDED)]  # fmt: skip
        return subprocess.Popen([sys.executable, "-m", "fastclip.train.launcher", *argv], cwd=tmp_path,
                                env=clean_env(), stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = launcher(port, 1)
        err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 2 and err.strip().splitlines() == [
        f"fastclip launcher: error: MASTER_PORT={port}: the port is in use on 127.0.0.1, this node, by a program that "
        f"is not a rendezvous store (another job's, or one left from an earlier run): choose another MASTER_PORT, the "
        f"same on every node"
    ], err
    # a store holding it (another agent of the job on this host: NNODES=2 tried on one machine) is no error, nor a
    # port in TIME_WAIT after a store closed
    import datetime

    from torch.distributed import TCPStore
    from torch.distributed.run import parse_args

    from fastclip.train.launcher import rendezvous_port_taken

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    args = parse_args(["--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{store.port}", "x"])
    assert rendezvous_port_taken(args) is None
    del store
    proc = launcher(port, 2)  # free now; the second node never comes
    note = "fastclip launcher: note: waiting for all 2 node(s) to join torchrun's rendezvous at 127.0.0.1:"
    lines: list[str] = []
    watchdog = threading.Timer(120, proc.kill)  # readline() waits for a line: without the note it waited for ever
    watchdog.start()
    wait_for(lambda: lines.append(proc.stderr.readline()) or note in lines[-1] or proc.poll() is not None, 120, "note")
    watchdog.cancel()
    proc.send_signal(signal.SIGTERM)
    err = "".join(lines) + proc.communicate(timeout=120)[1]
    assert proc.returncode == EXIT_PREEMPTED and note in err, err
