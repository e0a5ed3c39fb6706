"""What goes wrong around the trainer rather than in its config: a launcher environment that describes no job
(one line naming the variable, exit 2, from `--check` too), a peer that never joins (a note, then one line,
exit 1), Ctrl-C (one line naming the step and the last complete checkpoint, exit 130, the resume continues
from it) and a reader that closes the pipe (quiet). Real processes where the behaviour is the process's."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fastclip.train.cli import main

from dist_utils import free_port
from helpers import EMBEDDED, REPO, clean_env, fault_overrides, latest, step_dir, the_error_line, wait_for

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_", "TORCHELASTIC")


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher variable from the surroundings (a test run inside a SLURM job, say)."""
    for key in list(os.environ):
        if key.startswith(LAUNCH_VARS):
            monkeypatch.delenv(key)
    return monkeypatch


def _args(data, run, **extra) -> list[str]:
    return ["--config", str(EMBEDDED), *fault_overrides(data, run, **{"train.dist_timeout_minutes": 0.05, **extra})]


def _ctrl_c(
    argv, cwd, ready, what: str, *, wait_s: float, finish_s: float, settle_s: float = 0.0, sig=signal.SIGINT,
    module: str = "fastclip",
):  # fmt: skip
    """(status, stderr) of `python -m <module> <argv>` (`fastclip` by default) run in its own process group and
    sent SIGINT as a terminal's Ctrl-C sends it (to the whole group: data workers too) once `ready()` holds; killed
    if it outlives `finish_s`. `sig`: another signal sent the same way (SIGTERM: a job's time limit, scancel)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
        # a terminal's Ctrl-C reaches a command that handles SIGINT: not ignored, as it is when pytest itself was
        # started in the background by a non-interactive shell (which then passes the ignore on)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_for(lambda: ready() or proc.poll() is not None, wait_s, what)
        time.sleep(settle_s)
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=finish_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize(
    "env, words",
    [
        ({"WORLD_SIZE": "2"}, ["WORLD_SIZE=2 is set but RANK is not: start with torchrun (or srun), or unset it"]),
        ({"RANK": "1"}, ["RANK=1 is set but WORLD_SIZE is not"]),
        ({"RANK": "0", "WORLD_SIZE": "two"}, ["WORLD_SIZE='two' is not an integer"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, ["LOCAL_RANK='x' is not an integer"]),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, ["without SLURM_JOB_NODELIST and without MASTER_ADDR"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, ["MASTER_PORT='99999' must be from 1 to 65535"]),
        ({"RANK": "5", "WORLD_SIZE": "2"}, ["RANK=5 is not below WORLD_SIZE=2"]),
    ],
)
@pytest.mark.parametrize("check", [True, False], ids=["check", "train"])
def test_a_launch_environment_mistake_is_one_line_with_exit_2(
    tiny_embedded, tmp_path, capsys, bare_env, env, words, check
):
    for key, value in env.items():
        bare_env.setenv(key, value)
    run = tmp_path / "run"
    assert main(_args(tiny_embedded, run, **{"train.max_steps": 1}) + (["--check"] if check else [])) == 2
    line = the_error_line(capsys.readouterr().err)
    slurm = "SLURM_PROCID" in env and "RANK" not in env
    assert line.startswith("fastclip train: launch error: " + ("SLURM job" if slurm else "environment variable")), line
    for w in words:
        assert w in line, (w, line)
    assert not run.exists()  # refused before the run folder is made


def test_check_takes_the_world_size_from_the_launcher(tiny_embedded, tmp_path, capsys, bare_env):
    bare_env.setenv("RANK", "0")
    bare_env.setenv("WORLD_SIZE", "2")
    assert main(_args(tiny_embedded, tmp_path / "run") + ["--check"]) == 0
    assert "config ok for 2 process(es)" in capsys.readouterr().out
    assert main(_args(tiny_embedded, tmp_path / "run") + ["--check", "--world-size", "4"]) == 2
    assert "--world-size 4 but the environment says WORLD_SIZE=2" in the_error_line(capsys.readouterr().err)


def test_a_master_port_in_use_is_one_line_naming_it(tiny_embedded, tmp_path, capsys, bare_env):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}.items():
            bare_env.setenv(key, str(value))
        assert main(_args(tiny_embedded, tmp_path / "run", **{"train.max_steps": 1})) == 2
    line = the_error_line(capsys.readouterr().err)
    assert f"MASTER_PORT={port}: the port is in use" in line and "choose another MASTER_PORT" in line, line
    assert not (tmp_path / "run").exists()


def test_a_peer_that_never_joins_is_announced_then_one_line(tiny_embedded, tmp_path):
    """Rank 0 of 2 alone: a note names what it waits for, then after train.dist_timeout_minutes (3 s here)
    one line saying how many joined where, exit 1 (a run-time failure), instead of a DistStoreError traceback."""
    port = free_port()
    env = clean_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = subprocess.run(
        [sys.executable, "-m", "fastclip", "train", *_args(tiny_embedded, tmp_path / "run", **{"train.max_steps": 1})],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    where = f"127.0.0.1:{port}"
    assert (
        f"fastclip train: note: rank 0: waiting up to 0.05 min (train.dist_timeout_minutes) for all 2 processes to "
        f"join at {where}"
    ) in out.stderr
    line = the_error_line(out.stderr)
    assert line.startswith(f"fastclip train: error: only 1 of 2 processes joined at {where} within 0.05 min"), line
    assert "check that every node started" in line and "MASTER_ADDR and MASTER_PORT" in line, line
    assert not (tmp_path / "run").exists()  # the folder this run made holds nothing: removed, as after a config error


def test_a_failed_join_leaves_a_run_folder_another_job_holds(tmp_path):
    """Two launches on one run folder at once: the one whose join fails removed the folder and the lock of the
    other, which held it and had not written yet. Removed only when no job holds its lock."""
    from fastclip.train import preflight

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    held, _ = preflight._take_lock(run / preflight.RUN_LOCK)  # the other job's (an open file of its own)
    preflight.remove_if_untouched_and_free(run)
    assert (run / preflight.RUN_LOCK).is_file() and (run / "checkpoints").is_dir()
    held.close()
    preflight.remove_if_untouched_and_free(run)
    assert not run.exists()


def test_ctrl_c_to_two_ranks_is_said_once(tiny_embedded, tmp_path):
    """Ctrl-C reaches every rank of a launch: each printed the interrupted line (two identical lines, a fresh-eyes
    user's run); rank 0 says it, as a stop's line is said once."""
    run = tmp_path / "run"
    args = _args(tiny_embedded, run, **{"train.max_steps": 200, "checkpoint.every_steps": 2})
    argv = ["--standalone", "--nproc_per_node", "2", "-m", "fastclip", "train", "--", *args]
    ready = (run / "checkpoints" / "latest").is_file
    status, err = _ctrl_c(
        argv, tmp_path, ready, "a checkpoint", wait_s=240, finish_s=120, module="fastclip.train.launcher"
    )
    lines = [x for x in err.splitlines() if "interrupted" in x]
    assert status == 130 and len(lines) == 1 and lines[0].startswith("fastclip train: interrupted at step"), err


def test_ctrl_c_while_torch_is_imported_is_one_line_130(tmp_path):
    """Ctrl-C 0.3-1 s after the start lands in torch's import: it left numpy or torch half made (an abort, status
    -6, or a traceback), or an import guard swallowed it and the command went on (here to its config error, 2).
    It is held while the command's module is imported, then said: one line, 130, wherever it lands."""
    import time

    for n, delay in enumerate((0.3, 0.4, 0.5, 0.6, 0.8, 1.0)):
        argv = ["train", "--config", str(EMBEDDED), "--train.run_dir", str(tmp_path / f"run{n}")]
        proc = subprocess.Popen(
            [sys.executable, "-m", "fastclip", *argv], cwd=tmp_path, env=clean_env(), stderr=subprocess.PIPE,
            text=True, process_group=0, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
        # (where torch's import is done by then, as on a fast machine, the run's own line: "interrupted before ...")
        assert proc.returncode == 130 and "Traceback" not in err, (delay, err)
        assert err.strip().splitlines()[-1].startswith("fastclip train: interrupted"), (delay, err)


@pytest.mark.parametrize("signum, status", [("SIGTERM", 75), ("SIGINT", 130)])
def test_a_stop_while_waiting_for_peers_ends_the_wait_in_one_line(tiny_embedded, tmp_path, signum, status):
    """Rank 0 of 2 alone waits for its peer inside the backend, where no signal handler runs: a preemption's
    SIGTERM (or Ctrl-C) was lost for up to train.dist_timeout_minutes (30). It ends the wait: one line, 75 (130)."""
    import signal
    import time

    port = free_port()
    env = clean_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    argv = _args(tiny_embedded, tmp_path / "run", **{"train.max_steps": 1, "train.dist_timeout_minutes": 5})
    proc = subprocess.Popen([sys.executable, "-m", "fastclip", "train", *argv], cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    with socket.socket() as probe:  # rank 0's store listens: it waits in the join
        deadline = time.monotonic() + 120
        while probe.connect_ex(("127.0.0.1", port)) != 0:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(getattr(signal, signum))
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == status, err
    said = f"stopped by {signum} while waiting for the processes to join at 127.0.0.1:{port}: nothing to save"
    assert the_error_line(err).startswith(f"fastclip train: {said}; exit status {status}"), err
    assert not (tmp_path / "run").exists()  # made by this run, nothing written: removed before the os._exit


def test_a_stop_while_the_last_peer_is_joining_is_agreed_on_not_abandoned(tiny_embedded, tmp_path):
    """A stop that reaches rank 0 while its peer is a moment from joining: rank 0 waits a grace (5 s) instead of
    leaving at once, the peer joins, and both stop together at the first step with status 75 (a rank that left
    made the other wait in its first collective, and the job's status was not 75)."""
    import textwrap
    import time

    port, trigger = free_port(), tmp_path / "go"
    peer = tmp_path / "peer.py"
    peer.write_text(
        textwrap.dedent("""
        import sys, time
        from pathlib import Path
        import torch  # imported before the trigger: the peer joins at once once told
        while not Path(sys.argv[1]).exists():
            time.sleep(0.02)
        from fastclip.cli import main
        sys.exit(main(sys.argv[2:]))
    """)
    )
    argv = ["train", *_args(tiny_embedded, tmp_path / "run", **{"train.max_steps": 4, "train.dist_timeout_minutes": 2})]
    procs = []
    for rank in (0, 1):
        env = clean_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = (
            [sys.executable, "-m", "fastclip", *argv] if rank == 0 else [sys.executable, str(peer), str(trigger), *argv]
        )
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True))
    with socket.socket() as probe:  # rank 0's store listens: it waits in the join
        deadline = time.monotonic() + 120
        while probe.connect_ex(("127.0.0.1", port)) != 0:
            assert procs[0].poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    procs[0].send_signal(signal.SIGTERM)
    time.sleep(1.0)  # inside the grace
    trigger.touch()
    try:
        errs = [p.communicate(timeout=180)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [75, 75], errs
    assert "while waiting for the processes to join" not in errs[0] and "Traceback" not in errs[0] + errs[1], errs


def test_ctrl_c_is_one_line_exit_130_and_the_resume_continues_from_the_last_complete_checkpoint(
    tiny_embedded, tmp_path, capsys, bare_env
):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it (the data worker too), once a first
    checkpoint exists: wherever it lands (a step, a save), one line naming the step and `latest`, which is a
    complete folder; no half-written folder is left, and --train.resume latest continues from it."""
    run = tmp_path / "run"
    args = _args(tiny_embedded, run, **{"train.max_steps": 40, "checkpoint.every_steps": 1, "data.workers": 1})
    ready = (run / "checkpoints" / "latest").is_file
    # settle 0.05 s after the first checkpoint: into the next step or its save
    status, err = _ctrl_c(["train", *args], tmp_path, ready, "a checkpoint", wait_s=240, finish_s=120, settle_s=0.05)
    assert status == 130, err
    line = the_error_line(err)
    last = latest(run)
    assert line.startswith("fastclip train: interrupted at step "), line
    assert line.endswith(
        f"; last complete checkpoint: {run / 'checkpoints' / last} (continue with --train.resume latest)"
    )
    saved = int(last.split("_")[1])
    assert (step_dir(run, saved) / "model.pt").is_file() and (step_dir(run, saved) / "rank_0.pt").is_file()
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # no .tmp_ folder left
    stopped = int(line.split("at step ")[1].split(";")[0])
    assert saved in (stopped - 1, stopped), line  # the checkpoint of the step it was on, or the one before

    capsys.readouterr()
    resumed = _args(tiny_embedded, run, **{"train.max_steps": saved + 1, "checkpoint.every_steps": 1})
    assert main([*resumed, "--train.resume", "latest"]) == 0
    out = capsys.readouterr()
    assert f"resumed from {step_dir(run, saved)}" in out.out + out.err
    assert latest(run) == f"step_{saved + 1:08d}"


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(argv):
    """`fastclip --help | head -1`: the reader is gone before the text is written (its end closed first, so
    the case is certain): no BrokenPipeError traceback, no 'Exception ignored' at exit; status 141 as `yes | head`."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "fastclip", *argv],
            cwd=REPO,
            env=clean_env(),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert out.stderr == "" and out.returncode == 141, out.stderr


@pytest.mark.parametrize("every", [0, 1])
def test_a_run_whose_output_reader_ended_says_what_it_saved(tiny_embedded, tmp_path, every):
    """`fastclip train ... | head -2`: 141 and one line; it advised --train.resume latest where no checkpoint existed
    (the resume then starts over). It names the last complete checkpoint, or says there is none."""
    run = tmp_path / "run"
    args = _args(
        tiny_embedded, run, **{"train.max_steps": 200, "checkpoint.every_steps": every, "train.progress": "false"}
    )
    proc = subprocess.Popen([sys.executable, "-m", "fastclip", "train", *args], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    if every:
        wait_for(lambda: (run / "checkpoints" / "latest").is_file() or proc.poll() is not None, 120, "a checkpoint")
    proc.stdout.readline()
    proc.stdout.close()  # the reader ends
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    line = err.strip().splitlines()[-1]
    said = "its standard output was closed (the program reading it ended); "
    if every:
        assert line.startswith(f"fastclip train: stopped: {said}last complete checkpoint: {run / 'checkpoints'}"), line
    else:
        assert line == f"fastclip train: stopped: {said}no checkpoint was written yet: start it again", line


def test_ctrl_c_in_another_command_is_one_line_exit_130(tmp_path):
    """The dispatcher's answer for the commands that have none of their own: `fastclip data embedded` writing
    75,000 samples (half a minute), interrupted once its first shard folder exists."""
    out = tmp_path / "out"
    argv = ["data", "embedded", "--out", str(out), "--seed", "0"]
    status, err = _ctrl_c(argv, tmp_path, out.exists, "the output folder", wait_s=120, finish_s=60)
    assert status == 130, err
    assert err.strip().splitlines()[-1] == "fastclip data: interrupted" and "Traceback" not in err, err
    assert not out.exists()  # what it wrote is removed: no train split with its manifest and no val


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_scenes_stopped_with_workers_stop_at_once_and_leave_nothing(tmp_path, sig):
    """60,000 scenes on 2 worker processes (a minute's work), stopped once the first shard is written: the queued
    shards are not started, what was written is removed, one line, 128 + the signal's number."""
    out = tmp_path / "out"
    argv = ["data", "embedded", "--source", "scenes", "--out", str(out), "--num-train", "60000", "--num-val", "500"]
    argv += ["--num-test", "500", "--num-novel", "500", "--shard-size", "500", "--workers", "2"]
    ready = lambda: out.is_dir() and any((out / "train").glob("*.tar"))  # noqa: E731
    start = []
    status, err = _ctrl_c(
        argv,
        tmp_path,
        lambda: ready() and not start.append(time.monotonic()),
        "a shard",
        wait_s=120,
        finish_s=60,
        sig=sig,
    )
    stopped_in = time.monotonic() - start[0]
    assert status == 128 + sig, err
    last = err.strip().splitlines()[-1]
    if sig == signal.SIGINT:
        assert last == "fastclip data: interrupted", err
    else:
        assert last == f"fastclip data embedded: stopped by SIGTERM; what it wrote in {out} is removed", err
    assert "Traceback" not in err and not out.exists(), err
    assert stopped_in < 10, stopped_in  # under 1 s idle, 7 s on 2 busy cores; starting the queued shards took 14 s


@pytest.mark.parametrize("variable", ["LOCAL_RANK", "SLURM_LOCALID"])
def test_a_config_error_is_said_at_once_by_local_rank_0_and_after_a_wait_by_the_others(
    tmp_path, capsys, bare_env, monkeypatch, variable
):
    """The others wait so that the launcher, ending them once rank 0 has exited, leaves one line per node; a rank
    that is not ended still says it (nothing is lost if rank 0 never gets there). --check never waits."""
    import fastclip.train.cli as cli

    monkeypatch.setattr(cli, "CONFIG_ERROR_WAIT_S", 0.5)
    monkeypatch.setenv("WORLD_SIZE" if variable == "LOCAL_RANK" else "SLURM_NTASKS", "2")
    argv = ["--config", str(EMBEDDED), "--train.bogus", "1", "--train.run_dir", str(tmp_path / "run")]
    for local, extra, waits in (("1", [], True), ("0", [], False), ("1", ["--check"], False)):
        monkeypatch.setenv(variable, local)
        start = time.monotonic()
        assert main(argv + extra) == 2
        assert (time.monotonic() - start >= 0.5) is waits
        assert "fastclip train: config error: unknown config key 'train.bogus'" in the_error_line(
            capsys.readouterr().err
        )


def test_a_config_error_under_a_hand_run_torchrun_is_said_once(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "fastclip"]
        + ["train", "--", "--config", str(EMBEDDED), "--train.bogus", "1", "--train.run_dir", str(tmp_path / "run")],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert (out.stdout + out.stderr).count("fastclip train: config error: unknown config key 'train.bogus'") == 1


def test_errors_met_in_the_process_group_are_said_once(tmp_path, tiny_embedded):
    """A global batch larger than the data is found once the ranks have joined (the run's own signal handlers are
    installed, then released as ignored): rank 1 waited out torchrun's SIGTERM and said the line too; NaN steps in
    a row stopped every rank, and each said it (helper-61)."""

    def launched(*train_args: str, **env: str) -> subprocess.CompletedProcess:
        data = ["--data.train", str(tiny_embedded / "train"), "--data.val", "null", "--data.zeroshot", "null"]
        return subprocess.run(
            [sys.executable, "-m", "fastclip.train.launcher", "--standalone", "--nproc_per_node", "2", "-m"]
            + ["fastclip", "train", "--", "--config", str(EMBEDDED), *data, *train_args],
            cwd=REPO,
            env=clean_env(**env),
            capture_output=True,
            text=True,
            timeout=300,
        )

    out = launched("--data.batch_size", "60", "--train.run_dir", str(tmp_path / "run"))
    said = [line for line in (out.stdout + out.stderr).splitlines() if "fastclip train: config error:" in line]
    assert out.returncode == 2 and len(said) == 1, out.stdout + out.stderr
    assert "data.batch_size" in said[0], said
    # an error every rank raises with the same words (NaN/Inf steps in a row, all-reduced): said by rank 0 alone
    nan = ["--data.batch_size", "8", "--train.max_steps", "6", "--train.max_nonfinite_steps", "2"]
    nan += ["--train.run_dir", str(tmp_path / "nan"), "--eval.at_end", "false", "--train.progress", "false"]
    out = launched(*nan, FASTCLIP_FAULTS="nan@batch:rank=0")
    said = [line for line in (out.stdout + out.stderr).splitlines() if "fastclip train: error:" in line]
    assert out.returncode == 1 and len(said) == 1, out.stdout + out.stderr
    assert "2 steps in a row were skipped for NaN/Inf" in said[0], said


def test_quickstart_state_reads_a_runs_last_step_and_what_was_evaluated_there(tmp_path):
    """launch/run_state.py, what quickstart.sh's reruns decide by: the last logged training step (a line cut by a
    kill passed over), and whether the results hold an evaluation of a data path (normalised) at that step."""
    sys.path.insert(0, str(REPO / "launch"))
    try:
        import run_state
    finally:
        sys.path.pop(0)
    run = tmp_path / "run"
    assert run_state.trained_steps(run) == 0 and not run_state.evaluated(run, "d/test")
    (run / "checkpoints").mkdir(parents=True)
    rows = [{"step": 5, "loss": 1.0}, {"step": 10, "loss": 0.9}, {"step": 10, "eval/zeroshot/mean_top1": 0.4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 15, "lo')
    assert run_state.trained_steps(run) == 10
    results = run / "checkpoints" / "results.jsonl"
    results.write_text(json.dumps({"step": 5, "data": "d/test", "task": "retrieval"}) + "\n")
    assert not run_state.evaluated(run, "d/test")  # an older checkpoint's evaluation
    spot = {"step": 10, "data": "d/test", "task": "retrieval", "max_samples": 50}
    results.write_text(results.read_text() + json.dumps(spot) + "\n")
    assert not run_state.evaluated(run, "d/test")  # a spot check (it let a rerun skip the full evaluation)
    results.write_text(results.read_text() + json.dumps({"step": 10, "data": "d/test/", "task": "retrieval"}) + "\n")
    assert run_state.evaluated(run, "d/test") and run_state.evaluated(run, "./d/test")
    assert not run_state.evaluated(run, "d/novel")
    script = [sys.executable, str(REPO / "launch" / "run_state.py")]
    assert subprocess.run([*script, "evaluated", str(run), "d/test"]).returncode == 0
    assert subprocess.run([*script, "evaluated", str(run), "d/novel"]).returncode == 1
    assert subprocess.run([*script, "steps", str(run)], capture_output=True, text=True).stdout == "10\n"
    # the run folder is RUN=..., not an override that the rerun checks would not see
    done = subprocess.run(["bash", str(REPO / "launch" / "quickstart.sh"), "--train.run_dir", "x"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        "launch/quickstart.sh: --train.run_dir: the run folder is RUN=... (RUN=runs/mine bash launch/quickstart.sh)"
    )
