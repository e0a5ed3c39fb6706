"""Preemption with real processes: SIGUSR1/SIGTERM reaching a running 2-process job stops every rank at the
same step with a checkpoint there and exit status 75, and `--train.resume latest` then ends bitwise where an
uninterrupted run ends (fastclip/train/preemption.py, launch/slurm.sbatch)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fastclip.train.launcher import children
from fastclip.train.preemption import EXIT_PREEMPTED

from helpers import (
    Job,
    assert_same_training_state,
    catches,
    fault_overrides,
    feed_fifo,
    latest,
    step_dir,
    train_records,
    wait_for,
)

REPO = Path(__file__).resolve().parents[1]
STEPS = 8  # 5 steps per epoch at 2 x 8: the runs cross into epoch 1


def _args(data: Path, run: Path, **extra) -> list[str]:
    # no checkpoints by step count or time: the only checkpoint before the end is the one the signal asks for
    return fault_overrides(
        data,
        run,
        **{"train.max_steps": STEPS, "data.workers": 1, "checkpoint.every_steps": 0, "train.resume": "latest", **extra},
    )


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    """The uninterrupted 2-process run the stopped and resumed ones must end equal to."""
    root = tmp_path_factory.mktemp("reference")
    job = Job(_args(data, root / "run"), 2, root / "job")
    assert job.wait(300) == [0, 0], job.outputs()
    return root / "run"


def _resume_and_compare(data, run: Path, stopped_at: int, reference: Path, log_dir: Path) -> None:
    job = Job(_args(data, run), 2, log_dir)
    assert job.wait(300) == [0, 0], job.outputs()
    assert f"resumed from {step_dir(run, stopped_at)}" in job.output(0)
    assert_same_training_state(step_dir(reference, STEPS), step_dir(run, STEPS), 2)
    expected, got = train_records(reference), train_records(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for x, y in zip(expected, got):
        assert (x["loss"], x["objective"], x["lr"], x["samples_seen"]) == (
            y["loss"],
            y["objective"],
            y["lr"],
            y["samples_seen"],
        )


@pytest.mark.parametrize("action", ["usr1"])  # SIGTERM takes the same path: the whole-job test below sends it
def test_a_signal_to_one_rank_stops_both_at_that_step_and_the_resume_is_exact(data, reference, tmp_path, action):
    """The signal reaches rank 1 only, before step 3's forward: both ranks agree (the request rides in the
    step's all_reduce), checkpoint step 3 and exit 75; nothing else was checkpointed; the resume is exact."""
    run = tmp_path / "run"
    job = Job(_args(data, run), 2, tmp_path / "stopped", env={"FASTCLIP_FAULTS": f"{action}@batch:step=3:rank=1"})
    codes = job.wait(300)
    assert codes == [EXIT_PREEMPTED] * 2, job.outputs()
    assert latest(run) == "step_00000003"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000003"]
    assert [r["step"] for r in train_records(run)] == [1, 2, 3]
    assert (
        "stopped at step 3 by a signal to another rank: checkpoint saved; exit status 75, continue with "
        "--train.resume latest"
    ) in job.output(0)
    assert "Traceback" not in job.outputs()
    _resume_and_compare(data, run, 3, reference, tmp_path / "resumed")


def test_a_stop_on_an_evaluation_step_is_evaluated_by_the_resume(data, tmp_path):
    """A stop checkpoints at once, without the evaluation its step was due (the signal's lead is short): that
    point was lost for good, and a study's mean curve, which keeps the points every seed has, lost it for every
    seed. The resume evaluates the step first: the run's evaluation records equal those of a run never stopped."""

    def evals(run: Path) -> list[dict]:
        from helpers import records

        return [r for r in records(run) if any(k.startswith("eval/") for k in r)]

    held_out = {"data.val": data / "val", "data.zeroshot": data / "zeroshot.json", "eval.every_steps": 3}
    held_out["eval.max_samples"] = 40
    straight = Job(_args(data, tmp_path / "straight", **held_out), 2, tmp_path / "straight_job")
    assert straight.wait(300) == [0, 0], straight.outputs()
    run = tmp_path / "run"
    job = Job(
        _args(data, run, **held_out), 2, tmp_path / "stopped", env={"FASTCLIP_FAULTS": "usr1@batch:step=3:rank=1"}
    )
    assert job.wait(300) == [EXIT_PREEMPTED] * 2, job.outputs()
    assert latest(run) == "step_00000003" and evals(run) == []  # stopped at step 3, unevaluated
    resumed = Job(_args(data, run, **held_out), 2, tmp_path / "resumed")
    assert resumed.wait(300) == [0, 0], resumed.outputs()
    expected = evals(tmp_path / "straight")
    assert [r["step"] for r in expected] == [3, 6] and len(expected[0]) > 3, expected
    assert evals(run) == expected
    # a resume at a step whose evaluation is logged does not evaluate it again
    again = tmp_path / "again"
    shutil.copytree(run, again)
    (again / "checkpoints" / "latest").write_text("step_00000003\n")
    shutil.rmtree(step_dir(again, STEPS))
    rerun = Job(_args(data, again, **held_out), 2, tmp_path / "again_job")
    assert rerun.wait(300) == [0, 0], rerun.outputs()
    assert evals(again) == expected


