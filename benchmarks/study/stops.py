"""The study's stop signals, light enough to import before anything heavy: `python -m benchmarks.study` takes them
over before torch loads (a stop during its seconds of imports is one line too), and `run`'s loop stops its trainers
on them."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal closed


class Stopped(BaseException):
    """The runner was told to stop (SIGINT, SIGTERM, SIGHUP): its runs checkpoint and resume on the next `run`. A
    BaseException, so that no library's `except Exception` on the way swallows it."""


def raise_stopped(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def handled() -> list:
    """The stop signals to take over: never one that is ignored (nohup and setsid ignore SIGHUP: the study goes on
    after a logout, and its trainers inherit the ignoring)."""
    return [s for s in STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN]


def stopped_line(command: str, name: str) -> str:
    """The line a stop before any run leaves: `run` exits 75 (requeue; nothing started is lost)."""
    before = " before any run started" if command == "run" else ""
    return f"python -m benchmarks.study {command}: stopped by {name}{before}".replace(" :", ":")
