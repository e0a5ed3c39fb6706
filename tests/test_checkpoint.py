"""Checkpoint files: atomic step folders, the latest pointer, keep-last-k, RNG states under weights_only."""

import random
import shutil

import numpy as np
import pytest
import torch

from fastclip import checkpoint as ckpt
from fastclip.checkpoint import layout
from fastclip.distributed import DistInfo

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none", owns_group=False)


def save(root, step, keep_last=2):
    return ckpt.save_checkpoint(
        root,
        step,
        SINGLE,
        model_file={"step": step, "w": torch.full((3,), float(step))},
        rank_file={"rank": 0, "x": torch.arange(step)},
        keep_last=keep_last,
    )


def test_save_latest_and_keep_last(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        path = save(root, step)
        assert path == root / f"step_{step:08d}"
        assert (root / "latest").read_text().strip() == path.name
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000020", "step_00000030"]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    model = ckpt.load_file(root / "step_00000030" / "model.pt")
    assert model["step"] == 30 and torch.equal(model["w"], torch.full((3,), 30.0))
    assert torch.equal(ckpt.load_file(root / "step_00000030" / "rank_0.pt")["x"], torch.arange(30))


def test_crash_leftovers_and_resave_of_same_step(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 5)
    # a crash mid-save leaves a temporary folder: ignored by listing and resume, cleaned by the next save
    (root / ".tmp_step_00000007").mkdir()
    (root / ".tmp_step_00000007" / "rank_0.pt").write_bytes(b"partial")
    assert ckpt.resolve_resume("latest", tmp_path) == root / "step_00000005"
    save(root, 7)
    assert ckpt.load_file(root / "step_00000007" / "rank_0.pt")["rank"] == 0
    save(root, 7)  # the same step again replaces it
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000005", "step_00000007"]


def test_a_kill_during_pruning_leaves_no_step_folder_behind(tmp_path, monkeypatch):
    """(a kill -9 in the middle of deleting step_00000100 once left it without its model.pt: no longer a complete
    checkpoint, it was never pruned again and the run ended with keep_last + 1 folders)"""
    root = tmp_path / "checkpoints"
    save(root, 10)
    save(root, 20)
    real_rmtree = layout.shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        if not path.name.startswith(".pruned_"):
            return real_rmtree(path, ignore_errors=ignore_errors)
        (path / "model.pt").unlink()  # part of the folder is gone, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(layout.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save(root, 30)
    monkeypatch.setattr(layout.shutil, "rmtree", real_rmtree)
    # the half-deleted folder was renamed aside first: it is not a step folder, and latest names the new save
    assert sorted(p.name for p in root.iterdir()) == [
        ".pruned_step_00000010",
        "latest",
        "step_00000020",
        "step_00000030",
    ]
    assert ckpt.resolve_resume("latest", tmp_path) == root / "step_00000030"
    save(root, 40)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000030", "step_00000040"]


def test_an_incomplete_folder_newer_than_the_kept_one_is_left_alone(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 10)
    (root / "step_00000090").mkdir()  # damaged by hand, newer than anything saved: not ours to delete
    (root / "step_00000090" / "notes.txt").write_text("keep")
    save(root, 20)
    save(root, 30)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000020", "step_00000030", "step_00000090"]


@pytest.mark.parametrize("what", ["file", "link"])
def test_a_step_name_taken_by_a_file_stops_the_save_and_says_nothing_was_written(tmp_path, what):
    """(the file used to be moved aside, the checkpoint written, and then an error said nothing of it was kept)"""
    from fastclip.train.errors import CheckpointError

    root = tmp_path / "checkpoints"
    save(root, 5)
    taken = root / "step_00000007"
    if what == "file":
        taken.write_text("notes")
    else:
        taken.symlink_to(root / "step_00000005")
    with pytest.raises(CheckpointError) as e:
        save(root, 7)
    assert str(e.value) == (
        f"rank 0: cannot write checkpoint {taken}: a {what} has its name; nothing was written and {root / 'latest'} "
        "still names step_00000005. Move it away, then restart with --train.resume latest"
    )
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000005", "step_00000007"]
    assert taken.is_symlink() or taken.read_text() == "notes"


def test_a_pointer_write_that_fails_keeps_the_old_file_and_leaves_no_temporary_beside_it(tmp_path):
    from fastclip.checkpoint.files import write_text_atomic

    pointer = tmp_path / "latest"
    write_text_atomic(pointer, "step_00000002")
    write_text_atomic(pointer, "step_00000004")
    assert pointer.read_text() == "step_00000004" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    blocked = tmp_path / "blocked"
    (blocked / "inside").mkdir(parents=True)  # a non-empty folder: the rename onto it fails, as on a broken disk
    with pytest.raises(OSError):
        write_text_atomic(blocked, "step_00000006")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "latest"]


