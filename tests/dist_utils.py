"""Run a function in N real processes joined by a torch.distributed process group (gloo by default).

    from dist_utils import run_distributed

    def work(rank, world_size, scale):          # module-level, so the spawned processes can import it
        t = torch.full((2,), float(rank) * scale)
        torch.distributed.all_reduce(t)
        return t                                 # anything torch.save can write

    results = run_distributed(work, 2, 3.0)      # [result of rank 0, result of rank 1]

Each process gets one CPU thread, a fresh free TCP port is used for the rendezvous, an exception in any
process is re-raised here with its traceback, and the whole run is killed after ``timeout`` seconds (so a
test that would hang in a collective fails instead).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastclip.distributed import destroy_process_group


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def exit_without_finalizing() -> None:
    """End a worker that has written its results and destroyed its group, skipping interpreter finalization.

    What the tests check is done by then. Torch's C++ teardown at exit now and then aborts a gloo process
    ("terminate called without an active exception", no Python frame on the stack), which is not what any
    test here is about; the product's own exit path is exercised by the tests that launch `fastclip train`.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _entry(rank, fn, world_size, port, backend, out_dir, args, timeout):
    faulthandler.enable(all_threads=True)  # a native crash prints each thread's Python stack
    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank_{rank}.pt")
    finally:
        destroy_process_group()
    exit_without_finalizing()


# The processes are forked from a server that has imported torch, open_clip and the trainer once: a spawned process
# spends seconds of CPU importing them, and the suite starts over a hundred (multiprocessing's forkserver: the
# server starts clean, so nothing of the test process is inherited, as with spawn).
PRELOAD = ["forkserver_preload", "dist_utils"]


def _start_method() -> str:
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)
    return "forkserver"


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0) -> list:
    """``[fn(rank, world_size, *args) for each rank]``, each computed in its own process of one group."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned processes
    with tempfile.TemporaryDirectory(prefix="fastclip-dist-") as out_dir:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), backend, out_dir, args, timeout),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(
                    f"run_distributed({fn.__name__}, world_size={world_size}) did not finish "
                    f"within {timeout:.0f}s (a hang in a collective?)"
                )
        return [torch.load(Path(out_dir) / f"rank_{rank}.pt", weights_only=False) for rank in range(world_size)]
