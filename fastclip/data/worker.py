"""What one DataLoader worker (or the main process, with workers=0) does for one epoch of one rank.

The worker gets an `EpochJob` (the plan of fastclip/data/plan.py plus the preprocess and tokenizer), reads its
positions window by window, drops bad samples (counting them), serves each window in its seeded order, decodes
and preprocesses images under per-batch seeded RNGs, tokenizes captions per batch, and yields
(images, texts, indices, groups, meta). `meta` carries what the main process must know about the batch: its number,
the worker's cursor after it, and the skips and wraps it cost; the stream strips it before the trainer sees
the batch.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

# A spawned DataLoader worker unpickles the preprocess transforms (torchvision objects) right after importing
# this module (pickle loads EpochDataset's class before its state) and before any worker_init_fn runs: apply
# the CPU-torch guard here, or such a worker dies importing torchvision and the loader waits for it forever.
from fastclip.compat import ensure_torchvision_importable  # noqa: E402
from fastclip.data.bits import IndexBits
from fastclip.data.format import IMAGE_EXTS
from fastclip.data.plan import (
    TAG_BATCH,
    TAG_WINDOW,
    EpochSequence,
    Layout,
    Segment,
    rank_span,
    rng_for,
    window_span,
    worker_batches,
    worker_chunk,
    worker_runs,
)
from fastclip.data.remote import is_remote
from fastclip.data.samples import (
    MANIFEST_MISMATCH,
    SHARD_REASONS,
    Candidate,
    DataExhausted,
    SkipLog,
    check_sample,
    decode_image,
)
from fastclip.data.tario import ShardReader, TarBroken

ensure_torchvision_importable(announce=False)

_WANT = frozenset({*IMAGE_EXTS, "txt", "json"})


@dataclass
class EpochJob:
    """Everything a worker needs to make its batches of one epoch (pickled to worker processes if spawned)."""

    shard_paths: list[str]
    shard_names: list[str]
    shard_sizes: list[int]  # samples each shard's manifest promises (for messages)
    skip: list[dict[int | str, tuple[str, str]]]  # per shard: ordinal (or key, older manifests) -> (reason, detail)
    index_base: list[int | None]  # per shard: plain WebDataset shards take their index from the position
    index_offset: list[int]  # per shard: its manifest's, added to every index read (scan --index-offset)
    index_span: list[tuple[int, int] | None]  # per shard: its manifest's index_min, index_max (None: not listed)
    seq: EpochSequence
    segment: Segment
    layout: Layout
    rank: int
    seed: int
    epoch: int
    seg_tag: int
    data_size: int
    first_batch: int
    n_batches: int
    cursors: list[tuple[int, int]]
    preprocess: Callable
    tokenizer: Callable | None  # None: image-only batches (no captions needed)
    retry_delays: tuple[float, ...] | None = None  # a remote shard's, seconds before each retry (None: remote.py's)
    quiet: Segment | None = None  # positions read before a resume at another layout (fastclip/data/plan.py)


class EpochDataset(torch.utils.data.IterableDataset):
    def __init__(self, job: EpochJob):
        self.job = job

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        physical = info.id if info is not None else 0
        # The DataLoader asks workers round-robin starting at worker 0, but the next batch (first_batch) belongs
        # to logical worker first_batch % workers: rotate the roles.
        logical = (self.job.first_batch + physical) % self.job.layout.workers
        return _Worker(self.job, logical).batches()


class _Worker:
    def __init__(self, job: EpochJob, worker: int):
        self.job, self.worker = job, worker
        lay = job.layout
        self.rank_lo, self.n_rank, self.borrowed = rank_span(job.segment.length, job.rank, lay.world_size)
        self.chunk_start, self.chunk_len = worker_chunk(job.n_batches, lay, worker)
        self.window, self.consumed = job.cursors[worker]
        self.taken: list[tuple[int, int]] = []  # (window, offset in it) of each sample served since the last batch
        self.bad: list[tuple[int, int]] = []  # (window, offset in it) of the bad samples of windows read since then
        self.skips = SkipLog()
        # this epoch's owners, compactly: the indices served (a bitmap) and, per shard, a bit per position for
        # the sample that owns its index, so a re-read of it (wrap, refill) is not taken for a duplicate
        self.seen = IndexBits()
        self.owners: dict[int, bytearray] = {}
        self.known_len: dict[int, tuple[int, str, str | None]] = {}  # shard -> (readable, reason, last key)
        self.reader: tuple[int, ShardReader] | None = None
        self.open_errors: dict[int, str] = {}  # shard -> why it could not be opened
        self.bad_streak = 0
        self.shard_events: set[tuple[str, str]] = set()  # (shard, reason) already reported this epoch
        self.bad_by_shard: dict[str, set[str]] = {}  # shard -> reasons seen (for the message if all is bad)
        self.shard_detail: dict[str, str] = {}  # shard -> its first shard-wide problem's detail (same message)
        self.remote: Counter = Counter()  # remote.REMOTE_COUNTERS since the last batch: every open counts

    def batches(self):
        job, lay = self.job, self.job.layout
        samples = self._samples()
        try:
            for j in worker_batches(job.n_batches, lay.workers, self.worker, job.first_batch):
                images, captions, indices, groups, wrapped = [], [], [], [], 0
                with _seeded_rngs(job.seed, job.epoch, TAG_BATCH, job.seg_tag, job.rank, j):
                    while len(images) < lay.batch_size:
                        try:
                            c = next(samples)
                        except DataExhausted as e:  # handed over as data: an exception from a worker process
                            yield None, None, None, None, {"batch": j, "worker": self.worker, "error": str(e)}
                            return  # would reach the trainer wrapped in the DataLoader's traceback
                        try:
                            images.append(job.preprocess(decode_image(c.image)))
                        except Exception as e:  # any decoder/transform failure is this sample's fault
                            # a wrapped re-read was counted by the position's owner (fastclip/data/plan.py)
                            self._skip(
                                SkipLog(0) if c.wrapped else self.skips,
                                "undecodable_image",
                                c.shard,
                                c.key,
                                f"{type(e).__name__}: {e}",
                            )
                            self._bad(1)
                            continue
                        self.bad_streak = 0
                        captions.append(c.caption)
                        indices.append(c.index)
                        groups.append(c.group)
                        wrapped += c.wrapped
                if job.tokenizer is None:  # image-only training (fastclip/train/ssl.py): no text, no column
                    texts = torch.zeros(len(captions), 0, dtype=torch.int64)
                else:
                    texts = job.tokenizer(captions)
                    texts = (texts if torch.is_tensor(texts) else torch.as_tensor(texts)).long()
                counts, events = self.skips.take()
                meta = {
                    "batch": j,
                    "worker": self.worker,
                    "cursor": [self.window, self.consumed],
                    "taken": self.taken,
                    "bad": self.bad,
                    "skips": counts,
                    "events": events,
                    "wrapped": wrapped,
                    "remote": dict(self.remote),
                }
                self.remote.clear()
                self.taken, self.bad = [], []
                yield (
                    torch.stack(images),
                    texts,
                    torch.tensor(indices, dtype=torch.int64),
                    torch.tensor(groups, dtype=torch.int64),
                    meta,
                )
        finally:
            if self.reader is not None:
                self.reader[1].close()

    def _skip(self, log_: SkipLog, reason: str, shard: str, key: str | None, detail: str, n: int = 1) -> None:
        """Count (into log_) and remember a skip; a shard-wide problem gets one event per shard and epoch."""
        self.bad_by_shard.setdefault(shard, set()).add(reason)
        event = True
        if reason in SHARD_REASONS:
            self.shard_detail.setdefault(shard, detail)
            event = (shard, reason) not in self.shard_events and log_.max_events > 0
            if event:
                self.shard_events.add((shard, reason))
        log_.add(reason, shard, key, detail, n, event=event)

    def _bad(self, n: int) -> None:
        # A rank whose every sample is bad would loop forever wrapping around: after two passes over its whole
        # range without one usable sample, stop the run with what is wrong with its shards.
        self.bad_streak += n
        if self.bad_streak > 2 * (self.n_rank + self.job.layout.window):
            raise DataExhausted(
                f"rank {self.job.rank}: no usable sample in its share of epoch {self.job.epoch} "
                f"({self.n_rank} samples): every one is bad. Shards: {self._what_is_wrong()}. {self._what_to_do()}, "
                f"then restart with --train.resume latest"
            )

    def _what_is_wrong(self, detailed: int = 3) -> str:
        """Each bad shard with its reasons, the first few shard-wide problems with their detail: for a remote shard
        that is its location and the command's stderr tail or the HTTP status, which nothing else prints (the
        skip events travel with batches, and this rank makes none)."""
        parts = []
        for name, reasons in sorted(self.bad_by_shard.items()):
            said = ", ".join(sorted(reasons))
            if name in self.shard_detail and detailed > 0:
                said, detailed = f"{said}: {self.shard_detail[name]}", detailed - 1
            parts.append(f"{name} ({said})")
        return "; ".join(parts) or "none read"

    def _what_to_do(self) -> str:
        """Advice that works for where the bad shards are: `fastclip data scan` reads local shards only."""
        location = dict(zip(self.job.shard_names, self.job.shard_paths))
        remote = {is_remote(location.get(name, "")) for name in self.bad_by_shard} or {False}
        advice = []
        if False in remote:
            advice.append("Replace or remove the local shards (`fastclip data scan` lists what is wrong in each)")
        if True in remote:
            advice.append(
                "Make each remote location readable (run its command or fetch its URL by hand to see why not) or "
                "remove it from the data spec"
            )
        return "; ".join(advice)

    def _samples(self) -> Iterator[Candidate]:
        """Candidates in serving order; keeps (self.window, self.consumed) = position after the last one."""
        job = self.job
        k, start = self.window, self.consumed
        silent = start > 0  # this window was read (and its skips counted) before the saved position
        while True:
            items = self._read_window(k, count_skips=not silent)
            if not items:
                self._bad(job.layout.window)
            order = rng_for(job.seed, job.epoch, TAG_WINDOW, job.seg_tag, job.rank, self.worker, k).permutation(
                len(items)
            )
            for i in range(start, len(items)):
                self.window, self.consumed = k, i + 1
                self.taken.append((k, items[order[i]].offset))
                yield items[order[i]]
            k, start, silent = k + 1, 0, False

    def _read_window(self, k: int, count_skips: bool) -> list[Candidate]:
        job = self.job
        log_ = self.skips if count_skips else SkipLog(0)
        start, length = window_span(k, self.chunk_len, job.layout.window, self.n_rank)
        runs = worker_runs(
            job.seq,
            job.segment,
            self.rank_lo,
            self.n_rank,
            self.chunk_start,
            self.chunk_len,
            start,
            length,
            self.borrowed,
            job.quiet,
        )
        items, offset = [], 0  # offset: of the run's first position in the window
        for run in runs:
            shard = int(job.seq.slots[run.slot])
            name, skip = job.shard_names[shard], job.skip[shard]
            # only the position's owner counts its skips: a wrapped or refill read repeats positions whose
            # skips were (or will be) counted once this epoch by the worker whose chunk holds them; reading a quiet
            # position counted what it counts before a resume at another layout
            run_log = SkipLog(0) if run.wrapped or run.quiet else log_
            run_offset, offset = offset, offset + run.count
            for raw in self._read_run(shard, run.ordinal, run.count, run_log):
                # listed by position (int), or by key (str) in a manifest that names keys only
                listed = skip.get(raw.ordinal) or skip.get(raw.key)
                if listed is not None:
                    self._skip(run_log, listed[0], name, raw.key, listed[1] + " (listed in manifest)")
                    continue
                cand, reason, detail = check_sample(
                    raw,
                    job.data_size,
                    job.index_base[shard],
                    job.tokenizer is not None,
                    job.index_offset[shard],
                    job.index_span[shard],
                )
                if cand is not None and not self._owns(shard, raw.ordinal, cand.index):
                    reason = "duplicate_index"
                    detail = (
                        f"index {cand.index} already served this epoch from another sample (`fastclip data "
                        f"scan` names both)"
                    )
                    cand = None
                if cand is None:
                    self._skip(run_log, reason, name, raw.key, detail)
                    continue
                cand.shard, cand.wrapped = name, run.wrapped
                cand.offset = run_offset + raw.ordinal - run.ordinal
                items.append(cand)
        if start < self.chunk_len:  # a window of the worker's own chunk: which of its samples are bad (plan.remainder)
            good = {c.offset for c in items}
            self.bad += [(k, o) for o in range(length) if o not in good]
        return items

    def _owns(self, shard: int, ordinal: int, index: int) -> bool:
        """Whether the sample at (shard, ordinal) is the one serving `index` this epoch (claiming it if free)."""
        bits = self.owners.get(shard)
        if bits is None or len(bits) * 8 <= ordinal:
            bits = self.owners[shard] = (bits or bytearray()) + bytearray(
                max(self.job.shard_sizes[shard], ordinal + 1) // 8 + 1 - len(bits or b"")
            )
        byte, bit = ordinal >> 3, 1 << (ordinal & 7)
        if bits[byte] & bit:
            return True
        if self.seen.add(index):
            bits[byte] |= bit
            return True
        return False

    def _read_run(self, shard: int, ordinal: int, count: int, log_: SkipLog):
        """Samples [ordinal, ordinal+count) of a shard; lost ones (broken tar) are counted, not yielded."""
        name = self.job.shard_names[shard]
        if shard in self.known_len:
            readable, reason, last_key = self.known_len[shard]
            lost = ordinal + count - max(ordinal, readable)
            if lost > 0:
                self._skip(log_, reason, name, last_key, self._broken(shard, readable, reason), lost)
                count -= lost
        if count <= 0:
            return
        reader = self._reader(shard, ordinal)
        why = self.open_errors.get(shard)
        got = 0
        try:
            if reader is not None and reader.skip_to(ordinal):
                while got < count:
                    raw = reader.next_group()
                    if raw is None:
                        break
                    got += 1
                    yield raw
            if got < count:  # a complete tar (it ends with its end-of-archive block) with fewer samples
                readable = reader.ordinal if reader is not None else 0
                reason = MANIFEST_MISMATCH if reader is not None else "unreadable_shard"
                last_key = reader.last_key if reader is not None else None
                self.known_len.setdefault(shard, (readable, reason, last_key))
                detail = self._broken(shard, readable, reason) + (f": {why}" if reader is None and why else "")
                self._skip(log_, reason, name, last_key, detail, count - got)
            elif ordinal + count == self.job.shard_sizes[shard]:  # read to the manifest's end: is the tar longer?
                self._count_unlisted(shard, reader, log_)
        except TarBroken as e:
            self.known_len[shard] = (reader.ordinal, "truncated_tar", reader.last_key)
            self._drop_reader()
            self._skip(
                log_, "truncated_tar", name, reader.last_key, f"{self._broken(shard, reader.ordinal)}: {e}", count - got
            )

    def _count_unlisted(self, shard: int, reader: ShardReader, log_: SkipLog) -> None:
        """Samples after the manifest's count (headers only) are never served: counted, not silently lost."""
        listed, last_key = self.job.shard_sizes[shard], reader.last_key
        try:
            while reader.next_group(load=False) is not None:
                pass
        except TarBroken:
            pass  # the samples before the break are what the manifest leaves out
        self._drop_reader()  # at the tar's end (or its break): the shard's listed samples are all served
        if reader.ordinal > listed:
            name = self.job.shard_names[shard]
            detail = self._broken(shard, reader.ordinal, MANIFEST_MISMATCH)
            self._skip(log_, MANIFEST_MISMATCH, name, last_key, detail, reader.ordinal - listed)

    def _broken(self, shard: int, readable: int, reason: str = "truncated_tar") -> str:
        listed = self.job.shard_sizes[shard]
        if reason == MANIFEST_MISMATCH:
            return (
                f"the manifest disagrees with shard {self.job.shard_names[shard]} ({listed} listed vs {readable} "
                f"samples in the tar): rerun fastclip data scan on its folder"
            )
        return f"{readable} of {listed} samples readable"

    def _reader(self, shard: int, ordinal: int) -> ShardReader | None:
        if self.reader is not None and self.reader[0] == shard and self.reader[1].ordinal <= ordinal:
            return self.reader[1]  # continue sequentially: the common case inside a shard
        self._drop_reader()
        path = self.job.shard_paths[shard]
        try:
            self.reader = (shard, ShardReader(path, _WANT, self.job.retry_delays))
        except TarBroken as e:  # kept for the skip's detail: a remote shard's URL and stderr tail
            self.open_errors[shard] = str(e)
            if is_remote(path):  # given up (after its retries, if it was allowed any): samples skipped
                self.remote["remote_retries"] += e.retries
                self.remote["remote_shards_skipped"] += 1
            return None
        self.remote["remote_retries"] += self.reader[1].retries
        return self.reader[1]

    def _drop_reader(self) -> None:
        if self.reader is not None:
            self.reader[1].close()
            self.reader = None


@contextlib.contextmanager
def _seeded_rngs(*words: int):
    """Seed the global RNGs that transforms draw from (torch CPU, random, numpy) for one batch, then restore
    them, so augmentations are a function of the batch and the caller's RNG streams are untouched."""
    seed = int(rng_for(*words).integers(2**62))
    gen = torch.random.default_generator  # CPU only: never touch the trainer's CUDA RNG
    saved = gen.get_state(), random.getstate(), np.random.get_state()
    gen.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        gen.set_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])
