"""`fastclip` command processes forked from one that has imported torch, open_clip and the trainer once.

Each `python -m fastclip train` spends 7-10 s of CPU importing before its first line of work, and the suite starts
dozens of them (helpers.Job: every rank of every job). A process forked from this one starts with those imports
done and then does what `python -m fastclip ARGS` does: its own process group, environment, working directory and
output file, `fastclip.cli.main(ARGS)`, and the interpreter's normal exit with its status. The parent (the test)
sees real processes: real pids to signal, real process groups to kill; their exit statuses come back through a
pipe, since only this server, their parent, can wait for them.

Protocol, one JSON object per line. Request (test -> server): {"argv", "env", "cwd", "log", "pgid"} (pgid 0: a new
group led by the process). Replies (server -> test): {"started": pid} for each request, in order, and
{"exited": pid, "code": n} (negative: the signal that ended it) whenever a child ends.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys


def _child(request: dict, fds: tuple[int, ...]) -> None:
    """In the forked process: become `python -m fastclip ARGV` and exit as it would (never returns)."""
    try:
        os.setpgid(0, request["pgid"])
        for fd in fds:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)  # made empty by the test, as Popen's is
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import fastclip
        from fastclip.cli import main

        sys.argv = [os.path.join(os.path.dirname(fastclip.__file__), "__main__.py"), *request["argv"]]  # as -m sets it
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except BaseException:  # noqa: BLE001 - nothing here may return into the server's loop
        os._exit(127)
    sys.exit(main(request["argv"]))  # unwinds through serve(): the interpreter exits as `python -m fastclip` does


def serve(requests: int, replies: int) -> None:
    import torch.distributed  # noqa: F401

    import fastclip.cli  # noqa: F401
    import fastclip.train.trainer  # noqa: F401
    from fastclip.compat import import_open_clip

    import_open_clip()
    pending = b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.02)
        if ready:
            chunk = os.read(requests, 1 << 16)
            if not chunk:  # the test process is gone
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, (requests, replies))
                try:  # also here, so that the group exists before the next request joins it
                    os.setpgid(pid, request["pgid"] or pid)
                except OSError:
                    pass  # the child already did it, or has already exited
                os.write(replies, (json.dumps({"started": pid}) + "\n").encode())
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            os.write(replies, (json.dumps({"exited": pid, "code": code}) + "\n").encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
