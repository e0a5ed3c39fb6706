"""Who am I in the job: rank, world size, local rank and master address from torchrun or SLURM.

Three ways to start `fastclip train`, told apart by the environment:
  torchrun / torch.distributed.run   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are set
  srun (SLURM)                       SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST
  plain python                       none of these: one process, no process group
torchrun's variables win when both are present (torchrun inside an allocation). For SLURM the master is the
first host of the job's node list (parsed here, `scontrol show hostnames` as a fallback) and the port is
MASTER_PORT or derived from the job id, so every task computes the same address without talking.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastclip.errors import CollectiveFailure

# the rendezvous of a single process, and of a torchrun job that leaves MASTER_ADDR/MASTER_PORT unset
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    launcher: str = "none"  # "torchrun" | "slurm" | "none"


# ----------------------------------------------------------------------------- SLURM node lists
def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: "a[1-2,5],b3" -> ["a[1-2,5]", "b3"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM node list {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range_list(body: str, nodelist: str) -> list[str]:
    """ "01-03,07" -> ["01", "02", "03", "07"]; zero padding follows the width of the range's start."""
    out = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise ValueError(f"bad range {item!r} in SLURM node list {nodelist!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in SLURM node list {nodelist!r}")
        out.extend(f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1))
    return out


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list: "node[01-03,07],gpu5" -> [node01, node02, node03, node07, gpu5].

    A host may carry several bracket groups ("r[1-2]-n[1-2]"), expanded as their product in SLURM's order.
    """
    hosts: list[str] = []
    for pattern in _split_top_level(nodelist.strip()):
        expanded = [""]
        for literal, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", pattern):
            if not literal and not body:
                continue
            choices = _expand_range_list(body, nodelist) if body else [""]
            expanded = [prefix + literal + c for prefix in expanded for c in choices]
        hosts.extend(expanded)
    if not hosts:
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    return hosts


def _scontrol_hostnames(nodelist: str) -> list[str]:
    exe = shutil.which("scontrol")
    if exe is None:
        return []
    out = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    return out.stdout.split() if out.returncode == 0 else []


def slurm_master_addr(nodelist: str) -> str:
    try:
        return parse_slurm_nodelist(nodelist)[0]
    except ValueError:
        hosts = _scontrol_hostnames(nodelist)
        # (Slurm 22.05's scontrol expands a malformed list too: "n[1-" to "n]", which no host is called)
        if not hosts or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", hosts[0]):
            raise
        return hosts[0]


# ----------------------------------------------------------------------------- environment -> ranks
class LaunchError(ValueError):
    """The launcher's environment is wrong (a variable missing, not a number, out of range); the message names
    the variable and what to do. `fastclip train` prints it as one line and exits 2, like a ConfigError."""


_RESTART = "start with torchrun (or srun), or unset it"
_SET_BY_LAUNCHER = " (a launcher sets it: torchrun RANK/WORLD_SIZE, srun SLURM_*): start with one, or fix or unset it"


def _int_env(env, key: str, *, low: int = 0, high: int | None = None, what: str = "") -> int:
    text = env[key]
    try:
        value = int(text)
    except ValueError:
        raise LaunchError(f"environment variable {key}={text!r} is not an integer{what}") from None
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise LaunchError(f"environment variable {key}={text!r} must be {bound}{what}")
    return value


def _port(env, key: str = "MASTER_PORT") -> int:
    return _int_env(env, key, low=1, high=65535, what=": set it to a free TCP port, the same on every process")


def _ranks(env, rank_key: str, size_key: str, local_key: str) -> tuple[int, int, int]:
    world = _int_env(env, size_key, low=1, what=_SET_BY_LAUNCHER)
    rank = _int_env(env, rank_key, what=_SET_BY_LAUNCHER)
    if rank >= world:
        raise LaunchError(
            f"environment variable {rank_key}={rank} is not below {size_key}={world}: ranks run from 0 to "
            f"{world - 1}; start the processes with torchrun (or srun), which numbers them"
        )
    local = _int_env(env, local_key, what=_SET_BY_LAUNCHER) if local_key in env else 0
    if local >= world:  # a node runs at most the job's processes: a leftover or hand-set value (it picks the GPU)
        raise LaunchError(
            f"environment variable {local_key}={local} is not below {size_key}={world}: a process's rank on its node "
            f"runs from 0 to {world - 1}; start the processes with torchrun (or srun), which numbers them"
        )
    return rank, world, local


def _master_addr(env) -> str | None:
    if "MASTER_ADDR" not in env:
        return None
    addr = env["MASTER_ADDR"].strip()
    if not addr:
        raise LaunchError("environment variable MASTER_ADDR is empty: set it to the host of rank 0, or unset it")
    return addr


def dist_env_from(env=None) -> DistEnv:
    """Read rank/world/local rank/master from an environment mapping (os.environ by default).

    Raises LaunchError naming the variable when the environment cannot describe a job: a lone RANK or
    WORLD_SIZE that implies other processes, a value that is not a number or out of range, a SLURM job
    without its node list.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun_env(env)
    slurm = "SLURM_PROCID" in env and "SLURM_NTASKS" in env
    if not slurm:
        _refuse_half_pair(env)
        return DistEnv()
    return _slurm_env(env)