def test_resolve_resume(tmp_path):
    assert ckpt.resolve_resume("latest", tmp_path) is None  # nothing yet: a fresh start
    root = tmp_path / "checkpoints"
    save(root, 3)
    step_dir = root / "step_00000003"
    assert ckpt.resolve_resume("latest", tmp_path) == step_dir
    assert ckpt.resolve_resume(str(step_dir), tmp_path / "elsewhere") == step_dir
    assert ckpt.resolve_resume(str(tmp_path), tmp_path / "elsewhere") == step_dir  # a run folder -> its latest
    with pytest.raises(FileNotFoundError, match="nope .given as train.resume. does not exist"):
        ckpt.resolve_resume(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no model.pt"):
        ckpt.resolve_resume(str(tmp_path / "empty"), tmp_path)
    (root / "latest").write_text("garbage\n")  # not a step folder's name: what to do is said
    with pytest.raises(FileNotFoundError, match="named by .*latest. does not exist: write a step folder's name into"):
        ckpt.resolve_resume("latest", tmp_path)


def test_rng_states_round_trip_through_weights_only(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    state = ckpt.capture_rng_states(torch.device("cpu"))
    path = tmp_path / "rng.pt"
    ckpt.save_file(state, path)
    expected = (random.random(), np.random.standard_normal(3), torch.rand(4))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.restore_rng_states(torch.load(path, weights_only=True), torch.device("cpu"))
    got = (random.random(), np.random.standard_normal(3), torch.rand(4))
    assert got[0] == expected[0]
    assert np.array_equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


def test_model_file_of_another_format_version_is_refused(tmp_path):
    from fastclip.train.errors import CheckpointError

    path = tmp_path / ckpt.MODEL_FILE
    contents = {"format": ckpt.CHECKPOINT_FORMAT, "state_dict": {"w": torch.ones(2)}, "step": 3, "world_size": 1}
    ckpt.save_file(contents, path)
    assert ckpt.saved_step(ckpt.read_model_file(path)) == 3
    ckpt.save_file({**contents, "format": "fastclip-checkpoint/999"}, path)
    with pytest.raises(CheckpointError, match="fastclip-checkpoint/999"):
        ckpt.read_model_file(path)


# ----------------------------------------------------------------------------- the manager over stateful parts
class Counter:
    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, state):
        self.n = int(state["n"])


class Shards(Counter):
    """A per-rank part whose old states are summed at another world size (and who saw them, in which order)."""

    seen: list

    def reshard(self, old_states, rank, world_size):
        self.seen = [int(s["n"]) for s in old_states]
        return {"n": torch.tensor(sum(self.seen))}


def test_the_manager_saves_every_part_added_and_loads_each_as_it_is_added(tmp_path):
    from fastclip.checkpoint.manager import CheckpointManager, SavedCheckpoint
    from fastclip.checkpoint.parts import Record, Value

    class Run:
        step = 5

    run, towers = Run(), torch.nn.Linear(2, 2)
    manager = CheckpointManager(tmp_path, SINGLE, keep_last=2)
    manager.add(shared={"state_dict": towers, "step": Value(run, "step"), "config": Record(lambda: {"a": 1})})
    manager.add(per_rank={"data": Counter(3)})
    step_dir = manager.save(5)
    model_file = ckpt.read_model_file(step_dir / ckpt.MODEL_FILE)
    assert set(model_file) == {"format", "world_size", "state_dict", "step", "config"} and model_file["step"] == 5
    assert set(ckpt.load_file(step_dir / "rank_0.pt")) == {"rank", "world_size", "step", "data"}

    again, towers2, data = Run(), torch.nn.Linear(2, 2), Counter()
    again.step = 0
    resumed = CheckpointManager(tmp_path, SINGLE, keep_last=2, resume=SavedCheckpoint(step_dir, model_file, SINGLE))
    resumed.add(shared={"state_dict": towers2, "step": Value(again, "step")})
    assert again.step == 5 and torch.equal(towers2.weight, towers.weight)
    resumed.add(per_rank={"data": data})
    assert data.n == 3


def test_the_manager_reshards_per_rank_parts_reading_each_old_rank_file_once(tmp_path, monkeypatch):
    """Saved by 3 ranks, resumed by 1: the first per-rank part gets the old states as the files are read; the
    others get theirs, kept on the way, later."""
    from fastclip.checkpoint import layout as checkpoint_layout
    from fastclip.checkpoint.manager import SavedCheckpoint

    step_dir = tmp_path / "step_00000004"
    step_dir.mkdir()
    model_file = {"format": ckpt.CHECKPOINT_FORMAT, "world_size": 3, "step": 4}
    ckpt.save_file(model_file, step_dir / ckpt.MODEL_FILE)
    for r in range(3):
        rank_file = {"rank": r, "world_size": 3, "step": 4, "loss_state": {"n": torch.tensor(r + 1)}}
        ckpt.save_file({**rank_file, "data": {"n": torch.tensor(10 * r)}}, step_dir / f"rank_{r}.pt")
    reads = []
    real = checkpoint_layout.load_file
    monkeypatch.setattr(checkpoint_layout, "load_file", lambda path, **kw: reads.append(path.name) or real(path, **kw))
    saved = SavedCheckpoint(step_dir, model_file, SINGLE)
    loss, data = Shards(), Shards()
    loss.load_state_dict(saved.rank_state("loss_state", loss))
    data.load_state_dict(saved.rank_state("data", data))
    assert (loss.seen, loss.n, data.seen, data.n) == ([1, 2, 3], 6, [0, 10, 20], 30)
    assert reads == ["rank_0.pt", "rank_1.pt", "rank_2.pt"]


def test_an_empty_latest_pointer_resumes_from_the_newest_complete_step_folder(tmp_path, capsys):
    from fastclip.checkpoint import resolve_resume

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        (root / f"step_{step:08d}").mkdir(parents=True)
        for name in ("model.pt", "rank_0.pt"):
            (root / f"step_{step:08d}" / name).write_bytes(b"")
    (root / "latest").write_text("\n")
    assert resolve_resume("latest", tmp_path) == root / "step_00000004"
    assert f"{root / 'latest'} is empty; resuming from the newest step folder" in capsys.readouterr().err


def _complete(root, *steps):
    for step in steps:
        (root / f"step_{step:08d}").mkdir(parents=True)
        for name in ("model.pt", "rank_0.pt"):
            (root / f"step_{step:08d}" / name).write_bytes(b"")


def test_a_latest_pointer_behind_a_complete_newer_step_resumes_from_the_newer(tmp_path, capsys):
    """A stop between a save's rename and the pointer's update leaves `latest` at the step before: resume latest
    took it, losing the newer whole step and mixing branches; it takes the newest complete one saved after the
    pointer, with a note. An incomplete newer folder is not taken; a step folder given by path is taken as given;
    a pointer set back by hand (written after the folders: a rollback) is followed."""
    import os

    from fastclip.checkpoint import resolve_resume

    root = tmp_path / "checkpoints"
    _complete(root, 5, 10)
    (root / "latest").write_text("step_00000010\n")
    os.utime(root / "latest", (1e9, 1e9))  # written before the next save (file times may tie within a tick)
    _complete(root, 12)
    (root / "step_00000014").mkdir()  # cut short: no model.pt
    assert resolve_resume("latest", tmp_path) == root / "step_00000012"
    assert capsys.readouterr().err.strip() == (
        f"fastclip train: note: {root / 'latest'} names step_00000010, but step_00000012 is complete and newer (a stop "
        f"between its save and the pointer's update): resuming from {root / 'step_00000012'}; to resume from "
        f"step_00000010, write its name into {root / 'latest'} again"
    )
    assert resolve_resume(str(root / "step_00000010"), tmp_path) == root / "step_00000010"
    (root / "latest").write_text("step_00000012\n")
    assert resolve_resume("latest", tmp_path) == root / "step_00000012" and not capsys.readouterr().err
    (root / "latest").write_text("step_00000005\n")  # set back by hand, after every save: a rollback, as asked
    assert resolve_resume("latest", tmp_path) == root / "step_00000005" and not capsys.readouterr().err


@pytest.mark.parametrize("pointer", ["step_00000040\n", "\n"])
def test_a_latest_pointer_with_no_step_folder_left_is_an_error_not_a_fresh_start(tmp_path, pointer):
    """(every step folder moved away to free disk: `latest` used to resolve to nothing, the run started over and its
    first save overwrote `latest`)"""
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest").write_text(pointer)
    with pytest.raises(FileNotFoundError) as e:
        ckpt.resolve_resume("latest", tmp_path)
    assert str(e.value).startswith(f"{root / 'latest'} ") and str(e.value).endswith(
        f"and no step folder is left under {root}: restore the step folders, or start a new run in another "
        "--train.run_dir"
    )
    assert ckpt.latest_complete(tmp_path) is None  # (the Ctrl-C line names no checkpoint then)


def test_pruning_after_a_branch_keeps_the_branch_and_drops_the_abandoned_steps(tmp_path, capsys):
    """Resumed from step 20 of {10, 20, 30, 40}, the save at 25 keeps the newest 2 up to it (20, 25); 30 and 40 (the
    abandoned branch) go: they used to count towards keep_last (20 and 25 were deleted) and, with `latest` lost,
    resume took step 40 of the abandoned branch."""
    root = tmp_path / "checkpoints"
    _complete(root, 10, 20, 30, 40)
    save(root, 25, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000020", "step_00000025"]
    # the folder it names is the newest save, not the step the run resumed from (it said "which this run continued
    # from" of step 25)
    assert (
        "deleting step_00000030, step_00000040: after step_00000025, this run's newest, a branch left by resuming"
        in capsys.readouterr().err
    )
    (root / "latest").unlink()
    assert ckpt.resolve_resume("latest", tmp_path) == root / "step_00000025"
    link = root / "resumed"  # a resume may name a link to its step folder: pruning at start-up keeps what it names
    link.symlink_to(root / "step_00000025")
    _complete(root, 30)
    ckpt.prune_checkpoints(root, 1, keep=link)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000025"]
    assert "step_00000030: after step_00000025, this run's newest" in capsys.readouterr().err  # the link's target


def test_the_ctrl_c_line_and_resume_name_the_same_checkpoint(tmp_path, capsys):
    """latest_complete (the line after Ctrl-C) follows resolve_resume's rules, quietly: `latest` naming an incomplete
    folder is no checkpoint to continue from (resume takes that folder and refuses it; the line used to name an older
    one); without `latest`, the newest complete one."""
    root = tmp_path / "checkpoints"
    _complete(root, 2)
    (root / "step_00000004").mkdir()
    (root / "step_00000004" / "model.pt").write_bytes(b"")
    (root / "latest").write_text("step_00000004\n")
    assert ckpt.resolve_resume("latest", tmp_path) == root / "step_00000004" and ckpt.latest_complete(tmp_path) is None
    (root / "latest").unlink()
    assert ckpt.latest_complete(tmp_path) == root / "step_00000002" and capsys.readouterr().err == ""


def test_a_resume_from_a_folder_without_every_saved_rank_file_is_refused_before_start_up(tmp_path):
    """model.pt says 3 ranks saved; rank_2.pt is missing: one line naming it (it used to pass, and rank 2 alone
    stopped after start-up)."""
    from fastclip.checkpoint.compat import read_resume
    from fastclip.errors import ConfigError

    step_dir = tmp_path / "checkpoints" / "step_00000004"
    step_dir.mkdir(parents=True)
    config = {"model": {"arch": "tiny"}}
    torch.save({"format": ckpt.CHECKPOINT_FORMAT, "world_size": 3, "step": 4, "config": config}, step_dir / "model.pt")
    for rank in (0, 1):
        torch.save({"rank": rank}, step_dir / f"rank_{rank}.pt")
    with pytest.raises(ConfigError) as e:
        read_resume("latest", tmp_path)
    assert str(e.value) == (
        f"config key 'train.resume': {step_dir / 'rank_2.pt'} is missing, and the checkpoint was saved by 3 ranks; "
        f"restore it, or resume from another step folder (`fastclip train --train.resume {step_dir.parent}/step_...`)"
    )
    torch.save({"rank": 2}, step_dir / "rank_2.pt")
    assert read_resume("latest", tmp_path)[0] == step_dir


def test_the_checkpoint_folder_helpers_take_odd_names_and_bytes(tmp_path):
    """A rank file named with a non-ASCII digit is not a rank's; a pointer of undecodable bytes is read, replaced."""
    (tmp_path / "rank_\u00b2.pt").write_bytes(b"")
    (tmp_path / "rank_1.pt").write_bytes(b"")
    assert list(ckpt.rank_files_in(tmp_path)) == [1]
    (tmp_path / "latest").write_bytes(b"step_\xff\n")
    assert ckpt.read_pointer(tmp_path) == "step_\ufffd"
    assert ckpt.describe_checkpoint({"state_dict": {}, 1: 2, "a": 3}).startswith("a checkpoint with a state_dict")


def expected(**changes):
    from fastclip.checkpoint.compat import Expected

    data = {"seed": 0, "resampled": False, "epoch_length": 64, "fingerprint": "abc"}
    run = dict(arch="tiny", loss="fastclip-v3", backend="ddp", zero_stage=None, world_size=2, batch_size=8)
    run |= dict(batch_change_ok=False, max_steps=None, data_size=64, data=data, data_keys={"seed": "train.seed"})
    return Expected(**(run | changes))


def saved_run(root, *, backend="ddp", stage=None, world_size=2, data=None):
    """A step folder as the trainer writes it, with only what the resume checks read."""
    step_dir = root / "step_00000004"
    step_dir.mkdir(parents=True)
    config = {"model": {"arch": "tiny"}, "loss": {"name": "fastclip-v3"}, "train": {"distributed": backend}}
    optimizer = {"backend": "deepspeed", "stage": stage, "temperature": None} if backend == "deepspeed" else {}
    model_file = {"format": ckpt.CHECKPOINT_FORMAT, "world_size": world_size, "step": 4, "config": config}
    model_file |= {"optimizer": optimizer}
    data = {"seed": 0, "resampled": False, "epoch_length": 64, "fingerprint": "abc", "layout": {"batch_size": 8}}
    for rank in range(world_size):
        ckpt.save_file({"rank": rank, "data": data, "loss_state": {}}, step_dir / f"rank_{rank}.pt")
    if backend == "deepspeed":  # DeepSpeed's file names, each a torch.save zip
        (step_dir / ckpt.DEEPSPEED_TAG).mkdir()
        names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)]
        names += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)] if stage == 3 else []
        for name in names + ["mp_rank_00_model_states.pt"] * (stage != 3):
            torch.save({}, step_dir / ckpt.DEEPSPEED_TAG / name)
    return step_dir, model_file


