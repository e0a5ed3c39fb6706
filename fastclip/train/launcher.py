"""`python -m fastclip.train.launcher TORCHRUN-ARGS`: torchrun, run in this process, as launch/single_node.sh and
launch/multi_node.sh start it, with what a cluster's signals need of it.

* A stop signal reaches the ranks. SLURM sends SIGTERM to every process of a job (preemption, scancel, the
  time limit), `scancel --signal=USR1` or a `kill` may reach the agent alone. torchrun itself dies of SIGUSR1
  (its ranks, orphaned, train on) and answers SIGTERM by signalling its ranks' process groups, then SIGKILL 30 s
  later, then a traceback. Here SIGTERM, SIGUSR1 and SIGINT are forwarded to each rank (the process alone: its
  data workers leave these signals to it), which checkpoints at the step and exits 75 (train/preemption.py);
  SIGHUP and SIGUSR2 too where the ranks' train.stop_signals name them (read from their command line).
  Before any rank exists there is nothing to save: the agent stops, status 75 for a stop signal.
* The job's status is the ranks': 75 when the ranks that ended stopped with a checkpoint, else the first failed
  rank's status, or 128 + the signal that killed a rank, said in one line (not torchrun's SIGTERM to the others
  once one rank failed: that rank's status is the job's). The ranks print their own one line;
  torchrun's log lines about its workers and its ChildFailedError traceback are not printed.

An agent killed outright (kill -9) cannot forward anything: each rank watches its parent and stops with a
checkpoint when the agent is gone (StopSignals.watch_parent).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
import threading

from fastclip.train.preemption import EXIT_PREEMPTED

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOPS = (signal.SIGTERM, signal.SIGUSR1)  # the trainer's default train.stop_signals: a checkpoint, then 75
# forwarded too where the ranks' train.stop_signals name them (a checkpoint and 75); else torchrun stops the ranks
# with SIGHUP, and SIGUSR2 ends the agent, whose ranks then stop with a checkpoint (StopSignals.watch_parent)
NAMED = (signal.SIGHUP, signal.SIGUSR2)
_forwarded: list[int] = list(FORWARDED)  # this launcher's: FORWARDED and those of NAMED the ranks stop on
_rank_stops: set[int] = set(STOPS)
PREFIX = "fastclip launcher"


def children(parent: int | None = None) -> list[int]:
    """The child processes of `parent` (default: this process, whose children are the ranks), from /proc."""
    me, found = parent or os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it ended while we looked
            continue
        if int(stat.rpartition(")")[2].split()[1]) == me:  # the fields after the command: state, ppid, ...
            found.append(int(entry))
    return found


def _forward(signum, frame) -> None:
    ranks = children()
    if not ranks:  # rendezvous, or the ranks are gone: torchrun's own way out (it stops whatever it started)
        from torch.distributed.elastic.multiprocessing.api import SignalException

        raise SignalException(f"{signal.Signals(signum).name} before the ranks started", sigval=signum)
    for pid in ranks:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _quiet_torchrun_logs() -> None:
    """torchrun's agent logs each worker's failure and its shutdown; the ranks and this module say what matters."""
    agent_log = logging.getLogger("torch.distributed.elastic")
    agent_log.addHandler(logging.NullHandler())
    agent_log.propagate = False


def exit_status(failures: dict) -> tuple[int, str | None]:
    """The job's status from torchrun's failed ranks {rank: ProcessFailure}, and the line to print (None: the
    ranks said it). Once one rank fails, torchrun SIGTERMs the others and SIGKILLs those still there 30 s later:
    a rank that died of SIGTERM while another exited with a status of its own, or of SIGKILL after such an exit
    (a rank stuck in a collective, say), was stopped by torchrun, and the status is the one that failed."""
    exited = [f.timestamp for f in failures.values() if f.exitcode > 0]
    other_signal = any(f.exitcode < 0 and f.exitcode != -signal.SIGTERM for f in failures.values())
    stuck = None  # (rank, failure) of a rank torchrun had to kill
    for rank, failure in sorted(failures.items()):
        if failure.exitcode == -signal.SIGKILL and exited and failure.timestamp > min(exited):
            stuck = stuck or (rank, failure)
            continue
        # (a SIGTERM beside another signal's death: torchrun's too, sent once that rank died)
        if failure.exitcode < 0 and not ((exited or other_signal) and failure.exitcode == -signal.SIGTERM):
            name = failure.signal_name()
            why = " (out of memory, or kill -9)" if failure.exitcode == -signal.SIGKILL else ""
            return 128 - failure.exitcode, (
                f"{PREFIX}: rank {rank} (pid {failure.pid}) was killed by {name}{why}; the other ranks were "
                f"stopped. Continue with --train.resume latest"
            )
    codes = [f.exitcode for _, f in sorted(failures.items()) if f.exitcode > 0]
    status = next((c for c in codes if c != EXIT_PREEMPTED), EXIT_PREEMPTED)
    if stuck is None:
        return status, None
    rank, failure = stuck
    first, ended = min(((r, f) for r, f in failures.items() if f.exitcode > 0), key=lambda rf: rf[1].timestamp)
    return status, (
        f"{PREFIX}: rank {rank} (pid {failure.pid}) did not stop when rank {first} ended with status "
        f"{ended.exitcode} and was killed by torchrun (SIGKILL, 30 s after its SIGTERM: stuck, in a collective "
        f"perhaps); status {status}. Continue with --train.resume latest"
    )


def _take_over_torchruns_handler() -> None:
    """torchrun installs its handler (SIGTERM, SIGINT, SIGHUP, SIGQUIT in every version since 1.9; newer ones read
    --signals-to-handle) when it starts the ranks, by this module-level name: ours answers the forwarded signals,
    torchrun's the others (it stops the ranks with them)."""
    from torch.distributed.elastic.multiprocessing import api

    torchruns = api._terminate_process_handler

    def handler(signum, frame):
        (_forward if signum in _forwarded else torchruns)(signum, frame)

    api._terminate_process_handler = handler
    for kind in _forwarded:
        signal.signal(kind, handler)


