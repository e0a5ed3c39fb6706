"""One pass over a held-out set giving zero-shot accuracy per dataset and image-text retrieval.

Distributed without hangs (OpenCLIP #1121): every rank evaluates its own slice of the samples, zero-shot
counts are all-reduced and retrieval features all-gathered, so every rank returns the same numbers and
no rank waits at a barrier while another evaluates alone. An error on one rank (a label outside its class
list, a failing preprocess or forward) is carried through the same all-reduce and raised on all ranks,
instead of leaving the others blocked; undecodable samples are skipped and counted.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fastclip.data.format import ZEROSHOT_NAME
from fastclip.eval.collectives import all_gather_rows, all_reduce_sum, rank_and_world
from fastclip.eval.probe import LabelledFeatures, encode_image_with_features
from fastclip.eval.records import retrieval_reported
from fastclip.eval.retrieval import retrieval_metrics
from fastclip.eval.samples import (
    EvalDataError,
    EvalSample,
    Skipped,
    held_out_folder,
    is_image_folder,
    iter_samples,
    iter_shard_samples,
)
from fastclip.eval.spec import ZeroShotSpec, load_zeroshot_spec
from fastclip.eval.zeroshot import ZeroShotCounts, ZeroShotResult, mean_top1, zeroshot_classifier

log = logging.getLogger(__name__)


@dataclass
class EvalResults:
    zeroshot: dict[str, ZeroShotResult] = field(default_factory=dict)
    retrieval: dict[str, float] = field(default_factory=dict)
    retrieval_samples: int = 0
    retrieval_distinct_captions: int = 0  # captions with distinct embeddings: templated captions repeat
    retrieval_images: int | None = None  # several captions per image (json "group"): the images; None: pairs
    num_samples: int = 0
    unmatched: int = 0  # labelled samples whose dataset has no class names
    skipped: int = 0  # samples left out: undecodable, or in a broken shard after the break (its manifest's count)
    cut_shards: int = 0  # broken shards whose size no manifest lists: their samples after the break are not counted
    # collect_features: the probe's image features of the labelled samples, per dataset, gathered from every rank
    features: dict[str, LabelledFeatures] = field(default_factory=dict)
    val_loss: float | None = None  # loss_fn given: its value on the captioned samples, in eval mode
    val_loss_samples: int = 0

    def flat(self, per_class: bool = False) -> dict[str, float]:
        """Flat `name -> float`, e.g. `zeroshot/mnist/top1`, `retrieval/image_to_text_R@1` (the trainer logs
        these under `eval/`)."""
        out: dict[str, float] = {}
        for name, result in self.zeroshot.items():
            prefix = f"zeroshot/{name}"
            out[f"{prefix}/top1"] = result.top1
            out[f"{prefix}/top5"] = result.top5
            out[f"{prefix}/mean_per_class_recall"] = result.mean_per_class_recall
            out[f"{prefix}/num_samples"] = float(result.num_samples)
            if per_class:
                out.update({f"{prefix}/class/{c}": a for c, a in result.per_class.items() if a is not None})
        if len(self.zeroshot) > 1:
            out["zeroshot/mean_top1"] = mean_top1(out)
        out.update({f"retrieval/{k}": v for k, v in self.retrieval.items()})
        if self.retrieval:
            out["retrieval/num_samples"] = float(self.retrieval_samples)  # captions
            out["retrieval/distinct_captions"] = float(self.retrieval_distinct_captions)  # (summary's rule)
            if self.retrieval_images is not None:
                out["retrieval/num_images"] = float(self.retrieval_images)
        if self.val_loss is not None:
            out["val_loss"] = self.val_loss
        if self.skipped:
            out["skipped_samples"] = float(self.skipped)
        if self.cut_shards:
            out["cut_shards"] = float(self.cut_shards)
        return out


def unwrap_model(model):
    """The plain CLIP module under DDP (`.module`) or torch.compile (`._orig_mod`): evaluating through the
    DDP wrapper would run its forward hooks, which expect every rank to join a backward."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ == "DataParallel":
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def _batches(samples: Iterator[EvalSample], batch_size: int) -> Iterator[list[EvalSample]]:
    batch = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def _limited(samples: Iterable[EvalSample], limit: int | None) -> Iterator[EvalSample]:
    for i, sample in enumerate(samples):
        if limit is not None and i >= limit:
            return
        yield sample