@pytest.mark.parametrize(
    "saved,changes,said",
    [
        (dict(), dict(arch="other"), "config key 'model.arch': 'other' but checkpoint"),
        (dict(), dict(data={"seed": 3, "resampled": False, "epoch_length": 64, "fingerprint": "abc"}), "train.seed"),
        (dict(), dict(batch_size=16), "config key 'data.batch_size': 16 but checkpoint"),
        (dict(), dict(max_steps=2), "config key 'train.max_steps': 2 is below step 4"),
        (dict(backend="deepspeed", stage=2), dict(), "config key 'train.distributed': ddp, but checkpoint"),
        (dict(), dict(backend="deepspeed", zero_stage=2), "train.distributed': deepspeed, but checkpoint"),
        (dict(backend="deepspeed", stage=2), dict(backend="deepspeed", zero_stage=3), "deepspeed.stage': 3"),
        (dict(backend="deepspeed", stage=2), dict(backend="deepspeed", zero_stage=1, world_size=4), "ZeRO shards"),
    ],
)
def test_every_resume_check_runs_before_anything_is_built_in_one_line(tmp_path, saved, changes, said):
    from fastclip.checkpoint.compat import check_resume
    from fastclip.errors import ConfigError

    step_dir, model_file = saved_run(tmp_path, **saved)
    check_resume(step_dir, model_file, expected(backend=saved.get("backend", "ddp"), zero_stage=saved.get("stage")))
    with pytest.raises(ConfigError, match=said) as e:
        check_resume(step_dir, model_file, expected(**changes))
    assert "\n" not in str(e.value)


