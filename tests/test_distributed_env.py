"""SLURM / torchrun environment -> rank, world size, local rank, master address (no processes started)."""

import gc
import os
import stat
import weakref

import pytest

from fastclip.distributed import (
    LaunchError,
    dist_env_from,
    frozen_heap,
    parse_slurm_nodelist,
    release_wrappers,
    slurm_master_addr,
)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu-a[1-2],gpu-b3", ["gpu-a1", "gpu-a2", "gpu-b3"]),
        ("c[8-11]", ["c8", "c9", "c10", "c11"]),
        ("rack[1-2]-n[09-10]", ["rack1-n09", "rack1-n10", "rack2-n09", "rack2-n10"]),
        ("a,b[009-010],c", ["a", "b009", "b010", "c"]),
        ("node[7]", ["node7"]),
    ],
)
def test_parse_slurm_nodelist(nodelist, hosts):
    assert parse_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-", "node01]", "node[a-b]", "node[05-03]", ""])
def test_parse_slurm_nodelist_rejects(bad):
    with pytest.raises(ValueError, match="SLURM node list"):
        parse_slurm_nodelist(bad)


def test_slurm_env_maps_to_ranks_and_master():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "gpu[07-08],cpu1",
    }
    e = dist_env_from(env)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == (
        5,
        8,
        1,
        "gpu07",
        20000 + 123456 % 20000,
        "slurm",
    )
    # explicit MASTER_ADDR / MASTER_PORT win; SLURM_NODELIST is the older name of the same variable
    env2 = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "x[3-4]", "MASTER_PORT": "4242"}
    e2 = dist_env_from(env2)
    assert (e2.master_addr, e2.master_port, e2.local_rank) == ("x3", 4242, 0)
    assert dist_env_from({**env2, "MASTER_ADDR": "10.0.0.9"}).master_addr == "10.0.0.9"


def test_torchrun_env_wins_and_plain_process_is_single():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1234",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NODELIST": "n1",
    }
    e = dist_env_from(env)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == (
        3,
        4,
        1,
        "h",
        1234,
        "torchrun",
    )
    single = dist_env_from({})
    assert (single.rank, single.world_size, single.launcher) == (0, 1, "none")


def test_bad_values_name_the_variable():
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        dist_env_from({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"})
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        dist_env_from({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize(
    "env, words",
    [
        ({"WORLD_SIZE": "2"}, ["WORLD_SIZE=2 is set but RANK is not", "torchrun", "unset"]),
        ({"RANK": "1"}, ["RANK=1 is set but WORLD_SIZE is not"]),
        ({"RANK": "0", "WORLD_SIZE": "two"}, ["WORLD_SIZE='two' is not an integer"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, ["LOCAL_RANK='x' is not an integer"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, ["LOCAL_RANK='-1' must be >= 0"]),
        ({"RANK": "5", "WORLD_SIZE": "2"}, ["RANK=5 is not below WORLD_SIZE=2", "from 0 to 1"]),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "3"}, ["LOCAL_RANK=3 is not below WORLD_SIZE=1"]),
        ({"RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE='0' must be >= 1"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, ["MASTER_PORT='99999' must be from 1 to 65535"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, ["MASTER_PORT='0'"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": " "}, ["MASTER_ADDR is empty"]),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}, ["SLURM_PROCID=2", "SLURM_NTASKS=2"]),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-"}, ["SLURM_JOB_NODELIST", "ADDR"]),
        (
            {"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]", "WORLD_SIZE": "4"},
            ["WORLD_SIZE=4 disagrees with SLURM_NTASKS=8", "unset WORLD_SIZE"],
        ),
        (
            {"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]", "RANK": "0"},
            ["RANK=0 disagrees with SLURM_PROCID=1"],
        ),
    ],
)
def test_a_launch_environment_that_describes_no_job_is_refused_naming_the_variable(env, words):
    with pytest.raises(LaunchError) as info:
        dist_env_from(env)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_variables_that_describe_this_one_process_are_accepted():
    """RANK=0 or WORLD_SIZE=1 alone, and a one-task SLURM step without a node list, are a single process."""
    for env in ({"RANK": "0"}, {"WORLD_SIZE": "1"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}):
        assert dist_env_from(env).world_size == 1, env


def test_an_sbatch_script_that_exports_world_size_or_rank_from_slurm_is_accepted():
    """`export WORLD_SIZE=$SLURM_NTASKS` (or RANK=$SLURM_PROCID) before `srun python ...`: common in sbatch
    templates; SLURM's variables describe the job and the exported copies agree with them."""
    base = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_JOB_NODELIST": "gpu[001-002]"}
    for extra in ({"WORLD_SIZE": "8"}, {"RANK": "3"}):
        env = dist_env_from({**base, **extra})
        assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher) == (
            3,
            8,
            3,
            "gpu001",
            "slurm",
        ), extra


def test_scontrol_fallback(tmp_path, monkeypatch):
    """A node list this parser cannot read goes to `scontrol show hostnames` when scontrol exists."""
    script = tmp_path / "scontrol"
    script.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "weird-host-1\\nweird-host-2\\n"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert slurm_master_addr("weird[x-y]") == "weird-host-1"
    assert slurm_master_addr("n[2-3]") == "n2"  # parsable lists never call scontrol
    # Slurm 22.05's own scontrol expands "n[1-" to "n]": no host is called that (it was taken as the master)
    script.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "n]\\n"\n')
    with pytest.raises(ValueError, match="unbalanced"):
        slurm_master_addr("n[1-")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ValueError):
        slurm_master_addr("weird[x-y]")


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_heap_collects_what_was_made_inside_and_leaves_a_callers_freeze():
    """train()'s collection at its end (release_wrappers) scans only what the run made: a cycle made inside is
    freed, the objects from before are not scanned (gc.get_objects leaves frozen ones out), and on the way out the
    heap is as it was, frozen by the caller or not."""
    before = _Cycle()
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0 and not any(o is before for o in gc.get_objects())
        inside = weakref.ref(_Cycle())
        assert inside() is not None  # only a collection frees a cycle
        release_wrappers()
        assert inside() is None
    assert gc.get_freeze_count() == 0 and any(o is before for o in gc.get_objects())
    gc.freeze()  # a caller's own freeze (a fork server's, say) is not undone
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