def _torchrun_env(env) -> DistEnv:
    rank, world, local = _ranks(env, "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local,
        master_addr=_master_addr(env) or DEFAULT_MASTER_ADDR,
        master_port=_port(env) if "MASTER_PORT" in env else DEFAULT_MASTER_PORT,
        launcher="torchrun",
    )


def _refuse_half_pair(env) -> None:
    """One of RANK and WORLD_SIZE without the other, outside SLURM: a hand-set or half-cleared environment; training
    alone would silently give a different job than the one asked for (RANK=0 or WORLD_SIZE=1 alone describe this
    process)."""
    if "WORLD_SIZE" in env and _int_env(env, "WORLD_SIZE", low=1, what=_SET_BY_LAUNCHER) > 1:
        raise LaunchError(f"environment variable WORLD_SIZE={env['WORLD_SIZE']} is set but RANK is not: {_RESTART}")
    if "RANK" in env and _int_env(env, "RANK", what=_SET_BY_LAUNCHER) > 0:
        raise LaunchError(f"environment variable RANK={env['RANK']} is set but WORLD_SIZE is not: {_RESTART}")


def _slurm_env(env) -> DistEnv:
    rank, world, local = _ranks(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    # sbatch scripts often export WORLD_SIZE=$SLURM_NTASKS (or RANK=$SLURM_PROCID) for other tools: fine when
    # they agree with SLURM's, which is what the job runs by
    for key, slurm_key, value in (("WORLD_SIZE", "SLURM_NTASKS", world), ("RANK", "SLURM_PROCID", rank)):
        if key in env and _int_env(env, key, what=_SET_BY_LAUNCHER) != value:
            raise LaunchError(
                f"environment variable {key}={env[key]} disagrees with {slurm_key}={value} of this SLURM task: "
                f"unset {key}, or set it from {slurm_key}"
            )
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local,
        master_addr=_slurm_master_addr(env, world) or DEFAULT_MASTER_ADDR,
        master_port=_slurm_master_port(env),
        launcher="slurm",
    )


def _slurm_master_addr(env, world: int) -> str | None:
    """MASTER_ADDR, else (several tasks) the first host of the job's node list."""
    master = _master_addr(env)
    if master is not None or world == 1:
        return master
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError(
            f"SLURM job of {world} tasks without SLURM_JOB_NODELIST and without MASTER_ADDR: cannot find "
            "the master; start the tasks with srun inside the allocation, or set MASTER_ADDR to the host of "
            "task 0"
        )
    key = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    try:
        return slurm_master_addr(nodelist)
    except ValueError as e:
        raise LaunchError(f"environment variable {key}: {e}; set MASTER_ADDR to the host of task 0") from None