def test_a_checkpoint_from_before_the_state_shape_checks_still_resumes(tmp_path):
    """A model.pt without optim.optimizer in its config, a "loss" part or the optimizer's param groups (older
    checkpoints) is not refused for lack of them; with them, a loss of other shape is."""
    from fastclip.checkpoint.compat import check_resume
    from fastclip.errors import ConfigError

    step_dir, model_file = saved_run(tmp_path)
    shaped = dict(optimizer="adamw", loss_parameters={"logit_scale": ()}, loss_trainable=1)
    check_resume(step_dir, model_file, expected(**shaped))
    model_file["loss"] = {"logit_scale": torch.zeros(2)}
    with pytest.raises(ConfigError, match="loss parameter 'logit_scale' of shape \\[2\\], this loss has shape \\[\\]"):
        check_resume(step_dir, model_file, expected(**shaped))
    model_file["loss"] = {"logit_scale": torch.zeros(())}
    model_file["optimizer"] = {"state": {}, "param_groups": [{"name": "decay", "params": [0, 1]}]}
    with pytest.raises(ConfigError, match="optimizer state for 0 learned loss parameters, this loss has 1 learned"):
        check_resume(step_dir, model_file, expected(**shaped))


def test_the_data_layer_names_what_a_saved_position_depends_on_once():
    from fastclip.data.stream import IDENTITY, identity_mismatches

    state = {"seed": 0, "resampled": True, "epoch_length": 10, "fingerprint": "abc", "rank": 1}
    assert identity_mismatches(state, state) == []
    assert identity_mismatches(state, state | {"seed": 1, "fingerprint": "x"}) == ["seed", "fingerprint"]
    assert set(IDENTITY) == {"seed", "resampled", "epoch_length", "fingerprint"}


