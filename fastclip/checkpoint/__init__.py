"""Checkpoints: one folder per step, written atomically, a `latest` pointer, the last k kept.

    <run_dir>/checkpoints/
        step_00001000/model.pt      rank 0: "format", "world_size" and one key per shared part (the trainer's:
                                    towers "state_dict", loss parameters, optimizer, scaler, step, epoch,
                                    samples_seen, resolved config, schedules, arch, model config, guards, ...)
        step_00001000/rank_<r>.pt   rank r: "rank", "world_size", "step" and one key per per-rank part (its shard
                                    of the per-sample state "loss_state", its data-stream position "data", its
                                    RNG states "rng")
        latest                      text naming the newest complete step folder; written last

Every file holds only tensors and primitives, so torch.load(weights_only=True) reads it: RNG states are stored as
tensors and lists, not pickled objects. Loading is always weights_only: a file that carries pickled objects (code
that would run on load) is refused with a CheckpointError naming it.

    files.py     atomic writes, fsync, the weights_only loader
    layout.py    names, `latest`, complete step folders, the folder a resume continues from, pruning
    save.py      the collective write of one step folder
    records.py   reading a model.pt (the accessors eval, export and the resume checks use; what a file is)
    rng.py       the RNG states as tensors
    manager.py   the manager: a run's stateful parts by name, saved and loaded (resharded at another world size)
    parts.py     parts for what has no state_dict of its own: values, records, RNG, the loss, the data position
    compat.py    whether a checkpoint can resume this run: every part's check, before anything is built

Nothing here imports fastclip.train: the trainer, `fastclip eval` and `fastclip export` all read checkpoints
through this package.
"""

from fastclip.checkpoint.files import (
    fsync_dir,
    load_file,
    save_file,
    tensor_bytes,
    write_text_atomic,
)
from fastclip.checkpoint.layout import (
    CHECKPOINT_FORMAT,
    CHECKPOINTS,
    DEEPSPEED_TAG,
    LATEST,
    MODEL_FILE,
    RANK_FILES,
    STEP_DIR,
    complete_steps,
    find_model_file,
    is_complete,
    iter_rank_files,
    latest_complete,
    list_checkpoints,
    prune_checkpoints,
    rank_file_name,
    rank_files_in,
    read_pointer,
    resolve_resume,
    step_dir_name,
)
from fastclip.checkpoint.manager import CheckpointManager, SavedCheckpoint, Stateful
from fastclip.checkpoint.records import (
    BARE_STATE_DICT,
    RANK_FILE,
    WEIGHTS,
    architecture,
    check_format,
    describe_checkpoint,
    fitted_to,
    image_tower_state,
    is_ssl_checkpoint,
    is_training_checkpoint,
    loss_logit_bias,
    loss_logit_scale,
    loss_parameters,
    read_model_file,
    saved_backend,
    saved_config,
    saved_step,
    saved_world_size,
    shape_mismatches,
    strip_module_prefix,
    towers_state,
)
from fastclip.checkpoint.rng import capture_rng_states, restore_rng_states
from fastclip.checkpoint.save import save_checkpoint
from fastclip.errors import CheckpointError, CheckpointFileMissing

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINTS",
    "RANK_FILES",
    "DEEPSPEED_TAG",
    "LATEST",
    "MODEL_FILE",
    "STEP_DIR",
    "BARE_STATE_DICT",
    "RANK_FILE",
    "WEIGHTS",
    "CheckpointError",
    "CheckpointManager",
    "SavedCheckpoint",
    "Stateful",
    "CheckpointFileMissing",
    "architecture",
    "capture_rng_states",
    "check_format",
    "complete_steps",
    "describe_checkpoint",
    "find_model_file",
    "fsync_dir",
    "image_tower_state",
    "is_complete",
    "is_ssl_checkpoint",
    "is_training_checkpoint",
    "iter_rank_files",
    "latest_complete",
    "list_checkpoints",
    "load_file",
    "fitted_to",
    "loss_logit_bias",
    "loss_logit_scale",
    "loss_parameters",
    "prune_checkpoints",
    "rank_file_name",
    "rank_files_in",
    "read_model_file",
    "read_pointer",
    "resolve_resume",
    "restore_rng_states",
    "save_checkpoint",
    "save_file",
    "saved_backend",
    "saved_config",
    "saved_step",
    "saved_world_size",
    "shape_mismatches",
    "step_dir_name",
    "strip_module_prefix",
    "tensor_bytes",
    "towers_state",
    "write_text_atomic",
]