def _slurm_master_port(env) -> int:
    if "MASTER_PORT" in env:
        return _port(env)
    if "SLURM_JOB_ID" in env:  # same on every task of the job, different for concurrent jobs on a shared node
        return 20000 + _int_env(env, "SLURM_JOB_ID", what=": set MASTER_PORT instead") % 20000
    return DEFAULT_MASTER_PORT


# ----------------------------------------------------------------------------- process group
_JOIN_NOTE_AFTER_S = 5.0  # a normal start joins well within this: the note speaks only when something is missing


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    launcher: str
    owns_group: bool  # True if init_distributed created the process group (and so destroys it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device is 'cuda' but no CUDA device is available")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if kind == "cpu":
        return torch.device("cpu")
    raise ValueError(f"train.device must be auto, cpu or cuda, got {kind!r}")


def init_distributed(device: str = "auto", backend: str = "auto", timeout_minutes: float = 30.0) -> DistInfo:
    """Join (or create) the default process group; a single process gets no group at all.

    If a group already exists (a test harness or a caller that set one up) it is used as is and left alone.
    """
    if dist.is_available() and dist.is_initialized():
        env = dist_env_from()
        dev = pick_device(device, env.local_rank)
        return DistInfo(dist.get_rank(), dist.get_world_size(), env.local_rank, dev, env.launcher, False)
    env = dist_env_from()
    dev = pick_device(device, env.local_rank)
    if env.world_size == 1:
        return DistInfo(0, 1, 0, dev, env.launcher, False)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    # init_method env:// reads these; for SLURM they were not set by a launcher
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )
    join_process_group(env, backend, timeout_minutes, dev)
    return DistInfo(env.rank, env.world_size, env.local_rank, dev, env.launcher, True)


class JoinAbandoned(Exception):
    """A stop signal (or Ctrl-C) came while this process waited for its peers to join: the wait is given up. Its
    thread stays blocked inside the backend, so the process must end with os._exit (fastclip train does)."""

    def __init__(self, signal_name: str, where: str):
        super().__init__(f"stopped by {signal_name} while waiting for the processes to join at {where}")
        self.signal_name = signal_name


def join_process_group(env: DistEnv, backend: str, timeout_minutes: float, device: torch.device | None = None) -> None:
    """`init_process_group` that says what it waits for and fails in one line.

    A process whose peers never come waits train.dist_timeout_minutes in silence otherwise, then ends in a
    DistStoreError traceback: after a few seconds it prints a note, and a timeout or a network error becomes a
    CollectiveFailure (one line, exit 1) naming the address, the count and what to check; a port another
    program holds is the operator's choice, a LaunchError naming MASTER_PORT (exit 2). The join runs in a thread:
    inside the backend's C++ wait the main thread runs no signal handler, so a stop signal (held by `fastclip
    train`: preemption.early_stop) or Ctrl-C did nothing for up to the timeout; they end the wait (JoinAbandoned).
    """
    where = f"{env.master_addr}:{env.master_port}"
    limit = f"{timeout_minutes:g} min (train.dist_timeout_minutes)"
    note = threading.Timer(
        min(_JOIN_NOTE_AFTER_S, 30 * timeout_minutes),  # seconds: half the timeout at most
        lambda: print(
            f"fastclip train: note: rank {env.rank}: waiting up to {limit} for all {env.world_size} processes "
            f"to join at {where}",
            file=sys.stderr,
            flush=True,
        ),
    )
    note.daemon = True
    note.start()
    try:
        _join_in_thread(env, backend, timeout_minutes, device, where)
    except RuntimeError as e:  # DistStoreError, DistNetworkError, a backend that cannot connect its pairs
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise LaunchError(
                f"environment variable MASTER_PORT={env.master_port}: the port is in use on {env.master_addr} "
                f"(another job, or a process left from an earlier one): choose another MASTER_PORT"
            ) from None
        joined = re.search(r"(\d+)/(\d+) clients joined", text)
        if joined:
            what = f"only {joined.group(1)} of {env.world_size} processes joined at {where} within {limit}"
        elif env.rank != 0:
            what = f"rank {env.rank} could not reach rank 0 at {where} within {limit}"
        else:
            what = f"the processes could not meet at {where} ({text.strip().splitlines()[0][:300]})"
        raise CollectiveFailure(
            f"{what}: check that every node started (all {env.world_size} processes), that MASTER_ADDR and "
            f"MASTER_PORT name the same host and port on all of them and that the port is reachable from every node"
        ) from None
    finally:
        note.cancel()
        note.join()