def _input_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


class _Pass:
    """State of this rank's pass over its slice."""

    def __init__(
        self,
        specs: dict[str, ZeroShotSpec],
        device,
        retrieval: bool,
        one_list_for_all: bool = True,
        collect_features: str | None = None,
    ):
        self.specs = specs
        self.one_list_for_all = one_list_for_all
        self.datasets_scored: set[str] = set()  # named datasets one list scored (a few: it stops at the 2nd)
        self.names = sorted(specs)  # same order on every rank: the packed counts line up
        self.counts = {
            name: ZeroShotCounts(len(specs[name].classnames), device, specs[name].pool) for name in self.names
        }
        self.device = device
        self.retrieval = retrieval
        self.pairs: list[torch.Tensor] = []  # [n, 2d] image|text features of captioned samples
        self.pair_indices: list[torch.Tensor] = []  # their data indices (-1: none), for the validation loss
        self.pair_groups: list[torch.Tensor] = []  # their json "group" (-1: none)
        # their captions' hashes: distinct captions are counted by string (one string's embedding differs in its
        # last bits with the batch it is encoded in, so torch.unique over embeddings depended on the batch size)
        self.pair_captions: list[torch.Tensor] = []
        # every rank's (pairs, indices, groups or None), after the pass
        self.gathered_pairs = (torch.zeros(0, 0), torch.zeros(0, dtype=torch.int64), None)
        # collect_features: the name of the samples that name no dataset; None: no probe features kept
        self.collect_features = collect_features
        self.features: list[torch.Tensor] = []  # [n, d] probe features of labelled samples
        self.feature_labels: list[tuple[str, int, int]] = []  # their (dataset, label, data index or -1)
        self.num_samples = 0
        self.unmatched = 0
        # one process (`fastclip eval`): a class list that is not the data's is refused at the first sample that
        # shows it, not after the pass; ranks of a group count, and agree on one message after it
        self.fail_fast = False

    def spec_name(self, sample: EvalSample) -> str | None:
        if sample.label is None:
            return None
        if len(self.names) == 1 and self.one_list_for_all:  # a single class list applies to every labelled sample
            if sample.dataset is not None and len(self.datasets_scored) < 2:
                self.datasets_scored.add(sample.dataset)
                if len(self.datasets_scored) == 2 and self.fail_fast:  # said now, not after the pass
                    raise MixedDatasets(
                        f"one class list ({self.names[0]!r}) scored labelled samples of 2+ datasets (here: "
                        f"{', '.join(sorted(self.datasets_scored))}), each against the same classes"
                    )
            return self.names[0]
        if len(self.names) == 1 and sample.dataset is None:  # its own dataset's, and those that name none
            return self.names[0]
        return sample.dataset if sample.dataset in self.specs else None

    def add(self, model, tokenizer, preprocess, batch: list[EvalSample], classifiers) -> None:
        dtype = _input_dtype(model)
        images = torch.stack([preprocess(s.image) for s in batch]).to(self.device, dtype)
        if self.collect_features is None:
            embedding = model.encode_image(images)
        else:  # the same forward gives the probe's features: they are extracted once
            embedding, features = encode_image_with_features(model, images)
            labelled = [i for i, s in enumerate(batch) if s.label is not None]
            self.features.append(features[labelled].float())
            self.feature_labels += [
                (
                    batch[i].dataset or self.collect_features,
                    batch[i].label,
                    -1 if batch[i].index is None else batch[i].index,
                )
                for i in labelled
            ]
        image_features = F.normalize(embedding.float(), dim=-1)
        self.num_samples += len(batch)
        routed = [self.spec_name(s) for s in batch]
        self.unmatched += sum(1 for s, r in zip(batch, routed) if s.label is not None and r is None)
        for name in set(r for r in routed if r is not None):
            rows = [i for i, r in enumerate(routed) if r == name]
            labels = torch.tensor([batch[i].label for i in rows], dtype=torch.int64)
            classes = self.counts[name].num_classes
            if self.fail_fast and bool(((labels < 0) | (labels >= classes)).any()):  # said now, not after the pass
                bad = next(int(x) for x in labels.tolist() if not 0 <= x < classes)
                raise LabelOutOfRange(
                    f"a sample of dataset {name!r} has label {bad}, outside [0, {classes}) (its class list has "
                    f"{classes} names)"
                )
            self.counts[name].update(image_features[rows] @ classifiers[name], labels)
        captioned = [i for i, s in enumerate(batch) if s.caption is not None]
        if self.retrieval and captioned:
            tokens = tokenizer([batch[i].caption for i in captioned]).to(self.device)
            text_features = F.normalize(model.encode_text(tokens).float(), dim=-1)
            self.pairs.append(torch.cat([image_features[captioned], text_features], dim=1))
            index = [-1 if batch[i].index is None else batch[i].index for i in captioned]
            self.pair_indices.append(torch.tensor(index, dtype=torch.int64, device=self.device))
            group = [-1 if batch[i].group is None else batch[i].group for i in captioned]
            self.pair_groups.append(torch.tensor(group, dtype=torch.int64, device=self.device))
            hashes = [caption_hash(batch[i].caption) for i in captioned]
            self.pair_captions.append(torch.tensor(hashes, dtype=torch.int64, device=self.device))

    def packed(self, skipped: int, cut_shards: int, failed: bool) -> torch.Tensor:
        parts = [self.counts[name].packed() for name in self.names]
        extra = [self.num_samples, self.unmatched, skipped, cut_shards, int(failed)]
        extra = torch.tensor(extra, dtype=torch.int64, device=self.device)
        return torch.cat(parts + [extra])