def test_a_rank_whose_folder_rank_0_removed_goes_on_to_the_barrier_that_names_the_failed_save(tmp_path, monkeypatch):
    """Rank 0's part of a save fails and it removes the temporary folder while rank 1 still writes into it (seen
    under load): rank 1 must not blame a file of its own ("No such file") but reach the next barrier, whose
    failure names the save (test_operator_errors checks those words end to end)."""
    from fastclip.checkpoint import save

    class RankZeroGone(RuntimeError):
        pass

    barriers = []

    def barrier(info):  # the first barrier passes; rank 0 then removes the folder; the next one fails
        barriers.append(info.rank)
        if len(barriers) == 1:
            return
        raise RankZeroGone("rank 0 is gone")

    real_save_file = save.save_file

    def save_file(obj, path, durable=True):
        shutil.rmtree(path.parent)  # rank 0 gave up first
        real_save_file(obj, path, durable=durable)

    monkeypatch.setattr(save, "barrier", barrier)
    monkeypatch.setattr(save, "save_file", save_file)
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / ".tmp_step_00000004").mkdir()  # made by rank 0
    rank1 = DistInfo(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), launcher="none", owns_group=False)
    with pytest.raises(RankZeroGone):
        ckpt.save_checkpoint(root, 4, rank1, model_file=None, rank_file={"x": torch.ones(2)}, keep_last=2)
    assert barriers == [1, 1]