@pytest.mark.parametrize("kind", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_signal_to_the_whole_job_at_a_random_moment(data, reference, tmp_path, kind):
    """As SLURM's --signal=USR1@120 (SIGUSR1) and its preemption, time limit and scancel (SIGTERM) do: the signal
    goes to every process of the job (both ranks and their data workers) at a random moment; the job checkpoints
    the step it is on, exits 75, and resumes exactly. (SIGTERM used to kill the data workers first: every rank
    then crashed with "DataLoader worker ... is killed by signal: Terminated", without a checkpoint.)"""
    seed = random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    after, delay = rng.randint(1, STEPS - 3), rng.uniform(0.0, 0.1)
    where = f"(seed {seed}: {kind.name} after step {after} + {delay:.2f}s)"
    run = tmp_path / "run"
    job = Job(_args(data, run), 2, tmp_path / "stopped")
    try:
        wait_for(lambda: any(r["step"] >= after for r in train_records(run)), 240, f"step {after}", job)
        import os
        import time

        time.sleep(delay)
        # the data workers first (SLURM signals the processes of a step in no set order): a worker that died of
        # SIGTERM crashed its rank with "DataLoader worker ... is killed by signal" before the rank could stop
        for rank in job.procs:
            for worker in children(rank.pid):
                os.kill(worker, kind)
        time.sleep(0.2)
        os.killpg(job.pgid, kind)
        codes = job.wait(120)
    finally:
        job.kill()
    assert codes == [EXIT_PREEMPTED] * 2, f"{where}\n{job.outputs()}"
    stopped_at = max(r["step"] for r in train_records(run))
    assert stopped_at < STEPS, where
    assert latest(run) == f"step_{stopped_at:08d}", where  # the checkpoint is at the step the job stopped on
    assert f"by {kind.name}" in job.output(0), where
    assert "Traceback" not in job.outputs(), where
    _resume_and_compare(data, run, stopped_at, reference, tmp_path / "resumed")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_while_the_run_starts_ends_in_75_not_in_death(data, tmp_path, sig):
    """A preemption in the seconds `fastclip train` spends importing torch and reading its config killed it (143,
    no line) and slurm.sbatch requeues on 75 only. Deterministic: the config is a FIFO, so the command waits on it
    with the signal held; the signal comes, then the config: 75 and its one line, nothing trained."""
    import os

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    run = tmp_path / "run"
    args = fault_overrides(data, run, **{"train.max_steps": 4})
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastclip", "train", "--config", str(fifo), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(lambda: proc.poll() is not None or catches(proc.pid, sig), 60, "the signal held")
    proc.send_signal(sig)
    feed_fifo(fifo, (REPO / "configs" / "embedded.yaml").read_text(), [proc])
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == EXIT_PREEMPTED, out
    lines = [x for x in out.splitlines() if not x.startswith("fastclip train: note:")]
    assert lines == [
        f"fastclip train: stopped by {sig.name} before the run started: nothing to save; exit status 75, continue "
        "with --train.resume latest"
    ], out
    assert not (run / "metrics.jsonl").exists()


def test_a_stop_signal_during_check_ends_in_75_with_its_line(data, tmp_path):
    """launch/slurm.sbatch runs `--check` before the job: a preemption there killed it (143, no line, no requeue).
    Now the signal is held as for the run: the check runs to its end, then 75 and one line. Deterministic: the
    config is a FIFO, so the command waits on it with the signal held."""
    import os

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    args = fault_overrides(data, tmp_path / "run", **{"train.max_steps": 4})
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastclip", "train", "--config", str(fifo), *args, "--check"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: proc.poll() is not None or catches(proc.pid, signal.SIGTERM), 60, "the signal held")
    proc.send_signal(signal.SIGTERM)
    feed_fifo(fifo, (REPO / "configs" / "embedded.yaml").read_text(), [proc])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, (out, err)
    assert "config ok" in out
    lines = [x for x in err.splitlines() if not x.startswith("fastclip train: note:")]
    assert lines == [
        "fastclip train: stopped by SIGTERM during --check (it ran to its end: config ok); exit status 75, submit "
        "the job again"
    ], err


def test_a_held_signal_is_said_or_taken_as_configured_and_left_to_no_later_run(tmp_path, capsys):
    """In-process: a held signal that train.stop_signals lists ends the command with 75 and its line before anything
    is built; one it does not list gets its own action (here a handler of the caller's); one inherited as ignored
    (nohup) is not held; and nothing recorded outlives the command."""
    import os

    from fastclip.train.cli import _stopped_while_starting
    from fastclip.train.config import Config
    from fastclip.train.preemption import StopSignals, early_stop, hold_early, release_early

    cfg = Config()
    hold_early()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _stopped_while_starting(cfg) == EXIT_PREEMPTED
    finally:
        release_early()
    assert "stopped by SIGUSR1 before the run started: nothing to save; exit status 75" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    stop = StopSignals().install()
    assert early_stop() is None and stop.received is None  # not carried into a later run
    stop.release(stopped=False)
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda n, f: seen.append(n))
    try:
        cfg.train.stop_signals = ["SIGTERM"]
        hold_early()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _stopped_while_starting(cfg) is None and seen == [signal.SIGUSR1]  # delivered where it belongs
        hold_early()
        assert _stopped_while_starting(cfg) is None  # nothing came: the run goes on
        release_early()
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        hold_early()
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN  # inherited ignored: left so
    finally:
        release_early()
        signal.signal(signal.SIGUSR1, previous)


