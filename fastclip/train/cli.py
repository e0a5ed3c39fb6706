"""`fastclip train [--config FILE.yaml] [--section.key value ...]`

    fastclip train --config configs/embedded.yaml                                  # one process
    torchrun --nproc_per_node 2 -m fastclip train --config configs/embedded.yaml    # one node, 2 processes
    srun fastclip train --config configs/cc3m-fastclip-v3.yaml                      # SLURM (launch/slurm.sbatch)

Without --config the built-in defaults apply (the embedded recipe). `--print-config` shows the resolved config
and exits. `--check [--world-size N]` runs every check that needs no process group (config, device,
architecture, run folder, data for N processes, resume or pretrained file) and exits 0 or 2 without training:
the launchers run it before torchrun, so a configuration error is the first and only line the operator sees
(torchrun itself reports a worker's exit status 2 as its own failure, with a traceback, and exits 1). Configuration
errors are reported before anything is built, naming the key; exit status 2.
A run stopped for a known reason (a failed collective, too many NaN/Inf steps, an untrusted or unreadable
checkpoint: fastclip/train/errors.py) prints one line naming it; exit status 1. Stopped by a signal in
train.stop_signals (SIGUSR1, SIGTERM: preemption, the end of a SLURM time slot) after writing a checkpoint at
that step on every rank: exit status 75 (launch/slurm.sbatch requeues the job on it; fastclip/train/preemption.py).
The launcher's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, SLURM_*) are checked before
anything else, by --check too: a missing partner variable or a value out of range is one line naming it, exit 2.
Interrupted (Ctrl-C, SIGINT): one line naming the step and the last complete checkpoint (or what is wrong with
`latest`); exit status 130.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastclip.cli import EXIT_INTERRUPTED, launch_rank, note
from fastclip.distributed import JoinAbandoned, LaunchError, dist_env_from
from fastclip.train.config import ConfigError, dump_config, load_config
from fastclip.train.errors import TrainingError
from fastclip.train.preemption import EXIT_PREEMPTED

USAGE = __doc__


def _chain(error: BaseException | None):
    """`error`, then what it was raised from or while handling, once each."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _interrupt(error: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt behind `error`, if any: Ctrl-C inside torch.save surfaces as the RuntimeError the
    zip writer raises while unwinding it (its __context__), and in a job as a CollectiveFailure (its __cause__)."""
    return next((e for e in _chain(error) if isinstance(e, KeyboardInterrupt)), None)


def _interrupted_line(error: BaseException, run_dir) -> str:
    # the trainer tags the error it re-raises with the step it was on
    step = next((e.at_step for e in _chain(error) if getattr(e, "at_step", None) is not None), None)
    where = f"at step {step}" if step else "before the first step"
    from fastclip.checkpoint import CHECKPOINTS, LATEST, latest_complete, read_pointer

    last = latest_complete(Path(run_dir)) if run_dir else None
    root = Path(run_dir) / CHECKPOINTS if run_dir else None
    if last is None and root is not None and read_pointer(root) is not None:
        return f"fastclip train: interrupted {where}; {root / LATEST} names no usable step folder"
    if last is None:
        return f"fastclip train: interrupted {where}; no checkpoint yet"
    return (
        f"fastclip train: interrupted {where}; last complete checkpoint: {last} (continue with --train.resume latest)"
    )


# how long a process other than its node's local rank 0 waits before saying a configuration error itself
CONFIG_ERROR_WAIT_S = 5.0


def _say_config_error(error: ConfigError, check_only: bool) -> None:
    """Every process of a node reads the same arguments and files and meets the same error. Local rank 0 says it at
    once; the others wait: the launcher (torchrun, srun --kill-on-bad-exit) stops them when rank 0 has exited (its
    signal, held, ends the wait unsaid), so the line appears once per node, and a rank 0 that is slow or failed
    otherwise still leaves the line said."""
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    world = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
    if not check_only and local.isdigit() and int(local) > 0 and world.isdigit() and int(world) > 1:
        from fastclip.train.preemption import early_stop

        # the launcher's signal ends the wait: held since the start (hold_early), or here, for an error met in the
        # process group, after the run's own handlers were released (ignored: rank 1 waited it out and said it too)
        ended: list[int] = []
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
                previous[number] = signal.signal(number, lambda signum, frame: ended.append(signum))
        try:
            waited = time.monotonic() + CONFIG_ERROR_WAIT_S
            while time.monotonic() < waited:
                if ended or early_stop() is not None:
                    return
                time.sleep(0.1)
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
    print(f"fastclip train: config error: {error}", file=sys.stderr, flush=True)


class _UsageError(ValueError):
    """A flag of `fastclip train` itself given wrong (the config's keys are ConfigError's)."""


@dataclass
class _TrainArgs:
    config_path: str | None = None
    print_only: bool = False
    check_only: bool = False
    world_size: int | None = None  # --check's number of processes
    overrides: list[str] = field(default_factory=list)  # --section.key value ..., for load_config


def _parse(argv: list[str]) -> _TrainArgs:
    """The flags read here; everything else is a config override."""
    args, i = _TrainArgs(), 0
    while i < len(argv):
        a = argv[i]
        if a in ("--config", "-c") or a.startswith("--config="):
            given = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else None)
            if not given:
                raise _UsageError("--config needs a file")
            if args.config_path is not None:  # one would silently win
                raise _UsageError(f"--config given twice ({args.config_path}, {given}): pass one file")
            args.config_path, i = given, i + (1 if "=" in a else 2)
        elif a == "--print-config":
            args.print_only, i = True, i + 1
        elif a == "--check":
            args.check_only, i = True, i + 1
        elif a == "--world-size":
            if i + 1 >= len(argv) or not argv[i + 1].isdigit() or int(argv[i + 1]) < 1:
                raise _UsageError("--world-size needs a number of processes >= 1")
            args.world_size, i = int(argv[i + 1]), i + 2
        else:
            args.overrides.append(a)
            i += 1
    if args.world_size is not None and not args.check_only:  # the launcher starts the processes; this would be ignored
        n = args.world_size
        raise _UsageError(
            f"--world-size {n} is read by --check only; start {n} processes with "
            f"a launcher (torchrun --nproc_per_node {n} -m fastclip train ..., launch/single_node.sh)"
        )
    return args


def read_config(argv: list[str]):
    """The Config that `fastclip train ARGV` runs (ConfigError or _UsageError where it cannot be read)."""
    argv = list(argv)
    while argv and argv[0] == "--":
        argv.pop(0)
    args = _parse(argv)
    return load_config(args.config_path, args.overrides)


def _print_config(cfg) -> None:
    from fastclip.train.net import check_loss

    # a loss option the loss refuses is refused here too, not printed as if it would run
    check_loss(cfg, 1)  # (cheap: a loss holds no per-sample state before its first call)
    print(dump_config(cfg), end="")


def _check(cfg, env, world_size: int | None) -> None:
    """--check: every check that needs no process group, for --world-size processes (default: the launcher's)."""
    from fastclip.train.catalog_checks import check_before_launch

    if world_size is None:
        world_size = env.world_size
    elif env.world_size > 1 and world_size != env.world_size:
        raise LaunchError(
            f"--world-size {world_size} but the environment says WORLD_SIZE={env.world_size} "
            f"({env.launcher}): drop --world-size or make them agree"
        )
    check_before_launch(cfg, world_size)
    print(f"fastclip train: config ok for {world_size} process(es)")


def _stopped_while_checking() -> int | None:
    """A stop signal held while --check ran (fastclip.cli holds them for it too): its line and status 75, so that a
    launcher that checks first requeues the job as it would for the run; None: none came."""
    from fastclip.train.preemption import early_stop

    name = early_stop()
    if name is None:
        return None
    print(
        f"fastclip train: stopped by {name} during --check (it ran to its end: config ok); exit status "
        f"{EXIT_PREEMPTED}, submit the job again",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_PREEMPTED


def _stopped_while_starting(cfg) -> int | None:
    """A stop signal that came before the config was read (held by fastclip.cli): status 75 with its line when it is
    one of train.stop_signals (a torchrun rank leaves it to the run, whose ranks agree on the stop), else its own
    action now; None: go on (one arriving later is the run's)."""
    import signal

    from fastclip.train.preemption import early_stop, release_early, signal_number

    name = early_stop()
    release_early(keep=cfg.train.stop_signals)
    if name is None:
        return None
    number = signal_number(name)
    if number not in {signal_number(s) for s in cfg.train.stop_signals}:
        signal.raise_signal(number)  # its own action now: the default ends the process, a caller's handler runs
        return None
    if "TORCHELASTIC_RUN_ID" in os.environ:  # one of a job's ranks: the ranks agree on the stop at the first step
        return None
    print(
        f"fastclip train: stopped by {name} before the run started: nothing to save; exit status {EXIT_PREEMPTED}, "
        f"continue with --train.resume latest",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_PREEMPTED


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    while argv and argv[0] == "--":  # torchrun passes a separating "--" through to the script
        argv.pop(0)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        args = _parse(argv)
    except _UsageError as e:
        print(f"fastclip train: {e}", file=sys.stderr)
        return 2
    cfg = None
    try:
        cfg = load_config(args.config_path, args.overrides)
        if args.print_only:
            _print_config(cfg)
            return 0
        env = dist_env_from()  # the launcher's variables, before a run folder or a tower exists
        if args.check_only:
            _check(cfg, env, args.world_size)
            return _stopped_while_checking() or 0
        if (stopped := _stopped_while_starting(cfg)) is not None:
            return stopped
        from fastclip.train.trainer import train

        if train(cfg)["preempted"]:
            return EXIT_PREEMPTED
    except ConfigError as e:
        _say_config_error(e, args.check_only)
        return 2
    except LaunchError as e:
        print(f"fastclip train: launch error: {e}", file=sys.stderr)
        return 2
    except JoinAbandoned as e:  # its thread is still inside the backend's wait: no clean interpreter exit
        interrupted = e.signal_name == "SIGINT"
        code = EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED
        then = "" if interrupted else ", continue with --train.resume latest"
        print(f"fastclip train: {e}: nothing to save; exit status {code}{then}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)
    except BrokenPipeError as e:  # the reader of stdout ended: fastclip.cli says so, naming what was saved
        e.run_dir = cfg.train.run_dir if cfg is not None else None
        raise
    except BaseException as e:
        if _interrupt(e) is None:
            if isinstance(e, TrainingError):
                if not (e.agreed and launch_rank() > 0):  # (every rank has the same line: said once)
                    print(f"fastclip train: error: {e}", file=sys.stderr, flush=True)
                return 1
            raise
        # (Ctrl-C reaches every rank: the first one says it, as a stop's line is said once)
        note(_interrupted_line(e, cfg.train.run_dir if cfg is not None else None))
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