def test_the_ctrl_c_line_says_when_latest_names_nothing_usable(tmp_path):
    from fastclip.train.cli import _interrupted_line

    error = KeyboardInterrupt()
    error.at_step = 7
    assert _interrupted_line(error, tmp_path) == "fastclip train: interrupted at step 7; no checkpoint yet"
    root = tmp_path / "checkpoints"
    _complete(root, 4)
    assert _interrupted_line(error, tmp_path) == (
        f"fastclip train: interrupted at step 7; last complete checkpoint: {root / 'step_00000004'} (continue with "
        "--train.resume latest)"
    )
    shutil.rmtree(root / "step_00000004")
    (root / "latest").write_text("step_00000004\n")  # every step folder moved away: resume refuses, and the line says
    assert _interrupted_line(error, tmp_path) == (
        f"fastclip train: interrupted at step 7; {root / 'latest'} names no usable step folder"
    )


@pytest.mark.parametrize(
    "name, options",
    [
        ("openclip", {}),
        ("fastclip-v0", {}),
        ("fastclip-v2", {}),
        ("fastclip-v3", {"separate_temperatures": True}),
        ("fastclip-tempnet", {"tempnet_hidden": 8, "embed_dim": 16}),
        ("siglip", {}),
        ("dcl", {"queue_size": 64}),
    ],
)
def test_a_resume_reads_the_loss_parameter_shapes_without_building_per_sample_state(name, options):
    """The resume's check compares the loss's parameters with the checkpoint's by the names and shapes state_dict()
    gives, but must not call it: that builds the whole per-sample state (78 bytes a sample for v2: a v2 run on 2B
    samples would need ~156 GB in `--check`)."""
    from fastclip.checkpoint.parts import LossParameters
    from fastclip.losses import build_loss

    small = build_loss(name, data_size=10, **options)
    saved = {k: tuple(v.shape) for k, v in LossParameters(small).state_dict().items()}
    assert LossParameters.shapes(build_loss(name, data_size=10, **options)) == saved
    big = build_loss(name, data_size=10**6, **options)  # (small enough that a regression fails, not swaps)
    LossParameters.shapes(big)
    assert getattr(big, "_state", None) is None


def test_under_deepspeed_a_loss_whose_temperature_trains_otherwise_is_refused(tmp_path):
    from fastclip.checkpoint.compat import check_resume
    from fastclip.errors import ConfigError

    step_dir, model_file = saved_run(tmp_path, backend="deepspeed", stage=2)  # its "temperature": None (fixed τ)
    ds = dict(backend="deepspeed", zero_stage=2)
    check_resume(step_dir, model_file, expected(**ds, loss_trainable=0))
    with pytest.raises(ConfigError, match="optimizer state for 0 learned loss parameters, this loss has 1 learned"):
        check_resume(step_dir, model_file, expected(**ds, loss_trainable=1))
    model_file["optimizer"]["temperature"] = {"state": {}, "param_groups": [{"name": "temperature", "params": [0]}]}
    check_resume(step_dir, model_file, expected(**ds, loss_trainable=1))