class LabelOutOfRange(EvalDataError):
    """Labels that a class list cannot name: the list is not this data's (its caller knows where it came from)."""


class MixedDatasets(EvalDataError):
    """One class list scored the labelled samples of several datasets: each against another dataset's classes."""


def _refuse_mixed_datasets(state: _Pass, group) -> None:
    """The named datasets one list scored, over every rank (each rank its own, then gathered as name hashes: the
    same collective on every rank, and the same verdict)."""
    names = sorted(state.datasets_scored)
    local = torch.tensor([[zlib.crc32(n.encode())] for n in names], dtype=torch.int64).reshape(-1, 1)
    scored = set(all_gather_rows(local.to(state.device), group).flatten().tolist())
    if len(scored) > 1:
        raise MixedDatasets(
            f"one class list ({state.names[0]!r}) scored labelled samples of {len(scored)}+ datasets (here: "
            f"{', '.join(names)}), each against the same classes"
        )


def one_list_for_all(specs: dict[str, ZeroShotSpec], data_names_file) -> bool:
    """Whether a single class list scores every labelled sample (data of one dataset, under whatever name); not
    where the data's own class-names file (`default_zeroshot_file`) names the list's dataset among others: there
    it scores that dataset's samples only."""
    if len(specs) != 1 or data_names_file is None:
        return True
    try:
        datasets = load_zeroshot_spec(data_names_file)
    except (ValueError, OSError):  # unusable: the list given stands alone
        return True
    return not (len(datasets) > 1 and next(iter(specs)) in datasets)