def test_stop_signals_config_error_is_one_line_with_exit_2(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fastclip", "train", "--train.stop_signals", "[SIGUSR1, SIGFOO]", "--print-config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "fastclip train: config error: config key 'train.stop_signals': 'SIGFOO' is not a "
        "signal that can be caught here"
    )
    out = subprocess.run(  # one name where a list goes: the line shows the list to type
        [sys.executable, "-m", "fastclip", "train", "--train.stop_signals", "SIGHUP", "--print-config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.strip().endswith("(on the command line: --train.stop_signals '[SIGHUP]')")


def _show_job(state: str = "RUNNING", reason: str = "None", preempt_time: str = "None") -> str:
    """`scontrol show job`'s lines that slurm.sbatch reads, as Slurm 22.05 prints them for a job whose batch script
    is still running: after scancel COMPLETING / None / PreemptTime=None, at the time limit COMPLETING /
    TimeLimit, after a preemption RUNNING with PreemptTime set (seen on a one-node slurmctld + slurmd)."""
    return (
        f"JobId=4242 JobName=fastclip\n   UserId=root(0) GroupId=root(0) MCS_label=N/A\n"
        f"   JobState={state} Reason={reason} Dependency=(null)\n"
        f"   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0\n"
        f"   PreemptEligibleTime=2026-11-30T13:27:53 PreemptTime={preempt_time}\n   Partition=low\n"
    )


def _sbatch(
    tmp_path,
    srun_status: int,
    check_status: int = 0,
    srun_body: str | None = None,
    extra=(),
    show_job: str | None = None,
    check_body: str | None = None,
    **env_change,
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """launch/slurm.sbatch run by bash outside SLURM as sbatch runs it: a copy elsewhere, the repository being the
    submit folder (here a checkout without .venv), with `srun`, `scontrol` and `python3` as stand-ins on PATH that
    record their arguments (python3 answers the launcher's import probe, then `train --check` with check_status;
    `scontrol show job` prints `show_job`)."""
    submit = tmp_path / "submit"
    (submit / "launch").mkdir(parents=True)
    shutil.copy(REPO / "launch" / "python.sh", submit / "launch")
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(REPO / "launch" / "slurm.sbatch", spool / "slurm_script")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = f'echo "${{0##*/}} $*" >> "{tmp_path}/calls"'
    stand_ins = {
        "srun": (
            f'{record}\necho "$FASTCLIP_CONFIG_NOTES_SAID" > "{tmp_path}/srun_notes_said"\n'
            + (srun_body or f"exit {srun_status}")
        ),
        "scontrol": f'{record}\n[ "$1" = show ] && cat "{tmp_path}/show_job"\nexit 0',
        "python3": f'[ "$1" = -c ] && exit 0\n{record}\n{check_body or f"exit {check_status}"}',
    }
    (tmp_path / "show_job").write_text(show_job or _show_job())
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_CPUS_PER_TASK": "6",
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "8",
        "SLURM_SUBMIT_DIR": str(submit),
    }
    env = {k: v for k, v in {**env, **env_change}.items() if v is not None}  # None: unset
    argv = ["bash", str(spool / "slurm_script"), "configs/cc3m-fastclip-v3.yaml", "--optim.lr", "5e-4", *extra]
    if srun_body is None and check_body is None:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    else:  # as SLURM preempts: SIGTERM to every process of the job once the tasks run
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        wait_for(lambda: (tmp_path / "srun_started").exists() or proc.poll() is not None, 30, "srun")
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        out = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return out, calls


@pytest.mark.parametrize("srun_status, requeued", [(EXIT_PREEMPTED, True), (0, False), (1, False)])
def test_sbatch_script_checks_once_passes_cpus_to_srun_and_requeues_on_exit_75(tmp_path, srun_status, requeued):
    """The checks run once, on the batch node, for the job's SLURM_NTASKS; then srun starts the tasks with the
    python the launchers find (not a bare `python`) and --cpus-per-task, and the job is requeued exactly when the
    trainer exited 75; the script's status is the trainer's."""
    text = (REPO / "launch" / "slurm.sbatch").read_text()
    assert "#SBATCH --signal=USR1@120" in text and "#SBATCH --requeue" in text
    out, calls = _sbatch(tmp_path, srun_status)
    assert out.returncode == srun_status, out.stderr
    args = "--config configs/cc3m-fastclip-v3.yaml --train.resume latest --optim.lr 5e-4"
    assert calls[0] == f"python3 -m fastclip train --check --world-size 8 {args}"
    assert calls[1] == f"srun --kill-on-bad-exit=1 --cpus-per-task=6 python3 -u -m fastclip train {args}"
    assert (tmp_path / "srun_notes_said").read_text() == "1\n"  # the check said the config's notes: not each task
    assert calls[2:] == (["scontrol requeue 4242"] if requeued else [])


@pytest.mark.parametrize(
    "show_job",
    [_show_job(preempt_time="2026-11-30T13:26:54"), _show_job("COMPLETING", reason="TimeLimit"), _show_job()],
    ids=["preempted", "time-limit", "scancel-signal-TERM"],  # (the last: a request to checkpoint, the job RUNs)
)
def test_sbatch_script_outlives_slurms_sigterm_and_requeues_on_the_tasks_75(tmp_path, show_job):
    """A preemption's (or the time limit's) SIGTERM reaches the batch script too: it waited for srun (the tasks
    checkpoint and exit 75) and requeued; it died of the signal before (143, no requeue)."""
    body = f'trap "exit {EXIT_PREEMPTED}" TERM\ntouch "{tmp_path}/srun_started"\nwhile true; do sleep 0.05; done'
    out, calls = _sbatch(tmp_path, EXIT_PREEMPTED, srun_body=body, show_job=show_job)
    assert out.returncode == EXIT_PREEMPTED, (out.returncode, out.stderr)
    assert calls[1:] == [calls[1], "scontrol show job 4242", "scontrol requeue 4242"], calls
    assert "requeued job 4242" in out.stderr


@pytest.mark.parametrize("given", [["--resume", "runs/a/checkpoints/step_00000100"], ["--train.resume=x"]])
def test_sbatch_script_refuses_a_resume_of_the_users_that_would_win_on_every_requeue(tmp_path, given):
    """The script resumes with --train.resume latest: an OpenCLIP --resume X beside it was a conflict (exit 2, "keep
    one", which the user cannot), a --train.resume X won on every requeue. One line says what to do instead."""
    out, calls = _sbatch(tmp_path, srun_status=0, extra=given)
    assert out.returncode == 2 and calls == [], (out.stderr, calls)
    (line,) = out.stderr.strip().splitlines()
    flag, value = given if len(given) == 2 else given[0].split("=")
    assert line.startswith(
        f"launch/slurm.sbatch: error: {flag} {value}: this script resumes with --train.resume latest"
    )
    assert "copy its step folder into this run's checkpoints/" in line


@pytest.mark.parametrize("during", ["run", "check"])
def test_sbatch_script_does_not_requeue_a_cancelled_job_and_lets_a_resume_latest_through(tmp_path, during):
    """scancel's SIGTERM is a preemption's: the tasks stop with 75, and a cancelled job must stay cancelled. Slurm
    22.05 shows such a job COMPLETING, not CANCELLED, while the script runs: the script looked for CANCELLED and
    requeued every scancel'd job (seen on a real slurmctld). A `--resume latest` of the user's is what the script
    passes anyway: taken, not refused."""
    body = f'trap "exit {EXIT_PREEMPTED}" TERM\ntouch "{tmp_path}/srun_started"\nwhile true; do sleep 0.05; done'
    cancelled = _show_job("COMPLETING")
    if during == "run":
        out, calls = _sbatch(tmp_path, EXIT_PREEMPTED, srun_body=body, extra=["--resume", "latest"], show_job=cancelled)
        assert calls[1].endswith("--train.resume latest --optim.lr 5e-4 --resume latest")
    else:  # the stand-in python3 is the check: it waits for the signal (held, then said as 75)
        out, calls = _sbatch(tmp_path, 0, srun_body=body, show_job=cancelled, check_body=body)
    assert out.returncode == EXIT_PREEMPTED, out.stderr
    assert calls[-1] == "scontrol show job 4242", calls
    started = "with a checkpoint" if during == "run" else "before the job started"
    assert out.stderr.strip().splitlines()[-1] == (
        f"fastclip: stopped by a signal {started}; job 4242 was cancelled: not requeued"
    )


def test_sbatch_script_stops_before_srun_when_the_checks_fail(tmp_path):
    out, calls = _sbatch(tmp_path, srun_status=0, check_status=2)
    assert out.returncode == 2 and [c.split()[0] for c in calls] == ["python3"], (out.stderr, calls)


@pytest.mark.parametrize(
    "change, said",
    [
        ({"SLURM_NTASKS": None}, "launch/slurm.sbatch: error: SLURM_NTASKS is not set: give the job its tasks"),
        ({"SLURM_SUBMIT_DIR": "/"}, "launch/slurm.sbatch: error: the job was submitted from /, which is not the"),
    ],
)
def test_sbatch_script_without_its_tasks_or_outside_the_repository_is_one_line(tmp_path, change, said):
    """(bash's `unbound variable`, or `launch/python.sh: No such file or directory` and a status of 1, before)"""
    out, calls = _sbatch(tmp_path, srun_status=0, **change)
    assert out.returncode == 2 and calls == [], (out.stderr, calls)
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith(said), out.stderr


def test_sbatch_script_requeues_a_job_stopped_during_its_checks(tmp_path):
    """A preemption while `--check` runs ends it in 75 (held, as for the run): the job is requeued, srun never
    starts."""
    out, calls = _sbatch(tmp_path, srun_status=0, check_status=EXIT_PREEMPTED)
    assert out.returncode == EXIT_PREEMPTED, out.stderr
    assert [c.split()[0] for c in calls] == ["python3", "scontrol"] and calls[1] == "scontrol requeue 4242", calls
    assert out.stderr.strip() == "fastclip: stopped by a signal before the job started; requeued job 4242"


def test_between_logging_steps_the_stop_follows_within_stop_check_every(data, reference, tmp_path):
    """Device mode agrees on a stop on logging steps and every train.stop_check_every steps: with log_every 4 and
    stop_check_every 3, a signal to rank 1 before step 2 stops both ranks at step 3 (not at the logging step 4),
    and the resume (logging every step again) ends bitwise where the uninterrupted run ends."""
    run = tmp_path / "run"
    args = _args(data, run, **{"train.log_every": 4, "train.stop_check_every": 3})
    job = Job(args, 2, tmp_path / "stopped", env={"FASTCLIP_FAULTS": "usr1@batch:step=2:rank=1"})
    codes = job.wait(300)
    assert codes == [EXIT_PREEMPTED] * 2, job.outputs()
    assert latest(run) == "step_00000003"
    assert "stopped at step 3 by a signal to another rank" in job.output(0)
    job = Job(_args(data, run), 2, tmp_path / "resumed")
    assert job.wait(300) == [0, 0], job.outputs()
    assert f"resumed from {step_dir(run, 3)}" in job.output(0)
    assert_same_training_state(step_dir(reference, STEPS), step_dir(run, STEPS), 2)
