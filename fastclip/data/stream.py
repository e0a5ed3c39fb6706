"""The training stream: shards -> batches of (images, token ids, global indices, group ids), resumable, equal per
rank.

    stream = build_train_stream(cfg, rank=r, world_size=W, preprocess=built.preprocess_train,
                                tokenizer=built.tokenizer)
    for epoch in range(start_epoch, epochs):
        for images, texts, indices, groups in stream.epoch(epoch):   # stream.batches_remaining(epoch) batches
            ...      # groups: json["group"] of each sample, else its index (fastclip/data/format.py)
            if time_to_save: save({"data": stream.state_dict(), ...})

What is decided by what (fastclip/data/plan.py has the arithmetic, fastclip/data/worker.py the worker loop):
- The epoch's shard order comes from (seed, epoch) alone: every rank computes the same order, a new epoch gets
  a new order (FastCLIP's reference calls set_epoch(0) every epoch and so never reshuffles shards).
- Ranks split the epoch's sample sequence at sample granularity, so uneven shards cost at most one sample of
  imbalance; every rank serves ceil(samples / (W * B)) batches. A rank that runs short (rounding, bad samples)
  wraps around within its own range; those samples are counted in `counters["wrapped"]`.
- Batch j of a rank is made by logical worker j % workers; the sample shuffle is a seeded permutation of
  windows of `shuffle_buffer` samples; augmentations are seeded per batch. So the batches are a function of
  (data, seed, epoch, world_size, workers, batch_size, shuffle_buffer), whether workers are processes or not
  (workers=0 loads in the main process and gives the same batches as workers=1).

Resume (state_dict / load_state_dict; plain ints, lists and strings, and an int64 tensor for a long segment):
- Same world_size, workers, batch_size and shuffle_buffer: exact. Each worker's cursor (window, samples
  consumed in it) is saved; a resumed stream re-reads at most one window per worker and serves exactly the
  batches the uninterrupted run would have served, tensor for tensor. Load each rank's own state.
- Anything of those four changed (e.g. another world size): the current epoch is finished exactly, then epochs run
  normally at the new layout. Give every new rank `state_for_new_world_size(old_states, rank, world_size)` (the
  trainer's checkpoint manager does, at the same world size too): each old worker's state says which samples of
  its current shuffle window it served and which it found bad, so the rest of the epoch is exactly the good
  samples no old rank served (and those not read yet), split over the new ranks as a shorter epoch, possibly
  empty. Nothing is skipped, nothing served twice but the usual wrap (< new_world_size * B, counted) that fills the
  last batches, and each bad sample is counted once (the unserved samples of a partly read window are read again
  "quietly": fastclip/data/plan.py). Passed one old rank's state alone (or a state saved before the served samples
  were recorded), the rest is found from the batch count: after b batches, every old worker has consumed at least
  b_w * B samples (b_w = its share of the b batches) and so all of its first floor(b_w * B / shuffle_buffer)
  windows; everything else is served, so nothing is skipped, but up to old_world_size * old_workers *
  (shuffle_buffer - 1) samples are served twice (and their bad samples counted twice).
  `batches_remaining(epoch)` says how many batches the rest of the epoch has; the trainer's step count for that
  epoch must follow it, not batches_per_epoch.
- The data (shard names and counts), seed, resampling and epoch length (IDENTITY) must be the same;
  load_state_dict raises otherwise. load_state_dict(None) starts fresh.

Bad data does not stop training (fastclip/data/samples.py has the reasons), except when a rank's whole share
of an epoch is bad: then `epoch()` raises DataExhausted naming the rank and its shards (the trainer stops with
that one line, exit status 1). Each lost sample is counted once per epoch, by the worker whose chunk holds it,
however often refills and wraps re-read it (fastclip/data/plan.py). Counts come back from worker processes
piggybacked on the batches they belong to, so `stream.counters` counts exactly the samples skipped while making
the batches handed out so far (and it is restored on resume without double counting, at any layout).
`stream.recent_skips` holds the last events (shard, key, reason, detail); each bad sample, and each broken shard,
is logged once per epoch (the first `log_skips_per_reason` per reason; 0: not logged, as the trainer does, which
logs on rank 0).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from fastclip.data.catalog import Catalog, DataSpecError, resolve_catalog
from fastclip.data.plan import (
    EpochSequence,
    Layout,
    Segment,
    WorkerProgress,
    epoch_sequence,
    num_batches,
    rank_span,
    remainder,
    window_span,
    worker_chunk,
    worker_runs,
)
from fastclip.data.remote import REMOTE_COUNTERS, RETRY_DELAYS_S
from fastclip.data.samples import MANIFEST_MISMATCH, REASONS, SHARD_REASONS, DataExhausted
from fastclip.data.worker import EpochDataset, EpochJob

log = logging.getLogger(__name__)
STATE_FORMAT = "fastclip-stream/1"

# What a saved position is a place in, with why: a state is loaded only where these are the same. state_dict writes
# them, load_state_dict compares them, and so does the trainer's resume check (fastclip/checkpoint/compat.py).
IDENTITY = {
    "seed": "the data order and the shuffle come from it",
    "resampled": "the data order depends on it",
    "epoch_length": "samples per epoch: the saved position is a place in an epoch of that length",
    "fingerprint": "the shards (names and sample counts) differ from the ones the saved position refers to",
}


def stream_identity(*, seed: int, resampled: bool, samples_per_epoch: int | None, catalog: Catalog) -> dict:
    """The IDENTITY values of a stream over `catalog` (without building it)."""
    length = (samples_per_epoch or catalog.num_samples) if resampled else catalog.num_samples
    return {"seed": seed, "resampled": bool(resampled), "epoch_length": length, "fingerprint": catalog.fingerprint}


def identity_mismatches(state: dict, identity: dict) -> list[str]:
    """The IDENTITY fields a saved state has with another value than `identity` (IDENTITY's order)."""
    return [field for field in IDENTITY if field in state and state[field] != identity[field]]


@dataclass
class StreamOptions:
    """The stream's knobs, and the schema of the trainer's data section too (fastclip/train/config.py's DataConfig
    extends this class with what the trainer alone reads), so each knob has one default and one comment: here.
    Defaults: the embedded recipe's (configs/embedded.yaml)."""

    train: str = "data/embedded/train"  # shard folders, manifest .json files, brace patterns; sources joined by "::"
    batch_size: int = 64  # per process; the global batch is batch_size x world size
    data_size: int | None = None  # 1 + largest sample index (sizes the per-sample state); null: manifest's
    workers: int = 1  # data loader worker processes per rank (0: load in the main process)
    shuffle_buffer: int = 1000  # samples per seeded shuffle window (raw bytes of this many held per worker)
    seed: int | None = None  # shard order / shuffle / augmentation seed; null: train.seed (a stream by itself: 0)
    resampled: bool = False  # draw shards with replacement (OpenCLIP --dataset-resampled)
    samples_per_epoch: int | None = None  # virtual epoch length; only with resampled (null: all samples)
    upsampling_factors: str | None = None  # "1::2": per-source weights of "::"-joined sources (resampled)
    # page-locked batches, copied to the GPU asynchronously; null: on for CUDA in the trainer, off in a stream by
    # itself (the trainer decides it: fastclip/train/data.py's stream_config)
    pin_memory: bool | None = None
    # remote shards: seconds before each retry of a transient failure, one per retry ([]: none); then skipped
    remote_retry_delays: list[float] = field(default_factory=lambda: list(RETRY_DELAYS_S))

    def problems(self) -> list[tuple[str, str]]:
        """(knob, what is wrong with it) for each value out of its range: the trainer's config check and a stream's
        maker each say them in their own words (a config key, a ValueError). How resampled, samples_per_epoch and
        upsampling_factors go together is the data's question (DataSpecError when the stream reads the shards)."""
        per_epoch, found = self.samples_per_epoch, []
        for ok, key, why in (
            (self.batch_size >= 1, "batch_size", "must be >= 1"),
            (self.data_size is None or self.data_size >= 1, "data_size", "must be >= 1 or null"),
            (self.workers >= 0, "workers", "must be >= 0"),
            (self.shuffle_buffer >= 1, "shuffle_buffer", "must be >= 1"),
            (self.seed is None or self.seed >= 0, "seed", "must be >= 0 or null"),
            (per_epoch is None or per_epoch >= 1, "samples_per_epoch", "must be >= 1 or null"),
            (all(math.isfinite(x) and x >= 0 for x in self.remote_retry_delays or ()), "remote_retry_delays",
             "must be seconds >= 0, one per retry ([]: no retry)"),
        ):  # fmt: skip
            if not ok:
                found.append((key, why))
        return found


@dataclass
class StreamConfig(StreamOptions):
    """StreamOptions plus what only the maker of a stream sets."""

    upsampling_factors: str | list | None = None  # as StreamOptions, or a list of numbers
    prefetch_factor: int = 2
    log_skips_per_reason: int = 20  # warnings per reason and epoch; counts are always exact

    def __post_init__(self):
        if self.seed is None:  # (the trainer passes its train.seed)
            self.seed = 0

    @classmethod
    def from_any(cls, cfg: Any, **decided) -> StreamConfig:
        """A StreamConfig from itself, a dict, or any config object with these field names (the trainer's data
        section, whose schema StreamOptions is; OpenCLIP's spellings are command-line aliases only,
        fastclip/train/config.py), with the values in `decided` instead of its own."""
        if isinstance(cfg, cls) and not decided:
            return cfg
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        values = {}
        for f in fields(cls):
            value = decided[f.name] if f.name in decided else get(f.name, None)
            if value is not None:
                values[f.name] = value
        for required in ("train", "batch_size"):
            if required not in values:
                raise DataSpecError(f"data config has no {required!r}")
        return cls(**values)


def build_train_stream(
    cfg: Any,
    *,
    rank: int = 0,
    world_size: int = 1,
    preprocess: Callable,
    tokenizer: Callable,
    catalog: Catalog | None = None,
) -> TrainStream:
    """catalog: the shards of cfg.train as resolved once (by rank 0, broadcast); None: resolve them here."""
    return TrainStream(
        StreamConfig.from_any(cfg),
        rank=rank,
        world_size=world_size,
        preprocess=preprocess,
        tokenizer=tokenizer,
        catalog=catalog,
    )


class TrainStream:
    def __init__(
        self,
        cfg: StreamConfig,
        *,
        rank: int,
        world_size: int,
        preprocess: Callable,
        tokenizer: Callable,
        catalog: Catalog | None = None,
    ):
        _check_positive(cfg, world_size, rank)
        self.cfg, self.rank = cfg, rank
        self.preprocess, self.tokenizer = preprocess, tokenizer
        if catalog is None:
            catalog = resolve_catalog(cfg.train, cfg.data_size)
        elif cfg.data_size is not None and cfg.data_size != catalog.data_size:
            if cfg.data_size < catalog.data_size:
                raise DataSpecError(
                    f"data_size {cfg.data_size} is smaller than the manifests' data_size {catalog.data_size}"
                )
            catalog = replace(catalog, data_size=cfg.data_size)
        self.catalog: Catalog = catalog
        self.data_size = self.catalog.data_size
        self.grouped = self.catalog.grouped  # whether the group ids tell anything the indices do not
        self.layout = Layout(world_size, max(1, cfg.workers), cfg.batch_size, cfg.shuffle_buffer)
        self._weights = shard_weights(self.catalog, cfg)
        if cfg.resampled:
            self.epoch_length = cfg.samples_per_epoch or self.catalog.num_samples
        else:
            if cfg.samples_per_epoch is not None and cfg.samples_per_epoch != self.catalog.num_samples:
                raise DataSpecError(
                    f"samples_per_epoch={cfg.samples_per_epoch} but the shards hold {self.catalog.num_samples} "
                    f"samples: without resampled an epoch is one pass over all shards (a smaller number "
                    f"would silently train on a subset, OpenCLIP #993); set resampled for virtual epochs"
                )
            self.epoch_length = self.catalog.num_samples
        if self.epoch_length < world_size:
            raise DataSpecError(f"{cfg.train!r}: {self.epoch_length} samples per epoch for {world_size} ranks")
        self.batches_per_epoch = num_batches(self.epoch_length, self.layout)
        # position
        self._epoch: int | None = None
        self._segment: Segment | None = None
        self._batches_seen = 0
        self._cursors: list[tuple[int, int]] = []
        # per worker, the offsets of the samples served from its cursor's window, and of its bad ones (None:
        # unknown, for a state saved before they were recorded): an exact resume at another layout needs them
        self._taken: list[list[int]] | None = []
        self._bad: list[list[int]] | None = []
        self._quiet = Segment(())  # good positions read, not served, before a resume at another layout (plan.py)
        self._seq_cache: tuple[int, EpochSequence] | None = None
        self.samples_seen = 0
        self.counters: dict[str, int] = {reason: 0 for reason in REASONS} | {"wrapped": 0} | _remote_zeros()
        self.recent_skips: deque = deque(maxlen=100)
        self._logged: Counter = Counter()

    def __repr__(self) -> str:
        return (
            f"TrainStream(rank {self.rank}/{self.layout.world_size}, {len(self.catalog.shards)} shards, "
            f"{self.epoch_length} samples/epoch, batch {self.layout.batch_size}, "
            f"{self.batches_per_epoch} batches/epoch, data_size {self.data_size})"
        )

    # ------------------------------------------------------------------ iteration
    def _sequence(self, epoch: int) -> EpochSequence:
        if self._seq_cache is None or self._seq_cache[0] != epoch:
            sizes = [s.num_samples for s in self.catalog.shards]
            seq = epoch_sequence(
                sizes,
                self.cfg.seed,
                epoch,
                resampled=self.cfg.resampled,
                samples_per_epoch=self.epoch_length,
                weights=self._weights,
            )
            self._seq_cache = (epoch, seq)
        return self._seq_cache[1]

    def _enter(self, epoch: int) -> None:
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._epoch != epoch:  # a new epoch (or another one than the saved position's): start it fresh
            self._epoch, self._segment, self._batches_seen = epoch, Segment.full(self.epoch_length), 0
            self._cursors = [(0, 0)] * self.layout.workers
            self._forget_windows()
            self._quiet = Segment(())
            self._logged.clear()

    def entered(self, epoch: int) -> bool:
        """Whether the position is in `epoch` (a resumed stream: the saved one's epoch; a finished epoch's position
        stays in it until the next is entered)."""
        return self._epoch == epoch

    def batches_remaining(self, epoch: int) -> int:
        """How many batches `epoch(epoch)` will yield from the current position."""
        if self._epoch != epoch:
            return self.batches_per_epoch
        return num_batches(self._segment.length, self.layout) - self._batches_seen

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's batches of `epoch`, from the current position (the saved one after a resume)."""
        self._enter(epoch)
        n_batches = num_batches(self._segment.length, self.layout)
        first = self._batches_seen
        if first >= n_batches:
            return
        batches = self._start(EpochDataset(self._job(epoch, first, n_batches)))
        try:
            for expected in range(first, n_batches):
                try:
                    images, texts, indices, groups, meta = next(batches)
                except StopIteration:
                    raise RuntimeError(
                        f"rank {self.rank}: data workers stopped at batch {expected} of {n_batches} in epoch {epoch}"
                    ) from None
                if "error" in meta:
                    raise DataExhausted(meta["error"])
                if meta["batch"] != expected:  # DataLoader must interleave workers round-robin
                    raise RuntimeError(
                        f"rank {self.rank}: got batch {meta['batch']} from worker "
                        f"{meta['worker']}, expected batch {expected}"
                    )
                self._note_window(meta)
                self._cursors[meta["worker"]] = tuple(meta["cursor"])
                self._absorb(meta, epoch)
                self._batches_seen = expected + 1
                self.samples_seen += self.layout.batch_size
                if self.cfg.pin_memory and self.cfg.workers == 0 and torch.cuda.is_available():
                    images, texts, indices, groups = (t.pin_memory() for t in (images, texts, indices, groups))
                yield images, texts, indices, groups
        finally:
            del batches  # shuts worker processes down when the trainer stops early

    def _job(self, epoch: int, first: int, n_batches: int) -> EpochJob:
        """What the data workers need to serve batches first..n_batches - 1 of `epoch` from the current position."""
        segment = self._segment
        return EpochJob(
            shard_paths=[s.path for s in self.catalog.shards],
            shard_names=[s.name for s in self.catalog.shards],
            shard_sizes=[s.num_samples for s in self.catalog.shards],
            skip=[{k if o is None else o: (r, d) for k, o, r, d in s.skip} for s in self.catalog.shards],
            seq=self._sequence(epoch),
            index_base=[s.index_base for s in self.catalog.shards],
            index_offset=[s.index_offset for s in self.catalog.shards],
            index_span=[None if s.index_min is None else (s.index_min, s.index_max) for s in self.catalog.shards],
            segment=segment,
            layout=self.layout,
            rank=self.rank,
            seed=self.cfg.seed,
            epoch=epoch,
            seg_tag=segment.tag(self.epoch_length),
            data_size=self.data_size,
            first_batch=first,
            n_batches=n_batches,
            cursors=list(self._cursors),
            quiet=self._quiet if len(self._quiet) else None,
            preprocess=self.preprocess,
            tokenizer=self.tokenizer,
            retry_delays=None if self.cfg.remote_retry_delays is None else tuple(self.cfg.remote_retry_delays),
        )

    def _forget_windows(self) -> None:
        """No worker has served from or read a window yet (a new epoch, or a resume at another layout)."""
        self._taken = [[] for _ in range(self.layout.workers)]
        self._bad = [[] for _ in range(self.layout.workers)]

    def _note_window(self, meta: dict) -> None:
        """Keep the offsets of the samples each worker served from its cursor's window (a batch may span two), and
        of the window's bad samples (sent when it was read)."""
        if self._taken is None or self._bad is None:
            return
        w, window = meta["worker"], meta["cursor"][0]
        if self._cursors[w][0] != window:
            self._taken[w], self._bad[w] = [], []
        self._taken[w] += [offset for k, offset in meta["taken"] if k == window]
        # sent once per window read (again after a resume at the same layout: a set)
        if bad := [offset for k, offset in meta["bad"] if k == window]:
            self._bad[w] = sorted(set(self._bad[w]).union(bad))

    def _start(self, dataset: EpochDataset) -> Iterator:
        """The epoch's batches: read here (data.workers 0) or by data worker processes, started now."""
        if self.cfg.workers == 0:
            return iter(dataset)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.layout.workers,
            collate_fn=_as_is,
            pin_memory=self.cfg.pin_memory,
            prefetch_factor=self.cfg.prefetch_factor,
            persistent_workers=False,  # fresh workers per epoch: the job changes (and wds#365's leak)
            worker_init_fn=_leave_stop_signals_to_the_trainer,
            # its base seed from its own generator, not the caller's torch RNG: a resume mid-epoch starts one
            # more loader than the uninterrupted run did, and must not shift the trainer's RNG stream
            generator=torch.Generator().manual_seed(self.cfg.seed),
        )
        with _stop_signals_blocked():  # iter() starts the workers: they are born with the stop signals blocked
            return iter(loader)

    def drain_skips(self) -> list[dict]:
        """The skipped samples recorded since the last call (copies), forgetting them."""
        events = [dict(e) for e in self.recent_skips]
        self.recent_skips.clear()
        return events

    def _absorb(self, meta: dict, epoch: int) -> None:
        for reason, n in meta["skips"].items():
            self.counters[reason] = self.counters.get(reason, 0) + n
        self.counters["wrapped"] += meta["wrapped"]
        for name, n in meta["remote"].items():
            self.counters[name] += n
        for event in meta["events"]:
            event = dict(event, epoch=epoch, rank=self.rank)
            self.recent_skips.append(event)
            # one line per bad sample, one per bad shard (its workers may each report it) and epoch
            what = (
                (event["shard"], event["reason"])
                if event["reason"] in SHARD_REASONS
                else (event["shard"], event["key"], event["reason"])
            )
            if what in self._logged:
                continue
            self._logged[what] = 1
            self._logged[event["reason"]] += 1
            n = self._logged[event["reason"]]
            if n <= self.cfg.log_skips_per_reason:
                log.warning(
                    "%s%s",
                    describe_skip(event),
                    "; further skips of this reason are counted, not logged, this epoch"
                    if n == self.cfg.log_skips_per_reason
                    else "",
                )

    # ------------------------------------------------------------------ state
    def identity(self) -> dict:
        """What a saved position of this stream is a place in (IDENTITY)."""
        cfg = self.cfg
        return stream_identity(
            seed=cfg.seed, resampled=cfg.resampled, samples_per_epoch=cfg.samples_per_epoch, catalog=self.catalog
        )

    def state_dict(self) -> dict:
        return {
            "format": STATE_FORMAT,
            **self.identity(),
            "layout": self.layout.as_dict(),
            "rank": self.rank,
            "epoch": self._epoch,
            "segment": _intervals_state(self._segment) if self._segment is not None else None,
            "batches_seen": self._batches_seen,
            "cursors": [list(c) for c in self._cursors],
            # per worker, which samples of its cursor's window it served: a bitmap over the window, in hex
            "taken": None if self._taken is None else [_bitmap(t) for t in self._taken],
            "bad": None if self._bad is None else [_bitmap(t) for t in self._bad],
            "quiet": _intervals_state(self._quiet),
            "shard_cursor": self._shard_cursor(),  # for people reading a checkpoint; not used to resume
            "samples_seen": self.samples_seen,
            "counters": dict(self.counters),
        }

    def _shard_cursor(self) -> list[dict]:
        """Per logical worker: the shard and ordinal where its current shuffle window starts."""
        if self._epoch is None or not self._segment.length:
            return []
        n_batches = num_batches(self._segment.length, self.layout)
        lo, n_rank, _ = rank_span(self._segment.length, self.rank, self.layout.world_size)
        out = []
        for w, (window, consumed) in enumerate(self._cursors):
            chunk_start, chunk_len = worker_chunk(n_batches, self.layout, w)
            start, _ = window_span(window, chunk_len, self.layout.window, n_rank)
            run = worker_runs(self._sequence(self._epoch), self._segment, lo, n_rank, chunk_start, chunk_len, start, 1)[
                0
            ]
            shard = self.catalog.shards[int(self._sequence(self._epoch).slots[run.slot])]
            out.append(
                {
                    "worker": w,
                    "window": window,
                    "consumed_in_window": consumed,
                    "window_shard": shard.name,
                    "window_ordinal": run.ordinal,
                }
            )
        return out

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            return
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a data stream state (format {state.get('format')!r}, expected {STATE_FORMAT!r})")
        mine = self.identity()
        if differ := identity_mismatches(state, mine):
            said = ", ".join(f"{k}={state[k]!r} but this stream has {mine[k]!r}" for k in differ)
            raise ValueError(
                f"saved data stream position has {said}: the position is only meaningful for the same shards "
                f"(names and counts), seed, resampling and epoch length"
            )
        self.samples_seen = int(state["samples_seen"])
        self.counters = {reason: 0 for reason in REASONS} | {"wrapped": 0} | _remote_zeros() | dict(state["counters"])
        if state["epoch"] is None:
            return
        old = Layout(**state["layout"])
        epoch, segment = int(state["epoch"]), _segment_of(state["segment"])
        done = int(state["batches_seen"])
        self._epoch, self._logged = epoch, Counter()
        quiet = _segment_of(state.get("quiet"))
        if old == self.layout:
            if state["rank"] != self.rank:
                raise ValueError(
                    f"data stream state of rank {state['rank']} loaded into rank {self.rank} at the "
                    f"same world size: load each rank's own state"
                )
            self._segment, self._batches_seen, self._quiet = segment, done, quiet
            self._cursors = [tuple(c) for c in state["cursors"]]
            taken, bad = state.get("taken"), state.get("bad")
            self._taken = None if taken is None else [_offsets(t) for t in taken]
            self._bad = None if bad is None else [_offsets(t) for t in bad]
            return
        progress = _progress(state.get("old_ranks"), old)
        if done < num_batches(segment.length, old):
            self._segment, self._quiet = remainder(segment, old, done, progress, quiet)
        else:
            self._segment, self._quiet = Segment(()), Segment(())
        self._batches_seen, self._cursors = 0, [(0, 0)] * self.layout.workers
        self._forget_windows()
        log.info(
            "data stream: epoch %d resumed at another layout (%s -> %s) after %d batches: %d of its samples "
            "left, %d batches on this layout%s",
            epoch,
            old.as_dict(),
            self.layout.as_dict(),
            done,
            self._segment.length,
            self.batches_remaining(epoch),
            ""
            if progress is not None
            else " (a state without every old rank's served samples: partly served shuffle windows are served again)",
        )


