"""`fastclip <command> ...`: one entry point, each command lives beside the code it drives."""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import os
import sys
import tempfile
import threading
from pathlib import Path

COMMANDS = {
    "data": ("fastclip.data.cli", "write WebDataset shards with global indices, scan existing shards"),
    "train": ("fastclip.train.cli", "train with a FastCLIP loss or the OpenCLIP baseline (torchrun/SLURM aware)"),
    "eval": ("fastclip.eval.cli", "zero-shot classification and image-text retrieval"),
    "export": ("fastclip.eval.export", "write a model-only checkpoint that open_clip loads"),
    "plot": ("fastclip.eval.plots", "plot metrics of one or several runs"),
    "summary": ("fastclip.eval.summary", "what a run trained, how long, and how well, at a glance"),
    "reshard": ("fastclip.train.reshard", "reshard saved per-sample state to another world size"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr naming the command (the usage is at --help); exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def plural(n: int, word: str) -> str:
    """'1 shard', '2 shards'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def whole_number(text: str, least: int) -> int:
    """An argparse value that must be an integer >= least (ArgumentTypeError: the parser's one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
    return value


def create_error(path: str | os.PathLike) -> tuple[Path, OSError | None]:
    """The nearest place at or above `path` that exists, and the error creating a file there gives (None: no error;
    NotADirectoryError: the place is not a folder). Probed with a real file: permissions alone do not tell (root,
    read-only mounts, /proc)."""
    path = Path(path).absolute()
    place = next(p for p in (path, *path.parents) if os.path.lexists(p))
    if not place.is_dir():
        return place, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
    try:
        with tempfile.NamedTemporaryFile(dir=place, prefix=".fastclip-probe"):
            pass
    except OSError as e:
        return place, e
    return place, None


def unwritable(flag: str, path: str | os.PathLike) -> str | None:
    """Why the file `path` given as `flag` cannot be written (with the folders above it that do not exist yet), in
    one line naming both; None when it can. Checked before the work whose result it would hold."""
    folder, error = create_error(Path(path).absolute().parent)
    if isinstance(error, NotADirectoryError):
        return f"{flag} {path}: {folder} is not a folder; choose another {flag}"
    if error is not None:
        return f"{flag} {path}: cannot write in {folder} ({error.strerror or error}); choose another {flag}"
    return None


EXIT_PIPE = 141  # 128 + SIGPIPE: what `yes | head -1` gives; the reader chose to stop
EXIT_INTERRUPTED = 130  # 128 + SIGINT


def entry() -> None:
    """The process entry (`fastclip ...`, `python -m fastclip ...`, what torchrun and the launch scripts start): the
    process exits when its command ends, so a run's stop signals stay ignored after it (preemption.py)."""
    from fastclip.train.preemption import process_ends_with_run

    process_ends_with_run()
    one_line_warnings()
    sys.exit(main())


def one_line_warnings() -> None:
    """Python prints a warning on two lines (the second the source line that warned): an operator gets one, with
    the warning's file and line at its end (PIL's DecompressionBombWarning for a huge image, a library's notice)."""
    import warnings

    def formatted(message, category, filename, lineno, line=None) -> str:
        said = " ".join(str(message).split())
        return f"fastclip: warning: {category.__name__}: {said} ({Path(filename).name}:{lineno})\n"

    warnings.formatwarning = formatted


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        status = _dispatch(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError as e:
        # `fastclip ... | head`: the reader is gone; stdout goes to /dev/null so the exit flush is quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        training = argv[:1] == ["train"] and not {"-h", "--help", "--print-config"} & set(argv)
        if training:  # a run that stops must say so (`| tee` killed): its stderr may still be read
            print(
                f"fastclip train: stopped: its standard output was closed (the program reading it ended); "
                f"{_what_was_saved(getattr(e, 'run_dir', None))}",
                file=sys.stderr,
                flush=True,
            )
        return EXIT_PIPE
    except KeyboardInterrupt:  # `fastclip train` names its step and checkpoint itself; the others stop here
        print(f"{' '.join(['fastclip', *argv[:1]])}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _what_was_saved(run_dir) -> str:
    """What a stopped run can continue from (it advised --train.resume latest where nothing was saved yet)."""
    if run_dir is None:
        return "continue with --train.resume latest"
    from fastclip.checkpoint import latest_complete

    last = latest_complete(Path(run_dir))
    if last is None:
        return "no checkpoint was written yet: start it again"
    return f"last complete checkpoint: {last} (continue with --train.resume latest)"


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(
            f"fastclip: unknown command {argv[0]!r}; {hint}commands: {', '.join(COMMANDS)} (fastclip --help)",
            file=sys.stderr,
        )
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: fastclip <command> [options]\n\ncommands:\n" + "\n".join(lines))
        return 0
    # `--check` too: launch/slurm.sbatch runs it before the job, and a preemption there must requeue (75) as well
    training = argv[0] == "train" and not {"-h", "--help", "--print-config"} & set(argv)
    if training:
        from fastclip.train.preemption import hold_early

        hold_early()  # before torch is imported: a stop signal while the run starts ends in status 75, not 143
    try:
        module = _import_holding_ctrl_c(COMMANDS[argv[0]][0])
        if module is None:
            print(f"fastclip {argv[0]}: interrupted", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        return int(module.main(argv[1:]) or 0)
    finally:
        if training:
            from fastclip.train.preemption import release_early

            release_early()


def _import_holding_ctrl_c(name: str):
    """The command's module, imported with Ctrl-C held (None: it came meanwhile). A KeyboardInterrupt inside torch's
    or numpy's import leaves them half made: the next import of them failed with a traceback ("cannot load module
    more than once"), or a library's import guard swallowed it and the run went on."""
    import signal

    held: list[int] = []
    # (not in a caller's thread, where no handler can be set, nor where Ctrl-C is ignored: a background job)
    main_thread = threading.current_thread() is threading.main_thread()
    hold = main_thread and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    before = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum)) if hold else None
    try:
        module = importlib.import_module(name)
    finally:
        if hold:
            signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)
    return None if held else module


def launch_rank() -> int:
    """This process's global rank as its launcher set it (torchrun's RANK, srun's SLURM_PROCID), before any process
    group exists; 0 when neither is set or readable."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return int(rank) if rank.isdigit() else 0


def note(line: str) -> None:
    """One line on stderr, from the first process only (every rank parses the same command line)."""
    if launch_rank() == 0:
        print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
