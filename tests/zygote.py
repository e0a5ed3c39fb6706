"""`fastclip` command processes forked from one that has imported torch, open_clip and the trainer once.

Each `python -m fastclip train` spends 7-10 s of CPU importing before its first line of work, and the suite starts
dozens of them (helpers.Job: every rank of every job). A process forked from this one starts with those imports
done and then does what `python -m fastclip ARGS` does: its own process group, environment, working directory and
output file, `fastclip.cli.main(ARGS)`, and the interpreter's normal exit with its status. The parent (the test)
sees real processes: real pids to signal, real process groups to kill; their exit statuses come back through a
pipe, since only this server, their parent, can wait for them (and only it may signal a pid it has not yet reaped
without risking a recycled one: kills go through it too).

What is read once at interpreter start-up (PYTHON*, OMP_*, ... variables) is this server's: helpers.Job starts a
job here only when its environment agrees on those, else as `python -m fastclip`.

Protocol, one JSON object per line, test -> server:
    {"id": n, "cwd": DIR, "ranks": [{"argv": [...], "env": {...}, "log": FILE}, ...]}
        fork every rank before anything is reaped: rank 0 leads a new process group, the others join it
    {"kill": pid, "signal": s}     signal a child that has not exited (else nothing)
server -> test: {"id": n, "pids": [...]} once a job's ranks are forked, {"exited": pid, "code": c} (negative: the
signal that ended it) whenever a child ends.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback


def _child(rank: dict, cwd: str, pgid: int, fds: tuple[int, ...]) -> None:
    """In the forked process: become `python -m fastclip ARGV` and exit as it would (never returns)."""
    try:
        log = os.open(rank["log"], os.O_WRONLY | os.O_APPEND)  # made empty by the test, as Popen's is
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd in fds:
            os.close(fd)
        os.setpgid(0, pgid)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(rank["env"])
        import fastclip
        from fastclip.cli import main

        sys.argv = [os.path.join(os.path.dirname(fastclip.__file__), "__main__.py"), *rank["argv"]]  # as -m sets it
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except BaseException:  # noqa: BLE001 - nothing here may return into the server's loop
        os.write(2, f"zygote: could not start this rank:\n{traceback.format_exc()}".encode())
        os._exit(127)
    sys.exit(main(rank["argv"]))  # unwinds through serve(): the interpreter exits as `python -m fastclip` does


def serve(requests: int, replies: int) -> None:
    import threading

    import forkserver_preload  # noqa: F401 - what run_distributed's processes start with (tests/ is sys.path[0])

    import fastclip.cli  # noqa: F401

    assert threading.active_count() == 1, "a thread at fork time: the children would inherit its locks"

    def say(reply: dict) -> None:
        os.write(replies, (json.dumps(reply) + "\n").encode())

    pending, children = b"", set()
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
                if "kill" in request:
                    if request["kill"] in children:  # not reaped yet: the pid is still this child's
                        os.kill(request["kill"], request["signal"])
                    continue
                pids: list[int] = []
                for rank in request["ranks"]:
                    pgid = pids[0] if pids else 0
                    pid = os.fork()
                    if pid == 0:
                        _child(rank, request["cwd"], pgid, (requests, replies))
                    try:  # here too, so that the group exists before the next rank joins it
                        os.setpgid(pid, pgid or pid)
                    except OSError:
                        pass  # the child did it first
                    children.add(pid)
                    pids.append(pid)
                say({"id": request["id"], "pids": pids})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