def describe_skip(event: dict) -> str:
    """One line for a skip event: shard, key and reason (a shard-wide problem: the shard, once)."""
    if event.get("reason") in SHARD_REASONS:
        where = f" after key {event['key']}" if event.get("key") is not None else ""
        return (
            f"rank {event.get('rank')}: shard {event.get('shard')}: {event.get('reason')}{where} "
            f"({event.get('detail')}); "
            + (
                "the samples the manifest and the tar do not both hold are skipped this epoch"
                if event.get("reason") == MANIFEST_MISMATCH
                else "its unreadable samples are skipped this epoch"
            )
        )
    return (
        f"rank {event.get('rank')} skipped shard {event.get('shard')} key {event.get('key')}: "
        f"{event.get('reason')} ({event.get('detail')})"
    )


def state_for_new_world_size(old_states: list[dict], rank: int, world_size: int) -> dict:
    """What new rank `rank` of `world_size` loads when resuming from every old rank's state (in rank order).

    The position (epoch, batches served, old layout) is the same in every old state, so any one serves; the
    per-rank tallies (samples served, skip counters) are split so that their sums over ranks are kept: new rank
    r takes those of the old ranks j with j % world_size == r (none, when there are more new ranks than old).
    """
    if not old_states:
        raise ValueError("no saved data stream states to resume from")
    mine = [s for j, s in enumerate(old_states) if j % world_size == rank]
    counters: Counter = Counter()
    for s in mine:
        counters.update({k: int(v) for k, v in s["counters"].items()})
    return {
        **old_states[0],
        "samples_seen": sum(int(s["samples_seen"]) for s in mine),
        "counters": {k: counters[k] for k in old_states[0]["counters"]} | dict(counters),
        # what an exact finish of the interrupted epoch needs from every old rank (plan.remainder)
        "old_ranks": [{"cursors": s["cursors"], "taken": s.get("taken"), "bad": s.get("bad")} for s in old_states],
    }


