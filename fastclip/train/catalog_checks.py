"""The data catalog, read once for a job, and the checks train makes with it before anything heavy is built:
the data for this world size, the evaluations' inputs, the resume and --model.pretrained (preflight.py checks
what the operator typed). `fastclip train --check` runs them all (check_before_launch) before a launcher starts
the processes.

    read_catalog(cfg)                   the shard list of data.train from its manifests
    shared_catalog(cfg, info)           the same, read by rank 0 and broadcast (with check_eval_inputs)
    check_eval_inputs(cfg)              data.val, data.zeroshot, eval.probe_train and eval.imagenet_val exist
    check_data(cfg, world_size, ...)    sparse indices, a global batch larger than an epoch, upsampling factors
    check_inputs(cfg, world_size, ...)  check_data, the loss, the resume and --model.pretrained
    check_no_empty_shard(catalog)       `--check`: a 0-byte local shard its manifest lists with samples
    check_before_launch(cfg, ...)       `fastclip train --check`: every check above, without a process group
"""

from __future__ import annotations

import os
from pathlib import Path

from fastclip import checkpoint as ckpt
from fastclip.checkpoint import compat
from fastclip.data import DataSpecError
from fastclip.data.catalog import global_batch_too_large
from fastclip.data.stream import shard_weights
from fastclip.distributed import DistInfo
from fastclip.train import net, preflight
from fastclip.train.config import Config, ConfigError, note, scheduled_evaluation
from fastclip.train.engine import check_backend


def read_catalog(cfg: Config):
    """The shard list of data.train from its manifests (ConfigError naming the key if it is wrong)."""
    from fastclip.data import DataSpecError, ManifestError, resolve_catalog
    from fastclip.data.remote import RemoteError

    try:
        return resolve_catalog(cfg.data.train, cfg.data.data_size)
    except (DataSpecError, ManifestError, FileNotFoundError, RemoteError) as e:
        key = "data.data_size" if "data_size" in str(e) and cfg.data.data_size is not None else "data.train"
        raise ConfigError(f"config key '{key}': {e}") from None


def shared_catalog(cfg: Config, info: DistInfo):
    """Rank 0 reads the manifests (and checks local shard files exist, and the evaluations' inputs); the other
    ranks get its catalog, or its one-line error, by one broadcast: a 1,000-rank start does not read every manifest
    and stat every shard 1,000 times over (a shared file system or an object store would feel it)."""
    result = None
    if info.rank == 0:
        try:
            result = read_catalog(cfg)
            check_eval_inputs(cfg)
        except ConfigError as e:
            result = str(e)
    if info.distributed:
        import torch.distributed as dist

        box = [result]
        dist.broadcast_object_list(box, src=0, device=info.device if info.device.type == "cuda" else None)
        result = box[0]
    if isinstance(result, str):
        raise ConfigError(result)
    return result


STATE_BYTES_PER_INDEX = 12  # the least any per-sample loss keeps: u for both modalities and a seen mark, float32