@torch.no_grad()
def evaluate(
    model,
    *,
    tokenizer,
    preprocess,
    source,
    specs: dict[str, ZeroShotSpec],
    device,
    group=None,
    batch_size: int = 64,
    max_samples: int | None = None,
    retrieval: bool = True,
    progress=None,
    one_list_for_all: bool = True,
    collect_features: str | None = None,
    loss_fn=None,
    loss_batch_size: int | None = None,
) -> EvalResults:
    """Zero-shot (per spec) and retrieval results over `source`; every rank of `group` must call this.

    `source`: a shard folder / tar / glob / image folder path, or a function (rank, world_size, skipped) ->
    samples that appends a message to the list `skipped` for each sample it leaves out. `progress(n)`, if given,
    is called after each batch of this rank's n samples. `one_list_for_all`: a single spec scores every labelled
    sample, whatever its dataset (a class list given for data of one dataset), and MixedDatasets is raised when
    they come from several; False: only its own dataset's, and those that name none (see one_list_for_all).
    `collect_features`: keep the probe features of the labelled samples (EvalResults.features), those naming no
    dataset under this name. `loss_fn` (with retrieval): its value on the captioned samples in eval mode, in
    global batches of `loss_batch_size` per rank (see validation_loss).
    """
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    try:
        state = _Pass(specs, torch.device(device), retrieval, one_list_for_all, collect_features)
        results = _evaluate(model, tokenizer, preprocess, source, state, group, batch_size, max_samples, progress)
        if collect_features is not None:
            results.features = _gather_features(state, group)
        if loss_fn is not None and retrieval:
            from fastclip.eval.val_loss import validation_loss

            pairs, indices, groups = state.gathered_pairs
            if pairs.shape[0]:
                half = pairs.shape[1] // 2
                per_rank = loss_batch_size or batch_size
                results.val_loss, results.val_loss_samples = validation_loss(
                    loss_fn, pairs[:, :half], pairs[:, half:], indices, per_rank, group, groups=groups
                )
        return results
    finally:
        model.train(was_training)