def _bitmap(offsets: list[int]) -> str:
    bits = bytearray((max(offsets) // 8 + 1) if offsets else 0)
    for o in offsets:
        bits[o >> 3] |= 1 << (o & 7)
    return bits.hex()


def _offsets(bitmap: str) -> list[int]:
    bits = bytes.fromhex(bitmap)
    return [8 * i + b for i, byte in enumerate(bits) if byte for b in range(8) if byte >> b & 1]


def _progress(old_ranks: list[dict] | None, old: Layout) -> list[list[WorkerProgress]] | None:
    """Every old rank's worker progress, or None where any is unknown (plan.remainder's conservative rule): a state
    saved before the served samples were recorded, or fewer states than old ranks."""
    if (
        not old_ranks
        or len(old_ranks) != old.world_size
        or any(r.get("taken") is None or r.get("bad") is None for r in old_ranks)
        or any(not len(r["cursors"]) == len(r["taken"]) == len(r["bad"]) == old.workers for r in old_ranks)
    ):
        return None
    return [
        [
            WorkerProgress(int(k), int(i), tuple(_offsets(t)), tuple(_offsets(b)))
            for (k, i), t, b in zip(r["cursors"], r["taken"], r["bad"])
        ]
        for r in old_ranks
    ]


INLINE_INTERVALS = 64  # a segment of more intervals is saved as an int64 tensor [n, 2] (millions after a resume)


def _intervals_state(segment: Segment) -> list | torch.Tensor:
    if len(segment) <= INLINE_INTERVALS:
        return [list(iv) for iv in segment.intervals]
    return torch.from_numpy(segment.as_array())


def _segment_of(saved) -> Segment:
    if saved is None:
        return Segment(())
    return Segment(saved.numpy() if torch.is_tensor(saved) else saved)


def _check_positive(cfg: StreamConfig, world_size: int, rank: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} / world_size {world_size} is not a valid rank")
    problems = cfg.problems() + ([] if cfg.prefetch_factor >= 1 else [("prefetch_factor", "must be >= 1")])
    if problems:
        key, why = problems[0]
        raise ValueError(f"data config {key!r} {why}, got {getattr(cfg, key)!r}")


def shard_weights(catalog: Catalog, cfg: StreamConfig) -> list[float] | None:
    """Each shard's sampling weight from upsampling_factors (one per "::"-joined source); `cfg` may be the trainer's
    data section (the same field names): `fastclip train --check` validates the factors with it."""
    factors = cfg.upsampling_factors
    if factors is None:
        return None
    if not cfg.resampled:
        raise DataSpecError("upsampling_factors needs resampled (as in OpenCLIP)")
    try:
        values = [float(f) for f in (str(factors).split("::") if not isinstance(factors, list) else factors)]
    except ValueError:
        values = []
    if len(values) != len(catalog.sources) or any(not (v >= 0) for v in values):
        raise DataSpecError(
            f"upsampling_factors {factors!r}: need one factor >= 0 per source "
            f"({len(catalog.sources)} sources in {cfg.train!r})"
        )
    return [values[s.source] for s in catalog.shards]


def _remote_zeros() -> dict[str, int]:
    return dict.fromkeys(REMOTE_COUNTERS, 0)


def _as_is(batch):  # DataLoader collate_fn: our workers already make whole batches
    return batch


def _leave_stop_signals_to_the_trainer(_worker_id: int) -> None:
    """DataLoader worker_init_fn. A terminal's Ctrl-C (SIGINT) reaches the whole process group, and a scheduler's
    SIGUSR1 and SIGTERM (SLURM's preemption, time limit, scancel) every process of the job: the trainer stops on
    them (one line and exit 130; a checkpoint and exit 75) and shuts its workers down itself. A worker that died
    of the signal first would turn the stop into "DataLoader worker (pid ...) is killed by signal" in every rank.
    DataLoader's own last resort for a worker that does not end when asked is SIGTERM, now ignored: such a worker
    is killed with the trainer instead (PR_SET_PDEATHSIG), whichever way the trainer ends. The worker was started
    with these signals blocked (_stop_signals_blocked), so one sent before this ran stayed pending: ignoring it
    discards it, and unblocking lets later ones reach SIG_IGN."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    die_with_parent()


STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGUSR1", "SIGTERM") if hasattr(signal, n))


@contextmanager
def _stop_signals_blocked():
    """Blocks the stop signals in this thread while loader workers start. A child inherits the mask, so SLURM's
    SIGTERM to every process of the job cannot kill a worker in the moment between its start and its
    worker_init_fn (seconds for a spawned one on busy cores); here a signal sent meanwhile is delivered on exit."""
    if not hasattr(signal, "pthread_sigmask"):  # (Windows)
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that started it ends (prctl PR_SET_PDEATHSIG); elsewhere none."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the prctl: nobody will send the signal
        os.kill(os.getpid(), signal.SIGKILL)