def sparse_indices(data_size: int, num_samples: int, world_size: int) -> str | None:
    """Per-sample state is indexed up to data_size (the largest index + 1): indices far sparser than the samples
    (a mistyped --index-offset) would make each rank allocate for indices no sample has, until memory runs out.
    Said only when that exceeds half this machine's memory."""
    per_rank = -(-data_size // world_size) * STATE_BYTES_PER_INDEX
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    if data_size <= 1000 * max(num_samples, 1) or per_rank <= memory // 2:
        return None
    return (
        f"data_size {data_size:,} (the largest index + 1) for {num_samples:,} samples: the per-sample state of each "
        f"of {world_size} rank(s) would take at least {per_rank / 2**30:,.0f} GiB, this machine has "
        f"{memory / 2**30:,.0f}; number the samples densely (a mistyped --index-offset?)"
    )


def check_knn_fits(cfg: Config, probe_train: Path) -> None:
    """eval.knn's largest k within the probe's training features (eval.probe_max_train, and the samples the probe
    data's manifest lists): found at the first evaluation it stopped the run after training, naming eval's flags."""
    from fastclip.data.format import MANIFEST_NAME
    from fastclip.data.manifest import read_manifest

    if not cfg.eval.knn:
        return
    k, cap = max(cfg.eval.knn), cfg.eval.probe_max_train
    listed = None
    if (probe_train / MANIFEST_NAME).is_file():
        try:
            listed = read_manifest(probe_train).num_samples
        except (ValueError, OSError):  # a bad manifest is the probe's to say, with its file
            listed = None
    available = min(cap, listed) if listed is not None else cap
    if k > available:
        held = f"eval.probe_max_train {cap}" + (f", {listed} samples in {probe_train}" if listed is not None else "")
        raise ConfigError(
            f"config key 'eval.knn': k {k} but the probe has at most {available} training features ({held}): "
            f"use k <= {available}, or more probe training data (eval.probe_train, eval.probe_max_train)"
        )


def check_val_has_labels(val) -> None:
    """ssl scores data.val by kNN over its labels: shards that carry none (images alone, from `fastclip data folder
    --images`) would give no evaluation at all, without a word, after the training. The first shard of each folder
    val's shards sit in is read for its .json and .cls members only (no image is decoded), as check_labels_fit does."""
    from fastclip.data.tario import TarBroken
    from fastclip.eval.samples import is_image_folder

    if is_image_folder(val):  # a folder per class: every image has its folder's label
        return
    firsts = _first_shards(val)
    for shard in firsts:
        try:
            if next(_shard_labels(shard), None) is not None:
                return
        except TarBroken:  # the evaluation says it, skipping the rest of that shard
            return
    raise ConfigError(
        f"config key 'data.val': ssl.enabled scores data.val by kNN over its labels, and the samples of "
        f"{', '.join(str(p) for p in firsts)} have none: give labelled held-out shards (a .cls or json "
        f"'label' per sample), or set data.val null"
    )


def _first_shards(val) -> list[Path]:
    """The first shard of each folder val's shards sit in (a pattern may span folders, each of other data)."""
    from fastclip.eval.samples import shard_paths

    firsts: dict[Path, Path] = {}
    for path in shard_paths(val):
        firsts.setdefault(path.parent, path)
    return list(firsts.values())


def _shard_labels(shard):
    """(key, dataset, label) of a shard's labelled samples, read from its .json and .cls members only (no image is
    decoded); a malformed label is passed over, as the evaluation skips and counts that sample."""
    from fastclip.data.format import label_of, parse_meta
    from fastclip.data.tario import iter_shard

    for raw in iter_shard(shard, want=frozenset({"json", "cls"})):
        meta = parse_meta(raw.files.get("json"))[0] or {}
        try:
            label = label_of(raw.files, meta)
        except ValueError:
            continue
        if label is not None:
            yield raw.key, meta.get("dataset"), label


def check_labels_fit(zeroshot, specs: dict, val) -> None:
    """The labels of val's first shards must be within the class list that scores them, or the first evaluation,
    possibly hours in, stops the run. Each sample's list as fastclip/eval/evaluate.py picks it: one list scores
    every labelled sample (then they must come from one dataset) unless the data's own class-names file names that
    list's dataset among others, where it scores that dataset's and the unnamed samples; several lists score the
    samples of the dataset each names. The first shard of each folder val's shards sit in: read in milliseconds."""
    from fastclip.data.tario import TarBroken
    from fastclip.eval.evaluate import default_zeroshot_file, one_list_for_all
    from fastclip.eval.samples import is_image_folder

    if not specs or is_image_folder(val):
        return
    own = default_zeroshot_file(val)
    for_all = len(specs) == 1 and one_list_for_all(specs, None if own is None or Path(own) == Path(zeroshot) else own)
    named, outside = set(), None
    for shard in _first_shards(val):
        try:
            outside = _labels_outside(shard, specs, for_all, named, zeroshot)
        except TarBroken:  # the evaluation says it, skipping the rest of that shard
            continue
        if outside is not None:
            break
    if outside is not None:
        name, key, label, shard = outside
        n = len(specs[name].classnames)
        listed = f"names {n} class{'' if n == 1 else 'es'}" + (f" for dataset {name!r}" if len(specs) > 1 else "")
        raise ConfigError(
            f"config key 'data.zeroshot': {zeroshot} {listed}, but sample {key} of {shard} (data.val) has label "
            f"{label}; pass the class names of this data"
        )


def _labels_outside(shard, specs: dict, for_all: bool, named: set, zeroshot) -> tuple | None:
    """check_labels_fit over one shard: the first (list, key, label, shard) outside its list, returned after the
    whole shard (a mix of datasets under one list, raised at once, is the first thing to fix); `named` collects the
    dataset names one list would score."""
    outside = None
    for key, dataset, label in _shard_labels(shard):
        if for_all:
            name = next(iter(specs))
            named |= {dataset} - {None}
            if len(named) > 1:
                raise ConfigError(
                    f"config key 'data.zeroshot': {zeroshot} holds one class list ({name!r}), which would score the "
                    f"labelled samples of {len(named)}+ datasets of data.val ({', '.join(sorted(named))}), each "
                    f"against the same classes; pass a file with a list per dataset (as `fastclip data` writes "
                    f"zeroshot.json)"
                )
        elif len(specs) == 1 and dataset is None:
            name = next(iter(specs))
        else:
            name = dataset
        if outside is None and name in specs and not 0 <= label < len(specs[name].classnames):
            outside = (name, key, label, shard)
    return outside


def check_eval_inputs(cfg: Config) -> None:
    """The held-out data, class names and ImageNet folder the scheduled evaluations read: found now, not after the
    training. Rank 0 checks them for a job (shared_catalog)."""
    from fastclip.eval.samples import is_pattern

    for key in ("val", "zeroshot"):
        path = getattr(cfg.data, key)
        evaluating = cfg.data.val is not None and scheduled_evaluation(cfg)
        pattern = key == "val" and is_pattern(path)  # shards by glob or {a..b}: found below
        if path is not None and evaluating and not Path(path).exists() and not pattern:
            raise ConfigError(f"config key 'data.{key}': {path!r} does not exist (set it to null to skip eval)")
        if key == "val" and path is not None and evaluating:  # its shards are found now, not at the first eval
            from fastclip.eval.samples import is_image_folder, shard_paths, shard_subfolders

            try:
                if is_image_folder(path):
                    folders = shard_subfolders(path)
                else:
                    folders = []
                    shard_paths(path)
            except (ValueError, OSError) as e:  # (EvalDataError, and a ManifestError of a bad manifest.json)
                raise ConfigError(f"config key 'data.val': {e} (set it to null to skip eval)") from None
            if folders:  # a data root: its train/ and val/ would be read as two classes without images
                raise ConfigError(
                    f"config key 'data.val': {path}'s subfolders {', '.join(folders)} are shard folders, not one "
                    f"folder of images per class: give the held-out one, e.g. --data.val "
                    f"{Path(path) / ('val' if 'val' in folders else folders[0])}"
                )
        if key == "zeroshot" and evaluating and not cfg.ssl.enabled:  # read now, not after the training
            from fastclip.eval.evaluate import default_zeroshot_file
            from fastclip.eval.spec import load_zeroshot_spec

            path = path or default_zeroshot_file(cfg.data.val)  # null: the zeroshot.json beside data.val
            if path is None:
                continue
            try:
                specs = load_zeroshot_spec(path)
            except (ValueError, OSError) as e:
                raise ConfigError(f"config key 'data.zeroshot': {e}") from None
            check_labels_fit(path, specs, cfg.data.val)
    if cfg.ssl.enabled and cfg.data.val is not None and scheduled_evaluation(cfg):
        check_val_has_labels(cfg.data.val)
    probing = cfg.eval.linear_probe or cfg.eval.knn
    if probing and cfg.data.val is not None and scheduled_evaluation(cfg):
        from fastclip.eval.training_probe import probe_train_beside

        probe_train = cfg.eval.probe_train or probe_train_beside(cfg.data.val)
        if not Path(probe_train).exists():
            said = "" if cfg.eval.probe_train else f" (null: the train/ folder beside data.val, {probe_train})"
            raise ConfigError(
                f"config key 'eval.probe_train': {str(probe_train)!r}{said} does not exist; set it to labelled "
                "training data, or turn eval.linear_probe and eval.knn off"
            )
        check_knn_fits(cfg, Path(probe_train))
    if cfg.eval.imagenet_val is not None and scheduled_evaluation(cfg):
        from fastclip.eval.imagenet import read_variant

        try:
            _, said = read_variant(cfg.eval.imagenet_val)
        except (ValueError, OSError) as e:
            raise ConfigError(f"config key 'eval.imagenet_val': {e} (set it to null to skip it)") from None
        if said:
            note(f"fastclip train: note: eval.imagenet_val {said}")
    elif cfg.eval.imagenet_val is not None:  # given (--imagenet-val) but never read: say so rather than ignore it
        note(
            f"fastclip train: note: eval.imagenet_val {cfg.eval.imagenet_val} is not read: no evaluation is "
            "scheduled (eval.every_steps 0, eval.every_epochs 0, eval.at_end false)"
        )


def check_data(cfg: Config, world_size: int, catalog) -> int:
    """Checks that need the data and the world size, before anything heavy is built; returns data_size.
    catalog: the shards (read_catalog, or rank 0's by shared_catalog)."""
    if problem := sparse_indices(catalog.data_size, catalog.num_samples, world_size):
        raise ConfigError(f"config key '{'data.data_size' if cfg.data.data_size else 'data.train'}': {problem}")
    per_epoch = cfg.data.samples_per_epoch if cfg.data.resampled and cfg.data.samples_per_epoch else catalog.num_samples
    if problem := global_batch_too_large(cfg.data.batch_size, world_size, per_epoch, cfg.data.train):
        raise ConfigError(f"config key 'data.batch_size': {problem}")
    try:
        shard_weights(catalog, cfg.data)
    except DataSpecError as e:
        raise ConfigError(f"config key 'data.upsampling_factors': {e}") from None
    return catalog.data_size


def check_global_batch(cfg: Config, world_size: int, loss_fn) -> None:
    """A global batch with no negative for its anchors (one sample; a queue is still empty at the first step) trains
    nothing or fails in the loss's first call: refused before a tower is built."""
    global_batch = cfg.data.batch_size * world_size
    if global_batch < loss_fn.min_training_batch:
        raise ConfigError(
            f"config key 'data.batch_size': a global batch of {global_batch} sample ({cfg.data.batch_size} x "
            f"{world_size} process(es)) gives {cfg.loss.name}'s anchors no negative: use a global batch of at least "
            f"{loss_fn.min_training_batch}"
        )


def check_inputs(
    cfg: Config, world_size: int, catalog=None, *, rank_files: bool = False
) -> tuple[int, Path | None, dict | None, dict | None]:
    """Everything checkable before a tower is built: the data for this world size, the resume (a foreign file,
    another seed or data) and --model.pretrained. Returns (data_size, resume_dir, its model.pt, pretrained
    tensors); raises ConfigError. `fastclip train --check` runs it before a launcher starts the processes."""
    if catalog is None:  # (a job's ranks have both from rank 0: shared_catalog)
        catalog = read_catalog(cfg)
        check_eval_inputs(cfg)
    data_size = check_data(cfg, world_size, catalog)
    check_backend(cfg, world_size)
    loss_fn = net.check_loss(cfg, data_size)
    check_global_batch(cfg, world_size, loss_fn)
    resume_dir, model_file, pretrained = None, None, None
    if cfg.train.resume:
        resume_dir, model_file = compat.read_resume(cfg.train.resume, Path(cfg.train.run_dir))
    if resume_dir is not None:  # the same model, loss, data, seed, epoch length and backend, or a one-line error now
        expected = preflight.expected_by(cfg, world_size, catalog, data_size, loss_fn)
        compat.check_resume(resume_dir, model_file, expected, rank_files=rank_files)
    elif cfg.model.pretrained:
        pretrained = preflight.read_pretrained(cfg.model.pretrained)
    return data_size, resume_dir, model_file, pretrained


def check_no_empty_shard(catalog) -> None:
    """`--check`: a local shard of 0 bytes that its manifest lists with samples (a copy that failed). Training skips
    its samples (and a rank with nothing else to read stops), so the launchers' check refuses it while it is cheap to
    fix; remote shards are not read here."""
    from fastclip.data.remote import is_remote

    for shard in catalog.shards:
        if shard.num_samples and not is_remote(shard.path) and os.path.getsize(shard.path) == 0:
            raise ConfigError(
                f"config key 'data.train': shard {shard.path} is empty (0 bytes) but its manifest lists "
                f"{shard.num_samples} samples, which training would skip: copy it again, or remove it and rerun "
                f"`fastclip data scan` on its folder"
            )


def check_before_launch(cfg: Config, world_size: int) -> None:
    """`fastclip train --check`: every check train makes before its first step, without a process group or a run
    folder: the operator's input, the data and resume (check_inputs), the run folder's lock, the tower locks and
    whether the resume's or --model.pretrained's weights fit the architecture (built on the meta device: shapes
    only), and, beyond what train refuses, a 0-byte local shard."""
    preflight.check_operator_input(cfg, create=False)  # --check leaves no run folder
    preflight.check_run_dir_free(cfg)
    catalog = read_catalog(cfg)
    check_eval_inputs(cfg)
    check_no_empty_shard(catalog)
    _, resume_dir, model_file, pretrained = check_inputs(cfg, world_size, catalog, rank_files=True)
    locked = cfg.model.lock_image or cfg.model.lock_text  # the locks the towers cannot take: refused here too
    towers = preflight.meta_towers(cfg) if locked or model_file is not None or pretrained is not None else None
    if model_file is not None:
        what = f"checkpoint {resume_dir / ckpt.MODEL_FILE}"
        preflight.check_fits(towers, ckpt.towers_state(model_file), what, "train.resume")
    elif pretrained is not None:
        preflight.fit_pretrained(towers, pretrained, cfg.model.pretrained)