def ranks_stop_signals(args) -> set[int]:
    """The signals the ranks stop on with a checkpoint: their train.stop_signals, read from their command line as
    `fastclip train` reads it (STOPS where that is not a fastclip run or its config cannot be read: the ranks say
    why themselves)."""
    script = list(args.training_script_args)
    if not (args.module and args.training_script == "fastclip" and script[:1] == ["train"]):
        return set(STOPS)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        from fastclip.train.cli import read_config
        from fastclip.train.preemption import signal_number

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # the ranks'
            cfg = read_config(script[1:])  # notes, said by them
        return {signal_number(name) for name in cfg.train.stop_signals}
    except SignalException:  # a stop, not a config it cannot read
        raise
    except Exception:
        return set(STOPS)


def _stopped_line(signum: int, when: str) -> tuple[int, str]:
    name, stop = signal.Signals(signum).name, signum in _rank_stops
    then = f"; exit status {EXIT_PREEMPTED}, continue with --train.resume latest" if stop else ""
    return (EXIT_PREEMPTED if stop else 128 + signum), f"{PREFIX}: stopped by {name} {when}{then}"


def main(argv: list[str] | None = None) -> int:
    # importing torch and reading the ranks' command line take a second or two: a signal then is held, not fatal
    # (it died with no line, status 143); NAMED ones too, unless ignored (nohup's SIGHUP stays ignored)
    early: list[int] = []
    ignored = {kind for kind in NAMED if signal.getsignal(kind) is signal.SIG_IGN}
    for kind in FORWARDED + tuple(k for k in NAMED if k not in ignored):
        signal.signal(kind, lambda signum, frame: early.append(signum))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _quiet_torchrun_logs()
    waiting, before = None, set(FORWARDED)  # signals that, raised as SignalException, came before the ranks
    try:  # from here a stop signal before the ranks exist raises SignalException (_forward), said below
        args = parse_args(sys.argv[1:] if argv is None else argv)
        _rank_stops.clear()
        _rank_stops.update(ranks_stop_signals(args))
        _forwarded[:] = [*FORWARDED, *(kind for kind in NAMED if kind in _rank_stops)]
        before.update(_forwarded)
        _take_over_torchruns_handler()  # (the forwarded ones: held until here)
        for kind in (k for k in NAMED if k not in _rank_stops):  # as torchrun leaves them (see NAMED)
            signal.signal(kind, signal.SIG_IGN if kind in ignored else signal.SIG_DFL)
        before.update(early)
        if early:  # held while torch was imported and the command line read
            raise SignalException("held", sigval=signal.Signals(early[0]))
        if problem := rendezvous_port_taken(args):
            print(f"{PREFIX}: error: {problem}", file=sys.stderr, flush=True)
            return 2
        waiting = threading.Timer(WAIT_NOTE_AFTER_S, _say_waiting, args=(args,))
        waiting.daemon = True
        waiting.start()
        run(args)
    except ChildFailedError as e:
        status, line = exit_status(e.failures)
        if line:
            print(line, file=sys.stderr, flush=True)
        return status
    except SignalException as e:
        when = "before the ranks started" if e.sigval in before else "(torchrun stopped the ranks with it)"
        status, line = _stopped_line(e.sigval, when)
        print(line, file=sys.stderr, flush=True)
        return status
    except Exception as e:  # rendezvous and agent errors: torchrun's own
        print(f"{PREFIX}: torchrun failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if waiting is not None:
            waiting.cancel()
    return 0


WAIT_NOTE_AFTER_S = 10.0  # a rendezvous of nodes that all started is done well within this


def _say_waiting(args) -> None:
    """torchrun waits for the other nodes in silence (up to its join timeout, 600 s): said once, if no rank runs."""
    if not children() and not args.standalone:
        print(
            f"{PREFIX}: note: waiting for all {args.nnodes} node(s) to join torchrun's rendezvous at "
            f"{args.rdzv_endpoint} (each node runs launch/multi_node.sh with the same NNODES, MASTER_ADDR, MASTER_PORT "
            f"and RDZV_ID)",
            file=sys.stderr,
            flush=True,
        )


def rendezvous_port_taken(args) -> str | None:
    """Where this node is the rendezvous host and its port is held by another program: torchrun printed C++ stack
    traces for it, then waited. (Not this host, or free: None; torchrun's --standalone picks a free port itself.)"""
    import errno
    import socket

    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        return None
    host = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds: TIME_WAIT is no owner
            probe.bind((host, int(port)))
        return None
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return None  # not this host's address (EADDRNOTAVAIL), or a name that does not resolve here
    if _a_store_answers(host, int(port)):  # another agent of the job on this host holds it: torchrun joins it
        return None
    return (
        f"MASTER_PORT={port}: the port is in use on {host}, this node, by a program that is not a rendezvous store "
        f"(another job's, or one left from an earlier run): choose another MASTER_PORT, the same on every node"
    )


def _a_store_answers(host: str, port: int, within: float = 3.0) -> bool:
    """Whether a c10d store answers at host:port. In a thread: a client of a program that accepts and never answers
    waits past its timeout (measured: over a minute), and is left to wait there."""
    import datetime

    from torch.distributed import TCPStore

    answered: list[bool] = []

    def ask() -> None:
        try:
            TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=within))
            answered.append(True)
        except Exception:  # noqa: BLE001 - refused, closed, timed out, a protocol it does not speak: no store
            answered.append(False)

    asking = threading.Thread(target=ask, name="fastclip-store-probe", daemon=True)
    asking.start()
    asking.join(within + 1.0)
    return bool(answered and answered[0])


if __name__ == "__main__":
    sys.exit(main())
