"""Stopping cleanly when the cluster asks: a signal -> a checkpoint on every rank at the step where they agree on it ->
exit status 75, so the requeued job continues with `--train.resume latest`.

Who sends what. launch/slurm.sbatch asks SLURM for SIGUSR1 two minutes before the time limit
(`--signal=USR1@120`, delivered to every task of the job step); SLURM sends SIGTERM when it preempts or
cancels a job (then SIGKILL after KillWait/GraceTime, 30 s by default). `train.stop_signals` lists the
signals that stop training (default SIGUSR1 and SIGTERM; [] keeps Python's defaults).

The handler only records the signal. Every rank must stop at the same step (a checkpoint is a collective),
but the signal reaches the ranks at different moments, or only some of them, so the ranks agree on it:
* train.nonfinite_check host: the request is combined in the all_reduce that NonFiniteGuard.verdict makes every
  step (its tensor of two flags gets a third): the stop follows at the next step. A step whose features were
  refused (non-finite) makes no verdict; the request then rides in the next one.
* device (the default where it applies): no step has a collective or host read of its own, so the ranks agree in
  a tiny all_reduce on logging steps and every train.stop_check_every steps (default 10): the stop follows
  within that many steps. On logging steps alone it could wait train.log_every steps, and 100 steps of the
  recipes can take longer than the 120 s SLURM leaves.

After the stop checkpoint `fastclip train` exits with EXIT_PREEMPTED = 75 on every rank (EX_TEMPFAIL of
sysexits.h: "temporary failure, try again"); launch/slurm.sbatch requeues the job on that status. From then
on the stop signals are ignored: the process is leaving anyway, and srun (--kill-on-bad-exit) signals the
ranks that exit a moment later than the first; dying of that signal would turn status 75 into 143.

A rank started by torchrun also watches its agent (its parent process): an agent killed outright (kill -9, the
OOM killer) forwards no signal and would leave its ranks training on, orphaned. When the parent is gone, the
rank records the stop as if signalled (checked once a second: the stop follows within seconds).
"""

from __future__ import annotations

import os
import signal
import threading

EXIT_PREEMPTED = 75
DEFAULT_SIGNALS = ("SIGUSR1", "SIGTERM")


def stopped_line(step: int, reason: str | None) -> str:
    """The trainer's line after the stop checkpoint (`reason`: this rank's StopSignals.reason(), if it had one)."""
    return (
        f"stopped at step {step} by {reason or 'a signal to another rank'}: checkpoint saved; exit status "
        f"{EXIT_PREEMPTED}, continue with --train.resume latest"
    )


def signal_number(name: str) -> int:
    """ "SIGUSR1" or "USR1" -> its number; ValueError naming the signal if this platform lacks it."""
    full = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    number = getattr(signal, full, None)
    if not isinstance(number, signal.Signals) or full in ("SIGKILL", "SIGSTOP"):
        raise ValueError(f"{name!r} is not a signal that can be caught here")
    return int(number)


_ENDS_WITH_RUN: list[bool] = []  # [True]: this process exits when its run ends (process_ends_with_run)
_EARLY: list[str] = []  # the stop signal received before a run's StopSignals took over, if any
_HELD: dict[int, object] = {}  # the signals hold_early took, with their handlers before


def hold_early(names=DEFAULT_SIGNALS) -> None:
    """From `fastclip train`'s first line: a stop signal is recorded, not fatal, until the run's StopSignals take
    over. Importing torch, reading the config and joining the group take seconds; a preemption then killed the
    job (status 143, no line), and launch/slurm.sbatch requeues on 75 only. `fastclip train` reads early_stop()
    once the config is known."""
    _EARLY.clear()
    if threading.current_thread() is threading.main_thread():
        for name in names:
            number = signal_number(name)
            if signal.getsignal(number) is not signal.SIG_IGN:  # (nohup's, a parent's): left ignored
                _HELD[number] = signal.signal(number, _record_early)


def process_ends_with_run() -> None:
    """Said by the process entry (`python -m fastclip`, what torchrun and the launch scripts start): the process
    exits once its run ends, so a stop signal after the run has nothing left to stop and is ignored, as after a stop.
    A SIGTERM forwarded to a rank in its last second, its run saved and complete, killed it: status 143 and the
    launcher's "continue with --train.resume latest" for a finished run. A caller of train() in a process that goes
    on gets its handlers back instead."""
    _ENDS_WITH_RUN[:] = [True]


def _record_early(signum, frame) -> None:
    if not _EARLY:
        _EARLY.append(signal.Signals(signum).name)


def early_stop() -> str | None:
    """The stop signal received while held, if any."""
    return _EARLY[0] if _EARLY and _HELD else None


def release_early(keep=()) -> None:
    """The held signals not in `keep` (the run's train.stop_signals) back to their handlers before; one a run has
    set since (its StopSignals, or ignored after its stop) is left as it is."""
    kept = {signal_number(k) for k in keep}
    for number in [n for n in _HELD if n not in kept]:
        previous = _HELD.pop(number)
        if signal.getsignal(number) is _record_early:
            signal.signal(number, previous)
    if not _HELD:  # nothing held any more: a signal recorded before is no later run's
        _EARLY.clear()


class StopSignals:
    """Records the first stop signal this process receives; installed for the duration of one training run."""

    def __init__(self, names=DEFAULT_SIGNALS):
        self.numbers = [signal_number(n) for n in names]
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._watch: threading.Event | None = None  # set: the parent watch ends
        self._parent: int | None = None  # the watched parent's pid

    def reason(self) -> str | None:
        """What stopped this process, checked again now: when the agent dies, another rank's watch may see it
        first and the stop is agreed before this one's next poll; its words then still name the agent."""
        if self.received is None and self._parent is not None and os.getppid() != self._parent:
            self.received = f"the loss of its torchrun agent (pid {self._parent} is gone)"
        return self.received

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def install(self, *, watch_parent: bool | None = None) -> StopSignals:
        """watch_parent: stop when the parent process is gone (default: when torchrun started this process; not
        otherwise: a run started with nohup from a shell that then ends must go on)."""
        # signal.signal works only in the main thread; elsewhere (a caller's thread) training runs without it
        if threading.current_thread() is threading.main_thread():
            for number in self.numbers:
                self._previous[number] = signal.signal(number, self._handle)
        if (name := early_stop()) is not None and signal_number(name) in self.numbers:
            self.received = name  # came while the run started: it stops at its first chance
        if watch_parent if watch_parent is not None else "TORCHELASTIC_RUN_ID" in os.environ:
            self._watch = threading.Event()
            parent = self._parent = os.getppid()
            threading.Thread(target=self._watch_parent, args=(parent, self._watch), daemon=True).start()
        return self

    def _watch_parent(self, parent: int, done: threading.Event, every: float = 1.0) -> None:
        while not done.wait(every):
            if os.getppid() != parent:  # reparented: the agent is gone
                self.reason()  # records it, unless a signal came first
                return

    def release(self, *, stopped: bool) -> None:
        """Put the previous handlers back; after a stop, or where the process ends with the run
        (process_ends_with_run), ignore the signals instead (see the module doc)."""
        if self._watch is not None:
            self._watch.set()
        ignore = stopped or bool(_ENDS_WITH_RUN)
        for number, previous in self._previous.items():
            signal.signal(number, signal.SIG_IGN if ignore else previous)
        self._previous.clear()


__all__ = [
    "EXIT_PREEMPTED",
    "DEFAULT_SIGNALS",
    "StopSignals",
    "signal_number",
    "hold_early",
    "early_stop",
    "release_early",
    "process_ends_with_run",
]