def _evaluate(model, tokenizer, preprocess, source, state: _Pass, group, batch_size, max_samples, progress=None):
    specs = state.specs
    rank, world = rank_and_world(group)
    classifiers = {
        name: zeroshot_classifier(model, tokenizer, spec.prompted_names, spec.templates, state.device)
        for name, spec in specs.items()
    }
    error: BaseException | None = None
    skipped = Skipped()
    state.fail_fast = world == 1
    try:
        samples = source(rank, world, skipped) if callable(source) else iter_samples(source, rank, world, skipped)
        # max_samples caps the total: this rank's share of the first max_samples positions
        limit = None if max_samples is None else max(0, (max_samples - rank + world - 1) // world)
        for batch in _batches(_limited(samples, limit), batch_size):
            state.add(model, tokenizer, preprocess, batch, classifiers)
            if progress is not None:
                progress(len(batch))
    except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks learn of it
        error = err

    packed = all_reduce_sum(state.packed(skipped.samples, skipped.cut_shards, failed=error is not None), group)
    num_samples, unmatched, num_skipped, cut_shards, failures = packed[-5:].tolist()
    if failures:
        if error is not None:
            raise error
        raise EvalDataError(f"evaluation failed on {failures} other rank(s); see their logs")
    results = EvalResults(num_samples=num_samples, unmatched=unmatched, skipped=num_skipped, cut_shards=cut_shards)
    _unpack_zeroshot(state, packed, results)
    if len(specs) == 1 and state.one_list_for_all:
        _refuse_mixed_datasets(state, group)
    if unmatched and specs and rank == 0:  # (no class names at all: the caller knows zero-shot is off)
        log.warning("%d labelled samples belong to no dataset of the class names file; not scored", unmatched)
    if state.retrieval:
        _gather_retrieval(state, results, 2 * _embed_dim(model, classifiers), group)
    return results


# captions read before a look ahead takes retrieval for scored (then 90 % distinct, records.MIN_DISTINCT_CAPTIONS)
_LOOK_AHEAD_CAPTIONS = 64


def unscorable(
    source,
    specs: dict[str, ZeroShotSpec],
    retrieval: bool = True,
    one_list_for_all: bool = True,
    max_samples: int | None = None,
) -> EvalResults | None:
    """The counts an evaluation of shards would end with when it can score nothing (no labelled sample of a
    class list, no captions or only templated ones), read from the labels and captions alone: no image decoded,
    no model. None as soon as a sample shows that something will be scored, and for sources it does not read
    (an image folder's class folders are its labels; a function). An operator learns before the pass, not after
    it."""
    if callable(source) or is_image_folder(source):
        return None
    state = _Pass(specs, torch.device("cpu"), retrieval, one_list_for_all)
    results, captions = EvalResults(), set()
    # --max-samples counts the samples that decode (the pass skips the others): then the look ahead decodes too
    samples = iter_shard_samples(source, skipped=Skipped(), decode=max_samples is not None, quiet=True)
    for sample in _limited(samples, max_samples):
        results.num_samples += 1
        if state.spec_name(sample) is not None:  # zero-shot scores it
            return None
        results.unmatched += sample.label is not None
        if retrieval and sample.caption is not None:
            results.retrieval_samples += 1
            captions.add(sample.caption)
            # the pass counts distinct strings too (caption_hash)
            if len(captions) >= _LOOK_AHEAD_CAPTIONS and retrieval_reported(len(captions), results.retrieval_samples):
                return None
    results.retrieval_distinct_captions = len(captions)
    if not results.num_samples or (
        results.retrieval_samples and retrieval_reported(len(captions), results.retrieval_samples)
    ):
        return None  # nothing readable (the pass says why), or few captions, distinct enough
    return results


def _unpack_zeroshot(state: _Pass, packed: torch.Tensor, results: EvalResults) -> None:
    """Each dataset's summed counts, in `state.names` order at the start of `packed`, into `results.zeroshot`."""
    offset = 0
    for name in state.names:
        counts = state.counts[name]
        size = counts.packed().numel()
        counts.unpack(packed[offset : offset + size])
        offset += size
        if int(counts.invalid):
            raise LabelOutOfRange(
                f"{int(counts.invalid)} samples of dataset {name!r} have a label outside "
                f"[0, {counts.num_classes}) (its class list has {counts.num_classes} names)"
            )
        if int(counts.counts[0].sum()):
            results.zeroshot[name] = ZeroShotResult.from_counts(name, state.specs[name].classnames, counts.counts)


def _gather_retrieval(state: _Pass, results: EvalResults, width: int, group) -> None:
    """Every rank's image-caption pairs, in data-index order, into `state.gathered_pairs` and their recall into
    `results`."""
    device = state.device
    local = torch.cat(state.pairs) if state.pairs else torch.zeros(0, width, device=device)
    pairs = all_gather_rows(local, group)
    local = torch.cat(state.pair_indices) if state.pair_indices else torch.zeros(0, dtype=torch.int64)
    indices = all_gather_rows(local.to(device), group)
    local = torch.cat(state.pair_groups) if state.pair_groups else torch.zeros(0, dtype=torch.int64)
    groups = caption_groups(all_gather_rows(local.to(device), group))
    local = torch.cat(state.pair_captions) if state.pair_captions else torch.zeros(0, dtype=torch.int64)
    captions = all_gather_rows(local.to(device), group)
    order = torch.sort(indices, stable=True).indices  # data-index order: the validation loss's batches are
    # the same pairs whatever the number of ranks
    state.gathered_pairs = (pairs[order], indices[order], None if groups is None else groups[order])
    if not pairs.shape[0]:
        return
    half = pairs.shape[1] // 2
    if groups is None:
        results.retrieval = retrieval_metrics(pairs[:, :half], pairs[:, half:])
    else:  # in data-index order: an image is its group's first caption's, whatever the number of ranks
        pairs, _, groups = state.gathered_pairs
        results.retrieval = retrieval_metrics(pairs[:, :half], pairs[:, half:], groups=groups)
        results.retrieval_images = int(torch.unique(groups).shape[0])
    results.retrieval_samples = pairs.shape[0]
    results.retrieval_distinct_captions = int(torch.unique(captions).shape[0])


def caption_hash(caption: str) -> int:
    """A caption's 64-bit hash, the same in every process (str's own hash is salted per process)."""
    return int.from_bytes(hashlib.blake2b(caption.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def caption_groups(groups: torch.Tensor) -> torch.Tensor | None:
    """Each caption's group id where some captions share one (json "group"; -1, none: an id of its own), else
    None: one caption per image, retrieval as ever."""
    own = -2 - torch.arange(groups.shape[0], device=groups.device)  # negative: never a json group
    ids = torch.where(groups >= 0, groups, own)
    return ids if torch.unique(ids).shape[0] < ids.shape[0] else None


NAME_BYTES = 256  # a dataset name's room in the gather of names


def _wire(name: str) -> str:
    """The name as the gather carries it (cut to NAME_BYTES)."""
    return name.encode()[:NAME_BYTES].decode(errors="ignore")


def _gather_features(state: _Pass, group) -> dict[str, LabelledFeatures]:
    """Every rank's probe features, per dataset (names, widths and rows gathered: a rank may hold none), in
    data-index order: the same rows in the same order whatever the number of ranks (kNN breaks ties by order)."""
    device = state.device
    local_names = sorted({name for name, _, _ in state.feature_labels})
    encoded = torch.zeros(len(local_names), NAME_BYTES, dtype=torch.uint8)
    for row, name in enumerate(local_names):
        raw = _wire(name).encode()
        encoded[row, : len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    gathered = all_gather_rows(encoded.to(device), group).cpu()
    names = sorted({bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in gathered})
    features = torch.cat(state.features) if state.features else torch.zeros(0, 0, device=device)
    width = all_reduce_sum(torch.tensor([features.shape[1], int(features.shape[0] > 0)], device=device), group)
    width = int(width[0]) // max(1, int(width[1]))
    if features.shape[0] == 0:
        features = torch.zeros(0, width, device=device)
    position = {name: i for i, name in enumerate(names)}
    keys = [[position[_wire(n)], label, index] for n, label, index in state.feature_labels]
    keys = all_gather_rows(torch.tensor(keys, dtype=torch.int64).reshape(-1, 3).to(device), group).cpu().numpy()
    features = all_gather_rows(features, group).cpu().numpy()
    out = {}
    for i, name in enumerate(names):
        rows = np.flatnonzero(keys[:, 0] == i)
        rows = rows[np.argsort(keys[rows, 2], kind="stable")]
        out[name] = LabelledFeatures(features[rows], keys[rows, 1])
    return out


def _embed_dim(model, classifiers) -> int:
    """Feature width, known on every rank even when its slice is empty (the gather needs equal shapes)."""
    if classifiers:
        return next(iter(classifiers.values())).shape[0]
    projection = getattr(model, "text_projection", None)
    if isinstance(projection, torch.Tensor):
        return projection.shape[-1]
    if isinstance(projection, torch.nn.Linear):
        return projection.out_features
    raise ValueError("cannot tell the model's embedding width (no text_projection); pass a class names file")


def default_zeroshot_file(val_dir) -> Path | None:
    """`fastclip data embedded` writes DIR/zeroshot.json beside DIR/val (`val_dir` may be a shard or a pattern of
    that folder's shards)."""
    folder = held_out_folder(val_dir)
    if folder is None:  # a pattern over several folders: no one file beside them all
        return None
    for candidate in (folder / ZEROSHOT_NAME, folder.parent / ZEROSHOT_NAME):
        if candidate.is_file():
            return candidate
    return None


def run_evals(
    model,
    *,
    tokenizer,
    preprocess,
    val_dir,
    zeroshot_file=None,
    device,
    group=None,
    batch_size: int = 64,
    max_samples: int | None = None,
    per_class: bool = False,
    retrieval: bool = True,
    loss_fn=None,
    loss_batch_size: int | None = None,
    probe=None,
) -> dict[str, float]:
    """Evaluation during training: EVERY rank calls this; all return the same flat dict.

    `val_dir` is the held-out shard folder; `zeroshot_file` defaults to the zeroshot.json beside it. The
    model may be DDP-wrapped; it is evaluated under no_grad in eval mode, and its train mode restored.
    `loss_fn`: also its validation loss (`val_loss`); `probe` (a TrainingProbe): linear probe and kNN.
    """
    own = default_zeroshot_file(val_dir)
    zeroshot_file = zeroshot_file or own
    specs = load_zeroshot_spec(zeroshot_file) if zeroshot_file else {}
    results = evaluate(
        model,
        tokenizer=tokenizer,
        preprocess=preprocess,
        source=val_dir,
        specs=specs,
        device=device,
        group=group,
        batch_size=batch_size,
        max_samples=max_samples,
        retrieval=retrieval,
        # the data's own list holds all of its datasets: one_list_for_all need not read it a second time
        one_list_for_all=one_list_for_all(specs, None if zeroshot_file == own else own),
        collect_features=probe.unnamed if probe is not None else None,
        loss_fn=loss_fn,
        loss_batch_size=loss_batch_size,
    )
    flat = results.flat(per_class=per_class)
    if probe is not None:
        flat.update(probe.scores(model, preprocess, results.features, device, group, batch_size))
    return flat
