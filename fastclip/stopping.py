"""SIGTERM and SIGHUP for the commands that write files (`data embedded|folder`, `export`): they unwind like
Ctrl-C, so what a command half wrote is removed; and a block that must not be cut in two defers all three.

The trainer has its own handling (train/preemption.py): there a signal means "checkpoint at the next step"."""

from __future__ import annotations

import contextlib
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like KeyboardInterrupt (not an Exception: no `except Exception` keeps
    going). `done` says what had been completed when the signal acted, if the command knows."""

    def __init__(self, signum: int, done: str | None = None):
        super().__init__(signum)
        self.signum = signum
        self.done = done

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def _handled(kinds) -> list:
    """The signals of `kinds` this thread may take over: none off the main thread (Python installs handlers there
    only), and never one that is ignored (nohup ignores SIGHUP: the command goes on after a logout)."""
    if threading.current_thread() is not threading.main_thread():
        return []
    return [k for k in kinds if signal.getsignal(k) != signal.SIG_IGN]


@contextlib.contextmanager
def stopped_by_signals(active: bool = True):
    """Inside the block SIGTERM and SIGHUP raise `Stopped`."""
    previous = {kind: signal.signal(kind, _raise_stopped) for kind in (_handled(STOP_SIGNALS) if active else [])}
    try:
        yield
    finally:
        for kind, handler in previous.items():
            signal.signal(kind, handler)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT, SIGTERM and SIGHUP wait until the block is done, then act as they would have at its start."""
    received: list[int] = []
    kinds = _handled((signal.SIGINT, *STOP_SIGNALS))
    previous = {kind: signal.signal(kind, lambda number, frame: received.append(number)) for kind in kinds}
    try:
        yield
    finally:
        for kind, handler in previous.items():
            signal.signal(kind, handler)
        if received:
            signal.raise_signal(received[0])