JOIN_STOP_GRACE_S = 5.0


def _join_in_thread(env: DistEnv, backend: str, timeout_minutes: float, device, where: str) -> None:
    """init_process_group in a thread, this one waiting in short slices so that its signal handlers run."""
    from fastclip.train.preemption import early_stop

    outcome: list[BaseException | None] = []

    def join() -> None:
        try:
            if device is not None and device.type == "cuda":  # the current device is per thread
                torch.cuda.set_device(device)
            dist.init_process_group(
                backend=backend,
                init_method="env://",
                rank=env.rank,
                world_size=env.world_size,
                timeout=datetime.timedelta(minutes=timeout_minutes),
            )
            outcome.append(None)
        except BaseException as e:  # handed to the caller's thread
            outcome.append(e)

    thread = threading.Thread(target=join, name="fastclip-join-group", daemon=True)
    thread.start()
    stop_seen: float | None = None
    try:
        while thread.is_alive():
            thread.join(0.2)
            if stop_seen is None and early_stop() is not None:
                stop_seen = time.monotonic()
            # a grace after the stop: ranks that are all there join and agree on it at the first step (one that
            # joined a moment before its poll would go on while the others left)
            if thread.is_alive() and stop_seen is not None and time.monotonic() - stop_seen > JOIN_STOP_GRACE_S:
                raise JoinAbandoned(early_stop(), where)
    except KeyboardInterrupt:
        thread.join(1.0)  # the signal may end the backend's wait as well (EINTR): then the join failed
        if outcome == [None]:  # joined: an interrupt of the run, said as such
            raise
        raise JoinAbandoned("SIGINT", where) from None
    if outcome and outcome[0] is not None:
        if (name := early_stop()) is not None:  # (a stop signal that broke the backend's wait)
            raise JoinAbandoned(name, where) from None
        raise outcome[0]


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def broadcast_flag(flag: bool, info: DistInfo) -> bool:
    """Rank 0's decision on every rank (for wall-clock triggers that must agree across ranks)."""
    if not info.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=info.device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def release_wrappers() -> None:
    """Free unreachable DistributedDataParallel wrappers now, while their process group still exists.

    A wrapper that outlives its group (freed later, at interpreter exit at the latest) makes gloo abort the
    process now and then: SIGABRT, "terminate called without an active exception" (measured: 5 of 60
    two-process runs; 0 of 60 when the wrapper was dropped and collected first). Dropping references is the
    caller's part (train() clears its error's traceback frames); this collects what only cycles still hold.
    """
    gc.collect()


@contextlib.contextmanager
def frozen_heap():
    """Within: what exists on entry is exempt from garbage collection (gc.freeze), so release_wrappers() scans only
    what was created inside: a run's DDP wrapper and what holds it. A full collection in a process that has imported
    open_clip scans ~380,000 objects (0.4 s of CPU, and in a forked process a copy of every page they touch); a
    caller's own freeze is left as it is."""
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


def destroy_process_group() -> None:
    """`dist.destroy_process_group()` after `release_wrappers()`; a no-op without a group."""
    release_wrappers()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def cleanup(info: DistInfo) -> None:
    """End of `fastclip train`: drop its DDP wrapper; destroy the group only if the trainer created it."""
    if info.owns_group:
        destroy_process_group()
    else:
        release_wrappers()  # the caller's group lives on and may be destroyed without a collection first


__all__ = [
    "DistEnv",
    "DistInfo",
    "LaunchError",
    "parse_slurm_nodelist",
    "slurm_master_addr",
    "dist_env_from",
    "init_distributed",
    "join_process_group",
    "pick_device",
    "barrier",
    "broadcast_flag",
    "cleanup",
    "release_wrappers",
    "frozen_heap",
    "destroy_process_group",
]
